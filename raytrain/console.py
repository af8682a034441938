"""Everything raytrain prints, in plain lines: one output path per side, and their formats.

- `say` (driver side: the command line, a notebook) prints to sys.stdout, so a notebook cell shows it.
- `emit` (worker side: Ray Train workers, Ray Data tasks) writes to the process's real stdout,
  which Ray forwards to the driver and to `ray job logs` (see its docstring for why not print).
- `format_progress` / `parse_progress`: the one definition of the training progress line
  (`step 20/80  loss 1.2939  lr ...`), printed by rank 0 and read back by the benchmark and tests.
- `status`, `Meter`, `format_*`: progress of long work ("1.20 GB of 4.80 GB (25%), 310 MB/s, ETA
  12s"). Plain lines, never tqdm bars: a redrawn bar becomes a wall of escape codes in log files
  and in `ray job logs`, so long work prints a line every few seconds instead.
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
import time
from typing import Any, Callable


def say(line: str, err: bool = False) -> None:
    """One line to the user from the driver (stdout; stderr for notes beside machine-read stdout).

    One write per line: the driver's progress thread prints while Ray forwards worker lines."""
    stream = sys.stderr if err else sys.stdout
    stream.write(line + "\n")
    stream.flush()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with raytrain's error line for the command lines: one line on stderr,
    `raytrain: error: <what> (see <prog> --help)`, exit code 2. argparse's own prints the usage
    block first, so a mistake in a flag read as several lines unlike every other mistake.
    Abbreviated flags are refused: argparse would take `--gpu-mem` as `--gpu-memory-gib` silently."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        say(f"raytrain: error: {message} (see {self.prog} --help)", err=True)
        raise SystemExit(2)


def flag_number(kind: type, *, minimum: float | None = None, above: float | None = None):
    """An argparse `type` for a number with its range: `flag_number(float, above=0)` refuses -5 with
    "must be > 0, got -5" (argparse then names the flag)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value in (float("inf"), float("-inf")) and "inf" not in text.lower():  # 1e400: past a float's range
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text} (too large for a float)")
        out_of_range = (minimum is not None and value < minimum) or (above is not None and value <= above)
        finite = math.isfinite(value)
        if not finite or out_of_range:
            bound = f">= {minimum:g}" if minimum is not None else f"> {above:g}"
            # "must be > 0, got inf" would read as a contradiction: say what inf and nan are not
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if not finite else ''}{bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value" wording, if it ever shows
    return parse


def add_config_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--config FILE`, once: argparse keeps the last of a repeated flag and drops the others unread,
    so every one is collected and `one_config` refuses a second."""
    parser.add_argument("--config", action="append", help=help)


def one_config(parser: argparse.ArgumentParser, configs: list[str] | None) -> str | None:
    """The single --config of `add_config_flag` (None: none given); two are a usage error (exit 2)."""
    if configs and len(configs) > 1:
        parser.error(f"--config is given {len(configs)} times ({', '.join(configs)}): give one file "
                     f"(move the other's settings into it, or give them as KEY=VALUE)")
    return configs[0] if configs else None


def emit(line: str) -> None:
    """One line to the user from a worker process (rank 0 decides who calls it).

    Written to the process's real stdout, which Ray forwards to the driver and to `ray job logs`.
    Not print(): Ray Train V2 patches it into its logger and, where stdout is wrapped, every line
    reached the driver twice. Not logging: that logger's console output was not forwarded for the
    workers of a restarted group (measured: 2 of 4 "starting at step" lines arrived).
    """
    sys.__stdout__.write(line + "\n")
    sys.__stdout__.flush()


# ---------------------------------------------------------------------------------------------
# The training progress line.


def format_progress(m: dict[str, Any], max_steps: int) -> str:
    """`step 20/80  loss 1.2939  lr 1.00e-04  grad_norm 0.506  tok/s 5,251  [mfu 56.5%  ]
    [eval_loss ... eval_ppl ...  ]data_wait 0.2%  mem 0.69GiB  eta 0:00:12`."""
    parts = [f"step {int(m['step'])}/{max_steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
             f"grad_norm {m['grad_norm']:.3f}", f"tok/s {m['tokens_per_s']:,.0f}"]
    if "mfu" in m:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if "eval_loss" in m:
        parts.append(f"eval_loss {m['eval_loss']:.4f}  eval_ppl {m['eval_ppl']:.2f}")
    parts += [f"data_wait {100 * m['data_wait_frac']:.1f}%", f"mem {m['memory_gib']:.2f}GiB",
              f"eta {datetime.timedelta(seconds=round(m['eta_s']))}"]
    return "  ".join(parts)


_PROGRESS = re.compile(
    r"step (?P<step>\d+)/(?P<max_steps>\d+)  loss (?P<loss>\S+)  lr (?P<lr>\S+)  grad_norm (?P<grad_norm>\S+)  "
    r"tok/s (?P<tokens_per_s>[\d,]+)  (?:mfu (?P<mfu>[\d.]+)%  )?"
    r"(?:eval_loss (?P<eval_loss>\S+)  eval_ppl (?P<eval_ppl>\S+)  )?"
    r"data_wait (?P<data_wait>[\d.]+)%  mem (?P<memory_gib>[\d.]+)GiB  eta (?P<eta>\S+)")


def parse_progress(line: str) -> dict[str, Any] | None:
    """The numbers of a progress line (anywhere in `line`, e.g. behind Ray's log prefix), or None.
    Fractions come back as fractions (mfu 0.565, data_wait_frac 0.002), as the metrics dict has them."""
    m = _PROGRESS.search(line)
    if m is None:
        return None
    out: dict[str, Any] = {"step": int(m["step"]), "max_steps": int(m["max_steps"]), "loss": float(m["loss"]),
                           "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                           "tokens_per_s": float(m["tokens_per_s"].replace(",", "")),
                           "data_wait_frac": float(m["data_wait"]) / 100, "memory_gib": float(m["memory_gib"])}
    if m["mfu"] is not None:
        out["mfu"] = float(m["mfu"]) / 100
    if m["eval_loss"] is not None:
        out.update(eval_loss=float(m["eval_loss"]), eval_ppl=float(m["eval_ppl"]))
    return out


# ---------------------------------------------------------------------------------------------
# Progress of long work.

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
