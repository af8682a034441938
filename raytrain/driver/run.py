"""Driver side: what each command does on the driver, before and around the workers. Start at `fit`.

- `fit(cfg)`: connect, resolve the run for the live cluster, refuse what cannot fit, place the run
  in storage, build the datasets and the TorchTrainer, train, then summarise (and export).
- `dry_run(cfg)`: the same resolution for the requested shape, without Ray.
- `plan_memory(cfg, ...)`: the memory plan against stated sizes, the live cluster or this machine.

Everything that can be wrong with the user's input is checked before a single worker starts; the
workers (raytrain.worker.loop) receive the `RunSpec` built here, as a plain dict.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import ray.train
from ray.train.torch import TorchTrainer

from raytrain import hardware
from raytrain.checkpoint import layout, reshard
from raytrain.checkpoint.export import export
from raytrain.config import ConfigError, RunConfig
from raytrain.console import say
from raytrain.data.ingest import ShardedIngest
from raytrain.data.pipeline import build_datasets
from raytrain.data.progress import DataProgress
from raytrain.data.sources import inspect_sources
from raytrain.driver.cluster import check_preflight, cluster_target, connect, live_shape
from raytrain.driver.summary import write_summary
from raytrain.network.backend import torch_config
from raytrain.planning.memory import GIB, MemoryPlan, check_fits, estimate_memory
from raytrain.planning.resolve import advice, resolve_run, shape_from_config
from raytrain.run_spec import ResolvedRun, RunSpec
from raytrain.worker.loop import train_loop_per_worker


@dataclass
class FitResult:
    """What a finished run leaves: its final metrics and where its checkpoint and files are."""

    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    """Every logged window of the run (step, loss, lr, grad_norm, tokens_per_s, ...)."""
    checkpoint_path: str | None
    run_path: str
    spec: RunSpec


def fit(cfg: RunConfig, fresh: bool = False) -> FitResult:
    """Train `cfg` on the Ray cluster (connecting or starting one) and return the result.

    A run whose name already exists in the storage path continues from its latest checkpoint;
    `fresh=True` sets the old run aside (renamed, nothing deleted) and starts over.
    """
    connect(cfg.cluster, cfg.scaling)
    shape = live_shape(cfg)
    sources = inspect_sources(cfg.data)
    found = cluster_target(shape.use_gpu)  # None where unknown: not checked
    target = hardware.Target(found.gpu_memory_bytes, found.host_memory_bytes, shape.gpus_per_node or found.gpus_per_node)
    resolved = resolve_run(cfg, shape, sources, target)  # "auto" settings are chosen here, for this cluster
    for line in resolved.plan:
        say(f"raytrain: plan: {line}")
    for note in advice(resolved):
        say(f"raytrain: note: {note}")
    check_fits(estimate_memory(resolved, target))
    _check_tracking(cfg)
    if cfg.network.preflight:
        check_preflight(cfg)
    spec = _place(resolved, fresh)
    progress = DataProgress(cfg.data, spec.run_name)  # prints the training data's read/tokenize progress
    datasets = build_datasets(cfg.data, cfg.model, cfg.training.seed, sources, resolved.model.vocab_size, progress)
    trainer = _trainer(spec, datasets)
    with progress:
        result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"the run ended without a checkpoint (see the worker logs above): {result.error}")
    meta = layout.read_metadata(result.checkpoint)
    write_summary(meta["history"], meta["metrics"], spec.storage_path, spec.run_name)
    if cfg.checkpoint.export_dir:
        with result.checkpoint.as_directory() as local:
            export(local, cfg.checkpoint.export_dir)
    return FitResult(metrics=meta["metrics"], history=meta["history"], checkpoint_path=result.checkpoint.path,
                     run_path=str(result.path), spec=spec)


def dry_run(cfg: RunConfig) -> tuple[ResolvedRun, list[str]]:
    """The run resolved for the requested shape (GPUs counted on this machine; "auto" settings chosen
    for this machine's GPU memory and RAM), and advice notes (the plan's lines first)."""
    here = hardware.this_machine()
    resolved = resolve_run(cfg, shape_from_config(cfg, here.gpus_per_node or 0), target=here)
    return resolved, [f"plan: {line}" for line in resolved.plan] + advice(resolved)


def plan_memory(cfg: RunConfig, *, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
                gpus_per_node: int | None = None) -> MemoryPlan:
    """The memory plan of `cfg`, checked against its target (raises planning.memory.DoesNotFit).

    The target: the stated sizes (a cluster that may not exist yet; the config gives its shape),
    else the Ray cluster at cluster.address / RAY_ADDRESS, else this machine.
    """
    for flag, value in (("--gpu-memory-gib", gpu_memory_gib), ("--host-memory-gib", host_memory_gib),
                        ("--gpus-per-node", gpus_per_node)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value:g}")
    if any(v is not None for v in (gpu_memory_gib, host_memory_gib, gpus_per_node)):
        if gpu_memory_gib is not None and cfg.scaling.use_gpu is False:
            raise ConfigError("--gpu-memory-gib plans a GPU cluster but scaling.use_gpu=false: drop one of them")
        if gpu_memory_gib is not None and cfg.scaling.use_gpu is None:
            cfg = cfg.with_overrides(["scaling.use_gpu=true"])
        shape = shape_from_config(cfg)
        target = hardware.Target(int(gpu_memory_gib * GIB) if gpu_memory_gib else None,
                                 int(host_memory_gib * GIB) if host_memory_gib else None, gpus_per_node)
    elif cfg.cluster.address or os.environ.get("RAY_ADDRESS"):
        connect(cfg.cluster, cfg.scaling)
        shape = live_shape(cfg)
        found = cluster_target(shape.use_gpu)
        target = hardware.Target(found.gpu_memory_bytes, found.host_memory_bytes,
                                 shape.gpus_per_node or found.gpus_per_node)
    else:
        here = hardware.this_machine()
        shape = shape_from_config(cfg, here.gpus_per_node or 0)
        target = here if shape.use_gpu else hardware.Target(None, here.host_memory_bytes, None)
    resolved = resolve_run(cfg, shape, target=target)
    plan = estimate_memory(resolved, target)
    plan.notes.extend(resolved.plan)
    check_fits(plan)
    return plan


def _check_tracking(cfg: RunConfig) -> None:
    """Reach the MLflow tracking server from the driver before any worker starts: unreachable (or, for a
    file:// store, refused by MLflow 3 unless MLFLOW_ALLOW_FILE_STORE=true) it would otherwise fail rank
    0 at its first step, and Ray Train would retry that max_failures times."""
    uri = cfg.tracking.mlflow_tracking_uri
    if not uri:
        return
    import mlflow  # an optional extra (pip install "raytrain[mlflow]")

    try:
        mlflow.set_tracking_uri(uri)
        mlflow.search_experiments(max_results=1)
    except Exception as e:  # MLflow raises MlflowException, requests' ConnectionError, OSError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"tracking.mlflow_tracking_uri={uri}: MLflow cannot use it ({first[:300]}): start the "
                          f"server, fix the URI, or unset it") from None


def _place(resolved: ResolvedRun, fresh: bool) -> RunSpec:
    """The run's name and storage directory, ready (continued, or set aside with fresh=True), and
    the universal copy of its resume checkpoint when the world size changed: the final RunSpec."""
    cfg = resolved.config
    name = cfg.checkpoint.name or datetime.datetime.now().strftime("raytrain-%Y%m%d-%H%M%S")
    storage = _storage_path(cfg.checkpoint.storage_path)
    run = layout.run_uri(storage, name)
    resume_from = cfg.checkpoint.resume_from
    has_checkpoint = layout.latest_checkpoint(run) is not None
    if resume_from:
        layout.check_is_checkpoint(resume_from, "checkpoint.resume_from")
        if has_checkpoint and not fresh:
            raise ConfigError(f"checkpoint.resume_from is set but run {name!r} already exists in {storage}, and it "
                              f"would continue from its own latest checkpoint: choose a new checkpoint.name")
    if has_checkpoint and fresh:
        fs, path = layout.filesystem(run)
        aside = f"{path}.replaced-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        fs.move(path, aside)
        say(f"raytrain: --fresh: moved the existing run {name!r} to {aside}")
    elif has_checkpoint:
        say(f"raytrain: run {name!r} exists in {storage}: continuing from its latest checkpoint "
            f"(pass --fresh to start over; the old run is kept under another name)")
    # A checkpoint written by another number of workers is converted here, once, before workers start.
    universal = reshard.prepare(run, resume_from, resolved.cluster.num_workers, cfg.data.num_shards)
    return RunSpec.place(resolved, run_name=name, storage_path=storage, resume_from=resume_from, universal=universal)


def _trainer(spec: RunSpec, datasets: dict[str, Any]) -> TorchTrainer:
    cfg, shape = spec.config, spec.cluster
    resources: dict[str, float] = {"CPU": cfg.scaling.cpus_per_worker}
    if shape.use_gpu:
        resources["GPU"] = 1
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=spec.to_dict(),
        scaling_config=ray.train.ScalingConfig(num_workers=shape.num_workers, use_gpu=shape.use_gpu,
                                               resources_per_worker=resources,
                                               accelerator_type=cfg.scaling.accelerator_type,
                                               placement_strategy=cfg.scaling.placement_strategy),
        run_config=ray.train.RunConfig(
            name=spec.run_name, storage_path=spec.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep)),
        datasets=datasets,
        dataset_config=ShardedIngest(cfg.data.num_shards),
        # raytrain's backend sets each node's NCCL/Gloo environment before the process group exists.
        torch_config=torch_config(cfg.network, backend="nccl" if shape.use_gpu else "gloo"),
    )


def _storage_path(path: str) -> str:
    if "://" in path:
        return path
    local = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"checkpoint.storage_path={path}: cannot create it ({e.strerror}); "
                          f"choose a writable directory or a cloud URI") from None
    return local
