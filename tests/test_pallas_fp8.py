"""Block-FP8 weight products (:mod:`jaxmtp.pallas.matmul.fp8_triton`, run by the Pallas interpreter) against a
float64 numpy product of the dequantised weight and against :func:`fp8_matmul_reference`: both paths (multiply-add
up to 4 rows, tensor cores above), K and N multiples of 128 or not, float32 and bfloat16 rows, float32 output,
non-default tiles (split K, partial and empty steps, several M tiles); the plan; the refusals; and lowering for CUDA
at Qwen3.5 27B shapes (Triton IR without a device).

Every weight block is scaled by its own power of two (2^-5 to 2^5) before quantisation, so the block scales differ
by up to 2^10 and a scale read from the wrong block fails the float32 checks. The interpreter fills output buffers
with NaN before the kernel runs, so unwritten elements fail too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas.matmul.fp8_triton import FMA_MAX_ROWS, fp8_matmul_triton, plan, supports
from jaxmtp.pallas.matmul.reference import FP8_BLOCK, fp8_matmul_reference
from jaxmtp.quantize import quantize_fp8_blocks

F32, BF16 = jnp.float32, jnp.bfloat16
BF16_OUT_TOL = 2.0**-8  # a bfloat16 output is rounded once (<= 2^-9 relative per element); the float32 sums add ~0


def _inputs(rng, lead, k, n, dtype):
    """x [*lead, k] in ``dtype``; e4m3 W [n, k] and its block scales (blocks' magnitudes 2^-5 .. 2^5); the float64
    dequantised weight."""
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    mag = 2.0 ** rng.integers(-5, 6, size=(nb, kb))
    w = rng.standard_normal((n, k)) * np.repeat(np.repeat(mag, FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k] / np.sqrt(k)
    q, scale = quantize_fp8_blocks(w.astype(np.float32))
    expanded = np.repeat(np.repeat(scale.astype(np.float64), FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k]
    x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
    return x, jnp.asarray(q), jnp.asarray(scale), q.astype(np.float64) * expanded


def _rel_err(got, want):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite output elements"
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def _check(x, q, scale, w64, tol_f32=1e-5, **kw):
    """The kernel (``kw``: its tiles) against float64 and the reference, in x's dtype and in float32."""
    want = np.asarray(x, np.float64) @ w64.T
    y = fp8_matmul_triton(x, q, scale, interpret=True, **kw)
    assert y.shape == (*x.shape[:-1], q.shape[0]) and y.dtype == x.dtype
    if x.dtype == F32:
        assert _rel_err(y, want) < tol_f32
        assert _rel_err(y, np.asarray(fp8_matmul_reference(x, q, scale), np.float64)) < tol_f32
        return
    assert _rel_err(y, want) < BF16_OUT_TOL
    assert _rel_err(y, np.asarray(fp8_matmul_reference(x, q, scale), np.float64)) < 1e-2
    y32 = fp8_matmul_triton(x, q, scale, out_dtype=F32, interpret=True, **kw)  # no rounding of w * scale, no output
    assert y32.dtype == F32 and _rel_err(y32, want) < tol_f32


@pytest.mark.parametrize("lead,k,n,dtype", [
    ((1,), 256, 384, F32), ((1,), 200, 300, BF16), ((2,), 64, 40, F32), ((2,), 256, 384, BF16),
    ((3,), 200, 300, F32), ((2, 2), 256, 384, F32), ((4,), 64, 40, BF16),
    ((5,), 200, 300, BF16), ((5,), 256, 384, F32), ((17,), 64, 40, F32), ((17,), 200, 300, BF16),
    ((64,), 256, 384, BF16), ((4, 16), 200, 300, F32),
])
def test_matches_float64_and_reference(rng, lead, k, n, dtype):
    """Default tiles (the plan) on both paths: 1-4 rows multiply-add, 5+ rows tensor cores; K, N multiples of 128
    (256 x 384, a TP-sharded-like shape) or not (200 x 300; 64 x 40, less than one block each way)."""
    _check(*_inputs(rng, lead, k, n, dtype))


@pytest.mark.parametrize("m,k,n,dtype,tiles", [
    (3, 200, 300, F32, dict(block_n=16, block_k=256, splits=2)),  # the second split's step lies past K
    (2, 640, 136, F32, dict(block_n=8, splits=3)),  # 5 steps in 3 splits of 2: the last step past K
    (1, 256, 384, BF16, dict(fma_max_rows=0)),  # one row on the tensor-core path
    (6, 200, 300, F32, dict(fma_max_rows=8)),  # six rows on the multiply-add path
    (17, 200, 300, F32, dict(block_m=16, block_n=16, block_k=256, splits=1)),  # two M tiles, two dots per step
    (40, 640, 136, BF16, dict(block_m=32, block_n=128, block_k=256, splits=2)),  # dots past K (scale index clamped)
])
def test_tiles(rng, m, k, n, dtype, tiles):
    """Non-default tiles: split K with partial or empty steps, several M tiles, wider steps, the thresholds."""
    _check(*_inputs(rng, (m,), k, n, dtype), **tiles)


@pytest.mark.parametrize("m,k,n,lanes", [(1, 200, 300, 1), (1, 200, 300, 16), (2, 1024, 136, 16), (3, 640, 384, 1)])
def test_multiply_add_accumulators(rng, m, k, n, lanes):
    """The multiply-add path with a tile-wide accumulator (lanes 1) and with 16 products summed per thread first
    (lanes 16, the default), K a multiple of the step or not."""
    _check(*_inputs(rng, (m,), k, n, F32), fma_max_rows=4, lanes=lanes)


@pytest.mark.parametrize("fma_max_rows", [1, 4])
def test_the_policy_picks_the_path(rng, monkeypatch, fma_max_rows):
    """``fp8_linear`` hands the kernel policy's ``fp8_fma_max_rows``, ``fp8_fma_lanes`` and ``fp8_dot_min_programs``
    to the kernel, whose 3-row product then takes the multiply-add path (threshold 4) or tensor cores (1); both equal
    float64."""
    import dataclasses

    from jaxmtp.pallas import matmul
    from jaxmtp.pallas.policy import DEFAULT_POLICY

    seen = []

    def spy(*args, **kw):
        seen.append((kw["fma_max_rows"], kw["lanes"], kw["dot_min_programs"]))
        return fp8_matmul_triton(*args, **kw)

    monkeypatch.setattr(matmul, "fp8_matmul_triton", spy)
    x, q, scale, w64 = _inputs(rng, (3,), 200, 300, F32)
    policy = dataclasses.replace(DEFAULT_POLICY, fp8_fma_max_rows=fma_max_rows, fp8_dot_min_programs=fma_max_rows * 8)
    y = matmul.fp8_linear(x, {"weight": q, "block_scale": scale}, implementation="triton_interpret", policy=policy)
    assert seen == [(fma_max_rows, DEFAULT_POLICY.fp8_fma_lanes, fma_max_rows * 8)]
    assert plan(3, 200, 300, fma_max_rows=fma_max_rows).fma == (fma_max_rows >= 3)
    assert _rel_err(y, np.asarray(x, np.float64) @ w64.T) < 1e-5


def test_plan_and_refusals(rng):
    for m in (1, 2, 3, 4, 5, 17, 64, 300):
        for k, n in ((5120, 17408), (17408, 5120), (5120, 12288), (200, 300), (64, 40)):
            assert supports(m, k, n)
            p = plan(m, k, n)
            assert p.fma == (m <= FMA_MAX_ROWS) and FP8_BLOCK % p.block_n == 0 and p.block_k % FP8_BLOCK == 0
            if k % FP8_BLOCK == 0:
                assert k % p.block_k == 0
            if not p.fma:  # K split so that each program keeps at least 4 of its 128-wide blocks
                assert p.block_m >= min(m, 64) and -(-k // FP8_BLOCK) >= 4 * p.splits or p.splits == 1
    assert plan(32, 17408, 5120).splits == 8 and plan(1, 5120, 34816).fma
    # the verify window's products at 27B: W tiles of 32 rows; K split until 1024 programs, gate|up not at all
    shapes = ((5120, 34816), (5120, 16384), (17408, 5120), (6144, 5120))
    assert [plan(4, k, n).splits for k, n in shapes] == [1, 2, 8, 8]
    assert plan(4, 5120, 34816).block_n == 32 and plan(4, 5120, 34816, dot_min_programs=0)[2:4] == (64, 128)
    assert plan(4, 5120, 34816, dot_min_programs=0).splits == 4 and plan(17, 5120, 34816).block_n == 64
    assert not supports(0, 256, 384)
    x, q, scale, _ = _inputs(rng, (2,), 256, 384, F32)
    for w, s in ((q, scale[:, :1]), (q.astype(F32), scale)):  # scale shape, weight dtype
        with pytest.raises(ValueError):
            fp8_matmul_triton(x, w, s, interpret=True)
    for tiles in (dict(block_n=48), dict(block_k=192), dict(block_m=8, fma_max_rows=0), dict(lanes=3, fma_max_rows=4)):
        with pytest.raises(ValueError):
            fp8_matmul_triton(x, q, scale, interpret=True, **tiles)


@pytest.mark.parametrize("m,k,n", [(1, 5120, 17408), (4, 17408, 5120), (32, 5120, 17408), (32, 17408, 5120),
                                   (3, 200, 300), (37, 200, 300)])
def test_lowers_for_cuda(m, k, n):
    """Qwen3.5 27B MLP shapes (and partial blocks) lower to one Triton launch; nothing is padded."""
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), BF16), sds((n, k), jnp.float8_e4m3fn), sds((-(-n // 128), -(-k // 128)), F32))
    text = jax.jit(fp8_matmul_triton).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.pad" not in text


@pytest.mark.parametrize("m,k,n,n_tail,dtype", [(1, 256, 384, 96, F32), (1, 200, 300, 6, F32), (2, 640, 136, 10, BF16)])
def test_a_floating_tail_fills_the_columns_after_the_fp8_ones(rng, m, k, n, n_tail, dtype):
    """``tail``: a floating weight [K, N2] beside the FP8 one (the FP8 checkpoints' bf16 ``in_proj_b|a``), its columns
    formed by extra programs of the same launch. The FP8 columns are those of the launch without a tail, bit for bit;
    the tail's are x @ tail against float64; N2 not a multiple of BN (6, 10), K not one of the step (200, 640), two
    rows on the multiply-add path. A tail on the tensor-core path is refused."""
    x, q, scale, w64 = _inputs(rng, (m,), k, n, dtype)
    tail = jnp.asarray(rng.standard_normal((k, n_tail)) / np.sqrt(k), dtype)
    kw = dict(fma_max_rows=max(m, FMA_MAX_ROWS), interpret=True)
    y = fp8_matmul_triton(x, q, scale, tail=tail, out_dtype=F32, **kw)
    assert y.shape == (m, n + n_tail)
    np.testing.assert_array_equal(np.asarray(y[:, :n]), np.asarray(fp8_matmul_triton(x, q, scale, out_dtype=F32, **kw)))
    want = np.asarray(x, np.float64) @ np.asarray(tail, np.float64)
    assert _rel_err(y[:, n:], want) < 1e-5
    with pytest.raises(ValueError, match="tail"):
        fp8_matmul_triton(x, q, scale, tail=tail, fma_max_rows=0, interpret=True)


def test_the_policy_runs_an_fp8_projection_and_its_floating_tail_in_one_launch(rng):
    """``ops.linear_parts`` with the policy's ``fp8_tail``: an FP8 weight and a floating one after it (the GDN
    in_proj of an FP8 checkpoint) give the values of the two products concatenated, in one Triton launch for one
    row (lowered for CUDA) where without the option the floating product and the concatenation run apart."""
    import dataclasses

    from jaxmtp.pallas import ops
    from jaxmtp.pallas.backend import Backend

    x, q, scale, w64 = _inputs(rng, (1, 1), 256, 384, F32)
    tail = jnp.asarray(rng.standard_normal((256, 12)) / 16, F32)
    ws = [{"weight": q, "block_scale": scale}, tail]
    on = Backend(fp8_matmul="triton_interpret", matmul="xla")
    assert on.policy.fp8_tail  # the default
    off = dataclasses.replace(on, policy=dataclasses.replace(on.policy, fp8_tail=False))
    got, apart = ops.linear_parts(x, ws, on), ops.linear_parts(x, ws, off)
    assert got.shape == (1, 1, 396)
    np.testing.assert_allclose(np.asarray(got), np.asarray(apart), rtol=1e-6, atol=1e-6)
    want = np.concatenate([np.asarray(x[0], np.float64) @ w64.T, np.asarray(x[0], np.float64) @ np.asarray(tail)], -1)
    assert _rel_err(got[0], want) < 1e-5
    sds = jax.ShapeDtypeStruct
    cuda = lambda b: dataclasses.replace(b, fp8_matmul="triton")  # noqa: E731
    args = (sds((1, 1, 5120), BF16), {"weight": sds((16384, 5120), jnp.float8_e4m3fn), "block_scale":
            sds((128, 40), F32)}, sds((5120, 96), BF16))
    for backend in (cuda(on), cuda(off)):
        text = jax.jit(lambda x, w, t, b=backend: ops.linear_parts(x, [w, t], b)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        apart = not backend.policy.fp8_tail  # the floating product and the concatenation outside the launch
        assert ("stablehlo.dot_general" in text) == apart and ("stablehlo.concatenate" in text) == apart
