#!/usr/bin/env python
"""What does a hot draft vocabulary cost in acceptance? Measured on the shipped default model (or ``--model``).

    python scripts/eval_draft_vocab.py --sizes 256,512,1024,2048 --out draft_vocab_eval.json

Hot sets are counted on the training split of ``scripts/train_small.py``'s corpus (the stdlib) with the model's own
tokenizer (``jaxmtp.draft_vocab.most_frequent``) and judged on the held-out split, for each size and for the full
vocabulary:

* ``heldout_coverage``: share of held-out tokens inside the hot set;
* ``draft_hits``: teacher-forced, how often the MTP draft (``Model.draft_logits``, int8 head restricted to the set)
  equals the target's greedy next-next token, over windows of held-out text (what the first draft's acceptance
  follows);
* ``acceptance_length``: tokens per verify step (accepted drafts + 1) of real greedy generation with k drafts from
  held-out code prompts (``jaxmtp.generate``), and that its output equals the full vocabulary's, token for token.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import eval_default_model  # noqa: E402  (held-out prompts)
import train_small  # noqa: E402  (the corpus and its held-out rule)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--sizes", default="256,512,1024,2048")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows for the teacher-forced hit rate")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--out", default="draft_vocab_eval.json")
    args = ap.parse_args(argv)

    import jax

    import jaxmtp
    from jaxmtp.draft_vocab import count_tokens, coverage, most_frequent

    t0 = time.perf_counter()
    base = jaxmtp.load(args.model, dtype="float32", progress=False)
    tok = base.tokenizer
    if tok is None or not base.config.has_mtp:
        raise SystemExit("needs a checkpoint with a tokenizer and an MTP head")
    train, heldout = train_small.list_corpus(heldout_permille=30)
    train_counts = count_tokens(tok, (t for _, t in train))
    held_counts = count_tokens(tok, (t for _, t in heldout))
    stream = eval_default_model.heldout_stream(tok, heldout)
    n_win = min(args.windows, (len(stream) - 1) // args.seq)
    step = ((len(stream) - 1) // args.seq) // max(n_win, 1)
    windows = np.stack([stream[i * step * args.seq : (i * step + 1) * args.seq] for i in range(n_win)])
    target_next = base.logits(windows)[:, 1:].argmax(-1)  # row p: the target's greedy token p+2 (row p+1's)
    prompts = [p for _, p in eval_default_model.pick_prompts(heldout, args.prompts)]
    gen = dict(max_new_tokens=args.new_tokens, num_draft_tokens=args.k, ignore_eos=True, num_slots=len(prompts))
    reference = None
    rows = []
    sizes = [int(s) for s in args.sizes.split(",") if s] + [None]
    for size in sizes:
        if size is None:
            model, ids = base, None
        else:
            ids = most_frequent(train_counts, size, always=base.eos_token_ids)
            model = jaxmtp.load(args.model, dtype="float32", progress=False, draft_vocab=ids)
        draft = np.concatenate([model.draft_logits(windows[i : i + 4]).argmax(-1) for i in range(0, n_win, 4)])
        hits = float(np.mean(draft == target_next))  # draft row p also predicts token p+2
        results = jaxmtp.generate(model, prompts, **gen)
        toks = [r.token_ids for r in results]
        if reference is None and size is None:
            reference = toks
        row = {"size": size or model.config.vocab_size, "share_of_vocab": (size or model.config.vocab_size)
               / model.config.vocab_size,
               "train_coverage": 1.0 if ids is None else coverage(train_counts, ids),
               "heldout_coverage": 1.0 if ids is None else coverage(held_counts, ids),
               "draft_hits": hits, "acceptance_length": eval_default_model.acceptance_length(results),
               "_tokens": toks}
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "_tokens"},
              flush=True)
    for row in rows:
        row["same_tokens_as_full"] = row.pop("_tokens") == reference
    out = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].platform, "jax": jax.__version__,
           "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "k": args.k,
           "windows": int(n_win), "seq": args.seq, "prompts": len(prompts), "new_tokens": args.new_tokens,
           "vocab_size": base.config.vocab_size, "train_tokens": sum(train_counts.values()),
           "heldout_tokens": sum(held_counts.values()), "rows": rows, "seconds": time.perf_counter() - t0}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
