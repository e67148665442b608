#!/usr/bin/env python
"""Evaluate a checkpoint (the shipped default model unless --model is given) on held-out standard-library code.

    python scripts/eval_default_model.py [--model DIR] [--json OUT.json] [--max-windows N] [--dtype float32]

Held-out files are those of the running interpreter's stdlib that ``scripts/train_small.py`` holds out (the same
path-hash rule), tokenized with the checkpoint's own tokenizer and joined with EOS as in training, then cut into
non-overlapping windows of ``--seq`` tokens. Everything goes through the public API, ``jaxmtp.load(...)``:

* ``Model.logits`` gives the target's next-token loss and top-1 accuracy;
* ``Model.draft_logits`` (teacher-forced MTP: row p sees token p+1 and the target's final-normed hidden at p)
  gives the MTP head's **top-1 agreement with the target's greedy next-next token**,
  ``mean(argmax draft[p] == argmax logits[p+1])``, the quantity that sets the acceptance rate of the first draft
  under greedy speculative decoding; plus the MTP loss against the true token p+2.

It also writes greedy continuations of held-out code prompts (a plain prefill + one-token decode loop over
``jaxmtp.model.forward`` with a carry; no speculation). Results go to ``--json`` and a summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import train_small  # noqa: E402  (the corpus listing and held-out rule)


def heldout_stream(tok, files) -> np.ndarray:
    ids = []
    for e in tok.encode_batch([t for _, t in files], add_special_tokens=False):
        ids.extend(e.ids)
        ids.append(train_small.EOS_ID)
    return np.asarray(ids, np.int32)


def teacher_forced(model, windows: np.ndarray, batch: int, progress: bool = True):
    from jaxmtp.progress import Progress

    sums = dict(loss=0.0, top1=0.0, mtp_ce=0.0, mtp_top1=0.0, agree=0.0)
    n_tok = n_mtp = 0
    per_pos = np.zeros(windows.shape[1] - 1)
    n_batches = len(windows) // batch
    with Progress(n_batches, "teacher-forced", " batches", enabled=progress) as bar:
        for i in range(n_batches):
            w = windows[i * batch : (i + 1) * batch]
            logits = model.logits(w)  # [B, T, V]
            draft = model.draft_logits(w)  # [B, T-1, V], row p predicts token p+2
            tgt, tgt2 = w[:, 1:], w[:, 2:]
            lp = logits[:, :-1] - _lse(logits[:, :-1])
            sums["loss"] -= float(np.take_along_axis(lp, tgt[..., None], -1).sum())
            sums["top1"] += float((logits[:, :-1].argmax(-1) == tgt).sum())
            dp = draft[:, :-1] - _lse(draft[:, :-1])
            sums["mtp_ce"] -= float(np.take_along_axis(dp, tgt2[..., None], -1).sum())
            sums["mtp_top1"] += float((draft[:, :-1].argmax(-1) == tgt2).sum())
            agree = draft.argmax(-1) == logits[:, 1:].argmax(-1)  # [B, T-1]
            sums["agree"] += float(agree.sum())
            per_pos += agree.sum(0)
            n_tok += tgt.size
            n_mtp += agree.size
            bar.update(1)
    n_mtp_ce = n_batches * batch * (windows.shape[1] - 2)
    out = {
        "heldout_loss": sums["loss"] / n_tok,
        "heldout_top1": sums["top1"] / n_tok,
        "mtp_loss_vs_true_next_next": sums["mtp_ce"] / n_mtp_ce,
        "mtp_top1_vs_true_next_next": sums["mtp_top1"] / n_mtp_ce,
        "mtp_agreement_with_target_greedy": sums["agree"] / n_mtp,
        "scored_next_tokens": int(n_tok),
        "scored_draft_rows": int(n_mtp),
    }
    q = len(per_pos) // 4
    out["mtp_agreement_by_window_quarter"] = [float(per_pos[j * q : (j + 1) * q].sum() / (q * n_batches * batch))
                                              for j in range(4)]
    return out


def _lse(x):
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


def acceptance_length(results) -> float:
    """Tokens per verify step over ``jaxmtp.generate`` results: (accepted drafts + steps) / steps."""
    steps = sum(r.stats["steps"] for r in results)
    return (sum(r.stats["accepted"] for r in results) + steps) / steps


def pick_prompts(files, n: int, context_lines: int = 14):
    """Deterministic prompts: in evenly spaced held-out files, the lines up to and including a ``def`` line in the
    file's middle third (the continuation is the function body the model never saw)."""
    prompts = []
    candidates = [(r, t) for r, t in files if t.count("\n    def ") + t.count("\ndef ") >= 3]
    step = max(1, len(candidates) // max(n, 1))
    for rel, text in candidates[::step][:n]:
        lines = text.split("\n")
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and line.rstrip().endswith(":")]
        if not defs:
            continue
        i = defs[len(defs) // 2]
        # End on the ``def`` line's colon, not after its newline: the byte-level BPE merges a newline with the next
        # line's indentation, so a prompt ending in a bare newline token asks for an unindented line.
        prompts.append((rel, "\n".join(lines[max(0, i - context_lines) : i + 1])))
    return prompts


def greedy_generate(model, prompt_ids: list[list[int]], max_new: int, stop_ids=()):
    """Greedy continuation of each prompt: right-padded prefill, then one token a step with the carry."""
    import jax
    import jax.numpy as jnp

    from jaxmtp.model import forward, init_carry

    cfg, b = model.config, len(prompt_ids)
    lens = np.array([len(p) for p in prompt_ids])
    t = int(lens.max())
    tokens = np.zeros((b, t), np.int32)
    positions = np.full((b, t), -1, np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = p
        positions[i, : len(p)] = np.arange(len(p))
    fwd = jax.jit(lambda params, tok, pos, carry, logits: forward(params, tok, pos, carry, cfg=cfg, logits=logits,
                                                                   backend=model.backend), static_argnums=4)
    carry = init_carry(cfg, b, t + max_new, model.dtype)
    logits, _, carry = fwd(model.params, jnp.asarray(tokens), jnp.asarray(positions), carry, "last")
    out = [[] for _ in range(b)]
    done = np.zeros(b, bool)
    pos = lens.copy()
    nxt = np.asarray(jnp.argmax(logits, -1))
    for _ in range(max_new):
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) in stop_ids
        if done.all():
            break
        logits, _, carry = fwd(model.params, jnp.asarray(nxt[:, None].astype(np.int32)),
                               jnp.asarray(pos[:, None].astype(np.int32)), carry, "last")
        nxt = np.asarray(jnp.argmax(logits, -1))
        pos += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seq", type=int, default=1024, help="window length (the training context)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-windows", type=int, default=None,
                    help="score N evenly spaced windows instead of all (all: ~5 min on 2 CPU cores)")
    ap.add_argument("--heldout-permille", type=int, default=30)
    ap.add_argument("--stdlib", default=None,
                    help="standard-library directory to take the held-out files from (default: this interpreter's; "
                         "use the training interpreter's for exact numbers)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    import jax

    import jaxmtp

    t0 = time.perf_counter()
    model = jaxmtp.load(args.model, dtype=args.dtype, progress=not args.no_progress)
    if model.tokenizer is None:
        raise SystemExit(f"{model.path} has no tokenizer.json")
    stdlib = args.stdlib or train_small.stdlib_dir()
    _, files = train_small.list_corpus(stdlib, heldout_permille=args.heldout_permille)
    stream = heldout_stream(model.tokenizer, files)
    n = (len(stream) - 1) // args.seq
    windows = np.stack([stream[i * args.seq : (i + 1) * args.seq] for i in range(n)])
    if args.max_windows and args.max_windows < len(windows):  # evenly spaced over all held-out files
        windows = windows[np.linspace(0, len(windows) - 1, args.max_windows).round().astype(int)]
    windows = windows[: len(windows) // args.batch * args.batch]
    result = {
        "model": os.path.abspath(model.path),
        "python": sys.version.split()[0],
        "stdlib": stdlib,
        "device": jax.devices()[0].device_kind,
        "dtype": args.dtype,
        "heldout_files": len(files),
        "heldout_tokens": int(len(stream)),
        "windows": int(len(windows)),
        "seq": args.seq,
    }
    result.update(teacher_forced(model, windows, args.batch, progress=not args.no_progress))
    t1 = time.perf_counter()
    prompts = pick_prompts(files, args.prompts)
    ids = [model.tokenizer.encode(p, add_special_tokens=False).ids for _, p in prompts]
    gen = greedy_generate(model, ids, args.new_tokens, stop_ids=model.eos_token_ids)
    result["samples"] = [
        {"file": rel, "prompt": p, "completion": model.tokenizer.decode([i for i in g if i not in model.eos_token_ids])}
        for (rel, p), g in zip(prompts, gen)
    ]
    result["teacher_forced_s"] = round(t1 - t0, 1)
    result["generation_s"] = round(time.perf_counter() - t1, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    for s in result["samples"]:
        print(f"\n===== {s['file']} =====\n{s['prompt']}\033[1m{s['completion']}\033[0m" if sys.stdout.isatty()
              else f"\n===== {s['file']} =====\n{s['prompt']}<<<GENERATED>>>{s['completion']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
