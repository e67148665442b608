"""Cached-attention Pallas kernels (GPU Triton and TPU Mosaic variants, run by the Pallas interpreter) against the
jnp reference: GQA ratios 1, 2, 3, per-row lengths, padding rows, decode/verify/prefill windows, split-K, a cache
length that is no multiple of the kv block, stale rows past each position, float32 and bf16. Then the fused
gated-attention path (prelude and epilogue kernels around the Triton launch) against the jnp steps and the layer.

The interpreters fill output buffers with NaN before the kernel runs, so unwritten elements fail the check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.config import FULL, Qwen35Config
from jaxmtp.layers.attention import KVCache, gated_attention
from jaxmtp.pallas import Backend
from jaxmtp.pallas.attention.rope import rope_angles, rope_inv_freq
from jaxmtp.param_layout import fuse_projections
from jaxmtp.pallas.attention import (attention_reference, cached_attention, fused_gated_attention,
                                     output_gate_reference, prelude_reference, split_qkv)
from jaxmtp.pallas.attention.decode_triton import cached_attention_triton, combine_splits, pack_queries, unpack_rows
from jaxmtp.pallas.attention.prelude_triton import epilogue_triton, prelude_triton

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}


def make_inputs(rng, b, t, hq, hkv, d, s, dtype, starts, pad_last=False):
    """Window of t queries per row starting at ``starts[row]``; rows past each window hold stale garbage (1e3)."""
    q = rng.standard_normal((b, t, hq, d))
    kc = rng.standard_normal((b, hkv, s, d))
    vc = rng.standard_normal((b, hkv, s, d))
    pos = np.asarray(starts)[:, None] + np.arange(t)[None]
    for row in range(b):  # stale rows beyond the window must not be read
        kc[row, :, pos[row, -1] + 1 :] = 1e3
        vc[row, :, pos[row, -1] + 1 :] = 1e3
    if pad_last:
        pos[-1, -1] = -1  # padding query
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(kc), cast(vc), jnp.asarray(pos, jnp.int32)


def check(o, o_ref, pos, tol):
    o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
    assert np.isfinite(o).all(), "unwritten (NaN) or non-finite output elements"
    valid = np.asarray(pos)[:, :, None, None] >= 0
    diff, ref = np.where(valid, o - o_ref, 0), np.where(valid, o_ref, 0)
    err = np.linalg.norm(diff) / np.linalg.norm(ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


CASES = [
    # (t, hq, hkv, s, dtype, starts): decode, verify and a prefill-sized window
    (1, 4, 4, 88, jnp.float32, [0, 61, 87]),
    (3, 4, 2, 96, jnp.bfloat16, [5, 40, 90]),
    (5, 6, 2, 104, jnp.float32, [99, 17, 0]),
    (40, 6, 2, 120, jnp.float32, [0, 70, 31]),
]


@pytest.mark.parametrize("impl", ["triton_interpret", "mosaic_tpu_interpret"])
@pytest.mark.parametrize("t,hq,hkv,s,dtype,starts", CASES)
def test_cached_attention_matches_reference(rng, impl, t, hq, hkv, s, dtype, starts):
    starts = [min(x, s - t) for x in starts]
    q, kc, vc, pos = make_inputs(rng, 3, t, hq, hkv, 32, s, dtype, starts, pad_last=True)
    o = cached_attention(q, kc, vc, pos, implementation=impl)
    assert o.shape == q.shape and o.dtype == q.dtype
    check(o, attention_reference(q, kc, vc, pos), pos, TOL[dtype])


@pytest.mark.parametrize("n_split,block_kv", [(1, 16), (3, 16), (8, 32)])
def test_triton_splits_and_blocks(rng, n_split, block_kv):
    """Split-K with more splits than valid blocks, and a last block shifted back to end at S."""
    q, kc, vc, pos = make_inputs(rng, 2, 2, 8, 2, 16, 70, jnp.float32, [3, 60])
    o = cached_attention_triton(q, kc, vc, pos, n_split=n_split, block_kv=block_kv, interpret=True)
    check(o, attention_reference(q, kc, vc, pos), pos, TOL[jnp.float32])


def test_unsupported_shapes_fall_back(rng):
    q, kc, vc, pos = make_inputs(rng, 1, 1, 2, 1, 12, 10, jnp.float32, [4])  # head_dim 12, 10 cache rows
    for impl in ("triton_interpret", "mosaic_tpu_interpret"):
        o = cached_attention(q, kc, vc, pos, implementation=impl)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(attention_reference(q, kc, vc, pos)))


@pytest.mark.parametrize("impl,platform", [("triton", "cuda"), ("mosaic_tpu", "tpu")])
@pytest.mark.parametrize("t", [1, 5, 512])
def test_kernels_lower_at_model_shapes(impl, platform, t):
    """Qwen3.5 shapes (head_dim 256, 24/2 heads, 32k cache) lower for their platform without a device."""
    sds = jax.ShapeDtypeStruct
    args = (sds((2, t, 24, 256), jnp.bfloat16), sds((2, 2, 32768, 256), jnp.bfloat16),
            sds((2, 2, 32768, 256), jnp.bfloat16), sds((2, t), jnp.int32))
    fn = lambda *a: cached_attention(*a, implementation=impl)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)


# ---------------------------------------------------------------------------------------------------------------
# Fused gated attention: prelude + attention launch + epilogue
# ---------------------------------------------------------------------------------------------------------------
def assert_close(got, want, dtype, what):
    """float32: tight; bf16: within one rounding step of the output (the kernels sum in another order)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), f"{what}: unwritten (NaN) or non-finite elements"
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


