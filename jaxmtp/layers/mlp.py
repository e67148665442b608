"""Dense SwiGLU and the sparse MoE block (fp32 softmax router, top-k, renormalise, gated shared expert).

Native layouts (``x @ W``): dense ``gate_proj``/``up_proj [H, I]``, ``down_proj [I, H]``; MoE router ``gate [H, E]``,
experts ``gate_up_proj [E, H, 2I]`` (columns [0, I) gate, [I, 2I) up) and ``down_proj [E, I, H]``, shared expert as a
dense MLP, ``shared_expert_gate [H, 1]``. The serving layout holds a dense ``gate_up_proj [H, 2I]`` instead of
``gate_proj``/``up_proj`` (:mod:`jaxmtp.layers.projections`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.config import Qwen35Config
from jaxmtp.layers.projections import output_weight, part_widths
from jaxmtp.pallas import ops
from jaxmtp.pallas.backend import XLA, Backend


def dense_mlp(p, x, backend: Backend = XLA, partials: bool = False, reduce: bool = True):
    """``down(silu(gate(x)) * up(x))`` for x [..., H] (or a lazy norm, :func:`jaxmtp.pallas.ops.normed`).
    ``partials``: the result may be a :class:`jaxmtp.pallas._common.SplitSum`, for the residual add + norm.
    ``reduce=False``: under tensor parallelism, this rank's partial (:func:`jaxmtp.pallas.ops.output_product`)."""
    down, transposed = output_weight(p, "down_proj")
    if "gate_up_proj" in p:
        width = part_widths(None, "gate_up_proj", p)[0]
        return ops.swiglu_mlp(x, p["gate_up_proj"], down, transposed, width, backend, partials=partials,
                              reduce=reduce)
    x = ops.form(x, backend)
    act = jax.nn.silu(ops.linear(x, p["gate_proj"], backend)) * ops.linear(x, p["up_proj"], backend)
    return ops.output_product(act, down, transposed, backend, partials=partials, reduce=reduce)


def route(router_logits: jax.Array, top_k: int, renormalize: bool):
    """Softmax over all experts in float32, then top-k (optionally renormalised). Returns (weights, expert ids)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def moe_mlp(p, cfg: Qwen35Config, x, backend: Backend = XLA) -> jax.Array:
    """Sparse MoE block for x [..., H]: routed experts (:func:`jaxmtp.pallas.ops.moe_experts`) plus the
    sigmoid-gated shared expert (:func:`dense_mlp`); under tensor parallelism both are this rank's partials, summed
    over the ranks in one reduction (:func:`jaxmtp.pallas.ops.tp_sum`)."""
    x = ops.form(x, backend)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, experts = route(x2 @ p["gate"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    ex = p["experts"]
    routed = ops.moe_experts(x2, weights.astype(x.dtype), experts, ex["gate_up_proj"], ex["down_proj"], backend)
    shared = ops.form(dense_mlp(p["shared_expert"], x2, backend, reduce=False), backend)
    shared = jax.nn.sigmoid((x2 @ p["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype) * shared
    return ops.tp_sum((routed + shared).reshape(shape), backend)
