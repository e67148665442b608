"""The one-shot kernels' protocol (jaxmtp.pallas.allreduce_oneshot) on the CPU, across the wrap of its call counters.

The kernels store into their peers' memory through raw addresses, so neither Pallas's interpreter nor a single
process can run them. Here Triton's own interpreter runs each rank's kernel in a process of its own over workspaces
in shared memory (each process passes its own mappings' addresses as the peers'), so the ranks poll each other's
flags concurrently as GPUs do. The workspaces start as if 2^31 - 2 calls had been made: the calls cross the int32
wrap of the counters, where a parity taken as ``e % 2`` or a flag compared with ``<`` (not by difference) reads a
peer's stale block. The fused kernel runs one program per row (its one-program-per-chunk mode needs the programs of
a row resident together, which the interpreter's one-at-a-time programs are not); so do the fused product kernel's
(jaxmtp.pallas.oneshot_product). Needs the ``triton`` package (a test dependency on Linux x86-64, where its wheels
exist): skipped without it. On a GPU the kernels are checked against ``lax.psum`` and their references
(tests/test_gpu_checks.py).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from multiprocessing import shared_memory

import numpy as np
import pytest

# not imported here: each rank's process sets TRITON_INTERPRET before its first import of triton
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")

START = 2**31 - 2  # calls already made: the next calls' counters are 2^31 - 1, then -2^31, ...


def _rank(me, kind, n, names, out_name, inputs, shape, calls, launch):
    """One rank's process: ``calls`` launches of ``kind`` ("plain" or "row") in Triton's interpreter."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton.language as tl

    from jaxmtp.pallas import allreduce_oneshot as a

    from jaxmtp.pallas import oneshot_product

    kernel = {"plain": a._kernel, "row": a._row_kernel, "product": oneshot_product._kernel}[kind]()
    # the interpreter resolves names in the kernel's globals (not its closure) and has no libdevice: tl's rsqrt
    for module in (a, oneshot_product):
        vars(module).update(pick=a._pick(), signal_and_wait=a._signal_and_wait(), tl=tl, libdevice=tl)
    shms = [shared_memory.SharedMemory(name=nm) for nm in names]
    views = [torch.frombuffer(s.buf, dtype=torch.int32) for s in shms]
    peers = [v.data_ptr() for v in views] + [0] * (a.MAX_RANKS - n)
    out_shm = shared_memory.SharedMemory(name=out_name)
    out = np.ndarray((n, calls, 2, *shape), np.float32, buffer=out_shm.buf)
    rank = torch.tensor([me, 0], dtype=torch.int32)
    for c in range(calls):
        if kind == "plain":
            y = torch.empty(shape)
            kernel[(-(-int(np.prod(shape)) // a.BLOCK),)](torch.tensor(inputs[c][me]), rank, *peers, y, **launch)
            out[me, c, 0] = y.numpy()
        elif kind == "product":
            x, w, acts, w_t = inputs[c]
            s, h = torch.empty(shape), torch.empty(shape)
            kernel[(shape[1] // launch["BN"],)](torch.tensor(acts[me]), torch.tensor(w_t[me]), torch.tensor(x),
                                                torch.tensor(w), rank, *peers, s, h, **launch)
            out[me, c, 0], out[me, c, 1] = s.numpy(), h.numpy()
        else:
            x, w, parts = inputs[c]
            s, h = torch.empty(shape), torch.empty(shape)
            kernel[(shape[0],)](torch.tensor(parts[me]), torch.tensor(x), torch.tensor(w), rank, *peers, s, h,
                                **launch)
            out[me, c, 0], out[me, c, 1] = s.numpy(), h.numpy()
    del views, out
    for s in (*shms, out_shm):
        s.close()


def _run(kind, n, inputs, shape, calls, launch, counters, flags, programs=None):
    """Every rank's process at once, over new workspaces whose ``programs`` counters (default the most a kernel
    has) and every sender's flags for them are at START; returns their outputs [ranks, calls, 2, *shape]."""
    from jaxmtp.pallas import allreduce_oneshot as a

    shms = [shared_memory.SharedMemory(create=True, size=a.workspace_bytes(n)) for _ in range(n)]
    out = shared_memory.SharedMemory(create=True, size=n * calls * 2 * int(np.prod(shape)) * 4)
    try:
        for s in shms:
            words = np.ndarray((a.workspace_bytes(n) // 4,), np.int32, buffer=s.buf)
            words[:] = 0
            programs = a.MAX_PROGRAMS if programs is None else programs
            words[counters // 4: counters // 4 + programs] = START
            words[flags // 4: flags // 4 + a.MAX_RANKS * programs] = START  # every peer's START calls
            del words
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(me, kind, n, [s.name for s in shms], out.name, inputs, shape, calls,
                                                 launch)) for me in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return np.ndarray((n, calls, 2, *shape), np.float32, buffer=out.buf).copy()
    finally:
        for s in (*shms, out):
            s.close()
            s.unlink()


@pytest.mark.parametrize("nparts", [1, 2])
def test_the_all_reduce_sums_the_ranks_across_the_counter_wrap(nparts):
    """Three ranks, 3001 floats (a partial last block), each rank's value as ``nparts`` split-K parts, four calls from
    2^31 - 1 on: every rank gets the float32 sum in rank order of the ranks' part sums, bit for bit, every call."""
    from jaxmtp.pallas import allreduce_oneshot as a

    n, calls, numel = 3, 4, 3001
    rng = np.random.default_rng(nparts)
    inputs = [rng.standard_normal((n, nparts, numel)).astype(np.float32) for _ in range(calls)]
    launch = dict(NUMEL=numel, N=n, CAP=a.CAPACITY, BLOCK=a.BLOCK, PROGRAMS=a.MAX_PROGRAMS, FLAGS=a._FLAGS,
                  STAGING=a._STAGING, SPIN_LIMIT=1 << 16, P=nparts, num_warps=4)
    got = _run("plain", n, inputs, (numel,), calls, launch, 0, a._FLAGS)
    for c in range(calls):
        mine = [inputs[c][r][0] + inputs[c][r][1] if nparts == 2 else inputs[c][r][0] for r in range(n)]
        want = (mine[0] + mine[1]) + mine[2]
        for me in range(n):
            np.testing.assert_array_equal(got[me, c, 0], want, err_msg=f"rank {me}, call {c}")


def test_the_fused_add_norm_across_the_counter_wrap():
    """Two ranks, two rows of 2048 from two float32 parts each, one program per row, four calls from 2^31 - 1 on:
    s = x + the ranks' sum of their part sums, bit for bit, and h = rms_norm(s) against float64."""
    from jaxmtp.pallas import allreduce_oneshot as a

    n, calls, rows, hdim, nparts = 2, 4, 2, 2048, 2
    rng = np.random.default_rng(1)
    inputs = [(rng.standard_normal((rows, hdim)).astype(np.float32),
               (rng.standard_normal(hdim) * 0.1).astype(np.float32),
               rng.standard_normal((n, nparts, rows, hdim)).astype(np.float32)) for _ in range(calls)]
    launch = dict(ROWS=rows, H=hdim, C=hdim, CPP=1, P=nparts, N=n, EPS=1e-6, STRIDE=a.ROW_STRIDE,
                  MAXROWS=a.MAX_ROWS, MAXPROGS=a.MAX_PROGRAMS, COUNTERS=a._ROW_COUNTERS, FLAGS=a._ROW_FLAGS,
                  ROWSYNC=a._ROW_SYNC, SQUARES=a._ROW_SQUARES, STAGING=a._row_staging(n), SPIN_LIMIT=1 << 16,
                  num_warps=4)
    got = _run("row", n, inputs, (rows, hdim), calls, launch, a._ROW_COUNTERS, a._ROW_FLAGS)
    for c in range(calls):
        x, w, parts = inputs[c]
        s = x + ((parts[0, 0] + parts[0, 1]) + (parts[1, 0] + parts[1, 1]))
        s64 = s.astype(np.float64)
        h = s64 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + 1e-6) * (1.0 + w)
        for me in range(n):
            np.testing.assert_array_equal(got[me, c, 0], s, err_msg=f"rank {me}, call {c}")
            np.testing.assert_allclose(got[me, c, 1], h, rtol=1e-5, atol=1e-6, err_msg=f"rank {me}, call {c}")


@pytest.mark.parametrize("n,rows,kdim", [(2, 3, 200), (3, 1, 256), (2, 4, 256)])
def test_the_fused_product_add_norm_across_the_counter_wrap(n, rows, kdim):
    """The row-parallel product fused with the exchange, the add and the norm (jaxmtp.pallas.oneshot_product): ``n``
    ranks, ``rows`` rows (3: a masked fourth), K = ``kdim`` (200: a last BK step past K), 16 programs of 16 columns,
    four calls from 2^31 - 1 on: every rank gets the same s and h bits, s = x +
    the ranks' float32 products summed and h = rms_norm(s) against float64."""
    from jaxmtp.pallas import allreduce_oneshot as a

    calls, hdim = 4, 320  # five 64-column chunks a row
    rng = np.random.default_rng(n)
    inputs = [(rng.standard_normal((rows, hdim)).astype(np.float32),
               (rng.standard_normal(hdim) * 0.1).astype(np.float32),
               rng.standard_normal((n, rows, kdim)).astype(np.float32),
               (rng.standard_normal((n, hdim, kdim)) / np.sqrt(kdim)).astype(np.float32)) for _ in range(calls)]
    launch = dict(R=rows, RP=1 if rows == 1 else 4, K=kdim, H=hdim, BN=16, BK=64, C=64, N=n, EPS=1e-6,
                  STRIDE=a.ROW_STRIDE, MAXROWS=a.PRODUCT_MAX_ROWS, CONTROL=a._product_control(n),
                  STAGING=a._product_staging(n), SPIN_LIMIT=1 << 16, EXCHANGE=True, num_warps=4)
    control = a._product_control(n)
    # calls at START, the arrival counter at 0 (where a finished call leaves it), every sender's flag at START
    got = _run("product", n, inputs, (rows, hdim), calls, launch, control, control + 8, programs=1)
    for c in range(calls):
        x, w, acts, w_t = (v.astype(np.float64) for v in inputs[c])
        s = x + sum(acts[r] @ w_t[r].T for r in range(n))
        h = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6) * (1.0 + w)
        for me in range(n):
            np.testing.assert_array_equal(got[me, c], got[0, c], err_msg=f"rank {me}, call {c}")
        np.testing.assert_allclose(got[0, c, 0], s, rtol=1e-5, atol=1e-5, err_msg=f"call {c}")
        np.testing.assert_allclose(got[0, c, 1], h, rtol=1e-4, atol=1e-5, err_msg=f"call {c}")


def test_the_launches_give_the_kernels_every_parameter(monkeypatch):
    """jax_triton builds a kernel's signature from the arguments it is given, so a parameter left to its Triton
    default is missing there and the launch fails, on a GPU only (Triton's own launcher, which the interpreter tests
    use, fills defaults in). Through a stand-in for ``jax_triton.triton_call``: both launches, the all-reduce with
    and without split-K parts and the fused add + norm, give every input, output and constant the kernel names."""
    import sys
    import types

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxmtp.pallas import allreduce_oneshot as a, oneshot_product

    launched = []

    def triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, **constants):
        outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
        names = kernel.arg_names
        assert len(names) == len(args) + len(outs) + len(constants), (names, len(args), sorted(constants))
        assert set(constants) == set(names[len(args) + len(outs):]), (names, sorted(constants))
        launched.append(kernel.fn.__name__)
        res = [jnp.zeros(o.shape, o.dtype) for o in outs]
        return res if isinstance(out_shape, (list, tuple)) else res[0]

    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    peers = (1 << 20, 2 << 20) + (0,) * (a.MAX_RANKS - 2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    parts = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(256), jnp.float32)

    acts = jnp.asarray(rng.standard_normal((3, 384)), jnp.bfloat16)
    w_t = jnp.asarray(rng.standard_normal((256, 384)), jnp.bfloat16)

    def launches(x, parts, w, acts, w_t):
        return (a.allreduce(x, "tp", 2, peers), a.allreduce(parts, "tp", 2, peers, parts=True),
                a.add_rms_norm(x, parts, w, 1e-6, "tp", 2, peers, one_program_per_row=False),
                oneshot_product.product_add_rms_norm(x, acts, w_t, w, 1e-6, "tp", 2, peers))

    jax.jit(jax.shard_map(launches, mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), check_vma=False))(
        x, parts, w, acts, w_t)
    assert launched == ["oneshot", "oneshot", "oneshot_add_rms_norm", "oneshot_product_add_rms_norm"]
