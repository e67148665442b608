"""Row-block copies (:mod:`.reference`) in one kernel launch (Pallas, Triton lowering), writing the destinations in
place (aliased: jit the caller with them donated, or XLA copies them first).

Per head a move is one contiguous run of ``rows * D`` elements in each array. Program ``(i, h, a * chunks + c)``
copies chunk c of move i's run for head h in pair a, a power of two of elements that divides the run (no chunk
reads past it): many small programs, as in a memcpy, keep enough loads in flight. Programs of moves past ``count``
return at once. The prefix cache's copies (a slot's KV rows into a
block, a slot's GDN state into a snapshot, and back) thus read and write each byte once: XLA's gather and scatter
first formed the rows in a temporary, and a loop of dynamic updates paid a launch per layer and move.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

MAX_CHUNK = 8192  # elements per array and program (16 KiB of bf16)


def chunk_elements(run: int) -> int:
    """The largest power of two dividing ``run`` (a move's elements per head), at most :data:`MAX_CHUNK`."""
    return min(MAX_CHUNK, run & -run)


def supports(dsts: list, srcs: list) -> bool:
    """Whether one launch takes these pairs: every array 4-D of one dtype with the first pair's H and D, and each
    destination of one shape; element offsets within int32."""
    a = dsts[0]
    return all(x.ndim == 4 and x.dtype == a.dtype and x.shape[1] == a.shape[1] and x.shape[3] == a.shape[3]
               and x.size < 2**31 for x in [*dsts, *srcs]) and all(d.shape == a.shape for d in dsts) and all(
        s.shape == srcs[0].shape for s in srcs)


def _kernel(moves_ref, count_ref, *refs, n: int, width: int, chunk: int, chunks: int):
    srcs, dsts = refs[:n], refs[2 * n :]  # refs[n : 2n]: the destinations' inputs, aliased to the outputs
    i, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    a, c = p // chunks, p % chunks

    for j, (src, dst) in enumerate(zip(srcs, dsts)):
        @pl.when((i < count_ref[0]) & (a == j))
        def _(src=src, dst=dst):
            s_off = moves_ref[i, 1] * width + c * chunk
            d_off = moves_ref[i, 3] * width + c * chunk
            dst[moves_ref[i, 2], h, pl.ds(d_off, chunk)] = src[moves_ref[i, 0], h, pl.ds(s_off, chunk)]


def copy_rows_triton(dsts: list, srcs: list, moves, count, *, rows: int, interpret: bool = False) -> list:
    """:func:`.reference.copy_rows_reference` in one launch (:func:`supports` must hold)."""
    n = len(dsts)
    nd, h, sd, d = dsts[0].shape
    run = rows * d
    chunk = chunk_elements(run)
    flat = lambda a: a.reshape(a.shape[0], h, -1)  # noqa: E731  [N, H, S * D]
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, width=d, chunk=chunk, chunks=run // chunk),
        out_shape=[jax.ShapeDtypeStruct((nd, h, sd * d), dsts[0].dtype)] * n,
        grid=(moves.shape[0], h, n * (run // chunk)),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        input_output_aliases={2 + n + j: j for j in range(n)},
        interpret=interpret,
        name="row_copy",
    )(moves.astype("int32"), count.astype("int32").reshape(1), *map(flat, srcs), *map(flat, dsts))
    return [o.reshape(nd, h, sd, d) for o in outs]
