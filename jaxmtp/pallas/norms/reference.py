"""Reference for the fused residual add + zero-centred RMSNorm (the model's ``x = x + y; h = rms_norm(x)``)."""

from __future__ import annotations

import jax

from jaxmtp.layers.norms import rms_norm


def add_rms_norm_reference(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """x, y: [..., H] (one dtype); weight: [H] (float32 offset, scale ``1 + w``). Returns ``(s, h)``, both
    [..., H] in x.dtype: ``s = x + y`` added in x.dtype (the new residual stream) and ``h = rms_norm(s, weight, eps)``
    (float32 inside)."""
    s = x + y
    return s, rms_norm(s, weight, eps)
