#!/usr/bin/env python
"""Acceptance and speedup of MTP speculative decoding with the shipped default model, on held-out code.

    python scripts/bench_default_model.py [--prompts-out P.json | --prompts P.json] [--out R.json]

Prompts are held-out standard-library functions (the split of ``scripts/train_small.py``, chosen by
``scripts/eval_default_model.py``: the lines up to a ``def`` line in the middle of a held-out file). For
k = 0..4 every prompt is generated greedily through ``jaxmtp.generate`` (one slot, so each request runs alone: the
batch-1 latency case; ``--slots 8`` also runs the batched case), after a warm-up pass that compiles. Reported: the
mean acceptance length and acceptance per draft position (from the engine's per-request statistics), output tokens
per second and the speedup over k = 0, and whether every output equals the k = 0 output (it must).
``--prompts-out`` writes the prompts (for a machine whose stdlib lacks the held-out files); ``--prompts`` reads them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def held_out_prompts(n: int, stdlib: str | None):
    import eval_default_model
    import train_small

    _, files = train_small.list_corpus(stdlib)
    return [{"file": rel, "text": text} for rel, text in eval_default_model.pick_prompts(files, n)]


def run(model, prompts, k: int, slots: int, max_new: int) -> dict:
    import jaxmtp

    texts = [p["text"] for p in prompts]
    kw = dict(max_new_tokens=max_new, num_draft_tokens=k, num_slots=slots, max_context=1024)
    jaxmtp.generate(model, texts, **kw)  # compile every shape this prompt set needs (prefill buckets vary)
    t0 = time.perf_counter()
    res = jaxmtp.generate(model, texts, **kw)
    wall = time.perf_counter() - t0
    steps = sum(r.stats["steps"] for r in res)
    accepted = sum(r.stats["accepted"] for r in res)
    per_pos = [sum(r.stats["acceptance_per_position"][i] * r.stats["steps"] for r in res) / max(steps, 1)
               for i in range(k)]
    tokens = sum(len(r.token_ids) for r in res)
    return {"k": k, "slots": slots, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "mean_acceptance_length": (steps + accepted) / max(steps, 1), "acceptance_per_position": per_pos,
            "outputs": [r.token_ids for r in res]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--slots", default="1", help="slot counts to run, e.g. 1,8")
    ap.add_argument("--ks", default="0,1,2,3,4")
    ap.add_argument("--stdlib", default=None, help="standard library root (default: this interpreter's)")
    ap.add_argument("--prompts", default=None, help="read prompts from this JSON instead of the stdlib")
    ap.add_argument("--prompts-out", default=None, help="write the prompts to this JSON and exit")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-head-bits", type=int, default=None, choices=[4, 8],
                    help="the drafts' copy of the LM head (default: the engine's)")
    ap.add_argument("--override", default="", help="backend fields to set, e.g. out_matmul=xla (A/B of a kernel)")
    ap.add_argument("--out", default="bench_default_model.json")
    args = ap.parse_args(argv)

    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
    else:
        prompts = held_out_prompts(args.num_prompts, args.stdlib)
    if args.prompts_out:
        with open(args.prompts_out, "w") as f:
            json.dump(prompts, f)
        print(f"wrote {len(prompts)} prompts to {args.prompts_out}")
        return 0

    import jax

    import jaxmtp
    from jaxmtp.mtp import describe_draft_head

    from jaxmtp.pallas import override_backend

    model = jaxmtp.load(None, dtype=args.dtype, progress=False, draft_head_bits=args.draft_head_bits)
    if args.override:  # loaded again: the backend decides the params' layout
        model = jaxmtp.load(None, dtype=args.dtype, progress=False, draft_head_bits=args.draft_head_bits,
                            backend=override_backend(model.backend, args.override))
    dev = jax.devices()[0]
    out = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "python": platform.python_version(), "dtype": args.dtype,
           "backend": str(model.backend),
           "draft_head": describe_draft_head(model.params, model.config.vocab_size),
           "command": " ".join(["scripts/bench_default_model.py"] + sys.argv[1:]),
           "prompts": [p["file"] for p in prompts], "runs": []}
    for slots in [int(s) for s in args.slots.split(",")]:
        base = None
        for k in [int(x) for x in args.ks.split(",")]:
            r = run(model, prompts, k, slots, args.max_new_tokens)
            if k == 0:
                base = r
            r["equal_to_k0"] = base is not None and r["outputs"] == base["outputs"]
            r["speedup_vs_k0"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
            out["runs"].append({x: y for x, y in r.items() if x != "outputs"})
            print(json.dumps(out["runs"][-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    print(f"\n{out['device']} | jax {out['jax']} | {out['date']} | {len(prompts)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, greedy, {args.dtype}")
    print(f"{'slots':>5s} {'k':>2s} {'AL':>5s} {'accept per position':28s} {'tok/s':>8s} {'speedup':>7s} {'== k0':>5s}")
    for r in out["runs"]:
        pos = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        print(f"{r['slots']:5d} {r['k']:2d} {r['mean_acceptance_length']:5.2f} {pos:28s} {r['tokens_per_s']:8.1f} "
              f"{r['speedup_vs_k0']:7.2f} {str(r['equal_to_k0']):>5s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
