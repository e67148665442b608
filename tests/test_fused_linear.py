"""The fused few-row projection kernels (interpret mode) against float64 numpy, and their references."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxmtp.pallas.matmul import fused_triton, linear_residual, norm_linear
from jaxmtp.pallas.matmul.reference import linear_residual_reference, norm_linear_reference

EPS = 1e-6


def _np_rms(x, w, eps=EPS):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _draw(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("swiglu", [False, True])
def test_norm_linear_kernel_matches_float64(m, swiglu):
    rng = np.random.default_rng(m + 10 * swiglu)
    k, n, pad = 256, 128, 64  # SwiGLU: gate | up | zero padding, as the serving layout stores it
    x, nw = _draw(rng, m, k, scale=2.0), _draw(rng, k, scale=0.1)
    w = _draw(rng, k, 2 * n + pad if swiglu else n, scale=0.05)
    width = n if swiglu else None
    got = fused_triton.norm_linear_triton(jnp.asarray(x), jnp.asarray(nw), jnp.asarray(w), eps=EPS,
                                          swiglu_width=width, block_n=64, block_k=128, interpret=True)
    y = _np_rms(x.astype(np.float64), nw.astype(np.float64)) @ w.astype(np.float64)
    want = _silu(y[:, :n]) * y[:, n : 2 * n] if swiglu else y
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
    ref = norm_linear_reference(jnp.asarray(x), jnp.asarray(nw), jnp.asarray(w), eps=EPS, swiglu_width=width)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=2e-5, atol=2e-5)


def test_norm_linear_bf16_rounding_close_to_reference():
    rng = np.random.default_rng(7)
    k, n, m = 256, 128, 4
    x = jnp.asarray(_draw(rng, 2, m // 2, k, scale=3.0), jnp.bfloat16)
    nw = jnp.asarray(_draw(rng, k, scale=0.1))
    w = jnp.asarray(_draw(rng, k, 2 * n, scale=0.05), jnp.bfloat16)
    got = norm_linear(x, nw, w, eps=EPS, swiglu_width=n, implementation="triton_interpret")
    assert got.shape == (2, m // 2, n) and got.dtype == jnp.bfloat16
    y = _np_rms(_f64(x), _f64(nw)) @ _f64(w)
    want = _silu(y[..., :n]) * y[..., n:]
    scale = np.max(np.abs(want))
    err = np.max(np.abs(_f64(got) - want)) / scale
    ref_err = np.max(np.abs(_f64(norm_linear_reference(x, nw, w, eps=EPS, swiglu_width=n)) - want)) / scale
    assert err < 2e-2 and err < 3 * ref_err + 1e-3, (err, ref_err)


@pytest.mark.parametrize("m", [1, 4, 6])
@pytest.mark.parametrize("prologue", ["none", "gated_rms", "sigmoid_gate"])
def test_linear_residual_kernel_matches_float64(m, prologue):
    rng = np.random.default_rng(m + {"none": 0, "gated_rms": 100, "sigmoid_gate": 200}[prologue])
    k, n, d, off = 256, 64, 64, 32
    x, w_t, res = _draw(rng, m, k), _draw(rng, n, k, scale=0.05), _draw(rng, m, n)
    x64 = x.astype(np.float64)
    aux = ()
    if prologue == "gated_rms":
        z_src, nw = _draw(rng, m, off + k + 16), _draw(rng, d, scale=0.5)
        aux = (jnp.asarray(z_src), jnp.asarray(nw))
        heads = x64.reshape(m, k // d, d)
        z = z_src[:, off : off + k].astype(np.float64).reshape(m, k // d, d)
        inp = (heads / np.sqrt(np.mean(heads**2, -1, keepdims=True) + EPS) * nw * _silu(z)).reshape(m, k)
    elif prologue == "sigmoid_gate":
        qg = _draw(rng, m, 2 * k + 32)
        aux = (jnp.asarray(qg),)
        gate = qg[:, : 2 * k].astype(np.float64).reshape(m, k // d, 2 * d)[..., d:].reshape(m, k)
        inp = x64 / (1.0 + np.exp(-gate))
    else:
        inp = x64
    want = res + inp @ w_t.astype(np.float64).T
    kw = dict(prologue=prologue, aux_offset=off if prologue == "gated_rms" else 0, head_dim=d, eps=EPS)
    got = fused_triton.linear_residual_triton(jnp.asarray(x), jnp.asarray(w_t), jnp.asarray(res), aux, block_n=16,
                                              block_k=128, sub_k=64, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
    ref = linear_residual_reference(jnp.asarray(x), jnp.asarray(w_t), jnp.asarray(res), aux, **kw)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=2e-5, atol=2e-5)
    disp = linear_residual(jnp.asarray(x)[None], jnp.asarray(w_t), jnp.asarray(res)[None],
                           tuple(a[None] if a.ndim == 2 else a for a in aux), implementation="triton_interpret", **kw)
    np.testing.assert_allclose(np.asarray(disp[0], np.float64), want, rtol=2e-5, atol=2e-5)


def test_unsupported_rows_fall_back_to_reference():
    rng = np.random.default_rng(3)
    x = jnp.asarray(_draw(rng, fused_triton.MAX_ROWS + 1, 128))
    nw, w = jnp.asarray(_draw(rng, 128, scale=0.1)), jnp.asarray(_draw(rng, 128, 64, scale=0.05))
    got = norm_linear(x, nw, w, eps=EPS, implementation="triton_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(norm_linear_reference(x, nw, w, eps=EPS)), rtol=1e-6)
    with pytest.raises(ValueError, match="unsupported"):
        fused_triton.norm_linear_triton(x, nw, w, eps=EPS, interpret=True)


# ---------------------------------------------------------------------------------------------------------------
# The model with fused blocks (serving layout, interpreter) against the unfused XLA path on the native layout
# ---------------------------------------------------------------------------------------------------------------
import functools  # noqa: E402

from jaxmtp.config import FULL, LINEAR, Qwen35Config  # noqa: E402
from jaxmtp.model import forward, init_carry, init_mtp_carry, init_params, mtp_forward, use_fused_blocks  # noqa: E402
from jaxmtp.pallas import XLA, Backend  # noqa: E402
from jaxmtp.param_layout import native_layout, serving_layout  # noqa: E402


def _model_config(moe: bool) -> Qwen35Config:
    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, moe_layers=(True, True, True)) if moe else {}
    return Qwen35Config(
        family="qwen3_5_moe" if moe else "qwen3_5", vocab_size=96, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, layer_types=(LINEAR, FULL, LINEAR),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        intermediate_size=80, mtp_num_hidden_layers=1, **extra)


@pytest.mark.parametrize("moe", [False, True])
def test_fused_blocks_give_the_unfused_model(rng, monkeypatch, moe):
    calls = {"norm_linear": 0, "linear_residual": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    for name in calls:  # the kernels must run, not the dispatcher's fallback
        monkeypatch.setattr(fused_triton, f"{name}_triton", counted(name, getattr(fused_triton, f"{name}_triton")))
    cfg = _model_config(moe)
    native = init_params(cfg, jax.random.key(11), jnp.float32, scale=0.1)
    serving = serving_layout(jax.tree.map(lambda a: a, native), draft_head=False)
    assert "out_proj_t" in serving["layers"][0]["linear_attn"] and "o_proj_t" in serving["layers"][1]["self_attn"]
    np.testing.assert_array_equal(np.asarray(native_layout(serving, cfg)["layers"][1]["self_attn"]["o_proj"]),
                                  np.asarray(native["layers"][1]["self_attn"]["o_proj"]))
    interp = "triton_interpret"
    fused = Backend(blocks=interp, gdn_mixer=interp, gdn_recurrent=interp)
    b, t0, cap = 2, 9, 20
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t0 + 4)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t0 + 4, dtype=jnp.int32), ids.shape)
    assert use_fused_blocks(serving, fused, 8) and not use_fused_blocks(native, fused, 8)
    assert not use_fused_blocks(serving, fused, 17) and not use_fused_blocks(serving, XLA, 1)

    def run(params, backend):
        fwd = functools.partial(forward, cfg=cfg, backend=backend)
        _, hidden, carry = fwd(params, ids[:, :t0], pos[:, :t0], init_carry(cfg, b, cap, jnp.float32), logits="none")
        dec, _, carry = fwd(params, ids[:, t0:t0 + 1], pos[:, t0:t0 + 1], carry)  # 2 rows: fused
        ver, _, steps = fwd(params, ids[:, t0 + 1:], pos[:, t0 + 1:], carry, step_states=True)  # 6 rows: fused
        mtp, _, _ = mtp_forward(params, ids[:, t0 + 1:], hidden[:, -3:], pos[:, t0 - 2:t0 + 1],
                                init_mtp_carry(cfg, b, cap, jnp.float32), cfg=cfg, backend=backend)
        return dec, ver, steps[0].states, steps[0].conv_inputs, mtp

    got_all = run(serving, fused)
    # the decode and the verify run 3 blocks each and the MTP pass 1, each block through 2 norm_linear and 2
    # linear_residual kernels (1 and 1 with a MoE MLP)
    per_block = 1 if moe else 2
    assert calls["norm_linear"] == calls["linear_residual"] == (2 * cfg.num_hidden_layers + 1) * per_block, calls
    for got, want in zip(got_all, run(native, XLA)):
        assert np.abs(np.asarray(want)).max() > 0.1
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-5, rtol=0)
