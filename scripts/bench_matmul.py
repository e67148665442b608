#!/usr/bin/env python
"""Few-row projections (decode, verify) at Qwen3.5 shapes: the skinny-matmul kernel against XLA's ``x @ W``.

    python scripts/bench_matmul.py --out matmul.json [--sweep] [--rows 1,4,16,64]
    python scripts/bench_matmul.py --smoke     # tiny shapes in interpret mode: checks the script on a CPU

For every weight of the 0.8B, 4B and 27B shapes (MLP gate/up and down, GDN in_proj_qkv and out_proj, attention
q_proj and o_proj, the tied LM head read as ``[V, H]``) and every row count: the kernel's error against a float64
product, its time with the default tiling, XLA's time for the same product, and the bandwidth of reading W once.
``--sweep`` also times a grid of tilings (the data behind ``skinny_triton.plan``) at 1 row. Times are device kernel time from a profiler trace (scripts/devtime.py).
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
from jaxmtp.pallas.matmul import matmul_reference, skinny_matmul_triton  # noqa: E402
from jaxmtp.pallas.matmul.skinny_triton import plan  # noqa: E402

# (model, weight, K, N, transpose_w): [K, N] stored as x @ W, or [N, K] read transposed (tied LM head)
SHAPES = [
    ("0.8b", "mlp gate/up", 1024, 3584, False), ("0.8b", "mlp down", 3584, 1024, False),
    ("0.8b", "gdn in_proj_qkv", 1024, 6144, False), ("0.8b", "gdn out_proj", 2048, 1024, False),
    ("0.8b", "lm_head (tied)", 1024, 248320, True),
    ("4b", "mlp gate/up", 2560, 9216, False), ("4b", "mlp down", 9216, 2560, False),
    ("4b", "gdn in_proj_qkv", 2560, 8192, False), ("4b", "gdn out_proj", 4096, 2560, False),
    ("4b", "lm_head (tied)", 2560, 248320, True),
    ("27b", "mlp gate/up", 5120, 17408, False), ("27b", "mlp down", 17408, 5120, False),
    ("27b", "gdn in_proj_qkv", 5120, 10240, False), ("27b", "attn q_proj", 5120, 12288, False),
]
SMOKE = [("tiny", "w", 128, 96, False), ("tiny", "w^T", 192, 64, True)]


def chain_rows(a, out):
    """The output feeds the next call's x (a true dependency; x keeps its shape)."""
    return (a[0] + (out[..., :1] * 1e-3).astype(a[0].dtype), *a[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--models", default="0.8b,4b,27b")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=540)
    ap.add_argument("--draft-head", action="store_true",
                    help="only the LM head: bfloat16 (XLA, kernel) against the int8 draft head (kernel, XLA)")
    ap.add_argument("--out", default="bench_matmul.json")
    args = ap.parse_args(argv)
    if args.draft_head:
        return draft_head_main(args)
    t_start = time.time()
    dev = jax.devices()[0]
    res = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "rows": []}
    kw = {"interpret": True} if args.smoke else {}
    models = set(args.models.split(","))
    shapes = SMOKE if args.smoke else [s for s in SHAPES if s[0] in models]
    rows = [int(r) for r in args.rows.split(",")]

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for (model, name, k, n, tw), m in itertools.product(shapes, rows):
        if time.time() - t_start > args.max_seconds:
            res["stopped"] = "time limit"
            break
        key = jax.random.PRNGKey(k * 7 + n + m)
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (n, k) if tw else (k, n), jnp.float32) * k**-0.5)
        w = w.astype(jnp.bfloat16)
        out_dtype = jnp.float32 if tw else jnp.bfloat16
        want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64).T if tw else np.asarray(w, np.float64))
        got = skinny_matmul_triton(x, w, transpose_w=tw, out_dtype=out_dtype, **kw)
        err = float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))
        nbytes = w.size * 2
        row = {"model": model, "weight": name, "k": k, "n": n, "rows": m, "transpose_w": tw, "rel_err": err,
               "plan": plan(m, k, n), "weight_bytes": nbytes}
        ref = jax.jit(lambda a, b: matmul_reference(a, b, transpose_w=tw, out_dtype=out_dtype))
        row["xla_s"] = device_seconds(ref, x, w, chain=chain_rows)
        row["kernel_s"] = device_seconds(lambda a, b: skinny_matmul_triton(a, b, transpose_w=tw, out_dtype=out_dtype,
                                                                     **kw), x, w, chain=chain_rows)
        row["xla_gb_per_s"] = nbytes / row["xla_s"] / 1e9
        row["kernel_gb_per_s"] = nbytes / row["kernel_s"] / 1e9
        if args.sweep and m == 1:
            row["sweep"] = []
            mp, bn0, bk0, s0 = plan(m, k, n)
            for bn, bk, sp, warps, stages in itertools.product((64, 128), (128, 256), (1, 2, 4, 8),
                                                                (4, 8), (3, 5)):
                if n % bn or k % (bk * sp) or (k // (bk * sp)) < 1:
                    continue
                if (warps, stages) != (4, 3) and (bn, bk) != (bn0, bk0):
                    continue
                try:
                    sec = device_seconds(lambda a, b: skinny_matmul_triton(
                        a, b, transpose_w=tw, out_dtype=out_dtype, block_n=bn, block_k=bk, splits=sp,
                        num_warps=warps, num_stages=stages, **kw), x, w, chain=chain_rows)
                    row["sweep"].append({"bn": bn, "bk": bk, "splits": sp, "warps": warps, "stages": stages,
                                         "s": sec, "gb_per_s": nbytes / sec / 1e9})
                except Exception as e:  # noqa: BLE001 - a tiling Triton rejects
                    row["sweep"].append({"bn": bn, "bk": bk, "splits": sp, "warps": warps, "stages": stages,
                                         "error": f"{type(e).__name__}: {str(e)[:120]}"})
            best = min((r for r in row["sweep"] if "s" in r), key=lambda r: r["s"], default=None)
            row["best"] = best
        res["rows"].append(row)
        save()
        print(f"{model:5s} {name:16s} M={m:3d} err {err:.1e}  xla {row['xla_s'] * 1e6:8.1f} us "
              f"({row['xla_gb_per_s']:.0f} GB/s)  kernel {row['kernel_s'] * 1e6:8.1f} us "
              f"({row['kernel_gb_per_s']:.0f} GB/s)"
              + (f"  best {row['best']}" if row.get("best") else ""), flush=True)
    save()
    return 0


def draft_head_main(args) -> int:
    """The draft head's product (``quantized_linear``) at the tied-head shapes, against the bfloat16 head."""
    from jaxmtp.pallas.matmul import quantized_linear, quantized_matmul_reference
    from jaxmtp.param_layout import quantize_rows

    dev = jax.devices()[0]
    res = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "draft_head": []}
    kw = {"implementation": "triton_interpret" if args.smoke else "triton"}
    hidden = {"0.8b": 1024, "4b": 2560, "27b": 5120}
    vocab = 256 if args.smoke else 248320
    for model in args.models.split(","):
        h = 128 if args.smoke else hidden[model]
        key = jax.random.PRNGKey(h)
        w = (jax.random.normal(key, (vocab, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
        q, scale = quantize_rows(w)
        for m in [int(r) for r in args.rows.split(",")]:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, h), jnp.bfloat16)
            want = np.asarray(quantized_matmul_reference(x.astype(jnp.float32), q, scale), np.float64)
            got = np.asarray(quantized_linear(x, q, scale, **kw), np.float64)
            row = {"model": model, "rows": m, "vocab": vocab, "hidden": h,
                   "rel_err": float(np.abs(got - want).max() / np.abs(want).max()),
                   "bf16_bytes": w.size * 2, "int8_bytes": q.size + scale.size * 4}
            bf16 = jax.jit(lambda a, b: matmul_reference(a, b, transpose_w=True, out_dtype=jnp.float32))
            row["bf16_xla_s"] = device_seconds(bf16, x, w, chain=chain_rows)
            row["bf16_kernel_s"] = device_seconds(
                lambda a, b: skinny_matmul_triton(a, b, transpose_w=True, out_dtype=jnp.float32,
                                                  interpret=args.smoke), x, w, chain=chain_rows)
            row["int8_kernel_s"] = device_seconds(lambda a, b, c: quantized_linear(a, b, c, **kw), x, q, scale,
                                                  chain=chain_rows)
            row["int8_xla_s"] = device_seconds(jax.jit(quantized_matmul_reference), x, q, scale, chain=chain_rows)
            row["int8_gb_per_s"] = row["int8_bytes"] / row["int8_kernel_s"] / 1e9
            row["speedup_vs_best_bf16"] = min(row["bf16_xla_s"], row["bf16_kernel_s"]) / row["int8_kernel_s"]
            res["draft_head"].append(row)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
            print(f"{model:5s} M={m:3d} err {row['rel_err']:.1e}  bf16 xla {row['bf16_xla_s'] * 1e6:7.1f} us  "
                  f"bf16 kernel {row['bf16_kernel_s'] * 1e6:7.1f}  int8 kernel {row['int8_kernel_s'] * 1e6:7.1f} "
                  f"({row['int8_gb_per_s']:.0f} GB/s)  int8 xla {row['int8_xla_s'] * 1e6:7.1f}  "
                  f"x{row['speedup_vs_best_bf16']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
