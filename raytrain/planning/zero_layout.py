"""How DeepSpeed 0.19.8's ZeRO-3 lays a model's optimizer out: sub-groups, and which of them
`offload_optimizer.ratio` keeps on the GPU. Pure arithmetic, mirrored from DeepSpeed's source so the
memory planner (raytrain.planning.memory) computes the split DeepSpeed will make, not `ratio x N`.

- Sub-groups (runtime/zero/stage3.py `_create_fp16_sub_groups`, lines 1210-1233): each optimizer
  param group is cut by appending parameters (their partition on this rank) until the running size
  reaches `sub_group_size`; a sub-group closes *after* the parameter that crosses it, so it can
  exceed `sub_group_size` by one parameter. A group no larger than `sub_group_size` is one
  sub-group. Sub-groups are numbered across the param groups in order.
- The split (stage3.py lines 1100-1108): with S sub-groups, sub-group i goes to the CPU iff
  `i >= int((1 - ratio) * S)`. So the *last* sub-groups go first (for raytrain's two param groups:
  the norms' group, then lm_head and the last layers), and only S + 1 distinct splits exist. With
  the default sub_group_size (1e9) a 1.1B model has 3 sub-groups, which is why ratios 0.5 and 0.25
  measured the same (issue 14; upstream deepspeedai/DeepSpeed#4775): choose `sub_group_size` with
  the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # runtime/zero/config.py
# What the planner tries when `zero_optimization.sub_group_size` is "auto": DeepSpeed's default
# and two finer ones (more, smaller pinned buffers: finer ratios, smaller step transients).
SUB_GROUP_SIZES = (1_000_000_000, 200_000_000, 100_000_000)


def param_groups(numels: Sequence[int], ndims: Sequence[int], raytrain_optimizer: bool) -> list[list[int]]:
    """Parameter sizes per optimizer param group, in `model.parameters()` order.

    raytrain's own optimizer (raytrain.worker.engine.build_optimizer) makes two groups: the >= 2-D
    weights (decayed) and the rest. An optimizer from the DeepSpeed JSON gets `module.parameters()`
    as one group (deepspeed/runtime/engine.py, `model_parameters = self.module.parameters()`).
    """
    if not raytrain_optimizer or not ndims:
        return [list(numels)]
    decay = [n for n, d in zip(numels, ndims) if d >= 2]
    rest = [n for n, d in zip(numels, ndims) if d < 2]
    return [g for g in (decay, rest) if g]


def sub_groups(groups: Sequence[Sequence[int]], world_size: int, sub_group_size: int) -> list[int]:
    """Elements per sub-group on one rank (each parameter's partition is ceil(numel / world))."""
    out = []
    for group in groups:
        parts = [math.ceil(n / world_size) for n in group]
        if sub_group_size >= sum(parts):
            out.append(sum(parts))
            continue
        running = 0
        for i, n in enumerate(parts):
            running += n
            if running >= sub_group_size or i == len(parts) - 1:
                out.append(running)
                running = 0
    return out


def num_on_gpu(num_sub_groups: int, ratio: float) -> int:
    """How many leading sub-groups stay on the GPU for `offload_optimizer.ratio` (DeepSpeed's own
    expression, float rounding included: int((1 - 0.6) * 7) is 2)."""
    return int((1 - ratio) * num_sub_groups)


def split(subs: Sequence[int], ratio: float) -> tuple[list[int], list[int]]:
    """(sub-groups on the GPU, sub-groups on the CPU) for `offload_optimizer.ratio`."""
    k = num_on_gpu(len(subs), ratio)
    return list(subs[:k]), list(subs[k:])


def ratio_for(num_sub_groups: int, gpu_sub_groups: int) -> float:
    """A ratio (4 decimals, as written into the DeepSpeed dict) that keeps exactly `gpu_sub_groups`
    on the GPU: 1.0 for none, else the middle of its interval, so float rounding cannot move it."""
    if gpu_sub_groups == 0:
        return 1.0
    if not 0 < gpu_sub_groups < num_sub_groups:
        raise ValueError(f"{gpu_sub_groups} of {num_sub_groups} sub-groups on the GPU is not an offload split")
    ratio = round(1 - (gpu_sub_groups + 0.5) / num_sub_groups, 4)
    if num_on_gpu(num_sub_groups, ratio) != gpu_sub_groups:  # only for absurd sub-group counts
        raise ValueError(f"no 4-decimal ratio keeps {gpu_sub_groups} of {num_sub_groups} sub-groups on the GPU")
    return ratio
