#!/usr/bin/env python
"""Build a hot draft vocabulary (jaxmtp.draft_vocab): the N token ids most frequent in text like the traffic.

    python scripts/build_draft_vocab.py --model /path/to/Qwen3.5-4B --size 32768 --out draft_vocab.json \
        corpus/ more_text.txt chats.jsonl --jsonl-key text

Reads the checkpoint's tokenizer (no weights), tokenizes every file given (folders: their files, recursively;
``.jsonl``: the ``--jsonl-key`` field of each line, else the whole line), counts token ids and keeps the ``--size``
most frequent, plus the end-of-sequence ids. Writes ``{"ids": [...], ...}`` with the share of counted tokens the set
covers. Serve with ``python -m jaxmtp.serve --model DIR --draft-vocab draft_vocab.json`` or
``jaxmtp.load(DIR, draft_vocab="draft_vocab.json")``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxmtp.config import Qwen35Config  # noqa: E402
from jaxmtp.draft_vocab import count_tokens, coverage, most_frequent  # noqa: E402
from jaxmtp.loaded_model import _load_tokenizer, _read_json, eos_token_ids  # noqa: E402


def iter_files(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for name in sorted(files):
                    yield os.path.join(root, name)
        elif os.path.isfile(p):
            yield p
        else:
            raise SystemExit(f"no such file or folder: {p}")


def iter_texts(paths, jsonl_key: str | None, skipped: list):
    for path in iter_files(paths):
        try:
            with open(path, encoding="utf-8") as f:
                if path.endswith(".jsonl"):
                    for line in f:
                        if line.strip():
                            yield json.loads(line)[jsonl_key] if jsonl_key else line
                else:
                    yield f.read()
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError) as e:
            skipped.append(f"{path} ({type(e).__name__})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="text files or folders (.jsonl: one record per line)")
    ap.add_argument("--model", required=True, help="checkpoint directory (its tokenizer.json and config.json)")
    ap.add_argument("--size", type=int, default=32768, help="ids to keep (default 32768)")
    ap.add_argument("--jsonl-key", default=None, help="field of each .jsonl record holding the text")
    ap.add_argument("--out", default="draft_vocab.json")
    args = ap.parse_args(argv)
    cfg = Qwen35Config.from_pretrained(args.model)
    tok = _load_tokenizer(args.model)
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer.json")
    if not 0 < args.size <= cfg.vocab_size:
        raise SystemExit(f"--size must be in 1..{cfg.vocab_size} (the vocabulary)")
    t0, n_texts, skipped = time.time(), 0, []

    def texts():
        nonlocal n_texts
        for text in iter_texts(args.paths, args.jsonl_key, skipped):
            n_texts += 1
            if n_texts % 1000 == 0:
                print(f"{n_texts} texts tokenized ({time.time() - t0:.0f} s)", file=sys.stderr)
            yield text

    counts = count_tokens(tok, texts())
    if skipped:
        print(f"skipped {len(skipped)} file(s) that are not UTF-8 text or lack --jsonl-key, e.g. {skipped[0]}",
              file=sys.stderr)
    total = sum(counts.values())
    if not total:
        raise SystemExit("no tokens counted: the inputs are empty")
    ids = most_frequent(counts, args.size, always=eos_token_ids(cfg, _read_json(os.path.join(args.model, "generation_config.json"))))
    out = {"ids": ids.tolist(), "size": int(ids.size), "vocab_size": cfg.vocab_size, "texts": n_texts,
           "skipped_files": len(skipped),
           "tokens_counted": total, "distinct_tokens_seen": len(counts), "coverage": coverage(counts, ids)}
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"{args.out}: {ids.size} ids cover {out['coverage']:.2%} of {total} tokens in {n_texts} texts "
          f"({len(counts)} distinct ids seen)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
