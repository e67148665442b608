#!/usr/bin/env python
"""Does the int8 draft head draft what the exact LM head would? On the shipped default model (or ``--model``).

    python scripts/eval_draft_head.py --out draft_head_agreement.json

Teacher-forced over the first ``--tokens`` tokens of ``--files`` standard-library files: ``Model.draft_logits`` with
the int8 draft head and with ``exact_head=True``; reports how often their argmax agree and how often each equals the
target's greedy next token (what acceptance depends on).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

import jaxmtp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default="draft_head_agreement.json")
    args = ap.parse_args(argv)
    model = jaxmtp.load(args.model, dtype="float32", progress=False)
    if model.tokenizer is None or "draft_head" not in model.params:
        raise SystemExit("needs a checkpoint with a tokenizer and an MTP head")
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[: args.files]
    n = same = int8_hits = exact_hits = 0
    for path in paths:
        with open(path, encoding="utf-8", errors="ignore") as f:
            ids = model.tokenizer.encode(f.read()[: 12 * args.tokens]).ids[: args.tokens]
        if len(ids) < 64:
            continue
        q = model.draft_logits([ids]).argmax(-1)
        e = model.draft_logits([ids], exact_head=True).argmax(-1)
        t = model.logits([ids])[:, 1:].argmax(-1)
        n += q.size
        same += int((q == e).sum())
        int8_hits += int((q == t).sum())
        exact_hits += int((e == t).sum())
    out = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].platform, "jax": jax.__version__,
           "command": " ".join(sys.argv), "positions": n, "int8_equals_exact": same / n,
           "int8_equals_target": int8_hits / n, "exact_equals_target": exact_hits / n}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
