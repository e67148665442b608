"""Cached-attention Pallas kernels (GPU Triton and TPU Mosaic variants, run by the Pallas interpreter) against the
jnp reference: GQA ratios 1, 2, 3, per-row lengths, padding rows, decode/verify/prefill windows, split-K, a cache
length that is no multiple of the kv block, stale rows past each position, float32 and bf16; prefill chunks whose
tiles span unmasked and masked kv blocks under several tile settings, and the launch plan the policy selects. Then
the fused gated-attention path (prelude and epilogue kernels around the Triton launch, up to more than 32 splits)
against the jnp steps and the layer.

The interpreters fill output buffers with NaN before the kernel runs, so unwritten elements fail the check.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.config import FULL, Qwen35Config
from jaxmtp.layers.attention import KVCache, gated_attention
from jaxmtp.pallas import Backend, KernelPolicy
from jaxmtp.pallas import ops
from jaxmtp.pallas.attention.rope import rope_angles, rope_inv_freq
from jaxmtp.param_layout import fuse_projections
from jaxmtp.pallas.attention import (attention_reference, cached_attention, fused_gated_attention,
                                     output_gate_reference, prelude_reference, split_qkv)
from jaxmtp.pallas.attention.decode_triton import (Plan, cached_attention_triton, combine_splits, kv_ranges,
                                                   launch_plan, pack_queries, unpack_rows)
from jaxmtp.pallas.attention.prelude_triton import epilogue_triton, fused_splits, gated_attention_triton, prelude_triton

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


def test_reference_matches_float64_with_one_query_row_per_kv_head(rng):
    """The jnp reference's decode window with as many query heads as kv heads (computed with each head twice, so that
    its products stay matrix products) against float64 attention, per row over positions 0..p only."""
    q, kc, vc, pos = make_inputs(rng, 3, 1, 2, 2, 16, 40, jnp.float32, [0, 23, 39])
    o = np.asarray(attention_reference(q, kc, vc, pos), np.float64)
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, kc, vc))
    for row, p in enumerate(np.asarray(pos)[:, 0]):
        for h in range(2):
            sc = k64[row, h, : p + 1] @ q64[row, 0, h] / 4.0
            w = np.exp(sc - sc.max())
            np.testing.assert_allclose(o[row, 0, h], w @ v64[row, h, : p + 1] / w.sum(), rtol=1e-5, atol=1e-6)


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


PREFILL_CASES = [
    # (b, t, hq, hkv, s, starts, dtype, tiles (block_rows, block_kv, num_warps, num_stages)): chunks at offsets inside
    # larger caches (stale rows past them), T * G no multiple of the row tile, S no multiple of the kv block,
    # ragged offsets across the batch, a padding token inside a window and one at its end
    (2, 37, 3, 1, 150, [100, 0], jnp.float32, (16, 16, 4, 3)),
    (2, 29, 4, 2, 131, [64, 99], jnp.bfloat16, (32, 32, 4, 2)),
    (1, 40, 2, 2, 100, [50], jnp.float32, (64, 16, 8, 3)),
    (2, 21, 6, 2, 90, [69, 31], jnp.float32, (32, 64, 4, 3)),
]


@pytest.mark.parametrize("b,t,hq,hkv,s,starts,dtype,tiles", PREFILL_CASES)
def test_prefill_tiles_match_reference(rng, b, t, hq, hkv, s, starts, dtype, tiles):
    """Prefill chunks under explicit tiles: each tile's blocks below its lowest valid position run unmasked, the
    rest masked (the last one shifted back to end at S); padding tokens get zeros and leak into no row."""
    q, kc, vc, pos = make_inputs(rng, b, t, hq, hkv, 32, s, dtype, starts, pad_last=True)
    pos = pos.at[0, 3].set(-1)  # a padding token inside the first window
    bm, bs, nw, ns = tiles
    o = cached_attention_triton(q, kc, vc, pos, block_rows=bm, block_kv=bs, num_warps=nw, num_stages=ns,
                                interpret=True)
    check(o, attention_reference(q, kc, vc, pos), pos, TOL[dtype])
    assert not np.asarray(o, np.float32)[np.asarray(pos) < 0].any(), "padding tokens must give zeros"


def test_prefill_plan_through_ops_policy(rng):
    """The backend's policy reaches the kernel (``ops.cached_attention``): prefill tiles from
    ``attention_prefill_min_rows`` rows on, and the same output under another row tile and split-K."""
    q, kc, vc, pos = make_inputs(rng, 2, 23, 4, 2, 32, 120, jnp.float32, [80, 7], pad_last=True)
    policy = KernelPolicy(attention_prefill_min_rows=32, attention_prefill_block_rows=16,
                          attention_prefill_block_kv=32, attention_prefill_num_warps=2,
                          attention_prefill_num_stages=2, attention_split_waves=2, num_sms=4)
    assert launch_plan(2, 23, 4, 2, 120, policy) == Plan(16, 32, 1, 2, 2)
    backend = Backend(attention="triton_interpret", policy=policy)
    fn = lambda *a: ops.cached_attention(*a, backend)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(fn)(q, kc, vc, pos))
    assert "f32[2,2,48,32]" in jaxpr and "f32[2,2,64,32]" not in jaxpr  # 46 rows in 16-row tiles, not one of 64
    check(fn(q, kc, vc, pos), attention_reference(q, kc, vc, pos), pos, TOL[jnp.float32])
    o = cached_attention_triton(q, kc, vc, pos, block_rows=32, block_kv=16, n_split=3, interpret=True)
    check(o, attention_reference(q, kc, vc, pos), pos, TOL[jnp.float32])


def test_prefill_windows_on_hopper_choose_the_mosaic_kernel():
    """The policy sends a "triton" prefill window (>= ``attention_mosaic_min_tokens`` tokens, a 16-bit cache of
    whole 64-row blocks, head_dim a multiple of 64 up to 256) to the Mosaic GPU kernel on a Hopper GPU only; decode
    and verify windows, other GPUs, float32, odd shapes and the interpreters keep the Triton kernel (the Mosaic GPU
    kernel itself is checked on an H100: tests/test_gpu_checks.py)."""
    from jaxmtp.pallas.attention import use_mosaic_prefill

    sds = jax.ShapeDtypeStruct
    hopper = KernelPolicy(hopper=True)
    q = lambda t, d=256, dt=jnp.bfloat16: sds((2, t, 24, d), dt)  # noqa: E731
    cache = lambda s=4096, d=256, dt=jnp.bfloat16, hkv=4: sds((2, hkv, s, d), dt)  # noqa: E731
    assert use_mosaic_prefill(q(1024), cache(), hopper) and use_mosaic_prefill(q(128), cache(), hopper)
    assert use_mosaic_prefill(q(200, 128), cache(256, 128, hkv=2), hopper)
    assert not use_mosaic_prefill(q(1024), cache(), KernelPolicy(hopper=False))
    assert not use_mosaic_prefill(q(1024), cache(), KernelPolicy(hopper=True, attention_mosaic_min_tokens=None))
    for qq, cc in ((q(5), cache()), (q(127), cache()), (q(1024, dt=jnp.float32), cache(dt=jnp.float32)),
                   (q(1024), cache(s=4000)), (q(1024, 32), cache(d=32)), (q(1024, 512), cache(d=512))):
        assert not use_mosaic_prefill(qq, cc, hopper), (qq, cc)
    # the engine sizes KV rows in the kernel's whole 64-row blocks only where it can run
    from jaxmtp.engine.memory import kv_capacity

    assert hopper.kv_row_block("triton") == 64 and kv_capacity(8192, 3, 64) == 8256 and kv_capacity(8192, 3) == 8195
    for other, attention in ((KernelPolicy(hopper=False), "triton"), (hopper, "triton_interpret"), (hopper, "xla"),
                             (KernelPolicy(hopper=True, attention_mosaic_min_tokens=None), "triton")):
        assert other.kv_row_block(attention) == 1
    policy = KernelPolicy(hopper=True, attention_mosaic_min_tokens=16)  # the interpreter never takes it
    qv, kc, vc, pos = make_inputs(np.random.default_rng(0), 1, 20, 4, 2, 64, 64, jnp.bfloat16, [0], pad_last=False)
    out = cached_attention(qv, kc, vc, pos, implementation="triton_interpret", policy=policy)
    check(out, attention_reference(qv, kc, vc, pos), pos, TOL[jnp.bfloat16])


def test_kv_ranges_split_unmasked_and_masked_blocks():
    """Blocks wholly at or below every valid row's position are unmasked; padding rows do not shrink that range."""
    ranges = lambda pos, **kw: tuple(int(x) for x in kv_ranges(jnp.asarray(pos, jnp.int32), 16, 300, **kw))  # noqa
    assert ranges([100, 120, -1, -1]) == (0, 6, 6, 8)  # rows 0..95 unmasked; blocks 6, 7 masked
    assert ranges([-1, 100, 120, -1]) == (0, 6, 6, 8)
    assert ranges([5, 200, -1, 130]) == (0, 0, 0, 13)  # a row at 5: every block masked
    assert ranges([-1, -1]) == (0, 0, 0, 0)  # padding only: nothing read
    assert ranges([299, 299]) == (0, 18, 18, 19)  # the last block (shifted back to end at 300) stays masked
    assert ranges([100, 120], n_split=3, split=1) == (3, 6, 6, 6)  # split-K shares: 3 blocks each
    assert ranges([100, 120], n_split=3, split=2) == (6, 6, 6, 8)


