"""Fused residual add + zero-centred RMSNorm: ``(s, h) = (x + y, rms_norm(x + y, w))``, the model's residual add
followed by the next norm; and :func:`rms_norm`, the norm alone on the same kernel.

``add_rms_norm(x, y, weight, eps, implementation=...)``: ``"xla"`` is the reference; ``"triton"`` /
``"triton_interpret"`` run :func:`add_rms_norm_triton` when it takes the row length (:func:`supports`: all Qwen3.5
hidden sizes), else the reference. Other names (TPU) run the reference, which XLA fuses there. The model passes
``Backend.norm``: ``"triton"`` under ``"auto"`` on NVIDIA GPUs, ``"xla"`` elsewhere (docs/kernels.md has
the GPU measurements).
"""

from __future__ import annotations

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET, SplitSum, dense
from jaxmtp.pallas.norms.reference import rms_norm as rms_norm_reference
from jaxmtp.pallas.matmul.reference import INT4_BLOCK
from jaxmtp.pallas.norms.add_rms_norm_triton import (add_rms_norm_quantized_triton, add_rms_norm_triton,
                                                     rms_norm_triton, supports)
from jaxmtp.pallas.norms.reference import add_rms_norm_reference


def add_rms_norm(x, y, weight, eps: float, *, implementation: str = "xla"):
    """x, y: [..., H] (one dtype; y may be a :class:`jaxmtp.pallas._common.SplitSum`, a product's split-K partial
    sums, which the kernel adds itself); weight: [H] float32 offset. Returns ``(s, h)`` [..., H] in x.dtype."""
    if implementation in (TRITON, TRITON_INTERPRET) and x.size > 0 and supports(x.shape[-1]):
        return add_rms_norm_triton(x, y, weight, eps, interpret=implementation == TRITON_INTERPRET)
    return add_rms_norm_reference(x, dense(y), weight, eps)


def add_rms_norm_quantized(x, y, weight, eps: float, *, implementation: str = "xla"):
    """:func:`add_rms_norm` and, where the kernel runs (a kernel name, y dense, H a multiple of 128), h's rows
    quantised for the int4 draft head in the same launch: ``(s, h, (xlo, xhi, row_scale, row_sum))``
    (:func:`.add_rms_norm_triton.add_rms_norm_quantized_triton`), else ``(s, h, None)`` and the head quantises
    them itself."""
    if (implementation in (TRITON, TRITON_INTERPRET) and x.size > 0 and supports(x.shape[-1])
            and x.shape[-1] % INT4_BLOCK == 0 and not isinstance(y, SplitSum)):
        return add_rms_norm_quantized_triton(x, y, weight, eps, interpret=implementation == TRITON_INTERPRET)
    return (*add_rms_norm(x, y, weight, eps, implementation=implementation), None)


def rms_norm(x, weight, eps: float, *, implementation: str = "xla"):
    """The norm alone (:func:`jaxmtp.pallas.norms.reference.rms_norm`), on the same kernel where it applies: the MTP layer's
    input norm, whose input is a product's output rather than a residual sum."""
    if implementation in (TRITON, TRITON_INTERPRET) and x.size > 0 and supports(x.shape[-1]):
        return rms_norm_triton(x, weight, eps, interpret=implementation == TRITON_INTERPRET)
    return rms_norm_reference(x, weight, eps)


__all__ = ["add_rms_norm", "add_rms_norm_quantized", "add_rms_norm_reference", "add_rms_norm_triton", "rms_norm",
           "rms_norm_reference", "rms_norm_triton", "supports"]
