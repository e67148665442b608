#!/usr/bin/env python
"""Print the engine's memory plan (weights, per-slot carries, verify transients) for Qwen3.5 shapes as markdown.

    python scripts/memory_table.py [--slots 8] [--context 8192] [--k 3] [--model PATH ...]
    python scripts/memory_table.py --per-device     # one device's share under tensor / expert parallelism
    python scripts/memory_table.py --quantization fp8   # block-FP8 weights (the official FP8 checkpoints)

Weights exclude the serving layout's quantised draft head (V x H / 2 bytes as int4, V x H as int8, on every
device).
"""

import argparse

import jaxmtp
from jaxmtp import shapes
from jaxmtp.engine.memory import memory_plan
from jaxmtp.fp8 import STANDARD


def mib(b):
    return f"{b / 2**20:,.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--model", action="append", default=[], help="also a checkpoint directory (e.g. the default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="weights in block FP8 where the official FP8 checkpoints have them (jaxmtp.fp8)")
    ap.add_argument("--per-device", action="store_true",
                    help="one device's plan for the layouts docs/engine.md recommends (TP / EP degrees)")
    args = ap.parse_args()
    if args.per_device:
        return per_device(args)
    rows = [(n, shapes.config(n)) for n in shapes.names() if n != "qwen3.5-9b"]
    for path in args.model:
        rows.insert(0, (path, jaxmtp.Qwen35Config.from_pretrained(path)))
    print(f"slots = {args.slots}, context = {args.context} tokens, k = {args.k}, {args.dtype}"
          f"{', FP8 weights' if args.quantization else ''}; MiB\n")
    print("| model | weights | KV / slot | MTP KV / slot | GDN state / slot | conv / slot | verify window / slot "
          "(transient) | logits / slot (transient) | total |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, cfg in rows:
        p = memory_plan(cfg, args.slots, args.context, args.k, args.dtype, fp8=STANDARD if args.quantization else None)
        print(f"| {name} | {mib(p.weights)} | {mib(p.kv_per_slot)} | {mib(p.mtp_kv_per_slot)} | "
              f"{mib(p.gdn_state_per_slot)} | {mib(p.conv_per_slot)} | {mib(p.verify_window_per_slot)} | "
              f"{mib(p.logits_per_slot)} | {mib(p.total)} |")


LAYOUTS = [("qwen3.5-27b", 1), ("qwen3.5-27b", 2), ("qwen3.5-27b", 4), ("qwen3.5-35b-a3b", 1),
           ("qwen3.5-35b-a3b", 2), ("qwen3.5-122b-a10b", 4), ("qwen3.5-122b-a10b", 8), ("qwen3.5-397b-a17b", 8)]


def per_device(args):
    from jaxmtp.parallel import local_config, rank_weight_bytes

    print(f"slots = {args.slots}, context = {args.context} tokens, k = {args.k}, {args.dtype}"
          f"{', FP8 weights' if args.quantization else ''}; MiB per device\n")
    print("| model | TP / EP | weights | KV / slot | MTP KV / slot | GDN state / slot | total |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, tp in LAYOUTS:
        cfg = shapes.config(name)
        weights = rank_weight_bytes(cfg, tp, args.dtype, include_mtp=args.k > 0,
                                    fp8=STANDARD if args.quantization else None)
        p = memory_plan(local_config(cfg, tp), args.slots, args.context, args.k, args.dtype, weights=weights)
        print(f"| {name} | {tp} | {mib(p.weights)} | {mib(p.kv_per_slot)} | {mib(p.mtp_kv_per_slot)} | "
              f"{mib(p.gdn_state_per_slot)} | {mib(p.total)} |")


if __name__ == "__main__":
    main()
