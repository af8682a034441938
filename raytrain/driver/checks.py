"""The checks a run passes before Ray starts: one code path for `--dry-run` and for a real run.

- `check_before_ray(cfg)`: what needs neither Ray nor the cluster's shape: the paths (storage,
  resume_from, export_dir, a model path that is a raytrain checkpoint) and the Ray address. It writes
  nothing: a dry run creates no directory.
- `resolve_before_ray(cfg)`: the whole config resolved (model, tokenizer, data, DeepSpeed) for the
  shape the config itself states, so that a real run refuses a bad config before `ray.init`;
  None when only the cluster can tell the shape.
- `check_memory(resolved, target)`: the planner's verdict (raytrain.planning.memory), raising its
  one line for a run that does not fit; `dry_run_target` is what a dry run plans against (stated
  sizes, else this machine), a real run measures its cluster (raytrain.driver.cluster).
- `check_placement(...)`: a worker placement the cluster can never make (workers x CPUs, GPUs, an
  accelerator type no node has, STRICT_SPREAD/STRICT_PACK), refused in one line instead of Ray Train's
  wait; for the local cluster a run starts before ray.init (`check_local_placement`), for a live one
  after connecting (raytrain.driver.cluster.check_live_placement). `idle_settings`: settings that do
  nothing for this run, one note each, and a DeepSpeed config that turns ZeRO's partitioning off
  (`zero_stage_note`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence

from raytrain import hardware
from raytrain.checkpoint import layout
from raytrain.checkpoint.export import check_out_dir
from raytrain.config import (AUTO, OWN_DEFAULT_PEAK_LR, ZERO_ALIASED, ClusterConfig, ConfigError, DataConfig,
                             RunConfig, ScalingConfig, TrainingConfig)
from raytrain.config_fields import ray_address
from raytrain.data.sources import Sources
from raytrain.deepspeed_config import load_deepspeed
from raytrain.planning.choose import find_autos
from raytrain.planning.memory import GIB, DoesNotFit, MemoryPlan, check_fits, estimate_memory, gib, verdict
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.run_spec import ClusterShape, ResolvedRun


def check_before_ray(cfg: RunConfig) -> None:
    """Paths and addresses, with one-line ConfigErrors; nothing is created."""
    check_writable_dir(cfg.checkpoint.storage_path, "checkpoint.storage_path")
    check_storage_outside_data(cfg.checkpoint.storage_path, cfg.checkpoint.name, cfg.data)
    check_model_is_not_a_run(cfg.model.name_or_path)
    if cfg.checkpoint.resume_from:  # a URI pyarrow cannot reach is one line there too
        layout.check_is_checkpoint(cfg.checkpoint.resume_from, "checkpoint.resume_from")
    if cfg.checkpoint.export_dir:
        check_writable_dir(cfg.checkpoint.export_dir, "checkpoint.export_dir")
        check_export_outside_run(cfg.checkpoint.export_dir, cfg.checkpoint.storage_path, cfg.checkpoint.name)
        check_out_dir(cfg.checkpoint.export_dir, "checkpoint.export_dir")  # before hours of training
        check_export_outside_data(cfg.checkpoint.export_dir, cfg.data)
    check_ray_address(cfg.cluster.address)


def check_model_is_not_a_run(name_or_path: str | None) -> None:
    """model.name_or_path is not a raytrain checkpoint or run directory, where neither config.json nor weights are
    (they are DeepSpeed shards): the model's own checks said "holds no weights ...: drop model.pretrained to train
    from random init", or, without model.pretrained, transformers' "Should have a `model_type` key in its
    config.json", where the fix is the export or --resume-from. A local directory only: two listings."""
    if name_or_path is None or not os.path.isdir(name_or_path) or os.path.isfile(
            os.path.join(name_or_path, "config.json")):
        return
    if os.path.isfile(os.path.join(name_or_path, layout.METADATA)):
        checkpoint, what = name_or_path, "a raytrain checkpoint"
    else:
        steps = sorted(d for d in os.listdir(name_or_path) if d.startswith("checkpoint_step_")
                       and os.path.isfile(os.path.join(name_or_path, d, layout.METADATA)))
        if not steps:
            return
        checkpoint = os.path.join(name_or_path, steps[-1])
        what = f"a raytrain run's directory (its latest checkpoint is {steps[-1]})"
    raise ConfigError(f"model.name_or_path={name_or_path} is {what}, not a Hugging Face model directory: export it "
                      f"(python -m raytrain.tools.export {checkpoint} OUT_DIR) and set model.name_or_path=OUT_DIR "
                      f"model.pretrained=true to train from its weights, or pass --resume-from {checkpoint} to "
                      f"continue its training")


def check_storage_outside_data(storage_path: str, name: str | None, data: DataConfig) -> None:
    """The run's directory (STORAGE/NAME: checkpoint.storage_path and checkpoint.name) is not in
    data.path or data.eval_path: its checkpoints, tensorboard events, plots and summaries would be
    listed as data (a reviewer's run: under data.format=text a run trained on its .pt shards, 40 MB read for
    0.3 MB of text, exit 0; under auto a continued run stopped at "mixes formats"). Local paths compare
    resolved (~, relative to here, links: realpath; file:// is local), URIs by scheme and normalized
    key (gcs:// is gs://, no query). Data inside the run's directory (data.path=STORAGE/NAME/corpus)
    is left alone: the run writes beside it, not into it. Costs a realpath and an isdir per local path."""
    storage = _location(storage_path)
    run = storage if not name else (storage[0], posixpath.join(storage[1], name))
    for key, path, held in _data_directories(data):
        if _within(run, held):
            shown = storage_path if storage[0] else storage[1]
            given = path if held[0] or path == held[1] else f"{path} ({held[1]})"
            if _within(storage, held):
                where = f"checkpoint.storage_path={shown} is {'' if storage == held else 'inside '}{key}={given}"
            else:
                where = (f"checkpoint.storage_path={shown} with checkpoint.name={name!r} puts the run's directory at "
                         f"{key}={given}")
            read_as = "training" if key == "data.path" else "eval"
            raise ConfigError(f"{where}: the run's checkpoints, logs and summaries would be read as {read_as} data: "
                              f"move checkpoint.storage_path out of the data, or point {key} at a subdirectory "
                              f"holding only the data")


