"""Tensor parallelism inside ``jax.shard_map``: the few collectives a sharded step makes, and how it makes them.

The whole step runs under one ``shard_map`` (:mod:`jaxmtp.parallel`), so every op sees its rank's local shapes
and the only communication is what this module does:

* :func:`reduce_sum` after each row-parallel product (attention ``o_proj``, GDN ``out_proj``, the MLP's
  ``down_proj``; an MoE layer's routed experts and shared expert together): two per layer;
* :func:`vocab_argmax` / :func:`gather_vocab` for a vocabulary-parallel LM head: greedy choice from each rank's
  local (max, id) pair, lowest id on ties as ``jnp.argmax``; sampling gathers the logits and samples as one device.

:class:`TensorParallel` is carried by the :class:`jaxmtp.pallas.Backend` (``backend.parallel``), so the ops that
end a block reduce without any layer knowing about ranks. ``reduce="psum"`` (the default) sums with ``lax.psum``
in float32; ``reduce="oneshot"`` sums a decode or verify step's rows with a one-shot kernel on the compute stream
(:mod:`jaxmtp.pallas.allreduce_oneshot`, CUDA; larger tensors take the psum) that gives the psum's values, summed
in rank order; ``reduce="fixed"`` fixes the order: each row-parallel product is computed as ``chunks`` fixed slices of
its K axis whose float32 partial products are summed in one balanced tree of the same shape at every TP degree (the
slices a rank owns are a subtree; the ranks' subtree sums are gathered and the tree finished in rank order), so the
reduction gives the same bits at TP 1, 2, 4, 8 and across processes, where a psum does not. Whole outputs (logits,
drafts, carries, tokens) are then bit-identical across TP degrees where each rank's per-head ops compile to the
arithmetic of one device's, which holds N times the heads: on the CPU, under :data:`SHAPE_STABLE_CPU_XLA_FLAGS`.
MoE experts are whole on one rank, so their reduction is exact in either mode (one rank's value plus zeros).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

REDUCE_MODES = ("psum", "fixed", "oneshot")

#: XLA flags under which the CPU backend compiles an op to the same arithmetic whatever the sizes of its other axes,
#: so that a rank's share of the heads gets one device's bits. By default it does not (measured with jax 0.10.2):
#: YNNPACK's dot fusions choose their kernel by shape (a product's columns split 8 ways differ from the whole), and
#: the vectoriser sums a row reduction's elements in an order that depends on how many rows the fusion holds (the
#: square sum over one head differs from the same head's among 8). The first flag leaves dots to XLA's own emitter,
#: the second keeps codegen to scalar lanes. A one-row (matrix-vector) product still sums in another order than
#: the same row among several; docs/engine.md ("Reduction modes") has the two rules that keep such products from
#: changing with the layout. Used by the fixed mode's bit-equality test (tests/bitwise_worker.py); it slows CPU
#: code, so nothing sets it by default.
SHAPE_STABLE_CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_prefer_vector_width=32"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The step's tensor-parallel setting: ``size`` ranks on mesh axis ``axis``; ``reduce`` mode (module doc);
    ``chunks``: the fixed mode's K slices per row-parallel product (a multiple of every TP degree used);
    ``vocab_sharded``: the LM head holds V / size columns per rank (else it is replicated); ``peers``: the one-shot
    mode's workspace addresses (:func:`jaxmtp.pallas.allreduce_oneshot.allocate`)."""

    size: int = 1
    axis: str = "tp"
    reduce: str = "psum"
    chunks: int = 8
    vocab_sharded: bool = False
    peers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, not {self.reduce!r}")

    @property
    def active(self) -> bool:
        """Whether the ops run under a ``shard_map`` with this axis (also at size 1 in the fixed mode, whose
        chunked sums are the reference every TP degree matches)."""
        return self.size > 1 or self.reduce == "fixed"

    @property
    def fixed(self) -> bool:
        return self.reduce == "fixed"


SINGLE = TensorParallel()


def rank(tp: TensorParallel) -> jax.Array:
    """This rank's index on the tp axis (0 without tensor parallelism)."""
    return jax.lax.axis_index(tp.axis) if tp.active else jnp.int32(0)