def test_launch_plan_policy_fields():
    """Decode plan below ``attention_prefill_min_rows`` packed rows, prefill tiles from there (wide tiles where
    they fill ``attention_wide_min_waves`` waves); split-K up to
    ``attention_split_waves`` waves; the fused path's split count rounded up to a power of two, capped by
    ``attention_max_splits``."""
    p = KernelPolicy(num_sms=132)
    assert launch_plan(1, 1, 24, 2, 32768, p) == Plan(16, 64, 66, 4, 3)  # today's decode plan
    assert launch_plan(1, 4096, 24, 2, 4096, p) == Plan(128, 64, 1, 8, 2)  # 768 wide tiles: 5.8 waves
    assert launch_plan(1, 1024, 24, 4, 8192, p) == Plan(64, 64, 1, 4, 3)  # 192 wide tiles: 1.5 waves
    assert launch_plan(1, 1, 24, 2, 40, p) == Plan(16, 32, 2, 4, 3)  # kv block <= S, one split per block at most
    assert fused_splits(66, p) == 32 and fused_splits(3, p) == 4 and fused_splits(1, p) == 1
    p2 = dataclasses.replace(p, attention_split_waves=2, attention_max_splits=256, attention_prefill_min_rows=1024,
                             attention_prefill_block_rows=128, attention_prefill_num_warps=8,
                             attention_decode_block_kv=128, attention_decode_num_stages=2)
    assert launch_plan(1, 1, 24, 2, 32768, p2) == Plan(16, 128, 132, 4, 2)
    assert fused_splits(132, p2) == 256 and fused_splits(132, dataclasses.replace(p2, attention_max_splits=100)) == 100
    assert launch_plan(1, 64, 24, 4, 8192, p2) == Plan(64, 128, 11, 4, 2)  # 384 rows: still the decode plan
    assert launch_plan(1, 1024, 24, 4, 8192, p2) == Plan(128, 64, 2, 8, 3)  # 192 programs: 2 splits for 2 waves


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


