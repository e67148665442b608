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
