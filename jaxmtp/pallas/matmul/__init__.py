"""Projections ``x @ W``: the jnp reference, and GPU kernels for few rows (decode and verify).

``linear(x, w, implementation=..., policy=...)``: ``"xla"`` is the reference; ``"triton"`` / ``"triton_interpret"``
run :func:`skinny_matmul_triton` for products of at most ``policy.kernel_max_rows`` rows whose weight is large
enough to matter (``policy.min_weight_elements``), else the reference. :func:`output_linear` is a block's output
product (weights stored [N, K]); :func:`quantized_linear` the quantised (int8 or int4) draft head's and int8 MTP
layer's product; :func:`layer_gemv` the int8 MTP layer's one-row product with its norm, residual add or SwiGLU
inside. Every threshold comes from the :class:`jaxmtp.pallas.policy.KernelPolicy` passed in. TPU names run the
reference: XLA's TPU matmuls have no measured problem here (no TPU is available to measure one).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.matmul.fp8_triton import fp8_matmul_triton
from jaxmtp.pallas.matmul.fp8_triton import supports as fp8_supports
from jaxmtp.pallas.matmul.fp8_triton import tail_applies as fp8_tail_supported
from jaxmtp.pallas.matmul.gemv_triton import gemv_matmul_triton
from jaxmtp.pallas.matmul.gemv_triton import plan as gemv_plan
from jaxmtp.pallas.matmul.gemv_triton import supports as gemv_supports
from jaxmtp.pallas.matmul.reference import (argmax_from_partials, as_words, dequantize_fp8, fp8_matmul_reference,
                                            matmul_reference,
                                            quantize_rows_int8, quantized_matmul_reference, swiglu_reference,
                                            w4a8_matmul_reference)
from jaxmtp.pallas.matmul.skinny_triton import MAX_ROWS, output_plan, partials_plan, skinny_matmul_triton, supports
from jaxmtp.pallas.matmul.w4a8_triton import supports as w4a8_supports
from jaxmtp.pallas.matmul.w4a8_triton import w4a8_argmax_partials_triton, w4a8_argmax_triton, w4a8_matmul_triton
from jaxmtp.pallas.policy import DEFAULT_POLICY, KernelPolicy


def _kernel(implementation: str) -> bool:
    return implementation in (TRITON, TRITON_INTERPRET)


def is_fp8(w) -> bool:
    """Whether ``w`` is a block-FP8 weight ``{"weight": e4m3 [N, K], "block_scale": float32 [ceil(N/128),
    ceil(K/128)]}`` (:mod:`jaxmtp.fp8`), run by :func:`fp8_linear`."""
    return isinstance(w, dict) and "block_scale" in w


def fp8_linear(x, w, *, out_dtype=None, implementation: str = "xla", policy: KernelPolicy = DEFAULT_POLICY):
    """``x @ dequant(W)^T`` [..., N] for a block-FP8 weight (:func:`is_fp8`); x [..., K]. ``"triton"`` /
    ``"triton_interpret"``: up to ``policy.fp8_kernel_max_rows`` rows with :mod:`.fp8_triton` (e4m3 bytes read,
    float32 accumulation), where it takes the shape; else (prefill, other backends) the reference, which dequantises
    the weight to x's dtype first (:func:`jaxmtp.pallas.matmul.reference.fp8_matmul_reference`)."""
    q, s = w["weight"], w["block_scale"]
    rows = math.prod(x.shape[:-1])
    if _kernel(implementation) and rows <= policy.fp8_kernel_max_rows and fp8_supports(rows, q.shape[1], q.shape[0]):
        return fp8_matmul_triton(x, q, s, out_dtype=out_dtype, fma_max_rows=policy.fp8_fma_max_rows,
                                 lanes=policy.fp8_fma_lanes, dot_min_programs=policy.fp8_dot_min_programs,
                                 interpret=implementation == TRITON_INTERPRET)
    return fp8_matmul_reference(x, q, s, out_dtype=out_dtype)


