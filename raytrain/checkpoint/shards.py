"""Sharded ZeRO-3 checkpoints (worker side): `Checkpointer.save`, then `resume_point` + `restore`.

Every rank writes its own shard with `engine.save_checkpoint` into a local temporary directory; the
worker loop reports that directory with `ray.train.report` (raytrain.worker.loop), and Ray Train
merges all ranks' files into one checkpoint directory in the run's storage and keeps the last K
(layout: raytrain.checkpoint.layout). Nothing here calls Ray: the loop is tested without it.

A disk that is full, locally or in the storage, stops the run in one line (`out_of_space`), not as a
worker failure: Ray Train would restart the group, retrain up to checkpoint.every_n_steps steps and
fail at the same save, checkpoint.max_failures times (measured on a 6 MiB storage: 4 attempts, 2 minutes
and ~300 lines of tracebacks for the tiny model; hours of GPU time at a real every_n_steps).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import random
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import pyarrow.fs
import torch
import transformers

from raytrain import compat
from raytrain.checkpoint import scratch
from raytrain.checkpoint.layout import (METADATA, checkpoint_dir_name, is_cut_short, read_metadata,
                                        remove_shards_of_ranks_from, shown_uri, tag_for)
from raytrain.checkpoint.reshard import universal_uri, written_by
from raytrain.console import emit
from raytrain.data.bad_records import SetupMistake, stop_run
from raytrain.network.backend import applied_env
from raytrain.run_spec import RunSpec


@dataclass(frozen=True)
class Rank:
    """Where this worker process sits in the run."""

    world: int
    world_size: int
    local: int = 0
    node: int = 0
    local_size: int = 1
    """The ranks on this worker's node."""


