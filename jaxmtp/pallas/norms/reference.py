"""References: Qwen3.5's RMSNorm variants (float32 inside, cast back to the input dtype), the fused residual add +
norm (the model's ``x = x + y; h = rms_norm(x)``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax



def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)`` over the last axis. ``weight`` is the stored offset."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: ``x / rms(x) * w * silu(gate)`` (plain weight, norm before gate), per head over the last axis."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y * weight.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(x.dtype)


def add_rms_norm_reference(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """x, y: [..., H] (one dtype); weight: [H] (float32 offset, scale ``1 + w``). Returns ``(s, h)``, both
    [..., H] in x.dtype: ``s = x + y`` added in x.dtype (the new residual stream) and ``h = rms_norm(s, weight, eps)``
    (float32 inside)."""
    s = x + y
    return s, rms_norm(s, weight, eps)
