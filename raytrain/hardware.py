"""What a machine has: its GPUs (one nvidia-smi query) and host RAM; and the memory a plan targets.

Used on the driver (planning for this machine), in zero-CPU probe tasks on each node of a live
cluster (raytrain.driver.cluster) and by the preflight's workers.
"""

from __future__ import annotations

import subprocess
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


def this_machine() -> Target:
    """This machine as a plan target: its smallest GPU, its RAM, its GPU count."""
    found = gpus()
    return Target(gpu_memory_bytes=min((g.memory_bytes for g in found), default=None),
                  host_memory_bytes=host_memory_bytes(), gpus_per_node=len(found) or None)
