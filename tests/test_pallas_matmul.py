"""Few-row matmul kernels (GPU Triton variants, run by the Pallas interpreter) against a float64 numpy product:
row counts that are not powers of two, W stored [K, N] or [N, K], split K, float32 and bf16 operands, float32 output
from bf16 operands; the multiply-add kernel with int8 and packed int4 weights and both ways of widening them; the
dispatcher's fallbacks; the dp4a kernel for int4 weights and int8 rows (its instruction emulated by the interpreter,
checked here against a numpy definition); and a small model whose projections run through the kernel.

The interpreter fills output buffers with NaN before the kernel runs, so unwritten elements fail the check.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp.pallas.matmul as matmul_mod
from jaxmtp.pallas._common import SplitSum, dense
from jaxmtp.model import forward, init_carry, init_params
from jaxmtp.pallas import XLA, Backend, KernelPolicy
from jaxmtp.pallas.matmul import (gemv_matmul_triton, linear, matmul_reference, output_linear,
                                  quantized_matmul_reference, skinny_matmul_triton, swiglu_reference)
from jaxmtp.pallas.matmul.reference import as_words, quantize_rows_int8, unpack_int4, w4a8_matmul_reference
from jaxmtp.pallas.matmul.skinny_triton import plan
from jaxmtp.pallas.matmul.w4a8_triton import dp4a, quantize_rows_triton, w4a8_argmax_triton, w4a8_matmul_triton
from jaxmtp.pallas.norms import rms_norm_triton

from test_pallas_model import small_config


def _check(got, x, w, transpose_w, tol):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = x64 @ (w64.T if transpose_w else w64)
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite output elements"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("m,k,n,transpose_w,splits", [
    (1, 128, 48, False, 1), (3, 192, 96, False, 3), (17, 128, 64, True, 2), (64, 64, 32, False, 1),
    (5, 256, 16, True, 4),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_float64(rng, m, k, n, transpose_w, splits, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)) / np.sqrt(k), dtype)
    bn = 32 if n % 32 == 0 else 16
    y = skinny_matmul_triton(x, w, transpose_w=transpose_w, block_n=bn, block_k=64, splits=splits, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    _check(y, x, w, transpose_w, 1e-6 if dtype == jnp.float32 else 1e-2)
    if dtype == jnp.bfloat16:  # float32 output keeps the float32 accumulator: only operand rounding remains
        y32 = skinny_matmul_triton(x, w, transpose_w=transpose_w, out_dtype=jnp.float32, block_n=bn, block_k=64,
                                   splits=splits, interpret=True)
        assert y32.dtype == jnp.float32
        _check(y32, x, w, transpose_w, 1e-5)


@pytest.mark.parametrize("m,k,n,transpose_w,splits,bn,bk", [
    (1, 256, 48, False, 1, 16, 32), (3, 384, 64, True, 3, 8, 128), (4, 512, 40, False, 2, 8, 64),
    (2, 128, 24, True, 1, 8, 128),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gemv_kernel_matches_float64(rng, m, k, n, transpose_w, splits, bn, bk, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)) / np.sqrt(k), dtype)
    y = gemv_matmul_triton(x, w, transpose_w=transpose_w, block_n=bn, block_k=bk, splits=splits, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    _check(y, x, w, transpose_w, 1e-6 if dtype == jnp.float32 else 1e-2)
    y32 = gemv_matmul_triton(x, w, transpose_w=transpose_w, out_dtype=jnp.float32, interpret=True)  # default plan
    _check(y32, x, w, transpose_w, 1e-6 if dtype == jnp.float32 else 1e-5)


def _swiglu64(x, width):
    g, u = np.asarray(x[..., :width], np.float64), np.asarray(x[..., width : 2 * width], np.float64)
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("m,norm", [(1, False), (1, True), (2, True)])
def test_gemv_swiglu_epilogue_matches_float64(rng, m, norm):
    """glu_width I with an int8 gate|up weight (rows [0, I) gate, [I, 2I) up, padding rows after them): silu(gate) *
    up of the two scaled products, with and without the input norm formed inside, against float64; and through
    layer_gemv where layer_swiglu_applies (one row, slabs tiling I)."""
    k, i = 256, 48
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    q = jnp.asarray(rng.integers(-128, 128, (2 * i + 16, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, 2 * i + 16), jnp.float32)
    nw = jnp.asarray(rng.standard_normal(k) * 0.1, jnp.float32)
    kw = dict(norm_weight=nw, norm_eps=1e-6) if norm else {}
    y = gemv_matmul_triton(x, q, scale, transpose_w=True, out_dtype=jnp.bfloat16, glu_width=i, block_n=8,
                           interpret=True, **kw)
    x64 = np.asarray(x, np.float64)
    if norm:
        x64 = x64 * (1 + np.asarray(nw, np.float64)) / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6)
    prod = x64 @ np.asarray(q, np.float64).T * np.asarray(scale, np.float64)
    want = _swiglu64(prod, i)
    assert y.shape == (m, i) and y.dtype == jnp.bfloat16
    # the two products are rounded to bfloat16 before the SwiGLU, the result once more
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-6, atol=2**-6 * np.abs(want).max())
    w = {"weight": q, "scale": scale}
    applies = matmul_mod.layer_swiglu_applies(x.shape, w, i, "triton_interpret")
    assert applies == (m <= KernelPolicy().layer_gemv_max_rows)
    assert not matmul_mod.layer_swiglu_applies(x.shape, w, i, "xla")
    if applies:  # the layer kernel's own plan (its slabs tile I) gives the same values
        via = matmul_mod.layer_gemv(x, w, implementation="triton_interpret", glu_width=i,
                                    norm=(nw, 1e-6) if norm else None)
        np.testing.assert_array_equal(np.asarray(via, np.float32), np.asarray(y, np.float32))
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(x, q, scale, transpose_w=True, glu_width=q.shape[0], interpret=True)  # 2I > N


@pytest.mark.parametrize("m,k,n,bn,bk,extra", [(1, 256, 48, 2, 128, 0), (3, 384, 40, 8, 128, 128),
                                               (1, 512, 24, 4, 256, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gemv_swiglu_prologue_matches_float64(rng, m, k, n, bn, bk, extra, dtype):
    """x = gate | up (+ padding columns the kernel must ignore): the product's input is silu(gate) * up."""
    x = jnp.asarray(rng.standard_normal((m, 2 * k + extra)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    y = gemv_matmul_triton(x, w, transpose_w=True, swiglu=True, block_n=bn, block_k=bk, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    want = _swiglu64(x, k) @ np.asarray(w, np.float64).T
    err = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
    assert err < (1e-6 if dtype == jnp.float32 else 1e-2), err
    # the kernel rounds the activation to x's dtype once, as swiglu_reference materialises it
    ref = matmul_reference(matmul_mod.swiglu_reference(x, k), w, transpose_w=True, out_dtype=jnp.float32)
    y32 = gemv_matmul_triton(x, w, transpose_w=True, swiglu=True, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_allclose(np.asarray(y32), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(x[:, : 2 * k - 128], w, transpose_w=True, swiglu=True, interpret=True)  # no room for up


@pytest.mark.parametrize("m,k,n,bn,bk,extra", [(3, 256, 48, 16, 128, 0), (4, 384, 32, 16, 128, 64),
                                               (13, 128, 64, 32, 64, 0), (16, 256, 16, 16, 256, 0)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_skinny_kernel_with_masked_rows_matches_float64(rng, m, k, n, bn, bk, extra, swiglu):
    """The tensor-core kernel with the rows not padded (the kernel masks rows m..15 on load and store), W [N, K] bf16,
    one split and two, optionally x = gate | up (+ columns it must ignore) with the SwiGLU
    formed per step and rounded to bf16 as swiglu_reference materialises it."""
    x = jnp.asarray(rng.standard_normal((m, 2 * k + extra if swiglu else k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    y = skinny_matmul_triton(x, w, transpose_w=True, swiglu=swiglu, mask_rows=True, block_n=bn, block_k=bk,
                             out_dtype=jnp.float32, interpret=True)
    assert y.shape == (m, n)
    xin = matmul_mod.swiglu_reference(x, k) if swiglu else x
    _check(y, xin, w, True, 1e-5)  # operands exact in bf16, float32 accumulation
    if swiglu:
        want = _swiglu64(x, k) @ np.asarray(w, np.float64).T
        assert np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want) < 1e-2
    # split along K: the partials' rows from m on are never written (NaN in the interpreter) and must not leak
    y2 = skinny_matmul_triton(x, w, transpose_w=True, swiglu=swiglu, mask_rows=True, block_n=bn, block_k=64, splits=2,
                              out_dtype=jnp.float32, interpret=True)
    assert y2.shape == (m, n)
    _check(y2, xin, w, True, 1e-5)
    with pytest.raises(ValueError, match="int4"):
        skinny_matmul_triton(x[:, :k], jnp.zeros((n, k // 2), jnp.uint8), transpose_w=True, mask_rows=True,
                             interpret=True)


@pytest.mark.parametrize("swiglu", [False, True])
def test_output_linear_dispatch(rng, monkeypatch, swiglu):
    """One row runs the multiply-add kernel, up to ``output_skinny_max_rows`` the tensor-core kernel with masked
    rows, more rows (and the "xla" name) the reference; all agree with float64. (The tensor-core range is off by
    default, measured slower on the GPU: switched on here to check the dispatch.)"""
    policy = KernelPolicy(output_skinny_max_rows=16)
    k, n = 256, 64
    w_t = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32)
    calls = []
    for name in ("gemv_matmul_triton", "skinny_matmul_triton"):
        real = getattr(matmul_mod, name)
        monkeypatch.setattr(matmul_mod, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    for rows in (1, 3, policy.output_skinny_max_rows + 1):
        x = jnp.asarray(rng.standard_normal((rows, 1, 2 * k if swiglu else k)), jnp.float32)
        want = (_swiglu64(x, k) if swiglu else np.asarray(x, np.float64)) @ np.asarray(w_t, np.float64).T
        for impl in ("xla", "triton_interpret"):
            calls.clear()
            y = matmul_mod.output_linear(x, w_t, swiglu=swiglu, implementation=impl, policy=policy)
            assert y.shape == (rows, 1, n)
            np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5)
            expect = [] if impl == "xla" or rows > policy.output_skinny_max_rows else (
                ["gemv_matmul_triton"] if rows <= policy.output_gemv_max_rows else ["skinny_matmul_triton"])
            assert calls == expect


@pytest.mark.parametrize("swiglu", [False, True])
def test_output_linear_returns_split_sums_when_asked(rng, swiglu):
    """partials=True with 2..``output_split_max_rows`` rows: the tensor-core kernel split along K returns its float32
    partials unsummed (a SplitSum [S, ..., N]), whose sum is the product (float64); with a SwiGLU too (formed before
    the kernel). One row, the "xla" name, or a caller that takes no partials get the array."""
    k, n = 512, 64
    policy = KernelPolicy()
    w_t = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    for rows in (1, 2, policy.output_split_max_rows):
        x = jnp.asarray(rng.standard_normal((1, rows, 2 * k if swiglu else k)), jnp.bfloat16)
        want = (_swiglu64(x, k) if swiglu else np.asarray(x, np.float64)) @ np.asarray(w_t, np.float64).T
        y = matmul_mod.output_linear(x, w_t, swiglu=swiglu, implementation="triton_interpret", partials=True)
        split = rows > policy.output_gemv_max_rows
        assert isinstance(y, SplitSum) == split
        if isinstance(y, SplitSum):
            assert y.parts.shape[0] > 1 and y.parts.shape[1:] == (1, rows, n) and y.parts.dtype == jnp.float32
            assert y.dtype == jnp.bfloat16
            # the SwiGLU is rounded to bfloat16 before the product, as on XLA's path
            np.testing.assert_allclose(np.asarray(y.parts, np.float64).sum(0), want, rtol=0, atol=2e-2)
        np.testing.assert_allclose(np.asarray(dense(y), np.float64), want, rtol=2 ** -7, atol=2e-2)
        for kw in (dict(implementation="xla", partials=True), dict(implementation="triton_interpret")):
            assert not isinstance(matmul_mod.output_linear(x, w_t, swiglu=swiglu, **kw), SplitSum)


@pytest.mark.parametrize("unpack", ["magic", "convert"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_kernel_widens_int8_and_int4_exactly(rng, m, unpack):
    k, n = 384, 40
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    q8 = jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8)  # the full int8 range, -128 included
    q4 = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)  # any byte: two nibbles, each 0..15 minus 8
    for q, widened in [(q8, q8), (q4, unpack_int4(q4))]:
        y = gemv_matmul_triton(x, q, transpose_w=True, block_n=8, unpack=unpack, interpret=True)
        assert y.dtype == jnp.float32  # quantised weights: the unscaled float32 product
        _check(y, x, widened, True, 1e-6)
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(x, q8.T, interpret=True)  # quantised weights are read transposed only
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(jnp.ones((5, k), jnp.bfloat16), q8, transpose_w=True, interpret=True)  # > 4 rows


def test_dp4a_emulation_matches_its_definition(rng):
    """PTX dp4a.u32.s32: c + sum over the four bytes of a (unsigned) times those of b (signed), wrapping in int32."""
    a, b = (rng.integers(-2**31, 2**31, 4096, dtype=np.int64).astype(np.int32) for _ in range(2))
    c = rng.integers(-2**31, 2**31 - 2**18, 4096, dtype=np.int64).astype(np.int32)
    got = np.asarray(dp4a(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c), interpret=True))
    prod = a.view(np.uint8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4).astype(np.int64)
    want = (c.astype(np.int64) + prod.sum(1) + 2**31) % 2**32 - 2**31
    np.testing.assert_array_equal(got, want.astype(np.int32))


@pytest.mark.parametrize("m,k,n,bn,bw", [(1, 256, 48, 16, 16), (3, 512, 64, 32, 32), (8, 384, 16, 16, 16),
                                         (2, 1024, 96, 32, 64)])
def test_w4a8_kernel_matches_float64(rng, m, k, n, bn, bw):
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), jnp.bfloat16)
    packed = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)  # any byte: nibbles 0..15, minus 8
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    y = w4a8_matmul_triton(x, as_words(packed), scale, block_n=bn, words_per_step=bw, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    xq, rs = quantize_rows_int8(x)
    x64 = np.asarray(x, np.float64)
    rs64 = np.abs(x64).max(1) / 127
    np.testing.assert_allclose(np.asarray(rs, np.float64), rs64, rtol=1e-6)
    assert np.all(np.abs(np.asarray(xq, np.float64) * rs64[:, None] - x64) <= rs64[:, None] * (0.5 + 1e-5))
    assert np.abs(np.asarray(xq, np.int32)).max() == 127
    want = (np.asarray(xq, np.float64) @ np.asarray(unpack_int4(packed), np.float64).T) * rs64[:, None] * np.asarray(
        scale, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match="unsupported w4a8"):
        w4a8_matmul_triton(jnp.ones((9, k), jnp.bfloat16), as_words(packed), scale, interpret=True)  # > 8 rows
    with pytest.raises(ValueError, match="do not divide"):
        w4a8_matmul_triton(x, as_words(packed), scale, words_per_step=24, interpret=True)


def test_default_plan_and_leading_axes(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)  # [B, T, K] -> 6 rows
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    y = skinny_matmul_triton(x, w, interpret=True)
    assert y.shape == (2, 3, 64)
    _check(y.reshape(6, 64), x.reshape(6, 128), w, False, 1e-6)
    mp, bn, bk, splits = plan(1, 2560, 9216)
    assert mp == 16 and 9216 % bn == 0 and 2560 % (bk * splits) == 0


def test_dispatch_falls_back_where_the_kernel_does_not_apply(rng):
    wide = KernelPolicy(min_weight_elements=0, kernel_max_rows=64)
    kw = dict(implementation="triton_interpret")
    w = jnp.asarray(rng.standard_normal((128, 48)), jnp.float32)
    for rows, k in ((65, 128), (4, 100)):  # too many rows; K not a multiple of 64
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        wk = jnp.asarray(rng.standard_normal((k, 48)), jnp.float32)
        np.testing.assert_array_equal(linear(x, wk, policy=wide, **kw), matmul_reference(x, wk))
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    np.testing.assert_allclose(linear(x, w, policy=wide, **kw), matmul_reference(x, w), atol=1e-5)
    one_row = dataclasses.replace(wide, kernel_max_rows=1)  # more rows than the kernel is used for
    np.testing.assert_array_equal(linear(x, w, policy=one_row, **kw), matmul_reference(x, w))
    big_only = dataclasses.replace(wide, min_weight_elements=1 << 20)  # small weights stay with XLA
    np.testing.assert_array_equal(linear(x, w, policy=big_only, **kw), matmul_reference(x, w))


@pytest.mark.slow  # the multi-row kernel path is not a default (kernel_max_rows = 1); 30 s on the CI machine
def test_model_projections_through_the_kernel(rng, monkeypatch):
    # the small model's weights all qualify by size, and the 2-row decode and 6-row verify use the kernel
    policy = KernelPolicy(min_weight_elements=0, kernel_max_rows=64)
    calls = []
    real = matmul_mod.skinny_matmul_triton
    monkeypatch.setattr(matmul_mod, "skinny_matmul_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = small_config()
    params = init_params(cfg, jax.random.key(1), jnp.float32, scale=0.1)
    b, t0, cap = 2, 9, 16
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t0 + 4)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t0 + 4, dtype=jnp.int32), ids.shape)

    def run(backend):
        fwd = functools.partial(forward, cfg=cfg, backend=backend)
        _, _, carry = fwd(params, ids[:, :t0], pos[:, :t0], init_carry(cfg, b, cap, jnp.float32))
        dec, _, carry = fwd(params, ids[:, t0:t0 + 1], pos[:, t0:t0 + 1], carry)  # decode: 2 rows
        ver, _, _ = fwd(params, ids[:, t0 + 1:], pos[:, t0 + 1:], carry, step_states=True)  # verify: 6 rows
        return dec, ver

    want = run(XLA)
    got = run(Backend(matmul="triton_interpret", policy=policy))
    assert calls, "the kernel was never used"
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=0)


@pytest.mark.parametrize("m,k", [(1, 1024), (3, 2560), (4, 640)])  # 8, 20 and 5 packing blocks (loads of 8, 4, 1)
def test_row_quantize_kernel_equals_its_reference(rng, m, k):
    """The dp4a kernel's prologue: int8 rows, their words split into each block's halves, scales and sums, exactly."""
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), jnp.bfloat16)
    x = x.at[0, 5].set(-jnp.abs(x[0]).max() * 1.5)  # a negative extreme: -127 after rounding
    xlo, xhi, rs, rsum = quantize_rows_triton(x, interpret=True)
    xq, want_rs = quantize_rows_int8(x)
    x32 = np.asarray(x, np.float32)  # numpy: float32 products rounded once, ties to even
    inv = np.float32(127) / np.abs(x32).max(1)
    np.testing.assert_array_equal(np.asarray(xq), np.clip(np.round(x32 * inv[:, None]), -127, 127))
    halves = np.asarray(as_words(xq)).reshape(m, k // 128, 2, 16)
    np.testing.assert_array_equal(np.asarray(xlo), halves[:, :, 0].reshape(m, k // 8))
    np.testing.assert_array_equal(np.asarray(xhi), halves[:, :, 1].reshape(m, k // 8))
    mp = rs.shape[0]
    assert mp == 1 << (m - 1).bit_length()
    np.testing.assert_array_equal(np.asarray(rs)[:m], np.asarray(want_rs))
    np.testing.assert_array_equal(np.asarray(rsum)[:m], np.asarray(xq, np.int32).sum(1))
    assert np.all(np.asarray(rs)[m:] == 1) and np.all(np.asarray(rsum)[m:] == 0)
    assert int(np.asarray(xq)[0, 5]) == -127


@pytest.mark.parametrize("m", [1, 3])
def test_w4a8_argmax_is_the_first_largest_column(rng, m):
    """Ties across and within programs (copies of the winning weight row) resolve to the lowest column, as
    jnp.argmax over the logits does; without ties the index is the reference product's argmax."""
    k, n, bn = 256, 128, 16
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    scale = jnp.full((n,), 1e-2, jnp.float32)  # one scale: copied rows give bit-identical logits
    ref = np.asarray(w4a8_matmul_reference(x, jnp.asarray(packed), scale))
    want = ref.argmax(-1)
    np.testing.assert_array_equal(np.asarray(w4a8_argmax_triton(x, as_words(jnp.asarray(packed)), scale,
                                                                block_n=bn, interpret=True)), want)
    best = int(want[0])
    tied = packed.copy()
    early, late = (best + 3 * bn) % n, best  # a copy in another program, and the original
    lo, hi = sorted((early, late))
    tied[lo] = tied[hi] = packed[best]
    tied[hi - 1 if hi - 1 != lo else hi - 2] = packed[best]  # and one in the same program as the later copy, if any
    logits = np.asarray(w4a8_matmul_triton(x, as_words(jnp.asarray(tied)), scale, block_n=bn, interpret=True))
    got = np.asarray(w4a8_argmax_triton(x, as_words(jnp.asarray(tied)), scale, block_n=bn, interpret=True))
    np.testing.assert_array_equal(got, logits.argmax(-1))
    assert got[0] == min(np.flatnonzero(logits[0] == logits[0].max()))


@pytest.mark.parametrize("m,swiglu", [(1, False), (1, True), (4, False), (3, True)])
def test_int8_gemv_scales_and_casts_inside(rng, m, swiglu):
    """The int8 MTP layer's products: scale per output column and bf16 cast in the kernel, SwiGLU prologue."""
    k, n = 384, 48
    x = jnp.asarray(rng.standard_normal((m, 2 * k + 64 if swiglu else k)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    y = gemv_matmul_triton(x, q, scale, transpose_w=True, out_dtype=jnp.bfloat16, swiglu=swiglu, block_n=8,
                           interpret=True)
    assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
    xin = swiglu_reference(x, k) if swiglu else x  # the activation rounded to bf16, as the kernel forms it
    want = np.asarray(xin, np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8, atol=1e-3 * np.abs(want).max())
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(x, q, scale[:8], transpose_w=True, swiglu=swiglu, interpret=True)


def test_int8_layer_products_route_to_the_gemv_kernel(rng, monkeypatch):
    """Up to ``layer_gemv_max_rows`` (here 4) rows of an int8 [N <= 65536, K] weight: one multiply-add kernel (scale,
    cast, SwiGLU inside); more rows keep the tensor-core path; the results agree with the quantised reference."""
    calls = []
    real = matmul_mod.gemv_matmul_triton
    monkeypatch.setattr(matmul_mod, "gemv_matmul_triton", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    k, n = 256, 64
    q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    w = {"weight": q, "scale": jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)}
    policy = KernelPolicy(layer_gemv_max_rows=4)
    for rows in (1, 4, 5):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        calls.clear()
        y = linear(x, w, implementation="triton_interpret", policy=policy)
        assert y.dtype == jnp.bfloat16 and bool(calls) == (rows <= 4)
        want = quantized_matmul_reference(x, q, w["scale"])
        np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(want, np.float64), rtol=2 ** -7,
                                   atol=1e-3)
        g = jnp.asarray(rng.standard_normal((rows, 2 * k)), jnp.bfloat16)
        calls.clear()
        y = output_linear(g, w, swiglu=True, implementation="triton_interpret", policy=policy)
        assert bool(calls) == (rows <= 4) and all(c.get("swiglu") for c in calls)
        want = quantized_matmul_reference(swiglu_reference(g, k), q, w["scale"])
        np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(want, np.float64), rtol=2 ** -7,
                                   atol=1e-3)


@pytest.mark.parametrize("m,k", [(1, 384), (3, 256)])
def test_int8_gemv_forms_the_norm_and_adds_the_residual(rng, m, k):
    """The int8 layer kernel with the input norm (its row scale from the sums of squares gathered while streaming K)
    and the residual add inside: the norm kernel followed by the plain product and the bf16 add, up to the normed
    row's rounding to bf16 (which the fused kernel skips), and float64 within bf16 rounding."""
    n, eps = 48, 1e-6
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    nw = jnp.asarray(0.3 * rng.standard_normal(k), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    res = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    kw = dict(transpose_w=True, out_dtype=jnp.bfloat16, block_n=8, interpret=True)
    got = gemv_matmul_triton(x, q, scale, norm_weight=nw, norm_eps=eps, residual=res, **kw)
    h = rms_norm_triton(x, nw, eps, interpret=True)
    want = res + gemv_matmul_triton(h, q, scale, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=2 ** -6,
                               atol=4e-3 * np.abs(np.asarray(want, np.float64)).max())
    x64 = np.asarray(x, np.float64)
    h64 = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + eps) * (1 + np.asarray(nw, np.float64))
    ref = np.asarray(res, np.float64) + h64 @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2 ** -6, atol=2e-2 * np.abs(ref).max())
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(x, q, scale, norm_weight=nw[:128], norm_eps=eps, **kw)
    with pytest.raises(ValueError, match="unsupported gemv"):
        gemv_matmul_triton(x, q, scale, residual=res[:, :8], **kw)


def test_skinny_column_scale_matches_float64_and_needs_one_split(rng):
    """The tensor-core kernel with an int8 weight's column scale inside it (masked rows): the scaled product in the
    activations' dtype; a scale with a floating weight or several splits along K is refused."""
    m, k, n = 3, 256, 48
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    y = skinny_matmul_triton(x, q, scale, transpose_w=True, mask_rows=True, interpret=True)
    want = np.asarray(x, np.float64) @ np.asarray(q, np.float64).T * np.asarray(scale, np.float64)
    assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-8, atol=1e-6)
    with pytest.raises(ValueError, match="column scale"):
        skinny_matmul_triton(x, q, scale, transpose_w=True, splits=2, interpret=True)
    with pytest.raises(ValueError, match="column scale"):
        skinny_matmul_triton(x, q.astype(jnp.bfloat16), scale, transpose_w=True, interpret=True)
