"""Reference for the projections of the model: ``x @ W`` (or ``x @ W^T``) with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None) -> jax.Array:
    """x: [..., K]; w: [K, N] (or [N, K] with ``transpose_w``). Returns [..., N] in ``out_dtype`` (default x.dtype).

    A float32 ``out_dtype`` with 16-bit operands keeps the float32 accumulator (no rounding to 16 bits); XLA:CPU has
    no bf16 x bf16 -> f32 dot, so there the operands are upcast first (the same products).
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    eq = "...k,nk->...n" if transpose_w else "...k,kn->...n"
    if out_dtype == x.dtype:
        return jnp.einsum(eq, x, w)
    if jax.default_backend() == "cpu":
        return jnp.einsum(eq, x.astype(out_dtype), w.astype(out_dtype))
    return jnp.einsum(eq, x, w, preferred_element_type=out_dtype)
