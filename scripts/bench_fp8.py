#!/usr/bin/env python
"""Block-FP8 against bf16 at real Qwen3.5 shapes (random weights), one process: decode step times, tokens/s at the
published acceptance lengths, and each step against the memory roofline.

    python scripts/bench_fp8.py --models qwen3.5-27b --grid "1:0,3;32:0,3" --out fp8.json
    python scripts/bench_fp8.py --models qwen3.5-35b-a3b --grid "1:0,3" --fit 16:8192

Per model, the bf16 model is built and measured, freed, then the FP8 one (the linears the official FP8 checkpoints
quantise, drawn directly as block FP8: :func:`jaxmtp.model.init_params`): the two do not fit one 80 GB GPU side by
side at 27B, so the comparison is sequential within one process (same device, same compile cache, minutes apart).
For each (batch, k): step ms (median over ``--rounds`` rounds of ``--syncs`` device loops, the engines of one model
alternated; with three rounds or more the first is a warm-up and left out), tokens/s at ``PUBLISHED_AL[k]``, the
bytes the step must read (:func:`jaxmtp.benchmarking.step_bytes`, FP8 leaves at 1 byte plus their block scales)
over the measured bandwidth. Ratios: FP8 plain over bf16 plain tokens/s, FP8 k-step over FP8 plain step, FP8
tokens/s at the published AL over FP8 plain. ``--fit S:C`` also builds an engine of S slots x C tokens with the
memory check on (does it fit the device?) and, where it fits, times its k = 3 step with every slot near the end of
its context. ``--tiny``: CPU smoke run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmtp import shapes  # noqa: E402
from jaxmtp.benchmarking import (PUBLISHED_AL, CompileClock, alternating_step_ms, draft_head_bytes,  # noqa: E402
                                 fill_synthetic, hbm_bandwidth, mtp_bytes, random_model, run_metadata, step_bytes,
                                 synthetic_engine, timed_loops, tiny_config, write_json)
from jaxmtp.engine import Engine  # noqa: E402
from jaxmtp.fp8 import STANDARD  # noqa: E402
from jaxmtp.param_layout import weight_bytes  # noqa: E402


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``"1:0,3;32:0,3"`` -> [(1, 0), (1, 3), (32, 0), (32, 3)]."""
    out = []
    for part in filter(None, text.split(";")):
        b, ks = part.split(":")
        out += [(int(b), int(k)) for k in ks.split(",")]
    return out


