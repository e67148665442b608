"""Hot draft vocabulary: the MTP drafts choose among N frequent tokens instead of the whole vocabulary.

At batch 1 a draft costs mostly the read of the head that scores it (the 4B's 248k x 2560 head: 636 MB in int8 per
draft, most of the extra cost of a k = 3 verify step). A draft head restricted to the N
most frequent tokens reads N / V of that (FR-Spec, arXiv 2502.14856; EAGLE-3 and SGLang's ``--speculative-token-map``
do the same). Outputs are unchanged: the target model verifies every draft with its full head, and a draft is only
accepted when it equals the token the target picks, so a token outside the hot set merely ends the accepted run
there. What it can change is the acceptance length (a draft that should have been a rare token is wrong).

Which tokens are hot depends on the text a deployment serves, so the list is an input, never guessed:
``jaxmtp.load(path, draft_vocab=...)`` / ``serve --draft-vocab FILE`` take token ids, best built from the model's own
tokenizer over text like the traffic with ``scripts/build_draft_vocab.py``. Without one the drafts use the full head.

File formats :func:`read_draft_vocab` reads: ``.json`` (a list of ids, or an object with an ``"ids"`` list), ``.npy``
(a 1-D integer array) or text (ids separated by whitespace or commas).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable

import numpy as np

from jaxmtp.config import ConfigError

ROW_MULTIPLE = 128  # the head is padded to a multiple of this many rows (whole tiles for the GPU kernel)


def _load_ids(source) -> np.ndarray:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ConfigError(f"draft vocabulary file {path!r} does not exist")
        if path.endswith(".npy"):
            return np.load(path, allow_pickle=False)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"draft vocabulary {path!r} is not valid JSON: {e}") from None
            return np.asarray(data["ids"] if isinstance(data, dict) and "ids" in data else data)
        try:
            return np.asarray([int(tok) for tok in text.replace(",", " ").split()])
        except ValueError:
            raise ConfigError(f"draft vocabulary {path!r}: expected integer token ids separated by whitespace "
                              "or commas") from None
    return np.asarray(source)


def read_draft_vocab(source, vocab_size: int) -> np.ndarray:
    """Token ids of a hot draft vocabulary from ``source`` (a sequence or array of ids, or a file path; see the
    module doc), checked against ``vocab_size``. Returns them sorted ascending, int32 [N] (ties between equal
    logits then go to the lower id, as with the full head)."""
    ids = _load_ids(source)
    if ids.ndim != 1 or ids.size == 0:
        raise ConfigError(f"a draft vocabulary is a non-empty list of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        if not (np.issubdtype(ids.dtype, np.floating) and np.all(ids == np.round(ids))):
            raise ConfigError(f"draft vocabulary ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ConfigError(f"draft vocabulary holds {bad.size} id(s) outside [0, {vocab_size}), e.g. {int(bad[0])}")
    uniq = np.unique(ids)
    if uniq.size != ids.size:
        raise ConfigError(f"draft vocabulary repeats {ids.size - uniq.size} id(s)")
    return uniq.astype(np.int32)


def padded_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` padded to a multiple of :data:`ROW_MULTIPLE` by repeating the last id. A repeated row scores the same
    logit as its first occurrence, and argmax returns the first, so the drafts are those of the unpadded list."""
    pad = (-ids.size) % ROW_MULTIPLE
    return np.concatenate([ids, np.full(pad, ids[-1], ids.dtype)]) if pad else ids


def most_frequent(counts: Counter | dict, size: int, *, always: Iterable[int] = ()) -> np.ndarray:
    """The ``size`` ids with the highest counts (ties: lower id first), always including ``always`` (e.g. the
    end-of-sequence ids, which every answer ends with). Sorted ascending, int32."""
    keep = {int(i) for i in always}
    if size < len(keep):
        raise ConfigError(f"draft vocabulary size {size} is smaller than the {len(keep)} ids it must include")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    for tok, _ in ranked:
        if len(keep) >= size:
            break
        keep.add(int(tok))
    return np.asarray(sorted(keep), np.int32)


def coverage(counts: Counter | dict, ids) -> float:
    """Fraction of the counted token occurrences whose id is in ``ids``."""
    total = sum(counts.values())
    inside = set(int(i) for i in np.asarray(ids).tolist())
    return sum(c for t, c in counts.items() if int(t) in inside) / total if total else 0.0


def count_tokens(tokenizer, texts: Iterable[str], batch: int = 64) -> Counter:
    """Occurrences of each token id over ``texts`` as a ``tokenizers.Tokenizer`` encodes them (no special tokens)."""
    counts: Counter = Counter()
    buf: list[str] = []

    def flush():
        for enc in tokenizer.encode_batch(buf, add_special_tokens=False):
            counts.update(enc.ids)
        buf.clear()

    for text in texts:
        buf.append(text)
        if len(buf) >= batch:
            flush()
    if buf:
        flush()
    return counts
