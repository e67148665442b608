"""One-shot all-reduce of a small float32 tensor over the tensor-parallel ranks of one host: a Triton kernel on the
compute stream that reads nothing but its own memory and writes into its peers' (CUDA, one process, peer access).

Why: XLA runs each ``psum`` of a decode step's hidden row as a collective on a side stream, and on Hopper the GPU
sat idle about 18-21 us around each of the 129 per 27B step (docs/performance.md, "Tensor parallelism"). This
kernel is an ordinary launch in the step's stream: rank r writes its block of ``y`` into every peer's staging area,
raises a flag there, waits for every peer's flag in its own memory, then sums the ranks' blocks in rank order. The
sum is the reference's (:func:`reference`: ``lax.psum`` in float32; rank order, so every rank gets the same bits).

The protocol (per kernel program ``c``, which always owns elements ``[c B, (c+1) B)``, B = :data:`BLOCK`):

* each device keeps a workspace (:func:`allocate`): per program a call counter, per (sender, program) a flag, and a
  staging area of two parities x ranks x :data:`CAPACITY` floats;
* call ``e`` of program ``c`` (its counter + 1; every rank makes the same calls, so the counters agree) writes the
  block into parity ``e % 2`` of each peer's staging, then (after a CTA barrier) adds 1 to the peer's flag with
  release semantics at system scope; it waits until each peer's flag for it reaches ``e`` (acquire), reads the
  blocks (``.cg``: past the L1, which may hold the same addresses' values of two calls ago) and stores the sum;
* two parities suffice: a peer can write parity ``e % 2`` again only in call ``e + 2``, which needs this rank's
  flag of call ``e + 1``, raised after this rank's call ``e`` finished reading.

A program spins on its peers' flags, so every program of a call must be resident at once: at most
:data:`MAX_PROGRAMS` (1024 programs of 4 warps; an H100 holds 2112). Larger tensors (prefill chunks) take
``lax.psum``. The workspace's device addresses are static arguments of the kernel (``TensorParallel.peers``): the
workspace is allocated once per layout and lives as long as it (:class:`jaxmtp.parallel.ParallelLayout`), and as
the addresses are part of the backend, every compiled step (and the AOT store's key) belongs to one workspace.

Needs ``jax_triton`` (the ``gpu`` extra) and a CUDA GPU; :func:`available` says whether both are present. The
kernel cannot run on a CPU (no interpreter for raw pointers): it is checked on the GPU against ``lax.psum``
(tests/test_gpu_checks.py) and its reference's use is tested on the CPU through the psum mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 1024  # float32 elements per program
MAX_PROGRAMS = 1024
MAX_RANKS = 8
CAPACITY = BLOCK * MAX_PROGRAMS  # float32 elements a call may reduce (rows x hidden); more take lax.psum
NUM_WARPS = 4
_FLAGS = 4 * MAX_PROGRAMS  # byte offsets in a workspace: counters [programs] int32, flags [ranks, programs] int32,
_STAGING = _FLAGS + 4 * MAX_RANKS * MAX_PROGRAMS  # staging [2, ranks, CAPACITY] float32
_SPIN_LIMIT = 1 << 26  # polls before a program gives up and writes NaN (a peer that never comes: a bug, not a hang)


def workspace_bytes(ranks: int) -> int:
    """Device bytes of one rank's workspace."""
    return _STAGING + 2 * ranks * CAPACITY * 4


def available() -> bool:
    """Whether the kernel can run here: an NVIDIA GPU, ``jax_triton`` and the ``triton`` compiler it drives
    (jax_triton imports without it, then fails at the first call)."""
    from jaxmtp.pallas.backend import platform

    if platform() != "gpu":  # NVIDIA only: the kernel has not run on ROCm
        return False
    try:
        from jax_triton import triton_lib
    except ImportError:
        return False
    return bool(getattr(triton_lib, "CAN_USE_TRITON", False))


