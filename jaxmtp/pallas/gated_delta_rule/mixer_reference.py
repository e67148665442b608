"""Reference of the one-kernel GDN mixer, and the conv-ring helpers the Gated DeltaNet layer shares with it.

The conv carry is a ring of K rows indexed by absolute position (row ``q % K`` holds the raw input at position q),
not a shifted window of K-1: a decode step then writes one row the step does not read, so the one-kernel mixer
updates the carry in place.

:func:`gdn_mixer_reference` takes what :func:`.mixer_triton.gdn_mixer_triton` takes (the fused input projection,
the ring, the conv weight, the gates' parameters, the state) and returns what it returns, computed by the unfused
steps: conv over the ring's window and the window's inputs, the gates, then the token recurrence
(:func:`jaxmtp.pallas.gated_delta_rule.fused_recurrent_gated_delta_rule` with the implementation named).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.pallas.gated_delta_rule import fused_recurrent_gated_delta_rule


def window_from_ring(ring: jax.Array, start: jax.Array) -> jax.Array:
    """The conv window before position ``start [B]``: raw inputs at positions start-K+1 .. start-1, in order,
    ``[B, K-1, C]`` from the ring ``[B, K, C]`` (zeros before position 0: the ring starts zeroed)."""
    k = ring.shape[1]
    slots = (start[:, None] + jnp.arange(1 - k, 0)[None]) % k
    return jnp.take_along_axis(ring, slots[:, :, None], axis=1)


def ring_update(ring: jax.Array, inputs: jax.Array, start: jax.Array, n: jax.Array) -> jax.Array:
    """``ring [B, K, C]`` after writing ``inputs[b, i]`` (position start[b] + i) for i < n[b], in order of i: row j
    takes the last such i with ``(start + i) % K == j`` and keeps its value if there is none."""
    k, t = ring.shape[1], inputs.shape[1]
    j = jnp.arange(k)[None]
    last = n[:, None] - 1 - ((n[:, None] - 1 - (j - start[:, None])) % k)  # [B, K]; < 0: row j not written
    src = jnp.take_along_axis(inputs, jnp.clip(last, 0, t - 1)[:, :, None], axis=1)
    return jnp.where((last >= 0)[..., None], src.astype(ring.dtype), ring)


def causal_conv(conv_inputs: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv + SiLU. conv_inputs: [B, K-1+T, C]; weight: [K, C] -> [B, T, C] (float32 math)."""
    k = weight.shape[0]
    t = conv_inputs.shape[1] - (k - 1)
    xs = conv_inputs.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    acc = sum(xs[:, j : j + t] * w[j] for j in range(k))
    return jax.nn.silu(acc)


def gates(b_raw: jax.Array, a_raw: jax.Array, a_log: jax.Array, dt_bias: jax.Array, valid: jax.Array):
    """The rule's gates from the b and a projections [B, T, Hv]: ``beta = sigmoid(b)``, ``g = -exp(A_log) *
    softplus(a + dt_bias)`` (float32), both 0 on padding tokens (``valid [B, T]`` false), which leaves a state
    untouched (no decay, no write)."""
    beta = jax.nn.sigmoid(b_raw.astype(jnp.float32))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)


def conv_heads(mixed: jax.Array, ring: jax.Array, conv_w: jax.Array, start: jax.Array, *, hk, hv, dk, dv, dtype):
    """q, k [B, T, Hk, dk] and v [B, T, Hv, dv] (``dtype``): the causal conv of the raw inputs ``mixed [B, T, C]``
    after the ring's window before ``start``."""
    b, t, _ = mixed.shape
    conv_inputs = jnp.concatenate([window_from_ring(ring, start), mixed.astype(ring.dtype)], axis=1)
    c = causal_conv(conv_inputs, conv_w).astype(dtype)
    return (c[..., : hk * dk].reshape(b, t, hk, dk), c[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk),
            c[..., 2 * hk * dk :].reshape(b, t, hv, dv))


def gdn_mixer_reference(proj, ring, conv_w, a_log, dt_bias, state, valid, start, *, hk, hv, dk, dv, replay=False,
                        rule=None):
    """Shapes and outputs as :func:`.mixer_triton.gdn_mixer_triton`: proj [B, T, P] with columns ``[q | k | v (the
    conv's C inputs) | z (Hv*dv) | b (Hv) | a (Hv) | pad]``. ``rule(q, k, v, g, beta, **kw)``: the token recurrence
    (default :func:`jaxmtp.pallas.gated_delta_rule.fused_recurrent_gated_delta_rule`, the jnp reference)."""
    rule = rule or fused_recurrent_gated_delta_rule
    c = 2 * hk * dk + hv * dv
    mixed, b_raw, a_raw = proj[..., :c], proj[..., c + hv * dv : c + hv * dv + hv], proj[..., c + hv * dv + hv :
                                                                                         c + hv * dv + 2 * hv]
    g, beta = gates(b_raw, a_raw, a_log, dt_bias, valid)
    q, k, v = conv_heads(mixed, ring, conv_w, start, hk=hk, hv=hv, dk=dk, dv=dv, dtype=proj.dtype)
    common = dict(initial_state=state, use_qk_l2norm_in_kernel=True)
    if replay:
        o, _ = rule(q, k, v, g, beta, output_final_state=False, **common)
        return o, (k, v, g, beta)
    o, final = rule(q, k, v, g, beta, **common)
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    return o, (final, ring_update(ring, mixed, start, n_valid))
