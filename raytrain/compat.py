"""Every private API of Ray, torch and DeepSpeed that raytrain touches, in one place.

Each entry says what it is for, why no public API does it, and the version it was checked
against (`CHECKED`). tests/unit/test_compat.py fails when any of them moves or changes shape,
and when the installed versions differ from `CHECKED` (then re-check each entry and bump them).

DeepSpeed is imported inside the functions that need it: importing it picks its accelerator, and
a CPU worker must set DS_ACCELERATOR=cpu first (raytrain.worker.engine.import_deepspeed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator
from ray.train.torch.config import _TorchBackend

CHECKED = {"ray": "2.60.0", "deepspeed": "0.19.8", "torch": "2.13.0"}
"""The versions every entry below was checked against (torch: 2.11 on the GPU image too)."""


# Ray Train's torch backend (ray/train/torch/config.py, class _TorchBackend, ray 2.60.0). raytrain's
# backend subclasses it to set each node's NCCL/Gloo environment in `on_start` before the parent
# creates the process group: TorchConfig has no public hook that runs on every worker that early.
TorchBackend = _TorchBackend


class SplitCoordinatorOwner(StreamSplitDataIterator):
    """Not an iterator: what lets Ray Train shut a streaming_split's coordinator actor down.

    Ray Train's dataset manager keeps the coordinator of a shard it hands out only when the shard
    is a StreamSplitDataIterator (ray/train/v2/_internal/data_integration/dataset_manager.py:116,
    ray 2.60.0: `isinstance(...)` then `iterator._coord_actor`), and kills it with the worker group.
    raytrain hands out a group of shards instead (raytrain.data.ingest.ShardGroup), so it poses as
    one. super().__init__ is not called: that would start an iterator over one split.
    """

    def __init__(self, coordinator_actor):
        self._coord_actor = coordinator_actor


def split_coordinator(split: StreamSplitDataIterator):
    """The coordinator actor behind one split of `Dataset.streaming_split` (its private attribute)."""
    return split._coord_actor


def quiet_ray_train_report_log() -> None:
    """Ray Train V2 logs each ray.train.report at INFO from every rank, the whole metrics dict and
    checkpoint in one long line, burying raytrain's progress line. It is that module's only INFO
    message and its warnings still show. The logger is named after the module's file path
    (ray/train/v2/_internal/execution/context.py, ray 2.60.0), not a dotted name."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def torch_extension_build_dir(op_name: str) -> Path:
    """Where torch's cpp_extension builds (and locks) a JIT extension: torch.utils.cpp_extension.
    _get_build_directory (torch 2.13.0 and 2.11), the one place that knows TORCH_EXTENSIONS_DIR's
    default and the per-Python/CUDA subdirectory. Creates the directory."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op_name, verbose=False))


def disable_deepspeed_op(name: str) -> None:
    """Mark a DeepSpeed op incompatible so that DeepSpeed never JIT-builds it in this process.

    deepspeed.ops.__compatible_ops__ (deepspeed/ops/__init__.py, 0.19.8; built lazily on first
    access) is what DeepSpeed's comm consults before loading its shared-memory all-reduce
    ("deepspeed_shm_comm"): on CPU that build costs ~35 s per process and gloo does the job.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[name] = False


def share_backup_optimizer_param_groups(zero_optimizer) -> bool:
    """Make the GPU side of a partial optimizer offload follow the LR schedule; True if there was one.

    DeepSpeed 0.19.8, runtime/zero/stage3.py:313-326: with `offload_optimizer.ratio < 1` the sub-groups
    that stay on the GPU are stepped by `self.backup_optimizer`, a torch AdamW built with a *copy* of
    the CPU optimizer's param_groups[0] hyper-parameters; groups 1+ are added with
    add_param_group(the CPU optimizer's own dict) and so are shared. Schedulers (raytrain's LambdaLR,
    or a JSON scheduler) update the CPU optimizer's groups only, so group 0 on the GPU stayed at the
    LR of construction (with raytrain's warmup: lr / warmup_steps, forever). Here every backup group
    becomes the CPU optimizer's dict, as groups 1+ already are, with AdamW's defaults (foreach,
    maximize, ...) added to it; `_optimizer_step` sets and clears ['params'] around each call, so a
    shared dict is safe. tests/unit/test_compat.py fails when DeepSpeed's construction changes.
    """
    backup = getattr(zero_optimizer, "backup_optimizer", None)
    if backup is None:
        return False
    groups = zero_optimizer.optimizer.param_groups
    if len(groups) != len(backup.param_groups):
        raise RuntimeError(f"DeepSpeed's backup optimizer has {len(backup.param_groups)} param groups for the "
                           f"CPU optimizer's {len(groups)}: its construction changed, re-check this workaround")
    for i, group in enumerate(groups):
        for key, value in backup.defaults.items():
            group.setdefault(key, value)
        backup.param_groups[i] = group  # its params list is DeepSpeed's (empty between steps), not the dummy's
    return True