def fused_inputs(rng, b, t, hq, hkv, d, rd, s, dtype, positions, pad_cols=0):
    """Random fused projection (``pad_cols`` columns of zero padding), norms, rotary frequencies and caches."""
    proj = jnp.asarray(rng.standard_normal((b, t, 2 * (hq + hkv) * d + pad_cols)), dtype)
    if pad_cols:
        proj = proj.at[..., -pad_cols:].set(0)
    q_norm, k_norm = (jnp.asarray(0.3 * rng.standard_normal(d), jnp.float32) for _ in range(2))
    pos = jnp.asarray(positions, jnp.int32)
    kc, vc = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype) for _ in range(2))
    return proj, q_norm, k_norm, jnp.asarray(rope_inv_freq(rd, 10_000.0)), kc, vc, pos


PRELUDE_CASES = [
    # (t, hq, hkv, d, rotary_dim, dtype, positions): decode with an idle row, verify windows with padding tokens
    (1, 4, 2, 32, 8, jnp.bfloat16, [[7], [-1]]),
    (1, 6, 2, 16, 16, jnp.float32, [[0], [37]]),
    (4, 6, 2, 32, 8, jnp.bfloat16, [[3, 4, 5, 6], [30, 31, -1, -1]]),
    (4, 2, 2, 16, 4, jnp.float32, [[36, 37, 38, 39], [0, 1, 2, -1]]),
]


@pytest.mark.parametrize("t,hq,hkv,d,rd,dtype,positions", PRELUDE_CASES)
def test_prelude_matches_reference(rng, t, hq, hkv, d, rd, dtype, positions):
    b, s, mp = 2, 40, 16
    args = fused_inputs(rng, b, t, hq, hkv, d, rd, s, dtype, positions, pad_cols=32)
    kw = dict(hq=hq, hkv=hkv, d=d, eps=1e-6)
    qr, pos, kc, vc = prelude_triton(*args, **kw, mp=mp, interpret=True)
    cos, sin = rope_angles(jnp.maximum(args[-1], 0), rd, 10_000.0)  # the tables the kernel forms itself
    q_ref, _, kc_ref, vc_ref = prelude_reference(*split_qkv(args[0], hq=hq, hkv=hkv, d=d), *args[1:3], cos, sin,
                                                 *args[4:], **kw)
    qr_ref, pos_ref = pack_queries(q_ref, args[-1], hkv, mp)
    assert qr.shape == qr_ref.shape and qr.dtype == dtype
    assert_close(qr, qr_ref, dtype, "packed q")
    np.testing.assert_array_equal(np.asarray(pos), np.asarray(pos_ref))
    written = np.zeros((b, s), bool)
    for row, p in zip(*np.nonzero(np.asarray(positions) >= 0)):
        written[row, positions[row][p]] = True
    for got, want, old, name in ((kc, kc_ref, args[4], "k cache"), (vc, vc_ref, args[5], "v cache")):
        assert_close(got, want, dtype, name)
        changed = (np.asarray(got, np.float32) != np.asarray(old, np.float32)).any(axis=(1, 3))
        assert not (changed & ~written).any(), f"{name}: rows changed that no valid token writes"