def reduce_sum(y: jax.Array, tp: TensorParallel, dtype=None) -> jax.Array:
    """The sum over ranks of the local partial ``y`` (any float dtype, summed in float32), as ``dtype`` (default
    y's)."""
    return reduce_parts(y[None], tp, dtype or y.dtype)


def reduce_parts(parts: jax.Array, tp: TensorParallel, dtype=None) -> jax.Array:
    """:func:`reduce_sum` of a local partial given as ``parts [P, ...]`` (any float dtype), summed in part order
    (:func:`jaxmtp.pallas._common.sum_parts`) in float32; the one-shot kernel sums and widens them itself, with no
    launch of their own. As ``dtype`` (default float32)."""
    from jaxmtp.pallas._common import sum_parts

    dtype = dtype or jnp.float32
    if tp.active and tp.reduce == "oneshot" and tp.size > 1:
        from jaxmtp.pallas import allreduce_oneshot

        if parts[0].size <= allreduce_oneshot.CAPACITY:
            return allreduce_oneshot.allreduce(parts, tp.axis, tp.size, tp.peers, parts=True).astype(dtype)
    total = sum_parts(parts.astype(jnp.float32))
    return (jax.lax.psum(total, tp.axis) if tp.active else total).astype(dtype)


def _tree_sum(parts: jax.Array) -> jax.Array:
    """Balanced pairwise sum over the leading axis (a power of two): ((p0 + p1) + (p2 + p3)) + ..."""
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def fixed_product(a: jax.Array, w: jax.Array, tp: TensorParallel) -> jax.Array:
    """``a @ w`` summed over the ranks in the fixed order: a [..., K_local], w [K_local, N] (this rank's slice of a
    row-parallel weight). Returns float32 [..., N], the same bits at every TP degree."""
    local = tp.chunks // tp.size
    if tp.chunks % tp.size or local & (local - 1) or a.shape[-1] % local:
        raise ValueError(f"the fixed reduction needs chunks={tp.chunks} to be a power-of-two multiple of the TP "
                         f"degree {tp.size} and to divide K={a.shape[-1] * tp.size}")
    k = a.shape[-1] // local
    parts = jnp.stack([jnp.matmul(a[..., i * k:(i + 1) * k], w[i * k:(i + 1) * k],
                                  preferred_element_type=jnp.float32) for i in range(local)])
    mine = _tree_sum(parts)
    if tp.size == 1:
        return mine
    return _tree_sum(jax.lax.all_gather(mine, tp.axis))


def exact_sum(y: jax.Array, tp: TensorParallel) -> jax.Array:
    """Sum over ranks of values that are nonzero on one rank at most (an expert's output lives on its rank): exact
    in any order, so psum in both modes."""
    return jax.lax.psum(y, tp.axis) if tp.active else y


def vocab_argmax(logits: jax.Array, tp: TensorParallel) -> jax.Array:
    """Greedy ids int32 [...] over the global vocabulary from this rank's logits [..., V / size] (vocab-parallel
    head): each rank's (max, global id) pair is gathered and the first maximum wins, so ties resolve to the lowest
    id as ``jnp.argmax`` over the whole row does."""
    if not tp.vocab_sharded:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    v = logits.shape[-1]
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32) + rank(tp) * v
    vals = jnp.max(logits, axis=-1)
    all_vals = jax.lax.all_gather(vals, tp.axis, axis=-1)  # [..., size] in rank order = id order
    all_ids = jax.lax.all_gather(ids, tp.axis, axis=-1)
    best = jnp.argmax(all_vals, axis=-1)
    return jnp.take_along_axis(all_ids, best[..., None], axis=-1)[..., 0]


def gather_vocab(logits: jax.Array, tp: TensorParallel) -> jax.Array:
    """The full logits [..., V] from each rank's [..., V / size] (identity for a replicated head)."""
    if not tp.vocab_sharded:
        return logits
    return jax.lax.all_gather(logits, tp.axis, axis=logits.ndim - 1, tiled=True)


__all__ = ["REDUCE_MODES", "SHAPE_STABLE_CPU_XLA_FLAGS", "SINGLE", "TensorParallel", "exact_sum", "fixed_product",
           "gather_vocab", "rank", "reduce_parts", "reduce_sum", "vocab_argmax"]
