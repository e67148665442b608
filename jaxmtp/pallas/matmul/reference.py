"""Reference for the projections of the model: ``x @ W`` (or ``x @ W^T``) with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def quantized4_matmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """``(x @ q^T) * scale`` in float32 for int4 ``q`` packed as uint8 [N, K/2] (:func:`unpack_int4`)."""
    return quantized_matmul_reference(x, unpack_int4(packed), scale)