class Checkpointer:
    """Decides when the run saves (every checkpoint.every_n_steps and at the last step) and writes
    this rank's shard plus the run's files into a local directory. `save` is a collective."""

    def __init__(self, engine, spec: RunSpec, spec_dict: dict[str, Any], rank: Rank):
        self.engine, self.rank, self.spec = engine, rank, spec
        self.every = spec.config.checkpoint.every_n_steps
        self._spec_dict = spec_dict  # saved as is in raytrain.json: the contract this run ran with

    def due(self, step: int, last: bool) -> bool:
        return last or bool(self.every and step % self.every == 0)

    def save(self, step: int, metrics: dict[str, Any], history: list[dict[str, Any]],
             data_state: dict[str, Any]) -> str:
        """Write step `step` into a new local directory and return it (the caller reports and removes it).

        Adds checkpoint_save_s (slowest rank's local write), checkpoint_size_gib (all ranks) and
        checkpoint_gbps to `metrics` (the same dict object that is in `history`).
        """
        local = scratch.make("ckpt")
        try:
            self._write(local, step, metrics, history, data_state)
        except BaseException as e:
            full = out_of_space(e, os.path.dirname(local))  # before the partial files go and free the space again
            shutil.rmtree(local, ignore_errors=True)
            if full:
                stop_run(SetupMistake(
                    f"node {socket.gethostname()}",
                    f"no space left in {os.path.dirname(local)}, where each worker writes its part of the checkpoint "
                    f"of step {step} before Ray Train uploads it to checkpoint.storage_path",
                    f"free space there, or start the Ray nodes with TMPDIR on a larger disk; then the same command "
                    f"with checkpoint.name={self.spec.run_name} continues from the run's latest checkpoint"),
                    self.spec.counter)
            raise
        return local

    def storage_full(self, step: int, metrics: dict[str, Any]) -> None:
        """The upload of step `step`'s checkpoint found checkpoint.storage_path full: stop the run in one line."""
        keep = self.spec.config.checkpoint.num_to_keep
        stop_run(SetupMistake(  # `metrics` is the window `save` added the checkpoint's size to
            f"checkpoint.storage_path={self.spec.storage_path}",
            f"no space left for the checkpoint of step {step} ({metrics['checkpoint_size_gib']:.3f} GiB; "
            f"checkpoint.num_to_keep={keep} are kept, and a new one is written before the oldest is deleted)",
            f"free space there, and delete {self.spec.run_uri}/{checkpoint_dir_name(step)} (a save that never "
            f"completed); then the same command with checkpoint.name={self.spec.run_name} continues from the run's "
            f"latest checkpoint"), self.spec.counter)

    def _write(self, local: str, step: int, metrics: dict[str, Any], history: list[dict[str, Any]],
               data_state: dict[str, Any]) -> None:
        if self.rank.world == 0:
            self._clear_dead_save(step)
        start = time.perf_counter()
        # client_state lands in this rank's own model-states file: each rank restores its own RNG.
        self.engine.save_checkpoint(local, tag=tag_for(step),
                                    client_state={"raytrain_step": step, "rng": _rng_state(), "data": data_state})
        # One tiny all-reduce of each per checkpoint: the slowest rank's time, all ranks' bytes. On
        # the engine's device: NCCL (GPU runs) only reduces CUDA tensors.
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=self.engine.device)
        total = torch.tensor([_dir_bytes(local)], dtype=torch.float64, device=self.engine.device)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(total)
        metrics.update(checkpoint_save_s=seconds.item(), checkpoint_size_gib=total.item() / 2**30,
                       checkpoint_gbps=total.item() / 1e9 / max(seconds.item(), 1e-9))
        if self.rank.world == 0:
            emit(f"raytrain: checkpoint step {step}: {metrics['checkpoint_size_gib']:.3f} GiB written in "
                 f"{metrics['checkpoint_save_s']:.2f} s ({metrics['checkpoint_gbps']:.2f} GB/s)")
        if self.rank.local == 0:
            # The NCCL/Gloo/libfabric environment this node's workers actually ran with, one file per node.
            with open(os.path.join(local, f"nccl_env_node{self.rank.node}.json"), "w") as f:
                json.dump(applied_env(), f, indent=2, sort_keys=True)
        if self.rank.world == 0:
            with open(os.path.join(local, METADATA), "w") as f:
                # world_size: this group's, which an elastic run's spec alone does not say
                json.dump({"step": step, "world_size": self.rank.world_size, "metrics": metrics, "history": history,
                           "spec": self._spec_dict}, f, indent=2, default=str)

    def _clear_dead_save(self, step: int) -> None:
        """Remove what a bigger group left of step `step` in the storage, before this group saves it there.

        A group that dies between its ranks' uploads of a save and Ray Train's registration of it (a node lost
        mid-upload, a resize) leaves the directory, and its successor, which resumes from the registered
        checkpoint before it, saves the same step into the same directory: Ray uploads into it as it stands. Each
        rank's upload replaces its own files, but the shards of ranks this group does not have stay, and
        DeepSpeed's ds_to_universal (a resume at another size) and zero_to_fp32 (the export) read every shard of
        the tag: a conversion that mixed two partitions (KeyError 'optimizer_state_dict'), an export that found 3
        files where it expected 2. A step past the one this run resumed from is never registered
        (checkpoint.resume_from into an existing run is refused unless that run's own latest wins), so those are
        a dead group's. Rank 0 removes them before its save; the all-reduce after every rank's save keeps all
        uploads after that. One listing a save (one request on object storage)."""
        tag_dir = f"{self.spec.run_uri}/{checkpoint_dir_name(step)}/{tag_for(step)}"
        removed = remove_shards_of_ranks_from(tag_dir, self.rank.world_size)
        if removed:
            emit(f"raytrain: removed {len(removed)} shard files of ranks {self.rank.world_size} and up from "
                 f"{tag_dir}, an earlier group's save of step {step} that Ray Train never registered; this group of "
                 f"{self.rank.world_size} saves step {step} anew")


# torch.save reports a full disk as RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos
# 576 vs 534"), with no errno: what is left free on the disk says it. A disk a write failed on for want of space
# has at most a few blocks left (ext4 and XFS reserve theirs for root; statvfs' f_bavail already excludes them).
_FULL_BYTES = 64 * 2**20


def out_of_space(error: BaseException, directory: str | None = None) -> bool:
    """Whether `error`, raised by a write, means that the disk (or the user's quota) is full: its errno or
    message says so, or (`directory` given: the write's local directory) that disk has under 64 MiB free."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(text in str(error) for text in ("No space left on device", "Disk quota exceeded")):
        return True  # pyarrow's and others' OSErrors that carry the text but not the errno
    if directory is None or not isinstance(error, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(directory).free < _FULL_BYTES
    except OSError:
        return False


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a worker continues from."""

    checkpoint: Any  # ray.train.Checkpoint
    step: int
    written_by: int
    """The world size that wrote it."""
    universal: str | None = None
    """Where its universal copy lives (raytrain.checkpoint.reshard) when another world size wrote
    it; None: loaded as written."""


