"""References: Qwen3.5's RMSNorm variants (float32 inside, cast back to the input dtype), the fused residual add +
norm (the model's ``x = x + y; h = rms_norm(x)``) and the MTP draft passes' inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmtp.pallas.matmul.reference import argmax_from_partials


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


def fc_input_reference(ids: jax.Array, embed: jax.Array, hidden: jax.Array, w_e: jax.Array, w_h: jax.Array,
                       eps: float) -> jax.Array:
    """The MTP fc input ``concat[rms_norm(embed[ids], w_e), rms_norm(hidden, w_h)]`` [..., 2H] in embed's dtype, for
    ids [...] and hidden [..., H]."""
    e = rms_norm(embed[ids], w_e, eps)
    h = rms_norm(hidden.astype(e.dtype), w_h, eps)
    return jnp.concatenate([e, h], axis=-1)


def draft_input_reference(vals: jax.Array, idx: jax.Array, embed: jax.Array, hidden: jax.Array, w_e: jax.Array,
                          w_h: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """A recursive draft pass's input: the draft ``d`` = the argmax kernel's ``(vals, idx)`` [>= B, G] finished
    (first of the largest), and ``concat[rms_norm(embed[d], w_e), rms_norm(hidden, w_h)]`` [B, 2H] in embed's dtype
    (hidden [B, H]). Returns (d [B] int32, x)."""
    b = hidden.shape[0]
    d = argmax_from_partials(vals[:b], idx[:b]).astype(jnp.int32)
    return d, fc_input_reference(d, embed, hidden, w_e, w_h, eps)


def pass_positions(length: jax.Array, active: jax.Array, offset: int) -> jax.Array:
    """A recursive draft pass's positions ``where(active, length + offset, -1)`` [B] int32 (an idle row's pass writes
    nothing), as :func:`.draft_input_triton.draft_input_triton` forms them in its kernel."""
    return jnp.where(active, length + offset, -1).astype(jnp.int32)
