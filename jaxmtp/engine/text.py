"""Host-side text: incremental detokenisation and stop strings matched across chunk boundaries.

Both do work proportional to the new tokens / new text of each engine output, never to the output so far: a long
request costs the engine thread the same per iteration at its 10th token as at its 10,000th.
"""

from __future__ import annotations

from typing import Sequence

MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_BYTES = 16384  # total UTF-8 bytes of a request's stop strings


def check_stop_strings(stops: Sequence[str]) -> None:
    """Raise ValueError if a request's stop strings pass :data:`MAX_STOP_STRINGS` or :data:`MAX_STOP_BYTES`."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
    total = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
    if total > MAX_STOP_BYTES:
        raise ValueError(f"the stop strings total {total} bytes (UTF-8), more than the limit of {MAX_STOP_BYTES}")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (from ``prefix_offset``) each time and holds back text that ends in an incomplete
    UTF-8 sequence (U+FFFD), so multi-byte characters split across tokens are emitted once complete. The text itself
    is not kept: ``n_chars`` counts the characters emitted so far.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.n_chars = 0
        self._window = (0, 0)  # (prefix_offset, characters before it) of the last add, for tokens_covering

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids) -> str:
        """Append ids; returns the newly complete text."""
        self.ids.extend(int(i) for i in new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        self._window = (self.prefix_offset, self.n_chars - len(prefix))
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.n_chars += len(delta)
            return delta
        return ""

    def flush(self) -> str:
        """Everything not yet emitted (used when the request ends)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.n_chars += len(delta)
        self.prefix_offset = self.read_offset = len(self.ids)
        return delta

    def tokens_covering(self, n_chars: int) -> int:
        """The fewest leading tokens whose decoded text is at least ``n_chars`` long, for ``n_chars`` within the text
        of the last :meth:`add` (decodes only that call's window)."""
        start, before = self._window
        for n in range(max(start, 1), len(self.ids) + 1):
            if before + len(self._decode(self.ids[start:n])) >= n_chars:
                return n
        return len(self.ids)


class StopMatcher:
    """Finds stop strings in text fed piece by piece (an Aho-Corasick automaton over the stop strings).

    :meth:`feed` costs O(len(text)) per piece whatever the number and length of the stop strings (building the
    automaton costs O(their total length), once per request). ``held`` is the length of the longest tail of the text
    so far that is a proper prefix of some stop string: text that must not be streamed yet.

    A stop string is found as soon as its last character arrives: where several end at the same character, the
    longest wins (they all end the text at the same place, before the one that starts first).
    """

    def __init__(self, stops: Sequence[str]):
        goto: list[dict[str, int]] = [{}]
        depth, term = [0], [0]
        for s in stops:
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    term.append(0)
                node = nxt
            term[node] = len(s)
        fail, out = [0] * len(goto), list(term)  # out[n]: the longest stop string that is a suffix of node n
        order = list(goto[0].values())
        for node in order:  # breadth first: a node's failure link is shallower, so already final
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                link = goto[f].get(ch, 0) if node else 0
                fail[child] = link
                out[child] = term[child] or out[link]
                order.append(child)
        self._goto, self._fail, self._depth, self._out = goto, fail, depth, out
        self._state = 0

    @property
    def held(self) -> int:
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advance over ``text``. Returns ``(end, length)`` of the first stop string completed in it (``end``: the
        characters of ``text`` up to and including its last one), or None (then ``held`` is up to date)."""
        goto, fail, out = self._goto, self._fail, self._out
        state = self._state
        for i, ch in enumerate(text):
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            if out[state]:
                self._state = state
                return i + 1, out[state]
        self._state = state
        return None
