"""Reference for the projections of the model: ``x @ W`` (or ``x @ W^T``) with float32 accumulation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

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


@struct.dataclass
class PartialSums:
    """A product ``[..., N]`` left as float32 partial sums over K slices: ``parts [S, R', N]``, where the first R =
    prod(``shape[:-1]``) of the R' >= R rows are the product's rows (flattened) and any others padding."""

    parts: jax.Array
    shape: tuple = struct.field(pytree_node=False)

    def sum(self, dtype) -> jax.Array:
        """The product [..., N]: the partials summed in float32, rounded to ``dtype`` once."""
        rows = math.prod(self.shape[:-1])
        return jnp.sum(self.parts[:, :rows], axis=0).astype(dtype).reshape(self.shape)


def matmul_partials_reference(x: jax.Array, w: jax.Array, splits: int) -> PartialSums:
    """``x @ w`` (x [..., K]; w [K, N]) left as ``splits`` float32 partial sums over consecutive slices of K: a
    batched product over the slices (``w`` reshaped, no copy), so that the sum can be fused into whatever consumes it
    (:func:`jaxmtp.pallas.norms.add_rms_norm`) instead of being a kernel of its own. A single row is padded to two:
    XLA:GPU rewrites a batched one-row product into a transpose of the whole weight and a reduction (7.4 ms instead
    of 4.3 for the 4B decode step, H100)."""
    k, n = w.shape
    if k % splits:
        raise ValueError(f"K={k} does not split into {splits} equal slices")
    rows = math.prod(x.shape[:-1])
    xs = x.reshape(rows, splits, k // splits)
    if rows == 1:
        xs = jnp.pad(xs, ((0, 1), (0, 0), (0, 0)))
    dims = (((2,), (1,)), ((1,), (0,)))  # contract the slice, batch over the slices
    parts = jax.lax.dot_general(xs, w.reshape(splits, k // splits, n), dims, preferred_element_type=jnp.float32)
    return PartialSums(parts, x.shape[:-1] + (n,))


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
