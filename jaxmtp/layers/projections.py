"""Projections that read the same input, run as one product when their weights are concatenated.

The native (checkpoint) layout stores each projection separately; :func:`jaxmtp.param_layout.fuse_projections`
concatenates every group below into one weight (columns zero-padded to a multiple of ``FUSED_COLUMN_MULTIPLE``) for
serving. Where a group's parts differ in kind (an FP8 checkpoint's GDN ``in_proj_qkv|z`` are block-FP8, its
``in_proj_b|a`` floating: :mod:`jaxmtp.fp8`), each run of parts of one kind is fused under its names joined by
:data:`RUN_JOIN` (``"in_proj_qkv+in_proj_z"``), unpadded. :func:`fused_product` reads every layout, so the layers
run on all.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxmtp.pallas.ops import is_fp8, is_quantized

# Projections that end a block (their output joins the residual stream). The serving layout may store them
# transposed, ``[N, K]`` under ``name + "_t"`` (:func:`jaxmtp.param_layout.set_output_layout`), for the one-row
# output kernels (:func:`jaxmtp.pallas.ops.output_product`).
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")
TRANSPOSED_SUFFIX = "_t"

# fused name -> the projections it concatenates, in column order
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "in_proj_qkvzba": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # GDN
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # gated attention
    "gate_up_proj": ("gate_proj", "up_proj"),  # SwiGLU (dense MLP, MoE shared expert)
}
FUSED_COLUMN_MULTIPLE = 128
RUN_JOIN = "+"  # the key of a fused run of a group's parts: their names joined


def part_widths(cfg, fused: str, p) -> tuple[int, ...]:
    """Output widths of the projections in ``FUSED_GROUPS[fused]`` (``p``: the layer's dict, for the SwiGLU width,
    which differs between the dense MLP and the MoE shared expert)."""
    if fused == "in_proj_qkvzba":
        hv = cfg.linear_num_value_heads
        return (cfg.conv_dim, hv * cfg.linear_value_head_dim, hv, hv)
    if fused == "qkv_proj":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return (cfg.num_attention_heads * 2 * cfg.head_dim, kv, kv)
    if "down_proj_t" in p:  # SwiGLU: gate and up are I wide, down_proj's input
        i = p["down_proj_t"].shape[1]
    else:
        w = p["down_proj"]
        i = w["weight"].shape[1] if is_quantized(w) or is_fp8(w) else w.shape[0]
    return (i, i)


def stored_parts(p, fused: str) -> list[str]:
    """The keys of ``p`` that hold the parts of ``FUSED_GROUPS[fused]``, in column order: a part's own name or the
    name of the fused run (:data:`RUN_JOIN`) that starts with it."""
    parts, keys, i = FUSED_GROUPS[fused], [], 0
    while i < len(parts):
        j = next(j for j in range(len(parts), i, -1) if j == i + 1 or RUN_JOIN.join(parts[i:j]) in p)
        keys.append(RUN_JOIN.join(parts[i:j]))
        i = j
    return keys


def fused_product(p, x, fused: str, mm: Callable, form: Callable, mm_parts: Callable | None = None):
    """``x @ W`` for the fused weight ``p[fused]`` [K, >= sum of the parts' widths], or the products of the stored
    parts (:func:`stored_parts`: native projections or fused runs) concatenated (x formed once first with ``form``:
    it may be a lazy norm). ``mm(x, w)`` computes a product; ``mm_parts(x, [w, ...])``, where given, the parts'
    products concatenated (:func:`jaxmtp.pallas.ops.linear_parts`)."""
    if fused in p:
        return mm(x, p[fused])
    x = form(x)
    parts = [p[name] for name in stored_parts(p, fused)]
    if mm_parts is not None:
        return mm_parts(x, parts)
    return jnp.concatenate([mm(x, w) for w in parts], axis=-1)


def split_fused(y: jax.Array, fused: str, p, cfg=None) -> list[jax.Array]:
    """The parts of ``y [..., >= sum of widths]`` along its last axis, in ``FUSED_GROUPS[fused]`` order (padding
    dropped): a fused projection's output, or the fused weight's columns."""
    outs, start = [], 0
    for w in part_widths(cfg, fused, p):
        outs.append(y[..., start : start + w])
        start += w
    return outs


def output_weight(p, name: str):
    """``(w, transposed)`` for the output projection ``name`` (one of :data:`OUTPUT_PROJECTIONS`): stored transposed
    under ``name + "_t"`` ([N, K]) or as it is under ``name``."""
    if name + TRANSPOSED_SUFFIX in p:
        return p[name + TRANSPOSED_SUFFIX], True
    return p[name], False