@pytest.mark.parametrize("n_split", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_epilogue_matches_combine_and_gate(rng, n_split, dtype):
    b, t, hq, hkv, d, mp = 2, 3, 6, 2, 16, 16
    proj = jnp.asarray(rng.standard_normal((b, t, 2 * (hq + hkv) * d)), dtype)
    if n_split == 1:
        outs = (jnp.asarray(rng.standard_normal((b, hkv, mp, d)), dtype),)
        o = outs[0]
    else:
        m = rng.standard_normal((b, hkv, n_split, mp))
        l = rng.uniform(0.5, 3.0, (b, hkv, n_split, mp))
        m[..., 1, :], l[..., 1, :] = -1e30, 0.0  # a split that saw no kv block
        m[0, 1, :, 5], l[0, 1, :, 5] = -1e30, 0.0  # a row that saw nothing at all
        outs = tuple(jnp.asarray(a, jnp.float32) for a in (rng.standard_normal((b, hkv, n_split, mp, d)), m, l))
        o = combine_splits(*outs)
    y = epilogue_triton(outs, proj, hq=hq, d=d, interpret=True)
    gate = proj[..., : hq * 2 * d].reshape(b, t, hq, 2 * d)[..., d:].reshape(b, t, hq * d)
    want = output_gate_reference(unpack_rows(o, t, hq).astype(dtype), gate)
    assert y.shape == want.shape and y.dtype == dtype
    assert_close(y, want, dtype, "y")
    rows = jnp.asarray([2, 0], jnp.int32)  # one token's row per window: the same values, nothing else written
    one = epilogue_triton(outs, proj, rows, hq=hq, d=d, interpret=True)
    assert one.shape == (b, 1, hq * d)
    np.testing.assert_array_equal(np.asarray(one, np.float32)[:, 0],
                                  np.asarray(y, np.float32)[np.arange(b), np.asarray(rows)])


def attention_layer(rng, cfg, dtype):
    """Random attention weights of ``cfg`` in the serving layout (fused ``qkv_proj``, zero-padded columns)."""
    h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    w = lambda *shape: jnp.asarray(0.2 * rng.standard_normal(shape), dtype)  # noqa: E731
    p = {"q_proj": w(h, hq * 2 * d), "k_proj": w(h, hkv * d), "v_proj": w(h, hkv * d), "o_proj": w(hq * d, h),
         "q_norm": w(d), "k_norm": w(d)}
    return fuse_projections(p)


@pytest.mark.parametrize("t,dtype", [(1, jnp.float32), (4, jnp.bfloat16)])
def test_gated_attention_with_fused_prelude_matches_xla(rng, t, dtype):
    cfg = Qwen35Config(family="qwen3_5", vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, layer_types=(FULL,))
    p = attention_layer(rng, cfg, dtype)
    assert p["qkv_proj"].shape[1] % 128 == 0 and p["qkv_proj"].shape[1] > 2 * (4 + 2) * 16  # padded columns
    b, s = 2, 24
    x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), dtype)
    positions = np.array([[5 + i for i in range(t)], [20 + i for i in range(t)]], np.int32)
    positions[1, -1] = -1  # a padding token (t = 1: an idle row)
    positions = jnp.asarray(positions)
    cache = KVCache(*(jnp.asarray(rng.standard_normal((b, 2, s, 16)), dtype) for _ in range(2)))
    kernels = Backend(attention="triton_interpret", attention_prelude="triton_interpret")
    y, got = gated_attention(p, cfg, x, positions, cache, backend=kernels)
    y_ref, want = gated_attention(p, cfg, x, positions, cache)
    valid = np.asarray(positions) >= 0
    assert_close(np.asarray(y, np.float32)[valid], np.asarray(y_ref, np.float32)[valid], dtype, "layer output")
    assert_close(got.k, want.k, dtype, "k cache")
    np.testing.assert_array_equal(np.asarray(got.v), np.asarray(want.v))
    rows = jnp.asarray([t - 1, 0], jnp.int32)  # a window's pass: o_proj on one row, every row into the cache
    y1, got1 = gated_attention(p, cfg, x, positions, cache, backend=kernels, out_rows=rows)
    assert y1.shape == (b, 1, cfg.num_attention_heads * cfg.head_dim)
    np.testing.assert_array_equal(np.asarray(y1, np.float32)[:, 0],
                                  np.asarray(y, np.float32)[np.arange(b), np.asarray(rows)])
    np.testing.assert_array_equal(np.asarray(got1.k), np.asarray(got.k))


@pytest.mark.parametrize("d,rd,s,t", [(12, 4, 10, 1), (32, 12, 24, 2), (16, 4, 40, 17)])
def test_fused_gated_attention_falls_back(rng, d, rd, s, t):
    """head_dim not a power of two (attention falls back too), rotary dim not a power of two, T > MAX_TOKENS."""
    positions = np.arange(t)[None].repeat(2, 0) + np.array([[0], [s - t]])
    args = fused_inputs(rng, 2, t, 4, 2, d, rd, s, jnp.float32, positions)
    kw = dict(hq=4, hkv=2, d=d, eps=1e-6)
    got = fused_gated_attention(*args, **kw, implementation="triton_interpret")
    want = fused_gated_attention(*args, **kw, implementation="xla", attention="triton_interpret")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("t,one_row", [(1, False), (4, False), (3, True)])
def test_fused_gated_attention_lowers_at_model_shapes(t, one_row):
    """Qwen3.5 27B attention shapes (24/4 heads, head_dim 256, rotary dim 64, 32k cache) lower for CUDA: three
    Triton launches (prelude, attention, epilogue; with ``out_rows`` the epilogue picks the row)."""
    sds = jax.ShapeDtypeStruct
    b, hq, hkv, d, rd, s = 1, 24, 4, 256, 64, 32768
    bf16 = jnp.bfloat16
    args = (sds((b, t, 2 * (hq + hkv) * d), bf16), sds((d,), jnp.float32), sds((d,), jnp.float32),
            sds((rd // 2,), jnp.float32), sds((b, hkv, s, d), bf16),
            sds((b, hkv, s, d), bf16), sds((b, t), jnp.int32))
    rows = jnp.zeros((b,), jnp.int32) if one_row else None
    fn = lambda *a: fused_gated_attention(*a, hq=hq, hkv=hkv, d=d, eps=1e-6, implementation="triton",  # noqa: E731
                                          out_rows=rows)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