def allocate(mesh) -> tuple[jax.Array, tuple[int, ...]]:
    """Zeroed workspaces, one per device of ``mesh`` (any shape), and their device addresses in the mesh's flat
    order (padded with 0 to :data:`MAX_RANKS`). Keep the array alive while a kernel may use the addresses."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = list(mesh.devices.flat)
    if len(devices) > MAX_RANKS:
        raise ValueError(f"the one-shot all-reduce takes at most {MAX_RANKS} devices, not {len(devices)}")
    tp = mesh.shape["tp"]
    words = workspace_bytes(tp) // 4
    flat = jax.sharding.Mesh(np.asarray(devices), ("all",))
    ws = jax.device_put(np.zeros((len(devices), words), np.int32), NamedSharding(flat, P("all")))
    by_device = {s.device: s.data.unsafe_buffer_pointer() for s in ws.addressable_shards}
    addrs = tuple(by_device[d] for d in devices) + (0,) * (MAX_RANKS - len(devices))
    return ws, addrs


def reference(y: jax.Array, axis: str) -> jax.Array:
    """What the kernel computes: the float32 sum of ``y`` over the ranks of ``axis``."""
    return jax.lax.psum(y.astype(jnp.float32), axis)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def pick(i, s0, s1, s2, s3, s4, s5, s6, s7):
        a = tl.where(i == 0, s0, s1)
        a = tl.where(i == 2, s2, a)
        a = tl.where(i == 3, s3, a)
        a = tl.where(i == 4, s4, a)
        a = tl.where(i == 5, s5, a)
        a = tl.where(i == 6, s6, a)
        return tl.where(i == 7, s7, a)

    @triton.jit
    def oneshot(x_ptr, rank_ptr, s0, s1, s2, s3, s4, s5, s6, s7, out_ptr, NUMEL: tl.constexpr, N: tl.constexpr,
                CAP: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, FLAGS: tl.constexpr,
                STAGING: tl.constexpr, SPIN_LIMIT: tl.constexpr):
        c = tl.program_id(0)
        me = tl.load(rank_ptr)  # rank on the tp axis
        group = tl.load(rank_ptr + 1)  # flat mesh index of rank 0 of this tp group
        mine = pick(group + me, s0, s1, s2, s3, s4, s5, s6, s7)
        counter = mine.to(tl.pointer_type(tl.int32)) + c
        e = tl.load(counter, volatile=True) + 1
        parity = e % 2
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        for p in tl.static_range(N):
            peer = pick(group + p, s0, s1, s2, s3, s4, s5, s6, s7)
            stage = (peer + STAGING).to(tl.pointer_type(tl.float32)) + (parity * N + me) * CAP
            tl.store(stage + offs, x, mask=mask & (me != p))
        tl.debug_barrier()  # every thread's stores precede the one releasing flag write below
        for p in tl.static_range(N):
            peer = pick(group + p, s0, s1, s2, s3, s4, s5, s6, s7)
            flag = (peer + FLAGS).to(tl.pointer_type(tl.int32)) + me * PROGRAMS + c
            tl.atomic_add(flag, 1, mask=me != p, sem="release", scope="sys")
        late = 0
        for p in tl.static_range(N):
            flag = (mine + FLAGS).to(tl.pointer_type(tl.int32)) + p * PROGRAMS + c
            target = tl.where(me == p, 0, e)
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            polls = seen * 0
            while (seen < target) & (polls < SPIN_LIMIT):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                polls += 1
            late = late + (seen < target).to(tl.int32)
        acc = tl.zeros((BLOCK,), tl.float32)
        for p in tl.static_range(N):  # rank order: every rank sums the same values in the same order
            stage = (mine + STAGING).to(tl.pointer_type(tl.float32)) + (parity * N + p) * CAP
            v = tl.load(stage + offs, mask=mask & (me != p), other=0.0, cache_modifier=".cg")
            acc += tl.where(me == p, x, v)
        tl.store(out_ptr + offs, tl.where(late == 0, acc, float("nan")), mask=mask)
        tl.store(counter, e)

    return oneshot


def allreduce(y: jax.Array, axis: str, ranks: int, peers: tuple[int, ...]) -> jax.Array:
    """The float32 sum of ``y`` (any shape, at most :data:`CAPACITY` elements) over the ``ranks`` ranks of mesh axis
    ``axis``, inside the step's ``shard_map``; ``peers``: the workspaces' addresses (:func:`allocate`)."""
    import jax_triton as jt

    numel = y.size
    if numel > CAPACITY:
        raise ValueError(f"the one-shot all-reduce takes at most {CAPACITY} elements, not {numel}")
    rank = jax.lax.axis_index(axis).astype(jnp.int32)
    group = jax.lax.axis_index("dp").astype(jnp.int32) * ranks if _has_axis("dp") else jnp.int32(0)
    out = jt.triton_call(
        y.astype(jnp.float32).reshape(-1), jnp.stack([rank, group]), *peers, kernel=_kernel(),
        out_shape=jax.ShapeDtypeStruct((numel,), jnp.float32), grid=(-(-numel // BLOCK),), num_warps=NUM_WARPS,
        num_stages=1, NUMEL=numel, N=ranks, CAP=CAPACITY, BLOCK=BLOCK, PROGRAMS=MAX_PROGRAMS, FLAGS=_FLAGS,
        STAGING=_STAGING, SPIN_LIMIT=_SPIN_LIMIT)
    return out.reshape(y.shape)


def _has_axis(name: str) -> bool:
    try:
        jax.lax.axis_index(name)
    except NameError:
        return False
    return True


__all__ = ["BLOCK", "CAPACITY", "MAX_PROGRAMS", "MAX_RANKS", "allocate", "allreduce", "available", "reference",
           "workspace_bytes"]
