"""Partial rotary position embedding (NeoX / rotate-half pairing) on the leading ``rotary_dim`` dims of each head.

Qwen3.5's M-RoPE uses three position rows (t, h, w); for text they are equal, which makes it exactly this 1-D RoPE.
"""

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, rotary_dim: int, theta: float):
    """cos, sin of shape [B, T, rotary_dim] (float32) for integer positions [B, T]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, H, D]`` on dims [0, rotary_dim); pairs are (i, i + rotary_dim/2)."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].astype(jnp.float32), x[..., rd:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    half = rd // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = (xr * c + rotated * s).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1)
