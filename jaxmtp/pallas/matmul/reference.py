"""Reference for the projections of the model: ``x @ W`` (or ``x @ W^T``) with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmtp.precision import einsum_f32


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None) -> jax.Array:
    """x: [..., K]; w: [K, N] (or [N, K] with ``transpose_w``). Returns [..., N] in ``out_dtype`` (default x.dtype).

    Another ``out_dtype`` (float32 for the LM head) keeps the float32 accumulator (:func:`jaxmtp.precision.einsum_f32`)
    and casts it.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    eq = "...k,nk->...n" if transpose_w else "...k,kn->...n"
    if out_dtype == x.dtype:
        return jnp.einsum(eq, x, w)
    return einsum_f32(eq, x, w).astype(out_dtype)


def swiglu_reference(x: jax.Array, width: int) -> jax.Array:
    """``silu(gate) * up`` for x [..., >= 2 width] = gate | up (extra columns ignored), computed in float32 and
    rounded once to x's dtype."""
    g, u = x[..., :width].astype(jnp.float32), x[..., width : 2 * width].astype(jnp.float32)
    return (jax.nn.silu(g) * u).astype(x.dtype)


def quantized_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """``(x @ q^T) * scale`` in float32: x [..., K]; q [N, K] int8; scale [N] float32 (per output column)."""
    return einsum_f32("...k,nk->...n", x, q.astype(x.dtype)) * scale


INT4_BLOCK = 128  # packing block along K (see :func:`unpack_int4`)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int8 values [N, K] of int4 weights packed as uint8 [N, K/2]: within each 128-wide block b of K, byte j holds
    column ``128 b + j`` in its low nibble and column ``128 b + 64 + j`` in its high one, each stored as ``q + 8``
    (q in -7..7). A kernel reading one block's 64 bytes gets its two halves as two contiguous tiles."""
    n, half = packed.shape
    blocks = packed.reshape(n, half * 2 // INT4_BLOCK, INT4_BLOCK // 2).astype(jnp.int32)
    lo, hi = (blocks & 15) - 8, (blocks >> 4) - 8
    return jnp.concatenate([lo, hi], axis=-1).reshape(n, half * 2).astype(jnp.int8)


def as_words(b: jax.Array) -> jax.Array:
    """Bytes [..., K] (int8 or uint8) as little-endian int32 words [..., K/4]: byte j of word w is ``b[..., 4 w + j]``
    (a free bitcast on the GPU). The packed int4 head [N, K/2] becomes the words [N, K/8] that
    :mod:`jaxmtp.pallas.matmul.w4a8_triton` reads."""
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4), jnp.int32)


def quantize_rows_int8(x: jax.Array):
    """Symmetric dynamic int8 per row: x [m, K] -> (q int8 [m, K], scale float32 [m]) with x ~= q * scale:
    ``scale = max|x| / 127``, ``q = round(x * (127 / max|x|))`` (ties to even). A multiply by the reciprocal, not a
    division by the scale, because every backend rounds a multiply alike, while XLA may turn a division by a
    broadcast into a multiply of its own; so the GPU kernel (:func:`jaxmtp.pallas.matmul.w4a8_triton.quantize_rows_triton`)
    gives these bits exactly."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    inv = jnp.where(amax > 0, 127.0 / amax, 1.0)
    return jnp.clip(jnp.round(x * inv[..., None]), -127, 127).astype(jnp.int8), scale


def w4a8_matmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """``(xq @ q^T) * row_scale * scale`` in float32 for x [..., K] quantised per row to int8
    (:func:`quantize_rows_int8`) and int4 ``q`` packed as uint8 [N, K/2]: the integer sum exact (int32)."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, rs = quantize_rows_int8(x.reshape(-1, k))
    acc = lax.dot_general(xq, unpack_int4(packed), (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * rs[:, None] * scale
    return y.reshape(*lead, -1)


def argmax_from_partials(vals: jax.Array, idx: jax.Array) -> jax.Array:
    """The column of the first of the largest values, from an argmax kernel's per-program ``(vals, idx)`` ``[R, G]``
    (each program's largest value per row and the first column holding it): [R]."""
    best = jnp.argmax(vals, axis=-1)
    return jnp.take_along_axis(idx, best[:, None], axis=1)[:, 0]


# ---------------------------------------------------------------------------------------------------------------
# Block-FP8 weights (the official Qwen3.5 FP8 checkpoints): e4m3 values [..., N, K] and one float32 scale per
# 128 x 128 block [..., ceil(N/128), ceil(K/128)] (HF's ``weight_scale_inv``: it multiplies), the last block of
# either axis possibly partial.
# ---------------------------------------------------------------------------------------------------------------
FP8_BLOCK = 128
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def expand_block_scale(block_scale: jax.Array, n: int, k: int, block: int = FP8_BLOCK) -> jax.Array:
    """Per-element scales [..., n, k] from block scales [..., ceil(n/block), ceil(k/block)]."""
    s = jnp.repeat(jnp.repeat(block_scale, block, axis=-2)[..., :n, :], block, axis=-1)
    return s[..., :k]


def dequantize_fp8(w: jax.Array, block_scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``w * scale`` of its block, [..., N, K], computed in float32 (one rounding) and cast to ``dtype``."""
    n, k = w.shape[-2:]
    return (w.astype(jnp.float32) * expand_block_scale(block_scale.astype(jnp.float32), n, k)).astype(dtype)


def fp8_matmul_reference(x: jax.Array, w: jax.Array, block_scale: jax.Array, *, out_dtype=None) -> jax.Array:
    """``x @ dequantize_fp8(w)^T``: x [..., K]; w e4m3 [N, K]; block_scale [ceil(N/128), ceil(K/128)]. The weight
    is dequantised to x's dtype (exact in float32; one rounding in bfloat16) and multiplied with float32
    accumulation. Returns [..., N] in ``out_dtype`` (default x.dtype)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    return einsum_f32("...k,nk->...n", x, dequantize_fp8(w, block_scale, x.dtype)).astype(out_dtype)
