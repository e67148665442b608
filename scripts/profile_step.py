#!/usr/bin/env python
"""Where a decode step's (or a prompt's prefill) time goes: kernel counts, GPU busy time and the top ops, from a JAX
profiler trace.

    python scripts/profile_step.py --model qwen3.5-4b --grid '1:0,3' --out prof.json [--quantization fp8]
    python scripts/profile_step.py --model qwen3.5-27b --prefill 8192 --prefill-chunk 1024 --out prof.json

Builds a random bf16 model of a released Qwen3.5 shape, fills every slot with a request ``--context`` tokens deep
(``jaxmtp.benchmarking.synthetic_engine``), warms the engine's jitted ``steps_per_sync``-step loop, then traces
``--syncs`` calls with ``jax.profiler`` and reads the trace back (``*.trace.json.gz``; no TensorBoard needed).
With ``--prefill``, one prompt of that many random tokens is prefilled instead (after untraced prompts that
compile, warm up and are timed), and "per step" reads "per prefill call" (one chunk). Reported per step: wall time,
device kernels launched, the union of device busy intervals (so ``1 - busy / wall`` is the idle share: launch gaps,
host round trips), and the ops with the most device time. Run it with different
``XLA_FLAGS`` in separate processes to compare compiler settings. JSON out; a short summary prints last.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmtp import shapes  # noqa: E402
from jaxmtp.benchmarking import (LAYOUTS, covered_time, draft_head_bytes, fp8_scheme, hlo_sources,  # noqa: E402
                                 is_device_stream, mtp_bytes, prefill_engine, random_model, read_trace, run_metadata,
                                 step_bytes, synthetic_engine, timed_loops, timed_prefill, tiny_config, write_json)
from jaxmtp.pallas import override_backend, resolve_backend  # noqa: E402


def summarise(groups: dict, steps: int, wall_s: float, top: int, sources: dict | None = None) -> dict:
    threads, kernels = [], []
    for (proc, thr), evs in groups.items():
        threads.append({"process": proc, "thread": thr, "events": len(evs),
                        "total_us": sum(e["dur"] for e in evs)})
        if is_device_stream(proc, thr):
            kernels.extend(evs)
    busy_us = covered_time((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    by_op = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        args = e.get("args", {})
        name = args.get("hlo_op") or args.get("long_name") or e["name"]
        by_op[name][0] += 1
        by_op[name][1] += e["dur"]
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for name, (n, us) in by_op.items():
        kind = re.sub(r"(\.\d+)+(\.clone)?$", "", name)
        by_kind[kind][0] += n
        by_kind[kind][1] += us
    by_kernel = collections.defaultdict(lambda: [0, 0.0])  # the device kernel's own name (cuBLAS, Triton, ...)
    for e in kernels:
        by_kernel[e["name"][:160]][0] += 1
        by_kernel[e["name"][:160]][1] += e["dur"]
    kinds = sorted(({"kind": k, "calls_per_step": v[0] / steps, "us_per_step": v[1] / steps}
                    for k, v in by_kind.items()), key=lambda r: -r["us_per_step"])
    ops = sorted(({"op": k, "calls_per_step": v[0] / steps, "us_per_step": v[1] / steps} for k, v in by_op.items()),
                 key=lambda r: -r["us_per_step"])
    span_us = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0.0
    ordered = sorted(kernels, key=lambda e: e["ts"])
    mid, per_step = len(ordered) // 2, len(ordered) // max(steps, 1)
    sources = sources or {}
    sequence = [{"op": (op := e.get("args", {}).get("hlo_op") or e["name"]), "us": e["dur"],
                 "gap_us": e["ts"] - (p["ts"] + p["dur"]), "src": sources.get(op, "")}
                for p, e in zip(ordered[mid - 1 : mid + per_step], ordered[mid : mid + per_step])]
    # Host work (dispatch, command-buffer updates, transfers) and the device's longest idle stretches: where the
    # wall time that no kernel covers goes.
    host = collections.defaultdict(lambda: [0, 0.0])
    for (proc, thr), evs in groups.items():
        if not is_device_stream(proc, thr) and "host" in proc.lower():
            for e in evs:
                host[e["name"]][0] += 1
                host[e["name"]][1] += e["dur"]
    host_ops = sorted(({"name": k, "calls_per_step": v[0] / steps, "us_per_step": v[1] / steps}
                       for k, v in host.items()), key=lambda r: -r["us_per_step"])
    gaps = sorted(({"gap_us": e["ts"] - (p["ts"] + p["dur"]), "after": p.get("args", {}).get("hlo_op") or p["name"],
                    "before": e.get("args", {}).get("hlo_op") or e["name"], "index": i}
                   for i, (p, e) in enumerate(zip(ordered, ordered[1:]))), key=lambda r: -r["gap_us"])
    return {
        "wall_ms_per_step": wall_s / steps * 1e3,
        "kernels_per_step": len(kernels) / steps,
        "device_busy_ms_per_step": busy_us / steps / 1e3,
        "device_span_ms_per_step": span_us / steps / 1e3,
        "kernel_time_ms_per_step": sum(e["dur"] for e in kernels) / steps / 1e3,
        "top_ops": ops[:top],
        "by_kind": kinds[:top],
        "by_kernel": sorted(({"kernel": k, "calls_per_step": v[0] / steps, "us_per_step": v[1] / steps}
                             for k, v in by_kernel.items()), key=lambda r: -r["us_per_step"])[:top],
        "threads": sorted(threads, key=lambda r: -r["total_us"])[:40],
        "host_ops": host_ops[:top],
        "idle_gaps": gaps[:top],
        "sequence": sequence,  # one step's worth of kernels in launch order, from the middle of the trace
    }


def profile(model, batch: int, k: int, context: int, syncs: int, steps_per_sync: int, top: int,
            hlo_dir: str | None = None, sampling: bool = False) -> dict:
    """One (batch, k) loop traced; ``sampling``: the engine's loop with the sampling conditional (else greedy only)."""
    room = steps_per_sync * (syncs + 3) * (k + 1) + 16
    eng = synthetic_engine(model, batch, k, context, room, steps_per_sync)
    # The optimised HLO of the step loop traces each kernel (copies, fusions, Pallas calls) back to its source lines.
    hlo = eng.device_loop(sampling=sampling).lower(model.params, eng.state).compile().as_text()
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"step_b{batch}_k{k}{'_sampling' if sampling else ''}.hlo.txt"), "w") as f:
            f.write(hlo)
    eng.device_loop = lambda *_, f=eng.device_loop(sampling=sampling): f  # noqa: E731  (what timed_loops runs)
    timed_loops(eng, model.params, 2)  # compile and warm
    untraced = [dt for dt, _ in timed_loops(eng, model.params, syncs)]
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(syncs):
            eng.state, out = eng.device_loop()(model.params, eng.state)
            jax.device_get(out)
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        groups = read_trace(d)
    steps = syncs * steps_per_sync
    res = summarise(groups, steps, wall, top, hlo_sources(hlo))
    res.update(batch=batch, k=k, context=context, sampling=sampling,
               untraced_step_ms=float(np.median(untraced)) / steps_per_sync * 1e3)
    del eng
    return res


