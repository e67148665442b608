"""One-shot all-reduce of a small float32 tensor over the tensor-parallel ranks of one host: a Triton kernel on the
compute stream that reads nothing but its own memory and writes into its peers' (CUDA, one process, peer access).

Why: XLA runs each ``psum`` of a decode step's hidden row as a collective on a side stream, and on Hopper the GPU
sat idle about 18-21 us around each of the 129 per 27B step (docs/performance.md, "Tensor parallelism"). This
kernel is an ordinary launch in the step's stream: rank r writes its block of ``y`` into every peer's staging area,
raises a flag there, waits for every peer's flag in its own memory, then sums the ranks' blocks in rank order. The
sum is the reference's (:func:`reference`: ``lax.psum`` in float32) up to the order of the additions: rank order, so
every rank gets the same bits (psum's at two ranks; on more, NCCL may add in another order).

The protocol (per kernel program ``c``, which always owns elements ``[c B, (c+1) B)``, B = :data:`BLOCK`):

* each device keeps a workspace (:func:`allocate`): per program a call counter, per (sender, program) a flag, and a
  staging area of two parities x ranks x :data:`CAPACITY` floats;
* call ``e`` of program ``c`` (its counter + 1; every rank makes the same calls, so the counters agree) writes the
  block into parity ``e & 1`` of each peer's staging, then (after a CTA barrier) adds 1 to the peer's flag with
  release semantics at system scope; it waits until each peer's flag for it reaches ``e`` (acquire), reads the
  blocks (``.cg``: past the L1, which may hold the same addresses' values of two calls ago) and stores the sum;
* two parities suffice: a peer can write parity ``e & 1`` again only in call ``e + 2``, which needs this rank's
  flag of call ``e + 1``, raised after this rank's call ``e`` finished reading.

A Lamport-style protocol (no flags and no fences: the staged values are their own signal, polled until none holds
the empty mark) times within 2% of this one in the 27B step on two H200s (docs/performance.md, "The one-shot
reduction"), so the kernels keep one protocol and half the workspace.

A program spins on its peers' flags, so every program of a call must be resident at once: at most
:data:`MAX_PROGRAMS` (1024 programs of 4 warps; an H100 holds 2112). Larger tensors (prefill chunks) take
``lax.psum``. The counters are int32 and wrap after 2^31 calls (days of serving), so parities are ``e & 1`` and
flags are compared with their targets by difference. The workspace's device addresses are static arguments of the
kernel (``TensorParallel.peers``): the workspace is allocated once per layout and lives as long as it
(:class:`jaxmtp.parallel.ParallelLayout`), and as the addresses are part of the backend, every compiled step (and
the AOT store's key) belongs to one workspace.

:func:`add_rms_norm` is the same exchange fused with the block's residual add and the next RMSNorm: a block's
output, as this rank's split-K parts, reduced over the ranks, added to the residual stream and normed in one launch
(the kernel policy's ``oneshot_fused``, on: the fastest way measured, docs/performance.md). Its programs own a row
each, or a chunk of a row each (the policy's default), whose programs then meet at a per-row barrier to share their
square sums (at most 128 rows x 5 chunks of 8 warps for 27B's 5120: all resident at once). It has a section of the
workspace of its own (counters, flags, and staging with rows at a fixed stride of :data:`ROW_STRIDE`), so the two
kernels never share a program's region. It forms ``s = x + round(sum)`` and ``h = rms_norm(s)`` as
:func:`jaxmtp.pallas.norms.add_rms_norm_triton` does.

Needs ``jax_triton`` (the ``gpu`` extra) and a CUDA GPU; :func:`available` says whether both are present. On two
and four GPUs both kernels equal the ranks' values gathered and added in rank order, bit for bit
(tests/test_gpu_checks.py); on the CPU their protocol runs in Triton's interpreter with a process per rank
(tests/test_oneshot_protocol.py).
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
ROW_STRIDE = 8192  # float32 elements per row in the fused kernel's staging: the widest hidden size it takes
MAX_ROWS = 128  # rows one fused call may reduce (one program each): batch 32 x a verify window of 4
# Byte offsets in a workspace (int32 counters and flags, float32 staging):
_FLAGS = 4 * MAX_PROGRAMS  # after the plain kernel's counters [programs]: its flags [ranks, programs],
_ROW_COUNTERS = _FLAGS + 4 * MAX_RANKS * MAX_PROGRAMS  # the fused kernel's counters [programs],
_ROW_FLAGS = _ROW_COUNTERS + 4 * MAX_PROGRAMS  # flags [ranks, programs],
_ROW_SYNC = _ROW_FLAGS + 4 * MAX_RANKS * MAX_PROGRAMS  # per row a call count and two arrival counters [rows, 4]
_ROW_SQUARES = _ROW_SYNC + 16 * MAX_ROWS  # and the square sums of its programs [rows, 16] float32;
_STAGING = _ROW_SQUARES + 4 * 16 * MAX_ROWS  # the plain kernel's staging [2, ranks, CAPACITY], then the fused
# kernel's [2, ranks, MAX_ROWS * ROW_STRIDE] (:func:`_row_staging`), then the fused product kernel's section
SPIN_LIMIT = 1 << 26  # polls before a program gives up and writes NaN (a peer that never comes: a bug, not a hang;
# tests lower it, so that a broken protocol fails in a second instead of a minute per call)


PRODUCT_MAX_ROWS = 4  # rows one call of the fused product kernel (jaxmtp.pallas.oneshot_product) may take


def _row_staging(ranks: int) -> int:
    return _STAGING + 2 * ranks * CAPACITY * 4


def _product_control(ranks: int) -> int:
    """The fused product kernel's section (:mod:`jaxmtp.pallas.oneshot_product`): its call counter, arrival counter
    and a flag per sender (int32, 64 bytes in all), then this rank's staging [2, PRODUCT_MAX_ROWS * ROW_STRIDE]
    (float32; the peers read it)."""
    return _row_staging(ranks) + 2 * ranks * MAX_ROWS * ROW_STRIDE * 4


def _product_staging(ranks: int) -> int:
    return _product_control(ranks) + 64


def workspace_bytes(ranks: int) -> int:
    """Device bytes of one rank's workspace."""
    return _product_staging(ranks) + 2 * PRODUCT_MAX_ROWS * ROW_STRIDE * 4


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
    """New workspaces (zero: no calls made), one per device of ``mesh`` (any shape), and their device addresses
    in the mesh's flat order (padded with 0 to :data:`MAX_RANKS`). Keep the array alive while a kernel may use the
    addresses."""
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


