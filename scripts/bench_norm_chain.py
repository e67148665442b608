#!/usr/bin/env python
"""Residual add + RMSNorm alone (GPU): per-norm time of a jitted chain of 32, XLA's reference against the Triton
kernel at 1, 2, 4 and 8 warps, for a few (rows, H). JSON to argv[1].

    python scripts/bench_norm_chain.py out.json
    # docs/results/h100_norm_ab_run7.json, "micro_chain_of_32_norms_us_per_norm"
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmtp.pallas.norms import add_rms_norm_reference, add_rms_norm_triton  # noqa: E402

CHAIN = 32
SHAPES = [(1, 2560), (1, 5120), (8, 2560)]


def chain(fn):
    @jax.jit
    def f(x, y, w):
        for _ in range(CHAIN):
            x, y = fn(x, y, w)
        return x, y

    return f


def best_time(f, *args, reps: int = 200) -> float:
    """Fastest of 5 means over reps / 5 back-to-back calls (seconds per call; one sync per mean)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps // 5):
            r = f(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / (reps // 5))
    return min(ts)


def main(out_path: str) -> int:
    rows_out = []
    for rows, h in SHAPES:
        ks = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(ks[0], (rows, h), jnp.bfloat16)
        y = jax.random.normal(ks[1], (rows, h), jnp.bfloat16)
        w = 0.1 * jax.random.normal(ks[2], (h,), jnp.float32)
        row = {"rows": rows, "H": h}
        row["xla_us"] = best_time(chain(lambda x, y, w: add_rms_norm_reference(x, y, w, 1e-6)), x, y, w) / CHAIN * 1e6
        for nw in (1, 2, 4, 8):
            fn = lambda x, y, w, nw=nw: add_rms_norm_triton(x, y, w, 1e-6, num_warps=nw)  # noqa: E731
            row[f"triton_w{nw}_us"] = best_time(chain(fn), x, y, w) / CHAIN * 1e6
        print(row, flush=True)
        rows_out.append(row)
    with open(out_path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "norm_chain.json"))
