"""References for the MTP draft passes' inputs: ``concat[rms_norm(E[d]), rms_norm(hidden)]`` from known ids or from
the int4 head's argmax partials."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.pallas.matmul.reference import argmax_from_partials
from jaxmtp.pallas.norms.reference import rms_norm


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
