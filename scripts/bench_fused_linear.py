#!/usr/bin/env python
"""The fused few-row projections (norm -> product, product -> + residual) against XLA's unfused ops, and a tile sweep.

    python scripts/bench_fused_linear.py --out fused.json [--models 4b,27b] [--rows 1,4,16] [--sweep]
    python scripts/bench_fused_linear.py --smoke     # tiny shapes in interpret mode: checks the script on a CPU

For each block product of a model shape (GDN in_proj after the input norm, the SwiGLU gate|up after the post-mixer
norm, the GDN out_proj with its gated RMSNorm and the residual, the MLP down_proj with the residual) and each row
count: the kernel's error against a float64 evaluation, its device time with the dispatcher's tiles and XLA's time
for the same unfused ops (norm, product, SwiGLU, add: several kernels), and the bandwidth of reading W once.
Device time is the union of kernel intervals (scripts/devtime.py): the launch gaps that the fusion also removes
are not in it; the end-to-end step (bench_decode.py) shows those.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from devtime import device_seconds  # noqa: E402
from jaxmtp import shapes  # noqa: E402
from jaxmtp.pallas.matmul import LINEAR_RESIDUAL_TILES, NORM_LINEAR_TILES, fused_triton  # noqa: E402
from jaxmtp.pallas.matmul.reference import linear_residual_reference, norm_linear_reference  # noqa: E402

MODELS = {"0.8b": "qwen3.5-0.8b", "4b": "qwen3.5-4b", "9b": "qwen3.5-9b", "27b": "qwen3.5-27b"}
EPS = 1e-6


def block_products(cfg):
    """(name, kind, K, N, extra) for the four products of a dense GDN block."""
    h, i, hv, dv = cfg.hidden_size, cfg.intermediate_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    proj = cfg.conv_dim + hv * dv + 2 * hv
    proj += (-proj) % 128
    return [("gdn in_proj", "norm", h, proj, {}), ("mlp gate|up + swiglu", "norm", h, 2 * i, {"swiglu_width": i}),
            ("gdn out_proj + gated norm", "residual", hv * dv, h, {"prologue": "gated_rms", "head_dim": dv}),
            ("mlp down", "residual", i, h, {"prologue": "none"})]


def chain_first(a, out):
    return (a[0] + (out[..., :1] * 1e-3).astype(a[0].dtype), *a[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="4b,27b")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles at the first row count")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=400)
    ap.add_argument("--out", default="bench_fused_linear.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    dev = jax.devices()[0]
    res = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "norm_linear_tiles": NORM_LINEAR_TILES,
           "linear_residual_tiles": LINEAR_RESIDUAL_TILES, "rows": []}
    interp = {"interpret": True} if args.smoke else {}
    rows = [int(r) for r in args.rows.split(",")]
    todo = []
    for m in args.models.split(","):
        if args.smoke:
            cfg = shapes.config("qwen3.5-0.8b", hidden_size=128, intermediate_size=256, linear_num_value_heads=2,
                                linear_num_key_heads=2, linear_value_head_dim=64, linear_key_head_dim=64)
        else:
            cfg = shapes.config(MODELS[m])
        todo += [(m, *p) for p in block_products(cfg)]

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for (model, name, kind, k, n, extra), m in itertools.product(todo, rows):
        if time.time() - t0 > args.max_seconds:
            res["stopped"] = "time limit"
            break
        key = jax.random.PRNGKey(k + 7 * n + m)
        ks = jax.random.split(key, 5)
        x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
        if kind == "norm":
            w = (jax.random.normal(ks[1], (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
            nw = 0.1 * jax.random.normal(ks[2], (k,), jnp.float32)
            args_ = (x, nw, w)
            ref = jax.jit(lambda a, b, c: norm_linear_reference(a, b, c, eps=EPS, **extra))

            def kern(a, b, c, **t):
                return fused_triton.norm_linear_triton(a, b, c, eps=EPS, **extra, **t, **interp)
            tiles = dict(NORM_LINEAR_TILES)
            grid = [dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=st)
                    for (bn, bk), (wp, st) in itertools.product(((64, 128), (128, 128), (64, 256), (32, 256),
                                                                 (128, 64)), ((4, 3), (4, 4), (4, 5), (8, 4)))]
        else:
            w = (jax.random.normal(ks[1], (n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
            res_in = jax.random.normal(ks[3], (m, n), jnp.float32).astype(jnp.bfloat16)
            aux = ()
            if extra["prologue"] == "gated_rms":
                aux = (jax.random.normal(ks[4], (m, k + 64), jnp.float32).astype(jnp.bfloat16),
                       1.0 + 0.1 * jax.random.normal(ks[2], (extra["head_dim"],), jnp.float32))
            args_ = (x, w, res_in, *aux)
            kw = dict(extra, aux_offset=32 if aux else 0, eps=EPS)
            ref = jax.jit(lambda a, b, c, *au: linear_residual_reference(a, b, c, tuple(au), **kw))
            sub = extra.get("head_dim") if extra["prologue"] == "gated_rms" else 128

            def kern(a, b, c, *au, **t):
                return fused_triton.linear_residual_triton(a, b, c, tuple(au), sub_k=sub, **kw, **t, **interp)
            tiles = dict(LINEAR_RESIDUAL_TILES)
            grid = [dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=st)
                    for bn, bk, (wp, st) in itertools.product((16, 32), (256, 512, 1024),
                                                              ((4, 2), (4, 3), (4, 4), (8, 3)))]
        if k % tiles["block_k"]:
            tiles["block_k"] = max(b for b in (128, 256, 512) if k % b == 0)
        got = kern(*args_, **tiles)
        with jax.default_matmul_precision("highest"):
            f32 = jax.tree.map(lambda a: a.astype(jnp.float32), args_)
            truth = np.asarray(ref(*f32), np.float64)
        err = float(np.linalg.norm(np.asarray(got, np.float64) - truth) / np.linalg.norm(truth))
        xla_err = float(np.linalg.norm(np.asarray(ref(*args_), np.float64) - truth) / np.linalg.norm(truth))
        nbytes = w.size * 2
        row = {"model": model, "op": name, "k": k, "n": n, "rows": m, "tiles": tiles, "rel_err": err,
               "xla_rel_err": xla_err, "weight_bytes": nbytes,
               "xla_s": device_seconds(ref, *args_, chain=chain_first),
               "kernel_s": device_seconds(lambda *a: kern(*a, **tiles), *args_, chain=chain_first)}
        row["xla_gb_per_s"] = nbytes / row["xla_s"] / 1e9
        row["kernel_gb_per_s"] = nbytes / row["kernel_s"] / 1e9
        if args.sweep and m == rows[0] and not args.smoke:
            row["sweep"] = []
            for t in grid:
                if k % t["block_k"] or (kind == "norm" and (extra.get("swiglu_width") or n) % t["block_n"]):
                    continue
                try:
                    sec = device_seconds(lambda *a, t=t: kern(*a, **t), *args_, chain=chain_first)
                    row["sweep"].append({**t, "s": sec, "gb_per_s": nbytes / sec / 1e9})
                except Exception as e:  # noqa: BLE001 - a tiling Triton rejects
                    row["sweep"].append({**t, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            row["best"] = min((r for r in row["sweep"] if "s" in r), key=lambda r: r["s"], default=None)
        res["rows"].append(row)
        save()
        print(f"{model:5s} {name:26s} M={m:3d} err {err:.1e} (xla {xla_err:.1e})  xla {row['xla_s'] * 1e6:7.1f} us "
              f"({row['xla_gb_per_s']:.0f} GB/s)  kernel {row['kernel_s'] * 1e6:7.1f} us "
              f"({row['kernel_gb_per_s']:.0f} GB/s)" + (f"  best {row['best']}" if row.get("best") else ""),
              flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