def measure(cfg, quantization, args, bw: float) -> dict:
    clock = CompileClock()
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.dtype(args.dtype), quantization=quantization)
    entry = {"weights_bytes": weight_bytes(model.params), "init_s": time.perf_counter() - t0, "steps": []}
    grid = parse_grid(args.grid)
    engines = []
    for batch, k in grid:
        clock.reset()
        eng = synthetic_engine(model, batch, k, args.context, room=args.syncs * args.rounds * 8 * (k + 1) + 64,
                               steps_per_sync=args.steps_per_sync)
        eng.state, out = eng.device_loop()(model.params, eng.state)  # compile + warm (the state is donated)
        jax.block_until_ready(out)
        engines.append((batch, k, eng, clock.seconds))
    times = alternating_step_ms([e for _, _, e, _ in engines], model.params, args.rounds, args.syncs)
    fp8 = STANDARD if quantization else None
    for (batch, k, eng, compile_s), ts in zip(engines, times):
        ms = float(np.median(ts[1:] if len(ts) >= 3 else ts))
        need = step_bytes(cfg, batch, k, args.context, head_bytes=draft_head_bytes(model.params) if k else None,
                          mtp_stored=mtp_bytes(model.params) if k else None, fp8=fp8)
        entry["steps"].append({
            "batch": batch, "k": k, "step_ms": ms, "rounds_ms": ts, "compile_s": compile_s,
            "tokens_per_s_at_published_al": batch * PUBLISHED_AL[k] / ms * 1e3,
            "bytes_needed": need, "roofline_fraction": need["total"] / bw / (ms / 1e3)})
        print(f"  {quantization or 'bf16'} batch {batch} k {k}: {ms:.3f} ms/step, "
              f"{entry['steps'][-1]['roofline_fraction']:.0%} of the roofline, compile {compile_s:.1f} s", flush=True)
    del engines
    if args.fit and quantization:
        slots, ctx = (int(x) for x in args.fit.split(":"))
        try:
            eng = Engine(model, num_slots=slots, max_context=ctx, num_draft_tokens=3,
                         steps_per_sync=args.steps_per_sync)
            entry["fit"] = {"slots": slots, "context": ctx, "fits": True, "plan_total_bytes": eng.plan.total}
        except Exception as e:  # noqa: BLE001 - the refusal is the measurement
            entry["fit"] = {"slots": slots, "context": ctx, "fits": False, "error": str(e).splitlines()[0]}
        else:  # every slot busy near the end of its context: the planned engine steps at full size
            deep = ctx - (args.syncs + 1) * args.steps_per_sync * 4 - 8
            fill_synthetic(eng, deep, 7)
            eng.state, out = eng.device_loop()(model.params, eng.state)
            jax.block_until_ready(out)
            sec = float(np.median([dt for dt, _ in timed_loops(eng, model.params, args.syncs)])) / eng.steps_per_sync
            entry["fit"].update(depth=deep, k3_step_ms=sec * 1e3,
                                tokens_per_s_at_published_al=slots * PUBLISHED_AL[3] / sec,
                                device_bytes_in_use=(jax.devices()[0].memory_stats() or {}).get("bytes_in_use"))
            del eng
        print(f"  {slots} slots x {ctx}: {entry['fit']}", flush=True)
    del model
    gc.collect()
    return entry


def ratios(bf16: dict, fp8: dict) -> dict:
    """The issue's ratios from two :func:`measure` entries."""
    by = lambda e: {(s["batch"], s["k"]): s for s in e["steps"]}  # noqa: E731
    a, b = by(bf16), by(fp8)
    out = {}
    for (batch, k), s in b.items():
        plain = b.get((batch, 0))
        if k == 0 and (batch, 0) in a:
            out[f"b{batch}_fp8_plain_over_bf16_plain_tokens"] = a[(batch, 0)]["step_ms"] / s["step_ms"]
        if k and plain:
            out[f"b{batch}_k{k}_step_over_fp8_plain_step"] = s["step_ms"] / plain["step_ms"]
            out[f"b{batch}_k{k}_tokens_over_fp8_plain_at_published_al"] = PUBLISHED_AL[k] * plain["step_ms"] / s["step_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-27b")
    ap.add_argument("--grid", default="1:0,3;32:0,3", help="batch:k list, ';'-separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--steps-per-sync", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fit", default="", help="S:C: also check that S slots x C tokens fit with FP8 weights")
    ap.add_argument("--only", default="", choices=["", "bf16", "fp8"], help="measure one of the two")
    ap.add_argument("--tiny", action="store_true", help="shrunken shapes (CPU smoke run of the script)")
    ap.add_argument("--out", default="bench_fp8.json")
    args = ap.parse_args(argv)
    result = {**run_metadata(), "models": {}}
    bw = hbm_bandwidth()
    result["hbm_bytes_per_s"] = bw
    for name in args.models.split(","):
        cfg = tiny_config(name) if args.tiny else shapes.config(name)
        entry = result["models"][name] = {}
        for q in (None, "fp8"):
            if args.only and args.only != (q or "bf16"):
                continue
            print(f"== {name} {q or 'bf16'}", flush=True)
            entry[q or "bf16"] = measure(cfg, q, args, bw)
            write_json(args.out, result)
        if "bf16" in entry and "fp8" in entry:
            entry["ratios"] = ratios(entry["bf16"], entry["fp8"])
            print("  " + ", ".join(f"{k} {v:.3f}" for k, v in entry["ratios"].items()), flush=True)
        elif "fp8" in entry:
            entry["ratios"] = ratios({"steps": []}, entry["fp8"])
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
