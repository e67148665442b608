"""Gated DeltaNet mixer with a conv-window carry and a float32 recurrent-state carry.

Weights (native layout, ``x @ W``): ``in_proj_qkv [H, C]`` with C = [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)],
``in_proj_z [H, Hv*dv]``, ``in_proj_b``/``in_proj_a [H, Hv]``, ``conv1d [K, C]`` (depthwise, no bias),
``A_log``/``dt_bias [Hv]`` (float32), ``norm [dv]`` (plain-weight gated RMSNorm), ``out_proj [Hv*dv, H]``. The
serving layout holds ``in_proj_qkvzba`` (the four input projections concatenated) instead; see
:mod:`jaxmtp.layers.projections`.

Rollback for speculative decoding: with ``step_states=True`` :func:`gated_deltanet` returns a :class:`GDNSteps`
instead of the new carry: the state before the verify window, the old conv ring and the window's raw inputs, conv
outputs and gates. :func:`commit_steps` commits the first n tokens of each row once the accepted length is known, by
running the rule over them again from the old state (the other tokens masked with g = beta = 0, which leaves a state
unchanged). The committed state is the one plain decoding reaches, computed by the same per-token arithmetic; and a
verify step moves each layer's state once in and once out (plus the commit's read), where keeping the state after
every token would move T + 2 states per slot.

The conv carry is a ring of K rows indexed by absolute position (row ``q % K`` holds the raw input at position q;
:mod:`jaxmtp.pallas.gated_delta_rule.mixer_reference`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxmtp.config import Qwen35Config
from jaxmtp.layers.projections import fused_product, split_fused
from jaxmtp.pallas import ops
from jaxmtp.pallas.backend import XLA, Backend
from jaxmtp.pallas.gated_delta_rule.mixer_reference import conv_heads, gates, ring_update
from jaxmtp.pallas.norms.reference import gated_rms_norm


@struct.dataclass
class GDNCarry:
    """``conv [B, K, C]``: ring of raw (pre-conv) projections, row ``q % K`` holding position q (the last K-1
    positions before a row's length are the conv window; see :func:`window_from_ring`); ``state [B, Hv, dk, dv]``
    float32."""

    conv: jax.Array
    state: jax.Array

    @staticmethod
    def zeros(cfg: Qwen35Config, batch: int, dtype) -> "GDNCarry":
        return GDNCarry(
            jnp.zeros((batch, cfg.linear_conv_kernel_dim, cfg.conv_dim), dtype),
            jnp.zeros(
                (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32
            ),
        )


@struct.dataclass
class GDNSteps:
    """A verify window, kept until its accepted length is known: ``state [B, Hv, dk, dv]`` and ``ring [B, K, C]``
    before the window; ``inputs [B, T, C]``, the window's raw conv inputs (carry dtype); the conv outputs
    ``k [B, T, Hk, dk]`` and ``v [B, T, Hv, dv]`` (model dtype, before the rule's L2 norm); the gates
    ``g, beta [B, T, Hv]`` (float32, 0 on padding tokens); ``start [B]``, the window's first position."""

    state: jax.Array
    ring: jax.Array
    inputs: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    start: jax.Array


def commit_steps(carry: tuple, n_tokens: jax.Array, backend: Backend = XLA) -> tuple:
    """Every :class:`GDNSteps` of a model's carry committed to the first ``n_tokens[b]`` (0..T) tokens of each row's
    window (other entries returned as they are): the rule runs again over them from the old state, every layer in
    one launch where the commit kernel runs (:func:`jaxmtp.pallas.ops.commit_windows`); the conv rings update with
    XLA, which fuses them (:func:`ring_update`)."""
    at = [i for i, c in enumerate(carry) if isinstance(c, GDNSteps)]
    if not at:
        return tuple(carry)
    steps = [carry[i] for i in at]
    each = lambda name: [getattr(s, name) for s in steps]  # noqa: E731
    states = ops.commit_windows(each("k"), each("v"), each("g"), each("beta"), each("state"), n_tokens, backend)
    out = list(carry)
    for i, s, state in zip(at, steps, states):
        out[i] = GDNCarry(ring_update(s.ring, s.inputs, s.start, n_tokens), state)
    return tuple(out)


def row_start(positions: jax.Array) -> jax.Array:
    """First position of each row ``[B]`` (0 for an all-padding row, which writes nothing)."""
    return jnp.maximum(positions[:, 0], 0).astype(jnp.int32)


def gated_deltanet(p, cfg: Qwen35Config, x, positions: jax.Array, carry: GDNCarry, *, form: str = "chunk",
                   step_states: bool = False, backend: Backend = XLA):
    """One GDN mixer over a window, up to its output projection.

    x: [B, T, H] (or the lazy input norm, :func:`jaxmtp.pallas.ops.normed`); positions: [B, T] int32, consecutive
    from the row's length, -1 on padding at the end of a row. ``form`` is ``"chunk"`` or ``"recurrent"``;
    ``step_states=True`` (recurrent) returns :class:`GDNSteps` instead of the new carry. Returns (the gated norm's
    output [B, T, Hv*dv], GDNCarry | GDNSteps); the caller applies out_proj
    (:func:`jaxmtp.pallas.ops.output_add_norm`).
    """
    b, t = x.shape[:2]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    proj = fused_product(p, x, "in_proj_qkvzba", lambda a, w: ops.linear(a, w, backend),
                         lambda a: ops.form(a, backend), lambda a, ws: ops.linear_parts(a, ws, backend))
    mixed, z, b_raw, a_raw = split_fused(proj, "in_proj_qkvzba", p, cfg)
    z = z.reshape(b, t, hv, dv)
    valid, start = positions >= 0, row_start(positions)
    if step_states or form == "recurrent":
        o, out = ops.gdn_mixer(proj, carry.conv, p["conv1d"], p["A_log"], p["dt_bias"], carry.state, valid, start,
                               backend, cfg=cfg, replay=step_states)
        y = gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps).reshape(b, t, hv * dv)
        if step_states:
            return y, GDNSteps(carry.state, carry.conv, mixed.astype(carry.conv.dtype), *out, start)
        state, ring = out
        return y, GDNCarry(ring, state)
    if form != "chunk":
        raise ValueError(f"unknown GDN form {form!r}")
    g, beta = gates(b_raw, a_raw, p["A_log"], p["dt_bias"], valid)
    q, k, v = conv_heads(mixed, carry.conv, p["conv1d"], start, hk=hk, hv=hv, dk=dk, dv=dv, dtype=proj.dtype)
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, carry.state, backend)
    y = gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps).reshape(b, t, hv * dv)
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    return y, GDNCarry(ring_update(carry.conv, mixed, start, n_valid), final)
