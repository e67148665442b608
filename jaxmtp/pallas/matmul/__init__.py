"""Projections ``x @ W``: the jnp reference, and a GPU kernel for few rows (decode and verify).

``linear(x, w, implementation=...)``: ``"xla"`` is the reference; ``"triton"`` / ``"triton_interpret"`` run
:func:`skinny_matmul_triton` for products of at most ``KERNEL_MAX_ROWS`` rows whose weight is large enough to matter
(>= 2^20 elements), else the reference. ``quantized_linear`` is the quantised (int8 or int4) draft head's product.
TPU names run the reference: XLA's TPU matmuls have no measured problem here (no TPU is available to measure one).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET, NormedRows
from jaxmtp.pallas.matmul.reference import (as_words, matmul_reference, quantize_rows_int8, quantized_matmul_reference,
                                            swiglu_reference, w4a8_matmul_reference)
from jaxmtp.pallas.matmul.gemv_triton import gemv_matmul_triton
from jaxmtp.pallas.matmul.gemv_triton import plan as gemv_plan
from jaxmtp.pallas.matmul.gemv_triton import supports as gemv_supports
from jaxmtp.pallas.matmul.skinny_triton import (MAX_ROWS, NUM_SMS, output_plan, partials_plan,
                                                skinny_matmul_triton, supports)
from jaxmtp.pallas.matmul.w4a8_triton import supports as w4a8_supports
from jaxmtp.pallas.matmul.w4a8_triton import (argmax_from_partials, w4a8_argmax_partials_triton, w4a8_argmax_triton,
                                              w4a8_matmul_triton)

MIN_WEIGHT_ELEMENTS = 1 << 20  # smaller projections (GDN gates, MoE router) stay with XLA, which fuses them
# Products with more rows stay with XLA (at most skinny_triton.MAX_ROWS). Measured on an H200 (0.8B shape): the
# kernel fixes XLA's slow single-row products (batch-1 decode 7.8 -> 1.8 ms), but with 8-32 rows it was 5-10% slower
# than XLA's gemms; on an H100 with the rows unpadded, the 4-row verify products made the 0.8B k = 3 step 3.8% slower
# (docs/performance.md, run 15).
KERNEL_MAX_ROWS = 1
# An int8 head's one-row product (a batch-1 draft) runs the multiply-add kernel: on an H100 the 4B head took 231 us
# against 249 us with the tensor-core kernel (docs/performance.md, run 9). With more rows each row repeats the
# multiply-adds: the tensor-core kernel. (An int4 head goes to the dp4a kernel below instead.)
GEMV_MAX_ROWS = 1
# An int4 head's product of up to this many rows runs the dp4a kernel (rows quantised to int8): on an H100 the 4B
# head took 119 / 136 / 173 / 325 us for 1 / 2 / 4 / 8 rows against 212-217 us with the tensor-core kernel
# (docs/performance.md, run 10).
W4A8_MAX_ROWS = 4
# Up to this many rows the drafts' argmax runs inside the dp4a kernel (quantized_argmax; 0: never, the logits are
# written and jnp.argmax reads them). H100, 4B head (docs/performance.md run 15): 1 row 120.5 us against 120.8 with
# the argmax after it, in the step one reduction kernel instead of three; 2 rows 141.4 against 138.8, 4 rows 195.9
# against 181.3 (the per-row epilogue costs more than the logits it saves), so one row only.
DRAFT_ARGMAX_MAX_ROWS = 1
# An int8 weight with at most LAYER_GEMV_MAX_N outputs is one of the int8 MTP layer's products
# (:func:`jaxmtp.param_layout.quantize_mtp`), not a head. Up to LAYER_GEMV_MAX_ROWS rows (the recursive drafts'
# one row) they run the multiply-add kernel with the column scale, the cast and (down_proj) the SwiGLU inside it:
# one kernel per product, where XLA added a scale kernel (and a SwiGLU kernel) after it. With 4 rows (the verify
# window's pass) the multiply-adds cost more than the tensor-core kernel's extra kernels: 0.8B qkv / gate|up / down
# 13.2 / 18.0 / 14.1 us against 4.6 / 5.3 / 4.0 (H100, docs/performance.md run 15), so those stay with it.
LAYER_GEMV_MAX_N = 65536
LAYER_GEMV_MAX_ROWS = 1
# Those products with more rows (the window's pass: its fc and qkv over the verify window) run the tensor-core kernel.
# With N wide enough for a wave of 16-column slabs (``SKINNY_COLUMN_SCALE``: qkv) the column scale is applied inside
# it (one split along K); narrower products (fc) split K and XLA applies the scale after (one more kernel). H100, 0.8B
# (docs/performance.md run 19): qkv 5.4 us against 4.6 + 1.4; fc with one split 6.0 us against 2.9 + 1.4, hence the
# width rule. XLA's own product (the int8 widening and the scale inside its one fusion) was no faster than the split
# kernel: 0.8B k = 3 1.690 against 1.694 ms.
SKINNY_COLUMN_SCALE = True
# Those one-row products also take the layer's norms and residual adds (:func:`layer_gemv_fuses`): a norm (a
# :class:`NormedRows` input) through the row's sum of squares gathered while streaming K, the residual added after
# the cast. In the k = 3 step each recursive draft pass then runs two launches fewer (the input norm, the
# post-attention add + norm) and the window's pass one (docs/performance.md, run 18).
FUSE_LAYER_NORMS = True
# The one-row int8 gate|up product forms the SwiGLU too (:func:`layer_swiglu`): each program reads matching slabs
# of the gate and up rows, so the activation is no kernel of its own (one launch fewer per recursive draft pass and
# in the window's pass). H100, 0.8B (docs/performance.md run 19): 5.9 us against 5.3 + 1.2; the k = 3 step within
# its rounds' spread (1.694 against 1.686 ms without).
FUSE_LAYER_SWIGLU = True


def is_quantized(w) -> bool:
    """Whether ``w`` is a quantised weight ``{"weight": int8 [N, K], "scale": float32 [N]}``
    (:func:`jaxmtp.param_layout.quantize_mtp`) rather than an array."""
    return isinstance(w, dict) and "scale" in w


def layer_gemv_fuses(rows: int, w, implementation: str) -> bool:
    """Whether a product of ``rows`` rows with ``w`` runs the int8 MTP layer's multiply-add kernel and may take its
    input norm (a :class:`NormedRows` x) and residual add inside it (``FUSE_LAYER_NORMS``)."""
    return (FUSE_LAYER_NORMS and is_quantized(w) and w["weight"].dtype == jnp.int8
            and _layer_gemv_shape(rows, w["weight"].shape[1], w["weight"], implementation))


def layer_swiglu(x, w, width: int, implementation: str = "xla"):
    """``silu(x @ gate) * (x @ up)`` [..., width] for a quantised gate|up weight (gate rows ``[0, width)``, up rows
    ``[width, 2 width)``) in one multiply-add kernel where :func:`layer_gemv_fuses` and ``FUSE_LAYER_SWIGLU`` allow
    (x a :class:`NormedRows` or an array); None elsewhere (the caller forms the product and the SwiGLU itself)."""
    rows = math.prod(x.shape[:-1])
    if not (FUSE_LAYER_SWIGLU and is_quantized(w) and layer_gemv_fuses(rows, w, implementation)):
        return None
    bn = gemv_plan(x.shape[-1], w["weight"].shape[0], True, w["weight"].dtype, rows)[0]
    if width % bn or 2 * width > w["weight"].shape[0]:
        return None
    norm = dict(norm_weight=x.weight, norm_eps=x.eps) if isinstance(x, NormedRows) else {}
    return gemv_matmul_triton(x.x if norm else x, w["weight"], w["scale"], transpose_w=True, out_dtype=x.dtype,
                              glu_width=width, interpret=implementation == TRITON_INTERPRET, **norm)


def linear(x, w, *, transpose_w: bool = False, out_dtype=None, implementation: str = "xla"):
    """x: [..., K] (or a :class:`NormedRows`: rms_norm(x), normalised inside the product where
    :func:`layer_gemv_fuses`, else formed first); w: [K, N] (or [N, K] with ``transpose_w``), or a quantised weight
    (:func:`is_quantized`, run by :func:`quantized_linear`). Returns [..., N] (``out_dtype``, default x.dtype)."""
    if isinstance(x, NormedRows):
        rows = math.prod(x.shape[:-1])
        if layer_gemv_fuses(rows, w, implementation):
            return gemv_matmul_triton(x.x, w["weight"], w["scale"], transpose_w=True, out_dtype=out_dtype or x.dtype,
                                      norm_weight=x.weight, norm_eps=x.eps,
                                      interpret=implementation == TRITON_INTERPRET)
        x = x.formed()
    if is_quantized(w):
        return quantized_linear(x, w["weight"], w["scale"], out_dtype=out_dtype or x.dtype,
                                implementation=implementation)
    if implementation in (TRITON, TRITON_INTERPRET) and w.size >= MIN_WEIGHT_ELEMENTS:
        n = w.shape[0] if transpose_w else w.shape[1]
        rows = math.prod(x.shape[:-1])
        if rows <= KERNEL_MAX_ROWS and supports(rows, x.shape[-1], n):
            return skinny_matmul_triton(x, w, transpose_w=transpose_w, out_dtype=out_dtype, mask_rows=True,
                                        interpret=implementation == TRITON_INTERPRET)
    return matmul_reference(x, w, transpose_w=transpose_w, out_dtype=out_dtype)


# Products that end a block (attention o_proj, GDN out_proj, the MLP's down_proj), weights stored [N, K]: one row
# runs the multiply-add kernel without a split along K, the MLP's SwiGLU folded in (docs/performance.md, run 12:
# XLA's products there split K and reduce the partials in a second kernel, and the SwiGLU is a kernel of its own).
# Rows up to OUTPUT_SKINNY_MAX_ROWS would run the tensor-core kernel the same way (one split, the SwiGLU folded in,
# the rows masked rather than padded). Off (1): on an H100 (run 14, scripts/bench_output_matmul.py) it took 12-14 us
# for the 4B out_proj / o_proj at 4 and 8 rows against XLA's 11.5-11.7, and with the SwiGLU folded in 170-185 us for
# down_proj against 21; in the step the 4B k = 3 step took 9.9 ms instead of 4.7. Kept, tested, for a better tiling.
OUTPUT_GEMV_MAX_ROWS = 1
OUTPUT_SKINNY_MAX_ROWS = 1
# Rows up to OUTPUT_SPLIT_MAX_ROWS whose caller takes partial sums (``partials=True``: the product feeds the residual
# add + norm kernel, which adds them) run the tensor-core kernel split along K and return the float32 partials (a
# SplitSum): the verify window's out_proj / o_proj then cost one launch, where XLA ran the product and a split-K
# reduction. Not with the SwiGLU folded in (the MLP's down_proj): H100, 0.8B, 4 rows, that product took 24 us against
# XLA's 7.7 for its product, reduction and SwiGLU kernels (docs/performance.md run 16).
OUTPUT_SPLIT_MAX_ROWS = 4
# At most this many splits there (:func:`.skinny_triton.partials_plan`): the add + norm kernel loads every split's
# row, one program per row. H100 (run 16): with the usual plan's 16-28 splits that kernel took 3-4.4 us instead of
# 1.5.
OUTPUT_SPLIT_MAX_SPLITS = 4
# With the SwiGLU (the MLP's down_proj) those rows still run the split kernel, the SwiGLU formed first by XLA (one
# elementwise kernel, as on XLA's own path) rather than inside the kernel (the 24 us above): the product's split-K sum
# then happens in the add + norm kernel, where XLA ran a separate reduction kernel after its product. H100, 0.8B k = 3
# (docs/performance.md run 19): 24 kernels fewer per step, down_proj 5.2-6.7 us against XLA's 5.3 + 1.2, the step
# 1.694 against 1.757 ms in one process's alternating rounds (lower in all 8); 4B unchanged (4.536 against 4.544).
OUTPUT_SPLIT_SWIGLU_APART = True


def output_linear(x, w_t, *, swiglu: bool = False, implementation: str = "xla", partials: bool = False,
                  residual=None):
    """``x @ w_t^T`` for a block's output product, the weight stored ``w_t [N, K]``; x [..., K], or with ``swiglu``
    the gate|up projection's output [..., >= 2K] whose ``silu(gate) * up``
    (:func:`jaxmtp.pallas.matmul.reference.swiglu_reference`) is the product's input. Returns [..., N] in x's
    dtype. ``"triton"`` / ``"triton_interpret"``: up to ``OUTPUT_GEMV_MAX_ROWS`` rows with :mod:`.gemv_triton`, up to
    ``OUTPUT_SKINNY_MAX_ROWS`` with :mod:`.skinny_triton`, and with ``partials`` (the caller accepts a
    :class:`SplitSum`) up to ``OUTPUT_SPLIT_MAX_ROWS`` with it split along K, unsummed (a SwiGLU formed by XLA
    first: ``OUTPUT_SPLIT_SWIGLU_APART``). A quantised ``w_t``
    (:func:`is_quantized`) runs :func:`quantized_linear` after the SwiGLU; ``residual`` [..., N] (quantised
    ``w_t`` only) returns ``residual + product`` instead, the add inside the kernel where
    :func:`layer_gemv_fuses`."""
    if is_quantized(w_t):
        q, scale = w_t["weight"], w_t["scale"]
        if _layer_gemv(x, q, implementation, swiglu) and (residual is None or FUSE_LAYER_NORMS):
            return gemv_matmul_triton(x, q, scale, transpose_w=True, out_dtype=x.dtype, swiglu=swiglu,
                                      residual=residual, interpret=implementation == TRITON_INTERPRET)
        xin = swiglu_reference(x, q.shape[1]) if swiglu else x
        y = quantized_linear(xin, q, scale, out_dtype=x.dtype, implementation=implementation)
        return y if residual is None else residual + y
    if residual is not None:
        raise ValueError("output_linear adds a residual for quantised weights only")
    kdim = w_t.shape[1]
    rows = math.prod(x.shape[:-1])
    if (implementation in (TRITON, TRITON_INTERPRET) and rows <= OUTPUT_GEMV_MAX_ROWS
            and gemv_supports(rows, kdim, w_t.shape[0], True, w_t.dtype)):
        return gemv_matmul_triton(x, w_t, transpose_w=True, swiglu=swiglu, interpret=implementation == TRITON_INTERPRET)
    n = w_t.shape[0]
    if (partials and (OUTPUT_SPLIT_SWIGLU_APART or not swiglu) and implementation in (TRITON, TRITON_INTERPRET)
            and rows <= OUTPUT_SPLIT_MAX_ROWS and supports(rows, kdim, n)):
        bn, bk, splits = partials_plan(rows, kdim, n, OUTPUT_SPLIT_MAX_SPLITS)
        if splits > 1:
            return skinny_matmul_triton(swiglu_reference(x, kdim) if swiglu else x, w_t, transpose_w=True,
                                        mask_rows=True, partials=True, block_n=bn, block_k=bk, splits=splits,
                                        interpret=implementation == TRITON_INTERPRET)
    if implementation in (TRITON, TRITON_INTERPRET) and rows <= OUTPUT_SKINNY_MAX_ROWS and supports(rows, kdim, n):
        bn, bk, warps, stages = output_plan(kdim, n)
        return skinny_matmul_triton(x, w_t, transpose_w=True, swiglu=swiglu, mask_rows=True, block_n=bn, block_k=bk,
                                    num_warps=warps, num_stages=stages,
                                    interpret=implementation == TRITON_INTERPRET)
    return matmul_reference(swiglu_reference(x, kdim) if swiglu else x, w_t, transpose_w=True)


def _layer_gemv(x, q, implementation: str, swiglu: bool = False) -> bool:
    """Whether an int8 MTP-layer product (see ``LAYER_GEMV_MAX_N``) runs the multiply-add kernel, scale inside."""
    kdim = q.shape[1]
    return (x.shape[-1] >= (2 * kdim if swiglu else kdim) and (swiglu or x.shape[-1] == kdim)
            and _layer_gemv_shape(math.prod(x.shape[:-1]), kdim, q, implementation))


def _layer_gemv_shape(rows: int, kdim: int, q, implementation: str) -> bool:
    """:func:`_layer_gemv` for a product of ``rows`` rows with the input width K."""
    return (implementation in (TRITON, TRITON_INTERPRET) and q.dtype == jnp.int8 and q.shape[0] <= LAYER_GEMV_MAX_N
            and rows <= LAYER_GEMV_MAX_ROWS and gemv_supports(rows, kdim, q.shape[0], True, q.dtype))


def quantized_linear(x, q, scale, *, out_dtype=jnp.float32, implementation: str = "xla"):
    """A quantised product as ``out_dtype`` [..., N] (float32 by default: the draft head's logits): x [..., K];
    per-row ``scale [N]``; ``q`` int8 [N, K] (result ``(x @ q^T) * scale``, the float32 product scaled, then cast)
    or int4 packed as uint8 [N, K/2] (:func:`jaxmtp.pallas.matmul.reference.unpack_int4`).
    An int4 head multiplies the rows quantised to int8 (:func:`jaxmtp.pallas.matmul.reference.w4a8_matmul_reference`:
    ``(xq @ q^T) * row_scale * scale``, the integer sums exact) on every path, so that every backend and row count
    drafts alike. ``"triton"`` streams the quantised weight: one int8 row with :mod:`.gemv_triton`, up to
    ``W4A8_MAX_ROWS`` int4 rows with :mod:`.w4a8_triton`, else up to ``MAX_ROWS`` rows with :mod:`.skinny_triton`
    (int4: the int8 rows as bfloat16, exact); more rows, or other names, run the reference."""
    n = q.shape[0]
    int4 = q.dtype == jnp.uint8
    lead, kdim = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    interpret = implementation == TRITON_INTERPRET
    kernel = implementation in (TRITON, TRITON_INTERPRET)
    if int4:
        if kernel and rows <= W4A8_MAX_ROWS and w4a8_supports(rows, kdim, n):
            return w4a8_matmul_triton(x, as_words(q), scale, interpret=interpret).astype(out_dtype)
        if kernel and supports(rows, kdim, n, int4=True):
            xq, rs = quantize_rows_int8(x.reshape(rows, kdim))
            y = skinny_matmul_triton(xq.astype(x.dtype), q, transpose_w=True, out_dtype="float32", interpret=interpret)
            return (y * rs[:, None] * scale).reshape(*lead, n).astype(out_dtype)
        return w4a8_matmul_reference(x, q, scale).astype(out_dtype)
    gemv_rows = LAYER_GEMV_MAX_ROWS if n <= LAYER_GEMV_MAX_N else GEMV_MAX_ROWS  # an MTP layer product, or a head
    if kernel and rows <= gemv_rows and gemv_supports(rows, kdim, n, True, q.dtype):
        return gemv_matmul_triton(x, q, scale, transpose_w=True, out_dtype=out_dtype, interpret=interpret)
    if kernel and supports(rows, kdim, n):
        if SKINNY_COLUMN_SCALE and 16 * NUM_SMS <= n <= LAYER_GEMV_MAX_N:  # an MTP layer product, N >= a wave
            return skinny_matmul_triton(x, q, scale, transpose_w=True, out_dtype=out_dtype, mask_rows=True,
                                        interpret=interpret)
        y = skinny_matmul_triton(x, q, transpose_w=True, out_dtype="float32", mask_rows=True, interpret=interpret)
        return (y * scale).astype(out_dtype)
    return quantized_matmul_reference(x, q, scale).astype(out_dtype)


def argmax_partials_apply(rows: int, kdim: int, q, implementation: str) -> bool:
    """Whether :func:`quantized_argmax_partials` runs its kernel: an int4 head, up to ``DRAFT_ARGMAX_MAX_ROWS`` rows,
    ``"triton"`` / ``"triton_interpret"``."""
    return (q.dtype == jnp.uint8 and implementation in (TRITON, TRITON_INTERPRET)
            and rows <= min(DRAFT_ARGMAX_MAX_ROWS, W4A8_MAX_ROWS) and w4a8_supports(rows, kdim, q.shape[0]))


def quantized_argmax_partials(x, q, scale, *, implementation: str = "xla", quantized=None):
    """What :func:`quantized_argmax` computes, left before the argmax kernel's last reduction where that kernel runs
    (:func:`argmax_partials_apply`): ``(vals, idx)`` ``[rows, G]`` (:func:`w4a8_argmax_partials_triton`), else None.
    ``quantized``: x's rows in int8 form already (:func:`jaxmtp.pallas.norms.add_rms_norm_quantized`)."""
    rows, kdim = math.prod(x.shape[:-1]), x.shape[-1]
    if argmax_partials_apply(rows, kdim, q, implementation):
        partials = w4a8_argmax_partials_triton(x.reshape(rows, kdim), as_words(q), scale, quantized=quantized,
                                               interpret=implementation == TRITON_INTERPRET)
        return tuple(a[:rows] for a in partials)  # the kernel pads rows to a power of two
    return None


def quantized_argmax(x, q, scale, *, implementation: str = "xla"):
    """``argmax(quantized_linear(x, q, scale), axis=-1)`` as int32 [...] (the drafts' greedy choice). Where
    :func:`quantized_argmax_partials` runs its kernel the logits are never written; the index is the same (the first
    of the largest values, computed as the product kernel computes them)."""
    partials = quantized_argmax_partials(x, q, scale, implementation=implementation)
    if partials is not None:
        return argmax_from_partials(*partials).reshape(x.shape[:-1])
    return jnp.argmax(quantized_linear(x, q, scale, implementation=implementation), axis=-1).astype(jnp.int32)


__all__ = ["MAX_ROWS", "argmax_from_partials", "argmax_partials_apply", "gemv_matmul_triton", "is_quantized",
           "layer_gemv_fuses", "layer_swiglu", "linear", "matmul_reference", "output_linear", "quantized_argmax",
           "quantized_argmax_partials", "quantized_linear", "quantized_matmul_reference", "skinny_matmul_triton",
           "supports", "swiglu_reference", "w4a8_argmax_triton", "w4a8_matmul_reference", "w4a8_matmul_triton"]
