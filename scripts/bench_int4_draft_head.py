#!/usr/bin/env python
"""int4 draft head (GPU): the packed-int4 few-row kernel against the jnp reference at three shapes, then one
4B-sized head read (1 row, K 2560, N 248320) with the int8 and with the int4 kernel, timed. JSON to argv[1].

    python scripts/bench_int4_draft_head.py out.json   # docs/results/h100_int4_draft_head_run7.json, "check"
    python scripts/bench_int4_draft_head.py out.json --sweep   # also every tiling of the kernel (run 8)
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_norm_chain import best_time  # noqa: E402
from jaxmtp.pallas.matmul import quantized_linear  # noqa: E402
from jaxmtp.pallas.matmul.skinny_triton import skinny_matmul_triton  # noqa: E402
from jaxmtp.param_layout import quantize_rows, quantize_rows_int4  # noqa: E402


def main(out_path: str) -> int:
    out = {"device": jax.devices()[0].device_kind}
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 2560, 32768), (4, 2560, 4096), (3, 4096, 8192)]:
        w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
        p, s = quantize_rows_int4(w)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        want = np.asarray(quantized_linear(x, p, s, implementation="xla"), np.float64)
        got = np.asarray(quantized_linear(x, p, s, implementation="triton"), np.float64)
        out[f"err_{m}x{k}x{n}"] = float(np.abs(got - want).max() / np.abs(want).max())
        print(m, k, n, "rel err", out[f"err_{m}x{k}x{n}"], flush=True)
    k, n = 2560, 248320  # the 4B's head
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.bfloat16)
    for name, (q, s) in [("int8", quantize_rows(w)), ("int4", quantize_rows_int4(w))]:
        f = jax.jit(lambda x, q, s: jnp.argmax(quantized_linear(x, q, s, implementation="triton"), -1))
        t = best_time(f, x, q, s, reps=250)
        out[f"{name}_head_us"] = t * 1e6
        out[f"{name}_TBps"] = q.size * q.dtype.itemsize / t / 1e12
        print(name, out[f"{name}_head_us"], out[f"{name}_TBps"], flush=True)
    if "--sweep" in sys.argv:
        out["sweep"] = sweep(x, w)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def sweep(x, w):
    """The head read with each kernel tiling: column slab BN, warps, pipeline stages (K step 128, no K split)."""
    rows = []
    for name, (q, s) in [("int8", quantize_rows(w)), ("int4", quantize_rows_int4(w))]:
        for bn in (32, 64, 128, 256):
            for nw in (4, 8):
                for st in (3, 4, 6):
                    kw = dict(transpose_w=True, out_dtype="float32", block_n=bn, block_k=128, splits=1,
                              num_warps=nw, num_stages=st)
                    f = jax.jit(lambda x, q, kw=kw: skinny_matmul_triton(x, q, **kw))
                    row = {"w": name, "bn": bn, "warps": nw, "stages": st}
                    try:
                        t = best_time(f, x, q, reps=100)
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile is recorded
                        rows.append({**row, "error": str(e)[:200]})
                        continue
                    rows.append({**row, "us": t * 1e6, "TBps": q.size * q.dtype.itemsize / t / 1e12})
                    print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "int4_draft_head.json"))
