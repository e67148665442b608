#!/usr/bin/env python
"""Prefill temporaries against the memory plan: the figure the plan takes after a background warm-up (the one-row
prefill of the whole chunk compiled, the other shapes estimated from it), against XLA's temporaries of each prefill
shape compiled on its own (``Compiled.memory_analysis()``).

    python scripts/bench_prefill_memory.py --models qwen3.5-4b --out prefill_memory.json [--slots 8 --context 8192]

Random bf16 weights of the released shapes (``--tiny``: the same layout at width 64, for a CPU smoke run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax.numpy as jnp  # noqa: E402

from jaxmtp import shapes  # noqa: E402
from jaxmtp.benchmarking import random_model, run_metadata, tiny_config, write_json  # noqa: E402
from jaxmtp.engine import Engine  # noqa: E402
from jaxmtp.engine.warmup import prefill_args, temp_bytes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-4b")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--shapes", default="1x256,1x1024,2x1024,4x256,8x256", help="rows x chunk, comma-separated")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="prefill_memory.json")
    args = ap.parse_args(argv)
    result = {**run_metadata(), "models": {}}
    for name in args.models.split(","):
        cfg = tiny_config(name) if args.tiny else shapes.config(name)
        model = random_model(cfg, jnp.float32 if args.tiny else jnp.bfloat16)
        eng = Engine(model, num_slots=args.slots, max_context=args.context, num_draft_tokens=args.k)
        t = time.perf_counter()
        eng.warmup(background=True)
        eng.stop_background_compiles()
        entry = {"prefill_chunk": eng.prefill_chunk, "max_prefill_tokens": eng.max_prefill_tokens,
                 "max_prefill_batch": eng.max_prefill_batch, "warmup_s": time.perf_counter() - t,
                 "plan_prefill_activations": eng.plan.prefill_activations,
                 "persistent_per_slot": eng.plan.persistent_per_slot, "plan_table": eng.plan.table(), "temp": {}}
        for shape in args.shapes.split(","):
            rows, chunk = map(int, shape.split("x"))
            args = prefill_args(rows, chunk, eng.num_slots)()
            compiled = eng._prefill.lower(model.params, eng.state, *args).compile()
            entry["temp"][shape] = temp_bytes(compiled)
            print(f"{name} prefill {shape}: {entry['temp'][shape] / 2**20:.1f} MiB of temporaries", flush=True)
        print(f"{name}: the plan after a background warm-up takes {eng.plan.prefill_activations / 2**20:.1f} MiB",
              flush=True)
        result["models"][name] = entry
        write_json(args.out, result)
        del eng, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
