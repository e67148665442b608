"""Gated DeltaNet mixer with a conv-window carry and a float32 recurrent-state carry.

Weights (native layout, ``x @ W``): ``in_proj_qkv [H, C]`` with C = [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)],
``in_proj_z [H, Hv*dv]``, ``in_proj_b``/``in_proj_a [H, Hv]``, ``conv1d [K, C]`` (depthwise, no bias),
``A_log``/``dt_bias [Hv]`` (float32), ``norm [dv]`` (plain-weight gated RMSNorm), ``out_proj [Hv*dv, H]``. The
serving layout holds ``in_proj_qkvzba`` (the four input projections concatenated) instead; see
:mod:`jaxmtp.layers.projections`.

Rollback for speculative decoding: with ``step_states=True`` :func:`gated_deltanet` returns a :class:`GDNSteps`
instead of the new carry: the state before the verify window and the window's conv inputs (the old conv window
first), conv outputs and gates.
:func:`select_step` commits the first n tokens of each row once the accepted length is known, by running the rule
over them again from the old state (the other tokens masked with g = beta = 0, which leaves a state unchanged). The
committed state is the one plain decoding reaches, computed by the same per-token arithmetic; and a verify step
moves each layer's state once in and once out (plus the commit's read), where keeping the state after every token
(T states written, one read back) moved T + 2 states per slot (docs/performance.md, run 9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxmtp.config import Qwen35Config
from jaxmtp.layers.norms import gated_rms_norm
from jaxmtp.layers.projections import project, split_fused
from jaxmtp.pallas.matmul import linear
from jaxmtp.pallas.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gdn_mixer,
    use_fused_mixer,
)


@struct.dataclass
class GDNCarry:
    """``conv [B, K-1, C]``: the last K-1 raw (pre-conv) projections; ``state [B, Hv, dk, dv]`` float32."""

    conv: jax.Array
    state: jax.Array

    @staticmethod
    def zeros(cfg: Qwen35Config, batch: int, dtype) -> "GDNCarry":
        return GDNCarry(
            jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
            jnp.zeros(
                (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32
            ),
        )


@struct.dataclass
class GDNSteps:
    """A verify window, kept until its accepted length is known: ``state [B, Hv, dk, dv]`` before the window;
    ``conv_inputs [B, K-1+T, C]`` (the old window, then the new raw projections); the conv outputs
    ``k [B, T, Hk, dk]`` and ``v [B, T, Hv, dv]`` (model dtype, before the rule's L2 norm) and the gates
    ``g, beta [B, T, Hv]`` (float32, 0 on padding tokens)."""

    state: jax.Array
    conv_inputs: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def select_step(steps: GDNSteps, n_tokens: jax.Array, implementation: str = "xla") -> GDNCarry:
    """Carry after the first ``n_tokens[b]`` (0..T) tokens of each row's window: the rule runs again over them
    from the old state (``implementation`` names the recurrent kernel; its final state overwrites the old one)."""
    t = steps.k.shape[1]
    km1 = steps.conv_inputs.shape[1] - t
    keep = (jnp.arange(t)[None] < n_tokens[:, None])[..., None]
    g, beta = jnp.where(keep, steps.g, 0.0), jnp.where(keep, steps.beta, 0.0)
    # q only feeds the discarded read-out: k stands in for it
    _, state = fused_recurrent_gated_delta_rule(steps.k, steps.k, steps.v, g, beta, initial_state=steps.state,
                                                use_qk_l2norm_in_kernel=True, implementation=implementation)
    return GDNCarry(_conv_window(steps.conv_inputs, n_tokens, km1), state)


def _conv_window(conv_inputs: jax.Array, n_tokens: jax.Array, km1: int) -> jax.Array:
    """Rows [n, n + K-1) of each batch row: the last K-1 raw inputs once n new tokens were consumed."""
    return jax.vmap(lambda xs, n: jax.lax.dynamic_slice_in_dim(xs, n, km1, axis=0))(conv_inputs, n_tokens)


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
    valid: jax.Array,
    carry: GDNCarry,
    *,
    form: str = "chunk",
    step_states: bool = False,
    implementation: str = "xla",
    matmul: str = "xla",
    mixer: str = "xla",
):
    """One GDN mixer over a window.

    x: [B, T, H]; valid: [B, T] bool, a prefix of each row (right padding). ``form`` is ``"chunk"`` or
    ``"recurrent"``; ``step_states=True`` (recurrent only) returns :class:`GDNSteps` instead of the new carry.
    ``implementation`` names the gated delta rule kernel, ``matmul`` the projections', ``mixer`` the one-kernel
    recurrent mixer (:func:`jaxmtp.pallas.gated_delta_rule.gdn_mixer`; serving layout only, else unused).
    Returns (y [B, T, H], GDNCarry | GDNSteps).
    """
    b, t, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mm = lambda a, w: linear(a, w, implementation=matmul)  # noqa: E731
    if (step_states or form == "recurrent") and "in_proj_qkvzba" in p and use_fused_mixer(cfg, t, mixer):
        return _fused_mixer(p, cfg, x, valid, carry, step_states, mixer, mm)
    # mixed [B, T, C]: the raw conv inputs; z [B, T, Hv*dv]; b, a [B, T, Hv]
    mixed, z, b_raw, a = project(p, x, "in_proj_qkvzba", mm, cfg)
    z = z.reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(b_raw.astype(jnp.float32))
    a = a.astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    # Padding tokens must leave the state untouched: no decay (g = 0) and no write (beta = 0).
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)

    conv_inputs = jnp.concatenate([carry.conv, mixed.astype(carry.conv.dtype)], axis=1)
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
    y = mm(y, p["out_proj"])
    if step_states:
        return y, GDNSteps(carry.state, conv_inputs, k, v, g, beta)
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    return y, GDNCarry(_conv_window(conv_inputs, n_valid, cfg.linear_conv_kernel_dim - 1), final)


def _fused_mixer(p, cfg: Qwen35Config, x, valid, carry: GDNCarry, step_states: bool, implementation: str, mm):
    """The recurrent path with conv, gates and rule in one kernel after the fused input projection
    (:mod:`jaxmtp.pallas.gated_delta_rule.mixer_triton`)."""
    b, t, _ = x.shape
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    proj = mm(x, p["in_proj_qkvzba"])
    o, out = gdn_mixer(proj, carry.conv, p["conv1d"], p["A_log"], p["dt_bias"], carry.state, valid, cfg=cfg,
                       replay=step_states, implementation=implementation)
    mixed, z, _, _ = split_fused(proj, "in_proj_qkvzba", p, cfg)
    y = mm(gated_rms_norm(o, z.reshape(b, t, hv, dv), p["norm"], cfg.rms_norm_eps).reshape(b, t, hv * dv),
           p["out_proj"])
    if step_states:
        conv_inputs = jnp.concatenate([carry.conv, mixed.astype(carry.conv.dtype)], axis=1)
        return y, GDNSteps(carry.state, conv_inputs, *out)
    state, window = out
    return y, GDNCarry(window, state)