def resume_point(spec: RunSpec, latest, world_size: int) -> ResumePoint | None:
    """Which checkpoint to load, or None to start from scratch (reads only its raytrain.json).

    `latest`: Ray Train's latest reported checkpoint of this run (ray.train.get_checkpoint()), which
    wins (a restart after a failure, a resize, or the same run name submitted again); else
    checkpoint.resume_from (--resume-from PATH). One written by another number of workers is
    loaded from its universal copy, which the group makes at its start if it does not exist yet.
    """
    from ray.train import Checkpoint  # a plain class: no Ray cluster needed

    checkpoint = latest or (Checkpoint(spec.resume_from) if spec.resume_from else None)
    if checkpoint is None:
        return None
    meta = read_metadata(checkpoint)
    old_world, _ = written_by(meta)
    universal = None if old_world == world_size else universal_uri(spec.run_uri, checkpoint.path, meta)
    return ResumePoint(checkpoint, step=meta["step"], written_by=old_world, universal=universal)


def restore(engine, resume: ResumePoint | None, seed: int, rank: int, *, ranks_on_node: int = 1,
            counter: str | None = None) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Load `resume` into the engine; return (step, metrics history, data position). (0, [], {}) for none.

    A universal copy must be complete (raytrain.checkpoint.reshard) and the engine built with
    checkpoint.load_universal. `ranks_on_node` and `counter` (the run's counter actor) are for a
    download from remote storage that this node's disk cannot hold (`_rank_files`)."""
    if resume is None:
        return 0, [], {}
    from ray.train import Checkpoint

    source = Checkpoint(resume.universal) if resume.universal else resume.checkpoint
    settings = compat.param_group_settings(engine) if resume.universal else None
    # A universal copy is read whole by every rank (each slices every parameter's file); a checkpoint as
    # written, only this rank's part of it.
    files = source.as_directory() if resume.universal else _rank_files(source, rank, ranks_on_node, counter)
    with files as path:
        _, client_state = engine.load_checkpoint(path)  # reads the `latest` (or `latest_universal`) tag; full unpickling
        with open(os.path.join(path, METADATA)) as f:
            history = json.load(f)["history"]
    if client_state is None:
        raise RuntimeError(f"checkpoint {source.path} could not be loaded by DeepSpeed")
    step = int(client_state["raytrain_step"])
    if resume.universal:
        compat.repair_universal_load(engine, settings)  # DeepSpeed's: group 0's settings, one shared step
        # Every rank got rank 0's client state; per-rank RNG streams of another world size have no
        # counterpart here, so each rank starts a fresh one (only dropout, if any, draws from it).
        transformers.set_seed(seed * 1_000_003 + step * 1009 + rank)
    else:
        _set_rng_state(client_state["rng"])
    return step, history, client_state["data"]


# A rank's own files in a ZeRO-3 checkpoint: zero_pp_rank_{R}_mp_rank_00_model_states.pt and
# {bf16_}zero_pp_rank_{R}_mp_rank_00_optim_states.pt (DeepSpeed's engine._get_ckpt_name, _get_rank_zero_ckpt_name).
_RANK_FILE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")


@contextlib.contextmanager
def _rank_files(checkpoint, rank: int, ranks_on_node: int = 1, counter: str | None = None) -> Iterator[str]:
    """A local directory with the files of `checkpoint` that rank `rank` loads: all but other ranks' shards.

    Ray's `as_directory` downloads a remote checkpoint (s3://, gs://, abfs://) whole, once per node, though
    DeepSpeed reads only its own rank's shard files (engine._get_all_zero_checkpoint_state_dicts loads file i
    on rank i; the model-states file is per rank too). On 16 nodes of 8 GPUs that is 16x the checkpoint's
    bytes through the storage, and the whole checkpoint on each node's disk: ~0.8 TB for a 70B model's
    fp32 states and Adam moments, where this node's ranks need ~53 GB. Here each rank downloads its own
    files (its node's ranks in parallel, one stream each), plus those no rank's name claims (`latest`,
    raytrain.json). A checkpoint on a local or shared filesystem is read in place, as Ray does.

    A local disk (TMPDIR) that cannot hold the download stops the run in one line, not as a worker failure
    that every restart meets again after the same download: checked before the engine build
    (`check_restore_space`), before the first byte (`_to_download`) and again if a write fails for want of
    space (another process, a quota).
    """
    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        yield root
        return
    wanted, need = _to_download(checkpoint, rank, ranks_on_node, counter)
    local = scratch.make("restore")
    try:
        for info in wanted:
            dest = os.path.join(local, posixpath.relpath(info.path, root))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                pyarrow.fs.copy_files(info.path, dest, source_filesystem=fs,
                                      destination_filesystem=pyarrow.fs.LocalFileSystem())
            except OSError as e:
                if not out_of_space(e, local):
                    raise
                shutil.rmtree(local, ignore_errors=True)  # what was downloaded, before the free space is read
                _restore_disk_full(checkpoint, need, ranks_on_node, counter)
        _check_not_cut_short(checkpoint, local, counter)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _check_not_cut_short(checkpoint, local: str, counter: str | None) -> None:
    """Stop the run in one line if a shard file this rank downloaded (into `local`) is a torch.save archive cut
    short: torch.load fails on it at every restart, and Ray Train retried it checkpoint.max_failures times, each
    after a full engine build and download. The driver checks a checkpoint on a local or shared filesystem
    before Ray starts (layout.cut_short_shards); on object storage, where that would cost a request per file,
    each rank checks only its own files here, two small local reads each."""
    for directory, _, files in os.walk(local):
        for name in sorted(files):
            if _RANK_FILE.search(name) and is_cut_short(os.path.join(directory, name)):
                stop_run(SetupMistake(
                    f"checkpoint {shown_uri(checkpoint)}",
                    f"its shard file {os.path.relpath(os.path.join(directory, name), local)} is cut short (a "
                    f"torch.save archive without its end: a save or copy that stopped; DeepSpeed cannot load it)",
                    "put the file back, or start from an earlier checkpoint_step_* directory of the run under a new "
                    "name (--resume-from PATH checkpoint.name=NEW_NAME), or pass --fresh to start over (the old run "
                    "is kept under another name)"), counter)


def check_restore_space(resume: ResumePoint | None, rank: Rank, counter: str | None) -> None:
    """Before the engine build (minutes for a large model): stop the run in one line if this node's TMPDIR
    cannot hold what its ranks will download to restore `resume` from remote storage (`_rank_files`, which
    checks again as it downloads). One listing of the checkpoint; nothing for local or shared storage."""
    if resume is not None and not resume.universal:
        if not isinstance(resume.checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            _to_download(resume.checkpoint, rank.world, rank.local_size, counter)


def _to_download(checkpoint, rank: int, ranks_on_node: int, counter: str | None) -> tuple[list, int]:
    """(the files of remote `checkpoint` that rank `rank` downloads, the bytes this node's ranks download):
    this rank's files times `ranks_on_node` (they download at once; shards of about one size) and the
    shared ones. Stops the run if TMPDIR has not that much free (`_restore_disk_full`)."""
    root = checkpoint.path.rstrip("/")
    wanted = []
    for info in checkpoint.filesystem.get_file_info(pyarrow.fs.FileSelector(root, recursive=True)):
        match = _RANK_FILE.search(posixpath.basename(info.path))
        if info.type == pyarrow.fs.FileType.File and not (match and int(match.group(1)) != rank):
            wanted.append(info)
    ours = sum(info.size for info in wanted if _RANK_FILE.search(posixpath.basename(info.path)))
    need = ours * ranks_on_node + sum(info.size for info in wanted) - ours
    if shutil.disk_usage(tempfile.gettempdir()).free < need + _FULL_BYTES:
        _restore_disk_full(checkpoint, need, ranks_on_node, counter)
    return wanted, need


def _restore_disk_full(checkpoint, need: int, ranks_on_node: int, counter: str | None) -> NoReturn:
    """Stop the run: this node's TMPDIR cannot hold what its ranks download to restore `checkpoint`."""
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free
    workers = f"this node's {ranks_on_node} workers download" if ranks_on_node > 1 else "this worker downloads"
    stop_run(SetupMistake(
        f"node {socket.gethostname()}",
        f"no space left in {tmp} to restore checkpoint {shown_uri(checkpoint)}: {workers} {need / 2**30:.2f} GiB "
        f"of its files there (each worker its own shards) and {free / 2**30:.2f} GiB are free",
        "free space there, or start the Ray nodes with TMPDIR on a larger disk; then the same command continues "
        "from the same checkpoint"), counter)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
