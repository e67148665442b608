#!/usr/bin/env python
"""Tensor / expert parallelism on one host: step times of a model at TP 1 vs TP N, plain and speculative, with
output tokens/s at the published acceptance lengths and the share of the step spent in collectives; plus
exactness on the devices (greedy speculative == plain; sharded tokens vs TP 1). Random weights of a released shape.

    python scripts/bench_parallel.py --model qwen3.5-27b --tp 1,2 --batch 1,32 -k 0,3 --out results/parallel.json

The big model's weights are drawn per rank (jaxmtp.parallel.random_params), so its tokens differ between TP
degrees; a smaller shape (``--exact-model``) is built from the same weights at TP 1 and TP N to compare tokens.
Each TP degree runs in a process of its own (its weights fill the devices; ``--only-tp`` is that child), one after
the other in this call, so the figures compare on the same machine. XLA flags to A/B go in ``--xla-flags``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp import shapes
    from jaxmtp.benchmarking import (PUBLISHED_AL, alternating_step_ms, covered_time, is_device_stream,
                                     random_model, read_trace, synthetic_engine, tiny_config)
    from jaxmtp.parallel import device_bytes

    cfg = tiny_config(args.model) if args.tiny else shapes.config(args.model)
    if args.layers:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers, layer_types=cfg.layer_types[:args.layers],
                                  moe_layers=cfg.moe_layers[:args.layers])
    tp = args.only_tp
    from jaxmtp.compile_cache import enable_compile_cache

    enable_compile_cache()  # a rerun on the same machine compiles nothing
    model = random_model(cfg, jnp.bfloat16 if not args.tiny else jnp.float32, args.backend,
                         tensor_parallel_size=tp)
    out = {"tp": tp, "weight_bytes_per_device": device_bytes(model.params) if model.layout else
           int(sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))), "steps": []}
    batches = [int(b) for b in args.batch.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    modes = args.reduce.split(",") if tp > 1 else ["psum"]
    variants = {m: reduce_variant(model, m) for m in modes}
    for b in batches:
        runs = [(m, k) for m in modes for k in ks]  # every (mode, k) engine timed in alternating rounds
        engines = [synthetic_engine(variants[m], b, k, args.context, 16, args.steps_per_sync) for m, k in runs]
        times = alternating_step_ms(engines, model.params, args.rounds, args.syncs)
        for (m, k), ts, eng in zip(runs, times, engines):
            ms = float(np.median(ts))
            layout = variants[m].layout
            row = {"batch": b, "k": k, "reduce": m, "step_ms": ms, "rounds_ms": ts,
                   "reduce_mode": layout.collectives.reduce if layout is not None else "psum",
                   "tokens_per_s_published_al": b * PUBLISHED_AL[k] / ms * 1e3}
            if args.profile and b == batches[0]:
                row["collective_share"] = collective_share(eng, model.params, jax, covered_time, is_device_stream,
                                                           read_trace)
            out["steps"].append(row)
        del engines
        print("RESULT " + json.dumps(out), flush=True)  # what is done so far (the parent keeps the last)
    if args.tokens:  # exactness on the devices: greedy speculative == greedy plain on this model
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, cfg.vocab_size, 40).tolist() for _ in range(4)]
        tokens = {k: greedy(variants[modes[0]], prompts, k) for k in (0, 3)}
        # bf16 random weights have near-ties everywhere: report how long spec and plain agree (tokens of 48)
        out["spec_vs_plain_agreeing_prefix"] = [common_prefix(a, b) for a, b in zip(tokens[0], tokens[3])]
        for m in modes[1:]:  # the other modes against the first on the same weights
            mine = {k: greedy(variants[m], prompts, k) for k in (0, 3)}
            out[f"{m}_vs_{modes[0]}_agreeing_prefix"] = {k: [common_prefix(a, b) for a, b in zip(tokens[k], mine[k])]
                                                         for k in (0, 3)}
    del model, variants
    if tp > 1 and args.exact_model:  # the same weights at TP 1 and TP N: do the sharded tokens agree?
        from jaxmtp.loaded_model import Model, serving_params
        from jaxmtp.model import init_params
        from jaxmtp.pallas import resolve_backend
        from jaxmtp.parallel import make_layout

        ecfg = tiny_config(args.exact_model) if args.tiny else shapes.config(args.exact_model)
        native = jax.device_get(init_params(ecfg, jax.random.PRNGKey(1), jnp.bfloat16))
        backend = resolve_backend(args.backend, ecfg, jnp.bfloat16)
        got = {}
        for n in (1, tp):
            layout = make_layout(ecfg, n) if n > 1 else None
            p, b, _ = serving_params(jax.tree.map(lambda a: a, native), ecfg, backend, layout)
            m = Model(config=ecfg, params=p, dtype=jnp.bfloat16, backend=b, layout=layout)
            got[n] = {k: greedy(m, prompts, k) for k in (0, 3)}
            del m, p
        agree = [common_prefix(a, b) for a, b in zip(got[1][0], got[tp][0])]
        out["exact_model"] = {"model": args.exact_model, "tokens": 48, "agreeing_prefix_tp_vs_tp1": agree,
                              "spec_vs_plain_agreeing_prefix_tp1": [common_prefix(a, b) for a, b in
                                                                    zip(got[1][0], got[1][3])],
                              "spec_vs_plain_agreeing_prefix_tp": [common_prefix(a, b) for a, b in
                                                                   zip(got[tp][0], got[tp][3])]}
    return out


def reduce_variant(model, mode: str):
    """``model`` with its ranks' sums made in ``mode``: a reduce mode (``auto`` as loaded), optionally with kernel
    overrides after a colon, joined by ``+`` (``oneshot:oneshot_row_programs=0+oneshot_row_num_warps=8``,
    :func:`jaxmtp.pallas.override_backend`)."""
    from jaxmtp.benchmarking import variant_model
    from jaxmtp.parallel import with_reduce

    reduce, _, spec = mode.partition(":")
    if model.layout is not None and reduce not in ("auto", model.layout.collectives.reduce):
        model = with_reduce(model, reduce)
    return variant_model(model, spec.replace("+", ",")) if spec else model


def greedy(model, prompts, k, n=48):
    from jaxmtp.engine import Engine
    from jaxmtp.sampling import SamplingParams

    eng = Engine(model, num_slots=len(prompts), max_context=256, num_draft_tokens=k, check_memory=False)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
    got = {i: [] for i in ids}
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.token_ids
    return [got[i] for i in ids]


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def collective_share(eng, params, jax, covered_time, is_device_stream, read_trace) -> dict:
    """Device time of one loop on the first device: all kernels vs the collectives among them (NCCL kernels)."""
    loop = eng.device_loop()
    eng.state, _ = loop(params, eng.state)
    jax.block_until_ready(eng.state.length)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        eng.state, out = loop(params, eng.state)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        groups = read_trace(d)
    streams = [(p, t) for (p, t) in groups if is_device_stream(p, t)]
    first = sorted({p for p, _ in streams})[:1]
    events = [e for (p, t), evs in groups.items() if (p, t) in streams and p in first for e in evs]
    # NCCL's kernels, and XLA's own collective kernels, which it names after the op (``psum_12_0_fusion_1``)
    coll = [e for e in events if any(s in e["name"].lower() for s in ("nccl", "psum", "oneshot", "all-reduce",
                                                                     "all_reduce", "allreduce", "all-gather",
                                                                     "all_gather", "allgather", "reduce-scatter"))]
    total = covered_time((e["ts"], e["ts"] + e["dur"]) for e in events)
    comm = covered_time((e["ts"], e["ts"] + e["dur"]) for e in coll)
    kernels = {}  # name -> [count, total us]: what the step is made of (finds collectives named otherwise)
    for e in events:
        k = kernels.setdefault(e["name"][:90], [0, 0.0])
        k[0] += 1
        k[1] += e["dur"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    per_stream = {t: covered_time((e["ts"], e["ts"] + e["dur"]) for e in groups[(p, t)]) / eng.steps_per_sync
                  for (p, t) in streams if p in first}
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events) if events else 0.0
    return {"device_us_per_step": total / eng.steps_per_sync, "collective_us_per_step": comm / eng.steps_per_sync,
            "idle_us_per_step": (span - total) / eng.steps_per_sync,  # no kernel on the first device
            "share": comm / total if total else None, "collective_kernels": len(coll),
            "stream_us_per_step": per_stream,
            "top_kernels": [(n, c // eng.steps_per_sync, round(us / eng.steps_per_sync, 1)) for n, (c, us) in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-27b", help="a released shape (jaxmtp.shapes)")
    ap.add_argument("--tiny", action="store_true", help="the shape's layout at width 64 (CPU smoke runs)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--tp", default="1,2", help="TP degrees, each in its own process")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("-k", default="0,3")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--steps-per-sync", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--exact-model", default="qwen3.5-0.8b",
                    help="a shape whose same weights run at TP 1 and TP N: greedy tokens compared ('' to skip)")
    ap.add_argument("--no-tokens", dest="tokens", action="store_false",
                    help="time only: skip the greedy token checks (their prefill compiles take minutes at 27B)")
    ap.add_argument("--reduce", default="auto",
                    help="TP sum modes to time side by side in each TP > 1 process (auto, psum, oneshot, fixed; "
                         "auto: what jaxmtp.load picks, recorded as reduce_mode), each optionally with kernel "
                         "overrides after a colon joined by +: oneshot:oneshot_fused=0")
    ap.add_argument("--profile", action="store_true", help="also the collectives' share of the step (profiler)")
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for every child (an A/B of a flag)")
    ap.add_argument("--child-timeout", type=float, default=None,
                    help="seconds each TP degree's process may take (the others still run)")
    ap.add_argument("--only-tp", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.only_tp is not None:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    from jaxmtp.benchmarking import run_metadata, write_json

    env = dict(os.environ)
    if args.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    runs = []
    for tp in [int(t) for t in args.tp.split(",")]:
        cmd = [sys.executable, __file__, "--only-tp", str(tp)] + [a for a in sys.argv[1:]]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            done = [x for x in out.splitlines() if x.startswith("RESULT ")]
            runs.append(dict(json.loads(done[-1][len("RESULT "):]) if done else {"tp": tp},
                             error=f"timed out after {args.child_timeout} s", stdout=out[-2000:]))
        else:
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
                runs.append(dict(json.loads(line[-1][len("RESULT "):]) if line else {"tp": tp},
                                 returncode=proc.returncode, error=proc.stdout[-1000:] + proc.stderr[-3000:]))
            else:
                runs.append(json.loads(line[-1][len("RESULT "):]))
        print(json.dumps(runs[-1].get("steps")), flush=True)
        if args.out:  # what has finished survives a later degree's failure or the call's limit
            write_json(args.out, {"meta": run_metadata(), "args": vars(args), "runs": runs, "partial": True})
    base = next((r for r in runs if r.get("tp") == 1 and "steps" in r), None)
    for r in runs:
        if base is None or not r.get("steps"):
            continue
        for s in r["steps"]:
            b = next((x for x in base["steps"] if x["batch"] == s["batch"] and x["k"] == s["k"]
                      and x.get("reduce", "psum") == "psum"), None)
            if b is not None:
                s["ratio_to_tp1"] = s["step_ms"] / b["step_ms"]
        plain = {(s["batch"], s.get("reduce")): s for s in r["steps"] if s["k"] == 0}
        for s in r["steps"]:
            if s["k"] and (s["batch"], s.get("reduce")) in plain:
                s["speedup_vs_plain_published_al"] = s["tokens_per_s_published_al"] / plain[s["batch"], s.get(
                    "reduce")]["tokens_per_s_published_al"]
    result = {"meta": run_metadata(), "args": vars(args), "runs": runs}
    print(json.dumps({r["tp"]: [(s["batch"], s["k"], s.get("reduce"), round(s["step_ms"], 3),
                                 round(s.get("ratio_to_tp1", 0), 3))
                                for s in r.get("steps", [])] for r in runs}))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
