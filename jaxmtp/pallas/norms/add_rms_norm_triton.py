"""Fused residual add + zero-centred RMSNorm for GPU (Pallas, Triton lowering): one launch per add and norm.

Rows are the flattened leading axes (decode: one per batch slot). Grid ``(R,)``: a program reads one row of x and y,
writes ``s = x + y`` rounded to the input dtype (the residual stream, as the model's own add rounds it) and
``h = s / rms(s) * (1 + w)`` computed in float32 from the rounded ``s``. Triton tensors must have power-of-two sizes,
so a row of H is handled as ``H / C`` static chunks of ``C``, the largest power of two dividing H (capped at 4096):
one chunk for H = 1024, 2048, 4096, five of 512 / 1024 for H = 2560 / 5120. The chunks stay in registers between
the sum of squares and the write of ``h``; no padding, no masks. Picked by ``"auto"`` on NVIDIA GPUs:
one launch where XLA runs two after the product's split-K reduction (docs/kernels.md). :func:`rms_norm_triton` is the
same kernel without the add (the MTP layer's input norm).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import SplitSum, next_pow2
from jaxmtp.pallas.matmul.reference import INT4_BLOCK
from jaxmtp.pallas.matmul.w4a8_triton import WORDS_PER_BLOCK, _chunk_blocks, quantize_parts

MAX_CHUNK = 4096
MIN_CHUNK = 16
MAX_CHUNKS = 16


def chunk_size(h: int) -> int:
    """``C``: the largest power of two dividing ``h``, at most ``MAX_CHUNK``."""
    return min(h & -h, MAX_CHUNK)


def supports(h: int) -> bool:
    """Row lengths the kernel takes: ``H = n * C`` with ``C >= 16`` and at most 16 chunks (all Qwen3.5 sizes)."""
    return h > 0 and chunk_size(h) >= MIN_CHUNK and h // chunk_size(h) <= MAX_CHUNKS


def _kernel(*refs, chunk, eps, splits=0, quantize=False, interpret=False):
    """refs: ``x, y, w, s, h`` (add and norm) or ``x, w, h`` (norm only). ``splits`` > 0: y's ref holds that many
    float32 partial sums of the row ``[S, H]``, added here in split order and rounded to x's dtype (a
    :class:`jaxmtp.pallas._common.SplitSum`). ``quantize``: refs ``x, y, w, x5, y5, w5, s, h, xlo, xhi, rs, rsum``,
    and h's row is also quantised to int8 for the int4 draft head (:func:`_quantize_row`)."""
    q_refs = None
    if quantize:
        x_ref, y_ref, w_ref, *q_in, s_ref, h_ref = refs[:8]
        q_refs = (*q_in, *refs[8:])
    elif len(refs) == 3:
        x_ref, w_ref, h_ref = refs
        y_ref = s_ref = None
    else:
        x_ref, y_ref, w_ref, s_ref, h_ref = refs
    # Every load is issued before the first store: Triton keeps memory operations in program order where it cannot
    # prove the pointers distinct, so interleaving "load chunk j, store chunk j" costs one memory round trip per
    # chunk (5 at H = 2560).
    n = x_ref.shape[-1]
    sls = [pl.ds(j * chunk, chunk) for j in range(n // chunk)]
    xs = [x_ref[sl] for sl in sls]
    ws = [w_ref[sl] for sl in sls]
    if y_ref is None:
        ss = xs
    else:
        if splits:
            parts = [[y_ref[i, sl] for sl in sls] for i in range(splits)]
            ys = [functools.reduce(lambda a, b: a + b, [p[j] for p in parts]).astype(x_ref.dtype)
                  for j in range(len(sls))]
        else:
            ys = [y_ref[sl] for sl in sls]
        ss = [(x.astype(jnp.float32) + y.astype(jnp.float32)).astype(s_ref.dtype) for x, y in zip(xs, ys)]
    sq = jnp.zeros((chunk,), jnp.float32)
    for s in ss:
        s32 = s.astype(jnp.float32)
        sq = sq + s32 * s32  # one cross-thread reduction at the end, not one per chunk
    inv = jax.lax.rsqrt(jnp.sum(sq) / n + eps)
    for sl, s, w in zip(sls, ss, ws):
        if s_ref is not None:
            s_ref[sl] = s
        h_ref[sl] = (s.astype(jnp.float32) * inv * (1.0 + w.astype(jnp.float32))).astype(h_ref.dtype)
    if q_refs is not None:
        _quantize_row(*q_refs, inv=inv, dtype=h_ref.dtype, interpret=interpret)


def _quantize_row(x5_ref, y5_ref, w5_ref, xlo_ref, xhi_ref, rs_ref, rsum_ref, *, inv, dtype, interpret):
    """The row's h as :func:`jaxmtp.pallas.matmul.w4a8_triton.quantize_rows_triton` quantises it: the same h (the
    same rounded sum, norm and rounding to ``dtype``), recomputed from x, y and w read again in the packing's
    ``[K/128, 2, 16, 4]`` arrangement (registers cannot be regrouped), then int8 words, scale and sum."""
    f32 = jnp.float32
    nb = x5_ref.shape[0]
    c = _chunk_blocks(nb)

    def h_part(b, half):
        blk = (pl.ds(b, c), half)
        s = (x5_ref[blk].astype(f32) + y5_ref[blk].astype(f32)).astype(dtype).astype(f32)
        return (s * inv * (1.0 + w5_ref[blk].astype(f32))).astype(dtype).astype(f32)

    scale, rsum, words = quantize_parts([[h_part(b, half) for half in (0, 1)] for b in range(0, nb, c)],
                                        interpret=interpret)
    width = c * WORDS_PER_BLOCK
    for i, pair in enumerate(words):
        xlo_ref[pl.ds(i * width, width)] = pair[0]
        xhi_ref[pl.ds(i * width, width)] = pair[1]
    r = pl.program_id(0)
    rs_ref[pl.ds(r, 1)] = jnp.full((1,), scale, f32)
    rsum_ref[pl.ds(r, 1)] = jnp.full((1,), rsum, jnp.int32)


def _launch(rows_in, weight, eps, num_warps, interpret, name):
    """One program per row of the ``[R, H]`` arrays ``rows_in`` (x, or x and y; y may be ``[S, R, H]`` float32
    partial sums) and ``weight [H]``; returns the kernel's ``[R, H]`` outputs (h, or s and h) in x's dtype."""
    r, hdim = rows_in[0].shape
    row = pl.BlockSpec((None, hdim), lambda i: (i, 0))
    splits = rows_in[1].shape[0] if len(rows_in) == 2 and rows_in[1].ndim == 3 else 0
    in_specs = [row] * len(rows_in)
    if splits:
        in_specs[1] = pl.BlockSpec((splits, None, hdim), lambda i: (0, i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk_size(hdim), eps=float(eps), splits=splits),
        out_shape=[jax.ShapeDtypeStruct((r, hdim), rows_in[0].dtype)] * len(rows_in),
        grid=(r,),
        in_specs=in_specs + [pl.BlockSpec((hdim,), lambda i: (0,))],
        out_specs=[row] * len(rows_in),
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        interpret=interpret,
        name=name,
    )(*rows_in, weight)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def add_rms_norm_triton(x, y, weight, eps, *, num_warps=None, interpret=False):
    """Same contract as :func:`add_rms_norm_reference` for row lengths :func:`supports` accepts; ``y`` may be a
    :class:`SplitSum` of x's shape and dtype (its float32 parts are added in the kernel)."""
    hdim = x.shape[-1]
    if not supports(hdim):
        raise ValueError(f"unsupported row length H={hdim}: needs H = n * C, C a power of two >= 16, n <= 16")
    split = isinstance(y, SplitSum)
    if (y.shape != x.shape or y.dtype != x.dtype or weight.shape != (hdim,)
            or (split and y.parts.dtype != jnp.float32)):
        raise ValueError(f"shapes x {x.shape} {x.dtype}, y {y.shape} {y.dtype}, weight {weight.shape} do not match")
    y2 = y.parts.reshape(y.parts.shape[0], -1, hdim) if split else y.reshape(-1, hdim)
    s, h = _launch([x.reshape(-1, hdim), y2], weight, eps, num_warps, interpret, "add_rms_norm")
    return s.reshape(x.shape), h.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def rms_norm_triton(x, weight, eps, *, num_warps=None, interpret=False):
    """:func:`jaxmtp.pallas.norms.reference.rms_norm` (no residual add) with the same kernel: one launch where XLA runs two."""
    hdim = x.shape[-1]
    if not supports(hdim) or weight.shape != (hdim,):
        raise ValueError(f"unsupported row length H={hdim} or weight {weight.shape}")
    [h] = _launch([x.reshape(-1, hdim)], weight, eps, num_warps, interpret, "rms_norm")
    return h.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def add_rms_norm_quantized_triton(x, y, weight, eps, *, num_warps=None, interpret=False):
    """:func:`add_rms_norm_triton` (y dense) that also returns h's rows quantised for the int4 draft head, as
    :func:`jaxmtp.pallas.matmul.w4a8_triton.quantize_rows_triton` gives them from h: ``(s, h, (xlo, xhi, row_scale,
    row_sum))`` with xlo / xhi int32 ``[R, H/8]`` and the scale and sum ``[Rp]`` (Rp = next power of two >= R; the
    entries from R on are not written). The draft passes' final norm: one launch fewer before each head read."""
    hdim = x.shape[-1]
    if not supports(hdim) or hdim % INT4_BLOCK or y.shape != x.shape or weight.shape != (hdim,):
        raise ValueError(f"unsupported quantised add + norm: x {x.shape}, y {y.shape}, weight {weight.shape}")
    r, nb = x.size // hdim, hdim // INT4_BLOCK
    rp = next_pow2(r)
    x2, y2 = x.reshape(r, hdim), y.reshape(r, hdim).astype(x.dtype)
    five = lambda a: a.reshape(*a.shape[:-1], nb, 2, WORDS_PER_BLOCK, 4)  # noqa: E731  (a view: free)
    row = pl.BlockSpec((None, hdim), lambda i: (i, 0))
    row5 = pl.BlockSpec((None, nb, 2, WORDS_PER_BLOCK, 4), lambda i: (i, 0, 0, 0, 0))
    words = pl.BlockSpec((None, hdim // 8), lambda i: (i, 0))
    vec = pl.BlockSpec((rp,), lambda i: (0,))  # each program writes its row's entry
    s, h, xlo, xhi, rs, rsum = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk_size(hdim), eps=float(eps), quantize=True, interpret=bool(interpret)),
        out_shape=[jax.ShapeDtypeStruct((r, hdim), x.dtype)] * 2 + [jax.ShapeDtypeStruct((r, hdim // 8), jnp.int32)] * 2
        + [jax.ShapeDtypeStruct((rp,), jnp.float32), jax.ShapeDtypeStruct((rp,), jnp.int32)],
        grid=(r,),
        in_specs=[row, row, pl.BlockSpec((hdim,), lambda i: (0,)), row5, row5,
                  pl.BlockSpec((nb, 2, WORDS_PER_BLOCK, 4), lambda i: (0, 0, 0, 0))],
        out_specs=[row, row, words, words, vec, vec],
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm_quantized",
    )(x2, y2, weight, five(x2), five(y2), five(weight))
    return s.reshape(x.shape), h.reshape(x.shape), (xlo, xhi, rs, rsum)
