"""Products with block-FP8 weights on GPU (decode and verify): Pallas with the Triton lowering, the e4m3 weight read
once and widened in registers, never dequantised in memory.

The weight is the official Qwen3.5 FP8 checkpoints' (:mod:`jaxmtp.fp8`): e4m3 ``[N, K]`` (K contiguous) and one
float32 scale per 128 x 128 block ``[ceil(N/128), ceil(K/128)]``; the product is ``x @ (w * scale)^T`` with float32
accumulation (reference: :func:`jaxmtp.pallas.matmul.reference.fp8_matmul_reference`). Each program owns ``BN``
weight rows with BN dividing 128, so its rows share one row of block scales, and a 128-wide stretch of K one scale.
Two paths, by the number of rows M (the product of x's leading dims):

* M <= ``FMA_MAX_ROWS`` (one row: decode at batch 1, the drafts' passes): multiply-adds as :mod:`.gemv_triton`, no
  tensor cores. Grid ``(cdiv(N, BN), splits)``; per step a ``[BN, BK]`` e4m3 tile is widened to float32 and each
  row adds ``w * xs[None, :]``, summed over each thread's 16 contiguous columns, to an accumulator of its own,
  reduced across threads once at the end. The scale goes on the
  activations, not on the weights: ``xs = x * scale[nb, k // 128]`` (the step's scales gathered per column), BK
  multiplies per row and step instead of BN x BK (a variant taking one 128-column block at a time with a scalar
  scale measured no faster). Each row repeats the multiply-adds, hence few rows only.
* More rows (the verify window, batch decode): tensor cores. Grid ``(cdiv(M, BM), cdiv(N, BN), splits)``, the M
  tiles fastest (with several, the programs running together share weight slabs, read once from memory); per
  128-wide block of K the ``[BM, 128]`` rows and the ``[BN, 128]`` e4m3 tile (widened to x's dtype: exact, e4m3 fits
  in bfloat16) go to one dot with float32 result, which is multiplied by the block's scale and added: the scale is
  exact (no rounding of ``w * scale`` to bfloat16, as the reference has) and costs BM x BN multiplies per block.

Nothing is padded or copied: rows past M or N and columns past K are masked in the loads (zeros) and stores (only
where M, N or K is not a multiple of its tile), so any M, K, N >= 1 works; K a multiple of 16 keeps the weight loads
vectorised (Triton derives the rows' alignment from it). With ``splits > 1`` program s covers its share of the
K steps and a jnp sum adds the float32 partials ``[splits, M, N]``; the tensor-core plan splits K when the tiles
alone give fewer than two waves of programs (as :mod:`.skinny_triton` does).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import mm, next_pow2, sum_parts, work_dtype
from jaxmtp.pallas.matmul.reference import FP8_BLOCK, FP8_DTYPE
from jaxmtp.pallas.policy import DEFAULT_POLICY

# the kernel policy's defaults (jaxmtp.pallas.policy, where they are measured), for calls that name no tiles
FMA_MAX_ROWS = DEFAULT_POLICY.fp8_fma_max_rows  # up to this many rows the multiply-add path, then tensor cores
DOT_MIN_PROGRAMS = DEFAULT_POLICY.fp8_dot_min_programs  # tensor cores, up to 16 rows: K split until this many programs
LANES = DEFAULT_POLICY.fp8_fma_lanes  # multiply-add path: products a thread sums in registers before accumulating


class Plan(NamedTuple):
    """Tiles of one product: ``fma`` picks the path; ``block_m`` is M on the multiply-add path (all rows at once)."""

    fma: bool
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int
    lanes: int = 1  # multiply-add path: products a thread sums in registers before accumulating (:func:`_fma_kernel`)


def supports(m: int, k: int, n: int) -> bool:
    """Shapes the kernel takes: any M, K, N >= 1 (partial tiles and scale blocks are masked; nothing is refused for
    alignment)."""
    return m >= 1 and k >= 1 and n >= 1


def plan(m: int, k: int, n: int, *, fma_max_rows: int = FMA_MAX_ROWS,
         dot_min_programs: int = DOT_MIN_PROGRAMS) -> Plan:
    """Default tiles for x [m, k] times an e4m3 W [n, k], the best of sweeps at Qwen3.5-27B shapes
    (``scripts/sweep_fp8_tiles.py``: one row on an H100, more rows on an H200; docs/performance.md, "FP8").

    Multiply-add path (one row): four rows of W per program (two for N <= 4096), steps of 1024 along K (512 or
    256 where 1024 does not divide K, 128 for K not a multiple of 128, the last step masked; at most 512 for 3-4
    rows, whose accumulators must fit in registers), :data:`LANES` products summed per thread before they are
    accumulated; one split. With the kernel's time from a profiler trace (``--timing kernel``) these tiles were
    the fastest or within 2% of it at every 27B shape on an H100.
    Tensor-core path (two rows and more: at 4 rows 1.2-1.4x faster than the best multiply-add tiling on an H100,
    1.4-2.6x at 2-4 rows against the tile-wide accumulator on an H200): BM the rows rounded up to a power of two (16
    to 64), BK = 128 (one dot per scale block), three pipeline stages. Up to 16 rows (``dot_min_programs`` > 0):
    BN = 32 and K split in 1, 2, 4 or 8 (each split keeping at least 4 blocks of K) until the grid has at least
    ``dot_min_programs`` programs, so that the wide products run one launch with no partial sums (an H100 at 4
    rows). More rows: BN = 64 and K split in 8 where that leaves at least 8 blocks of K per program, else in 4 (more
    programs in flight per SM: splits of 4-8 were the fastest at every shape swept on an H200)."""
    steps = pl.cdiv(k, FP8_BLOCK)  # 128-wide blocks of K
    if m <= fma_max_rows:
        widest = 1024 if m <= 2 else 512
        bk = next((b for b in (1024, 512, 256) if b <= widest and k % b == 0), FP8_BLOCK)
        return Plan(True, m, 2 if n <= 4096 else 4, bk, 1, 4, 2, LANES)
    bm = min(64, max(16, next_pow2(m)))
    if bm == 16 and dot_min_programs > 0:
        splits, programs = 1, pl.cdiv(n, 32)
        while splits < 8 and steps >= 8 * splits and programs * splits < dot_min_programs:  # >= 4 blocks a split
            splits *= 2
        return Plan(False, bm, 32, FP8_BLOCK, splits, 4, 3)
    splits = 8 if steps >= 64 else 4 if steps >= 16 else 2 if steps >= 4 else 1
    return Plan(False, bm, 64, FP8_BLOCK, splits, 4, 3)


def _load(ref, mask):
    """``ref`` (a view), masked entries read as 0 (no mask: a plain load)."""
    return ref[...] if mask is None else pltr.load(ref, mask=mask, other=0.0)


def _both(a, b):
    return b if a is None else a if b is None else a & b


def _fma_kernel(x_ref, w_ref, s_ref, *refs, m, k, n, bn, bk, steps, ragged_k, lanes, n_tail=0):
    """x [m, K]; w e4m3 [N, K]; s float32 [cdiv(N, 128), cdiv(K, 128)]; o [m, N] (this split's). Program (j, s): W's
    rows ``[j BN, (j + 1) BN)`` over the K steps ``[s steps, (s + 1) steps)``; ``ragged_k``: the steps cover more
    than K (columns from K on masked). Each row's accumulator is ``[BN, BK / lanes]``: the ``lanes`` products of
    one thread's 16-byte load are summed in registers first, with no exchange between threads (a tile-wide
    accumulator, lanes 1, holds more registers per byte in flight and measured up to 1.5x slower). With
    ``n_tail``, refs are ``t, o``: a floating weight t [K, n_tail] whose products fill o's columns from N on (o [m,
    N + n_tail], one split); the first ``cdiv(n_tail, BN)`` programs take BN of its columns each (first, so that
    they run beside the FP8 rows rather than after them), the rest the FP8 rows."""
    *t_ref, o_ref = refs
    k0 = pl.program_id(1) * steps * bk
    if n_tail:
        first = pl.cdiv(n_tail, bn)
        j = pl.program_id(0)
        pl.when(j < first)(lambda: _tail_columns(x_ref, t_ref[0], o_ref, j * bn, m=m, k=k, n=n, n_tail=n_tail, bn=bn,
                                                 bk=bk))
        pl.when(j >= first)(lambda: _fma_rows(x_ref, w_ref, s_ref, o_ref, (j - first) * bn, k0, m=m, k=k, n=n, bn=bn,
                                              bk=bk, steps=steps, ragged_k=ragged_k, lanes=lanes))
    else:
        _fma_rows(x_ref, w_ref, s_ref, o_ref, pl.program_id(0) * bn, k0, m=m, k=k, n=n, bn=bn, bk=bk, steps=steps,
                  ragged_k=ragged_k, lanes=lanes)


def _tail_columns(x_ref, t_ref, o_ref, c0, *, m, k, n, n_tail, bn, bk):
    """Columns ``[c0, c0 + BN)`` of a floating weight t [K, n_tail] (stored ``x @ W``, as the projections are) times
    the rows, float32 accumulation, into o's columns from ``N + c0``."""
    f32 = jnp.float32
    ragged_k = k % bk != 0
    kk = lax.iota(jnp.int32, bk)
    cols_ok = c0 + lax.iota(jnp.int32, bn) < n_tail if n_tail % bn else None

    def body(i, accs):
        off = pl.multiple_of(i * bk, bk)
        k_ok = off + kk < k if ragged_k else None
        mask = _both(None if k_ok is None else jnp.broadcast_to(k_ok[:, None], (bk, bn)),
                     None if cols_ok is None else jnp.broadcast_to(cols_ok[None, :], (bk, bn)))
        w = _load(t_ref.at[pl.ds(off, bk), pl.ds(c0, bn)], mask).astype(f32)  # [BK, BN]
        xs = [_load(x_ref.at[jnp.int32(r), pl.ds(off, bk)], k_ok).astype(f32) for r in range(m)]
        return tuple(acc + jnp.sum(w * x[:, None], axis=0) for acc, x in zip(accs, xs))

    accs = lax.fori_loop(0, pl.cdiv(k, bk), body, tuple(jnp.zeros((bn,), f32) for _ in range(m)))
    for r, acc in enumerate(accs):
        pltr.store(o_ref.at[jnp.int32(r), pl.ds(n + c0, bn)], acc.astype(o_ref.dtype), mask=cols_ok)


