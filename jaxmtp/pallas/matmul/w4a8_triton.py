"""Products of a few rows with packed int4 weights on GPU, the rows quantised to int8: four products per instruction.

The multiply-add kernel (:mod:`.gemv_triton`) reads an int4 draft head barely faster than its int8 read of twice
the bytes: every weight costs an extraction, a widening, a float subtraction and a multiply-add, and that read is
bound by instruction issue, not by memory (docs/kernels.md). Here the row is quantised to int8 first (symmetric per row, as
:func:`quantize_rows_int8`, by the one-program kernel :func:`quantize_rows_triton`), and the kernel never leaves
integers: a 32-bit word of the packed weight holds
eight 4-bit values, one ``AND`` (and one shift) give two words of four unsigned bytes, and ``dp4a`` (PTX
``dp4a.u32.s32``) multiplies four such bytes by four signed bytes of the row and adds them to a 32-bit accumulator:
about 1.4 instructions per weight.

Weight: the draft head's int4 layout (:func:`jaxmtp.pallas.matmul.reference.unpack_int4`: in each 128-wide block
of K, byte j holds column j in its low nibble and column 64 + j in its high one, as q + 8) read as little-endian
int32 words ``[N, K/8]`` (:func:`as_words`): word w of block b holds columns ``128 b + 4 w .. + 3`` in its low
nibbles and ``128 b + 64 + 4 w .. + 3`` in its high ones, byte by byte, so the row's int8 values, read as words, pair
with them unpermuted (``x_lo`` / ``x_hi``: the row's words for each block's two halves).

Result: ``(sum_k q_k * xq_k - 8 * sum_k xq_k) * row_scale * scale[n]`` in float32, exact up to the final two
float multiplications (the integer sum cannot overflow for K < 2^20). Grid ``(N / BN,)``; each program reads its
``BN`` weight rows whole, ``words_per_step`` words per row per step. In interpret mode (CPU tests) ``dp4a`` is
emulated with integer jnp ops; the PTX instruction itself runs only on the GPU (checked there against the reference
by scripts/bench_kernels.py --sections matmul). Reference: :func:`jaxmtp.pallas.matmul.reference.w4a8_matmul_reference`.

:func:`w4a8_argmax_triton` is the drafts' use of it: only the index of each row's largest value is wanted, so each
program writes its columns' maximum and first index instead of the logits, and a small jnp argmax over the programs
finishes (for the 248k-row head: 2 x 62 KB per row written instead of 1 MB, and one reduction kernel instead of
three; reference: ``jnp.argmax`` of the product).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import next_pow2
from jaxmtp.pallas.matmul.reference import INT4_BLOCK, argmax_from_partials

MAX_ROWS = 8  # each row repeats the dp4a of every word: a few rows only
WORDS_PER_BLOCK = INT4_BLOCK // 8  # int32 words per row of one packing block
LOW_NIBBLES = 0x0F0F0F0F
DP4A = "dp4a.u32.s32 $0, $1, $2, $3;"  # $0 = $3 + sum_j unsigned byte j of $1 x signed byte j of $2
ROUND = "cvt.rni.f32.f32 $0, $1;"  # to the nearest integer, ties to even


def dp4a(a, b, c, *, interpret: bool = False):
    """Elementwise ``c + sum_j a_j * b_j`` over the four bytes of int32 words (a's unsigned, b's signed)."""
    if not interpret:
        [out] = pltr.elementwise_inline_asm(DP4A, args=[a, b, c], constraints="=r,r,r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
        return out
    for j in range(4):
        ua = (a >> (8 * j)) & 0xFF
        sb = (b << (24 - 8 * j)) >> 24  # arithmetic shift: the signed byte
        c = c + ua * sb
    return c


def round_half_even(y, *, interpret: bool = False):
    """``jnp.round`` (to the nearest integer, ties to even) in a kernel: PTX ``cvt.rni`` on the GPU (the Triton
    lowering has no rule for ``lax.round``)."""
    if interpret:
        return jnp.round(y)
    [out] = pltr.elementwise_inline_asm(ROUND, args=[y], constraints="=f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])
    return out


def supports(m: int, k: int, n: int) -> bool:
    """1-8 rows, K a multiple of 128, N a multiple of 16."""
    return 0 < m <= MAX_ROWS and k % INT4_BLOCK == 0 and n % 16 == 0


def plan(k: int):
    """Default ``(block_n, words_per_step, num_warps, num_stages)``: the best tiling of a sweep at a real head's
    shape (two blocks per step; docs/kernels.md); one block per step where K is not a multiple of 256."""
    return (16, 2 * WORDS_PER_BLOCK, 8, 2) if k % (2 * INT4_BLOCK) == 0 else (16, WORDS_PER_BLOCK, 4, 4)


def _chunk_blocks(nb: int) -> int:
    """Packing blocks per load in :func:`_quantize_kernel`: the largest power of two (at most 8) dividing ``nb``
    (Triton loads must hold a power-of-two number of elements; K / 128 need not be one, 20 for the 4B)."""
    c = 1
    while c < 8 and nb % (2 * c) == 0:
        c *= 2
    return c


def quantize_parts(parts, *, interpret: bool = False):
    """One row's int8 quantisation inside a kernel, from its float32 values as ``parts[i][h]`` ``[c, 16, 4]`` (chunk i
    of c packing blocks, half h, word, byte; :func:`_chunk_blocks`): ``(scale, rsum, words)`` with ``words[i][h]``
    the int32 words ``[c * 16]`` of that chunk's half, exactly as :func:`quantize_rows_int8` and :func:`as_words`."""
    c = parts[0][0].shape[0]
    shift = 8 * lax.broadcasted_iota(jnp.int32, (c, WORDS_PER_BLOCK, 4), 2)
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(t)) for pair in parts for t in pair])
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    inv = jnp.where(amax > 0, 127.0 / amax, 1.0)
    rsum, words = jnp.zeros((), jnp.int32), []
    for pair in parts:
        row = []
        for t in pair:
            q = jnp.clip(round_half_even(t * inv, interpret=interpret), -127.0, 127.0).astype(jnp.int32)
            rsum = rsum + jnp.sum(q)
            row.append(jnp.sum((q & 0xFF) << shift, axis=2).reshape(c * WORDS_PER_BLOCK))
        words.append(row)
    return scale, rsum, words


