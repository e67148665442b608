"""Row-block copies between arrays ``[N, H, S, D]`` (the prefix cache's copies between the slots' carries and its
pools): ``copy_rows(dsts, srcs, moves, count, rows=..., implementation=...)``. ``"xla"`` is the reference (a loop of
dynamic updates, :mod:`.reference`); ``"triton"`` / ``"triton_interpret"`` run one kernel launch that writes the
destinations in place (:mod:`.row_copy_triton`) where it takes the arrays, else the reference.
"""

from __future__ import annotations

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.row_copy.reference import copy_rows_reference
from jaxmtp.pallas.row_copy.row_copy_triton import copy_rows_triton, supports


def copy_rows(dsts: list, srcs: list, moves, count, *, rows: int, implementation: str = "xla") -> list:
    """``dsts`` with rows ``[src_start, src_start + rows)`` of entry ``src_entry`` of each src copied to rows
    ``[dst_start, dst_start + rows)`` of entry ``dst_entry``, for each of the first ``count`` rows of ``moves [n, 4]``
    (``(src_entry, src_start, dst_entry, dst_start)``, int32) in order."""
    if not dsts:
        return []
    if implementation in (TRITON, TRITON_INTERPRET) and supports(dsts, srcs):
        return copy_rows_triton(dsts, srcs, moves, count, rows=rows, interpret=implementation == TRITON_INTERPRET)
    return copy_rows_reference(dsts, srcs, moves, count, rows)


__all__ = ["copy_rows", "copy_rows_reference", "copy_rows_triton", "supports"]
