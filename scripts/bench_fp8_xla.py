#!/usr/bin/env python
"""The block-FP8 product kernel against XLA's own product of the widened weight, at Qwen3.5-27B shapes.

    python scripts/bench_fp8_xla.py --out fp8_xla.json

Per (rows, product): the kernel (:func:`jaxmtp.pallas.matmul.fp8_triton.fp8_matmul_triton`); XLA's product of the
e4m3 weight widened and scaled by its 128 x 128 block scales inside the jitted function (scales as float32, or as
bfloat16), which XLA may fuse into its product; XLA's product of the widened weight without the scales (wrong
numbers: what the widening alone costs); and XLA's product of a bf16 weight of the same shape. ``--calls`` chained
calls in one jitted loop whose weights rotate over copies of at least 256 MiB (they stream from HBM), the median of
``--reps``; percentages of the measured copy bandwidth (read + write). Each variant's HLO is searched for a Triton
fusion and its output compared with the kernel's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmtp.benchmarking import chained_product_seconds, hbm_bandwidth, run_metadata, write_json  # noqa: E402
from jaxmtp.pallas.matmul.fp8_triton import fp8_matmul_triton  # noqa: E402
from jaxmtp.pallas.matmul.reference import FP8_BLOCK, FP8_DTYPE  # noqa: E402

SHAPES = {"gate_up": (5120, 34816), "down": (17408, 5120), "in_proj": (5120, 16384), "out": (6144, 5120)}


def _block_scales(s, n, k, dtype):
    return jnp.repeat(jnp.repeat(s.astype(dtype), FP8_BLOCK, axis=0)[:n], FP8_BLOCK, axis=1)[:, :k]


def xla_scaled(x, w, s):
    n, k = w.shape
    wd = (w.astype(jnp.float32) * _block_scales(s, n, k, jnp.float32)).astype(jnp.bfloat16)
    return jnp.einsum("mk,nk->mn", x, wd, preferred_element_type=jnp.float32)


def xla_scaled_bf16(x, w, s):
    n, k = w.shape
    return jnp.einsum("mk,nk->mn", x, w.astype(jnp.bfloat16) * _block_scales(s, n, k, jnp.bfloat16),
                      preferred_element_type=jnp.float32)


def xla_widened(x, w, s):
    return jnp.einsum("mk,nk->mn", x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def xla_bf16(x, w, s):
    return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)


VARIANTS = {"kernel": fp8_matmul_triton, "xla_scaled": xla_scaled, "xla_scaled_bf16": xla_scaled_bf16,
            "xla_widened_only": xla_widened}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="fp8_xla.json")
    args = ap.parse_args(argv)
    bw = hbm_bandwidth()
    out = {**run_metadata(), "copy_GBps": bw / 1e9, "rows": []}
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    for m in map(int, args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            copies = max(2, (256 << 20) // (n * k) + 1)
            ws = [(jax.random.normal(jax.random.key(i), (n, k), jnp.float32).astype(FP8_DTYPE),
                   jax.random.uniform(jax.random.key(100 + i), (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)),
                                      jnp.float32, 0.5, 2.0) / 64) for i in range(copies)]
            x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
            ref = np.asarray(fp8_matmul_triton(x, *ws[0]), np.float32)
            for variant, fn in VARIANTS.items():
                sec = chained_product_seconds(fn, x, ws, args.calls, args.reps)
                y = np.asarray(fn(x, *ws[0]), np.float32)
                row = dict(rows=m, shape=name, variant=variant, us=sec * 1e6, pct=100 * n * k / sec / bw,
                           triton_fusion="triton" in jax.jit(fn).lower(x, *ws[0]).compile().as_text().lower(),
                           rel_err_vs_kernel=float(np.abs(y - ref).max() / np.abs(ref).max()))
                print(row, flush=True)
                out["rows"].append(row)
            del ws
            wb = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16)
                  for i in range(max(2, (256 << 20) // (2 * n * k) + 1))]
            sec = chained_product_seconds(lambda x, w: xla_bf16(x, w, None), x, [(w,) for w in wb], args.calls,
                                          args.reps)
            row = dict(rows=m, shape=name, variant="xla_bf16_weight", us=sec * 1e6, pct=100 * 2 * n * k / sec / bw)
            print(row, flush=True)
            out["rows"].append(row)
            del wb
            write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
