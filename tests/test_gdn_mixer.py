"""The one-kernel GDN mixer (Pallas Triton, run by the interpreter) against the unfused layer (XLA path): decode
with a padding row (output, state and conv window) and verify (replay inputs, then the commit of accepted prefixes),
GQA ratios 1 and 2, float32 and bfloat16, two and four v blocks per head. The layer's XLA path is itself checked against
transformers (test_parity_hf)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.config import FULL, LINEAR, Qwen35Config
from jaxmtp.layers.gated_deltanet import GDNCarry, GDNSteps, commit_steps, gated_deltanet
from jaxmtp.model import init_params
from jaxmtp.pallas import Backend, KernelPolicy
from jaxmtp.pallas.gated_delta_rule import use_fused_mixer
from jaxmtp.pallas.gated_delta_rule.mixer_reference import ring_update, window_from_ring
from jaxmtp.param_layout import fuse_projections


def _mixer(impl: str, bv: int = 32) -> Backend:
    """The fused mixer kernel (``impl``) or the unfused steps ("xla"), with BV = ``bv``."""
    return Backend(gdn_mixer=impl, policy=KernelPolicy(mixer_block_v=bv))


def _commit(steps, n, impl: str):
    return commit_steps((steps,), n, Backend(gdn_recurrent=impl))[0]


def _setup(rng, r, dtype):
    cfg = Qwen35Config(
        family="qwen3_5", vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=(LINEAR, FULL), linear_num_key_heads=2,
        linear_num_value_heads=2 * r, linear_key_head_dim=16, linear_value_head_dim=64, intermediate_size=32)
    params = fuse_projections(init_params(cfg, jax.random.key(r), dtype, scale=0.2))
    p = params["layers"][0]["linear_attn"]
    b = 3
    carry = GDNCarry(jnp.asarray(rng.standard_normal((b, cfg.linear_conv_kernel_dim, cfg.conv_dim)), dtype),
                     jnp.asarray(rng.standard_normal((b, 2 * r, 16, 64)) * 0.3, jnp.float32))
    return cfg, p, carry, b


STARTS = np.array([6, 0, 2])  # each row's first position (row 1 idle): the ring wraps differently per row


def _positions(valid):
    """Positions [B, T] of a right-padded window starting at STARTS (-1 on padding)."""
    valid = np.asarray(valid)
    return jnp.asarray(np.where(valid, STARTS[:, None] + np.arange(valid.shape[1]), -1), jnp.int32)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    assert np.abs(want).max() > 0.05
    tol = 2e-5 if dtype == jnp.float32 else 2.5e-2
    np.testing.assert_allclose(got, want, atol=tol * max(1.0, np.abs(want).max()), rtol=0)


@pytest.mark.parametrize("r,bv", [(1, 32), (2, 16)])  # BV: the dv slice per program (dv = 64 here)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_step_matches_the_unfused_layer(rng, r, bv, dtype):
    cfg, p, carry, b = _setup(rng, r, dtype)
    x = jnp.asarray(rng.standard_normal((b, 1, cfg.hidden_size)), dtype)
    valid = jnp.asarray([[True], [False], [True]])  # row 1 is an idle slot: its carry must not move
    policy = KernelPolicy(mixer_block_v=bv)
    assert use_fused_mixer(cfg, 1, "triton_interpret", policy) and not use_fused_mixer(cfg, 1, "xla", policy)
    run = lambda impl: gated_deltanet(p, cfg, x, _positions(valid), carry, form="recurrent",  # noqa: E731
                                        backend=_mixer(impl, bv))
    (y, c), (y_ref, c_ref) = run("triton_interpret"), run("xla")
    _close(y[jnp.asarray([0, 2])], y_ref[jnp.asarray([0, 2])], dtype)
    _close(c.state, c_ref.state, dtype)
    np.testing.assert_array_equal(np.asarray(c.conv), np.asarray(c_ref.conv))  # raw inputs: copied, not computed
    np.testing.assert_array_equal(np.asarray(c.conv[1]), np.asarray(carry.conv[1]))
    np.testing.assert_array_equal(np.asarray(c.state[1]), np.asarray(carry.state[1]))


@pytest.mark.parametrize("r,bv", [(1, 32), (2, 16)])  # BV: the dv slice per program (dv = 64 here)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_verify_step_states_match_the_unfused_layer(rng, r, bv, dtype):
    cfg, p, carry, b = _setup(rng, r, dtype)
    t = 4
    x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), dtype)
    valid = jnp.asarray([[True] * 4, [False] * 4, [True, True, True, False]])
    run = lambda impl: gated_deltanet(p, cfg, x, _positions(valid), carry, step_states=True,  # noqa: E731
                                        backend=_mixer(impl, bv))
    (y, s), (y_ref, s_ref) = run("triton_interpret"), run("xla")
    assert isinstance(s, GDNSteps)
    mask = np.asarray(valid)
    _close(np.asarray(y)[mask], np.asarray(y_ref)[mask], dtype)
    for got, want in [(s.k, s_ref.k), (s.v, s_ref.v), (s.g, s_ref.g), (s.beta, s_ref.beta)]:
        _close(got, want, dtype)
    np.testing.assert_array_equal(np.asarray(s.g)[~mask], 0.0)  # padding tokens: no decay, no write
    np.testing.assert_array_equal(np.asarray(s.beta)[~mask], 0.0)
    for got, want in [(s.ring, s_ref.ring), (s.inputs, s_ref.inputs), (s.start, s_ref.start)]:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    n = jnp.asarray([2, 0, 3], jnp.int32)  # accepted prefixes; row 1 (idle) commits nothing
    c, c_ref = _commit(s, n, "triton_interpret"), _commit(s_ref, n, "xla")
    _close(c.state, c_ref.state, dtype)
    np.testing.assert_array_equal(np.asarray(c.conv), np.asarray(c_ref.conv))
    np.testing.assert_array_equal(np.asarray(c.state[1]), np.asarray(carry.state[1]))
    # the committed carry is what a shorter window leaves (row 0: its first 2 tokens)
    row0 = jax.tree.map(lambda a: a[:1], carry)
    short = lambda impl: gated_deltanet(p, cfg, x[:1, :2], _positions(valid)[:1, :2], row0,  # noqa: E731
                                        form="recurrent", backend=_mixer(impl, bv))[1]
    _close(c.state[:1], short("triton_interpret").state, dtype)
    np.testing.assert_array_equal(np.asarray(c.conv[:1]), np.asarray(short("xla").conv))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_multi_token_final_window_matches_the_unfused_layer(rng, dtype):
    """T > 1 without step states (a short prefill chunk): the ring is written to a fresh buffer, every row."""
    cfg, p, carry, b = _setup(rng, 2, dtype)
    t = 3
    x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), dtype)
    valid = jnp.asarray([[True] * 3, [False] * 3, [True, True, False]])
    run = lambda impl: gated_deltanet(p, cfg, x, _positions(valid), carry, form="recurrent",  # noqa: E731
                                      backend=_mixer(impl))
    (y, c), (y_ref, c_ref) = run("triton_interpret"), run("xla")
    mask = np.asarray(valid)
    _close(np.asarray(y)[mask], np.asarray(y_ref)[mask], dtype)
    _close(c.state, c_ref.state, dtype)
    np.testing.assert_array_equal(np.asarray(c.conv), np.asarray(c_ref.conv))
    np.testing.assert_array_equal(np.asarray(c.conv[1]), np.asarray(carry.conv[1]))


def test_conv_ring_holds_the_last_inputs_by_position(rng):
    """ring_update / window_from_ring against a plain list of every raw input fed so far: after any sequence of
    windows (random lengths, padding, some empty), the window before position L is inputs L-3 .. L-1 (zeros before
    position 0)."""
    k, c, b = 4, 5, 3
    ring = jnp.zeros((b, k, c), jnp.float32)
    fed = [[] for _ in range(b)]
    length = np.zeros(b, np.int64)
    for _ in range(12):
        t = int(rng.integers(1, 7))
        n = rng.integers(0, t + 1, size=b)
        inputs = rng.standard_normal((b, t, c)).astype(np.float32)
        ring = ring_update(ring, jnp.asarray(inputs), jnp.asarray(length, jnp.int32), jnp.asarray(n, jnp.int32))
        for i in range(b):
            fed[i].extend(inputs[i, : n[i]])
        length += n
        window = np.asarray(window_from_ring(ring, jnp.asarray(length, jnp.int32)))
        for i in range(b):
            want = [fed[i][q] if q >= 0 else np.zeros(c, np.float32) for q in range(length[i] - k + 1, length[i])]
            np.testing.assert_array_equal(window[i], np.stack(want))
