"""Ray Train's torch backend with raytrain's per-node NCCL/Gloo environment (driver and worker sides).

Start at `torch_config` (driver side): it returns the TorchConfig to give TorchTrainer. Its backend
runs `apply_nccl_env` on every worker before Ray Train creates the torch process group; the
decisions themselves live in raytrain.network.nccl_env.compute_nccl_env.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.train.torch.config import TorchConfig

from raytrain import compat
from raytrain.config import NETWORK_ENV_PREFIXES, NetworkConfig
from raytrain.console import emit
from raytrain.network.nccl_env import NcclPlan, compute_nccl_env

_applied: dict[str, str] | None = None  # this worker's NCCL_*/GLOO_*/FI_* right after apply_nccl_env


def apply_nccl_env(forced: Mapping[str, str], auto_configure: bool) -> NcclPlan:
    """Worker side: compute this node's plan, set it in os.environ, print it once per node."""
    global _applied
    import torch.distributed as dist

    # NCCL and Gloo read these when the process group and its communicators are created; set later
    # they would be silently ignored, so a wrong call order fails here instead.
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("raytrain.network.apply_nccl_env ran after the torch process group was created; "
                           "NCCL/Gloo variables set now would be ignored")
    import ray

    node_ip = ray.util.get_node_ip_address()
    plan = compute_nccl_env(node_ip, forced=forced, auto_configure=auto_configure, multi_node=_spans_nodes())
    os.environ.update(plan.env)
    _applied = _network_vars(os.environ)
    if _local_rank() in (0, None):
        lines = [f"raytrain.network [{node_ip}]: " + " ".join(f"{k}={v}" for k, v in sorted(_applied.items()))]
        lines += [f"raytrain.network [{node_ip}]:   {note}" for note in plan.notes]
        emit("\n".join(lines))
    return plan


def applied_env() -> dict[str, str]:
    """In a worker: the NCCL_*/GLOO_*/FI_* variables it had when raytrain set up its process group.

    Outside a raytrain worker (no apply_nccl_env in this process): the current ones.
    """
    return dict(_applied) if _applied is not None else _network_vars(os.environ)


def _network_vars(env: Mapping[str, str]) -> dict[str, str]:
    """NCCL's, Gloo's and libfabric's variables (raytrain.config.NETWORK_ENV_PREFIXES)."""
    return {k: v for k, v in env.items() if k.startswith(NETWORK_ENV_PREFIXES)}


def _spans_nodes() -> bool:
    """The worker group has workers on more than one node (True where Ray Train cannot tell)."""
    try:
        import ray.train

        ctx = ray.train.get_context()
        return ctx.get_world_size() > ctx.get_local_world_size()
    except Exception:  # Ray Train V1 worker group: the train context does not exist yet
        return True


def _local_rank() -> int | None:
    try:
        import ray.train

        return ray.train.get_context().get_local_rank()
    except Exception:  # Ray Train V1 worker group: the train context does not exist yet
        return None


class _RaytrainTorchBackend(compat.TorchBackend):
    """Ray Train's torch backend, with raytrain's NCCL/Gloo environment set on every worker first.

    Ray Train V2 calls on_start from BackendSetupCallback.after_execution_group_start, once the
    worker actors and their train context exist; the parent then sets MASTER_ADDR/PORT and runs
    init_process_group on each worker. Ray sets no NCCL_SOCKET_IFNAME of its own since ray#42808
    removed the default that ray#42652 reported, so nothing after this step overrides the plan.
    """

    def on_start(self, worker_group, backend_config: "RaytrainTorchConfig") -> None:
        network = backend_config.network
        worker_group.execute(apply_nccl_env, forced=dict(network.env), auto_configure=network.auto_configure)
        super().on_start(worker_group, backend_config)


@dataclass
class RaytrainTorchConfig(TorchConfig):
    """TorchConfig whose backend applies `network` on each worker before the process group."""

    network: NetworkConfig = field(default_factory=NetworkConfig)

    @property
    def backend_cls(self):
        return _RaytrainTorchBackend

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "network_env": dict(self.network.env),
                "network_auto_configure": self.network.auto_configure}


def torch_config(network: NetworkConfig, backend: str, timeout_s: int = 1800) -> TorchConfig:
    """The TorchConfig for TorchTrainer: `backend` ("nccl", "gloo") plus this run's network section
    (network.env is validated by NetworkConfig itself)."""
    return RaytrainTorchConfig(backend=backend, timeout_s=timeout_s, network=network)
