"""A small random Qwen3.5 model runs prefill, decode and verify (step states) with the Triton kernels (interpret
mode) and matches the XLA path; plus the backend registry."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.config import FULL, LINEAR, Qwen35Config
from jaxmtp.layers.gated_deltanet import GDNCarry
from jaxmtp.model import commit_window, forward, init_carry, init_params
from jaxmtp.pallas import XLA, Backend, KernelPolicy, auto_backend as _auto_backend, override_backend, resolve_backend
import jaxmtp.pallas.matmul as matmul_mod
from jaxmtp.pallas._common import SplitSum
from jaxmtp.param_layout import fuse_projections, set_output_layout, transposes_outputs


def small_config():
    return Qwen35Config(
        family="qwen3_5", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, layer_types=(LINEAR, FULL), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=96,
    )


# the checkpoint layout with kernels is not a served path (jaxmtp.load always fuses): slow, out of the CI suite
@pytest.mark.parametrize("layout", [pytest.param("native", marks=pytest.mark.slow), "fused", "transposed", "split"])
def test_model_with_kernels_matches_xla(rng, monkeypatch, layout):
    """With fused projections (the serving layout) the one-kernel GDN mixer (its conv ring updated in place) and the
    attention prelude / epilogue kernels run too; with the output projections transposed also the one-row output
    kernel (SwiGLU folded into down_proj), here for the two-row decode step, against the XLA path on [K, N]
    weights. ``split``: the verify window's out_proj / o_proj / down_proj return split-K partial sums that the add +
    norm kernel adds (checked by counting them)."""
    kind = "triton_interpret"  # the GPU path; the TPU kernels are checked op by op (never picked automatically)
    cfg = small_config()
    policy = KernelPolicy()
    if layout == "transposed":  # the output kernel needs K (attention 128, GDN Hv * dv, MLP I) a multiple of 128
        cfg = dataclasses.replace(cfg, intermediate_size=128, linear_value_head_dim=32)
        policy = KernelPolicy(output_gemv_max_rows=2)
    split_products = []
    if layout == "split":  # K = 256 for every output product: two or more splits along K
        cfg = dataclasses.replace(cfg, intermediate_size=256, linear_value_head_dim=64, head_dim=64)
        policy = KernelPolicy(output_split_max_rows=8)  # the verify window: 2 rows x 4 tokens
        real = matmul_mod.skinny_matmul_triton

        def spy(*a, **k):
            out = real(*a, **k)
            split_products.append(isinstance(out, SplitSum))
            return out

        monkeypatch.setattr(matmul_mod, "skinny_matmul_triton", spy)
        layout = "transposed"
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.1)
    kernels = Backend(attention=kind, gdn_chunk=kind, gdn_recurrent=kind, policy=policy)
    kernel_params = params
    if layout != "native":
        params = fuse_projections(params)
        kernels = dataclasses.replace(kernels, gdn_mixer=kind, attention_prelude=kind, norm=kind)
        kernel_params = params
    if layout == "transposed":
        kernels = dataclasses.replace(kernels, out_matmul=kind)
        kernel_params = set_output_layout(jax.tree.map(lambda a: a, params), transposes_outputs(kernels))
        assert {"out_proj_t", "down_proj_t"} <= set(kernel_params["layers"][0]["linear_attn"]) | set(
            kernel_params["layers"][0]["mlp"]) and "o_proj_t" in kernel_params["layers"][1]["self_attn"]
    b, t0, cap = 2, 21, 32
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t0 + 5)), jnp.int32)
    pos = np.broadcast_to(np.arange(t0 + 5, dtype=np.int32), ids.shape).copy()
    pre_pos = pos[:, :t0].copy()
    pre_pos[1, 15:] = -1  # row 1 is shorter: right padding
    lens = np.array([t0, 15])

    def run(backend, params):
        fwd = jax.jit(functools.partial(forward, cfg=cfg, backend=backend), static_argnames="step_states")
        out = []
        logits, _, carry = fwd(params, ids[:, :t0], jnp.asarray(pre_pos), init_carry(cfg, b, cap, jnp.float32))
        out.append(logits)
        step_pos = jnp.asarray(lens[:, None], jnp.int32)
        logits, _, carry = fwd(params, ids[:, t0 : t0 + 1], step_pos, carry)  # decode
        out.append(logits)
        vpos = jnp.asarray(lens[:, None] + 1 + np.arange(4)[None], jnp.int32)
        logits, _, steps = fwd(params, ids[:, t0 + 1 : t0 + 5], vpos, carry, step_states=True)  # verify
        out.append(logits)
        n = jnp.asarray([4, 2], jnp.int32)  # accepted prefixes, every layer committed in one kernel launch
        states = [c.state for c in commit_window(steps, n, backend) if isinstance(c, GDNCarry)]
        return out, states

    got, got_states = run(kernels, kernel_params)
    want, want_states = run(XLA, params)
    mask = pre_pos >= 0
    np.testing.assert_allclose(np.asarray(got[0])[mask], np.asarray(want[0])[mask], atol=2e-4, rtol=0)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=0)
    for g, w in zip(got_states, want_states):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0)
    if split_products:  # out_proj (GDN layer), o_proj (attention layer), in the two-row decode step and the
        # eight-row verify window; down_proj (its SwiGLU formed by XLA first) in each layer too
        assert split_products == [True] * 8


def test_backend_registry():
    assert resolve_backend("xla") == XLA
    assert _auto_backend("cpu") == XLA
    assert _auto_backend("tpu") == XLA  # TPU kernels are unmeasured: never picked automatically
    gpu = _auto_backend("gpu")
    assert {gpu.attention, gpu.gdn_chunk, gpu.gdn_recurrent} <= {"xla", "triton"}
    assert gpu.moe in ("xla", "triton")
    small, large = small_config(), dataclasses.replace(small_config(), hidden_size=4096)
    assert _auto_backend("gpu", small).matmul == "triton"  # XLA's single-row products are slow at small hidden
    assert _auto_backend("gpu", large).matmul == "xla"
    assert _auto_backend("gpu", small).out_matmul == "triton" and _auto_backend("gpu", large).out_matmul == "xla"
    largest = dataclasses.replace(small, hidden_size=5120)  # int8 MTP layer up to the 9B's hidden size (measured)
    assert _auto_backend("gpu", large).mtp_matmul == "triton" and _auto_backend("gpu", largest).mtp_matmul == "xla"
    assert _auto_backend("cpu", small) == XLA
    real_heads = dataclasses.replace(small, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128)
    assert _auto_backend("gpu", real_heads, jnp.float32) == XLA  # kernels are tiled for 16-bit weights
    assert _auto_backend("gpu", small, jnp.float32).attention == gpu.attention  # small heads fit in float32
    assert _auto_backend("gpu", small, jnp.bfloat16).attention == gpu.attention
    with pytest.raises(ValueError):
        resolve_backend("fast")
    assert override_backend(gpu, "") == gpu
    assert override_backend(XLA, "norm=triton,gdn_mixer=triton") == Backend(norm="triton", gdn_mixer="triton")
    for bad in ("nrom=triton", "norm", "mixer_block_v=wide"):
        with pytest.raises(ValueError, match="gdn_mixer|integer"):  # the message lists the fields
            override_backend(XLA, bad)
    # kernel policy fields by name: the rest of the policy, and the implementations, stay as they were
    tuned = override_backend(gpu, "output_split_max_rows=1,mixer_block_v=16,num_sms=none")
    assert tuned.policy == dataclasses.replace(gpu.policy, output_split_max_rows=1, mixer_block_v=16, num_sms=None)
    assert dataclasses.replace(tuned, policy=gpu.policy) == gpu
    # thresholds that pick kernels by model size come from the policy too
    assert _auto_backend("gpu", large, policy=KernelPolicy(matmul_kernel_max_hidden=4096)).matmul == "triton"
