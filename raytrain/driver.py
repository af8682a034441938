"""Driver side: connect to Ray, resolve the run for the live cluster, build and run the TorchTrainer.

Start at `fit`. Everything that can be wrong with the user's input is checked here, before a
single worker starts; the workers (raytrain.worker) receive the resolved run as a plain dict.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from raytrain.config import ClusterConfig, ConfigError, RunConfig, ScalingConfig
from raytrain.resolve import ClusterShape, advice, resolve_run, shape_from_cluster


@dataclass
class FitResult:
    """What a finished run leaves: its final metrics and where its checkpoint and files are."""

    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    """Every logged window of the run (step, loss, lr, grad_norm, tokens_per_s, ...)."""
    checkpoint_path: str | None
    run_path: str
    resolved: dict[str, Any]


def fit(cfg: RunConfig, fresh: bool = False) -> FitResult:
    """Train `cfg` on the Ray cluster (connecting or starting one) and return the result.

    A run whose name already exists in the storage path continues from its latest checkpoint;
    `fresh=True` sets the old run aside (renamed, nothing deleted) and starts over.
    """
    from raytrain.checkpoint import read_metadata
    from raytrain.data import build_dataset, build_eval_dataset
    from raytrain.data_progress import DataProgress
    from raytrain.reshard import prepare

    connect(cfg.cluster, cfg.scaling)
    shape = live_shape(cfg)
    resolved = resolve_run(cfg, shape)
    for note in advice(cfg, resolved):
        print(f"raytrain: note: {note}", flush=True)
    _check_memory(cfg, shape, resolved)
    if cfg.network.preflight:
        _preflight(cfg, shape)
    name, storage = _place_run(cfg, resolved, fresh)
    # A checkpoint written by another number of workers is converted here, once, before workers start.
    resolved["universal"] = prepare(cfg, storage, name, shape.num_workers,
                                    resolved["run"]["deepspeed"]["train_micro_batch_size_per_gpu"])

    progress = DataProgress(cfg.data, name)  # prints the training data's read/tokenize progress
    datasets = {"train": build_dataset(cfg.data, cfg.model, cfg.training.seed, progress)}
    eval_ds = build_eval_dataset(cfg.data, cfg.model, cfg.training.seed)
    if eval_ds is not None:
        datasets["eval"] = eval_ds
    resolved["has_eval"] = eval_ds is not None
    trainer = _trainer(cfg, shape, resolved, name, storage, datasets)
    with progress:
        result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"the run ended without a checkpoint (see the worker logs above): {result.error}")
    meta = read_metadata(result.checkpoint)
    _after_run(cfg, result, meta, storage, name)
    return FitResult(metrics=meta["metrics"], history=meta["history"], checkpoint_path=result.checkpoint.path,
                     run_path=str(result.path), resolved=resolved)


def _preflight(cfg: RunConfig, shape: ClusterShape) -> None:
    """Versions, NCCL transport and collective bandwidth on the workers' placement, before training."""
    from raytrain.preflight import run_preflight

    report = run_preflight(cfg.network, num_workers=shape.num_workers, use_gpu=shape.use_gpu,
                           cpus_per_worker=cfg.scaling.cpus_per_worker)
    print(report.render(), flush=True)
    if not report.passed:
        raise ConfigError("network.preflight failed (" + "; ".join(report.failures) + "): fix the fabric, "
                          "or set network.preflight=false to train anyway")


def _place_run(cfg: RunConfig, resolved: dict[str, Any], fresh: bool) -> tuple[str, str]:
    """The run's name and storage path (recorded in `resolved`), its directory ready: (name, storage)."""
    name = cfg.checkpoint.name or datetime.datetime.now().strftime("raytrain-%Y%m%d-%H%M%S")
    storage = _storage_path(cfg.checkpoint.storage_path)
    _prepare_run_dir(storage, name, fresh=fresh, resume_from=cfg.checkpoint.resume_from)
    resolved["run"]["checkpoint"].update(name=name, storage_path=storage)
    resolved["resume_from"] = cfg.checkpoint.resume_from
    return name, storage


