"""Host-side text: incremental detokenisation and stop strings matched across chunk boundaries."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (from ``prefix_offset``) each time and holds back text that ends in an incomplete
    UTF-8 sequence (U+FFFD), so multi-byte characters split across tokens are emitted once complete.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Everything not yet emitted (used when the request ends)."""
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self.prefix_offset = self.read_offset = len(self.ids)
        return delta

    def tokens_covering(self, n_chars: int) -> int:
        """The fewest leading tokens whose decoded text is at least ``n_chars`` long."""
        lo, hi = 0, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self.ids[:mid])) >= n_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo


def find_stop(text: str, stops, start: int) -> tuple[int, int] | None:
    """Earliest ``(index, length)`` of any stop string occurring in ``text`` at or after ``start``."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, len(s))
    return best


def held_back(text: str, stops) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string (not safe to stream yet)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