def reference(y: jax.Array, axis: str, *, parts: bool = False) -> jax.Array:
    """What the kernel computes: the float32 sum of ``y`` over the ranks of ``axis`` (with ``parts``, of the sum of
    ``y``'s parts along its first axis, in part order)."""
    if parts:
        from jaxmtp.pallas._common import sum_parts

        y = sum_parts(y.astype(jnp.float32))
    return jax.lax.psum(y.astype(jnp.float32), axis)


@functools.cache
def _pick():
    import triton
    import triton.language as tl

    @triton.jit
    def pick(i, s0, s1, s2, s3, s4, s5, s6, s7):
        """The workspace address of flat mesh index ``i`` (scalar arguments cannot be indexed)."""
        a = tl.where(i == 0, s0, s1)
        a = tl.where(i == 2, s2, a)
        a = tl.where(i == 3, s3, a)
        a = tl.where(i == 4, s4, a)
        a = tl.where(i == 5, s5, a)
        a = tl.where(i == 6, s6, a)
        return tl.where(i == 7, s7, a)

    return pick


@functools.cache
def _signal_and_wait():
    import triton
    import triton.language as tl

    pick = _pick()

    @triton.jit
    def signal_and_wait(me, group, mine, c, e, s0, s1, s2, s3, s4, s5, s6, s7, N: tl.constexpr,
                        PROGRAMS: tl.constexpr, FLAGS: tl.constexpr, SPIN_LIMIT: tl.constexpr):
        """Call ``e`` of program ``c``, its stores to the peers made: raise its flag in each peer's workspace, wait
        for each peer's in its own (``mine``). Returns how many peers never came (SPIN_LIMIT polls)."""
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
            while ((seen - target) < 0) & (polls < SPIN_LIMIT):  # differences: right across the wrap at 2^31
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                polls += 1
            late = late + ((seen - target) < 0).to(tl.int32)
        return late

    return signal_and_wait


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    pick, signal_and_wait = _pick(), _signal_and_wait()

    @triton.jit
    def oneshot(x_ptr, rank_ptr, s0, s1, s2, s3, s4, s5, s6, s7, out_ptr, NUMEL: tl.constexpr, N: tl.constexpr,
                CAP: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, FLAGS: tl.constexpr,
                STAGING: tl.constexpr, SPIN_LIMIT: tl.constexpr, P: tl.constexpr):
        c = tl.program_id(0)
        me = tl.load(rank_ptr)  # rank on the tp axis
        group = tl.load(rank_ptr + 1)  # flat mesh index of rank 0 of this tp group
        mine = pick(group + me, s0, s1, s2, s3, s4, s5, s6, s7)
        counter = mine.to(tl.pointer_type(tl.int32)) + c  # the workspace's first section: the counters
        e = tl.load(counter, volatile=True) + 1
        parity = e & 1  # (not e % 2: e wraps past 2^31 after a few days of steps, and a negative e % 2 is -1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(1, P):  # this rank's split-K parts, summed in part order
            x += tl.load(x_ptr + i * NUMEL + offs, mask=mask, other=0.0).to(tl.float32)
        for p in tl.static_range(N):
            peer = pick(group + p, s0, s1, s2, s3, s4, s5, s6, s7)
            stage = (peer + STAGING).to(tl.pointer_type(tl.float32)) + (parity * N + me) * CAP
            tl.store(stage + offs, x, mask=mask & (me != p))
        late = signal_and_wait(me, group, mine, c, e, s0, s1, s2, s3, s4, s5, s6, s7, N, PROGRAMS, FLAGS, SPIN_LIMIT)
        acc = tl.zeros((BLOCK,), tl.float32)
        for p in tl.static_range(N):  # rank order: every rank sums the same values in the same order
            stage = (mine + STAGING).to(tl.pointer_type(tl.float32)) + (parity * N + p) * CAP
            v = tl.load(stage + offs, mask=mask & (me != p), other=0.0, cache_modifier=".cg")
            acc += tl.where(me == p, x, v)
        tl.store(out_ptr + offs, tl.where(late == 0, acc, float("nan")), mask=mask)
        tl.store(counter, e)

    return oneshot


