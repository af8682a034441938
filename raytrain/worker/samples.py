"""data.sample_log: which rows every optimizer step trained on, written by every rank.

An audit of the data order: with it a run can show that no row was skipped or read twice, across
restarts and resizes (tests/integration/test_elastic.py and test_fault_tolerance.py read it). Each rank
appends one JSON line per step to

    STORAGE/RUN/samples/<group>-rank<R>.jsonl
        {"step": 7, "world_size": 2, "epoch": 0, "t": 1764582000.12, "rows": ["9f2c...", ...]}

where <group> names the worker group (its start time and size, the same on all its ranks) and
"rows" holds an 8-byte digest of each row's tokens, in the order the rank trained on them; "t" is
when the step ended (time.time(), this node's clock). A step
that a later group ran again (the steps after the checkpoint a restart resumed from) appears once
per group; the later group's is the one that counts.

Cost: a hash per row in the reading thread (raytrain.data.ingest), ~20 bytes per row on disk, one
tiny broadcast at the group's start. Needs a storage_path on a local or shared filesystem.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from raytrain.checkpoint.layout import SAMPLES_DIR


class SampleLog:
    """One rank's file. `record` after every step; `close` at the end."""

    def __init__(self, run_dir: str, rank: int, world_size: int):
        # the group's name from rank 0, so that all ranks of one group share it
        name = [f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}-w{world_size}"]
        torch.distributed.broadcast_object_list(name, src=0)
        os.makedirs(os.path.join(run_dir, SAMPLES_DIR), exist_ok=True)
        self.path = os.path.join(run_dir, SAMPLES_DIR, f"{name[0]}-rank{rank}.jsonl")
        self.world_size = world_size
        self._file = open(self.path, "a")

    def record(self, step: int, batches: Any) -> None:
        """The rows `batches` (a MicroBatches with digests=True) handed out for `step`."""
        line = {"step": step, "world_size": self.world_size, "epoch": batches.position()["epoch"], "t": time.time(),
                "rows": batches.pop_digests()}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()  # a killed worker's steps are on disk up to its last one

    def close(self) -> None:
        self._file.close()
