"""Row layout shared by the grouped-expert kernels: (token, expert) pairs laid out in row blocks of one expert.

The kernels multiply blocks of ``bm`` rows by one expert's matrices, so the N*K pairs are placed in a padded row
array in which every block of ``bm`` rows belongs to a single expert. Two layouts (both plain jnp, static sizes):

* ``"pairs"`` (few pairs, decode): block b holds pair b alone (its row 0; rows 1..bm-1 are zero padding). No sort;
  ``N*K`` blocks. An expert chosen by several tokens is streamed once per pair (from L2 when those programs run
  close together; few pairs share an expert while N*K <= E/4).
* ``"sorted"`` (more pairs): pairs sorted by expert (stable), each expert's group padded to a multiple of ``bm``
  rows. With ``g = min(E, N*K)`` groups at most, the number of blocks is at most ``(N*K + g * (bm - 1)) // bm``
  (each group of c rows takes ``ceil(c / bm) <= (c + bm - 1) / bm`` blocks); blocks past the used ones are
  *invalid*: kernels skip them (no weight reads, outputs left unwritten) and no pair points into them.

``block_expert[b]`` is the expert of block b; past the valid blocks it repeats the last valid block's expert (so a
TPU pipeline sees an unchanged block index and fetches nothing). ``n_valid`` ([1] int32) counts the valid blocks,
``row_token`` ([nb * bm]) is the token of each row (N, i.e. out of range, for padding rows: gathered as zeros) and
``pair_row`` ([N*K]) the row of pair ``n * K + k``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Layout(NamedTuple):
    row_token: jax.Array     # [nb * bm] int32
    block_expert: jax.Array  # [nb] int32
    n_valid: jax.Array       # [1] int32
    pair_row: jax.Array      # [N * K] int32


def choose_layout(n_pairs: int, num_experts: int, *, max_block_rows: int = 64, layout: str | None = None,
                  block_rows: int | None = None):
    """Static plan ``(layout, bm, nb)``: ``"pairs"`` while N*K <= E/4 (few experts shared by two pairs), else
    ``"sorted"`` with bm the power of two >= 16 nearest above the mean rows per touched expert (capped)."""
    layout = layout or ("pairs" if n_pairs <= max(1, num_experts // 4) else "sorted")
    if layout == "pairs":
        bm = block_rows or 16
        return layout, bm, n_pairs
    if layout != "sorted":
        raise ValueError(f"unknown MoE layout {layout!r}; use 'pairs' or 'sorted'")
    groups = min(num_experts, n_pairs)
    if block_rows is None:
        mean = n_pairs / groups
        block_rows = 16
        while block_rows < max_block_rows and mean > 1.5 * block_rows:
            block_rows *= 2
    return layout, block_rows, (n_pairs + groups * (block_rows - 1)) // block_rows


def make_layout(experts: jax.Array, num_experts: int, layout: str, bm: int, nb: int) -> Layout:
    n, k = experts.shape
    p = n * k
    flat = experts.reshape(-1).astype(jnp.int32)
    if layout == "pairs":
        rows = lax.iota(jnp.int32, nb * bm)
        row_token = jnp.where(rows % bm == 0, rows // (bm * k), n)
        return Layout(row_token, flat, jnp.full((1,), p, jnp.int32), lax.iota(jnp.int32, p) * bm)
    sorted_e, order = lax.sort((flat, lax.iota(jnp.int32, p)), num_keys=1, is_stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    blocks = (counts + bm - 1) // bm
    block_end = jnp.cumsum(blocks)                   # one past each expert's last block
    first_row = (block_end - blocks) * bm            # first padded row of each expert
    first_pos = jnp.cumsum(counts) - counts          # first sorted position of each expert
    dest = first_row[sorted_e] + lax.iota(jnp.int32, p) - first_pos[sorted_e]  # row of sorted pair s
    pair_row = jnp.zeros((p,), jnp.int32).at[order].set(dest)
    row_token = jnp.full((nb * bm,), n, jnp.int32).at[dest].set(order // k)
    n_valid = block_end[-1]
    b = jnp.minimum(lax.iota(jnp.int32, nb), n_valid - 1)
    block_expert = jnp.sum(block_end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)
    return Layout(row_token, block_expert, n_valid.reshape(1), pair_row)


def gather_rows(x: jax.Array, lay: Layout, dtype) -> jax.Array:
    """``x[row_token]`` ([nb * bm, H]) with zero padding rows."""
    return jnp.take(x, lay.row_token, axis=0, mode="fill", fill_value=0).astype(dtype)


def combine(y: jax.Array, weights: jax.Array, lay: Layout, dtype) -> jax.Array:
    """``out[n] = sum_k weights[n, k] * y[pair_row[n * K + k]]`` in float32, cast to ``dtype`` ([N, H])."""
    n, k = weights.shape
    yk = jnp.take(y, lay.pair_row, axis=0).astype(jnp.float32).reshape(n, k, -1)
    return jnp.sum(yk * weights.astype(jnp.float32)[..., None], axis=1).astype(dtype)