def profile_prefill(model, prompt_len: int, chunk: int, top: int) -> dict:
    """One ``prompt_len``-token prompt prefilled in ``chunk``-token calls, traced (after one that compiles, one that
    warms up and three timed untraced, their median reported); the summary's steps are the prefill calls."""
    eng = prefill_engine(model, prompt_len, chunk)
    for seed in range(2):  # compile, then warm (a small model's first timed prompt ran 3-4x slower on an H100)
        timed_prefill(eng, prompt_len, np.random.default_rng(seed))
    untraced = float(np.median([timed_prefill(eng, prompt_len, np.random.default_rng(seed)) for seed in (3, 4, 5)]))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        wall = timed_prefill(eng, prompt_len, np.random.default_rng(2))
        jax.profiler.stop_trace()
        groups = read_trace(d)
    calls = -(-prompt_len // chunk)
    res = summarise(groups, calls, wall, top)
    res.update(prompt_len=prompt_len, chunk=chunk, calls=calls, untraced_s=untraced,
               tokens_per_s=prompt_len / untraced)
    del eng
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-4b")
    ap.add_argument("--grid", default="1:0,3", help="batch:k,k;batch:k,... profiled in turn")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--steps-per-sync", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--override", default="", help="backend and kernel-policy fields to set "
                    "(jaxmtp.pallas.override_backend), e.g. matmul=triton,kernel_max_rows=4")
    ap.add_argument("--layout", default="serving", choices=LAYOUTS,
                    help="params layout (jaxmtp.benchmarking.random_model)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="hot draft vocabulary size (jaxmtp.draft_vocab)")
    ap.add_argument("--tiny", action="store_true", help="shrink the shape (CPU smoke test of the script)")
    ap.add_argument("--out", default="profile_step.json")
    ap.add_argument("--sampling", default="0", help="'0', '1' or '0,1': profile the greedy-only loop, the loop "
                    "with the sampling conditional (what the engine runs while a busy slot samples), or both")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="draw the linears the official FP8 checkpoints quantise as block FP8 (jaxmtp.fp8)")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead of --grid")
    ap.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill call (with --prefill)")
    ap.add_argument("--hlo-dir", default=None, help="also write each step loop's optimised HLO text here")
    args = ap.parse_args(argv)

    cfg = tiny_config(args.model) if args.tiny else shapes.config(args.model)
    backend = override_backend(resolve_backend(args.backend, cfg, jnp.bfloat16), args.override)  # before the layout
    model = random_model(cfg, jnp.bfloat16, backend, args.layout, args.draft_vocab, quantization=args.quantization)
    result = {**run_metadata(), "model": args.model, "backend": str(model.backend), "layout": args.layout,
              "quantization": args.quantization,
              "runs": []}
    if args.prefill:
        r = profile_prefill(model, args.prefill, args.prefill_chunk, args.top)
        result["prefill"] = r
        write_json(args.out, result)
        print(f"{args.model} prefill {args.prefill} tokens in {args.prefill_chunk}-token calls: "
              f"{r['tokens_per_s']:.0f} tokens/s untraced; per call {r['wall_ms_per_step']:.1f} ms traced, "
              f"{r['kernels_per_step']:.0f} kernels, device busy {r['device_busy_ms_per_step']:.1f} ms", flush=True)
        for op in r["by_kind"][:25]:
            print(f"   {op['us_per_step']:9.1f} us  x{op['calls_per_step']:5.1f}  {op['kind'][:110]}")
        return 0
    for part in filter(None, args.grid.split(";")):
        b, ks = part.split(":")
        for k, sampling in ((k, s) for k in ks.split(",") for s in args.sampling.split(",")):
            r = profile(model, int(b), int(k), args.context, args.syncs, args.steps_per_sync, args.top,
                        args.hlo_dir, sampling=bool(int(sampling)))
            r["bytes_needed"] = step_bytes(cfg, int(b), int(k), args.context,
                                           head_bytes=draft_head_bytes(model.params),
                                           mtp_stored=mtp_bytes(model.params),
                                           fp8=fp8_scheme(model.params))["total"]
            result["runs"].append(r)
            write_json(args.out, result)
            print(f"{args.model} B={b} k={k} sampling={sampling}: step {r['wall_ms_per_step']:.2f} ms traced "
                  f"({r['untraced_step_ms']:.2f} untraced), {r['kernels_per_step']:.0f} kernels, device busy "
                  f"{r['device_busy_ms_per_step']:.2f} ms", flush=True)
            if not r["kernels_per_step"]:
                print("   no device-stream threads found; threads:", [(t["process"], t["thread"]) for t in r["threads"]])
            for op in r["by_kind"][:12]:
                print(f"   {op['us_per_step']:9.1f} us  x{op['calls_per_step']:5.1f}  {op['kind'][:110]}")
            for op in r["top_ops"][:8]:
                print(f"   {op['us_per_step']:9.1f} us  x{op['calls_per_step']:5.1f}  {op['op'][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
