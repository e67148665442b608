#!/usr/bin/env python
"""Do the int8 and int4 draft heads, and the int8 MTP layer, draft what the exact head and layer would? On the shipped
default model (or ``--model``).

    python scripts/eval_draft_head.py --out draft_head_agreement.json

Teacher-forced over the first ``--tokens`` tokens of ``--files`` standard-library files: ``Model.draft_logits`` with
the int8 and the int4 draft head (each also with the MTP layer's weights int8, ``jaxmtp.param_layout.quantize_mtp``:
``*_mtp8``; the GPU default for hidden sizes <= 4096 is ``int4_mtp8``) and with ``exact_head=True``, and the whole
model quantised to block FP8 on load (``fp8_int8``: ``jaxmtp.load(..., quantization="fp8")``, its MTP layer FP8
too, the int8 head); reports how often their argmax agree and how often each equals the target's greedy next token
(what acceptance depends on).
Then the acceptance length of real greedy generation with k = 3 from ``--prompts`` held-out code prompts
(``scripts/eval_default_model.py``'s) with each head.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

import jaxmtp  # noqa: E402
from jaxmtp.param_layout import quantize_mtp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eval_default_model  # noqa: E402  (held-out prompts)
import train_small  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default="draft_head_agreement.json")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    heads = {"int8": jaxmtp.load(args.model, dtype="float32", progress=False, draft_head_bits=8),
             "int4": jaxmtp.load(args.model, dtype="float32", progress=False, draft_head_bits=4)}
    for bits in ("int8", "int4"):
        m = heads[bits]
        heads[f"{bits}_mtp8"] = dataclasses.replace(m, params=quantize_mtp(jax.tree.map(lambda a: a, m.params)))
    # the whole model quantised to block FP8 on load (its MTP layer too), drafting with the int8 head
    heads["fp8_int8"] = jaxmtp.load(args.model, dtype="float32", progress=False, draft_head_bits=8, quantization="fp8")
    model = heads["int8"]
    if model.tokenizer is None or "draft_head" not in model.params:
        raise SystemExit("needs a checkpoint with a tokenizer and an MTP head")
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[: args.files]
    n = exact_hits = 0
    same = dict.fromkeys(heads, 0)
    hits = dict.fromkeys(heads, 0)
    for path in paths:
        with open(path, encoding="utf-8", errors="ignore") as f:
            ids = model.tokenizer.encode(f.read()[: 12 * args.tokens]).ids[: args.tokens]
        if len(ids) < 64:
            continue
        e = model.draft_logits([ids], exact_head=True).argmax(-1)
        t = model.logits([ids])[:, 1:].argmax(-1)
        n += e.size
        exact_hits += int((e == t).sum())
        for name, m in heads.items():
            q = m.draft_logits([ids]).argmax(-1)
            same[name] += int((q == e).sum())
            hits[name] += int((q == t).sum())
    _, heldout = train_small.list_corpus(heldout_permille=30)
    prompts = [p for _, p in eval_default_model.pick_prompts(heldout, args.prompts)]
    exact_model = dataclasses.replace(model, params={k: v for k, v in model.params.items() if k != "draft_head"})
    acceptance = {}
    for name, m in {"exact": exact_model, **heads}.items():
        rs = jaxmtp.generate(m, prompts, max_new_tokens=args.new_tokens, num_draft_tokens=3, ignore_eos=True,
                             num_slots=len(prompts))
        acceptance[name] = eval_default_model.acceptance_length(rs)
    out = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].platform, "jax": jax.__version__,
           "command": " ".join(sys.argv), "positions": n, "exact_equals_target": exact_hits / n,
           **{f"{h}_equals_exact": same[h] / n for h in heads}, **{f"{h}_equals_target": hits[h] / n for h in heads},
           "acceptance_length_k3": acceptance, "prompts": len(prompts), "new_tokens": args.new_tokens}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
