#!/usr/bin/env python
"""Engine warm-up time against the number of compile threads, and the step time after it.

    python scripts/bench_warmup.py --model qwen3.5-4b --slots 8 --k 3 --threads 1 --out warmup.json

Builds a random bf16 model of a released shape and an engine (slot buckets on: every width's greedy and sampling
loops, every prefill bucket), times ``Engine.warmup(compile_threads=...)``, then fills every slot with a synthetic
request (``bench_decode.fill_synthetic``) and times the full-width step loop, so that a warm-up whose parallel
compiles autotuned worse kernels would show. Run each thread count in its own process (compiled executables are
cached per process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode import fill_synthetic, random_model, timed_loops  # noqa: E402
from bench_step_loop import tiny_config  # noqa: E402
from jaxmtp import shapes  # noqa: E402
from jaxmtp.engine import Engine  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-4b")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="Engine.warmup(compile_threads=)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--syncs", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke test of the script)")
    ap.add_argument("--out", default="warmup.json")
    args = ap.parse_args(argv)
    model = random_model(tiny_config(args.model) if args.tiny else shapes.config(args.model), jnp.bfloat16, "auto")
    steps = 8
    eng = Engine(model, num_slots=args.slots, max_context=args.context + steps * (args.syncs + 2) * (args.k + 1) + 16,
                 num_draft_tokens=args.k, steps_per_sync=steps, check_memory=False)
    warm_s = eng.warmup(compile_threads=args.threads)
    fill_synthetic(eng, args.context, 7)
    times = [dt for dt, _ in timed_loops(eng, model.params, args.syncs)]
    dev = jax.devices()[0]
    res = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "model": args.model, "slots": args.slots,
           "k": args.k, "threads": args.threads, "loops": len(eng._loops), "warmup_s": warm_s,
           "step_ms": float(np.median(times[1:])) / steps * 1e3, "cpu_count": os.cpu_count()}
    print(json.dumps(res), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
