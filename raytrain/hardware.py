"""What a machine has: its GPUs (one nvidia-smi query) and host RAM; the memory a plan targets; the
allocator setting under which the plan's GPU reserve holds (`allocator_env`).

Used on the driver (planning for this machine), in zero-CPU probe tasks on each node of a live
cluster (raytrain.driver.cluster) and by the preflight's workers.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    memory_bytes: int


@dataclass(frozen=True)
class Target:
    """The memory a run is planned against; None where unknown (then that limit is not checked)."""

    gpu_memory_bytes: int | None = None
    """Memory of one GPU (the smallest, if they differ)."""
    host_memory_bytes: int | None = None
    """Host RAM of one node (the smallest)."""
    gpus_per_node: int | None = None


def gpus(use_torch: bool = True) -> list[Gpu]:
    """Every GPU of this machine. nvidia-smi sees them all whatever CUDA_VISIBLE_DEVICES says (Ray
    hides GPUs from a task that asked for none); without it, torch's view (visible devices only,
    and asking initialises CUDA in this process: `use_torch=False` where that must not happen)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
        return [Gpu(name=r[0], driver=r[1], memory_bytes=int(float(r[2])) * 2**20) for r in rows]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    if not use_torch:
        return []
    import torch  # not at the top: planning on a laptop needs no torch import for this module

    if not torch.cuda.is_available():
        return []
    return [Gpu(name=torch.cuda.get_device_name(i), driver="", memory_bytes=torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def host_memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def this_machine(with_gpus: bool = True) -> Target:
    """This machine as a plan target: its smallest GPU, its RAM, its GPU count. with_gpus=False reads the
    RAM only: without nvidia-smi, finding no GPU means importing torch (~2 CPU-seconds), which a CPU run's
    probe task on each node has no use for (and at Ray workers' niceness 15 on a busy node, that took over
    two minutes on CI)."""
    if not with_gpus:
        return Target(host_memory_bytes=host_memory_bytes())
    found = gpus()
    return Target(gpu_memory_bytes=min((g.memory_bytes for g in found), default=None),
                  host_memory_bytes=host_memory_bytes(), gpus_per_node=len(found) or None)


def ray_accelerator_type() -> str | None:
    """The accelerator type Ray gives this machine's NVIDIA GPUs: its node resource `accelerator_type:TYPE`
    ("H200", "A100", ...), which scaling.accelerator_type must name exactly; None without one (no GPU, or a
    name Ray does not parse). Ray's own reading (pynvml, device 0), so a local cluster's type is predicted
    as Ray will set it: ray/_private/accelerators/nvidia_gpu.py, get_current_node_accelerator_type (ray
    2.60.0, a private API)."""
    from ray._private.accelerators import NvidiaGPUAcceleratorManager

    try:
        return NvidiaGPUAcceleratorManager.get_current_node_accelerator_type()
    except Exception:  # noqa: BLE001  (pynvml's errors: no driver, no device; then Ray sets no type either)
        return None


# The variables that configure torch's CUDA caching allocator (PYTORCH_ALLOC_CONF is torch >= 2.9's name).
ALLOCATOR_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_env(use_gpu: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """GPU workers' allocator default: expandable segments, unless the driver's environment (the user's
    shell or the job's runtime_env) says anything about the allocator; then the workers keep theirs.

    Why: torch's default allocator keeps the blocks it splits; a checkpointed large micro-batch
    (recomputed 2.4 GiB MLP tensors) left 6.2 GiB of a 24 GiB cap reserved but unusable, and a setting
    the planner had found to fit (1.1B, mb 55, full offload) ran out of memory at 15.7 GiB allocated
    (2026-12-02, docs/benchmarks.md). The planner models allocated bytes plus a 10% reserve; expandable
    segments map pages into one growing segment, so that reserve holds (that run fits at 21.1 GiB). Cost:
    none measured (one call: the shipped 1.1B step 78,497 vs 78,466 tokens/s with and without, the 24 GiB
    pick 61,108 vs 61,159). Set at process start (runtime_env): the allocator reads it once, when CUDA
    first allocates.
    """
    if not use_gpu or any(k in environ for k in ALLOCATOR_VARS):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
