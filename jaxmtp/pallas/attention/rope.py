"""Partial rotary position embedding (NeoX / rotate-half pairing) on the leading ``rotary_dim`` dims of each head.

Qwen3.5's M-RoPE uses three position rows (t, h, w); for text they are equal, which makes it exactly this 1-D RoPE.
"""

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """The rotary frequencies ``theta^(-2i / rotary_dim)`` [rotary_dim / 2] as float32, computed in float64 and
    rounded once: a constant of the config (no kernel in the step), shared by :func:`rope_angles` and the attention
    prelude kernel, which forms the angles itself (:mod:`jaxmtp.pallas.attention.prelude_triton`)."""
    return (1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 2 len(inv_freq)] (float32) for integer positions [B, T]: angle ``position * inv_freq[i]``
    (float32 product) at dims i and i + rotary_dim/2."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rope_angles(positions: jax.Array, rotary_dim: int, theta: float):
    """cos, sin of shape [B, T, rotary_dim] (float32) for integer positions [B, T]."""
    return rope_cos_sin(positions, rope_inv_freq(rotary_dim, theta))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, H, D]`` on dims [0, rotary_dim); pairs are (i, i + rotary_dim/2)."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].astype(jnp.float32), x[..., rd:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    half = rd // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = (xr * c + rotated * s).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1)