def fp8_tail_applies(x_shape, w, tail, implementation: str, policy: KernelPolicy = DEFAULT_POLICY) -> bool:
    """Whether :func:`fp8_linear_with_tail` runs ``x @ [dequant(W)^T | tail]`` as one launch: a block-FP8 ``w``, a
    floating ``tail [K, N2]``, the policy's ``fp8_tail`` on, a kernel implementation and rows on the one-split
    multiply-add path."""
    if not (policy.fp8_tail and is_fp8(w) and isinstance(tail, jax.Array) and tail.ndim == 2
            and jnp.issubdtype(tail.dtype, jnp.floating) and _kernel(implementation)):
        return False
    q = w["weight"]
    rows, k = math.prod(x_shape[:-1]), x_shape[-1]
    return (tail.shape[0] == k == q.shape[1] and rows <= policy.fp8_kernel_max_rows
            and fp8_tail_supported(rows, k, q.shape[0], fma_max_rows=policy.fp8_fma_max_rows,
                                   dot_min_programs=policy.fp8_dot_min_programs))


def fp8_linear_with_tail(x, w, tail, *, implementation: str, policy: KernelPolicy = DEFAULT_POLICY):
    """``concat(x @ dequant(W)^T, x @ tail)`` [..., N + N2] in x's dtype, one launch (only where
    :func:`fp8_tail_applies`): the FP8 kernel's extra programs form the floating tail's columns."""
    return fp8_matmul_triton(x, w["weight"], w["block_scale"], fma_max_rows=policy.fp8_fma_max_rows,
                             lanes=policy.fp8_fma_lanes, dot_min_programs=policy.fp8_dot_min_programs, tail=tail,
                             interpret=implementation == TRITON_INTERPRET)


def is_quantized(w) -> bool:
    """Whether ``w`` is a quantised weight ``{"weight": int8 [N, K], "scale": float32 [N]}``
    (:func:`jaxmtp.quantize.quantize_mtp`) rather than an array."""
    return isinstance(w, dict) and "scale" in w


def layer_gemv_applies(rows: int, w, implementation: str, policy: KernelPolicy = DEFAULT_POLICY) -> bool:
    """Whether a product of ``rows`` rows with ``w`` runs the int8 MTP layer's multiply-add kernel
    (:func:`layer_gemv`): an int8 weight with at most ``policy.layer_gemv_max_n`` outputs, at most
    ``policy.layer_gemv_max_rows`` rows, a kernel implementation."""
    if not (is_quantized(w) and _kernel(implementation)):
        return False
    q = w["weight"]
    return (q.dtype == jnp.int8 and q.shape[0] <= policy.layer_gemv_max_n and rows <= policy.layer_gemv_max_rows
            and gemv_supports(rows, q.shape[1], q.shape[0], True, q.dtype))


def layer_gemv(x, w, *, implementation: str, norm=None, residual=None, swiglu: bool = False, glu_width=None,
               out_dtype=None):
    """The int8 MTP layer's one-row product (only where :func:`layer_gemv_applies`): x [..., K]; ``norm = (weight,
    eps)``: the product's input is ``rms_norm(x)``, formed inside; ``residual`` [..., N]: returns ``residual + x @ W``;
    ``swiglu``: x is [..., >= 2K] (gate | up), the input ``silu(gate) * up``; ``glu_width`` I: returns the SwiGLU of
    the product's two halves [..., I] (:func:`.gemv_triton.gemv_matmul_triton`)."""
    extra = dict(norm_weight=norm[0], norm_eps=norm[1]) if norm is not None else {}
    return gemv_matmul_triton(x, w["weight"], w["scale"], transpose_w=True, out_dtype=out_dtype or x.dtype,
                              swiglu=swiglu, residual=residual, glu_width=glu_width,
                              interpret=implementation == TRITON_INTERPRET, **extra)


