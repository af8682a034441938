"""The Ray cluster a run goes to (driver side): connect, read its shape and memory, check its fabric.

Start at `connect`: `cluster.address`, else RAY_ADDRESS (set under `ray job submit`), else a new
local cluster sized for the workers plus Ray Data.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray

from raytrain import hardware
from raytrain.config import ClusterConfig, ConfigError, RunConfig, ScalingConfig
from raytrain.console import say
from raytrain.network.preflight import run_preflight
from raytrain.network.preflight_report import PreflightReport
from raytrain.planning.resolve import shape_from_cluster
from raytrain.run_spec import ClusterShape


def connect(cluster: ClusterConfig, scaling: ScalingConfig) -> None:
    """Join the cluster this runs on (cluster.address, or RAY_ADDRESS under `ray job submit`), else start one."""
    if ray.is_initialized():
        return
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # A local cluster needs logical CPUs for the workers *and* for Ray Data's tokenization tasks:
    # with only the workers' share, Ray Data never gets a CPU and the run hangs.
    workers = scaling.num_workers or 2
    num_cpus = cluster.num_cpus or max(os.cpu_count() or 1, int(workers * scaling.cpus_per_worker) + 2)
    # address="local": always a new cluster; plain ray.init() would join any other one on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def live_shape(cfg: RunConfig) -> ClusterShape:
    """The run's shape on the connected cluster (GPUs per node: the largest alive GPU node's)."""
    gpus_per_node = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    return shape_from_cluster(cfg, ray.cluster_resources(), gpus_per_node or None)


def cluster_target(use_gpu: bool) -> hardware.Target:
    """GPU memory per GPU, host RAM per node and GPUs per node of the connected cluster.

    Each is the smallest over the alive nodes that would run workers (GPU nodes for a GPU run),
    read on the node itself by a zero-CPU probe task. All None when there is no such node yet (an
    autoscaling cluster whose GPU nodes start at zero): plan with stated sizes then.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU" if use_gpu else "CPU", 0) > 0]
    if not nodes:
        return hardware.Target()
    probe = ray.remote(num_cpus=0)(hardware.this_machine)
    targets = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                       .remote() for n in nodes], timeout=120)
    gpu_sizes = [t.gpu_memory_bytes for t in targets if t.gpu_memory_bytes]
    return hardware.Target(gpu_memory_bytes=min(gpu_sizes) if gpu_sizes else None,
                           host_memory_bytes=min(t.host_memory_bytes for t in targets),
                           gpus_per_node=min(int(n["Resources"].get("GPU", 0)) for n in nodes) if use_gpu else None)


def preflight_cluster(cfg: RunConfig, sizes: Sequence[int] | None = None, **options) -> PreflightReport:
    """Connect and run the preflight (raytrain.network.preflight) on the workers' placement.

    `options`: run_preflight's iters, warmup_iters, min_*_busbw_gbs, timeout_s.
    """
    connect(cfg.cluster, cfg.scaling)
    shape = live_shape(cfg)
    return run_preflight(cfg.network, shape.num_workers, shape.use_gpu, sizes,
                         cpus_per_worker=cfg.scaling.cpus_per_worker, **options)


def check_preflight(cfg: RunConfig) -> None:
    """network.preflight=true: the preflight before training; a failure stops the run with one line."""
    report = preflight_cluster(cfg)
    say(report.render())
    if not report.passed:
        raise ConfigError("network.preflight failed (" + "; ".join(report.failures) + "): fix the fabric, "
                          f"or {report.train_anyway}")
