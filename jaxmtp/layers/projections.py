"""Projections that read the same input, run as one product when their weights are concatenated.

The native (checkpoint) layout stores each projection separately; :func:`jaxmtp.param_layout.fuse_projections`
concatenates every group below into one weight (columns zero-padded to a multiple of ``FUSED_COLUMN_MULTIPLE``) for
serving. :func:`project` reads either layout, so the layers run on both.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

# fused name -> the projections it concatenates, in column order
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "in_proj_qkvzba": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # GDN
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # gated attention
    "gate_up_proj": ("gate_proj", "up_proj"),  # SwiGLU (dense MLP, MoE shared expert)
}
FUSED_COLUMN_MULTIPLE = 128


def project(p, x: jax.Array, fused: str, widths: Sequence[int], mm: Callable) -> list[jax.Array]:
    """``[x @ W_i for W_i in FUSED_GROUPS[fused]]``; ``widths`` are the output widths of the parts.

    x: [..., K]. With ``p[fused]`` present (shape [K, >= sum(widths)]) it is one product sliced into the parts,
    else one product per part. ``mm(x, w)`` computes a product.
    """
    names = FUSED_GROUPS[fused]
    if fused not in p:
        return [mm(x, p[name]) for name in names]
    y = mm(x, p[fused])
    outs, start = [], 0
    for w in widths:
        outs.append(y[..., start : start + w])
        start += w
    return outs