def check_export_outside_data(export_dir: str, data: DataConfig) -> None:
    """checkpoint.export_dir is not in data.path or data.eval_path: the export (config.json, tokenizer files,
    safetensors) lands in the data after the run, and the next run on that data lists it as data (under
    data.format=text it trains on the weights' bytes; under auto it stops at the export's config.json)."""
    export = _location(export_dir)
    for key, path, held in _data_directories(data):
        if _within(export, held):
            given = path if held[0] or path == held[1] else f"{path} ({held[1]})"
            raise ConfigError(f"checkpoint.export_dir={export_dir} is {'' if export == held else 'inside '}{key}="
                              f"{given}: the exported model's files would be read as data by the next run on it: "
                              f"export outside the data, or point {key} at a subdirectory holding only the data")


def check_export_outside_run(export_dir: str, storage_path: str, name: str | None) -> None:
    """checkpoint.export_dir does not hold the run's directory (STORAGE/NAME, or a new one under STORAGE when
    checkpoint.name is None): the export refuses a directory that is not empty, and after training it would
    find its own run's checkpoints there (seen: a 2-step run trained, then ended on "exists and is not
    empty"). An export inside the run's directory is left alone: --fresh sets it aside with the run."""
    export, storage = _location(export_dir), _location(storage_path)
    run = (storage[0], posixpath.join(storage[1], name)) if name else storage
    if _within(run, export):
        shown = storage_path if storage[0] else storage[1]
        what = (f"checkpoint.storage_path={shown}" if run == storage else
                f"the run's directory (checkpoint.storage_path={shown}, checkpoint.name={name!r})")
        inside = "is" if run == export else "holds"
        raise ConfigError(f"checkpoint.export_dir={export_dir} {inside} {what}: the export never writes into a "
                          f"directory that is not empty, and after training it would hold the run's checkpoints: "
                          f"export elsewhere, e.g. checkpoint.export_dir={export_dir.rstrip('/')}-export")
    if name and _within(export, run) and export != run:
        # a directory the run writes itself (the model's files at its start, checkpoints, TensorBoard's events,
        # the sample log, the universal copies): the export at the end found it not empty, after the training
        own = posixpath.relpath(export[1], run[1]).split("/", 1)[0]
        if own in _RUN_OWN_DIRS or re.fullmatch(r"checkpoint_step_\d+", own):
            raise ConfigError(f"checkpoint.export_dir={export_dir} is inside {own}/ of the run's directory, which the "
                              f"run writes itself: the export would find it not empty after training; export "
                              f"elsewhere, e.g. checkpoint.export_dir="
                              f"{posixpath.join(storage_path.rstrip('/'), name, 'export')}")


# What a run writes under its own directory besides checkpoint_step_*: the model's files, universal copies,
# TensorBoard's events (raytrain.worker.tracking), the sample log (raytrain.worker.samples).
_RUN_OWN_DIRS = frozenset({layout.MODEL_DIR, layout.UNIVERSAL_DIR, layout.TENSORBOARD_DIR, layout.SAMPLES_DIR})


def _location(path: str) -> tuple[str, str]:
    """(scheme, path) to compare: local paths resolved (~, relative to here, links; file:// is local; need not
    exist), URIs by scheme and normalized key (gcs:// is gs://, no query)."""
    if "://" in path and not path.lower().startswith("file://"):
        scheme, _, rest = path.partition("://")
        return {"gcs": "gs"}.get(scheme.lower(), scheme.lower()), posixpath.normpath("/" + rest.split("?", 1)[0])
    local = path[len("file://"):] if "://" in path else path
    return "", os.path.realpath(os.path.expanduser(local))


def _within(child: tuple[str, str], parent: tuple[str, str]) -> bool:
    return child[0] == parent[0] and (child[1] == parent[1] or child[1].startswith(parent[1].rstrip("/") + "/"))


def _data_directories(data: DataConfig) -> Iterator[tuple[str, str, tuple[str, str]]]:
    """(key, path as given, its _location) for each directory in data.path and data.eval_path: a local path
    that is no directory here (a file, a hub id org/name) is left out."""
    for key, value in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        for path in [value] if isinstance(value, str) else list(value or ()):
            held = _location(path)
            if held[0] or os.path.isdir(held[1]):
                yield key, path, held


def check_ray_address(address: str | None) -> None:
    """The environment's RAY_ADDRESS, when `address` (cluster.address, already checked by the config)
    does not override it, follows cluster.address's rule. Also called by every `connect` (plan and
    preflight too): ray.init's own refusal of a dashboard address is a 27-line ValueError traceback."""
    if address is None and os.environ.get("RAY_ADDRESS"):
        env = os.environ["RAY_ADDRESS"]
        try:
            ray_address(env)  # the rule cluster.address is declared with
        except ValueError as e:
            raise ConfigError(f"the environment's RAY_ADDRESS={env!r} {e} (or unset it for a local "
                              f"cluster)") from None


