"""Prefix caching: a prompt's prefix that an earlier prompt already prefilled is copied into the slot instead of
being run again, with the tokens of a cold run.

What resuming at position P needs (P a multiple of the granularity G): every attention layer's KV rows 0..P-1 (the
target's and the MTP layer's), each GDN layer's float32 state after token P-1 and its conv ring. The MTP layer's KV
row P-1 depends on token P as well (its input is ``(embed(x_P), h_{P-1})``), so a snapshot is keyed by the token
ids 0..P-1 *and* token P: a prompt that shares tokens 0..P with an earlier one resumes at P exactly, with no row to
recompute; one that departs exactly at token P resumes at the boundary before (the only case where a block is run
again, against vLLM's recompute of a block on every hit under MTP).

A snapshot is only taken of a final state. In a prompt: the end of a chunk that is not the prompt's last (prefill
ends a chunk at each boundary the prompt publishes, whatever ``prefill_chunk``), at the prompt's last boundary and at
the point where it departs from a prefix published before (:meth:`PrefixIndex.branch_point`), not at every boundary:
a snapshot weighs as much as 1.4k-5.9k tokens of KV (a 4B snapshot is 49 MiB), so one per G tokens would add such a
copy to every chunk of every prompt and fill the pool with states no prompt resumes from. After a device loop: a
slot, whose steps commit exactly the tokens they emit (a tail snapshot, off the grid: a request that ended, or one
still decoding that crossed a multiple of G). Never inside a verify window, never from a rejected draft, never from a
request's partial work (an abort keeps what it published, which is exact).

Host side (:class:`PrefixIndex`): blocks of G tokens keyed by a chained hash of the ids (SHA-256 of the previous
block's key and this block's ids), snapshots keyed by (block key at P, token P), both in fixed pools with LRU
eviction (a block is evictable once no snapshot holds it). Device side: the block pool ``[blocks, Hkv, G, D]`` per
attention layer (target, then MTP) and the snapshot pool ``[snapshots, ...]`` per GDN layer, written and read by
two fixed-shape jitted copies (:func:`save`: a batch of blocks and snapshots, one call per publishing site;
:func:`restore`), so no hit length or batch compiles anything new. The copies are data-dependent on the pools, so a
restore always reads what the save before it wrote (published entries are never read before they are filled).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmtp.layers.attention import KVCache
from jaxmtp.layers.gated_deltanet import GDNCarry
from jaxmtp.pallas.row_copy import copy_rows

DEFAULT_GRANULARITY = 256  # G: tokens per block, and the grid where hits resume

# ---------------------------------------------------------------------------------------------------------------
# Host index
# ---------------------------------------------------------------------------------------------------------------
def block_keys(tokens: np.ndarray, granularity: int, n: int | None = None, known: list[bytes] = ()) -> list[bytes]:
    """Chained keys of the first ``n`` whole blocks of ``tokens`` (default all): key i covers tokens 0..(i+1)G-1.
    ``known``: the keys of a prefix of those blocks, already made (a request's prompt keys when it publishes its
    output), extended rather than hashed again."""
    n = len(tokens) // granularity if n is None else n
    keys = list(known[:n])
    prev = keys[-1] if keys else b""
    for i in range(len(keys), n):
        h = hashlib.sha256(prev)
        h.update(np.ascontiguousarray(tokens[i * granularity : (i + 1) * granularity], np.int32).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


def _tail_matches(key: tuple, prompt: np.ndarray, start: int) -> bool:
    """Whether a tail snapshot's ids (``key[1]``) follow ``start`` in ``prompt``, with its token after them (and one
    token at least left to prefill past them)."""
    tail = np.frombuffer(key[1], np.int32)
    end = start + tail.size
    return end < len(prompt) and int(prompt[end]) == key[2] and np.array_equal(prompt[start:end], tail)


@dataclasses.dataclass
class Hit:
    """A usable snapshot: resume at ``tokens`` (a multiple of G) from snapshot ``snapshot`` over ``blocks``; ``key``
    is the snapshot's index key, ``held`` its blocks' keys."""

    tokens: int
    blocks: list[int]
    snapshot: int
    key: tuple
    held: list


class PrefixIndex:
    """Which blocks and snapshots the device pools hold, by key, with LRU eviction. Counters: ``queried_tokens``
    (prompt tokens looked up), ``hit_tokens`` (tokens restored instead of prefilled), ``evictions``."""

    def __init__(self, granularity: int, num_blocks: int, num_snapshots: int):
        self.granularity = granularity
        self.num_blocks, self.num_snapshots = num_blocks, num_snapshots
        self._blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> block id, LRU first
        self._snaps: collections.OrderedDict[tuple, tuple[int, list[bytes]]] = collections.OrderedDict()
        # finished requests' snapshots off the grid: block key at the last boundary (b"" at 0) -> their keys
        # (block key, tail ids, token after); the tail's KV rows are a block of their own, the last they hold
        self._tails: collections.defaultdict[bytes, set] = collections.defaultdict(set)
        self._refs: collections.Counter = collections.Counter()  # block key -> snapshots holding it
        # the eviction order of blocks no snapshot holds, in O(log n): when each block last moved to the end of
        # ``_blocks``, and a heap of (that time, key) for the unheld ones (entries gone stale are skipped)
        self._stamp: dict[bytes, int] = {}
        self._clock = itertools.count()
        self._unheld: list[tuple[int, bytes]] = []
        # block key -> the tokens that followed it in the sequences published over it (the token at the boundary
        # after the block): whether a new prompt's token there was seen before (:meth:`branch_point`)
        self._followers: collections.defaultdict[bytes, set] = collections.defaultdict(set)
        self._free_blocks = list(range(num_blocks))[::-1]
        self._free_snaps = list(range(num_snapshots))[::-1]
        self.queried_tokens = self.hit_tokens = self.evictions = 0

    def prompt_keys(self, prompt: np.ndarray) -> list[bytes]:
        """The block keys of ``prompt``'s whole blocks before its last token (the boundaries it can resume at)."""
        return block_keys(prompt, self.granularity, (len(prompt) - 1) // self.granularity)

    def lookup(self, prompt: np.ndarray, keys: list[bytes] | None = None) -> Hit | None:
        """The longest snapshot for ``prompt`` (``keys``: its :meth:`prompt_keys`, if already made): at P <
        len(prompt) (one token at least is left to prefill), keyed by ids 0..P-1 and token P, its blocks all present.
        Counts the query; the caller counts the hit (:meth:`used`)."""
        self.queried_tokens += len(prompt)
        keys = self.prompt_keys(prompt) if keys is None else keys
        g = self.granularity
        for i in range(len(keys), -1, -1):
            base = keys[i - 1] if i else b""
            tails = [key for key in self._tails.get(base, ()) if _tail_matches(key, prompt, i * g)]
            for key in sorted(tails, key=lambda key: -len(key[1])):  # the longest usable tail first
                hit = self._hit(i * g + len(key[1]) // 4, key)
                if hit is not None:
                    return hit
            if i:
                hit = self._hit(i * g, (keys[i - 1], int(prompt[i * g])))
                if hit is not None:
                    return hit
        return None

    def branch_point(self, prompt: np.ndarray, keys: list[bytes], hit_tokens: int) -> int:
        """Where ``prompt`` should publish a snapshot because an earlier sequence shared it that far, or 0: the
        deepest boundary P > ``hit_tokens`` such that tokens 0..P (the snapshot's key: the ids before P and token P)
        were all published before, found from the leading blocks of ``keys`` the pool holds (to depth d G) and the
        tokens that followed block d (P = d G if token d G was among them, else (d - 1) G). Prefill snapshots are
        taken only at such points and at a prompt's last boundary, so a prefix shared by several prompts gets a
        snapshot at its end once a second prompt has shown it shared (SGLang's branching point)."""
        d = next((i for i, k in enumerate(keys) if k not in self._blocks), len(keys))
        if d == 0:
            return 0
        g = self.granularity
        p = d * g if int(prompt[d * g]) in self._followers.get(keys[d - 1], ()) else (d - 1) * g
        return p if p > hit_tokens else 0

    def follow(self, keys: list[bytes], seq: np.ndarray) -> None:
        """Record, for each block ``keys[i]`` of ``seq``, the token that followed it (``seq[(i + 1) G]``)."""
        g = self.granularity
        for i, k in enumerate(keys[: (len(seq) - 1) // g]):
            self._followers[k].add(int(seq[(i + 1) * g]))

    def _hit(self, tokens: int, key: tuple) -> Hit | None:
        entry = self._snaps.get(key)
        if entry is None:
            return None
        snap, held = entry
        if not all(k in self._blocks for k in held):
            return None
        return Hit(tokens, [self._blocks[k] for k in held], snap, key, held)

    def used(self, hit: Hit) -> None:
        """Mark ``hit`` (from :meth:`lookup`) as used now: its entries become the most recent."""
        self.hit_tokens += hit.tokens
        for k in hit.held:
            self._touch(k)
        self._snaps.move_to_end(hit.key)

    def missing_blocks(self, keys: list[bytes]) -> list[int]:
        """Indices i of ``keys`` (a prompt's block keys) whose block the pool does not hold."""
        return [i for i, k in enumerate(keys) if k not in self._blocks]

    def has_snapshot(self, key: bytes, next_token: int) -> bool:
        return (key, int(next_token)) in self._snaps

    def _evict_snapshot(self) -> bool:
        if not self._snaps:
            return False
        key, (snap, held) = self._snaps.popitem(last=False)
        if len(key) == 3:  # a tail snapshot
            self._tails[key[0]].discard(key)
        for k in held:
            self._refs[k] -= 1
            if self._refs[k] <= 0 and k in self._blocks:
                heapq.heappush(self._unheld, (self._stamp[k], k))
        self._free_snaps.append(snap)
        self.evictions += 1
        return True

    def _touch(self, key: bytes) -> None:
        """``key``'s block becomes the most recent (the end of ``_blocks``)."""
        self._blocks.move_to_end(key)
        self._stamp[key] = stamp = next(self._clock)
        if self._refs[key] <= 0:
            heapq.heappush(self._unheld, (stamp, key))
        if len(self._unheld) > 4 * self.num_blocks + 64:  # drop the stale entries
            self._unheld = [(self._stamp[k], k) for k in self._blocks if self._refs[k] <= 0]
            heapq.heapify(self._unheld)

    def _least_recent_unheld(self) -> bytes | None:
        """The first block of ``_blocks`` that no snapshot holds, or None."""
        while self._unheld:
            stamp, key = self._unheld[0]
            if key in self._blocks and self._refs[key] <= 0 and self._stamp[key] == stamp:
                return key
            heapq.heappop(self._unheld)
        return None

    def _take_block(self) -> int | None:
        while not self._free_blocks:
            victim = self._least_recent_unheld()
            if victim is None:
                if not self._evict_snapshot():
                    return None
                continue
            self._free_blocks.append(self._blocks.pop(victim))
            self._refs.pop(victim, None)
            self._followers.pop(victim, None)
            del self._stamp[victim]
            self.evictions += 1
        return self._free_blocks.pop()

    def add_block(self, key: bytes) -> int | None:
        """A block id to hold the block ``key`` (evicting least recently used entries), or None when every block is
        held by a snapshot that cannot go (the pool is too small). The caller fills it before publishing a
        snapshot over it."""
        if key in self._blocks:
            self._touch(key)
            return self._blocks[key]
        block = self._take_block()
        if block is not None:
            self._blocks[key] = block
            self._touch(key)
        return block

    def add_snapshot(self, keys: list[bytes], next_token: int) -> int | None:
        """A snapshot id for the boundary after ``keys`` (all present: :meth:`missing_blocks` is empty) with token
        ``next_token`` at it, or None if the pool has no room (its blocks are then held, not evicted)."""
        if not self._free_snaps and not self._evict_snapshot():
            return None
        if any(k not in self._blocks for k in keys):  # an eviction above took one of them
            return None
        snap = self._free_snaps.pop()
        self._snaps[(keys[-1], int(next_token))] = (snap, list(keys))
        for k in keys:
            self._refs[k] += 1
            self._touch(k)
        return snap

    def add_tail_snapshot(self, keys: list[bytes], tail: np.ndarray, next_token: int) -> tuple[int, int] | None:
        """Ids (snapshot, tail block) for a finished request's state after ``keys``' whole blocks and ``tail``
        (0 < len < G ids past them) with ``next_token`` after it, or None if the pools have no room. The whole blocks
        must be present (:meth:`missing_blocks`); the caller fills the tail block and the snapshot."""
        tail_ids = np.ascontiguousarray(tail, np.int32).tobytes()
        key = (keys[-1] if keys else b"", tail_ids, int(next_token))
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return None
        tail_key = hashlib.sha256(b"tail" + key[0] + tail_ids).digest()
        block = self.add_block(tail_key)
        if block is None:
            return None
        if not self._free_snaps and not self._evict_snapshot():
            return None
        held = list(keys) + [tail_key]
        if any(k not in self._blocks for k in held):  # an eviction above took one of them
            return None
        snap = self._free_snaps.pop()
        self._snaps[key] = (snap, held)
        self._tails[key[0]].add(key)
        for k in held:
            self._refs[k] += 1
            self._touch(k)
        return snap, block

    def stats(self) -> dict:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens, "evictions": self.evictions,
                "blocks": len(self._blocks), "snapshots": len(self._snaps)}


# ---------------------------------------------------------------------------------------------------------------
# Device pools and copies
# ---------------------------------------------------------------------------------------------------------------
def _kv_layers(state) -> list[KVCache]:
    return [c for c in state.carry if isinstance(c, KVCache)] + list(state.mtp_carry)


def _gdn_layers(state) -> list[GDNCarry]:
    return [c for c in state.carry if isinstance(c, GDNCarry)]


def init_pool(state, granularity: int, num_blocks: int, num_snapshots: int) -> dict:
    """Empty pools shaped after ``state``'s carries: ``{"kv": [(k, v) [blocks, Hkv, G, D] per attention layer],
    "gdn": [(conv [snapshots, K, C], state [snapshots, Hv, dk, dv]) per GDN layer]}``."""
    kv = [tuple(jnp.zeros((num_blocks, a.shape[1], granularity, a.shape[3]), a.dtype) for a in (c.k, c.v))
          for c in _kv_layers(state)]
    gdn = [(jnp.zeros((num_snapshots,) + c.conv.shape[1:], c.conv.dtype),
            jnp.zeros((num_snapshots,) + c.state.shape[1:], c.state.dtype)) for c in _gdn_layers(state)]
    return {"kv": kv, "gdn": gdn}


def pool_specs(pool: dict, tp_axis: str) -> dict:
    """PartitionSpecs of :func:`init_pool`'s pools under tensor parallelism: split over ``tp_axis`` as the carries
    they copy (:func:`jaxmtp.parallel.carry_spec`: KV heads and GDN value heads on axis 1, conv channels on axis 2),
    so a copy between a slot and an entry stays on each rank."""
    return {"kv": [(P(None, tp_axis), P(None, tp_axis)) for _ in pool["kv"]],
            "gdn": [(P(None, None, tp_axis), P(None, tp_axis)) for _ in pool["gdn"]]}


def pool_bytes_per_entry(state, granularity: int) -> tuple[int, int]:
    """Bytes of one block and of one snapshot for ``state``'s carries."""
    block = sum(2 * a.shape[1] * granularity * a.shape[3] * a.dtype.itemsize
                for a in (c.k for c in _kv_layers(state)))
    snap = sum(np.prod(a.shape[1:]) * a.dtype.itemsize for c in _gdn_layers(state) for a in (c.conv, c.state))
    return int(block), int(snap)


def _rows(cache, slot, start, g):
    """``cache [B, H, S, D]``'s rows ``[start, start + g)`` of ``slot``: [H, g, D]."""
    return jax.lax.dynamic_slice(cache, (slot, 0, start, 0), (1, cache.shape[1], g, cache.shape[3]))[0]


def _owner(state, slot, dp_axis):
    """``slot`` as this replica sees it: (its local index, or the local slot count when another replica holds it;
    whether this replica holds it). One device (``dp_axis`` None): the slot itself, held."""
    if dp_axis is None:
        return slot, True
    n = state.length.shape[0]  # this replica's slots: [d n, (d + 1) n)
    lo = jax.lax.axis_index(dp_axis) * n
    mine = (slot >= lo) & (slot < lo + n)
    return jnp.where(mine, slot - lo, n), mine


def _from_owner(x, mine, dp_axis):
    """``x`` as the replica holding the slot read it, on every replica (the others add zeros: exact)."""
    return x if dp_axis is None else jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), dp_axis)


def save(pool: dict, state, blocks, n_blocks, snaps=None, n_snaps=None, dp_axis=None, copy: str = "xla"):
    """The pools with one publication batch copied in: for i < ``n_blocks``, KV rows ``[start, start + G)`` of
    ``slot`` (every attention layer) into block ``id``, ``blocks [n, 3]`` int32 rows (slot, start, id); for j <
    ``n_snaps``, ``slot``'s GDN conv rings and states into snapshot ``id``, ``snaps [m, 2]`` rows (slot, id); without
    ``snaps`` (a batch of blocks alone) the snapshot pool passes through untouched. The ids
    of a batch are distinct (:meth:`Publications.take`). Fixed shapes, counts as arguments: one compiled copy for
    every batch, a gather of all n (m) rows and a scatter that drops those past the counts. ``state`` is only read
    (the pools are donated). ``dp_axis``: inside a data-parallel ``shard_map``, every replica's pool receives each
    entry from the replica holding its slot. ``copy``: a kernel name runs the copies as
    :func:`jaxmtp.pallas.row_copy.copy_rows` launches on one device (no ``dp_axis``), writing the pools in place."""
    if copy != "xla" and dp_axis is None:
        zero = jnp.zeros_like(blocks[:, 0])
        kv = _copy_kv(pool["kv"], [(c.k, c.v) for c in _kv_layers(state)],
                      jnp.stack([blocks[:, 0], blocks[:, 1], blocks[:, 2], zero], 1), n_blocks, copy,
                      pool["kv"][0][0].shape[2] if pool["kv"] else 0)
        if snaps is None:
            return {"kv": kv, "gdn": pool["gdn"]}
        zero = jnp.zeros_like(snaps[:, 0])
        moves = jnp.stack([snaps[:, 0], zero, snaps[:, 1], zero], 1)
        gdn = [(c.conv, c.state) for c in _gdn_layers(state)]
        return {"kv": kv, "gdn": _copy_gdn(pool["gdn"], gdn, moves, n_snaps, copy) if gdn else []}

    def ids(rows, count, pool_size):  # the unused rows' ids past the pool (distinct: the scatter drops them)
        i = jnp.arange(rows.shape[0])
        return jnp.where(i < count, rows[:, -1], pool_size + i)

    def put(p, at, new):
        return p.at[at].set(new, mode="drop", unique_indices=True)

    kv, gdn = [], [] if snaps is not None else pool["gdn"]
    if pool["kv"]:
        slot, mine = jax.vmap(lambda s: _owner(state, s, dp_axis))(blocks[:, 0])
        at = ids(blocks, n_blocks, pool["kv"][0][0].shape[0])
        for (pk, pv), c in zip(pool["kv"], _kv_layers(state)):
            def rows(a, g=pk.shape[2]):  # [n, H, g, D], the replica holding each slot's
                x = jax.vmap(lambda s, t: _rows(a, s, t, g))(slot, blocks[:, 1])
                return _from_owner(x, mine[:, None, None, None], dp_axis)
            kv.append((put(pk, at, rows(c.k)), put(pv, at, rows(c.v))))
    if pool["gdn"] and snaps is not None:
        slot, mine = jax.vmap(lambda s: _owner(state, s, dp_axis))(snaps[:, 0])
        at = ids(snaps, n_snaps, pool["gdn"][0][0].shape[0])
        for (pc, ps), c in zip(pool["gdn"], _gdn_layers(state)):
            def rows(a):  # [m, ...] of each slot, the replica holding it
                x = jnp.take(a, jnp.minimum(slot, a.shape[0] - 1), axis=0)
                return _from_owner(x, mine.reshape((-1,) + (1,) * (x.ndim - 1)), dp_axis)
            gdn.append((put(pc, at, rows(c.conv)), put(ps, at, rows(c.state))))
    return {"kv": kv, "gdn": gdn}


class Publications:
    """Host-side queue of the copies a publishing site enqueues (:meth:`block`, :meth:`snapshot`), handed to the
    device as one :func:`save` call by :meth:`take`. When one kind's queue is full the caller hands over that kind
    alone (``take(blocks_only=True)`` for blocks: a site's snapshots then go in one call, not one per full queue of
    blocks; the two pools' copies are independent). The caller flushes before anything changes the state they read
    or reads the pools they write."""

    def __init__(self, max_blocks: int, max_snaps: int):
        self.blocks = np.zeros((max_blocks, 3), np.int32)
        self.snaps = np.zeros((max_snaps, 2), np.int32)
        self.n_blocks = self.n_snaps = 0

    def blocks_full(self) -> bool:
        return self.n_blocks == len(self.blocks)

    def snaps_full(self) -> bool:
        return self.n_snaps == len(self.snaps)

    def block(self, slot: int, start: int, block: int) -> None:
        self.blocks[self.n_blocks] = slot, start, block
        self.n_blocks += 1

    def snapshot(self, slot: int, snap: int) -> None:
        self.snaps[self.n_snaps] = slot, snap
        self.n_snaps += 1

    def take(self, blocks_only: bool = False) -> tuple | None:
        """The batch as :func:`save`'s arguments after ``pool, state`` (None when empty), emptying the queue; with
        ``blocks_only`` the blocks alone (``blocks, n_blocks``), the snapshots staying queued. An id queued twice
        (the index reused it) keeps its later copy only: the result of copying in order."""

        def last_per_id(queued, n):
            keep = sorted({int(r[-1]): i for i, r in enumerate(queued[:n])}.values())  # each id's last row
            out = np.zeros_like(queued)
            out[: len(keep)] = queued[keep]
            return out, np.int32(len(keep))

        if blocks_only:
            args = last_per_id(self.blocks, self.n_blocks) if self.n_blocks else None
            self.n_blocks = 0
            return args
        if not (self.n_blocks or self.n_snaps):
            return None
        args = (*last_per_id(self.blocks, self.n_blocks), *last_per_id(self.snaps, self.n_snaps))
        self.n_blocks = self.n_snaps = 0
        return args


def _copy_kv(dst_pairs: list, src_pairs: list, moves, count, copy: str, g: int) -> list:
    """KV ``(k, v)`` pairs ``dst_pairs`` with ``moves`` of ``g`` rows (a pool block's) copied from ``src_pairs``
    (slots' rows into pool blocks, or back); one :func:`copy_rows` launch for all layers."""
    if not dst_pairs:
        return []
    flat = copy_rows([a for pair in dst_pairs for a in pair], [a for pair in src_pairs for a in pair], moves, count,
                     rows=g, implementation=copy)
    return [tuple(flat[2 * i : 2 * i + 2]) for i in range(len(dst_pairs))]


def _copy_gdn(dst: list, src: list, moves, count, copy: str) -> list:
    """GDN ``(conv, state)`` pairs ``dst`` (pool snapshots or slots' carries) with ``moves`` (whole entries) copied
    from ``src``'s pairs: a launch for the states, one for the conv rings (as ``[N, 1, K, C]``)."""
    as4 = lambda a: a.reshape(a.shape[0], 1, *a.shape[1:])  # noqa: E731
    conv = copy_rows([as4(c) for c, _ in dst], [as4(c[0]) for c in src], moves, count, rows=dst[0][0].shape[1],
                     implementation=copy)
    states = copy_rows([st for _, st in dst], [c[1] for c in src], moves, count, rows=dst[0][1].shape[2],
                       implementation=copy)
    return [(c.reshape(d[0].shape), st) for c, st, d in zip(conv, states, dst)]


def restore(state, pool: dict, slot, blocks, n_blocks, snap, dp_axis=None, copy: str = "xla"):
    """``state`` with ``slot``'s KV rows ``[i G, (i + 1) G)`` set from pool block ``blocks[i]`` for i < ``n_blocks``
    (``blocks [max_blocks]`` int32, fixed length: one compiled copy for every hit length) and its GDN carries from
    snapshot ``snap`` (a slot id past the slots and no blocks change nothing: the warm-up's call). ``dp_axis``:
    inside a data-parallel ``shard_map``, only the replica holding the slot writes. ``copy``: as :func:`save`'s."""
    if copy != "xla" and dp_axis is None:
        live = slot < state.length.shape[0]
        i = jnp.arange(blocks.shape[0], dtype=jnp.int32)
        g = pool["kv"][0][0].shape[2] if pool["kv"] else 0
        moves = jnp.stack([blocks, jnp.zeros_like(i), jnp.full_like(i, slot), i * g], 1)
        kv = _copy_kv([(c.k, c.v) for c in _kv_layers(state)], pool["kv"], moves, jnp.where(live, n_blocks, 0), copy, g)
        gdn = _gdn_layers(state)
        if gdn:
            move = jnp.stack([snap, 0, slot, 0]).astype(jnp.int32)[None]
            gdn = _copy_gdn([(c.conv, c.state) for c in gdn], pool["gdn"], move, live.astype(jnp.int32), copy)
        kv_it, gdn_it = iter(kv), iter(gdn)
        carry = tuple(GDNCarry(*next(gdn_it)) if isinstance(c, GDNCarry) else KVCache(*next(kv_it))
                      for c in state.carry)
        return state.replace(carry=carry, mtp_carry=tuple(KVCache(*next(kv_it)) for _ in state.mtp_carry))
    slot, mine = _owner(state, slot, dp_axis)
    n_blocks = jnp.where(mine, n_blocks, 0)
    kv = [(c.k, c.v) for c in _kv_layers(state)]
    if kv:
        def body(i, caches):
            def put(cache, pooled):
                at = (slot, 0, i * pooled.shape[2], 0)
                return jax.lax.dynamic_update_slice(cache, pooled[blocks[i]][None], at)
            return [(put(ck, pk), put(cv, pv)) for (pk, pv), (ck, cv) in zip(pool["kv"], caches)]

        kv = jax.lax.fori_loop(0, n_blocks, body, kv)
    kv_it, snaps = iter(kv), iter(pool["gdn"])

    def layer(c):
        if isinstance(c, GDNCarry):
            pc, ps = next(snaps)
            return GDNCarry(c.conv.at[slot].set(pc[snap], mode="drop"), c.state.at[slot].set(ps[snap], mode="drop"))
        return KVCache(*next(kv_it))

    carry = tuple(layer(c) for c in state.carry)
    return state.replace(carry=carry, mtp_carry=tuple(KVCache(*next(kv_it)) for _ in state.mtp_carry))


__all__ = ["Hit", "PrefixIndex", "Publications", "block_keys", "init_pool", "pool_bytes_per_entry", "restore",
           "save"]
