"""Gated DeltaNet mixer with a conv-window carry and a float32 recurrent-state carry.

Weights (native layout, ``x @ W``): ``in_proj_qkv [H, C]`` with C = [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)],
``in_proj_z [H, Hv*dv]``, ``in_proj_b``/``in_proj_a [H, Hv]``, ``conv1d [K, C]`` (depthwise, no bias),
``A_log``/``dt_bias [Hv]`` (float32), ``norm [dv]`` (plain-weight gated RMSNorm), ``out_proj [Hv*dv, H]``. The
serving layout holds ``in_proj_qkvzba`` (the four input projections concatenated) instead; see
:mod:`jaxmtp.layers.projections`.

Rollback for speculative decoding: with ``step_states=True`` :func:`gated_deltanet` returns a :class:`GDNSteps`
instead of the new carry: the state before the verify window, the old conv ring and the window's raw inputs, conv
outputs and gates.
:func:`select_step` commits the first n tokens of each row once the accepted length is known, by running the rule
over them again from the old state (the other tokens masked with g = beta = 0, which leaves a state unchanged). The
committed state is the one plain decoding reaches, computed by the same per-token arithmetic; and a verify step
moves each layer's state once in and once out (plus the commit's read), where keeping the state after every token
(T states written, one read back) moved T + 2 states per slot (docs/performance.md, run 9).

The conv carry is a ring of K rows indexed by absolute position (row ``q % K`` holds the raw input at position q),
not a shifted window of K-1: a decode step then writes one row the step does not read, so the one-kernel mixer
updates the carry in place, where rewriting a shifted window raced with the programs reading it and cost a copy of
every layer's window per step (docs/performance.md, run 11).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxmtp.config import Qwen35Config
from jaxmtp.layers.norms import gated_rms_norm
from jaxmtp.layers.projections import output_product, project, split_fused
from jaxmtp.pallas.matmul import linear
from jaxmtp.pallas.gated_delta_rule import (
    chunk_gated_delta_rule,
    commit_windows,
    fused_recurrent_gated_delta_rule,
    gdn_mixer,
    use_fused_mixer,
)


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


def select_step(steps: GDNSteps, n_tokens: jax.Array, implementation: str = "xla") -> GDNCarry:
    """Carry after the first ``n_tokens[b]`` (0..T) tokens of each row's window: the rule runs again over them
    from the old state (``implementation`` names the recurrent kernel; its final state overwrites the old one)."""
    return select_steps((steps,), n_tokens, implementation)[0]


def select_steps(carry: tuple, n_tokens: jax.Array, implementation: str = "xla") -> tuple:
    """:func:`select_step` for every :class:`GDNSteps` of a model's carry (other entries returned as they are). A
    Triton ``implementation`` commits every layer's state in one kernel launch, reading each layer's window as it is
    (:func:`jaxmtp.pallas.gated_delta_rule.commit_windows`); the conv rings update with XLA, which fuses them
    (:func:`ring_update`). Committing the rings in the kernel too removed those kernels but made it take 44 s to
    compile instead of 2 at the 0.8B shapes (H100, docs/performance.md run 18)."""
    at = [i for i, c in enumerate(carry) if isinstance(c, GDNSteps)]
    if not at:
        return tuple(carry)
    steps = [carry[i] for i in at]
    each = lambda name: [getattr(s, name) for s in steps]  # noqa: E731
    states = commit_windows(each("k"), each("v"), each("g"), each("beta"), each("state"), n_tokens,
                            implementation=implementation)
    out = list(carry)
    for i, s, state in zip(at, steps, states):
        out[i] = GDNCarry(ring_update(s.ring, s.inputs, s.start, n_tokens), state)
    return tuple(out)


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


def row_start(positions: jax.Array) -> jax.Array:
    """First position of each row ``[B]`` (0 for an all-padding row, which writes nothing)."""
    return jnp.maximum(positions[:, 0], 0).astype(jnp.int32)


def causal_conv(conv_inputs: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv + SiLU. conv_inputs: [B, K-1+T, C]; weight: [K, C] -> [B, T, C] (float32 math)."""
    k = weight.shape[0]
    t = conv_inputs.shape[1] - (k - 1)
    xs = conv_inputs.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    acc = sum(xs[:, j : j + t] * w[j] for j in range(k))
    return jax.nn.silu(acc)


