"""Sharded ZeRO-3 checkpoints through Ray Train (worker side).

Every rank writes its own shard with `engine.save_checkpoint` into a local temporary directory and
reports it with `ray.train.report`; Ray Train merges all ranks' files into one checkpoint directory
in the run's storage path (local, shared filesystem or cloud URI) and keeps the last K.

Layout of one checkpoint:
    raytrain.json                 step, metrics and their history, resolved run config (rank 0)
    nccl_env_node<N>.json         the NCCL/Gloo environment node N's workers ran with
    latest                        DeepSpeed's pointer to the tag below
    step_00000080/                DeepSpeed's tag: per-rank model and optimizer shards

Trust: DeepSpeed loads its shards with full unpickling (torch.load(weights_only=False)), which can
run code: only load checkpoints from storage you trust.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from raytrain.metrics import emit

METADATA = "raytrain.json"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def save(engine, step: int, metrics: dict[str, Any], history: list[dict[str, Any]], run: dict[str, Any],
         upload_async: bool = False, data_state: dict[str, Any] | None = None) -> str:
    """Save this rank's shard for `step` and report it (a collective: every rank must call it).

    Adds checkpoint_save_s (slowest rank's local write), checkpoint_size_gib (all ranks) and
    checkpoint_gbps to `metrics` (the same dict object that is in `history`).
    """
    import ray.train
    import torch

    from raytrain.network import applied_env

    ctx = ray.train.get_context()
    local = tempfile.mkdtemp(prefix="raytrain-ckpt-")
    try:
        start = time.perf_counter()
        # client_state lands in this rank's own model-states file: each rank restores its own RNG.
        engine.save_checkpoint(local, tag=tag_for(step), client_state={"raytrain_step": step, "rng": _rng_state(),
                                                                         "data": data_state or {}})
        # on the engine's device: NCCL (GPU runs) only reduces CUDA tensors
        stats = torch.tensor([time.perf_counter() - start, _dir_bytes(local)], dtype=torch.float64,
                             device=engine.device)
        # one tiny all-reduce per checkpoint: the slowest rank's time, all ranks' bytes
        seconds = stats[:1].clone()
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        total = stats[1:].clone()
        torch.distributed.all_reduce(total)
        metrics.update(checkpoint_save_s=seconds.item(), checkpoint_size_gib=total.item() / 2**30,
                       checkpoint_gbps=total.item() / 1e9 / max(seconds.item(), 1e-9))
        if ctx.get_world_rank() == 0:
            emit(f"raytrain: checkpoint step {step}: {metrics['checkpoint_size_gib']:.3f} GiB written in "
                  f"{metrics['checkpoint_save_s']:.2f} s ({metrics['checkpoint_gbps']:.2f} GB/s)")
        if ctx.get_local_rank() == 0:
            # The NCCL/Gloo environment this node's workers actually ran with, one file per node.
            with open(os.path.join(local, f"nccl_env_node{ctx.get_node_rank()}.json"), "w") as f:
                json.dump(applied_env(), f, indent=2, sort_keys=True)
        if ctx.get_world_rank() == 0:
            with open(os.path.join(local, METADATA), "w") as f:
                json.dump({"step": step, "metrics": metrics, "history": history, "run": run}, f, indent=2, default=str)
        # ASYNC: Ray uploads in the background and deletes `local` afterwards, so training goes on
        # while the shards travel to storage; SYNC: report returns once they are there.
        mode = ray.train.CheckpointUploadMode.ASYNC if upload_async else ray.train.CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(local),
                         checkpoint_dir_name=f"checkpoint_{tag_for(step)}", checkpoint_upload_mode=mode)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    if not upload_async:
        shutil.rmtree(local, ignore_errors=True)
    return tag_for(step)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@dataclass
class ResumePoint:
    """The checkpoint a worker continues from."""

    checkpoint: Any  # ray.train.Checkpoint
    universal: bool
    """True: DeepSpeed's universal form of a checkpoint written by another number of workers."""


def resume_point(payload: dict[str, Any], world_size: int) -> ResumePoint | None:
    """Which checkpoint to load, or None to start from scratch.

    Ray Train's latest reported checkpoint of this run wins (a restart after a failure, or the
    same run name submitted again); else checkpoint.resume_from (--resume-from PATH). One written
    by another number of workers is loaded from the universal copy the driver made of it
    (payload["universal"], raytrain.reshard).
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and payload.get("resume_from"):
        checkpoint = ray.train.Checkpoint(payload["resume_from"])
    if checkpoint is None:
        return None
    meta = read_metadata(checkpoint)
    written_by = meta["run"]["scaling"]["num_workers"]
    if written_by == world_size:
        return ResumePoint(checkpoint, universal=False)
    universal = payload.get("universal") or {}
    if universal.get("step") != meta["step"]:
        raise RuntimeError(f"checkpoint {checkpoint.path} (step {meta['step']}) was written by {written_by} workers, "
                           f"this run has {world_size}, and the driver prepared no universal copy of it "
                           f"(it has one of step {universal.get('step')})")
    return ResumePoint(ray.train.Checkpoint(universal["path"]), universal=True)


def restore(engine, resume: ResumePoint | None, seed: int, rank: int) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Load `resume` into the engine; return (step, metrics history, data position). (0, [], {}) for none."""
    if resume is None:
        return 0, [], {}
    with resume.checkpoint.as_directory() as path:
        _, client_state = engine.load_checkpoint(path)  # reads the `latest` (or `latest_universal`) tag; full unpickling
        with open(os.path.join(path, METADATA)) as f:
            history = json.load(f)["history"]
    if client_state is None:
        raise RuntimeError(f"checkpoint {resume.checkpoint.path} could not be loaded by DeepSpeed")
    step = int(client_state["raytrain_step"])
    if resume.universal:
        # Every rank got rank 0's client state; per-rank RNG streams of another world size have no
        # counterpart here, so each rank starts a fresh one (only dropout, if any, draws from it).
        _seed_all(seed * 1_000_003 + step * 1009 + rank)
    else:
        _set_rng_state(client_state["rng"])
    return step, history, client_state["data"]


def _seed_all(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_metadata(checkpoint) -> dict[str, Any]:
    """raytrain.json of a ray.train.Checkpoint (local or remote storage)."""
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{METADATA}") as f:
        return json.loads(f.read().decode())