def layer_swiglu_applies(x_shape, w, width: int, implementation: str, policy: KernelPolicy = DEFAULT_POLICY) -> bool:
    """Whether a quantised gate|up product forms its SwiGLU inside :func:`layer_gemv` (``glu_width=width``): the
    layer kernel runs and each program's slab of outputs falls within one half."""
    rows = math.prod(x_shape[:-1])
    if not layer_gemv_applies(rows, w, implementation, policy):
        return False
    bn = gemv_plan(x_shape[-1], w["weight"].shape[0], True, w["weight"].dtype, rows)[0]
    return width % bn == 0 and 2 * width <= w["weight"].shape[0]


def linear(x, w, *, transpose_w: bool = False, out_dtype=None, implementation: str = "xla",
           policy: KernelPolicy = DEFAULT_POLICY):
    """x: [..., K]; w: [K, N] (or [N, K] with ``transpose_w``), or a quantised weight (:func:`is_quantized`, run by
    :func:`quantized_linear`; :func:`is_fp8`, run by :func:`fp8_linear`). Returns [..., N] (``out_dtype``, default
    x.dtype)."""
    if is_fp8(w):
        return fp8_linear(x, w, out_dtype=out_dtype, implementation=implementation, policy=policy)
    if is_quantized(w):
        return quantized_linear(x, w["weight"], w["scale"], out_dtype=out_dtype or x.dtype,
                                implementation=implementation, policy=policy)
    if _kernel(implementation) and w.size >= policy.min_weight_elements:
        n = w.shape[0] if transpose_w else w.shape[1]
        rows = math.prod(x.shape[:-1])
        if rows <= policy.kernel_max_rows and supports(rows, x.shape[-1], n):
            return skinny_matmul_triton(x, w, transpose_w=transpose_w, out_dtype=out_dtype, mask_rows=True,
                                        num_sms=policy.sms, interpret=implementation == TRITON_INTERPRET)
    return matmul_reference(x, w, transpose_w=transpose_w, out_dtype=out_dtype)


def output_linear(x, w_t, *, swiglu: bool = False, implementation: str = "xla", partials: bool = False,
                  residual=None, policy: KernelPolicy = DEFAULT_POLICY):
    """``x @ w_t^T`` for a block's output product, the weight stored ``w_t [N, K]``; x [..., K], or with ``swiglu``
    the gate|up projection's output [..., >= 2K] whose ``silu(gate) * up``
    (:func:`jaxmtp.pallas.matmul.reference.swiglu_reference`) is the product's input. Returns [..., N] in x's
    dtype. ``"triton"`` / ``"triton_interpret"``: up to ``policy.output_gemv_max_rows`` rows with :mod:`.gemv_triton`
    (no split along K, the SwiGLU inside), with ``partials`` (the caller accepts a
    :class:`jaxmtp.pallas._common.SplitSum`) up to ``policy.output_split_max_rows`` with :mod:`.skinny_triton` split
    along K and unsummed (a SwiGLU formed by XLA first), up to ``policy.output_skinny_max_rows`` with it in one split.
    A quantised ``w_t`` (:func:`is_quantized`) runs :func:`layer_gemv` where it applies, else :func:`quantized_linear`
    after the SwiGLU; ``residual`` [..., N] (quantised ``w_t`` only) returns ``residual + product``, the add inside
    the kernel where :func:`layer_gemv` runs."""
    if is_quantized(w_t):
        q, scale = w_t["weight"], w_t["scale"]
        kdim = q.shape[1]
        width_ok = x.shape[-1] >= 2 * kdim if swiglu else x.shape[-1] == kdim
        if width_ok and layer_gemv_applies(math.prod(x.shape[:-1]), w_t, implementation, policy):
            return layer_gemv(x, w_t, implementation=implementation, swiglu=swiglu, residual=residual)
        xin = swiglu_reference(x, kdim) if swiglu else x
        y = quantized_linear(xin, q, scale, out_dtype=x.dtype, implementation=implementation, policy=policy)
        return y if residual is None else residual + y
    if residual is not None:
        raise ValueError("output_linear adds a residual for quantised weights only")
    kdim, n = w_t.shape[1], w_t.shape[0]
    rows = math.prod(x.shape[:-1])
    interpret = implementation == TRITON_INTERPRET
    if _kernel(implementation) and rows <= policy.output_gemv_max_rows and gemv_supports(rows, kdim, n, True,
                                                                                         w_t.dtype):
        return gemv_matmul_triton(x, w_t, transpose_w=True, swiglu=swiglu, interpret=interpret)
    if partials and _kernel(implementation) and rows <= policy.output_split_max_rows and supports(rows, kdim, n):
        bn, bk, splits = partials_plan(rows, kdim, n, policy.output_split_max_splits, policy.sms)
        if splits > 1:
            return skinny_matmul_triton(swiglu_reference(x, kdim) if swiglu else x, w_t, transpose_w=True,
                                        mask_rows=True, partials=True, block_n=bn, block_k=bk, splits=splits,
                                        interpret=interpret)
    if _kernel(implementation) and rows <= policy.output_skinny_max_rows and supports(rows, kdim, n):
        bn, bk, warps, stages = output_plan(kdim, n)
        return skinny_matmul_triton(x, w_t, transpose_w=True, swiglu=swiglu, mask_rows=True, block_n=bn, block_k=bk,
                                    num_warps=warps, num_stages=stages, interpret=interpret)
    return matmul_reference(swiglu_reference(x, kdim) if swiglu else x, w_t, transpose_w=True)


