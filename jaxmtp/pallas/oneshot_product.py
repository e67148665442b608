"""A block's row-parallel output product fused with the one-shot reduction, the residual add and the next RMSNorm:
tensor parallelism's decode and verify rows (up to ``PRODUCT_MAX_ROWS``) in one launch per block output, where the
one-shot mode otherwise runs the product and then :func:`jaxmtp.pallas.allreduce_oneshot.add_rms_norm`.

Why: in the 27B step at TP 2 that reduce + add + norm launch costs about 9 us, 6.7 us more than the add + norm it
replaces, most of it a round trip between the GPUs that starts only once the product has ended
(docs/performance.md, "The one-shot reduction"). Here the programs' columns are staged as they finish, and only
the last program of a rank exchanges and waits.

The product: W stored ``[N, K]`` (K contiguous; the one-row output layout of
:func:`jaxmtp.param_layout.set_output_layout`), this rank's K slice. Program j owns output columns
``[j BN, (j + 1) BN)`` of every row over the whole of K (no split, so no partial sums): per ``BK`` step it loads a
``[BN, BK]`` tile and the rows' ``[R, BK]``, widened to float32, and adds their products to a tile-wide float32
accumulator, reduced once at the end (the fastest of three ways measured; docs/performance.md, "The product in the
same launch").

The protocol (a section of the one-shot workspace of its own, :func:`jaxmtp.pallas.allreduce_oneshot.allocate`: a
call counter, an arrival counter, a flag per sender, staging of two parities x ``PRODUCT_MAX_ROWS`` rows):

* every program of call ``e`` (the call counter + 1; every rank makes the same calls, so the counters agree) stores
  its float32 columns into parity ``e & 1`` of this rank's staging, then adds one to the arrival counter
  (acquire-release, GPU scope: its stores precede the addition);
* the program whose addition completes the grid is the last: every column of this rank is staged. It raises its
  flag in each peer (release, system scope: the staged rows it acquired precede it), waits for each peer's flag to
  reach ``e`` (acquire), reads each rank's staged rows from that rank's memory in rank order, so that every rank
  sums the same values in the same order, and forms ``s = x + round(sum)`` and ``h = rms_norm(s)`` over whole rows;
  then it zeroes the arrival counter and stores ``e``. The next launch on the stream begins after this one has
  ended, so no program of call ``e + 1`` reads either before they are set;
* two parities suffice: a rank writes parity ``e & 1`` again in call ``e + 2``, which begins after its call
  ``e + 1`` saw each peer's flag ``e + 1``, raised after that peer's call ``e`` had read.

A program stores only into its own GPU's memory and the last one reads the peers' rows; every program pushing its
columns into each peer's staging measured the same (docs/performance.md, "The product in the same launch"). The
policy leaves this kernel off: it measured no faster than the two launches in the 27B step.

Only the last program spins, so the grid need not be resident at once. A peer that never comes (a bug) leaves NaN
rows after ``SPIN_LIMIT`` polls, as in the other one-shot kernels. The value is the reference's
(:func:`reference`): the float32 products of each rank (its own summation order along K), their sum in rank order,
rounded to x's dtype and added to x; ``h`` as :func:`jaxmtp.pallas.norms.add_rms_norm_triton` forms it.

Needs ``jax_triton`` and a CUDA GPU (:func:`jaxmtp.pallas.allreduce_oneshot.available`); on the CPU the protocol runs
in Triton's interpreter with a process per rank (tests/test_oneshot_protocol.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmtp.pallas import allreduce_oneshot as _oneshot
from jaxmtp.pallas._common import next_pow2


@functools.cache
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    pick = _oneshot._pick()

    @triton.jit
    def oneshot_product_add_rms_norm(a_ptr, w_ptr, x_ptr, nw_ptr, rank_ptr, s0, s1, s2, s3, s4, s5, s6, s7, s_ptr,
                                     h_ptr, R: tl.constexpr, RP: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                                     BN: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                                     N: tl.constexpr, EPS: tl.constexpr, STRIDE: tl.constexpr,
                                     MAXROWS: tl.constexpr, CONTROL: tl.constexpr, STAGING: tl.constexpr,
                                     SPIN_LIMIT: tl.constexpr, EXCHANGE: tl.constexpr):
        j = tl.program_id(0)
        me = tl.load(rank_ptr)
        group = tl.load(rank_ptr + 1)
        mine = pick(group + me, s0, s1, s2, s3, s4, s5, s6, s7)
        control = (mine + CONTROL).to(tl.pointer_type(tl.int32))  # [calls, arrivals, flags[8] by sender]
        e = tl.load(control, volatile=True) + 1
        parity = e & 1
        area = MAXROWS * STRIDE  # floats of one rank's rows in one parity

        # this program's columns of every row: [RP, BN] float32
        rows = tl.arange(0, RP)
        cols = j * BN + tl.arange(0, BN)
        k_in = tl.arange(0, BK)[None, :]
        w_at = w_ptr + cols[:, None] * K
        a_at = a_ptr + rows[:, None] * K
        row_ok = rows[:, None] < R
        acc = tl.zeros((RP, BN, BK), tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + k_in
            if K % BK:  # a last step past K: its columns masked
                w = tl.load(w_at + kk, mask=kk < K, other=0.0)
                a = tl.load(a_at + kk, mask=row_ok & (kk < K), other=0.0)
            elif R < RP:
                w = tl.load(w_at + kk)
                a = tl.load(a_at + kk, mask=row_ok, other=0.0)
            else:
                w = tl.load(w_at + kk)
                a = tl.load(a_at + kk)
            acc += w.to(tl.float32)[None] * a.to(tl.float32)[:, None]  # [RP, BN, BK]
        part = tl.sum(acc, axis=2)
        if not EXCHANGE:  # the product alone (benchmarks): s and h its rounded value
            out = rows[:, None] * H + cols[None, :]
            tl.store(s_ptr + out, part.to(s_ptr.dtype.element_ty), mask=rows[:, None] < R)
            tl.store(h_ptr + out, part.to(h_ptr.dtype.element_ty), mask=rows[:, None] < R)
            return
        stage = (mine + STAGING).to(tl.pointer_type(tl.float32)) + parity * area  # this rank's own staging
        tl.store(stage + rows[:, None] * STRIDE + cols[None, :], part, mask=rows[:, None] < R)
        tl.debug_barrier()  # every thread's stores precede the releasing arrival below
        arrived = tl.atomic_add(control + 1, 1, sem="acq_rel", scope="gpu") + 1
        if arrived == tl.num_programs(0):  # the last program: every column of this rank is staged everywhere
            for p in tl.static_range(N):
                peer = pick(group + p, s0, s1, s2, s3, s4, s5, s6, s7)
                flag = (peer + CONTROL).to(tl.pointer_type(tl.int32)) + 2 + me
                tl.atomic_add(flag, 1, mask=me != p, sem="release", scope="sys")
            late = 0
            for p in tl.static_range(N):
                target = tl.where(me == p, 0, e)
                seen = tl.atomic_add(control + 2 + p, 0, sem="acquire", scope="sys")
                polls = seen * 0
                while ((seen - target) < 0) & (polls < SPIN_LIMIT):  # differences: right across the wrap at 2^31
                    seen = tl.atomic_add(control + 2 + p, 0, sem="acquire", scope="sys")
                    polls += 1
                late = late + ((seen - target) < 0).to(tl.int32)
            cc = tl.arange(0, C)
            for r in tl.static_range(R):
                sq = tl.zeros((C,), tl.float32)
                for c0 in tl.static_range(0, H, C):
                    total = tl.zeros((C,), tl.float32)
                    for p in tl.static_range(N):  # rank order, each rank's row read from its own staging
                        staged = (pick(group + p, s0, s1, s2, s3, s4, s5, s6, s7) + STAGING).to(
                            tl.pointer_type(tl.float32)) + parity * area
                        total += tl.load(staged + r * STRIDE + c0 + cc, cache_modifier=".cg")
                    x = tl.load(x_ptr + r * H + c0 + cc)
                    s = (x.to(tl.float32) + total.to(x.dtype).to(tl.float32)).to(x.dtype)
                    s = tl.where(late == 0, s, float("nan")).to(x.dtype)
                    tl.store(s_ptr + r * H + c0 + cc, s)
                    s32 = s.to(tl.float32)
                    sq += s32 * s32
                inv = libdevice.rsqrt(tl.sum(sq, 0) / H + EPS)
                tl.debug_barrier()  # s as stored, read back below by whichever thread holds its columns now
                for c0 in tl.static_range(0, H, C):
                    s = tl.load(s_ptr + r * H + c0 + cc)
                    nw = tl.load(nw_ptr + c0 + cc).to(tl.float32)
                    tl.store(h_ptr + r * H + c0 + cc, (s.to(tl.float32) * inv * (1.0 + nw)).to(s.dtype))
            tl.store(control + 1, 0)
            tl.store(control, e)

    return oneshot_product_add_rms_norm


def supports(rows: int, kdim: int, hdim: int, ranks: int, *, block_n: int, block_k: int) -> bool:
    """Whether :func:`product_add_rms_norm` takes ``rows`` rows of a ``[hdim, kdim]`` weight slice over ``ranks``
    ranks with these tiles (BN and BK powers of two, BN dividing the hidden size; a hidden size up to the staging's
    row stride that the norm kernel's chunks divide)."""
    from jaxmtp.pallas.norms import supports as norm_supports
    from jaxmtp.pallas.norms.add_rms_norm_triton import chunk_size

    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    return (0 < rows <= _oneshot.PRODUCT_MAX_ROWS and 1 < ranks <= _oneshot.MAX_RANKS and kdim > 0
            and hdim <= _oneshot.ROW_STRIDE and norm_supports(hdim) and pow2(chunk_size(hdim)) and pow2(block_n)
            and pow2(block_k) and hdim % block_n == 0)


def product_add_rms_norm(x: jax.Array, a: jax.Array, w_t: jax.Array, weight: jax.Array, eps: float, axis: str,
                         ranks: int, peers: tuple[int, ...], *, block_n: int = 8, block_k: int = 512,
                         num_warps: int = 4, num_stages: int = 3,
                         exchange: bool = True) -> tuple[jax.Array, jax.Array]:
    """``(s, h)`` [..., H] in x's dtype: ``s = x + round(sum over ranks of a @ w_t^T)``, ``h = rms_norm(s, weight,
    eps)`` (:func:`reference`), in one launch inside the step's ``shard_map``. x [..., H] the residual stream; a
    [..., K] this rank's slice of the product's input; ``w_t [H, K]`` this rank's slice of the weight; ``weight``
    [H] the norm's offset (scale ``1 + w``); ``peers`` the workspaces' addresses. Tiles: BN output columns per
    program, BK of K per step (the kernel policy's ``oneshot_product_*``). ``exchange=False`` (benchmarks: the
    product's own time) skips the exchange: s and h are this rank's product."""
    import jax_triton as jt
    from jaxmtp.pallas.norms.add_rms_norm_triton import chunk_size

    hdim, kdim = x.shape[-1], a.shape[-1]
    rows = x.size // hdim
    if (w_t.shape != (hdim, kdim) or a.shape[:-1] != x.shape[:-1] or weight.shape != (hdim,)
            or not supports(rows, kdim, hdim, ranks, block_n=block_n, block_k=block_k)):
        raise ValueError(f"the fused one-shot product does not take x {x.shape}, a {a.shape}, w_t {w_t.shape}, "
                         f"weight {weight.shape} over {ranks} ranks with BN {block_n}, BK {block_k}")
    row = jax.ShapeDtypeStruct((rows, hdim), x.dtype)
    s, h = jt.triton_call(
        a.reshape(rows, kdim), w_t, x.reshape(rows, hdim), weight, _oneshot._rank_and_group(axis, ranks), *peers,
        kernel=_kernel(), out_shape=[row, row], grid=(hdim // block_n,), num_warps=num_warps, num_stages=num_stages,
        R=rows, RP=next_pow2(rows), K=kdim, H=hdim, BN=block_n, BK=block_k, C=chunk_size(hdim),
        N=ranks, EPS=float(eps), STRIDE=_oneshot.ROW_STRIDE, MAXROWS=_oneshot.PRODUCT_MAX_ROWS,
        CONTROL=_oneshot._product_control(ranks), STAGING=_oneshot._product_staging(ranks),
        SPIN_LIMIT=_oneshot.SPIN_LIMIT, EXCHANGE=exchange)
    return s.reshape(x.shape), h.reshape(x.shape)


def reference(x: jax.Array, a: jax.Array, w_t: jax.Array, weight: jax.Array, eps: float, axis: str):
    """What :func:`product_add_rms_norm` computes: this rank's float32 product, ``lax.psum`` over ``axis``, the add +
    norm reference."""
    y = jnp.einsum("...k,nk->...n", a.astype(jnp.float32), w_t.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return _oneshot.row_reference(x, y[None], weight, eps, axis)


__all__ = ["product_add_rms_norm", "reference", "supports"]
