"""Progress of long work as plain lines: "1.20 GB of 4.80 GB (25%), 310 MB/s, ETA 12s".

Used by the checkpoint export, the tokenization progress of a run (raytrain.data_progress) and the
preflight. Plain lines, not tqdm bars: a redrawn bar becomes a wall of escape codes in log files
and in `ray job logs`, so each long job prints a line every few seconds instead. Start at `status`.
"""

from __future__ import annotations

import time
from typing import Callable

_SCALES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_duration(seconds: float | None) -> str:
    """42s, 4m12s, 2h05m, 3d04h; "?" when unknown (nothing measured yet)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_count(n: float) -> str:
    """Three significant digits with a decimal prefix: 999, 1.23k, 45.6M, 310B (B: billions)."""
    for scale, prefix in _SCALES:
        if abs(n) >= scale:
            return f"{_three_digits(n / scale)}{'B' if prefix == 'G' else prefix}"
    return f"{n:.0f}" if float(n).is_integer() or abs(n) >= 100 else _three_digits(n)


def format_bytes(n: float) -> str:
    """Decimal units, as in "5GB" shard sizes: 512 B, 12.5 kB, 4.80 GB, 1.20 TB."""
    for scale, prefix in _SCALES:
        if abs(n) >= scale:
            return f"{_three_digits(n / scale)} {prefix}B"
    return f"{n:.0f} B"


def amount(n: float, unit: str) -> str:
    """`n` of `unit`: "B" is bytes (4.80 GB), anything else is counted (1.23M documents)."""
    return format_bytes(n) if unit == "B" else f"{format_count(n)} {unit}"


def status(done: float, total: float | None, rate_per_s: float | None, unit: str) -> str:
    """"1.20 GB of 4.80 GB (25%), 310 MB/s, ETA 12s". Without a total: "1.20 GB, 310 MB/s" (no
    percent, no ETA); without a rate (nothing timed yet) the rate is left out and the ETA is "?"."""
    if total is None:
        parts = [amount(done, unit)]
    else:
        percent = 100.0 * done / total if total > 0 else 100.0
        parts = [f"{amount(done, unit)} of {amount(total, unit)} ({percent:.0f}%)"]
    if rate_per_s is not None:
        parts.append(f"{amount(rate_per_s, unit)}/s")
    if total is not None:
        parts.append(f"ETA {format_duration((total - done) / rate_per_s if rate_per_s else None)}")
    return ", ".join(parts)


class Meter:
    """Work done out of a known total, timed from creation. `add` says when a line is due: at most
    one every `every_s`, never at the very end (the caller prints the final line itself)."""

    def __init__(self, total: float, unit: str = "B", every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.unit, self.every_s, self.done = total, unit, every_s, 0.0
        self._clock = clock
        self._start = self._last_line = clock()

    def add(self, n: float) -> bool:
        self.done += n
        now = self._clock()
        if self.done < self.total and now - self._last_line >= self.every_s:
            self._last_line = now
            return True
        return False

    def line(self) -> str:
        # Average since the start, so the ETA includes what happens between adds (a shard's write).
        elapsed = self._clock() - self._start
        return status(self.done, self.total, self.done / elapsed if elapsed > 0 else None, self.unit)


def _three_digits(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"
