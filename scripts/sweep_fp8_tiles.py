#!/usr/bin/env python
"""Tile sweep of the block-FP8 product kernel (:mod:`jaxmtp.pallas.matmul.fp8_triton`) at Qwen3.5-27B shapes: the
measurements behind its default plan.

    python scripts/sweep_fp8_tiles.py --out fp8_tiles.json [--max-seconds 400]

For each (rows, K, N) of ``--cases`` and each tile choice of the path the rows take (multiply-add for few rows,
tensor-core dots otherwise; ``--paths both`` tries both), the time of one product: ``--calls`` chained calls in one
jitted loop whose weights rotate over copies of at least 256 MiB (so they stream from HBM, not L2), wall clock over
the loop, the median of ``--reps``. Reported against the measured copy bandwidth (read + write of float32) and the
default plan's time. JSON after every case; stops starting cases after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmtp.benchmarking import (chained_product_seconds, device_seconds, hbm_bandwidth, run_metadata,  # noqa: E402
                                 write_json)
from jaxmtp.pallas.matmul.fp8_triton import fp8_matmul_triton, plan  # noqa: E402
from jaxmtp.pallas.matmul.reference import FP8_DTYPE  # noqa: E402

# (name, K, N) at 27B: fused gate|up, down, GDN in_proj_qkv|z, out_proj / o_proj
SHAPES = {"gate_up": (5120, 34816), "down": (17408, 5120), "in_proj": (5120, 16384), "out": (6144, 5120)}


def fma_tiles(lanes=(1, 16), stages=(2,), bns=(4, 8, 16), bks=(512, 1024, 2048), splits_=(1,), warps_=(4, 8)):
    for bn, bk, warps, lane, stage, splits in itertools.product(bns, bks, warps_, lanes, stages, splits_):
        yield dict(fma_max_rows=4, block_n=bn, block_k=bk, num_warps=warps, num_stages=stage, splits=splits,
                   lanes=lane)


def dot_tiles(m: int, stages=(3,), warps=(4,), bns=(32, 64, 128), bks=(128, 256, 512), splits_=(1, 2, 4, 8)):
    bm = max(16, min(64, 1 << (m - 1).bit_length()))
    for bn, bk, splits, stage, warp in itertools.product(bns, bks, splits_, stages, warps):
        yield dict(fma_max_rows=0, block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=warp, num_stages=stage)


def time_product(x, ws, tiles: dict, calls: int, reps: int, timing: str = "wall") -> float:
    """Seconds per product of ``calls`` chained products over the rotating weights ``ws``: ``"wall"`` the loop's
    wall clock (launches and dispatch included), ``"kernel"`` the device's kernel time from a profiler trace
    (:func:`jaxmtp.benchmarking.device_seconds`; the chaining op's ~1 us included)."""
    fn = lambda y, w, s: fp8_matmul_triton(y, w, s, **tiles)  # noqa: E731
    if timing == "kernel":
        chain = lambda a, out: (a[0] + out[..., :1].astype(a[0].dtype) * 0, *a[1:])  # noqa: E731
        return min(device_seconds(fn, x, *ws[0], chain=chain, calls=calls) for _ in range(reps))
    return chained_product_seconds(fn, x, ws, calls, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1:gate_up,1:down,1:in_proj,1:out,2:gate_up,2:down,4:gate_up,4:down,8:gate_up,"
                                      "32:gate_up,32:down")
    ap.add_argument("--paths", default="both", choices=["rows", "both", "dots"],
                    help="rows: the path the row count takes by default; both: multiply-add and dots for 2-4 rows; "
                    "dots: tensor cores only")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=400.0)
    ap.add_argument("--timing", default="wall", choices=["wall", "kernel"],
                    help="wall clock of the chained loop, or the kernels' device time from a profiler trace")
    ap.add_argument("--lanes", default="1,16", help="multiply-add path: products summed per thread before "
                    "accumulating (1: a [BN, BK] accumulator)")
    ap.add_argument("--fma-stages", default="2", help="multiply-add path: pipeline stages to try, e.g. 2,3,4")
    ap.add_argument("--fma-bn", default="4,8,16", help="multiply-add path: W rows per program (BN) to try")
    ap.add_argument("--fma-bk", default="512,1024,2048", help="multiply-add path: K step widths (BK) to try")
    ap.add_argument("--fma-splits", default="1", help="multiply-add path: K splits to try")
    ap.add_argument("--fma-warps", default="4,8", help="multiply-add path: warps per program to try")
    ap.add_argument("--dot-stages", default="3", help="tensor-core path: pipeline stages to try, e.g. 2,3,4")
    ap.add_argument("--dot-warps", default="4", help="tensor-core path: warps per program to try, e.g. 4,8")
    ap.add_argument("--dot-bn", default="32,64,128", help="tensor-core path: W tile rows (BN) to try")
    ap.add_argument("--dot-bk", default="128,256,512", help="tensor-core path: K tile widths (BK) to try")
    ap.add_argument("--dot-splits", default="1,2,4,8", help="tensor-core path: K splits to try")
    ap.add_argument("--out", default="fp8_tiles.json")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, the kernel interpreted, two tiles per case")
    args = ap.parse_args(argv)
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    if args.smoke:
        SHAPES.update({name: (256, 384) for name in SHAPES})
    t_start = time.perf_counter()
    result = {**run_metadata(), "copy_bytes_per_s": hbm_bandwidth(), "timing": args.timing, "cases": []}
    bw = result["copy_bytes_per_s"]
    key = jax.random.key(0)
    for case in args.cases.split(","):
        m, name = case.split(":")
        m, (k, n) = int(m), SHAPES[name]
        w = (64 * jax.random.normal(key, (n, k), jnp.float32)).clip(-448, 448).astype(FP8_DTYPE)
        s = jax.random.uniform(key, (-(-n // 128), -(-k // 128)), jnp.float32, 1e-4, 1e-3)
        nbytes = w.size + s.size * 4
        ws = [(w, s)] + [(jnp.copy(w), jnp.copy(s)) for _ in range(max(0, -(-(256 << 20) // nbytes) - 1))]
        x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
        default = plan(m, k, n)
        entry = {"rows": m, "K": k, "N": n, "name": name, "weight_bytes": nbytes, "default_plan": default._asdict(),
                 "tiles": []}
        tiles = (list(fma_tiles(ints(args.lanes), ints(args.fma_stages), ints(args.fma_bn), ints(args.fma_bk),
                                ints(args.fma_splits), ints(args.fma_warps)))
                 if m <= 4 and args.paths != "dots" else [])
        if m > 4 or (args.paths != "rows" and m > 1):
            tiles += list(dot_tiles(m, ints(args.dot_stages), ints(args.dot_warps), ints(args.dot_bn),
                                    ints(args.dot_bk), ints(args.dot_splits)))
        if args.smoke:
            tiles = [dict(t, interpret=True) for t in tiles[:1] + tiles[-1:]]
            ws = ws[:2]
        entry["default_s"] = time_product(x, ws, {"interpret": True} if args.smoke else {}, args.calls, args.reps,
                                         args.timing)
        for t in tiles:
            if time.perf_counter() - t_start > args.max_seconds:
                entry["stopped_early"] = True
                break
            try:
                sec = time_product(x, ws, t, args.calls, args.reps, args.timing)
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a result
                entry["tiles"].append({**t, "error": str(e).splitlines()[0][:200]})
                continue
            entry["tiles"].append({**t, "s": sec, "copy_fraction": nbytes / sec / bw})
        ok = [t for t in entry["tiles"] if "s" in t]
        if ok:
            best = min(ok, key=lambda t: t["s"])
            entry["best"] = best
            print(f"{m:3d} rows {name:8s}: default {entry['default_s'] * 1e6:7.1f} us "
                  f"({nbytes / entry['default_s'] / bw:.0%}), best {best['s'] * 1e6:7.1f} us "
                  f"({best['copy_fraction']:.0%}) {({k: v for k, v in best.items() if k not in ('s', 'copy_fraction')})}",
                  flush=True)
        result["cases"].append(entry)
        write_json(args.out, result)
        del ws
    return 0


if __name__ == "__main__":
    sys.exit(main())
