"""One driver per run: a second `fit()` of a run that is training is refused. Start at `claimed`.

Two drivers of one run name (a job submitted twice, a notebook's fit() beside a job, --fresh typed in a
second terminal) would both save checkpoints into STORAGE/NAME, prune each other's (num_to_keep) and
overwrite Ray Train's record of the run; --fresh would rename the directory the first is writing into.
Ray Train takes no lock on a run, and object stores have no atomic create, so the driver keeps a
heartbeat file while it trains:

    STORAGE/.raytrain-live/NAME.json    host, pid, start, the Ray job's id, and when it was last written

written when the run is placed, rewritten every BEAT_S by a thread of the driver, removed when fit()
returns or raises. Another driver of the same run refuses to start while the file is fresh. A driver
that died without removing it (kill -9, a lost head node) stops counting STALE_S after its last beat,
at once on the same host when its pid is gone. Two drivers that start in the same instant both write
the file; each reads it back after CLAIM_SETTLE_S and only the one whose token is there goes on: the
settle time must exceed a write's latency, which it does by orders of magnitude (a PUT is milliseconds).
Cost: one small write per BEAT_S, and the settle time once per run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pyarrow.fs

from raytrain.checkpoint import layout
from raytrain.config import ConfigError

LIVE_DIR = ".raytrain-live"
BEAT_S = 30.0
STALE_S = 120.0
"""Four missed beats: a storage hiccup or a paused driver does not free the run for a second driver."""
CLAIM_SETTLE_S = {True: 1.0, False: 0.2}
"""Seconds between writing the claim and reading it back: cloud storage (True), a local or shared path."""


def marker_uri(storage: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{LIVE_DIR}/{name}.json"


@dataclass(frozen=True)
class Driver:
    """What the heartbeat file says of the driver that trains the run."""

    token: str
    host: str
    pid: int
    started: str
    beat: float
    """time.time() of the last write, on the driver's clock."""
    job: str | None = None
    """The Ray job's submission id, when the driver runs under `ray job submit`."""
    claimed: float | None = None
    """time.time() when the driver claimed the run (None in files of raytrain before 2026-12-06)."""

    def seen_s_ago(self) -> float:
        return max(0.0, time.time() - self.beat)

    def alive(self) -> bool:
        if self.host == socket.gethostname() and not _pid_alive(self.pid, self.claimed):
            return False
        return self.seen_s_ago() < STALE_S

    def describe(self) -> str:
        job = f", Ray job {self.job}" if self.job else ""
        return (f"its driver (pid {self.pid} on {self.host}{job}, started {self.started}) was seen "
                f"{self.seen_s_ago():.0f} s ago")

    def how_to_stop(self) -> str:
        if self.job:
            return f"`ray job stop {self.job}`"
        return f"Ctrl-C in its terminal, or `kill {self.pid}` on {self.host}"


def _pid_alive(pid: int, claimed: float | None = None) -> bool:
    """Whether process `pid` of this host runs, and is the one that claimed the run at `claimed`: a process
    started after the claim has the pid of a dead driver, reused (a restarted container starts its processes
    in the same order, so a driver killed with its container comes back with its old pid, and its own
    heartbeat file held the run against it until STALE_S)."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: alive
        return True
    return claimed is None or started <= claimed + _CLOCK_TICK_S


_CLOCK_TICK_S = 1.0
"""psutil's create_time comes from the boot time and clock ticks since (Linux): it may read up to a tick
late, and the claim is written after the process starts, so a margin of a second only ever errs towards
"the same process"."""


def _job_id() -> str | None:
    """The submission id of the Ray job this driver runs in (`ray job submit` sets the job's config in
    this variable for the entrypoint), else None."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return json.loads(raw).get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None


def read(storage: str, name: str) -> Driver | None:
    """The driver the heartbeat file of run `name` names, or None: no file, or one that cannot be read
    (storage that cannot be reached is said by the storage checks, not here)."""
    fs, path = layout.filesystem(marker_uri(storage, name))
    try:
        with fs.open_input_stream(path) as f:
            data = json.loads(f.read())
        return Driver(**data)
    except (OSError, ValueError, TypeError):
        return None


def live_driver(storage: str, name: str) -> Driver | None:
    """The driver training run `name` in `storage` now, or None."""
    driver = read(storage, name)
    return driver if driver is not None and driver.alive() else None


def in_progress(storage: str, name: str, driver: Driver) -> str:
    return (f"run {name!r} in {storage} is in progress: {driver.describe()}; wait for it to end or stop it "
            f"({driver.how_to_stop()}), or set another checkpoint.name (a driver that died stops counting "
            f"{STALE_S:.0f} s after it was last seen: {marker_uri(storage, name)})")


def check_not_live(storage: str, name: str) -> None:
    """A one-line ConfigError when another driver is training run `name` in `storage`."""
    driver = live_driver(storage, name)
    if driver is not None:
        raise ConfigError(in_progress(storage, name, driver))


def _write(storage: str, name: str, driver: Driver) -> None:
    """On a local or shared disk, written beside the file and renamed over it: a file rewritten in place is
    empty for an instant, and a second driver reading it then found no driver (an object store's PUT is whole)."""
    fs, path = layout.filesystem(marker_uri(storage, name))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    local = isinstance(fs, pyarrow.fs.LocalFileSystem)
    written = f"{path}.{driver.token}.tmp" if local else path
    with fs.open_output_stream(written) as f:
        f.write(json.dumps(driver.__dict__).encode())
    if local:
        fs.move(written, path)


@contextlib.contextmanager
def claimed(storage: str, name: str) -> Iterator[Driver]:
    """While the block runs, this driver holds run `name` in `storage`: refused with a one-line ConfigError
    if another live driver holds it (or claims it in the same instant), else the heartbeat file is written,
    kept fresh by a daemon thread, and removed at the end if it is still this driver's."""
    check_not_live(storage, name)
    now = time.time()
    me = Driver(token=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(),
                started=datetime.datetime.fromtimestamp(now).strftime("%Y-%m-%d %H:%M:%S"), beat=now, job=_job_id(),
                claimed=now)
    _write(storage, name, me)
    time.sleep(CLAIM_SETTLE_S["://" in storage])
    holder = read(storage, name)
    if holder is not None and holder.token != me.token:
        raise ConfigError(in_progress(storage, name, holder))
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(storage, name, me, stop), name="raytrain-live", daemon=True)
    beat.start()
    try:
        yield me
    finally:
        stop.set()
        beat.join()
        _release(storage, name, me)


def _beat(storage: str, name: str, me: Driver, stop: threading.Event) -> None:
    while not stop.wait(BEAT_S):
        try:
            _write(storage, name, Driver(**{**me.__dict__, "beat": time.time()}))
        except OSError:  # a storage hiccup: the next beat tries again, and STALE_S allows four of them
            pass


def _release(storage: str, name: str, me: Driver) -> None:
    holder = read(storage, name)
    if holder is None or holder.token != me.token:  # taken over after this driver went stale: not ours
        return
    fs, path = layout.filesystem(marker_uri(storage, name))
    with contextlib.suppress(OSError):
        fs.delete_file(path)