def check_writable_dir(path: str, key: str, instead: str = "a cloud URI") -> None:
    """`path` is a directory raytrain can write, or one it can create (without creating it); the
    errors name `instead` as the other way out. A URI (s3://, gs://, ...) is storage this driver
    can reach (`check_storage_uri`)."""
    if "://" in path:
        check_storage_uri(path, key)
        return
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):/(?!/)", path)
    if scheme:  # `s3:/bucket/runs` would silently be a local directory ./s3:/bucket/runs
        raise ConfigError(f"{key}={path}: a URI takes two slashes after its scheme: write "
                          f"{scheme.group(1)}://{path[scheme.end():]} (or ./{path} for a local directory)")
    local = os.path.abspath(os.path.expanduser(path))
    existing = local
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "it" if existing == local else f"{existing}, on its path,"
        raise ConfigError(f"{key}={path}: {where} is a file, not a directory: choose a directory (or {instead})")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "it is not writable" if existing == local else f"it cannot be created ({existing} is not writable)"
        raise ConfigError(f"{key}={path}: {what}: choose a writable directory or {instead}")


def check_storage_uri(uri: str, key: str) -> None:
    """`uri`'s scheme is one pyarrow (Ray Train's storage layer) has a filesystem for, and this driver can
    reach it (layout.check_reachable: the driver reads the run's record there before any worker starts,
    a dry run too). An unknown scheme (az://, s3a://, wasbs://) otherwise raised ArrowInvalid after
    ray.init, or in the dry run as a traceback; an unreachable bucket, a 32-line OSError traceback after
    ray.init. Costs a round trip or two to the store (seconds at most when it does not answer)."""
    import pyarrow.fs

    scheme = uri.partition("://")[0].lower()
    if scheme not in _ARROW_SCHEMES:
        try:  # a scheme registered outside pyarrow's list (a later pyarrow, an fsspec handler): let pyarrow say
            pyarrow.fs.FileSystem.from_uri(uri)
        except (ValueError, OSError, pyarrow.lib.ArrowException) as e:  # ArrowInvalid is a ValueError
            if "Unrecognized filesystem type" in str(e):
                azure = (" (Azure storage is abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH: cluster/ib.yaml)"
                         if scheme in _AZURE_SCHEMES else "")
                raise ConfigError(f"{key}={uri}: pyarrow has no filesystem for the scheme {scheme}:// : use s3://, "
                                  f"gs://, abfs://, hdfs:// or a local path{azure} (an S3-compatible store is s3:// "
                                  f"with AWS_ENDPOINT_URL)") from None
    layout.check_reachable(uri, key)


# pyarrow.fs.FileSystem.from_uri's schemes: any other is asked whether pyarrow knows it before the probe, so that
# one it does not know is named as such, with the schemes that work.
_ARROW_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "file", "mock", "abfs", "abfss"})
# Azure's other spellings (adlfs/fsspec's az://, Hadoop's wasb(s):// and adl://): pyarrow reads none of them.
_AZURE_SCHEMES = frozenset({"az", "wasb", "wasbs", "adl"})


def resolve_before_ray(cfg: RunConfig, sources: Sources) -> ResolvedRun | None:
    """The run resolved for the shape the config states, before any cluster is joined.

    The shape is the config's own when it sets scaling.num_workers and scaling.use_gpu, or when the
    run starts its own local cluster (no cluster.address, no RAY_ADDRESS): this machine, with the
    CPUs that cluster will have, and a worker placement it could never make is refused here. Otherwise
    (joining a cluster whose GPUs only it knows) None: the driver resolves after connecting."""
    joins = not starts_local_cluster(cfg.cluster)
    if joins and (cfg.scaling.num_workers is None or cfg.scaling.use_gpu is None):
        return None
    if joins and find_autos(cfg, load_deepspeed(cfg.deepspeed)):
        return None  # "auto" settings are chosen for the cluster's memory, known once connected
    # A local cluster is this machine: its GPUs and RAM are the target "auto" settings are chosen for.
    target = None if joins else hardware.this_machine()
    shape = shape_from_config(cfg, 0 if joins else _local_gpus())
    local = not joins and not _ray_initialized()  # the local cluster this run starts: its CPUs are known now
    # whether the workers' nodes include the driver's is known here only for that local cluster; otherwise once
    # connected (raytrain.driver.cluster.live_shape)
    shape = dataclasses.replace(shape, driver_on_worker_node=local)
    if local:
        shape = dataclasses.replace(shape, cpus_total=local_cluster_cpus(cfg.cluster, cfg.scaling))
    resolved = resolve_run(cfg, shape, sources, target)
    if local:  # after the config's own errors, which hold wherever it runs
        check_local_placement(cfg)
    return resolved


def starts_local_cluster(cluster: ClusterConfig) -> bool:
    """Whether the run starts a local cluster (or reuses the one this process holds): no cluster.address and
    no RAY_ADDRESS, or "local", which in Ray means a new local cluster (ray.init(address="local"))."""
    return (cluster.address or os.environ.get("RAY_ADDRESS") or "local") == "local"