def _trainer(cfg: RunConfig, shape: ClusterShape, resolved: dict[str, Any], name: str, storage: str,
             datasets: dict[str, Any]):
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.data import ingest_config
    from raytrain.worker import train_loop_per_worker

    resources: dict[str, float] = {"CPU": cfg.scaling.cpus_per_worker}
    if shape.use_gpu:
        resources["GPU"] = 1
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=resolved,
        scaling_config=ray.train.ScalingConfig(num_workers=shape.num_workers, use_gpu=shape.use_gpu,
                                               resources_per_worker=resources,
                                               accelerator_type=cfg.scaling.accelerator_type,
                                               placement_strategy=cfg.scaling.placement_strategy),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep)),
        datasets=datasets,
        dataset_config=ingest_config(cfg.data.num_shards),
        torch_config=_torch_config(cfg, shape),
    )


def _after_run(cfg: RunConfig, result, meta: dict[str, Any], storage: str, name: str) -> None:
    """summary.md + loss_curve.png next to the checkpoints; the Hugging Face export when configured."""
    from raytrain.tracking import write_summary

    write_summary(meta["history"], meta["metrics"], storage, name)
    if cfg.checkpoint.export_dir:
        from raytrain.export import export

        with result.checkpoint.as_directory() as local:
            export(local, cfg.checkpoint.export_dir)


def _check_memory(cfg: RunConfig, shape: ClusterShape, resolved: dict[str, Any]) -> None:
    """Refuse a run whose model states and activations cannot fit the cluster's GPUs / host RAM,
    naming the setting that would make it fit (raytrain.plan; `python -m raytrain.plan` shows it all)."""
    from raytrain.model import load_model_config
    from raytrain.plan import check_fits, cluster_memory, estimate_memory

    gpu_mem, host_mem, gpus_per_node = cluster_memory(shape.use_gpu)  # None where unknown: not checked
    check_fits(estimate_memory(resolved, load_model_config(cfg.model),
                               gpus_per_node=shape.gpus_per_node or gpus_per_node), gpu_mem, host_mem)


def connect(cluster: ClusterConfig, scaling: ScalingConfig) -> None:
    """Join the cluster this runs on (cluster.address, or RAY_ADDRESS under `ray job submit`), else start one."""
    import ray

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
    import ray

    gpus_per_node = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    return shape_from_cluster(cfg, ray.cluster_resources(), gpus_per_node or None)


def _torch_config(cfg: RunConfig, shape: ClusterShape):
    from raytrain.network import torch_config

    # raytrain's backend sets each node's NCCL/Gloo environment before the process group exists.
    return torch_config(cfg.network, backend="nccl" if shape.use_gpu else "gloo")


def _prepare_run_dir(storage: str, name: str, *, fresh: bool, resume_from: str | None) -> None:
    """Existing run: continue it (default) or, with fresh=True, rename it aside. Never overwrite."""
    import pyarrow.fs

    from raytrain.checkpoint import METADATA

    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    run_dir = f"{root.rstrip('/')}/{name}"
    exists = fs.get_file_info(f"{run_dir}/checkpoint_manager_snapshot.json").type != pyarrow.fs.FileType.NotFound
    if resume_from:
        if "://" not in resume_from and not os.path.isfile(os.path.join(resume_from, METADATA)):
            raise ConfigError(f"checkpoint.resume_from={resume_from} is not a raytrain checkpoint (no {METADATA}): "
                              f"give a checkpoint_step_* directory")
        if exists and not fresh:
            raise ConfigError(f"checkpoint.resume_from is set but run {name!r} already exists in {storage}, and it "
                              f"would continue from its own latest checkpoint: choose a new checkpoint.name")
    if exists and fresh:
        aside = f"{run_dir}.replaced-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        fs.move(run_dir, aside)
        print(f"raytrain: --fresh: moved the existing run {name!r} to {aside}", flush=True)
    elif exists:
        print(f"raytrain: run {name!r} exists in {storage}: continuing from its latest checkpoint "
              f"(pass --fresh to start over; the old run is kept under another name)", flush=True)


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
