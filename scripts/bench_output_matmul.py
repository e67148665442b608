#!/usr/bin/env python
"""A block's output product (o_proj, out_proj, down_proj with its SwiGLU; W stored ``[N, K]``) at 2-16 rows: XLA
(what the engine runs there: a split-K product, a kernel summing the partials, the SwiGLU a kernel of its own)
against the tensor-core kernel with one split, the SwiGLU folded in and the rows masked
(``skinny_matmul_triton(..., swiglu=, mask_rows=True)``), its default tiling (``output_plan``) and a sweep.

    python scripts/bench_output_matmul.py --models qwen3.5-4b --rows 2,4,8,16 --out output_matmul.json

Device time per call (``devtime.device_seconds``: kernel intervals of 20 chained calls, weights rotating over
copies so they come from HBM; the ~1 us chain op included) and the kernel's largest error against XLA's output.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from devtime import device_seconds  # noqa: E402
from jaxmtp import shapes  # noqa: E402
from jaxmtp.pallas.matmul import matmul_reference, swiglu_reference  # noqa: E402
from jaxmtp.pallas.matmul.skinny_triton import output_plan, skinny_matmul_triton  # noqa: E402


def products(cfg):
    """(name, K, N, swiglu) of the model's block output products."""
    out = [("down_proj", cfg.intermediate_size, cfg.hidden_size, True)]
    out.append(("out_proj", cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.hidden_size, False))
    out.append(("o_proj", cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-4b")
    ap.add_argument("--rows", default="2,4,8,16")
    ap.add_argument("--sweep", default="16,32/128,256,512/4/3,4,6",
                    help="BN values/BK values/warps/stages, ','-separated each ('' for the default plan only)")
    ap.add_argument("--out", default="output_matmul.json")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    res = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "rows": []}
    key = jax.random.PRNGKey(0)
    chain = lambda a, y: (a[0] + y[:, :1].astype(a[0].dtype), a[1])  # noqa: E731
    grid = [tuple(map(int, part.split(","))) for part in args.sweep.split("/")] if args.sweep else None
    for name in args.models.split(","):
        cfg = shapes.config(name)
        for prod, k, n, swiglu in products(cfg):
            w = (jax.random.normal(key, (n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            for m in map(int, args.rows.split(",")):
                x = jax.random.normal(jax.random.fold_in(key, m), (m, 2 * k if swiglu else k), jnp.bfloat16)

                def xla(x, w, k=k, swiglu=swiglu):
                    return matmul_reference(swiglu_reference(x, k) if swiglu else x, w, transpose_w=True)

                def kernel(x, w, swiglu=swiglu, **kw):
                    return skinny_matmul_triton(x, w, transpose_w=True, swiglu=swiglu, mask_rows=True, **kw)

                want = np.asarray(jax.jit(xla)(x, w), np.float32)
                row = {"model": name, "product": prod, "k": k, "n": n, "swiglu": swiglu, "rows": m,
                       "weight_mb": n * k * 2 / 1e6, "xla_us": device_seconds(xla, x, w, chain=chain) * 1e6}
                bn, bk, nw, ns = output_plan(k, n)
                plan_kw = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                got = np.asarray(jax.jit(lambda x, w: kernel(x, w, **plan_kw))(x, w), np.float32)
                row["max_abs_err"] = float(np.max(np.abs(got - want)))
                row["max_abs_ref"] = float(np.max(np.abs(want)))
                row["kernel_us"] = device_seconds(lambda x, w: kernel(x, w, **plan_kw), x, w, chain=chain) * 1e6
                row["plan"] = [bn, bk, nw, ns]
                if grid:
                    sweep = []
                    for bn_, bk_, nw_, ns_ in itertools.product(*grid):
                        if n % bn_ or k % bk_:
                            continue
                        kw = dict(block_n=bn_, block_k=bk_, num_warps=nw_, num_stages=ns_)
                        try:
                            us = device_seconds(lambda x, w, kw=kw: kernel(x, w, **kw), x, w, chain=chain) * 1e6
                        except Exception as e:  # noqa: BLE001 - e.g. shared memory exceeded: record and go on
                            us = None
                            print("  ", kw, type(e).__name__, str(e)[:120], flush=True)
                        sweep.append({"tiles": [bn_, bk_, nw_, ns_], "us": us})
                    row["sweep"] = sweep
                    best = min((s for s in sweep if s["us"]), key=lambda s: s["us"])
                    row["best"] = best
                res["rows"].append(row)
                print(f"{name} {prod:9s} K={k:5d} N={n:5d} rows={m:2d}: XLA {row['xla_us']:6.2f} us, kernel "
                      f"{row['kernel_us']:6.2f} us (plan {row['plan']})"
                      + (f", best {row['best']['us']:6.2f} us {row['best']['tiles']}" if grid else "")
                      + f", max err {row['max_abs_err']:.3g} of {row['max_abs_ref']:.3g}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
