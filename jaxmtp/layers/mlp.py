"""Dense SwiGLU and the sparse MoE block (fp32 softmax router, top-k, renormalise, gated shared expert).

Native layouts (``x @ W``): dense ``gate_proj``/``up_proj [H, I]``, ``down_proj [I, H]``; MoE router ``gate [H, E]``,
experts ``gate_up_proj [E, H, 2I]`` (columns [0, I) gate, [I, 2I) up) and ``down_proj [E, I, H]``, shared expert as a
dense MLP, ``shared_expert_gate [H, 1]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.config import Qwen35Config


def dense_mlp(p, x: jax.Array) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` for x [..., H]."""
    return (jax.nn.silu(x @ p["gate_proj"]) * (x @ p["up_proj"])) @ p["down_proj"]


def route(router_logits: jax.Array, top_k: int, renormalize: bool):
    """Softmax over all experts in float32, then top-k (optionally renormalised). Returns (weights, expert ids)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def grouped_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array, down: jax.Array):
    """Routed expert output, computing each expert only on the tokens routed to it.

    x: [N, H]; weights/experts: [N, K]; gate_up: [E, H, 2I]; down: [E, I, H]. Returns [N, H].
    Few routed rows (N*K <= E/2, decode and verify at small batch): each row gathers its expert's weights
    (:func:`gathered_experts`), reading only the experts in use. More rows: :func:`ragged_experts`.
    """
    if experts.size <= gate_up.shape[0] // 2:
        return gathered_experts(x, weights, experts, gate_up, down)
    return ragged_experts(x, weights, experts, gate_up, down)


def gathered_experts(x, weights, experts, gate_up, down):
    """Per routed row: gather that expert's matrices and multiply (bytes ~ rows x one expert)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)  # [N*K, H]
    h = jnp.einsum("rh,rhj->rj", rows, gate_up[flat])
    i = gate_up.shape[-1] // 2
    act = jax.nn.silu(h[:, :i]) * h[:, i:]
    y = jnp.einsum("ri,rih->rh", act, down[flat]).reshape(n, k, -1)
    return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights.astype(jnp.float32)).astype(x.dtype)


def ragged_experts(x, weights, experts, gate_up, down):
    """Token copies sorted by expert, multiplied group by group with ``jax.lax.ragged_dot``, weighted and scattered
    back."""
    n, k = experts.shape
    num_experts, _, two_i = gate_up.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[token], gate_up, group_sizes)
    i = two_i // 2
    act = jax.nn.silu(h[:, :i]) * h[:, i:]
    y = jax.lax.ragged_dot(act, down, group_sizes)  # [N*K, H]
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


def moe_mlp(p, cfg: Qwen35Config, x: jax.Array) -> jax.Array:
    """Sparse MoE block for x [..., H]: routed experts plus the sigmoid-gated shared expert."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, experts = route(x2 @ p["gate"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    routed = grouped_experts(x2, weights.astype(x.dtype), experts, p["experts"]["gate_up_proj"], p["experts"]["down_proj"])
    shared = dense_mlp(p["shared_expert"], x2)
    shared = jax.nn.sigmoid((x2 @ p["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype) * shared
    return (routed + shared).reshape(shape)