def _quantize_kernel(x_ref, xlo_ref, xhi_ref, rs_ref, rsum_ref, *, m, interpret):
    """:func:`quantize_rows_int8` and :func:`as_words` for the kernel below, in one program. x_ref: the rows as
    ``[m, K/128, 2, 16, 4]`` (block, half, word, byte); xlo / xhi: int32 words ``[m, K/8]``; rs / rsum: ``[Mp]``."""
    nb = x_ref.shape[1]
    c = _chunk_blocks(nb)
    mp = rs_ref.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (mp,), 0)
    rs_all, rsum_all = jnp.ones((mp,), jnp.float32), jnp.zeros((mp,), jnp.int32)
    for r in range(m):
        parts = [[x_ref[r, pl.ds(b, c), h].astype(jnp.float32) for h in (0, 1)] for b in range(0, nb, c)]
        scale, rsum, words = quantize_parts(parts, interpret=interpret)
        for i, pair in enumerate(words):
            for h, w in enumerate(pair):
                out = xlo_ref if h == 0 else xhi_ref
                out[r, pl.ds(i * c * WORDS_PER_BLOCK, c * WORDS_PER_BLOCK)] = w
        rs_all = jnp.where(lane == r, scale, rs_all)
        rsum_all = jnp.where(lane == r, rsum, rsum_all)
    rs_ref[...] = rs_all
    rsum_ref[...] = rsum_all


