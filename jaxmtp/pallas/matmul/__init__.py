"""Projections ``x @ W``: the jnp reference, and a GPU kernel for few rows (decode and verify).

``linear(x, w, implementation=...)``: ``"xla"`` is the reference; ``"triton"`` / ``"triton_interpret"`` run
:func:`skinny_matmul_triton` for products of at most ``KERNEL_MAX_ROWS`` rows whose weight is large enough to matter
(>= 2^20 elements), else the reference. ``quantized_linear`` is the int8 draft head's product. TPU names run the
reference: XLA's TPU matmuls have no measured problem here (no TPU is available to measure one).
"""

from __future__ import annotations

import math

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.matmul import fused_triton
from jaxmtp.pallas.matmul.reference import (linear_residual_reference, matmul_reference, norm_linear_reference,
                                            quantized_matmul_reference)
from jaxmtp.pallas.matmul.skinny_triton import MAX_ROWS, skinny_matmul_triton, supports

MIN_WEIGHT_ELEMENTS = 1 << 20  # smaller projections (GDN gates, MoE router) stay with XLA, which fuses them
# Products with more rows stay with XLA (at most skinny_triton.MAX_ROWS). Measured on an H200 (0.8B shape): the
# kernel fixes XLA's slow single-row products (batch-1 decode 7.8 -> 1.8 ms), but with 8-32 rows it was 5-10% slower
# than XLA's gemms.
KERNEL_MAX_ROWS = 1


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
    """``(x @ q^T) * scale`` as float32 [..., N]: x [..., K]; q [N, K] int8 with per-row ``scale [N]`` (the draft
    head, :mod:`jaxmtp.param_layout`). ``"triton"`` streams the int8 weight for up to ``MAX_ROWS`` rows (the
    slots of a draft step); more rows, or other names, run the reference."""
    n = q.shape[0]
    rows = math.prod(x.shape[:-1])
    if implementation in (TRITON, TRITON_INTERPRET) and supports(rows, x.shape[-1], n):
        y = skinny_matmul_triton(x, q, transpose_w=True, out_dtype="float32",
                                 interpret=implementation == TRITON_INTERPRET)
        return y * scale
    return quantized_matmul_reference(x, q, scale)


# Tiles of the fused kernels (H200 sweep, docs/performance.md): norm -> product over [K, N] column slabs of BN;
# product -> + residual over rows of the [N, K] weight, BN rows per program, BK columns per loop step.
NORM_LINEAR_TILES = dict(block_n=64, block_k=256, num_warps=4, num_stages=3)
LINEAR_RESIDUAL_TILES = dict(block_n=32, block_k=1024, num_warps=4, num_stages=3)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _divisor_tile(size: int, preferred: int, smallest: int = 16) -> int:
    """The largest power of two <= ``preferred`` (and >= ``smallest``) dividing ``size``; 0 if none."""
    b = preferred
    while b >= smallest:
        if size % b == 0:
            return b
        b //= 2
    return 0


def norm_linear(x, norm_w, w, *, eps: float, swiglu_width: int | None = None, implementation: str = "xla"):
    """``rms_norm(x) @ w``, or with ``swiglu_width`` I ``silu(h @ w[:, :I]) * (h @ w[:, I:2I])``; x [..., K],
    w [K, N]. ``"triton"`` runs :func:`fused_triton.norm_linear_triton` for up to ``fused_triton.MAX_ROWS`` rows."""
    k = x.shape[-1]
    n = swiglu_width or w.shape[1]
    t = dict(NORM_LINEAR_TILES, block_n=_divisor_tile(n, NORM_LINEAR_TILES["block_n"]),
             block_k=_divisor_tile(k, NORM_LINEAR_TILES["block_k"]))
    if implementation in (TRITON, TRITON_INTERPRET) and t["block_n"] and t["block_k"] and (
            fused_triton.norm_linear_supported(_rows(x), k, n, t["block_n"], t["block_k"])):
        return fused_triton.norm_linear_triton(x, norm_w, w, eps=eps, swiglu_width=swiglu_width,
                                               interpret=implementation == TRITON_INTERPRET, **t)
    return norm_linear_reference(x, norm_w, w, eps=eps, swiglu_width=swiglu_width)


def linear_residual(x, w_t, residual, aux=(), *, prologue: str = "none", aux_offset: int = 0, head_dim: int = 0,
                    eps: float = 1e-6, implementation: str = "xla"):
    """``residual + prologue(x) @ w_t^T``; x [..., K], w_t [N, K] (see :func:`fused_triton.linear_residual_triton`
    for the prologues). ``"triton"`` runs the kernel for up to ``fused_triton.MAX_ROWS`` rows."""
    k = x.shape[-1]
    if prologue == fused_triton.GATED_RMS:
        sub = head_dim
    else:  # the sigmoid gate's sub-chunks stay within a head
        sub = _divisor_tile(k, min(128, head_dim) if prologue == fused_triton.SIGMOID_GATE else 128)
    t = dict(LINEAR_RESIDUAL_TILES, block_n=_divisor_tile(w_t.shape[0], LINEAR_RESIDUAL_TILES["block_n"]))
    # the largest multiple of sub dividing K, up to the tile's block_k
    t["block_k"] = max([b for b in range(sub, max(t["block_k"], sub) + 1, sub) if k % b == 0] or [sub]) if sub else 0
    kw = dict(prologue=prologue, aux_offset=aux_offset, head_dim=head_dim, eps=eps)
    if (implementation in (TRITON, TRITON_INTERPRET) and sub and t["block_n"]
            and fused_triton.linear_residual_supported(_rows(x), x.shape[-1], w_t.shape[0], t["block_n"],
                                                       t["block_k"], sub)
            and (prologue != fused_triton.SIGMOID_GATE or head_dim % sub == 0)):
        return fused_triton.linear_residual_triton(x, w_t, residual, tuple(aux), sub_k=sub,
                                                   interpret=implementation == TRITON_INTERPRET, **kw, **t)
    return linear_residual_reference(x, w_t, residual, tuple(aux), **kw)


__all__ = ["MAX_ROWS", "linear", "linear_residual", "linear_residual_reference", "matmul_reference", "norm_linear",
           "norm_linear_reference", "quantized_linear", "quantized_matmul_reference", "skinny_matmul_triton",
           "supports"]
