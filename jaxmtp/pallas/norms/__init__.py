"""Fused residual add + zero-centred RMSNorm: ``(s, h) = (x + y, rms_norm(x + y, w))``, the model's residual add
followed by the next norm; and :func:`rms_norm`, the norm alone on the same kernel.

``add_rms_norm(x, y, weight, eps, implementation=...)``: ``"xla"`` is the reference; ``"triton"`` /
``"triton_interpret"`` run :func:`add_rms_norm_triton` when it takes the row length (:func:`supports`: all Qwen3.5
hidden sizes), else the reference. Other names (TPU) run the reference, which XLA fuses there. The model passes
``Backend.norm``: ``"triton"`` under ``"auto"`` on NVIDIA GPUs since run 11, ``"xla"`` elsewhere (docs/kernels.md has
the GPU measurements).
"""

from __future__ import annotations

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET, dense
from jaxmtp.layers.norms import rms_norm as rms_norm_reference
from jaxmtp.pallas.norms.add_rms_norm_triton import add_rms_norm_triton, rms_norm_triton, supports
from jaxmtp.pallas.norms.draft_input_triton import draft_input_triton
from jaxmtp.pallas.norms.reference import add_rms_norm_reference, draft_input_reference


def add_rms_norm(x, y, weight, eps: float, *, implementation: str = "xla"):
    """x, y: [..., H] (one dtype; y may be a :class:`jaxmtp.pallas._common.SplitSum`, a product's split-K partial
    sums, which the kernel adds itself); weight: [H] float32 offset. Returns ``(s, h)`` [..., H] in x.dtype."""
    if implementation in (TRITON, TRITON_INTERPRET) and x.size > 0 and supports(x.shape[-1]):
        return add_rms_norm_triton(x, y, weight, eps, interpret=implementation == TRITON_INTERPRET)
    return add_rms_norm_reference(x, dense(y), weight, eps)


def rms_norm(x, weight, eps: float, *, implementation: str = "xla"):
    """The norm alone (:func:`jaxmtp.layers.norms.rms_norm`), on the same kernel where it applies: the MTP layer's
    input norm, whose input is a product's output rather than a residual sum."""
    if implementation in (TRITON, TRITON_INTERPRET) and x.size > 0 and supports(x.shape[-1]):
        return rms_norm_triton(x, weight, eps, interpret=implementation == TRITON_INTERPRET)
    return rms_norm_reference(x, weight, eps)


def draft_input(vals, idx, embed, hidden, w_e, w_h, eps: float, *, implementation: str = "xla"):
    """A recursive draft pass's input from the previous head's argmax partials: ``(d [B], concat[rms_norm(embed[d]),
    rms_norm(hidden)] [B, 2H])`` (:func:`draft_input_reference`); one kernel on ``"triton"`` / ``"triton_interpret"``
    (:mod:`.draft_input_triton`) where the row length allows."""
    if implementation in (TRITON, TRITON_INTERPRET) and supports(hidden.shape[-1]):
        return draft_input_triton(vals, idx, embed, hidden, w_e, w_h, eps, interpret=implementation == TRITON_INTERPRET)
    return draft_input_reference(vals, idx, embed, hidden, w_e, w_h, eps)


__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_triton", "draft_input", "draft_input_reference",
           "draft_input_triton", "rms_norm", "rms_norm_reference", "rms_norm_triton", "supports"]
