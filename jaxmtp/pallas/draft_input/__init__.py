"""The MTP draft passes' inputs ``concat[rms_norm(E[d]), rms_norm(hidden)]`` [B, 2H]: from known ids (:func:`fc_input`)
or finishing the int4 head's argmax partials (:func:`draft_input`). ``implementation``: ``"xla"`` (the references in
:mod:`.reference`), ``"triton"`` / ``"triton_interpret"`` (one kernel, :mod:`.draft_input_triton`) where the row
length allows (the add + norm kernel's rule, :func:`jaxmtp.pallas.norms.supports`).
"""

from __future__ import annotations

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.draft_input.draft_input_triton import draft_input_triton, fc_input_triton
from jaxmtp.pallas.draft_input.reference import draft_input_reference, fc_input_reference, pass_positions
from jaxmtp.pallas.norms.add_rms_norm_triton import supports


def draft_input(vals, idx, embed, hidden, w_e, w_h, eps: float, *, implementation: str = "xla", position=None):
    """A recursive draft pass's input from the previous head's argmax partials: ``(d [B], concat[rms_norm(embed[d]),
    rms_norm(hidden)] [B, 2H])`` (:func:`draft_input_reference`); one kernel on ``"triton"`` / ``"triton_interpret"``
    (:mod:`.draft_input_triton`) where the row length allows. ``position = (length [B], active [B], offset)``: also
    the pass's positions ``where(active, length + offset, -1)`` [B] int32, a third output (formed in the kernel)."""
    if implementation in (TRITON, TRITON_INTERPRET) and supports(hidden.shape[-1]):
        length, active, offset = position if position is not None else (None, None, None)
        return draft_input_triton(vals, idx, embed, hidden, w_e, w_h, eps, length, active, offset=offset,
                                  interpret=implementation == TRITON_INTERPRET)
    out = draft_input_reference(vals, idx, embed, hidden, w_e, w_h, eps)
    return out if position is None else (*out, pass_positions(*position))


def fc_input(ids, embed, hidden, w_e, w_h, eps: float, *, implementation: str = "xla"):
    """The MTP fc input for known ids [...] and hidden [..., H]: ``concat[rms_norm(embed[ids]), rms_norm(hidden)]``
    [..., 2H] (:func:`fc_input_reference`); one kernel on ``"triton"`` / ``"triton_interpret"``
    (:func:`.draft_input_triton.fc_input_triton`) where the row length allows."""
    hdim = hidden.shape[-1]
    if implementation in (TRITON, TRITON_INTERPRET) and supports(hdim) and ids.size > 0:
        x = fc_input_triton(ids.reshape(-1), embed, hidden.reshape(-1, hdim), w_e, w_h, eps,
                            interpret=implementation == TRITON_INTERPRET)
        return x.reshape(*ids.shape, 2 * hdim)
    return fc_input_reference(ids, embed, hidden, w_e, w_h, eps)


__all__ = ["draft_input", "draft_input_reference", "draft_input_triton", "fc_input", "fc_input_reference", "fc_input_triton",
           "pass_positions"]