def test_tuned_plans_lower_at_model_shapes():
    """Policy-chosen plans lower for CUDA at Qwen3.5 27B shapes (24/4 heads, head_dim 256, 32k cache): a prefill
    chunk on 128-row tiles with 8 warps, and the fused decode layer with 80 splits (three epilogue groups, the last
    shifted and masked)."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    hq, hkv, d, s = 24, 4, 256, 32768
    prefill = KernelPolicy(attention_prefill_block_rows=128, attention_prefill_num_warps=8,
                           attention_prefill_num_stages=2)
    args = (sds((1, 512, hq, d), bf16), sds((1, hkv, s, d), bf16), sds((1, hkv, s, d), bf16),
            sds((1, 512), jnp.int32))
    fn = lambda *a: cached_attention(*a, implementation="triton", policy=prefill)  # noqa: E731
    assert "triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    decode = KernelPolicy(attention_max_splits=80, attention_split_waves=2, num_sms=132)
    args = (sds((1, 1, 2 * (hq + hkv) * d), bf16), sds((d,), jnp.float32), sds((d,), jnp.float32),
            sds((32,), jnp.float32), sds((1, hkv, s, d), bf16), sds((1, hkv, s, d), bf16), sds((1, 1), jnp.int32))
    fn = lambda *a: fused_gated_attention(*a, hq=hq, hkv=hkv, d=d, eps=1e-6, implementation="triton",  # noqa: E731
                                          policy=decode)
    traced = jax.jit(fn).trace(*args)
    assert "f32[1,4,80,16,256]" in str(traced.jaxpr)
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 3


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


@pytest.mark.parametrize("n_split,dtype", [(1, jnp.float32), (1, jnp.bfloat16), (4, jnp.float32),
                                           (4, jnp.bfloat16), (3, jnp.float32), (40, jnp.bfloat16)])
def test_epilogue_matches_combine_and_gate(rng, n_split, dtype):
    """One split, a power of two, and counts the epilogue combines in shifted groups (3: two of 2; 40: 32 + 8)."""
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


def test_fused_layer_with_more_than_32_splits(rng):
    """The backend's policy reaches the fused launch: 48 splits (``attention_max_splits``; the epilogue combines
    them in two groups of 32, the second shifted back and half masked), and 40 given explicitly, against the jnp
    layer steps."""
    cfg = Qwen35Config(family="qwen3_5", vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, layer_types=(FULL,))
    p = attention_layer(rng, cfg, jnp.float32)
    b, s = 2, 600
    x = jnp.asarray(rng.standard_normal((b, 1, cfg.hidden_size)), jnp.float32)
    positions = jnp.asarray([[590], [233]], jnp.int32)
    cache = KVCache(*(jnp.asarray(rng.standard_normal((b, 2, s, 16)), jnp.float32) for _ in range(2)))
    policy = KernelPolicy(attention_max_splits=48, attention_decode_block_kv=16, num_sms=132)
    kernels = Backend(attention="triton_interpret", attention_prelude="triton_interpret", policy=policy)
    fn = lambda x, cache: gated_attention(p, cfg, x, positions, cache, backend=kernels)  # noqa: E731
    assert "f32[2,2,48,16,16]" in str(jax.make_jaxpr(fn)(x, cache))  # the split partials [B, Hkv, NS, MP, D]
    y, got = fn(x, cache)
    y_ref, want = jax.jit(lambda x, cache: gated_attention(p, cfg, x, positions, cache))(x, cache)
    assert_close(y, y_ref, jnp.float32, "layer output, 48 splits")
    assert_close(got.k, want.k, jnp.float32, "k cache")
    args = fused_inputs(rng, b, 2, 4, 2, 16, 8, s, jnp.bfloat16, [[300, 301], [77, -1]])
    kw = dict(hq=4, hkv=2, d=16, eps=1e-6)
    y40, *_ = gated_attention_triton(*args, **kw, n_split=40, block_kv=16, interpret=True)
    y40_ref, *_ = jax.jit(lambda *a: fused_gated_attention(*a, **kw, implementation="xla"))(*args)
    valid = np.asarray(args[-1]) >= 0
    assert_close(np.asarray(y40, np.float32)[valid], np.asarray(y40_ref, np.float32)[valid], jnp.bfloat16,
                 "layer output, 40 splits")


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
