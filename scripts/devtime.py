"""Device time of a jitted op from a profiler trace: kernel durations, not host wall clock.

``device_seconds(fn, *args, chain=..., calls=20)`` jits ``calls`` chained calls of ``fn`` (each call's first input
rebuilt from the previous output through an optimization barrier, the other inputs rotating over copies so weights
come from HBM, not L2), runs it once to compile, then once under ``jax.profiler`` and returns the union of the
device's kernel intervals divided by ``calls``. Launch gaps between kernels are excluded; the small chain op is
included (about a microsecond). On a CPU (no device streams) it falls back to wall time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import _union, is_device_stream, read_trace  # noqa: E402


def _copies(args, n):
    return [tuple(args)] + [tuple(None if a is None else jax.numpy.copy(a) for a in args) for _ in range(n - 1)]


def device_seconds(fn, *args, chain, calls: int = 20, min_set_bytes: int = 256 << 20) -> float:
    set_bytes = sum(a.size * a.dtype.itemsize for a in args if a is not None)
    sets = _copies(args, max(1, min(calls, -(-min_set_bytes // max(set_bytes, 1)))))

    @jax.jit
    def loop(all_sets):
        out = fn(*all_sets[0])
        for i in range(1, calls):
            out = fn(*chain(all_sets[i % len(all_sets)], jax.lax.optimization_barrier(out)))
        return out

    jax.block_until_ready(loop(sets))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        jax.block_until_ready(loop(sets))
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        groups = read_trace(d)
    kernels = [e for (p, t), evs in groups.items() if is_device_stream(p, t) for e in evs]
    if not kernels:
        return wall / calls
    return _union((e["ts"], e["ts"] + e["dur"]) for e in kernels) * 1e-6 / calls
