"""A dependency-free progress bar for long host-side work (conversion, training, compiling, benchmarks)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "converting") as p: p.update(1, note="layers.3")`` draws a one-line bar on stderr.

    On a terminal the bar redraws in place; elsewhere (a log file, a pipe) it writes one line per update at most
    every ``log_interval`` seconds, and the last."""

    def __init__(self, total: int, desc: str, unit: str = "", stream=None, enabled: bool = True, min_interval=0.1,
                 log_interval: float = 5.0):
        self.total, self.desc, self.unit = max(int(total), 1), desc, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.n = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.min_interval = min_interval if self.tty else log_interval
        self._drawn = False

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def eta(self) -> float:
        """Seconds left at the rate so far (0 before the first update)."""
        frac = min(self.n / self.total, 1.0)
        return self.elapsed / frac - self.elapsed if frac > 0 else 0.0

    def line(self, note: str = "") -> str:
        frac = min(self.n / self.total, 1.0)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        return (f"{self.desc} [{bar}] {self.n}/{self.total}{self.unit} {self.elapsed:6.1f}s eta {self.eta():6.1f}s "
                f"{note[:40]}")

    def update(self, n: int = 1, note: str = "") -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and (now - self._last >= self.min_interval or self.n >= self.total):
            self._last = now
            self._drawn = True
            if self.tty:
                self.stream.write("\r" + f"{self.line(note):{100}s}")
            else:
                self.stream.write(self.line(note).rstrip() + "\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
