#!/usr/bin/env python
"""The engine's step loop against its control flow, timed with every slot busy, variants alternating in one process:
the per-step conditional that skips steps with no busy slot (``skip_idle``), ``lax.scan`` unrolling (``unroll``)
and the sampling conditional (``sampling=0`` compiles greedy choice only, what the engine runs when no busy slot
samples) and ``steps`` (steps per device loop, i.e. per host read; the engine's ``steps_per_sync``, default 8).

    python scripts/bench_step_loop.py --models qwen3.5-4b --grid "1:0;1:3" --out step_loop.json

A conditional's predicate is read by the host (GPU command buffers end at it), so the host cannot queue what follows
before the kernels ahead of it end; this measures what each costs (docs/performance.md, runs 5 and 14).
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
import numpy as np  # noqa: E402

from bench_decode import alternating_step_ms, random_model, synthetic_engine, timed_loops  # noqa: E402
from jaxmtp import shapes  # noqa: E402
from jaxmtp.engine import steps  # noqa: E402

VARIANTS = ("sampling=1,skip_idle=1", "sampling=0,skip_idle=1", "sampling=0,skip_idle=0", "sampling=1,skip_idle=0")
STEPS_PER_SYNC = 8


def tiny_config(name: str):
    """``name``'s first four layers at width 64 (CPU smoke tests of the step-loop scripts)."""
    full = shapes.config(name)
    return shapes.config(name, num_hidden_layers=4, layer_types=full.layer_types[:4], hidden_size=64,
                         intermediate_size=128, vocab_size=512, head_dim=32, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         num_attention_heads=4, num_key_value_heads=2, moe_layers=full.moe_layers[:4])


def parse_variant(variant: str) -> dict:
    """"a=1,b=0" -> {"a": 1, "b": 0}."""
    return {a: int(b) for a, b in (x.split("=") for x in variant.split(",") if x)}


def loop_variant(eng, model, variant: str):
    """The full-width loop of ``eng`` compiled with the ``run_steps`` keywords of ``variant`` (all but ``steps``)."""
    kw = {a: bool(v) if a in ("sampling", "skip_idle") else v for a, v in parse_variant(variant).items()
          if a != "steps"}
    return jax.jit(functools.partial(steps.run_steps, cfg=model.config, k=eng.k, num_steps=eng.steps_per_sync,
                                     backend=model.backend, **kw), donate_argnums=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-4b")
    ap.add_argument("--grid", default="1:0;1:3", help="batch:k pairs")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="run_steps keyword sets, ';'-separated")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (each times every variant)")
    ap.add_argument("--syncs", type=int, default=5, help="device loops per variant and round (median taken)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke test of the script)")
    ap.add_argument("--out", default="step_loop.json")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    out = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "command": " ".join(sys.argv),
           "runs": []}
    variants = args.variants.split(";")
    for name in args.models.split(","):
        model = random_model(tiny_config(name) if args.tiny else shapes.config(name), jax.numpy.bfloat16, "auto")
        for pair in args.grid.split(";"):
            b, k = map(int, pair.split(":"))
            runs = []
            for variant in variants:
                steps = parse_variant(variant).get("steps", STEPS_PER_SYNC)
                room = steps * (args.rounds * args.syncs + 2) * (k + 1) + 16
                eng = synthetic_engine(model, b, k, args.context, room, steps)
                eng.device_loop = lambda *_, f=loop_variant(eng, model, variant): f  # noqa: E731
                timed_loops(eng, model.params, 1)  # compile
                runs.append(eng)
            times = alternating_step_ms(runs, model.params, args.rounds, args.syncs)
            for variant, ts in zip(variants, times):
                r = {"model": name, "variant": variant, "batch": b, "k": k, "round_step_ms": ts,
                     "step_ms": float(np.median(ts))}
                out["runs"].append(r)
                print(f"{name} {variant:26s} B={b:3d} k={k}: {r['step_ms']:.3f} ms "
                      f"(rounds {min(ts):.3f}-{max(ts):.3f})", flush=True)
            del runs
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
