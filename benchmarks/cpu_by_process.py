"""CPU-seconds per process while a command runs: where a `raytrain.main` run's CPU goes on a small
machine (the test suite's time on 2 cores is mostly process starts; docs/status.md #16).

    python benchmarks/cpu_by_process.py -- python -m raytrain.main training.max_steps=12 ...
    python benchmarks/cpu_by_process.py -- sleep 60      # what an idle cluster takes in a minute

Against a cluster that has run once already: a cluster's first run also starts its long-lived
actors (Ray Data's _StatsActor, Ray Train's _AutoscalingCoordinatorActor) and warms its worker pool.

Samples /proc every 0.5 s while the command runs (and 2 s after, for actors that end with it):
every process's user+system time at its last sample minus its first (a process seen only once, or
started and ended between two samples, is under-counted by up to 0.5 s of its CPU). Prints the
processes by name (Ray's actor name, `ray::RayTrainWorker`, or the command line's start), then the
total. Linux only (/proc).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[float, str]]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(pid)] = ((int(fields[11]) + int(fields[12])) / TICK, cmd)  # utime + stime
    return out


def name_of(cmd: str) -> str:
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0]  # an actor shows its running method: ray::RayTrainWorker.poll_status
    return cmd[:70] or "(kernel thread)"


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:]
    first: dict[int, float] = {}
    last: dict[int, tuple[float, str]] = {}

    def sample() -> None:
        for pid, (cpu, cmd) in snapshot().items():
            first.setdefault(pid, cpu)
            last[pid] = (cpu, cmd if cmd else last.get(pid, (0, ""))[1])

    sample()
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        time.sleep(0.5)
        sample()
    end = time.time() + 2
    while time.time() < end:
        time.sleep(0.5)
        sample()
    by_name: dict[str, list[float]] = defaultdict(list)
    for pid, (cpu, cmd) in last.items():
        if pid != os.getpid() and cpu - first[pid] > 0:
            by_name[name_of(cmd)].append(cpu - first[pid])
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    print(f"command exited {proc.returncode} after {time.time() - 2 - start:.1f} s; CPU-seconds by process:")
    for name, cpus in rows[:25]:
        print(f"{sum(cpus):8.2f}  {len(cpus):3d} x  {name}")
    print(f"{sum(sum(c) for c in by_name.values()):8.2f}  total ({len(rows)} names)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