def local_cluster_cpus(cluster: ClusterConfig, scaling: ScalingConfig) -> int:
    """The logical CPUs of the local cluster a run starts: cluster.num_cpus, else room for the workers and
    for Ray Data's tokenization tasks (with only the workers' share, Ray Data never gets a CPU and the run
    hangs), or this machine's CPUs where it has more. An elastic range gets room for its maximum (a local
    cluster never grows); a GPU run without scaling.num_workers has a worker per local GPU."""
    if cluster.num_cpus:
        return cluster.num_cpus
    workers = scaling.num_workers
    if isinstance(workers, list):
        workers = max(workers)
    if workers is None:
        workers = (_local_gpus() if scaling.use_gpu is not False else 0) or 2
    return max(os.cpu_count() or 1, int(workers * scaling.cpus_per_worker) + 2)


def _ray_initialized() -> bool:
    """Whether this process is connected to a Ray cluster already (a notebook's second fit(), the user's own
    ray.init()): the run then goes there, not to a new local cluster."""
    import ray

    return ray.is_initialized()


def _local_gpus() -> int:
    """The GPUs a local Ray cluster started here will have: Ray counts CUDA_VISIBLE_DEVICES when set
    (nvidia-smi sees every GPU of the machine regardless)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(hardware.gpus(use_torch=False))


def check_memory(resolved: ResolvedRun, target: hardware.Target, written: RunConfig | None = None) -> str:
    """The planner's verdict line for `resolved` on `target`; raises DoesNotFit (its one line) if it does not fit.
    `written`: the config before resolve_run, whose keys the refusal names (estimate_memory).

    An elastic range is checked at each of its sizes: ZeRO-3's states per GPU are largest at the
    minimum, but host RAM per node (more workers on a node) and hpZ's copy can be largest higher up.
    The verdict is that of the size closest to a limit."""
    plans = []
    for w in resolved.cluster.world_sizes:
        plan = estimate_memory(resolved.at_world_size(w), target, written=written)
        try:
            check_fits(plan)
        except DoesNotFit as e:
            if not resolved.cluster.elastic:
                raise
            shape = resolved.cluster
            raise DoesNotFit(f"scaling.num_workers=[{shape.min_workers}, {shape.num_workers}], at world size {w}: {e}",
                             plan) from None
        plans.append(plan)
    return verdict(max(plans, key=_usage))


def checkpoint_space_note(resolved: ResolvedRun) -> str | None:
    """A note when checkpoint.storage_path, a local or shared directory, has less free space than the run keeps
    there at once: checkpoint.num_to_keep checkpoints and the next, which is written before the oldest is deleted
    (the final one only, with every_n_steps=0), less this run's checkpoints already there.

    A ZeRO checkpoint holds every parameter's master weight and optimizer states: 12 bytes a parameter with fp32
    master weights and Adam's two moments (measured: 12.294 GiB for the 1.1B model on an H200, 12.0 bytes a
    parameter; 11.8 for the CPU default), 6 with bf16 master weights and optimizer states (measured: 6.147 GiB for
    the 1.1B model on an H100, 6.0 bytes a parameter). Only a note, not a
    refusal: another optimizer keeps other states, and space may be freed while the run trains. A save that finds
    the disk full stops the run in one line (raytrain.checkpoint.shards). One statvfs and one directory walk."""
    ckpt = resolved.config.checkpoint
    if "://" in ckpt.storage_path:
        return None  # object stores have no free space to ask
    bf16 = resolved.ds_config.get("bf16") or {}
    per_param = (2 if bf16.get("bf16_master_weights_and_grads") else 4) + (4 if bf16.get("bf16_optimizer_states")
                                                                           else 8)
    size = resolved.model.num_parameters * per_param
    storage = os.path.abspath(os.path.expanduser(ckpt.storage_path))
    existing = storage
    while not os.path.exists(existing):  # a storage path made when the run starts: its disk is its parent's
        existing = os.path.dirname(existing)
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return None
    held = ckpt.num_to_keep + 1 if ckpt.every_n_steps else 1
    run = os.path.join(storage, ckpt.name) if ckpt.name else None
    mine = _dir_bytes(run, "checkpoint_") if run and os.path.isdir(run) else 0
    if free + mine >= held * size:
        return None
    return (f"checkpoint.storage_path={ckpt.storage_path} has {gib(free)} free, and this run keeps up to {held} "
            f"checkpoints of about {gib(size)} there at once ({per_param} bytes a parameter: master weights and "
            f"optimizer states; checkpoint.num_to_keep={ckpt.num_to_keep}, and the next is written before the oldest "
            f"is deleted): free space there or choose another storage path; a save that does not fit stops the run")


def _dir_bytes(path: str, prefix: str) -> int:
    """Bytes of the files under `path`'s entries whose names start with `prefix`."""
    total = 0
    for entry in os.scandir(path):
        if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False):
            for d, _, files in os.walk(entry.path):
                total += sum(os.path.getsize(os.path.join(d, f)) for f in files
                             if os.path.isfile(os.path.join(d, f)))
    return total


def _usage(plan: MemoryPlan) -> tuple[float, int]:
    """How close the configured setting comes to the plan's known limits (then its bytes per worker)."""
    o = plan.configured
    gpu = o.worker_bytes / plan.gpu_memory_bytes if plan.use_gpu and plan.gpu_memory_bytes else 0.0
    host = o.host_bytes_per_node / plan.host_memory_bytes if plan.host_memory_bytes else 0.0
    return max(gpu, host), o.worker_bytes


def tightest(resolved: ResolvedRun) -> ResolvedRun:
    """The run at its fewest workers (an elastic range's minimum), where ZeRO-3's states per GPU
    (1/N of them) are largest: the size the memory check must pass at."""
    return resolved.at_world_size(resolved.cluster.world_sizes[0])


