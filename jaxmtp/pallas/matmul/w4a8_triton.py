"""Products of a few rows with packed int4 weights on GPU, the rows quantised to int8: four products per instruction.

The multiply-add kernel (:mod:`.gemv_triton`) reads the 4B draft head as int4 in ~209 us, barely faster than its
int8 read of twice the bytes: every weight costs an extraction, a widening, a float subtraction and a multiply-add,
and Nsight Compute shows that read bound by instruction issue (8.3 instructions per weight, 77% of issue slots busy,
DRAM 46% busy; docs/performance.md, run 10). Here the row is quantised to int8 first (:func:`quantize_rows_int8`,
symmetric per row, before the kernel), and the kernel never leaves integers: a 32-bit word of the packed weight holds
eight 4-bit values, one ``AND`` (and one shift) give two words of four unsigned bytes, and ``dp4a`` (PTX
``dp4a.u32.s32``) multiplies four such bytes by four signed bytes of the row and adds them to a 32-bit accumulator:
1.4 instructions per weight measured, 119 us for the 4B head.

Weight: the draft head's int4 layout (:func:`jaxmtp.pallas.matmul.reference.unpack_int4`: in each 128-wide block
of K, byte j holds column j in its low nibble and column 64 + j in its high one, as q + 8) read as little-endian
int32 words ``[N, K/8]`` (:func:`as_words`): word w of block b holds columns ``128 b + 4 w .. + 3`` in its low
nibbles and ``128 b + 64 + 4 w .. + 3`` in its high ones, byte by byte, so the row's int8 values, read as words, pair
with them unpermuted (``x_lo`` / ``x_hi``: the row's words for each block's two halves).

Result: ``(sum_k q_k * xq_k - 8 * sum_k xq_k) * row_scale * scale[n]`` in float32, exact up to the final two
float multiplications (the integer sum cannot overflow for K < 2^20). Grid ``(N / BN,)``; each program reads its
``BN`` weight rows whole, ``words_per_step`` words per row per step. In interpret mode (CPU tests) ``dp4a`` is
emulated with integer jnp ops; the PTX instruction itself runs only on the GPU (checked there against the reference
by scripts/bench_gemv.py). Reference: :func:`jaxmtp.pallas.matmul.reference.w4a8_matmul_reference`.
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
from jaxmtp.pallas.matmul.reference import INT4_BLOCK, as_words, quantize_rows_int8

MAX_ROWS = 8  # each row repeats the dp4a of every word: a few rows only
WORDS_PER_BLOCK = INT4_BLOCK // 8  # int32 words per row of one packing block
LOW_NIBBLES = 0x0F0F0F0F
DP4A = "dp4a.u32.s32 $0, $1, $2, $3;"  # $0 = $3 + sum_j unsigned byte j of $1 x signed byte j of $2


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


def supports(m: int, k: int, n: int) -> bool:
    """1-8 rows, K a multiple of 128, N a multiple of 16."""
    return 0 < m <= MAX_ROWS and k % INT4_BLOCK == 0 and n % 16 == 0


def plan(k: int):
    """Default ``(block_n, words_per_step, num_warps, num_stages)``: the best of scripts/bench_gemv.py's sweep on an
    H100 for the 4B head (119.7 us; 24 tilings took 119.7-184 us, two blocks per step all within 133 us);
    one block per step where K is not a multiple of 256."""
    return (16, 2 * WORDS_PER_BLOCK, 8, 2) if k % (2 * INT4_BLOCK) == 0 else (16, WORDS_PER_BLOCK, 4, 4)


def _kernel(xlo_ref, xhi_ref, rs_ref, rsum_ref, w_ref, scale_ref, o_ref, *, m, bw, interpret):
    bn = o_ref.shape[-1]
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
    for r, acc in enumerate(accs):
        total = jnp.sum(acc, axis=1) - 8 * rsum_ref[r]
        o_ref[r, :] = total.astype(jnp.float32) * rs_ref[r] * scale


@functools.partial(jax.jit, static_argnames=("block_n", "words_per_step", "num_warps", "num_stages", "interpret"))
def w4a8_matmul_triton(x, words, scale, *, block_n=None, words_per_step=None, num_warps=None, num_stages=None,
                       interpret=False):
    """x [..., K] (1-8 rows); ``words`` int32 [N, K/8] (:func:`as_words` of the packed head); ``scale`` float32 [N].
    Returns ``(quantize_rows_int8(x) @ q^T) * scale`` as float32 [..., N]."""
    lead, kdim = x.shape[:-1], x.shape[-1]
    m, n = math.prod(lead), words.shape[0]
    if not supports(m, kdim, n) or words.dtype != jnp.int32 or words.shape[1] * 8 != kdim:
        raise ValueError(f"unsupported w4a8 product: [{m}, {kdim}] x words {words.shape} {words.dtype}")
    bn0, bw0, nw0, st0 = plan(kdim)
    block_n, bw = block_n or bn0, words_per_step or bw0
    num_warps, num_stages = num_warps or nw0, num_stages or st0
    if bw % WORDS_PER_BLOCK or (kdim // 8) % bw or n % block_n:
        raise ValueError(f"tiles BN={block_n}, {bw} words per step do not divide [{kdim}, {n}]")
    mp = next_pow2(m)
    xq, rs = quantize_rows_int8(x.reshape(m, kdim))
    xw = as_words(xq)  # [m, K/4]: block b's low half, then its high half
    halves = xw.reshape(m, kdim // INT4_BLOCK, 2, WORDS_PER_BLOCK)
    pad = ((0, mp - m), (0, 0))
    xlo = jnp.pad(halves[:, :, 0].reshape(m, kdim // 8), pad)
    xhi = jnp.pad(halves[:, :, 1].reshape(m, kdim // 8), pad)
    rsum = jnp.pad(jnp.sum(xq.astype(jnp.int32), axis=1), (0, mp - m))
    rs = jnp.pad(rs, (0, mp - m))
    full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    y = pl.pallas_call(
        functools.partial(_kernel, m=m, bw=bw, interpret=bool(interpret)),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32),
        grid=(n // block_n,),
        in_specs=[full((mp, kdim // 8)), full((mp, kdim // 8)), full((mp,)), full((mp,)),
                  pl.BlockSpec((block_n, kdim // 8), lambda j: (j, 0)), pl.BlockSpec((block_n,), lambda j: (j,))],
        out_specs=pl.BlockSpec((mp, block_n), lambda j: (0, j)),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w4a8",
    )(xlo, xhi, rs, rsum, words, scale)
    return y[:m].reshape(*lead, n)


__all__ = ["MAX_ROWS", "dp4a", "plan", "supports", "w4a8_matmul_triton"]