def _fma_rows(x_ref, w_ref, s_ref, o_ref, n0, k0, *, m, k, n, bn, bk, steps, ragged_k, lanes):
    """One program of :func:`_fma_kernel`: W's rows ``[n0, n0 + BN)`` (e4m3, block scales ``s_ref``) from K step
    ``k0`` on, into o's columns ``[n0, n0 + BN)``."""
    f32 = jnp.float32
    nb, kb_last = lax.div(n0, FP8_BLOCK), s_ref.shape[1] - 1
    col = lax.iota(jnp.int32, bk)
    col_block = lax.div(col, FP8_BLOCK)  # a column's scale block within the step
    rows_ok = n0 + lax.broadcasted_iota(jnp.int32, (bn, bk), 0) < n if n % bn else None

    def body(i, accs):
        off = pl.multiple_of(k0 + i * bk, bk)
        cols_ok = off + col < k if ragged_k else None
        w = _load(w_ref.at[pl.ds(n0, bn), pl.ds(off, bk)],
                  _both(rows_ok, None if cols_ok is None else jnp.broadcast_to(cols_ok[None, :], (bn, bk))))
        w = w.astype(f32)
        scale = pltr.load(s_ref.at[nb, jnp.minimum(lax.div(off, FP8_BLOCK) + col_block, kb_last)])  # [BK]
        xs = [_load(x_ref.at[jnp.int32(r), pl.ds(off, bk)], cols_ok).astype(f32) * scale for r in range(m)]
        return tuple(acc + jnp.sum((w * x[None, :]).reshape(bn, bk // lanes, lanes), axis=2)
                     for acc, x in zip(accs, xs))

    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((bn, bk // lanes), f32) for _ in range(m)))
    out_ok = n0 + lax.iota(jnp.int32, bn) < n if n % bn else None
    for r, acc in enumerate(accs):
        pltr.store(o_ref.at[jnp.int32(r), pl.ds(n0, bn)], jnp.sum(acc, axis=1).astype(o_ref.dtype), mask=out_ok)


def _dot_kernel(x_ref, w_ref, s_ref, o_ref, *, m, k, n, bm, bn, bk, steps, ragged_k, dtype, interpret):
    """x [M, K]; w e4m3 [N, K]; s float32 [cdiv(N, 128), cdiv(K, 128)]; o [M, N] (this split's). Program (i, j, s):
    rows ``[i BM, (i + 1) BM)`` of x times W's rows ``[j BN, (j + 1) BN)`` over the K steps ``[s steps, (s + 1)
    steps)``, one dot per 128-wide block of K, scaled by the block's scale."""
    m0, n0 = pl.program_id(0) * bm, pl.program_id(1) * bn
    k0 = pl.program_id(2) * steps * bk
    nb, kb_last = lax.div(n0, FP8_BLOCK), s_ref.shape[1] - 1
    x_rows_ok = m0 + lax.broadcasted_iota(jnp.int32, (bm, FP8_BLOCK), 0) < m if m % bm else None
    w_rows_ok = n0 + lax.broadcasted_iota(jnp.int32, (bn, FP8_BLOCK), 0) < n if n % bn else None

    def body(i, acc):
        for u in range(bk // FP8_BLOCK):
            off = pl.multiple_of(k0 + i * bk + u * FP8_BLOCK, FP8_BLOCK)
            cols = off + lax.broadcasted_iota(jnp.int32, (1, FP8_BLOCK), 1) < k if ragged_k else None
            xt = _load(x_ref.at[pl.ds(m0, bm), pl.ds(off, FP8_BLOCK)],
                       _both(x_rows_ok, None if cols is None else jnp.broadcast_to(cols, (bm, FP8_BLOCK))))
            wt = _load(w_ref.at[pl.ds(n0, bn), pl.ds(off, FP8_BLOCK)],
                       _both(w_rows_ok, None if cols is None else jnp.broadcast_to(cols, (bn, FP8_BLOCK))))
            scale = s_ref[nb, jnp.minimum(lax.div(off, FP8_BLOCK), kb_last)]
            acc = acc + mm(xt, wt, tb=True, dtype=dtype, interpret=interpret) * scale
        return acc

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    out_ok = None
    if m % bm or n % bn:
        out_ok = ((m0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < m)
                  & (n0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 1) < n))
    pltr.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=out_ok)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "block_k", "splits", "num_warps",
                                             "num_stages", "fma_max_rows", "lanes", "dot_min_programs",
                                             "interpret"))
def fp8_matmul_triton(x, w, block_scale, *, out_dtype=None, block_m=None, block_n=None, block_k=None, splits=None,
                      num_warps=None, num_stages=None, fma_max_rows=FMA_MAX_ROWS, lanes=None,
                      dot_min_programs=DOT_MIN_PROGRAMS, tail=None, interpret=False):
    """``x @ (w * scale)^T``: x [..., K] (bfloat16, float16 or float32); w e4m3 [N, K]; block_scale
    [cdiv(N, 128), cdiv(K, 128)] (float32; another float dtype is cast). Returns [..., N] in ``out_dtype``
    (default x.dtype), float32 accumulation. Up to ``fma_max_rows`` rows the multiply-add path, else the tensor-core
    path; tiles default to :func:`plan` (``block_m``: the tensor-core path only; ``lanes``: the multiply-add path
    only). BN must divide 128, BM (a power of two >= 16) and BK (a power of two >= 128, a multiple of ``lanes``) are
    free; ``splits`` divides the K steps between programs (float32 partials, summed here in part order). ``tail``:
    a floating weight [K, N2] (FP8 checkpoints keep ``in_proj_b|a`` in bf16 beside the FP8 ``in_proj_qkv|z``) whose
    products fill columns ``[N, N + N2)`` of the output, from extra programs of the same launch (multiply-add path,
    one split; :func:`tail_applies`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    m, n = math.prod(lead), w.shape[0]
    n_blocks = (pl.cdiv(n, FP8_BLOCK), pl.cdiv(k, FP8_BLOCK))
    if (w.ndim != 2 or w.shape[1] != k or w.dtype != FP8_DTYPE or block_scale.shape != n_blocks
            or not jnp.issubdtype(x.dtype, jnp.floating) or not supports(m, k, n)):
        raise ValueError(f"unsupported FP8 product: x {x.shape} {x.dtype}, W {w.shape} {w.dtype}, scale "
                         f"{block_scale.shape} (want {n_blocks})")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    p = plan(m, k, n, fma_max_rows=fma_max_rows, dot_min_programs=dot_min_programs)
    bm, bn, bk = (m if p.fma else block_m or p.block_m), block_n or p.block_n, block_k or p.block_k
    ns = splits or p.splits
    lanes = lanes or p.lanes
    if (FP8_BLOCK % bn or bk % FP8_BLOCK or bk != next_pow2(bk) or (not p.fma and (bm < 16 or bm != next_pow2(bm)))
            or bk % lanes):
        raise ValueError(f"tiles BM={bm}, BN={bn}, BK={bk}, lanes={lanes}: BN must divide {FP8_BLOCK}, BK be a power "
                         f"of two >= {FP8_BLOCK} that lanes divides and BM (tensor-core path) one >= 16")
    n_tail = 0 if tail is None else tail.shape[1]
    if tail is not None and (not p.fma or ns != 1 or tail.shape != (k, n_tail)
                             or not jnp.issubdtype(tail.dtype, jnp.floating)):
        raise ValueError(f"a floating tail {tail.shape} {tail.dtype} runs on the one-split multiply-add path with K "
                         f"{k} only (rows {m}, splits {ns})")
    steps = pl.cdiv(pl.cdiv(k, bk), ns)  # K steps per split
    ragged_k = steps * bk * ns != k
    if p.fma:
        kernel = functools.partial(_fma_kernel, m=m, k=k, n=n, bn=bn, bk=bk, steps=steps, ragged_k=ragged_k,
                                   lanes=lanes, n_tail=n_tail)
        grid = (pl.cdiv(n, bn) + pl.cdiv(n_tail, bn), ns)
    else:
        kernel = functools.partial(_dot_kernel, m=m, k=k, n=n, bm=bm, bn=bn, bk=bk, steps=steps, ragged_k=ragged_k,
                                   dtype=work_dtype(x.dtype), interpret=bool(interpret))
        grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), ns)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *g: (0,) * a.ndim)  # noqa: E731  (indexed in the kernel)
    if ns == 1:
        out_shape = jax.ShapeDtypeStruct((m, n + n_tail), out_dtype)
        out_spec = pl.BlockSpec((m, n + n_tail), lambda *g: (0, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((ns, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, m, n), lambda *g: (g[-1], 0, 0))
    x2, scale = x.reshape(m, k), block_scale.astype(jnp.float32)
    tails = [] if tail is None else [tail]
    y = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[whole(x2), whole(w), whole(scale), *map(whole, tails)],
        out_specs=out_spec,
        compiler_params=pltr.CompilerParams(num_warps=num_warps or p.num_warps, num_stages=num_stages or p.num_stages),
        interpret=interpret,
        name="fp8_matmul",
    )(x2, w, scale, *tails)
    if ns > 1:
        y = sum_parts(y).astype(out_dtype)
    return y.reshape(*lead, n + n_tail)


def tail_applies(m: int, k: int, n: int, *, fma_max_rows: int = FMA_MAX_ROWS,
                 dot_min_programs: int = DOT_MIN_PROGRAMS) -> bool:
    """Whether :func:`fp8_matmul_triton` takes a floating ``tail`` for these shapes: the plan's multiply-add path with
    one split."""
    p = plan(m, k, n, fma_max_rows=fma_max_rows, dot_min_programs=dot_min_programs)
    return p.fma and p.splits == 1