def dry_run_target(cfg: RunConfig, *, gpu_memory_gib: float | None, host_memory_gib: float | None,
                   gpus_per_node: int | None) -> tuple[RunConfig, ClusterShape, hardware.Target | None]:
    """(config, shape, target) of a dry run: the stated sizes (a cluster that may not exist yet), else
    this machine. None: nothing to plan against (a GPU run on a machine without GPUs, no sizes stated)."""
    for flag, value in (("--gpu-memory-gib", gpu_memory_gib), ("--host-memory-gib", host_memory_gib),
                        ("--gpus-per-node", gpus_per_node)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value:g}")
    if any(v is not None for v in (gpu_memory_gib, host_memory_gib, gpus_per_node)):
        # Either GPU flag states a GPU target; --gpus-per-node alone once planned CPU workers against it
        # (memory "?") and said "fits".
        gpu_flag = "--gpu-memory-gib" if gpu_memory_gib is not None else "--gpus-per-node" if gpus_per_node else None
        if gpu_flag and cfg.scaling.use_gpu is False:
            raise ConfigError(f"{gpu_flag} plans a GPU cluster but scaling.use_gpu=false: drop one of them")
        if gpu_flag and cfg.scaling.use_gpu is None:
            cfg = cfg.with_overrides(["scaling.use_gpu=true"])
        target = hardware.Target(int(gpu_memory_gib * GIB) if gpu_memory_gib else None,
                                 int(host_memory_gib * GIB) if host_memory_gib else None, gpus_per_node)
        # the node size also sets the shape: hpZ "auto" and the workers per node are resolved from it; the nodes
        # are another cluster's, whose packages this machine's do not stand for
        shape = shape_from_config(cfg)
        return cfg, dataclasses.replace(shape, gpus_per_node=gpus_per_node, driver_on_worker_node=False), target
    here = hardware.this_machine()
    shape = shape_from_config(cfg, here.gpus_per_node or 0)
    # this machine stands for the workers' nodes where the same command would start a local cluster here, with
    # the GPUs a GPU run needs; else the dry run plans for a cluster elsewhere (a laptop, a CPU head node)
    here_runs_workers = starts_local_cluster(cfg.cluster) and (not shape.use_gpu or bool(here.gpus_per_node))
    shape = dataclasses.replace(shape, driver_on_worker_node=here_runs_workers)
    if plans_local_cluster(cfg.cluster):  # the real run's local cluster, of these CPUs (Ray Data's share checked)
        shape = dataclasses.replace(shape, cpus_total=local_cluster_cpus(cfg.cluster, cfg.scaling))
    if not shape.use_gpu:
        return cfg, shape, hardware.Target(None, here.host_memory_bytes, None)
    return cfg, shape, here if here.gpu_memory_bytes else None


# ---------------------------------------------------------------------------------------------
# Placement: what Ray Train asks the cluster for, and whether the cluster can ever give it. Ray Train
# waits for a placement group it can never have, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s) at a
# time, printing the controller's 40-line traceback after each, forever.


def worker_bundle(scaling: ScalingConfig, use_gpu: bool) -> dict[str, float]:
    """One worker's resources, as raytrain.driver.run builds its ScalingConfig and Ray Train adds to it: the
    accelerator type is a node resource `accelerator_type:TYPE`, of which each worker takes 0.001
    (ray/air/config.py, ScalingConfig._resources_per_worker_not_none, ray 2.60.0)."""
    bundle = {"CPU": scaling.cpus_per_worker, **({"GPU": 1.0} if use_gpu else {})}
    if scaling.accelerator_type:
        bundle[f"accelerator_type:{scaling.accelerator_type}"] = 0.001
    return bundle


