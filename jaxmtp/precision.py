"""Matmuls whose result is float32 whatever the operand dtype."""

import jax
import jax.numpy as jnp


def einsum_f32(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum`` with a float32 result. Accelerators accumulate bf16 operands in float32 natively
    (``preferred_element_type``); XLA:CPU has no bf16 x bf16 -> f32 dot, so there the operands are upcast."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(equation, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)