def quantize_rows_triton(x, *, interpret=False):
    """x [m, K] -> ``(xlo, xhi, row_scale, row_sum)``: the rows quantised per row to int8 (exactly as
    :func:`jaxmtp.pallas.matmul.reference.quantize_rows_int8`), as little-endian int32 words ``[m, K/8]`` of each
    128-wide block's low and high halves (:func:`as_words` of the int8 rows, block b's 32 words split 16 / 16), and
    the per-row scale and sum of the int8 values as ``[Mp]`` vectors (Mp = next power of two >= m; rows beyond m
    hold 1 and 0). One kernel where XLA ran five (row maximum, scale, rounding with the sum, two slices)."""
    m, kdim = x.shape
    mp, nb = next_pow2(m), kdim // INT4_BLOCK
    x5 = x.reshape(m, nb, 2, WORDS_PER_BLOCK, 4)  # free: a view of the same row-major bytes
    words = jax.ShapeDtypeStruct((m, kdim // 8), jnp.int32)
    return pl.pallas_call(
        functools.partial(_quantize_kernel, m=m, interpret=bool(interpret)),
        out_shape=(words, words, jax.ShapeDtypeStruct((mp,), jnp.float32), jax.ShapeDtypeStruct((mp,), jnp.int32)),
        grid=(1,),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="w4a8_quantize_rows",
    )(x5)


def _kernel(xlo_ref, xhi_ref, rs_ref, rsum_ref, w_ref, scale_ref, *out_refs, m, bw, interpret):
    bn = w_ref.shape[0]
    steps = w_ref.shape[1] // bw

    def body(i, accs):
        off = pl.multiple_of(i * bw, bw)
        t = w_ref[:, pl.ds(off, bw)]
        lo, hi = t & LOW_NIBBLES, (t >> 4) & LOW_NIBBLES
        out = []
        for r, acc in enumerate(accs):
            xl = jnp.broadcast_to(xlo_ref[r, pl.ds(off, bw)][None, :], (bn, bw))
            xh = jnp.broadcast_to(xhi_ref[r, pl.ds(off, bw)][None, :], (bn, bw))
            out.append(dp4a(hi, xh, dp4a(lo, xl, acc, interpret=interpret), interpret=interpret))
        return tuple(out)

    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((bn, bw), jnp.int32) for _ in range(m)))
    scale = scale_ref[...]
    rows = [(jnp.sum(acc, axis=1) - 8 * rsum_ref[r]).astype(jnp.float32) * rs_ref[r] * scale
            for r, acc in enumerate(accs)]
    if len(out_refs) == 1:
        for r, y in enumerate(rows):
            out_refs[0][r, :] = y
        return
    # argmax: each row's largest value of this program's bn columns and its first column (global index)
    val_ref, idx_ref = out_refs
    mp = val_ref.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (mp,), 0)
    vals, idxs = jnp.full((mp,), -jnp.inf, jnp.float32), jnp.zeros((mp,), jnp.int32)
    for r, y in enumerate(rows):
        vals = jnp.where(lane == r, jnp.max(y), vals)
        idxs = jnp.where(lane == r, jnp.argmax(y).astype(jnp.int32) + pl.program_id(0) * bn, idxs)
    val_ref[...] = vals
    idx_ref[...] = idxs


