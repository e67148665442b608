#!/usr/bin/env python
"""End-to-end decode benchmark at real Qwen3.5 shapes (random bf16 weights), against the memory roofline and
transformers.

    python scripts/bench_decode.py --models qwen3.5-4b,qwen3.5-27b --out results.json [--hf]

Per model, in one run: weights and memory per slot; prefill tokens/s for the given prompt lengths; plain decode
(k = 0) and verify (k >= 1) step times for the (batch, k) grid, measured through ``Engine.step`` (host work included)
with all slots busy; compile time of each step; output tokens/s at the measured (random, ~0) acceptance and at the
published Qwen3.5 MTP acceptance lengths; the bytes a step must read over the measured HBM bandwidth (roofline) and
the fraction achieved, and for k >= 1 an estimate of the most the bytes allow (``bound``: tokens/s over plain at
the published AL if the step cost the plain step plus its extra bytes at the measured bandwidth,
:func:`speedup_bound`; the probe is a read + write stream, which the best kernels beat by a few percent). ``--hf``
adds transformers' model of the same shape doing greedy generation.
JSON is written after every measurement (partial results survive a time limit); a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import shapes
from jaxmtp.benchmarking import (LAYOUTS, PUBLISHED_AL, CompileClock, alternating_step_ms, draft_head_bytes,
                                 fill_synthetic, fp8_scheme, hbm_bandwidth, mtp_bytes, prefill_engine, random_model,
                                 run_metadata, speedup_bound, step_bytes, synthetic_engine, timed_loops, timed_prefill,
                                 tiny_config, variant_model, write_json)
from jaxmtp.engine import Engine
from jaxmtp.engine.memory import memory_plan
from jaxmtp.mtp import describe_draft_head
from jaxmtp.pallas import override_backend, resolve_backend
from jaxmtp.param_layout import has_quantized_mtp
from jaxmtp.sampling import SamplingParams

COMPILE = CompileClock()


def bench_prefill(model, prompt_len: int, chunk: int) -> dict:
    eng = prefill_engine(model, prompt_len, chunk)
    rng = np.random.default_rng(0)
    out = {}
    for attempt in ("cold", "warm"):
        COMPILE.reset()
        out[attempt] = {"seconds": timed_prefill(eng, prompt_len, rng), "compile_s": COMPILE.seconds}
    return {"prompt_len": prompt_len, "chunk": chunk, "seconds": out["warm"]["seconds"],
            "tokens_per_s": prompt_len / out["warm"]["seconds"], "compile_s": out["cold"]["compile_s"]}


ENGINE_FIELDS = ("mid_prompt_prefill",)  # A/B items that set an Engine argument (0 / 1), not the backend


def split_engine_fields(spec: str) -> tuple[str, dict]:
    """``spec`` without its :data:`ENGINE_FIELDS` items, and those as Engine keyword arguments."""
    rest, kw = [], {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.strip().partition("=")
        if name in ENGINE_FIELDS:
            kw[name] = bool(int(value))
        else:
            rest.append(item)
    return ",".join(rest), kw


def bench_prefill_ab(model, prompt_len: int, chunk: int, variants: list[str], rounds: int) -> dict:
    """Prefill under several overrides (:func:`jaxmtp.benchmarking.variant_model`, and the Engine arguments of
    :data:`ENGINE_FIELDS`) in one process, alternating (as :func:`bench_ab` for steps)."""
    engines = []
    for spec in variants:
        backend_spec, engine_kw = split_engine_fields(spec)
        eng = prefill_engine(variant_model(model, backend_spec), prompt_len, chunk, **engine_kw)
        timed_prefill(eng, prompt_len, np.random.default_rng(0))  # compile
        engines.append(eng)
    times: list[list[float]] = [[] for _ in variants]
    for r in range(rounds):
        for i, eng in enumerate(engines):
            times[i].append(timed_prefill(eng, prompt_len, np.random.default_rng(r)))
    del engines
    return {"prompt_len": prompt_len, "chunk": chunk, "variants": [
        {"override": spec, "round_seconds": ts, "tokens_per_s": prompt_len / float(np.median(ts))}
        for spec, ts in zip(variants, times)]}


def bench_steps(model, batch: int, k: int, context: int, syncs: int, steps_per_sync: int, bw: float) -> dict:
    """Device step time with every slot busy (the jitted ``steps_per_sync``-step loop, timed between host reads)."""
    cfg = model.config
    room = steps_per_sync * (syncs + 2) * (k + 1) + 16
    eng = synthetic_engine(model, batch, k, context, room, steps_per_sync)
    COMPILE.reset()
    t0 = time.perf_counter()
    eng.state, out = eng.device_loop()(model.params, eng.state)
    jax.block_until_ready(out)
    first = time.perf_counter() - t0
    compile_s = COMPILE.seconds
    times, accepted, steps = [], 0, 0
    for dt, out in timed_loops(eng, model.params, syncs):
        times.append(dt)
        accepted += int(out["accepted"].sum())
        steps += int(out["was_active"].sum())
    step_s = float(np.median(times)) / steps_per_sync
    fp8 = fp8_scheme(model.params)
    plan = memory_plan(cfg, batch, context, k, model.dtype, fp8=fp8)
    need = step_bytes(cfg, batch, k, context + room // 2, head_bytes=draft_head_bytes(model.params),
                      mtp_stored=mtp_bytes(model.params), fp8=fp8)
    del eng
    return {
        "batch": batch, "k": k, "context": context, "step_ms": step_s * 1e3, "compile_s": compile_s,
        "first_call_s": first, "measured_acceptance_length": (accepted + steps) / max(steps, 1),
        "published_acceptance_length": PUBLISHED_AL[k],
        "tokens_per_s_at_published_al": batch * PUBLISHED_AL[k] / step_s,
        "bytes_needed": need, "roofline_ms": need["total"] / bw * 1e3,
        "roofline_fraction": need["total"] / bw / step_s, "memory_per_slot_bytes": plan.per_slot,
    }


def bench_ab(model, batch: int, k: int, context: int, variants: list[str], rounds: int, syncs: int,
             steps_per_sync: int, bw: float) -> dict:
    """The same step under several overrides (``variants``: :func:`jaxmtp.pallas.override_backend` specs of backend
    and kernel-policy fields, "" = the model's backend), in one process on the same weights, timed in alternation:
    ``rounds`` rounds, each timing every variant's ``syncs`` loops. Step-time differences of a few percent are below
    the spread between processes but not between rounds of one process, which this measures."""
    cfg = model.config
    room = steps_per_sync * (rounds * syncs + 2) * (k + 1) + 16
    engines = []
    for spec in variants:
        m = variant_model(model, spec)
        eng = synthetic_engine(m, batch, k, context, room, steps_per_sync)
        timed_loops(eng, m.params, 1)  # compile
        engines.append((m, eng))
    times = alternating_step_ms([eng for _, eng in engines], [m.params for m, _ in engines], rounds, syncs)
    need = step_bytes(cfg, batch, k, context + room // 2, head_bytes=draft_head_bytes(model.params),
                      mtp_stored=mtp_bytes(model.params), fp8=fp8_scheme(model.params))
    roofline_ms = need["total"] / bw * 1e3
    out = {"batch": batch, "k": k, "context": context, "roofline_ms": roofline_ms, "variants": []}
    for spec, (m, _), ts in zip(variants, engines, times):
        med = float(np.median(ts))
        out["variants"].append({"override": spec, "backend": str(m.backend), "round_step_ms": ts,
                                "step_ms": med, "roofline_fraction": roofline_ms / med})
    del engines
    return out


def bench_ratio(model, batch: int, k: int, context: int, rounds: int, syncs: int, steps_per_sync: int) -> dict:
    """The k-draft step against the plain step of the same weights, timed in alternating rounds in one process (each
    round: ``syncs`` loops of the plain engine, then of the k engine): the per-round ratios and their median, so
    that drift within the process (clocks, other tenants) moves both steps alike. The spread between processes is
    larger still: run several processes and report the distribution."""
    room = steps_per_sync * (rounds * syncs + 2) * (k + 1) + 16
    engines = [synthetic_engine(model, batch, kk, context, room, steps_per_sync) for kk in (0, k)]
    for eng in engines:
        timed_loops(eng, model.params, 1)  # compile and warm
    times = alternating_step_ms(engines, model.params, rounds, syncs)
    ratios = [b / a for a, b in zip(*times)]
    del engines
    return {"batch": batch, "k": k, "plain_round_ms": times[0], "k_round_ms": times[1], "round_ratios": ratios,
            "plain_ms": float(np.median(times[0])), "k_ms": float(np.median(times[1])),
            "ratio": float(np.median(ratios))}


def bench_lone_request(model, slots: int, k: int, context: int, syncs: int, steps_per_sync: int) -> dict:
    """One busy slot (slot 0) in an engine of ``slots``: the step over every slot against the step over the
    smallest slot bucket (the engine's default since slot buckets), and an engine of one slot."""
    out = {"slots": slots, "k": k, "context": context}
    room = steps_per_sync * (syncs + 2) * (k + 1) + 16
    for name, n_slots in (("all_slots", slots), ("bucket", slots), ("one_slot_engine", 1)):
        eng = Engine(model, num_slots=n_slots, max_context=context + room, num_draft_tokens=k,
                     steps_per_sync=steps_per_sync, check_memory=False)
        fill_synthetic(eng, context, 3)
        eng.state = eng.state.replace(active=eng.state.active.at[1:].set(False))
        run = eng.device_loop(1 if name == "bucket" else None)
        eng.state, o = run(model.params, eng.state)
        jax.block_until_ready(o)
        times = []
        for _ in range(syncs):
            t0 = time.perf_counter()
            eng.state, o = run(model.params, eng.state)
            jax.device_get(o)
            times.append(time.perf_counter() - t0)
        out[name + "_step_ms"] = float(np.median(times)) / steps_per_sync * 1e3
        del eng
    return out


def bench_engine(model, k: int, prompt_len: int, new_tokens: int) -> dict:
    """One real request through Engine.step() (prefill, decode loops, host work): end-to-end output tokens/s."""
    eng = Engine(model, num_slots=1, max_context=prompt_len + new_tokens + 8, num_draft_tokens=k,
                 prefill_chunk=512, steps_per_sync=8, check_memory=False)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size - 1, prompt_len).tolist()
    res = {}
    for attempt in ("cold", "warm"):
        eng.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        first, first_n, n = None, 0, 0
        while eng.has_work():
            for o in eng.step():
                n += len(o.token_ids)
                if first is None and o.token_ids:
                    first, first_n = time.perf_counter() - t0, n
        res[attempt] = (time.perf_counter() - t0, first, first_n, n)
    total, first, first_n, n = res["warm"]
    return {"k": k, "prompt_len": prompt_len, "new_tokens": n, "seconds": total,
            "first_chunk_s": first, "first_chunk_tokens": first_n,
            "decode_tokens_per_s": (n - first_n) / (total - first), "cold_seconds": res["cold"][0]}


def bench_hf(cfg, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """transformers' Qwen3_5ForCausalLM of the same shape (random bf16 weights), greedy generate on CUDA."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings, layer_types=list(cfg.layer_types),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size - 1, (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "seconds": dt,
            "tokens_per_s": batch * new_tokens / dt}


def parse_grid(spec: str) -> list[tuple[int, int]]:
    """'1:0,1,2,3,4;8:0,3' -> [(1,0),(1,1),...,(8,0),(8,3)]"""
    out = []
    for part in filter(None, spec.split(";")):
        b, ks = part.split(":")
        out += [(int(b), int(k)) for k in ks.split(",")]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-4b,qwen3.5-27b")
    ap.add_argument("--grid", default="1:0,1,2,3,4;8:0,3;32:0,3;64:0,3",
                    help="batch:k,k;batch:k,... (steps measured for each pair)")
    ap.add_argument("--small-grid", default="1:0,3", help="grid for models listed in --small-grid-models")
    ap.add_argument("--small-grid-models", default="")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each slot during decode")
    ap.add_argument("--prefill", default="1024,8192,32768", help="prompt lengths for the prefill measurement")
    ap.add_argument("--prefill-models", default=None, help="models to measure prefill on (default: all)")
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--syncs", type=int, default=6)
    ap.add_argument("--steps-per-sync", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--override", default="", help="backend and kernel-policy fields to set "
                    "(jaxmtp.pallas.override_backend), e.g. gdn_mixer=xla,norm=triton")
    ap.add_argument("--ab", default="", help="overrides to compare in one process, '|'-separated (an empty entry = "
                    "the default), each a --override spec of backend and kernel-policy fields, e.g. '|norm=triton' "
                    "or '|output_split_max_rows=1': each grid point is timed in alternating rounds; prefill variants "
                    "may also set mid_prompt_prefill=0/1 (an Engine argument)")
    ap.add_argument("--ab-rounds", type=int, default=6)
    ap.add_argument("--ratio", default="", help="batch:k pairs, e.g. 1:3: the k step against the plain step in "
                    "alternating rounds in one process (--ratio-rounds), per-round ratios and their median")
    ap.add_argument("--ratio-rounds", type=int, default=6)
    ap.add_argument("--engine-ks", default="", help="k values for a real single-request Engine run (host included)")
    ap.add_argument("--engine-models", default=None)
    ap.add_argument("--lone", default="", help="slots:k pairs, e.g. 32:3;8:0: one busy slot, full step vs bucket")
    ap.add_argument("--hf", default="", help="batches for the transformers comparison, e.g. 1,32")
    ap.add_argument("--hf-models", default=None)
    ap.add_argument("--hf-only", action="store_true",
                    help="only the transformers comparison (run it in its own process: JAX reserves GPU memory)")
    ap.add_argument("--hf-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="draw the linears the official FP8 checkpoints quantise as block FP8 (jaxmtp.fp8)")
    ap.add_argument("--layout", default="serving", choices=LAYOUTS, help="params layout (see random_model)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="hot draft vocabulary size (jaxmtp.draft_vocab)")
    ap.add_argument("--draft-head-bits", type=int, default=None, choices=[8, 4],
                    help="draft head quantisation (default: the engine's, int4 where the hidden size allows)")
    ap.add_argument("--tiny", action="store_true", help="shrink every shape (CPU smoke test of the script)")
    ap.add_argument("--time-limit", type=float, default=1e9, help="stop starting new measurements after this")
    ap.add_argument("--out", default="bench_decode.json")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    if args.hf_only:
        return hf_only(args)
    result = {**run_metadata(), "layout": args.layout, "draft_vocab": args.draft_vocab,
              "draft_head_bits": args.draft_head_bits, "models": {}}
    bw = hbm_bandwidth()
    result["hbm_bytes_per_s"] = bw
    print(f"device {result['device']}, measured bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    dtype = jnp.dtype(args.dtype)
    small = set(filter(None, args.small_grid_models.split(",")))
    prefill_models = set(filter(None, (args.prefill_models or args.models).split(",")))
    hf_models = set(filter(None, (args.hf_models or args.models).split(",")))

    def save():
        write_json(args.out, result)

    def over() -> bool:
        return time.perf_counter() - t_start > args.time_limit

    for name in args.models.split(","):
        if over():
            break
        cfg = tiny_config(name) if args.tiny else shapes.config(name)
        t0 = time.perf_counter()
        backend = override_backend(resolve_backend(args.backend, cfg, dtype), args.override)  # before the layout
        model = random_model(cfg, dtype, backend, args.layout, args.draft_vocab, args.draft_head_bits,
                             quantize_mtp_layer=False if args.ab else None,  # A/B variants quantise a copy
                             quantization=args.quantization)
        entry = {"config": {k: v for k, v in cfg.__dict__.items() if not isinstance(v, tuple)},
                 "weights_bytes": memory_plan(cfg, 1, args.context, 3, dtype, fp8=fp8_scheme(model.params)).weights,
                 "init_s": time.perf_counter() - t0, "backend": str(model.backend),
                 "draft_head": describe_draft_head(model.params, cfg.vocab_size),
                 "mtp_int8": has_quantized_mtp(model.params), "prefill": [], "steps": [],
                 "hf": []}
        result["models"][name] = entry
        print(f"\n== {name}: {entry['weights_bytes'] / 2**30:.1f} GiB of weights ({model.backend})", flush=True)
        if name in prefill_models:
            for p in [int(x) for x in args.prefill.split(",") if x and int(x) > 0]:
                if over():
                    break
                try:
                    r = (bench_prefill_ab(model, p, args.prefill_chunk, args.ab.split("|"), args.ab_rounds) if args.ab
                         else bench_prefill(model, p, args.prefill_chunk))
                except Exception as e:  # noqa: BLE001 - record and go on (e.g. out of memory)
                    r = {"prompt_len": p, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                entry["prefill"].append(r)
                print("prefill", json.dumps(r), flush=True)
                save()
        for batch, k in parse_grid(args.small_grid if name in small else args.grid):
            if over():
                break
            if args.ab:
                try:
                    r = bench_ab(model, batch, k, args.context, args.ab.split("|"), args.ab_rounds, args.syncs,
                                 args.steps_per_sync, bw)
                except Exception as e:  # noqa: BLE001
                    r = {"batch": batch, "k": k, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                entry.setdefault("ab", []).append(r)
                print("ab", json.dumps(r), flush=True)
                save()
                continue
            try:
                r = bench_steps(model, batch, k, args.context, args.syncs, args.steps_per_sync, bw)
            except Exception as e:  # noqa: BLE001
                r = {"batch": batch, "k": k, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            plain = next((p for p in entry["steps"] if p["batch"] == batch and p["k"] == 0 and "error" not in p), None)
            if k > 0 and plain is not None and "error" not in r:
                r.update(speedup_bound(r, plain, bw))
            entry["steps"].append(r)
            print("step", json.dumps({x: r[x] for x in r if x != "bytes_needed"}), flush=True)
            save()
        for batch, k in (parse_grid(args.ratio) if args.ratio else []):
            if over() or k == 0:
                continue
            try:
                r = bench_ratio(model, batch, k, args.context, args.ratio_rounds, args.syncs, args.steps_per_sync)
            except Exception as e:  # noqa: BLE001
                r = {"batch": batch, "k": k, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            entry.setdefault("ratio", []).append(r)
            if "error" not in r:
                print(f"ratio {name} B={batch} k={k}: plain {r['plain_ms']:.3f} ms, k {r['k_ms']:.3f} ms, k / plain "
                      f"{r['ratio']:.3f} (rounds {min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f})",
                      flush=True)
            else:
                print("ratio", json.dumps(r), flush=True)
            save()
        for slots, k in (parse_grid(args.lone) if args.lone else []):
            if over():
                break
            try:
                r = bench_lone_request(model, slots, k, args.context, args.syncs, args.steps_per_sync)
            except Exception as e:  # noqa: BLE001
                r = {"slots": slots, "k": k, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            entry.setdefault("lone_request", []).append(r)
            print("lone", json.dumps(r), flush=True)
            save()
        engine_models = set(filter(None, (args.engine_models or args.models).split(",")))
        for k in [int(x) for x in args.engine_ks.split(",") if x] if name in engine_models else []:
            if over():
                break
            try:
                r = bench_engine(model, k, args.context, args.hf_new_tokens * 2)
            except Exception as e:  # noqa: BLE001
                r = {"k": k, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            entry.setdefault("engine", []).append(r)
            print("engine", json.dumps(r), flush=True)
            save()
        del model
        if args.hf and name in hf_models and jax.default_backend() == "gpu":
            for b in [int(x) for x in args.hf.split(",")]:
                if over():
                    break
                try:
                    r = bench_hf(cfg, b, args.context, args.hf_new_tokens)
                except Exception as e:  # noqa: BLE001
                    r = {"batch": b, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                entry["hf"].append(r)
                print("hf", json.dumps(r), flush=True)
                save()
    save()
    print_table(result)
    return 0


def hf_only(args) -> int:
    """transformers' greedy generation for each model and batch, alone in this process (no JAX device use)."""
    import datetime
    import os

    import torch

    out = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "models": {}}
    import transformers

    out["transformers"] = transformers.__version__
    try:
        import fla

        out["fla"] = getattr(fla, "__version__", "installed")
    except ImportError:
        out["fla"] = None
    for name in args.models.split(","):
        cfg = shapes.config(name)
        out["models"][name] = []
        for b in [int(x) for x in args.hf.split(",")]:
            try:
                r = bench_hf(cfg, b, args.context, args.hf_new_tokens)
            except Exception as e:  # noqa: BLE001
                r = {"batch": b, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            out["models"][name].append(r)
            print("hf", name, json.dumps(r), flush=True)
            write_json(args.out, out)
    return 0


def print_table(result: dict) -> None:
    print(f"\n{result['device']} | jax {result['jax']} | {result['date']} | HBM {result['hbm_bytes_per_s'] / 1e9:.0f} GB/s")
    print(f"{'model':18s} {'B':>3s} {'k':>2s} {'step ms':>8s} {'x k=0':>6s} {'roofline':>8s} {'tok/s@AL':>9s} "
          f"{'x plain':>7s} {'bound':>6s} {'compile s':>9s}")
    for name, e in result["models"].items():
        base = {s["batch"]: s for s in e["steps"] if s.get("k") == 0 and "error" not in s}
        for s in e["steps"]:
            if "error" in s:
                print(f"{name:18s} {s['batch']:3d} {s['k']:2d} error: {s['error'][:60]}")
                continue
            b0 = base.get(s["batch"])
            ratio = s["step_ms"] / b0["step_ms"] if b0 else math.nan
            speed = s["tokens_per_s_at_published_al"] / b0["tokens_per_s_at_published_al"] if b0 else math.nan
            print(f"{name:18s} {s['batch']:3d} {s['k']:2d} {s['step_ms']:8.2f} {ratio:6.2f} "
                  f"{s['roofline_fraction']:8.0%} {s['tokens_per_s_at_published_al']:9.0f} {speed:7.2f} "
                  f"{s.get('tokens_ratio_bound', math.nan):6.2f} {s['compile_s']:9.1f}")
        for r in e.get("ab", []):
            if "error" in r:
                print(f"{name:18s} {r['batch']:3d} {r['k']:2d} A/B error: {r['error'][:60]}")
                continue
            base = r["variants"][0]["step_ms"]
            for v in r["variants"]:
                rounds = " ".join(f"{t:.2f}" for t in v["round_step_ms"])
                print(f"{name:18s} {r['batch']:3d} {r['k']:2d} {v['step_ms']:8.3f} {v['step_ms'] / base:6.3f} "
                      f"{v['roofline_fraction']:8.0%}  A/B [{v['override'] or 'default'}] rounds: {rounds}")
        for p in e["prefill"]:
            for v in p.get("variants", [p] if "error" not in p else []):
                label = f"  A/B [{v['override'] or 'default'}]" if "override" in v else ""
                print(f"{name:18s} prefill {p['prompt_len']:6d} tokens: {v['tokens_per_s']:9.0f} tok/s{label}")
        for r in e.get("engine", []):
            if "error" not in r:
                print(f"{name:18s} engine k={r['k']}: {r['decode_tokens_per_s']:.0f} tok/s after the first chunk, "
                      f"{r['new_tokens']} tokens in {r['seconds']:.2f} s (prompt {r['prompt_len']})")
        for h in e["hf"]:
            if "error" not in h:
                print(f"{name:18s} transformers B={h['batch']}: {h['tokens_per_s']:.1f} tok/s")


if __name__ == "__main__":
    sys.exit(main())