def gated_deltanet(
    p,
    cfg: Qwen35Config,
    x: jax.Array,
    positions: jax.Array,
    carry: GDNCarry,
    *,
    form: str = "chunk",
    step_states: bool = False,
    implementation: str = "xla",
    matmul: str = "xla",
    mixer: str = "xla",
    out_matmul: str = "xla",
    partials: bool = False,
):
    """One GDN mixer over a window.

    x: [B, T, H]; positions: [B, T] int32, consecutive from the row's length, -1 on padding at the end of a row.
    ``form`` is ``"chunk"`` or
    ``"recurrent"``; ``step_states=True`` (recurrent only) returns :class:`GDNSteps` instead of the new carry.
    ``implementation`` names the gated delta rule kernel, ``matmul`` the projections', ``mixer`` the one-kernel
    recurrent mixer (:func:`jaxmtp.pallas.gated_delta_rule.gdn_mixer`; serving layout only, else unused),
    ``out_matmul`` out_proj's when it is stored transposed (:func:`jaxmtp.layers.projections.output_product`;
    ``partials``: y may be a :class:`jaxmtp.pallas._common.SplitSum`, for the residual add + norm).
    Returns (y [B, T, H], GDNCarry | GDNSteps).
    """
    b, t, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mm = lambda a, w: linear(a, w, implementation=matmul)  # noqa: E731
    out_proj = lambda a: output_product(p, "out_proj", a, mm, out_matmul, partials)  # noqa: E731
    valid, start = positions >= 0, row_start(positions)
    if (step_states or form == "recurrent") and "in_proj_qkvzba" in p and use_fused_mixer(cfg, t, mixer):
        return _fused_mixer(p, cfg, x, valid, start, carry, step_states, mixer, mm, out_proj)
    # mixed [B, T, C]: the raw conv inputs; z [B, T, Hv*dv]; b, a [B, T, Hv]
    mixed, z, b_raw, a = project(p, x, "in_proj_qkvzba", mm, cfg)
    z = z.reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(b_raw.astype(jnp.float32))
    a = a.astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    # Padding tokens must leave the state untouched: no decay (g = 0) and no write (beta = 0).
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)

    mixed = mixed.astype(carry.conv.dtype)
    conv_inputs = jnp.concatenate([window_from_ring(carry.conv, start), mixed], axis=1)
    c = causal_conv(conv_inputs, p["conv1d"]).astype(x.dtype)
    q = c[..., : hk * dk].reshape(b, t, hk, dk)
    k = c[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk)
    v = c[..., 2 * hk * dk :].reshape(b, t, hv, dv)

    common = dict(initial_state=carry.state, use_qk_l2norm_in_kernel=True, implementation=implementation)
    if step_states:
        o, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=False, **common)
    elif form == "recurrent":
        o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **common)
    elif form == "chunk":
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, **common)
    else:
        raise ValueError(f"unknown GDN form {form!r}")

    y = gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps).reshape(b, t, hv * dv)
    y = out_proj(y)
    if step_states:
        return y, GDNSteps(carry.state, carry.conv, mixed, k, v, g, beta, start)
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    return y, GDNCarry(ring_update(carry.conv, mixed, start, n_valid), final)


def _fused_mixer(p, cfg: Qwen35Config, x, valid, start, carry: GDNCarry, step_states: bool, implementation: str,
                 mm, out_proj):
    """The recurrent path with conv, gates and rule in one kernel after the fused input projection
    (:mod:`jaxmtp.pallas.gated_delta_rule.mixer_triton`)."""
    b, t, _ = x.shape
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    proj = mm(x, p["in_proj_qkvzba"])
    o, out = gdn_mixer(proj, carry.conv, p["conv1d"], p["A_log"], p["dt_bias"], carry.state, valid, start, cfg=cfg,
                       replay=step_states, implementation=implementation)
    mixed, z, _, _ = split_fused(proj, "in_proj_qkvzba", p, cfg)
    y = out_proj(gated_rms_norm(o, z.reshape(b, t, hv, dv), p["norm"], cfg.rms_norm_eps).reshape(b, t, hv * dv))
    if step_states:
        return y, GDNSteps(carry.state, carry.conv, mixed.astype(carry.conv.dtype), *out, start)
    state, ring = out
    return y, GDNCarry(ring, state)
