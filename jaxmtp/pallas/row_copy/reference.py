"""Row-block copies between arrays ``[N, H, S, D]``, the jnp reference: move i copies rows
``[src_start, src_start + rows)`` of entry ``src_entry`` (every head) to rows ``[dst_start, dst_start + rows)`` of
entry ``dst_entry``, for i < count, in order, in every (dst, src) pair alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def copy_rows_reference(dsts: list, srcs: list, moves, count, rows: int) -> list:
    """``dsts`` with the moves applied from ``srcs`` (pairs of one dtype, ``[N, H, S, D]`` with equal H and D):
    ``moves [n, 4]`` int32 rows ``(src_entry, src_start, dst_entry, dst_start)``, ``count`` int32 (moves past it are
    ignored), ``rows`` the rows per move. A loop of dynamic slices and updates with a traced trip count."""

    moves = jnp.asarray(moves)

    def body(i, outs):
        se, ss, de, ds = moves[i, 0], moves[i, 1], moves[i, 2], moves[i, 3]
        return [jax.lax.dynamic_update_slice(
            out, jax.lax.dynamic_slice(src, (se, 0, ss, 0), (1, src.shape[1], rows, src.shape[3])), (de, 0, ds, 0))
            for out, src in zip(outs, srcs)]

    return jax.lax.fori_loop(0, count, body, list(dsts))
