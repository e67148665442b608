#!/usr/bin/env python
"""Prefix caching against none, one process, the same engine settings: time to first token and throughput.

    python scripts/bench_prefix_cache.py --out prefix_cache.json                          # the default model, CPU
    python scripts/bench_prefix_cache.py --random-model qwen3.5-4b --system 8192 --out x.json   # a released shape

Three workloads, each run on an engine with the prefix cache (``Engine(prefix_cache_memory=--cache-memory)``) and on
one without, alternating:

* **shared system prompt:** ``--requests`` requests whose prompts are one ``--system``-token prefix plus a
  distinct ``--user``-token question; one request first (it fills the cache), then the rest one at a time (TTFT
  p50 / p99 of those) and then all together (wall time and output tokens/s);
* **multi-turn chat:** ``--turns`` turns on a growing history (each prompt = the previous prompt + its answer + a
  new ``--user``-token message); TTFT of each turn;
* **no hits:** ``--requests`` - 1 distinct prompts of ``--system`` + ``--user`` tokens sharing nothing, all together
  (the cost of the cache when it never helps: publishing snapshots, the index; wall time, output tokens/s, TTFT),
  ``--rounds`` rounds with the engines alternating, new prompts each round; the ratio is of the median rounds.

``--workloads`` picks some of them (``shared``, ``chat``, ``none``).

Token ids are random (the model's vocabulary), so the outputs are not meaningful text; with the cache the tokens
must equal those without (checked per workload: ``tokens_equal``, and ``equal_token_share``, the share of tokens before
each request's first difference). JSON as the other benchmarks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import jaxmtp  # noqa: E402
from jaxmtp.benchmarking import run_metadata, write_json  # noqa: E402
from jaxmtp.engine import Engine  # noqa: E402
from jaxmtp.sampling import SamplingParams  # noqa: E402
from jaxmtp.serve import bytes_or_auto  # noqa: E402


def serve(eng: Engine, prompts, max_new: int):
    """Run ``prompts`` together: (tokens per prompt, TTFT seconds per prompt, wall seconds, cached tokens)."""
    t0 = time.perf_counter()
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for p in prompts]
    out, first, cached = {r: [] for r in rids}, {}, {}
    while eng.has_work():
        for o in eng.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            out[o.request_id] += o.token_ids
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
    return [out[r] for r in rids], [first[r] for r in rids], time.perf_counter() - t0, [cached[r] for r in rids]


def equal_share(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens two runs' outputs (one list per request) share before each request's first difference, over all."""
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b))
    return same / max(1, sum(map(len, a)))


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    ap.add_argument("--random-model", default=None, help="a released shape with random weights instead")
    ap.add_argument("--system", type=int, default=2048, help="tokens of the shared system prompt")
    ap.add_argument("--user", type=int, default=32, help="tokens of each question / chat message")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--cache-memory", type=bytes_or_auto, default="auto",
                    help="the cached engine's pool, e.g. 8GiB (default auto; with two engines in one process give a "
                    "size: auto sizes from the device as if the engine were alone)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the no-hit workload, the engines alternating")
    ap.add_argument("--workloads", default="shared,chat,none",
                    help="which to run, comma-separated: shared (system prompt), chat, none (no hits)")
    ap.add_argument("--out", default="bench_prefix_cache.json")
    args = ap.parse_args(argv)
    workloads = set(args.workloads.split(","))
    if not workloads or not workloads <= {"shared", "chat", "none"}:
        ap.error(f"--workloads takes shared, chat and none, got {args.workloads!r}")
    if args.random_model:
        from jaxmtp.serving.random_model import random_model

        model = random_model(args.random_model)
    else:
        model = jaxmtp.load(args.model, progress=False)
    vocab = model.config.vocab_size - 2
    context = args.system + args.turns * (args.user + args.max_new) + args.user + 64
    kw = dict(num_slots=args.slots, max_context=context, num_draft_tokens=args.k)
    engines = {"cache": Engine(model, prefix_cache_memory=args.cache_memory, **kw),
               "none": Engine(model, **kw)}
    for eng in engines.values():
        eng.warmup()
    rng = np.random.default_rng(0)
    system = rng.integers(0, vocab, args.system).tolist()
    questions = [rng.integers(0, vocab, args.user).tolist() for _ in range(args.requests)]
    messages = [rng.integers(0, vocab, args.user).tolist() for _ in range(args.turns)]
    result = {**run_metadata(), "args": vars(args), "model": model.path or args.random_model,
              "cache_pool_bytes": engines["cache"].plan.prefix_cache}
    tokens = {}
    for name, eng in engines.items() if "shared" in workloads else ():  # shared system prompt
        first, ttft1, _, _ = serve(eng, [system + questions[0]], args.max_new)
        seq = [serve(eng, [system + q], args.max_new) for q in questions[1:]]
        together = serve(eng, [system + q for q in questions[1:]], args.max_new)
        tokens[name, "shared"] = [first[0]] + [s[0][0] for s in seq] + together[0]
        ttfts = [s[1][0] for s in seq]
        result.setdefault("shared_system", {})[name] = {
            "first_ttft_s": ttft1[0], "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "cached_tokens": [s[3][0] for s in seq], "together_wall_s": together[2],
            "together_tokens_per_s": sum(map(len, together[0])) / together[2]}
    for name, eng in engines.items() if "chat" in workloads else ():  # multi-turn chat
        history, ttfts, cached, outs = system[:256], [], [], []  # a chat with a short system prompt of its own
        for msg in messages:
            history = history + msg
            out, ttft, _, c = serve(eng, [history], args.max_new)
            history = history + out[0]
            ttfts.append(ttft[0])
            cached.append(c[0])
            outs.append(out[0])
        tokens[name, "chat"] = outs
        result.setdefault("chat", {})[name] = {"ttft_s": ttfts, "cached_tokens": cached}
    for _ in range(args.rounds) if "none" in workloads else ():  # nothing shared: the cache's cost alone
        distinct = [rng.integers(0, vocab, args.system + args.user).tolist() for _ in range(args.requests - 1)]
        for name, eng in engines.items():  # alternating, on prompts no round has seen (the cache never hits)
            out, ttfts, wall, cached = serve(eng, distinct, args.max_new)
            tokens.setdefault((name, "none"), []).extend(out)  # every round's outputs are compared
            runs = result.setdefault("no_hits", {}).setdefault(name, [])
            runs.append({"wall_s": wall, "tokens_per_s": sum(map(len, out)) / wall, "ttft_p50_s": pct(ttfts, 50),
                         "ttft_p99_s": pct(ttfts, 99), "cached_tokens": sum(cached)})
    if "no_hits" in result:  # the median round's throughput of each
        median = {n: float(np.median([r["tokens_per_s"] for r in runs])) for n, runs in result["no_hits"].items()}
        result["no_hits_throughput_ratio"] = median["cache"] / median["none"]
    # per workload: whether the outputs with the cache equal those without, and the share of equal tokens
    ran = [w for engine, w in tokens if engine == "cache"]
    result["tokens_equal"] = {w: tokens["cache", w] == tokens["none", w] for w in ran}
    result["equal_token_share"] = {w: equal_share(tokens["cache", w], tokens["none", w]) for w in ran}
    result["prefix_cache_stats"] = engines["cache"].prefix_cache_stats()
    s = result.get("shared_system")
    if s and s["cache"]["ttft_p50_s"] and s["none"]["ttft_p50_s"]:
        result["ttft_p50_ratio_cache_over_none"] = s["cache"]["ttft_p50_s"] / s["none"]["ttft_p50_s"]
        result["together_throughput_ratio"] = s["cache"]["together_tokens_per_s"] / s["none"]["together_tokens_per_s"]
    write_json(args.out, result)
    print({k: v for k, v in result.items() if k in ("tokens_equal", "ttft_p50_ratio_cache_over_none",
                                                     "together_throughput_ratio", "no_hits_throughput_ratio")})
    if s:
        print("shared system:", {n: {k: round(v, 4) for k, v in e.items() if isinstance(v, float)}
                                 for n, e in s.items()})
    if "chat" in result:
        print("chat ttft:", {n: [round(x, 3) for x in e["ttft_s"]] for n, e in result["chat"].items()})
    if "no_hits" in result:
        print("no hits, tokens/s per round:", {n: [round(r["tokens_per_s"], 2) for r in runs]
                                               for n, runs in result["no_hits"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
