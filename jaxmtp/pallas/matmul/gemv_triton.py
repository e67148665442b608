"""Products of one to four rows on GPU without tensor cores: Pallas with the Triton lowering, one fused multiply-add
per weight.

:mod:`.skinny_triton` feeds the weight tile to a tensor-core dot with the rows padded to 16. For a bfloat16 weight
that streams near the HBM bandwidth, but a quantised weight must first be widened in registers and then moved into
the dot's operand layout, and for packed int4 that per-weight work, not the bytes, sets the time (as long as the
int8 read of twice the bytes). Here each program keeps a
float32 accumulator tile the shape of its weight tile, multiplies the widened weights elementwise by the broadcast
row and adds, and reduces the tile once at the end: per weight a widening and one multiply-add, no layout change.
That pays only for a few rows (each row repeats the multiply-adds), hence ``MAX_ROWS``.

Grid ``(N / BN, splits)``. Weight layouts: ``[K, N]`` (``x @ W``; tile ``[BK, BN]``), ``[N, K]`` with
``transpose_w`` (tile ``[BN, BK]``), int8 ``[N, K]`` and packed int4 ``[N, K/2]`` (uint8, the block-halves layout of
:func:`jaxmtp.pallas.matmul.reference.unpack_int4`; each step reads one 128-wide block's 64 bytes per row and
multiplies its low and high nibbles by the block's two halves of the row) with ``transpose_w``. With ``splits > 1``
each program covers ``K / splits`` and a jnp sum adds the float32 partials. The reference is
:func:`jaxmtp.pallas.matmul.reference.matmul_reference` (and the quantised references, before their scale).

The products that end a block (attention ``o_proj``, GDN ``out_proj``, the MLP's ``down_proj``; N = hidden size, K
up to 4x larger) are where XLA's one-row products split K and reduce the partials in a kernel of their own. Stored
``[N, K]`` (K contiguous), a program reads a few whole rows of W and needs no split: one kernel, no partial sums
(:func:`jaxmtp.pallas.matmul.output_linear`). ``swiglu=True`` folds the MLP's activation in: x is the gate|up
projection's output ``[..., >= 2K]`` and the product's input ``silu(gate) * up`` is formed per step in registers
(rounded to x's dtype, as :func:`jaxmtp.pallas.matmul.reference.swiglu_reference` materialises it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxmtp.pallas._common import next_pow2, swiglu_tile
from jaxmtp.pallas.matmul.reference import INT4_BLOCK
from jaxmtp.pallas.matmul.skinny_triton import launch_row_kernel

MAX_ROWS = 4
HALF = INT4_BLOCK // 2
_MAGIC = 0x4B000000  # float32 bits of 2^23: OR-ing an integer 0 <= i < 2^23 into the mantissa gives 2^23 + i


def _widen(i, offset: int, unpack: str):
    """int32 ``i`` (0 <= i < 256) minus ``offset`` as float32. ``"magic"``: the integer goes into the mantissa of
    2^23 and one float subtraction removes 2^23 + offset (exact; no integer-to-float conversion, an instruction the
    GPU issues at 1/8 of the rate of a multiply-add); ``"convert"``: integer subtraction, then conversion."""
    if unpack == "magic":
        return lax.bitcast_convert_type(i | _MAGIC, jnp.float32) - float(2**23 + offset)
    return (i - offset).astype(jnp.float32)


def supports(m: int, k: int, n: int, transpose_w: bool, w_dtype) -> bool:
    """Shapes the kernel takes: 1-4 rows, N a multiple of 8; K a multiple of 128; quantised weights transposed."""
    quantised = jnp.dtype(w_dtype) in (jnp.int8, jnp.uint8)
    return 0 < m <= MAX_ROWS and n % 8 == 0 and k % INT4_BLOCK == 0 and (transpose_w or not quantised)


def plan(k: int, n: int, transpose_w: bool, w_dtype, m: int = 1):
    """Default ``(BN, BK, splits, num_warps, num_stages)``. Quantised (the draft head): every tiling measured within a
    few percent of the others.
    int8 with N <= 65536 (the int8 MTP layer's products): fewer rows per program and longer steps, so that N of a
    few thousand still gives enough programs (measured faster than the head's tiles at the MTP layers' shapes); with
    3-4 rows (the verify window's pass) steps half as
    long, so that the four accumulators fit in registers. Floating ``[N, K]`` (a block's output product): a few rows
    per program, long steps along K (the best of a sweep). ``[K, N]`` bf16 weights stay with XLA in
    the engine (its split-K products were faster than this kernel's)."""
    bn = 16 if n % 16 == 0 else 8
    if jnp.dtype(w_dtype) == jnp.uint8:
        return bn, INT4_BLOCK, 1, 4, 4
    if transpose_w and jnp.dtype(w_dtype) == jnp.int8:
        shrink = 1 if m <= 2 else 2  # steps half as long for 3-4 rows
        if n <= 4096 and n % 2 == 0:
            return 2, next(b for b in (1024 // shrink, 512, 256, 128) if k % b == 0), 1, 4, 2
        if n <= 65536 and n % 8 == 0:
            return 8, next(b for b in (512 // shrink, 256, 128) if k % b == 0), 1, 4, 2
        return bn, 256 if k % 256 == 0 else 128, 1, 4, 4
    if transpose_w:
        bk = next(b for b in (1024, 512, 256, 128) if k % b == 0)
        return (2, bk, 1, 4, 2) if k <= 4096 else (4, bk, 1, 8, 2)
    bn = next(b for b in (64, 32, 16, 8) if n % b == 0)
    return bn, 32, 1, 4, 4


def _row(x_ref, r, off, bk, swiglu, nw_ref=None):
    """Row r's inputs ``[off, off + bk)`` as float32; with ``swiglu`` (x = gate|up, each ``swiglu`` wide)
    ``silu(gate) * up`` rounded to x's dtype; with the norm weight ``nw_ref`` ``x * (1 + w)``, the RMSNorm before
    its row scale (applied to the product's sums at the end)."""
    f32 = jnp.float32
    if nw_ref is not None:
        return x_ref[r, pl.ds(off, bk)].astype(f32) * (1.0 + nw_ref[pl.ds(off, bk)].astype(f32))
    if not swiglu:
        return x_ref[r, pl.ds(off, bk)].astype(f32)
    g = x_ref[r, pl.ds(off, bk)].astype(f32)
    u = x_ref[r, pl.ds(swiglu + off, bk)].astype(f32)
    return swiglu_tile(g, u, x_ref.dtype).astype(f32)


def _kernel(x_ref, w_ref, *refs, m, bk, k_per_split, transpose_w, int4, unpack, swiglu, scaled=False, norm_eps=None,
            residual=False, glu=False):
    """refs: ``[up weight], [scale], [up scale], [norm weight], [residual], out`` (see :func:`gemv_matmul_triton`;
    ``glu``: a second view of W, the up rows, and of the scale)."""
    refs = list(refs)
    w_refs = [w_ref] + ([refs.pop(0)] if glu else [])
    scale_refs = [refs.pop(0) for _ in w_refs] if scaled else [None] * len(w_refs)
    nw_ref = refs.pop(0) if norm_eps is not None else None
    res_ref = refs.pop(0) if residual else None
    [o_ref] = refs
    f32 = jnp.float32
    k0 = pl.program_id(1) * k_per_split
    bn = o_ref.shape[-1]
    if int4:
        shape = (bn, HALF)
    else:
        shape = (bn, bk) if transpose_w else (bk, bn)

    def body(i, carry):
        off = pl.multiple_of(k0 + i * bk, bk)
        accs, sqs = carry if nw_ref is not None else (carry, None)
        new = products(off, accs)
        if nw_ref is None:
            return new
        # the rows' sums of squares ride along: the norm's row scale needs no prologue
        xs = [x_ref[r, pl.ds(off, bk)].astype(f32) for r in range(m)]
        return new, tuple(sq + x * x for sq, x in zip(sqs, xs))

    def products(off, accs):
        """accs: m accumulators per weight view, the views in order."""
        if int4:
            b = w_ref[:, pl.ds(pl.multiple_of(off // 2, HALF), HALF)].astype(jnp.int32)
            lo, hi = _widen(b & 15, 8, unpack), _widen(b >> 4, 8, unpack)
            return tuple(acc + lo * x_ref[r, pl.ds(off, HALF)].astype(f32)[None, :]
                         + hi * x_ref[r, pl.ds(off + HALF, HALF)].astype(f32)[None, :] for r, acc in enumerate(accs))
        rows = [_row(x_ref, r, off, bk, swiglu, nw_ref) for r in range(m)]
        out = []
        for v, wr in enumerate(w_refs):
            if transpose_w:
                w = wr[:, pl.ds(off, bk)]
                w = _widen(w.astype(jnp.int32) + 128, 128, unpack) if w.dtype == jnp.int8 else w.astype(f32)
                out += [acc + w * x[None, :] for acc, x in zip(accs[v * m : (v + 1) * m], rows)]
            else:
                w = wr[pl.ds(off, bk), :].astype(f32)
                out += [acc + w * x[:, None] for acc, x in zip(accs[v * m : (v + 1) * m], rows)]
        return tuple(out)

    init = tuple(jnp.zeros(shape, f32) for _ in range(m * len(w_refs)))
    if nw_ref is not None:
        init = (init, tuple(jnp.zeros((bk,), f32) for _ in range(m)))
    accs = lax.fori_loop(0, k_per_split // bk, body, init)
    inv = [None] * m
    if nw_ref is not None:
        accs, sqs = accs
        inv = [lax.rsqrt(jnp.sum(sq) / k_per_split + norm_eps) for sq in sqs]
    scales = [None if r is None else r[...] for r in scale_refs]

    def column(v, r):
        """Row r's outputs of weight view v, scaled (norm, column scale) and cast."""
        total = jnp.sum(accs[v * m + r], axis=1 if transpose_w else 0)
        if inv[r] is not None:
            total = total * inv[r]
        return (total if scales[v] is None else total * scales[v]).astype(o_ref.dtype)

    for r in range(m):
        out = column(0, r)
        if glu:  # silu(gate) * up of the two rounded products, as the model forms it from them
            out = swiglu_tile(out.astype(f32), column(1, r).astype(f32), o_ref.dtype)
        if res_ref is not None:  # the residual add, as the model's own add rounds it
            out = (res_ref[r, :].astype(f32) + out.astype(f32)).astype(o_ref.dtype)
        o_ref[r, :] = out


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "block_n", "block_k", "splits",
                                             "num_warps", "num_stages", "unpack", "swiglu", "norm_eps", "glu_width",
                                             "interpret"))
def gemv_matmul_triton(x, w, scale=None, *, transpose_w=False, out_dtype=None, block_n=None, block_k=None,
                       splits=None, num_warps=None, num_stages=None, unpack="magic", swiglu=False, norm_weight=None,
                       norm_eps=None, residual=None, glu_width=None, interpret=False):
    """x [..., K] (1-4 rows in all); w [K, N], or [N, K] / int8 [N, K] / packed int4 uint8 [N, K/2] with
    ``transpose_w``. Returns ``x @ W`` [..., N] in ``out_dtype`` (default x.dtype; quantised weights give the
    unscaled float32 product of the integer values). ``scale`` (float32 [N], one split only): each column's float32
    sum is multiplied by it before the cast to ``out_dtype``, as
    :func:`jaxmtp.pallas.matmul.reference.quantized_matmul_reference` does (the quantised MTP layer's products end
    here, in the activations' dtype, with no scale kernel after them). ``swiglu``: x is [..., >= 2K] (gate | up) and
    the product's input ``silu(gate) * up`` (floating or int8 weights). ``norm_weight`` [K] (float32 offset) with
    ``norm_eps``: the product's input is ``rms_norm(x)`` (:func:`jaxmtp.pallas.norms.reference.rms_norm`): each program
    multiplies ``x * (1 + w)`` and sums the row's squares as it streams K, and scales its sums by the row's
    ``rsqrt(mean(x^2) + eps)`` at the end (float32 throughout; the unfused norm rounds the normed row to x's dtype
    first, so the two differ in the last bits). The layer's input norm then needs no launch of its own and the
    product no prologue.
    ``residual`` [..., N] (``out_dtype``): returns ``residual + x @ W``, added after the cast and rounded again, as the
    model's residual add does (a block's output product that hands its sum to the next norm). Both: one split.
    ``glu_width`` I (``transpose_w``, one split; W's rows ``[0, I)`` the gate's, ``[I, 2I)`` the up projection's):
    returns ``silu(gate) * up`` [..., I], each product scaled and rounded to ``out_dtype`` first, as the SwiGLU after
    a gate|up product is formed: each program reads matching slabs of both halves, so the activation needs no
    kernel of its own."""
    lead = x.shape[:-1]
    kdim = (w.shape[1] if transpose_w else w.shape[0]) if swiglu else x.shape[-1]
    m = math.prod(lead)
    n = w.shape[0] if transpose_w else w.shape[1]
    int4 = w.dtype == jnp.uint8
    bad_swiglu = swiglu and (x.shape[-1] < 2 * kdim or int4)
    bad_scale = scale is not None and (scale.shape != (n,) or scale.dtype != jnp.float32)
    bad_norm = norm_weight is not None and (swiglu or norm_eps is None or norm_weight.shape != (kdim,)
                                            or x.shape[-1] != kdim or int4)
    quantised = jnp.dtype(w.dtype) in (jnp.int8, jnp.uint8)
    out_dtype = jnp.dtype(out_dtype or (jnp.float32 if quantised else x.dtype))
    n_out = glu_width or n
    bad_residual = residual is not None and (residual.shape != (*lead, n_out) or residual.dtype != out_dtype)
    bad_glu = glu_width is not None and (not transpose_w or int4 or swiglu or 2 * glu_width > n)
    if (not supports(m, kdim, n, transpose_w, w.dtype) or (int4 and w.shape[1] * 2 != kdim) or bad_swiglu
            or bad_scale or bad_norm or bad_residual or bad_glu):
        raise ValueError(f"unsupported gemv: [{m}, {x.shape[-1]}] x W {w.shape} {w.dtype}, transpose_w={transpose_w}"
                         f", swiglu={swiglu}, scale {None if scale is None else (scale.shape, scale.dtype)}, norm "
                         f"{None if norm_weight is None else (norm_weight.shape, norm_eps)}, residual "
                         f"{None if residual is None else (residual.shape, residual.dtype)}, glu_width={glu_width}")
    bn0, bk0, s0, nw0, st0 = plan(kdim, n, transpose_w, w.dtype, m)
    bn, bk, ns = block_n or bn0, block_k or bk0, splits or s0
    if int4 and bk != INT4_BLOCK:
        raise ValueError(f"int4 weights are read in blocks of {INT4_BLOCK} along K, not {bk}")
    one_split_only = scale is not None or norm_weight is not None or residual is not None or glu_width is not None
    if n_out % bn or kdim % (bk * ns) or (one_split_only and ns != 1):
        raise ValueError(f"tiles BN={bn}, BK={bk}, splits={ns} do not divide [{kdim}, {n_out}] (or split a product "
                         f"with a scale, norm, residual or SwiGLU)")
    kernel = functools.partial(_kernel, m=m, bk=bk, k_per_split=kdim // ns, transpose_w=transpose_w, int4=int4,
                               unpack=unpack, swiglu=kdim if swiglu else 0, scaled=scale is not None,
                               norm_eps=None if norm_weight is None else float(norm_eps), residual=residual is not None,
                               glu=glu_width is not None)
    return launch_row_kernel(kernel, x, w, rows=next_pow2(m), block_n=bn, splits=ns, transpose_w=transpose_w,
                             out_dtype=out_dtype, num_warps=num_warps or nw0, num_stages=num_stages or st0,
                             interpret=interpret, name="gemv", column_scale=scale,
                             row_weight=None if norm_weight is None else norm_weight.astype(jnp.float32),
                             residual=residual, glu_width=glu_width)
