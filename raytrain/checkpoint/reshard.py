"""Resume on another number of workers: DeepSpeed's universal checkpoint conversion, in the workers.

A ZeRO-3 checkpoint holds one model/optimizer partition per rank, so it loads only on the world
size that wrote it. A worker group of another size converts it when it starts, whatever brought
it there: an elastic resize (scaling.num_workers: [min, max]), or a run resumed on another number
of workers (--resume-from, or the same run name submitted with another scaling.num_workers).
Rank 0 runs DeepSpeed's `ds_to_universal` (one file per parameter: fp32 weights and both Adam
moments, whole) in a child process while every rank builds its engine, and stores the result
next to the run:

    <storage>/<run>/universal/checkpoint_step_00000080-<digest of its path and raytrain.json>/
        step_00000080_universal/   DeepSpeed's universal tag (what `load_universal` reads)
        latest_universal
        raytrain.json              copied last: marks the conversion complete

The other ranks wait for that marker (a file, not a collective: a conversion of a large model
outlasts the process group's timeout), then every rank loads it with DeepSpeed's
`checkpoint.load_universal` (raytrain.checkpoint.shards.restore), which re-partitions every tensor
for the new world size. A universal copy fits any world size: a later group of yet another size
reuses it. Only the copy of the checkpoint being resumed is useful (Ray Train hands out the
latest); older copies are removed once a new one is complete.

Why in the workers and not on the driver: the driver process takes no part between the
restarts of an elastic run (Ray Train's controller decides them), the controller's own hooks run
inside its event loop on the often small head node, and the workers sit on the nodes with the
memory, disk and storage bandwidth, where Ray Train already delivers the checkpoint. One path then
serves every resize.

Cost (docs/benchmarks.md): the conversion reads the checkpoint and writes ~1.5x its size (~10 s
per GB on 2 CPU cores, CPU-bound), once per (checkpoint, change of size); the group's other work
waits on it. Local disk on rank 0's node for one copy (a cloud checkpoint is downloaded first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pyarrow.fs

from raytrain.checkpoint import scratch
from raytrain.checkpoint.layout import METADATA, UNIVERSAL_DIR, exists, filesystem, tag_for, written_world_size

# The converter dies with the worker that started it (PR_SET_PDEATHSIG): a worker group shut down
# mid-conversion (a node lost, a resize) must not leave a converter writing into the run directory.
# (Its functions must live in their module, not in __main__: its process pools pickle them.)
_CONVERTER = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv.pop(1)):
    sys.exit("raytrain: the worker that started this conversion is gone")
from deepspeed.checkpoint import ds_to_universal
ds_to_universal.main(ds_to_universal.parse_arguments())
"""


def written_by(meta: dict) -> tuple[int, int]:
    """(world size, data shards) of the run that wrote a checkpoint (its raytrain.json). The world
    size is the group's own (an elastic run's varies); older checkpoints have only the spec's."""
    world = written_world_size(meta)
    return world, meta["spec"]["config"]["data"].get("num_shards") or world


def universal_uri(run_uri: str, checkpoint_uri: str, meta: dict) -> str:
    """Where the universal copy of a checkpoint lives in this run: its directory's name and a digest
    of its full path and its raytrain.json (`meta`). The name alone is no key: a session resumed from
    one run's checkpoint_step_00000100 left its copy behind, and a later session of the same run
    resumed from another run's checkpoint_step_00000100 loaded that copy (the other run's weights).
    raytrain.json holds the run's spec and timed history, so a checkpoint rewritten at the same path
    gets a new copy too."""
    source = f"{checkpoint_uri.rstrip('/')}\n{json.dumps(meta, sort_keys=True, default=str)}"
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    return f"{run_uri.rstrip('/')}/{UNIVERSAL_DIR}/{os.path.basename(checkpoint_uri.rstrip('/'))}-{digest}"


def is_complete(target: str) -> bool:
    return exists(f"{target}/{METADATA}")


class Conversion:
    """Rank 0's conversion of one checkpoint into `target`: `start` launches it in the background,
    `finish` waits for it, stores the result and writes the marker last. A context manager: the
    checkpoint's local copy and the scratch directory live until it exits."""

    def __init__(self, checkpoint, step: int, target: str):
        self.checkpoint, self.step, self.target = checkpoint, step, target
        self._stack = contextlib.ExitStack()
        self._proc: subprocess.Popen | None = None
        self._started = 0.0

    def __enter__(self) -> "Conversion":
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stack.close()

    def start(self) -> None:
        self._started = time.perf_counter()
        self._src = self._stack.enter_context(self.checkpoint.as_directory())
        self._tmp = self._stack.enter_context(tempfile.TemporaryDirectory(prefix=scratch.prefix("universal")))
        self._log = self._stack.enter_context(open(os.path.join(self._tmp, "convert.log"), "w+"))
        tag = tag_for(self.step)
        out = os.path.join(self._tmp, "out", f"{tag}_universal")
        self._proc = subprocess.Popen([sys.executable, "-c", _CONVERTER, str(os.getpid()), "--input_folder",
                                       os.path.join(self._src, tag), "--output_folder", out],
                                      stdout=self._log, stderr=subprocess.STDOUT)
        # when the converter itself ended (it runs beside the engine build: finish() comes later)
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self._proc.wait()
        self._ended = time.perf_counter()

    def finish(self) -> tuple[float, float, float]:
        """Wait for the converter and store its output; returns (GiB written, seconds the converter
        ran, seconds from its start to the copy stored)."""
        self._waiter.join()
        if self._proc.returncode != 0:
            self._log.seek(0)
            raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {self.checkpoint.path}:\n"
                               f"{self._log.read()[-4000:]}")
        out = os.path.join(self._tmp, "out")
        fs, path = filesystem(self.target)
        fs.create_dir(path, recursive=True)
        pyarrow.fs.copy_files(out, path, destination_filesystem=fs)
        # last: a conversion cut short has no raytrain.json and is redone by the next group
        pyarrow.fs.copy_files(os.path.join(self._src, METADATA), f"{path}/{METADATA}", destination_filesystem=fs)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out) for f in files)
        return size / 2**30, self._ended - self._started, time.perf_counter() - self._started


def wait_until_complete(target: str, poll_s: float = 0.5) -> None:
    """Until rank 0's conversion into `target` is complete. No timeout of its own: if rank 0
    fails, Ray Train ends the whole worker group."""
    while not is_complete(target):
        time.sleep(poll_s)


def prune(run_uri: str, keep: str) -> None:
    """Remove the run's universal copies other than `keep` (Ray Train only ever hands out the
    latest checkpoint, so the older copies are dead weight of 1.5x a checkpoint each)."""
    fs, root = filesystem(f"{run_uri.rstrip('/')}/{UNIVERSAL_DIR}")
    keep_name = os.path.basename(keep.rstrip("/"))
    for info in fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True)):
        if info.type == pyarrow.fs.FileType.Directory and info.base_name != keep_name:
            fs.delete_dir(info.path)
