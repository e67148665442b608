#!/usr/bin/env python
"""The Mosaic GPU few-row FP8 product (:mod:`jaxmtp.pallas.matmul.fp8_mosaic`) against the Triton kernel's plan at
Qwen3.5-27B shapes (Hopper only): each tiling's error against a float64 product and its kernel time from a profiler
trace (weights rotating over 256 MiB of copies), against the measured copy bandwidth.

    python scripts/sweep_fp8_mosaic.py --cases 4:gate_up,4:down,4:in_proj,4:out --out fp8_mosaic.json
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
import numpy as np  # noqa: E402

from jaxmtp.benchmarking import device_seconds, hbm_bandwidth, run_metadata, write_json  # noqa: E402
from jaxmtp.pallas.matmul.fp8_mosaic import fp8_rows_mosaic, tile_weight  # noqa: E402
from jaxmtp.pallas.matmul.fp8_triton import fp8_matmul_triton  # noqa: E402
from jaxmtp.pallas.matmul.reference import FP8_DTYPE, dequantize_fp8  # noqa: E402

SHAPES = {"gate_up": (5120, 34816), "down": (17408, 5120), "in_proj": (5120, 16384), "out": (6144, 5120)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="4:gate_up,4:down,4:in_proj,4:out")
    ap.add_argument("--block-n", default="64,128")
    ap.add_argument("--block-k", default="128")
    ap.add_argument("--tiled", default="0", help="1: the weight stored as contiguous [BN, 128] tiles (tile_weight)")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--work", default="float16", help="16-bit types to widen the weights to, e.g. float16,bfloat16")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=400.0)
    ap.add_argument("--out", default="fp8_mosaic.json")
    args = ap.parse_args(argv)
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    t_start = time.perf_counter()
    result = {**run_metadata(), "copy_bytes_per_s": hbm_bandwidth(), "cases": []}
    bw = result["copy_bytes_per_s"]
    key = jax.random.key(0)
    chain = lambda a, out: (a[0] + out[..., :1].astype(a[0].dtype) * 0, *a[1:])  # noqa: E731
    for case in args.cases.split(","):
        m, name = case.split(":")
        m, (k, n) = int(m), SHAPES[name]
        w = (64 * jax.random.normal(key, (n, k), jnp.float32)).clip(-448, 448).astype(FP8_DTYPE)
        s = jax.random.uniform(key, (n // 128, k // 128), jnp.float32, 1e-4, 1e-3)
        x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32).astype(jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(dequantize_fp8(w, s), np.float64).T
        nbytes = w.size + s.size * 4
        err = lambda y: float(np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want))  # noqa: E731
        triton = lambda a, b, c: fp8_matmul_triton(a, b, c, out_dtype=jnp.float32)  # noqa: E731
        base = device_seconds(triton, x, w, s, chain=chain, calls=args.calls)
        entry = {"rows": m, "K": k, "N": n, "name": name, "weight_bytes": nbytes, "triton_s": base,
                 "triton_err": err(triton(x, w, s)), "tiles": []}
        print(f"{m} rows {name}: triton {base * 1e6:.1f} us ({nbytes / base / bw:.0%}) err {entry['triton_err']:.1e}",
              flush=True)
        for bn, bk, tiled, splits, stages, work in itertools.product(
                ints(args.block_n), ints(args.block_k), ints(args.tiled), ints(args.splits), ints(args.stages),
                args.work.split(",")):
            if time.perf_counter() - t_start > args.max_seconds:
                entry["stopped_early"] = True
                break
            t = dict(block_n=bn, block_k=bk, splits=splits, stages=stages, work=work)
            if (k // 128) % splits or (k // 128 // splits) % (bk // 128):
                continue
            fn = lambda a, b, c, t=t: fp8_rows_mosaic(a, b, c, out_dtype=jnp.float32, **t)  # noqa: E731
            wt = tile_weight(w, bn) if tiled else w
            try:
                e = err(fn(x, wt, s))
                sec = device_seconds(fn, x, wt, s, chain=chain, calls=args.calls)
            except Exception as ex:  # noqa: BLE001 - a tiling the compiler refuses is a result
                entry["tiles"].append({**t, "tiled": tiled, "error": str(ex).splitlines()[0][:300]})
                print(f"   {t}: {entry['tiles'][-1]['error']}", flush=True)
                continue
            entry["tiles"].append({**t, "tiled": tiled, "s": sec, "err": e, "copy_fraction": nbytes / sec / bw})
            print(f"   {t} tiled {tiled}: {sec * 1e6:.1f} us ({nbytes / sec / bw:.0%}) err {e:.1e}", flush=True)
        result["cases"].append(entry)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