def _holds(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many `bundle`s one node holds (every resource of a bundle on the same node, as Ray places them)."""
    # 1e-9: Ray keeps resources to 1e-4, and 0.3 + 0.3 + 0.3 is not 0.9 in floats
    return min(math.floor(node.get(key, 0.0) / amount + 1e-9) for key, amount in bundle.items())


def placeable(nodes: Sequence[Mapping[str, float]], bundle: Mapping[str, float], strategy: str) -> int:
    """The most workers of `bundle` a placement group of `strategy` can hold on `nodes` (their total resources)."""
    holds = [_holds(node, bundle) for node in nodes]
    if strategy == "STRICT_SPREAD":  # one worker per node
        return sum(1 for n in holds if n >= 1)
    if strategy == "STRICT_PACK":  # every worker on one node
        return max(holds, default=0)
    return sum(holds)  # PACK and SPREAD are preferences: any node holds what it can


def check_placement(scaling: ScalingConfig, use_gpu: bool, nodes: Sequence[Mapping[str, float]], where: str, *,
                    more_cpus: str, more_nodes: str) -> None:
    """Refuse a worker group that `nodes` (each node's total resources: all the cluster has, or can add)
    can never hold, in one line naming the setting. `where` names the cluster ("the local Ray cluster ...");
    `more_cpus` and `more_nodes` say how to give it more ("raise cluster.num_cpus", "add nodes"). The group
    that must fit is scaling.num_workers, or an elastic range's minimum (Ray Train starts an elastic group
    with as many workers as it can place, at least the minimum)."""
    size = scaling.num_workers
    if isinstance(size, list):
        low, high = size
        what = f"the elastic range's minimum of {low} workers (scaling.num_workers=[{low}, {high}])"
        size = low
    else:
        if size is None:  # one worker per GPU, else 2 (raytrain.planning.resolve.shape_from_config)
            size = int(sum(node.get("GPU", 0.0) for node in nodes)) if use_gpu else 2
        what = f"{size} workers"
    bundle = worker_bundle(scaling, use_gpu)
    strategy = scaling.placement_strategy
    if placeable(nodes, bundle, strategy) >= max(size, 1):
        return
    accelerator = scaling.accelerator_type
    if accelerator and not any(node.get(f"accelerator_type:{accelerator}", 0) > 0 for node in nodes):
        known = sorted({key.partition(":")[2] for node in nodes for key, value in node.items()
                        if key.startswith("accelerator_type:") and value > 0})
        same = [k for k in known if k.lower() == accelerator.lower()]
        if same:
            has = f" (Ray's names are case-sensitive: its nodes have {same[0]!r})"
        else:
            has = f" (its nodes have {', '.join(known)})" if known else ", nor any other (Ray gives one to GPU nodes)"
        raise ConfigError(f"scaling.accelerator_type={accelerator!r}: no node of {where} has that accelerator type"
                          f"{has}: set it to one they have, or unset it (null)")
    gpus = sum(node.get("GPU", 0.0) for node in nodes)
    if use_gpu and gpus == 0:
        raise ConfigError(f"scaling.use_gpu=true, and {where} has no GPU: set scaling.use_gpu=false to train on CPU, "
                          f"or run on a cluster with GPUs (cluster.address)")
    anywhere = placeable(nodes, bundle, "PACK")
    if strategy == "STRICT_SPREAD" and anywhere >= size:
        raise ConfigError(f"scaling.placement_strategy=STRICT_SPREAD puts each of {what} on a node of its own, and "
                          f"{where} has {placeable(nodes, bundle, strategy)} node(s) that can hold one: use PACK or "
                          f"SPREAD, fewer workers, or {more_nodes}")
    if strategy == "STRICT_PACK" and anywhere >= size:
        raise ConfigError(f"scaling.placement_strategy=STRICT_PACK puts all of {what} on one node, and a node of "
                          f"{where} holds at most {placeable(nodes, bundle, strategy)}: use PACK or SPREAD, or "
                          f"fewer workers")
    if use_gpu and placeable(nodes, {"GPU": 1.0}, "PACK") < size:
        raise ConfigError(f"{what} need a GPU each, and {where} has {gpus:g}: lower scaling.num_workers, or run on "
                          f"a cluster with more GPUs")
    cpus = scaling.cpus_per_worker
    if placeable(nodes, {"CPU": cpus}, "PACK") < size:
        total = sum(node.get("CPU", 0.0) for node in nodes)
        split = (f"; a worker's CPUs must be on one node, and its nodes hold {placeable(nodes, {'CPU': cpus}, 'PACK')}"
                 if total >= size * cpus else "")
        raise ConfigError(f"{what} x scaling.cpus_per_worker={cpus:g} need {size * cpus:g} CPUs, and {where} has "
                          f"{total:g}{split}: lower scaling.cpus_per_worker (fractions work) or scaling.num_workers, "
                          f"or {more_cpus}")
    # Each resource is there, but not together: e.g. the nodes of the accelerator type are too small or too few.
    each = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
    raise ConfigError(f"{what} need {each} each, and {where} can place {anywhere}: lower scaling.num_workers or "
                      f"scaling.cpus_per_worker, or {more_nodes}")


def check_local_placement(cfg: RunConfig) -> None:
    """`check_placement` for the local cluster this run starts (before ray.init, and in a dry run): one node
    with `local_cluster_cpus` CPUs, this machine's GPUs (CUDA_VISIBLE_DEVICES counts, as Ray counts them)
    and the accelerator type Ray would give them."""
    scaling = cfg.scaling
    gpus = _local_gpus()
    node = {"CPU": float(local_cluster_cpus(cfg.cluster, scaling)), "GPU": float(gpus)}
    kind = hardware.ray_accelerator_type() if gpus and scaling.accelerator_type else None
    if kind:
        node[f"accelerator_type:{kind}"] = 1.0
    sized = f"cluster.num_cpus={cfg.cluster.num_cpus}" if cfg.cluster.num_cpus else f"{node['CPU']:g} CPUs"
    where = f"the local Ray cluster this run starts (one node: {sized}, {f'{gpus} GPUs' if gpus else 'no GPU'})"
    use_gpu = scaling.use_gpu if scaling.use_gpu is not None else gpus > 0
    check_placement(scaling, use_gpu, [node], where, more_cpus="raise cluster.num_cpus",
                    more_nodes="set cluster.address to a cluster of several nodes")


def plans_local_cluster(cluster: ClusterConfig) -> bool:
    """Whether a dry run plans for the local cluster the real run starts here. A dry run plans for the shape
    the config asks for, which may be a cluster elsewhere (the same command submitted with `ray job submit`,
    where RAY_ADDRESS is set; a GPU run planned on a laptop): only a config that says the run is local,
    cluster.address=local or a cluster.num_cpus (which sizes nothing else), is held to this machine."""
    local = (cluster.address or os.environ.get("RAY_ADDRESS")) == "local" or cluster.num_cpus is not None
    return local and starts_local_cluster(cluster)


def local_elastic_note(cfg: RunConfig) -> list[str]:
    """A note where an elastic range runs on the local cluster raytrain starts: one node, sized for the
    range's maximum, that no node loss or return can change, so the run keeps the size it starts at and
    scaling.replacement_timeout_s and resize_interval_s never act (a user trying elastic training here saw
    nothing happen, without a word)."""
    num_workers = cfg.scaling.num_workers
    # a process already connected (a notebook's ray.init("ray://...")) runs where it is connected
    if not isinstance(num_workers, list) or not starts_local_cluster(cfg.cluster) or _ray_initialized():
        return []
    return [f"scaling.num_workers={num_workers} runs on the one-node local cluster raytrain starts here, which "
            f"loses and gains no node: the run keeps the size it starts at and never resizes; an elastic run "
            f"needs a cluster of several nodes (cluster.address, or ray job submit)"]


def check_dry_run_placement(cfg: RunConfig, *sizes: float | None) -> None:
    """A dry run's `check_local_placement`, where it plans for the local cluster (`plans_local_cluster`) and
    `sizes` (--gpu-memory-gib, --host-memory-gib, --gpus-per-node) state no other target."""
    if plans_local_cluster(cfg.cluster) and all(size is None for size in sizes):
        check_local_placement(cfg)


def idle_settings(cfg: RunConfig, use_gpu: bool, num_workers: int | None = None) -> list[str]:
    """Settings that have no effect on this run: a note each, naming the key and why (a setting that
    silently does nothing reads as one that works); and `zero_stage_note`. Only values the user set are
    named: a section's value other than its default, a key the DeepSpeed JSON holds. The data settings
    that the data sources leave unused are raytrain.data.sources' notes. `num_workers`: the run's worker
    count where scaling.num_workers leaves it to the cluster (one per GPU)."""
    scaling, cluster = cfg.scaling, cfg.cluster
    notes = _idle_data_and_training(cfg)
    if scaling.gpu_memory_fraction is not None and not use_gpu:
        notes.append(f"scaling.gpu_memory_fraction={scaling.gpu_memory_fraction:g} has no effect: it caps each "
                     f"worker's share of its GPU, and this run has no GPU (scaling.use_gpu=false)")
    if not isinstance(scaling.num_workers, list):
        defaults = ScalingConfig()
        for key in ("replacement_timeout_s", "resize_interval_s"):
            value = getattr(scaling, key)
            if value != getattr(defaults, key):
                notes.append(f"scaling.{key}={value:g} has no effect: it applies to an elastic run "
                             f"(scaling.num_workers=[min, max]), and this run has a fixed number of workers")
    if cluster.num_cpus is not None and not starts_local_cluster(cluster):
        joins = (f"cluster.address={cluster.address}" if cluster.address
                 else f"the environment's RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}")
        notes.append(f"cluster.num_cpus={cluster.num_cpus} has no effect: it sizes the local cluster raytrain "
                     f"starts, and this run joins {joins}, whose nodes have the CPUs they were started with")
    zero = zero_stage_note(cfg, scaling.num_workers if scaling.num_workers is not None else num_workers)
    return notes + ([zero] if zero else [])


def _idle_data_and_training(cfg: RunConfig) -> list[str]:
    """`idle_settings`' notes on the data, training and DeepSpeed settings the config alone makes idle."""
    data, training = cfg.data, cfg.training
    data_defaults, training_defaults = DataConfig(), TrainingConfig()
    notes = []
    if data.eval_every_n_steps != data_defaults.eval_every_n_steps and data.eval_path is None \
            and not data.eval_fraction:
        notes.append(f"data.eval_every_n_steps={data.eval_every_n_steps} has no effect: it sets how often the held-out "
                     f"data is evaluated, and this run has none: set data.eval_path or data.eval_fraction")
    # data.eval_path's files are read by data.text_column too, whatever the training data is
    if data.text_column != data_defaults.text_column and data.path is None and data.eval_path is None:
        notes.append(f"data.text_column={data.text_column!r} has no effect: it names the documents' column in "
                     f"data.path's files, and this run trains on the built-in corpus (data.path is null)")
    if data.path is None and cfg.model.name_or_path is not None \
            and data.num_builtin_documents == data_defaults.num_builtin_documents:
        # `data.path:` left empty in a YAML is null too: a user's own model then trained on generated stories (a
        # corpus sized on purpose, as `raytrain.tools.bench --model-dir` does, is meant)
        notes.append(f"data.path is null: this run trains model.name_or_path={cfg.model.name_or_path} on raytrain's "
                     f"built-in corpus (generated short stories, for trying a setup out); set data.path to your "
                     f"data")
    if training.warmup_steps != training_defaults.warmup_steps and training.warmup_steps > training.max_steps:
        notes.append(f"training.warmup_steps={training.warmup_steps} is more than training.max_steps="
                     f"{training.max_steps}: the learning rate is still warming up when the run ends, so it never "
                     f"reaches its peak (training.learning_rate) and never decays; set training.warmup_steps below "
                     f"{training.max_steps}")
    ds = load_deepspeed(cfg.deepspeed)
    zero = ds.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if isinstance(offload, dict):
        ratio, device = offload.get("ratio"), str(offload.get("device", "none")).lower()
        # DeepSpeed's default ratio is 1.0 (all of it offloaded); "auto" is the planner's to choose
        if type(ratio) in (int, float) and ratio != 1 and device == "none":
            notes.append(f"deepspeed.zero_optimization.offload_optimizer.ratio={ratio:g} has no effect: it is the "
                         f"share of the optimizer states offloaded, and offload_optimizer.device is none: set the "
                         f"device to cpu to offload that share, or drop ratio")
    notes += _stage3_keys_below_stage3(zero)
    notes += _peak_lr_replaced(ds, cfg.deepspeed)
    for key, (on, reader) in _UNUSED_DEEPSPEED.items():
        value = ds.get(key)
        if key in ds and (not on or (isinstance(value, dict) and value.get("enabled") is True)):
            notes.append(f"deepspeed.{key} has no effect: {reader}: remove it")
    return notes


# DeepSpeed keys that only parts of DeepSpeed raytrain never runs read (deepspeed 0.19.8): the data loader
# (engine.deepspeed_io: its drop_last and data_efficiency's curriculum sampling), the launcher's autotuner and
# the pipeline engine. key -> (noted only when its "enabled" is true, what reads it)
_UNUSED_DEEPSPEED = {
    "dataloader_drop_last": (False, "only DeepSpeed's data loader reads it, and raytrain's data comes from Ray "
                                    "Data (each tokenize batch's tail shorter than data.seq_len is dropped)"),
    "data_efficiency": (True, "its curriculum sampling runs in DeepSpeed's data loader, which raytrain does not "
                              "use (Ray Data feeds the workers), and its random-LTD needs layers DeepSpeed converted, "
                              "which raytrain's models are not"),
    "autotuning": (True, "DeepSpeed's launcher (deepspeed --autotuning) runs it, and raytrain starts its workers "
                         "through Ray Train"),
    "pipeline": (False, "only DeepSpeed's PipelineModule reads it, and raytrain trains the model as one stage on "
                        "every worker"),
}


def _stage3_keys_below_stage3(zero: object) -> list[str]:
    """One note naming the ZeRO-3-only keys (stage3_*, or the field names DeepSpeed reads them under) given values
    in a zero_optimization section of stage 0-2, where DeepSpeed reads none of them: a stage-3 JSON turned to stage
    2 keeps its tuning without a word. "auto" values are left out: raytrain fills those (the shipped configs write
    them), so a stage override alone names nothing. offload_param below stage 3 is refused (deepspeed_check)."""
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if type(stage) is not int or stage not in (0, 1, 2):
        return []
    keys = [k for k, v in zero.items() if (k.startswith("stage3_") or k in ZERO_ALIASED) and v != AUTO]
    if not keys:
        return []
    named = ", ".join(f"deepspeed.zero_optimization.{k}" for k in keys)
    has, it = ("has", "it") if len(keys) == 1 else ("have", "them")
    return [f"{named} {has} no effect: DeepSpeed reads {it} at ZeRO stage 3 only, and "
            f"deepspeed.zero_optimization.stage is {stage}: remove {it}, or set the stage to 3"]


def _peak_lr_replaced(ds: dict, source) -> list[str]:
    """A note where the JSON's scheduler warms up to a peak of DeepSpeed's own instead of its optimizer's concrete
    lr: WarmupDecayLR without warmup_max_lr peaks at 0.001 (DeepSpeed's documented default, so not refused; a
    training.learning_rate the user wrote beside it is: raytrain.config.OWN_DEFAULT_PEAK_LR)."""
    optimizer, scheduler = ds.get("optimizer"), ds.get("scheduler")
    if not (isinstance(optimizer, dict) and isinstance(scheduler, dict)):
        return []
    params, optimizer_params = scheduler.get("params"), optimizer.get("params")
    peak = OWN_DEFAULT_PEAK_LR.get(str(scheduler.get("type")))
    lr = optimizer_params.get("lr") if isinstance(optimizer_params, dict) else None
    if peak is None or (isinstance(params, dict) and "warmup_max_lr" in params) or type(lr) not in (int, float) \
            or lr == peak:
        return []
    where = f" (in {source})" if isinstance(source, str) else ""
    return [f"deepspeed.optimizer.params.lr={lr:g}{where} has no effect on the peak learning rate: "
            f"deepspeed.scheduler ({scheduler['type']}) has no params.warmup_max_lr, so DeepSpeed warms up to its "
            f"own {peak:g}; write \"warmup_max_lr\": {lr:g} there"]


def zero_stage_note(cfg: RunConfig, num_workers: int | list[int] | None) -> str | None:
    """A note for a DeepSpeed config of ZeRO stage 0 or 1 on more than one worker: every worker then holds the
    whole model's parameters and gradients, which is what raytrain's ZeRO-3 default exists to avoid. A
    `deepspeed` section replaces that default whole (used unchanged, as a user's ds_config.json must be), so a
    section written for its batch size alone runs at DeepSpeed's default stage 0 without a word. Not an error:
    stage 0-2 on a model that fits is the user's choice. None where the stage is 2 or 3, or the workers unknown."""
    most = max(num_workers) if isinstance(num_workers, list) else num_workers
    if most is None or most < 2:
        return None  # one worker: there is nothing to partition, at any stage
    ds = load_deepspeed(cfg.deepspeed)
    zero = ds.get("zero_optimization", {})
    null = zero is None  # `zero_optimization: null`: no ZeRO section, as resolve_deepspeed reads it (stage 0)
    zero = {} if null else zero
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None  # 0: DeepSpeed's default (ZeroStageEnum)
    if type(stage) is not int or stage not in (0, 1):  # a malformed one is check_deepspeed's to refuse
        return None
    workers = f"{num_workers[0]} to {most}" if isinstance(num_workers, list) else f"{most}"
    key = "deepspeed.zero_optimization.stage"
    if null:
        how = f"{key} is 0 (deepspeed.zero_optimization is null: no ZeRO section, so DeepSpeed's default)"
    elif "stage" not in zero:
        how = f"{key} is 0 (absent: DeepSpeed's default; a deepspeed section replaces raytrain's ZeRO-3 default whole)"
    else:
        how = f"{key}={stage}"
    held = ("parameters, gradients and optimizer states" if stage == 0
            else "parameters and gradients (stage 1 partitions only the optimizer states)")
    return f"{how} on {workers} workers: every worker holds the whole model's {held}; set {key}=3 to partition them"
