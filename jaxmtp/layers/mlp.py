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
from jaxmtp.layers.projections import output_product, part_widths, project
from jaxmtp.pallas.matmul import layer_swiglu, linear, output_linear
from jaxmtp.pallas.moe import moe_experts


def dense_mlp(p, x: jax.Array, matmul: str = "xla", out_matmul: str = "xla", partials: bool = False) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` for x [..., H]; ``matmul`` names the projection implementation,
    ``out_matmul`` down_proj's when it is stored transposed (then, with gate|up fused, the kernel forms the SwiGLU;
    ``partials``: it may return a :class:`jaxmtp.pallas._common.SplitSum`, for the residual add + norm). x may be
    a :class:`jaxmtp.pallas._common.NormedRows` (the post-attention norm, formed by the gate|up product). An int8
    down_proj (the quantised MTP layer) does not form the SwiGLU: inside its one-row product that took 6.1-6.3 us
    against 4.2 + 1.4 (H100, runs 15 and 18). The int8 gate|up product forms it instead where
    :func:`jaxmtp.pallas.matmul.layer_swiglu` runs."""
    mm = lambda a, w: linear(a, w, implementation=matmul)  # noqa: E731
    if "down_proj_t" in p and "gate_up_proj" in p:
        return output_linear(mm(x, p["gate_up_proj"]), p["down_proj_t"], swiglu=True, implementation=out_matmul,
                             partials=partials)
    fused = layer_swiglu(x, p["gate_up_proj"], part_widths(None, "gate_up_proj", p)[0], matmul) if (
        "gate_up_proj" in p) else None
    if fused is None:
        gate, up = project(p, x, "gate_up_proj", mm)
        fused = jax.nn.silu(gate) * up
    return output_product(p, "down_proj", fused, mm, out_matmul, partials)


def route(router_logits: jax.Array, top_k: int, renormalize: bool):
    """Softmax over all experts in float32, then top-k (optionally renormalised). Returns (weights, expert ids)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def moe_mlp(p, cfg: Qwen35Config, x: jax.Array, implementation: str = "xla", matmul: str = "xla",
            out_matmul: str = "xla") -> jax.Array:
    """Sparse MoE block for x [..., H]: routed experts (``implementation``: see :func:`jaxmtp.pallas.moe.moe_experts`) plus the
    sigmoid-gated shared expert (``matmul`` / ``out_matmul``: its projections, as in :func:`dense_mlp`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, experts = route(x2 @ p["gate"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    ex = p["experts"]
    routed = moe_experts(x2, weights.astype(x.dtype), experts, ex["gate_up_proj"], ex["down_proj"],
                         implementation=implementation)
    shared = dense_mlp(p["shared_expert"], x2, matmul, out_matmul)
    shared = jax.nn.sigmoid((x2 @ p["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype) * shared
    return (routed + shared).reshape(shape)