def _launch(x, words, scale, *, block_n, words_per_step, num_warps, num_stages, argmax, interpret, quantized=None):
    lead, kdim = x.shape[:-1], x.shape[-1]
    m, n = math.prod(lead), words.shape[0]
    if not supports(m, kdim, n) or words.dtype != jnp.int32 or words.shape[1] * 8 != kdim:
        raise ValueError(f"unsupported w4a8 product: [{m}, {kdim}] x words {words.shape} {words.dtype}")
    bn0, bw0, nw0, st0 = plan(kdim)
    block_n, bw = block_n or bn0, words_per_step or bw0
    num_warps, num_stages = num_warps or nw0, num_stages or st0
    if bw % WORDS_PER_BLOCK or (kdim // 8) % bw or n % block_n:
        raise ValueError(f"tiles BN={block_n}, {bw} words per step do not divide [{kdim}, {n}]")
    mp, g = next_pow2(m), n // block_n
    # the rows' int8 form: given (the final norm kernel formed it, jaxmtp.pallas.norms.add_rms_norm) or made here
    xlo, xhi, rs, rsum = quantized or quantize_rows_triton(x.reshape(m, kdim), interpret=interpret)
    full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    if argmax:
        out_shape = (jax.ShapeDtypeStruct((mp, g), jnp.float32), jax.ShapeDtypeStruct((mp, g), jnp.int32))
        out_specs = (pl.BlockSpec((mp, None), lambda j: (0, j)),) * 2
    else:
        out_shape = jax.ShapeDtypeStruct((mp, n), jnp.float32)
        out_specs = pl.BlockSpec((mp, block_n), lambda j: (0, j))
    return pl.pallas_call(
        functools.partial(_kernel, m=m, bw=bw, interpret=bool(interpret)),
        out_shape=out_shape,
        grid=(g,),
        in_specs=[full((m, kdim // 8)), full((m, kdim // 8)), full((mp,)), full((mp,)),
                  pl.BlockSpec((block_n, kdim // 8), lambda j: (j, 0)), pl.BlockSpec((block_n,), lambda j: (j,))],
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w4a8_argmax" if argmax else "w4a8",
    )(xlo, xhi, rs, rsum, words, scale)


@functools.partial(jax.jit, static_argnames=("block_n", "words_per_step", "num_warps", "num_stages", "interpret"))
def w4a8_matmul_triton(x, words, scale, *, block_n=None, words_per_step=None, num_warps=None, num_stages=None,
                       interpret=False):
    """x [..., K] (1-8 rows); ``words`` int32 [N, K/8] (:func:`as_words` of the packed head); ``scale`` float32 [N].
    Returns ``(quantize_rows_int8(x) @ q^T) * scale`` as float32 [..., N]."""
    y = _launch(x, words, scale, block_n=block_n, words_per_step=words_per_step, num_warps=num_warps,
                num_stages=num_stages, argmax=False, interpret=interpret)
    m = math.prod(x.shape[:-1])
    return y[:m].reshape(*x.shape[:-1], words.shape[0])


@functools.partial(jax.jit, static_argnames=("interpret",))
def w4a8_argmax_partials_triton(x, words, scale, *, quantized=None, interpret=False):
    """The argmax kernel's per-program results before the last reduction: ``(vals, idx)`` float32 / int32
    ``[Mp, G]``, each program's largest value per row and the first column holding it (rows from m on unused).
    :func:`argmax_from_partials` finishes it; :mod:`jaxmtp.pallas.draft_input.draft_input_triton` finishes it inside the
    next draft pass's input kernel instead. ``quantized``: x's ``(xlo, xhi, row_scale, row_sum)`` as
    :func:`quantize_rows_triton` returns them, formed already (then x only gives the shapes)."""
    return _launch(x, words, scale, block_n=None, words_per_step=None, num_warps=None, num_stages=None, argmax=True,
                   interpret=interpret, quantized=quantized)


@functools.partial(jax.jit, static_argnames=("block_n", "words_per_step", "num_warps", "num_stages", "interpret"))
def w4a8_argmax_triton(x, words, scale, *, block_n=None, words_per_step=None, num_warps=None, num_stages=None,
                       interpret=False):
    """``argmax(w4a8_matmul_triton(x, words, scale), axis=-1)`` as int32 [...] without writing the logits: each
    program keeps its columns' maximum and first index per row, and a jnp argmax over the programs picks the first
    of the largest (ties resolve to the lowest column, as ``jnp.argmax``; the values are computed exactly as the
    product kernel computes them)."""
    vals, idx = _launch(x, words, scale, block_n=block_n, words_per_step=words_per_step, num_warps=num_warps,
                        num_stages=num_stages, argmax=True, interpret=interpret)
    m = math.prod(x.shape[:-1])
    return argmax_from_partials(vals[:m], idx[:m]).reshape(x.shape[:-1])


__all__ = ["MAX_ROWS", "argmax_from_partials", "dp4a", "plan", "quantize_rows_triton", "supports",
           "w4a8_argmax_partials_triton", "w4a8_argmax_triton", "w4a8_matmul_triton"]
