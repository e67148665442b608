#!/usr/bin/env python
"""Print the engine's memory plan (weights, per-slot carries, verify transients) for Qwen3.5 shapes as markdown.

    python scripts/memory_table.py [--slots 8] [--context 8192] [--k 3] [--model PATH ...]
"""

import argparse

import jaxmtp
from jaxmtp import shapes
from jaxmtp.engine.memory import memory_plan


def mib(b):
    return f"{b / 2**20:,.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--model", action="append", default=[], help="also a checkpoint directory (e.g. the default)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rows = [(n, shapes.config(n)) for n in shapes.names() if n != "qwen3.5-9b"]
    for path in args.model:
        rows.insert(0, (path, jaxmtp.Qwen35Config.from_pretrained(path)))
    print(f"slots = {args.slots}, context = {args.context} tokens, k = {args.k}, {args.dtype}; MiB\n")
    print("| model | weights | KV / slot | MTP KV / slot | GDN state / slot | conv / slot | verify window / slot "
          "(transient) | logits / slot (transient) | total |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, cfg in rows:
        p = memory_plan(cfg, args.slots, args.context, args.k, args.dtype)
        print(f"| {name} | {mib(p.weights)} | {mib(p.kv_per_slot)} | {mib(p.mtp_kv_per_slot)} | "
              f"{mib(p.gdn_state_per_slot)} | {mib(p.conv_per_slot)} | {mib(p.verify_window_per_slot)} | "
              f"{mib(p.logits_per_slot)} | {mib(p.total)} |")


if __name__ == "__main__":
    main()
