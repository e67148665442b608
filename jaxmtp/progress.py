"""A dependency-free progress bar for long host-side work (conversion, training, benchmarks)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "converting") as p: p.update(1, note="layers.3")`` draws a one-line bar on stderr."""

    def __init__(self, total: int, desc: str, unit: str = "", stream=None, enabled: bool = True, min_interval=0.1):
        self.total, self.desc, self.unit = max(int(total), 1), desc, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.n = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self.min_interval = min_interval

    def update(self, n: int = 1, note: str = "") -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and (now - self._last >= self.min_interval or self.n >= self.total):
            self._last = now
            frac = min(self.n / self.total, 1.0)
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            elapsed = now - self.t0
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            line = f"\r{self.desc} [{bar}] {self.n}/{self.total}{self.unit} {elapsed:6.1f}s eta {eta:6.1f}s {note[:40]:40s}"
            self.stream.write(line)
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