def quantized_linear(x, q, scale, *, out_dtype=jnp.float32, implementation: str = "xla",
                     policy: KernelPolicy = DEFAULT_POLICY):
    """A quantised product as ``out_dtype`` [..., N] (float32 by default: the draft head's logits): x [..., K];
    per-row ``scale [N]``; ``q`` int8 [N, K] (result ``(x @ q^T) * scale``, the float32 product scaled, then cast)
    or int4 packed as uint8 [N, K/2] (:func:`jaxmtp.pallas.matmul.reference.unpack_int4`).
    An int4 head multiplies the rows quantised to int8 (:func:`jaxmtp.pallas.matmul.reference.w4a8_matmul_reference`:
    ``(xq @ q^T) * row_scale * scale``, the integer sums exact) on every path, so that every backend and row count
    drafts alike. ``"triton"`` streams the quantised weight: int8 rows up to ``policy.layer_gemv_max_rows`` (an MTP
    layer product, N <= ``policy.layer_gemv_max_n``) or ``policy.gemv_max_rows`` (a head) with :mod:`.gemv_triton`,
    int4 rows up to ``policy.w4a8_max_rows`` with :mod:`.w4a8_triton`, else up to ``MAX_ROWS`` rows with
    :mod:`.skinny_triton` (int4: the int8 rows as bfloat16, exact; an MTP layer product at least a wave of 16-column
    slabs wide takes its column scale inside, one split); more rows, or other names, run the reference."""
    n = q.shape[0]
    int4 = q.dtype == jnp.uint8
    lead, kdim = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    interpret = implementation == TRITON_INTERPRET
    kernel = _kernel(implementation)
    if int4:
        if kernel and rows <= policy.w4a8_max_rows and w4a8_supports(rows, kdim, n):
            return w4a8_matmul_triton(x, as_words(q), scale, interpret=interpret).astype(out_dtype)
        if kernel and supports(rows, kdim, n, int4=True):
            xq, rs = quantize_rows_int8(x.reshape(rows, kdim))
            y = skinny_matmul_triton(xq.astype(x.dtype), q, transpose_w=True, out_dtype="float32", num_sms=policy.sms,
                                     interpret=interpret)
            return (y * rs[:, None] * scale).reshape(*lead, n).astype(out_dtype)
        return w4a8_matmul_reference(x, q, scale).astype(out_dtype)
    layer_product = n <= policy.layer_gemv_max_n
    gemv_rows = policy.layer_gemv_max_rows if layer_product else policy.gemv_max_rows
    if kernel and rows <= gemv_rows and gemv_supports(rows, kdim, n, True, q.dtype):
        return gemv_matmul_triton(x, q, scale, transpose_w=True, out_dtype=out_dtype, interpret=interpret)
    if kernel and supports(rows, kdim, n):
        if layer_product and n >= 16 * policy.sms:  # a wave of 16-column slabs: the column scale inside, one split
            return skinny_matmul_triton(x, q, scale, transpose_w=True, out_dtype=out_dtype, mask_rows=True,
                                        num_sms=policy.sms, interpret=interpret)
        y = skinny_matmul_triton(x, q, transpose_w=True, out_dtype="float32", mask_rows=True, num_sms=policy.sms,
                                 interpret=interpret)
        return (y * scale).astype(out_dtype)
    return quantized_matmul_reference(x, q, scale).astype(out_dtype)


