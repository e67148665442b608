#!/usr/bin/env python
"""The engine's step loop against its control flow: a conditional per step (skip steps with no busy slot) and
``lax.scan`` unrolling, timed with every slot busy (``bench_decode.bench_steps``).

    python scripts/bench_step_loop.py --models qwen3.5-4b --out step_loop.json

Each step of the device loop ends with a host-visible predicate (the conditional, the loop's own condition), so the
host cannot queue the next step's kernels before the current one ends; this measures whether removing the
conditional or running several steps per iteration pays (docs/performance.md, "Run 5").
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from bench_decode import bench_steps, hbm_bandwidth, random_model  # noqa: E402
from jaxmtp import shapes  # noqa: E402
from jaxmtp.engine import device  # noqa: E402

VARIANTS = ("skip_idle=1,unroll=1", "skip_idle=0,unroll=1", "skip_idle=0,unroll=2", "skip_idle=0,unroll=8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-4b")
    ap.add_argument("--grid", default="1:0;1:3;32:0", help="batch:k pairs")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="run_steps keyword sets, ';'-separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke test of the script)")
    ap.add_argument("--out", default="step_loop.json")
    args = ap.parse_args(argv)
    real = device.run_steps
    dev = jax.devices()[0]
    out = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "runs": []}
    bw = hbm_bandwidth()
    for name in args.models.split(","):
        full = shapes.config(name)
        over = dict(num_hidden_layers=4, layer_types=full.layer_types[:4], hidden_size=64, intermediate_size=128,
                    vocab_size=512, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                    num_key_value_heads=2, moe_layers=full.moe_layers[:4]) if args.tiny else {}
        model = random_model(shapes.config(name, **over), jax.numpy.bfloat16, "auto")
        for variant in args.variants.split(";"):
            kw = {a: int(b) for a, b in (x.split("=") for x in variant.split(","))}
            device.run_steps = functools.partial(real, **kw)
            try:
                for pair in args.grid.split(";"):
                    b, k = map(int, pair.split(":"))
                    r = bench_steps(model, b, k, args.context, 4, 8, bw)
                    out["runs"].append({"model": name, "variant": variant, "batch": b, "k": k,
                                        "step_ms": r["step_ms"], "compile_s": r["compile_s"]})
                    print(f"{name} {variant:22s} B={b:3d} k={k}: {r['step_ms']:.3f} ms "
                          f"(compile {r['compile_s']:.1f} s)", flush=True)
                    with open(args.out, "w") as f:
                        json.dump(out, f, indent=1)
            finally:
                device.run_steps = real
    return 0


if __name__ == "__main__":
    sys.exit(main())
