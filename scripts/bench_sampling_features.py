#!/usr/bin/env python
"""What the logits processing and log-probabilities cost: the step loops of one engine, greedy only, with sampling,
and with the features (penalties, logit bias, min_p, min_tokens, logprobs; ``spec_step(features=True)``), timed in
alternating rounds in one process. Random weights of released shapes, every slot busy (synthetic state).

    python scripts/bench_sampling_features.py --model qwen3.5-0.8b,qwen3.5-4b -k 0,3 --batch 1 --out features.json

The feature loop's cost does not depend on the settings' values (one fixed-shape step for all), so neutral
settings time it. Whether the greedy loop is as fast as before the features existed is an A/B across trees
(another process per tree), not this script.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import shapes
from jaxmtp.benchmarking import (PUBLISHED_AL, random_model, run_metadata, synthetic_engine, timed_loops,
                                 tiny_config, write_json)
from jaxmtp.engine.warmup import FEATURES

MODES = {"greedy": False, "sampling": True, "features": FEATURES}


def measure(model, batch: int, k: int, args) -> list[dict]:
    eng = synthetic_engine(model, batch, k, args.context, 16, args.steps_per_sync)
    loops = {name: eng._loops[eng.num_slots, mode] for name, mode in MODES.items()}
    for fn in loops.values():  # compile and warm each
        eng.state, out = fn(model.params, eng.state)
        jax.block_until_ready(out)
    times = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, fn in loops.items():
            ts = [dt for dt, _ in timed_loops(eng, model.params, args.syncs, fn)]
            times[name].append(float(np.median(ts)) / eng.steps_per_sync * 1e3)
    base = float(np.median(times["greedy"]))
    return [{"batch": batch, "k": k, "loop": name, "step_ms": float(np.median(ts)), "rounds_ms": ts,
             "ratio_to_greedy": float(np.median(ts)) / base,
             "tokens_per_s_published_al": batch * PUBLISHED_AL[k] / float(np.median(ts)) * 1e3}
            for name, ts in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b,qwen3.5-4b", help="released shapes (jaxmtp.shapes), comma-separated")
    ap.add_argument("--tiny", action="store_true", help="the shapes' layout at width 64 (CPU smoke runs)")
    ap.add_argument("-k", default="0,3")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--steps-per-sync", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.model.split(","):
        cfg = tiny_config(name) if args.tiny else shapes.config(name)
        model = random_model(cfg, jnp.float32 if args.tiny else jnp.bfloat16, args.backend)
        for b in (int(x) for x in args.batch.split(",")):
            for k in (int(x) for x in args.k.split(",")):
                for r in measure(model, b, k, args):
                    rows.append({"model": name, **r})
                    print(f"{name} b{b} k{k} {r['loop']:9s} {r['step_ms']:8.3f} ms  x{r['ratio_to_greedy']:.3f}",
                          flush=True)
        del model
    if args.out:
        write_json(args.out, {"meta": run_metadata(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