def argmax_partials_apply(rows: int, kdim: int, q, implementation: str, policy: KernelPolicy = DEFAULT_POLICY) -> bool:
    """Whether :func:`quantized_argmax_partials` runs its kernel: an int4 head, up to ``policy.draft_argmax_max_rows``
    rows, ``"triton"`` / ``"triton_interpret"``."""
    return (q.dtype == jnp.uint8 and _kernel(implementation)
            and rows <= min(policy.draft_argmax_max_rows, policy.w4a8_max_rows) and w4a8_supports(rows, kdim, q.shape[0]))


def quantized_argmax_partials(x, q, scale, *, implementation: str = "xla", quantized=None,
                              policy: KernelPolicy = DEFAULT_POLICY):
    """What :func:`quantized_argmax` computes, left before the argmax kernel's last reduction where that kernel runs
    (:func:`argmax_partials_apply`): ``(vals, idx)`` ``[rows, G]`` (:func:`w4a8_argmax_partials_triton`), else None.
    ``quantized``: x's rows in int8 form already (:func:`jaxmtp.pallas.norms.add_rms_norm_quantized`)."""
    rows, kdim = math.prod(x.shape[:-1]), x.shape[-1]
    if argmax_partials_apply(rows, kdim, q, implementation, policy):
        partials = w4a8_argmax_partials_triton(x.reshape(rows, kdim), as_words(q), scale, quantized=quantized,
                                               interpret=implementation == TRITON_INTERPRET)
        return tuple(a[:rows] for a in partials)  # the kernel pads rows to a power of two
    return None


def quantized_argmax(x, q, scale, *, implementation: str = "xla", policy: KernelPolicy = DEFAULT_POLICY):
    """``argmax(quantized_linear(x, q, scale), axis=-1)`` as int32 [...] (the drafts' greedy choice). Where
    :func:`quantized_argmax_partials` runs its kernel the logits are never written; the index is the same (the first
    of the largest values, computed as the product kernel computes them)."""
    partials = quantized_argmax_partials(x, q, scale, implementation=implementation, policy=policy)
    if partials is not None:
        return argmax_from_partials(*partials).reshape(x.shape[:-1])
    return jnp.argmax(quantized_linear(x, q, scale, implementation=implementation, policy=policy),
                      axis=-1).astype(jnp.int32)


__all__ = ["MAX_ROWS", "argmax_from_partials", "argmax_partials_apply", "dequantize_fp8", "fp8_linear",
           "fp8_linear_with_tail", "fp8_matmul_reference", "fp8_matmul_triton", "fp8_tail_applies",
           "gemv_matmul_triton", "is_fp8", "is_quantized", "layer_gemv", "layer_gemv_applies", "layer_swiglu_applies",
           "linear", "matmul_reference", "output_linear", "quantized_argmax", "quantized_argmax_partials",
           "quantized_linear", "quantized_matmul_reference", "skinny_matmul_triton", "supports", "swiglu_reference",
           "w4a8_argmax_triton", "w4a8_matmul_reference", "w4a8_matmul_triton"]
