"""Projections ``x @ W``: the jnp reference, and a GPU kernel for few rows (decode and verify).

``linear(x, w, implementation=...)``: ``"xla"`` is the reference; ``"triton"`` / ``"triton_interpret"`` run
:func:`skinny_matmul_triton` for products of at most ``KERNEL_MAX_ROWS`` rows whose weight is large enough to matter
(>= 2^20 elements), else the reference. ``quantized_linear`` is the int8 draft head's product. TPU names run the
reference: XLA's TPU matmuls have no measured problem here (no TPU is available to measure one).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.matmul.reference import matmul_reference, quantized4_matmul_reference, quantized_matmul_reference
from jaxmtp.pallas.matmul.gemv_triton import gemv_matmul_triton
from jaxmtp.pallas.matmul.gemv_triton import supports as gemv_supports
from jaxmtp.pallas.matmul.skinny_triton import MAX_ROWS, skinny_matmul_triton, supports

MIN_WEIGHT_ELEMENTS = 1 << 20  # smaller projections (GDN gates, MoE router) stay with XLA, which fuses them
# Products with more rows stay with XLA (at most skinny_triton.MAX_ROWS). Measured on an H200 (0.8B shape): the
# kernel fixes XLA's slow single-row products (batch-1 decode 7.8 -> 1.8 ms), but with 8-32 rows it was 5-10% slower
# than XLA's gemms.
KERNEL_MAX_ROWS = 1
# The quantised draft head's one-row product (a batch-1 draft) runs the multiply-add kernel: on an H100 the 4B head
# took 231 us as int8 against 249 us with the tensor-core kernel, and 208 against 211 us as int4
# (docs/performance.md, run 9). With more rows each row repeats the multiply-adds: the tensor-core kernel.
GEMV_MAX_ROWS = 1


def linear(x, w, *, transpose_w: bool = False, out_dtype=None, implementation: str = "xla"):
    """x: [..., K]; w: [K, N] (or [N, K] with ``transpose_w``). Returns [..., N] (``out_dtype``, default x.dtype)."""
    if implementation in (TRITON, TRITON_INTERPRET) and w.size >= MIN_WEIGHT_ELEMENTS:
        n = w.shape[0] if transpose_w else w.shape[1]
        rows = math.prod(x.shape[:-1])
        if rows <= KERNEL_MAX_ROWS and supports(rows, x.shape[-1], n):
            return skinny_matmul_triton(x, w, transpose_w=transpose_w, out_dtype=out_dtype,
                                        interpret=implementation == TRITON_INTERPRET)
    return matmul_reference(x, w, transpose_w=transpose_w, out_dtype=out_dtype)


def quantized_linear(x, q, scale, *, implementation: str = "xla"):
    """``(x @ q^T) * scale`` as float32 [..., N]: x [..., K]; q [N, K] int8, or int4 packed as uint8 [N, K/2]
    (:func:`jaxmtp.pallas.matmul.reference.unpack_int4`), with per-row ``scale [N]`` (the draft head,
    :mod:`jaxmtp.param_layout`). ``"triton"`` streams the quantised weight for up to ``MAX_ROWS`` rows (the slots of a
    draft step; one row with :mod:`.gemv_triton`, more with :mod:`.skinny_triton`); more rows, or other names, run
    the reference."""
    n = q.shape[0]
    int4 = q.dtype == jnp.uint8
    rows = math.prod(x.shape[:-1])
    interpret = implementation == TRITON_INTERPRET
    if (implementation in (TRITON, TRITON_INTERPRET) and rows <= GEMV_MAX_ROWS
            and gemv_supports(rows, x.shape[-1], n, True, q.dtype)):
        return gemv_matmul_triton(x, q, transpose_w=True, interpret=interpret) * scale
    if implementation in (TRITON, TRITON_INTERPRET) and supports(rows, x.shape[-1], n, int4=int4):
        y = skinny_matmul_triton(x, q, transpose_w=True, out_dtype="float32", interpret=interpret)
        return y * scale
    return (quantized4_matmul_reference if int4 else quantized_matmul_reference)(x, q, scale)


__all__ = ["MAX_ROWS", "gemv_matmul_triton", "linear", "matmul_reference", "quantized4_matmul_reference",
           "quantized_linear", "quantized_matmul_reference", "skinny_matmul_triton", "supports"]