def allreduce(y: jax.Array, axis: str, ranks: int, peers: tuple[int, ...], *, parts: bool = False) -> jax.Array:
    """The float32 sum of ``y`` (any shape, at most :data:`CAPACITY` elements) over the ``ranks`` ranks of mesh axis
    ``axis``, inside the step's ``shard_map``; ``peers``: the workspaces' addresses (:func:`allocate`). With
    ``parts``, ``y [P, ...]`` (any float dtype) is this rank's value as P split-K parts, summed in part order in the
    kernel (:func:`reference`): no launch of its own for that sum or a conversion."""
    import jax_triton as jt

    shape = y.shape[1:] if parts else y.shape
    numel = int(np.prod(shape))
    if numel > CAPACITY:
        raise ValueError(f"the one-shot all-reduce takes at most {CAPACITY} elements, not {numel}")
    out = jt.triton_call(
        y.reshape(-1) if parts else y.astype(jnp.float32).reshape(-1), _rank_and_group(axis, ranks), *peers,
        kernel=_kernel(), out_shape=jax.ShapeDtypeStruct((numel,), jnp.float32), grid=(-(-numel // BLOCK),),
        num_warps=NUM_WARPS, num_stages=1, NUMEL=numel, N=ranks, CAP=CAPACITY, BLOCK=BLOCK, PROGRAMS=MAX_PROGRAMS,
        FLAGS=_FLAGS, STAGING=_STAGING, SPIN_LIMIT=SPIN_LIMIT, P=y.shape[0] if parts else 1)
    return out.reshape(shape)


@functools.cache
def _row_kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    pick, signal_and_wait = _pick(), _signal_and_wait()

    @triton.jit
    def oneshot_add_rms_norm(y_ptr, x_ptr, w_ptr, rank_ptr, s0, s1, s2, s3, s4, s5, s6, s7, s_ptr, h_ptr,
                             ROWS: tl.constexpr, H: tl.constexpr, C: tl.constexpr, CPP: tl.constexpr,
                             P: tl.constexpr, N: tl.constexpr, EPS: tl.constexpr, STRIDE: tl.constexpr,
                             MAXROWS: tl.constexpr, MAXPROGS: tl.constexpr, COUNTERS: tl.constexpr,
                             FLAGS: tl.constexpr, ROWSYNC: tl.constexpr, SQUARES: tl.constexpr,
                             STAGING: tl.constexpr, SPIN_LIMIT: tl.constexpr):
        PPR: tl.constexpr = H // C // CPP  # programs per row, each CPP chunks of C
        g = tl.program_id(0)
        r = g // PPR
        q = g % PPR
        me = tl.load(rank_ptr)
        group = tl.load(rank_ptr + 1)
        mine = pick(group + me, s0, s1, s2, s3, s4, s5, s6, s7)
        counter = (mine + COUNTERS).to(tl.pointer_type(tl.int32)) + g
        e = tl.load(counter, volatile=True) + 1
        area = MAXROWS * STRIDE  # floats of one rank's rows in one parity
        base = r * STRIDE + q * CPP * C  # this program's columns of row r, in a staging area and in the rows
        row = r * H + q * CPP * C
        cols = tl.arange(0, C)
        # this rank's columns: its split-K parts summed in part order, written to every rank's staging (its own too)
        for j in tl.static_range(CPP):
            part = tl.load(y_ptr + row + j * C + cols).to(tl.float32)
            for i in tl.static_range(1, P):
                part += tl.load(y_ptr + i * ROWS * H + row + j * C + cols).to(tl.float32)
            for p in tl.static_range(N):
                peer = pick(group + p, s0, s1, s2, s3, s4, s5, s6, s7)
                stage = (peer + STAGING).to(tl.pointer_type(tl.float32)) + ((e & 1) * N + me) * area + base
                tl.store(stage + j * C + cols, part)
        late = signal_and_wait(me, group, mine, g, e, s0, s1, s2, s3, s4, s5, s6, s7, N, MAXPROGS, FLAGS, SPIN_LIMIT)
        # the ranks' values summed in rank order, rounded to x's dtype, added to x: s; the squares of s summed
        mine_stage = (mine + STAGING).to(tl.pointer_type(tl.float32)) + (e & 1) * N * area + base
        sq = tl.zeros((C,), tl.float32)
        for j in tl.static_range(CPP):
            total = tl.load(mine_stage + j * C + cols, cache_modifier=".cg")
            for p in tl.static_range(1, N):
                total += tl.load(mine_stage + p * area + j * C + cols, cache_modifier=".cg")
            x = tl.load(x_ptr + row + j * C + cols)
            s = (x.to(tl.float32) + total.to(x.dtype).to(tl.float32)).to(x.dtype)
            s = tl.where(late == 0, s, float("nan")).to(x.dtype)
            tl.store(s_ptr + row + j * C + cols, s)
            s32 = s.to(tl.float32)
            sq += s32 * s32
        squares = tl.sum(sq, 0)
        if PPR > 1:  # the row's programs hand each other their square sums: each adds them in program order
            mine_sq = (mine + SQUARES).to(tl.pointer_type(tl.float32)) + r * 16
            tl.store(mine_sq + q, squares)
            tl.debug_barrier()
            # a two-phase barrier of the row's programs: call n of row r (n counted per row, so the same in all of
            # them, unlike their own counters where the workspace also ran one program per row) adds to arrival
            # counter n & 1 and waits for PPR there; program 0 zeroes the other one, which call n - 1 used (done)
            # and call n + 1 will (not begun): no counter grows, and none wraps
            rs = (mine + ROWSYNC).to(tl.pointer_type(tl.int32)) + r * 4  # [calls, arrivals 0, arrivals 1, -]
            n = tl.load(rs, volatile=True)
            tl.store(rs + 1 + (1 - (n & 1)), 0, mask=q == 0)
            arrivals = rs + 1 + (n & 1)
            seen = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") + 1
            polls = seen * 0
            while (seen < PPR) & (polls < SPIN_LIMIT):
                seen = tl.atomic_add(arrivals, 0, sem="acquire", scope="gpu")
                polls += 1
            tl.store(rs, n + 1, mask=q == 0)  # every program of the row read n before it arrived
            squares = tl.load(mine_sq, cache_modifier=".cg")
            for i in tl.static_range(1, PPR):
                squares += tl.load(mine_sq + i, cache_modifier=".cg")
            squares = tl.where(seen < PPR, float("nan"), squares)  # a row's program that never came: NaN rows
        inv = libdevice.rsqrt(squares / H + EPS)
        tl.debug_barrier()  # s as stored, read back below by whichever thread holds its columns now
        for j in tl.static_range(CPP):
            s = tl.load(s_ptr + row + j * C + cols)
            w = tl.load(w_ptr + q * CPP * C + j * C + cols).to(tl.float32)
            tl.store(h_ptr + row + j * C + cols, (s.to(tl.float32) * inv * (1.0 + w)).to(s.dtype))
        tl.store(counter, e)

    return oneshot_add_rms_norm


def row_fusion_applies(rows: int, hdim: int, ranks: int) -> bool:
    """Whether :func:`add_rms_norm` takes ``rows`` rows of ``hdim`` over ``ranks`` ranks."""
    from jaxmtp.pallas.norms import supports

    return 0 < rows <= MAX_ROWS and hdim <= ROW_STRIDE and supports(hdim) and 1 < ranks <= MAX_RANKS


def add_rms_norm(x: jax.Array, parts: jax.Array, weight: jax.Array, eps: float, axis: str, ranks: int,
                 peers: tuple[int, ...], *, num_warps: int = 4,
                 one_program_per_row: bool = True) -> tuple[jax.Array, jax.Array]:
    """The block's output reduced over the ranks and added to the residual stream, normed, in one launch:
    ``(s, h)`` [..., H] in x's dtype with ``s = x + round(sum over ranks of (sum over i of parts[i]))`` and ``h =
    rms_norm(s, weight, eps)`` (:func:`row_reference`). x [..., H]; ``parts`` [P, ..., H] (any float dtype): this
    rank's partial output, split along K in P parts (P = 1: the product's output); ``weight`` [H] (the norm's
    offset, scale ``1 + w``). Inside the step's ``shard_map``, for shapes :func:`row_fusion_applies` takes.
    ``num_warps`` per program; a program per row, or one per chunk of a row (the row length's largest power-of-two
    divisor up to 4096: :func:`jaxmtp.pallas.norms.add_rms_norm_triton.chunk_size`), which hand each other their
    square sums. The kernel policy chooses (``oneshot_row_*``). One hidden size per workspace: a program's staging
    region depends on it."""
    import jax_triton as jt
    from jaxmtp.pallas.norms.add_rms_norm_triton import chunk_size

    hdim = x.shape[-1]
    rows = x.size // hdim
    if parts.shape[1:] != x.shape or weight.shape != (hdim,) or not row_fusion_applies(rows, hdim, ranks):
        raise ValueError(f"the fused one-shot add + norm does not take x {x.shape}, parts {parts.shape}, weight "
                         f"{weight.shape} over {ranks} ranks")
    chunk = chunk_size(hdim)
    ppr = 1 if one_program_per_row else hdim // chunk
    row = jax.ShapeDtypeStruct((rows, hdim), x.dtype)
    s, h = jt.triton_call(
        parts.reshape(parts.shape[0], rows, hdim), x.reshape(rows, hdim), weight, _rank_and_group(axis, ranks),
        *peers, kernel=_row_kernel(), out_shape=[row, row], grid=(rows * ppr,), num_warps=num_warps,
        num_stages=1, ROWS=rows, H=hdim, C=chunk, CPP=hdim // chunk // ppr, P=parts.shape[0], N=ranks,
        EPS=float(eps), STRIDE=ROW_STRIDE, MAXROWS=MAX_ROWS, MAXPROGS=MAX_PROGRAMS, COUNTERS=_ROW_COUNTERS,
        FLAGS=_ROW_FLAGS, ROWSYNC=_ROW_SYNC, SQUARES=_ROW_SQUARES, STAGING=_row_staging(ranks),
        SPIN_LIMIT=SPIN_LIMIT)
    return s.reshape(x.shape), h.reshape(x.shape)


def row_reference(x: jax.Array, parts: jax.Array, weight: jax.Array, eps: float, axis: str):
    """What :func:`add_rms_norm` computes, from ``lax.psum`` and the add + norm reference."""
    from jaxmtp.pallas.norms import add_rms_norm_reference

    total = reference(parts, axis, parts=True)
    return add_rms_norm_reference(x, total.astype(x.dtype), weight, eps)


def _rank_and_group(axis: str, ranks: int) -> jax.Array:
    """int32 [2]: this device's rank on ``axis`` and the flat mesh index of its group's rank 0 (a ``dp`` axis, if
    the mesh has one, holds several groups)."""
    rank = jax.lax.axis_index(axis).astype(jnp.int32)
    group = jax.lax.axis_index("dp").astype(jnp.int32) * ranks if _has_axis("dp") else jnp.int32(0)
    return jnp.stack([rank, group])


def _has_axis(name: str) -> bool:
    try:
        jax.lax.axis_index(name)
    except NameError:
        return False
    return True


__all__ = ["BLOCK", "CAPACITY", "MAX_PROGRAMS", "MAX_RANKS", "MAX_ROWS", "PRODUCT_MAX_ROWS", "ROW_STRIDE",
           "SPIN_LIMIT", "add_rms_norm", "allocate", "allreduce", "available", "reference", "row_fusion_applies",
           "row_reference", "workspace_bytes"]
