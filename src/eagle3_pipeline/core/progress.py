"""Progress lines that read well in a terminal and in a log file.

Plain, timestamp-free lines (`[extract] 120/240 50% 12.3 rows/s ETA 0:00:10`) printed at most every
`every_s` seconds: a log file gets a handful of useful lines instead of thousands of carriage
returns, and a terminal still sees the work move.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import TextIO


def log(stage: str, message: str, stream: TextIO | None = None) -> None:
    """One plain line tagged with its stage, flushed so `tail -f` sees it at once."""
    out = stream or sys.stdout
    print(f"[{stage}] {message}", file=out, flush=True)


class Progress:
    """Counts units of work (rows, tokens, steps) and prints rate and ETA now and then."""

    def __init__(
        self,
        stage: str,
        total: int,
        unit: str = "rows",
        every_s: float = 10.0,
        already_done: int = 0,
        stream: TextIO | None = None,
    ) -> None:
        self.stage = stage
        self.total = total
        self.unit = unit
        self.every_s = every_s
        self.done = already_done
        self._start_done = already_done
        self._stream = stream
        self._t0 = time.monotonic()
        self._last = 0.0
        if already_done:
            log(stage, f"resuming: {already_done}/{total} {unit} already done", stream)

    def advance(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            self._print(now, extra)

    def _print(self, now: float, extra: str) -> None:
        elapsed = max(now - self._t0, 1e-9)
        rate = (self.done - self._start_done) / elapsed
        left = max(self.total - self.done, 0)
        eta = timedelta(seconds=round(left / rate)) if rate > 0 else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        tail = f" {extra}" if extra else ""
        log(
            self.stage,
            f"{self.done}/{self.total} {pct:.0f}% {rate:.1f} {self.unit}/s ETA {eta}{tail}",
            self._stream,
        )
