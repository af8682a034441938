"""The checks a run passes before Ray starts: one code path for `--dry-run` and for a real run.

- `check_before_ray(cfg)`: what needs neither Ray nor the cluster's shape: the paths (storage,
  resume_from, export_dir) and the Ray address. It writes nothing: a dry run creates no directory.
- `resolve_before_ray(cfg)`: the whole config resolved (model, tokenizer, data, DeepSpeed) for the
  shape the config itself states, so that a real run refuses a bad config before `ray.init`;
  None when only the cluster can tell the shape.
- `check_memory(resolved, target)`: the planner's verdict (raytrain.planning.memory), raising its
  one line for a run that does not fit; `dry_run_target` is what a dry run plans against (stated
  sizes, else this machine), a real run measures its cluster (raytrain.driver.cluster).
"""

from __future__ import annotations

import dataclasses
import os
import re

from raytrain import hardware
from raytrain.checkpoint import layout
from raytrain.checkpoint.export import check_out_dir
from raytrain.config import ConfigError, RunConfig
from raytrain.config_fields import ray_address
from raytrain.data.sources import Sources
from raytrain.deepspeed_config import load_deepspeed
from raytrain.planning.choose import find_autos
from raytrain.planning.memory import GIB, DoesNotFit, MemoryPlan, check_fits, estimate_memory, verdict
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.run_spec import ClusterShape, ResolvedRun


def check_before_ray(cfg: RunConfig) -> None:
    """Paths and addresses, with one-line ConfigErrors; nothing is created."""
    check_writable_dir(cfg.checkpoint.storage_path, "checkpoint.storage_path")
    if cfg.checkpoint.resume_from:  # a URI pyarrow cannot reach is one line there too
        layout.check_is_checkpoint(cfg.checkpoint.resume_from, "checkpoint.resume_from")
    if cfg.checkpoint.export_dir:
        check_writable_dir(cfg.checkpoint.export_dir, "checkpoint.export_dir")
        check_out_dir(cfg.checkpoint.export_dir, "checkpoint.export_dir")  # before hours of training
    check_ray_address(cfg.cluster.address)


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


def check_writable_dir(path: str, key: str) -> None:
    """`path` is a directory raytrain can write, or one it can create (without creating it).

    A cloud URI (s3://, gs://, ...) is not checked here: opening it needs credentials and the
    network, and the run's first write reports it."""
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
        raise ConfigError(f"{key}={path}: {where} is a file, not a directory: choose a directory (or a cloud URI)")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "it is not writable" if existing == local else f"it cannot be created ({existing} is not writable)"
        raise ConfigError(f"{key}={path}: {what}: choose a writable directory or a cloud URI")


def check_storage_uri(uri: str, key: str) -> None:
    """`uri`'s scheme is one pyarrow (Ray Train's storage layer) has a filesystem for. Nothing is
    opened: a bucket's credentials and reachability are the run's first write's to report. An unknown
    scheme (az://, s3a://, wasbs://) otherwise raised ArrowInvalid after ray.init, or in the dry run
    as a traceback."""
    import pyarrow.fs

    scheme = uri.partition("://")[0].lower()
    if scheme in _ARROW_SCHEMES:
        return
    try:  # a scheme registered outside pyarrow's list (a later pyarrow, an fsspec handler): let pyarrow say
        pyarrow.fs.FileSystem.from_uri(uri)
    except (ValueError, OSError, pyarrow.lib.ArrowException) as e:  # ArrowInvalid is a ValueError
        if "Unrecognized filesystem type" not in str(e):
            return  # a known scheme that could not be opened here (credentials, network): the run reports it
        raise ConfigError(f"{key}={uri}: pyarrow has no filesystem for the scheme {scheme}:// : use s3://, gs://, "
                          f"hdfs:// or a local path (an S3-compatible store is s3:// with AWS_ENDPOINT_URL)") from None


# pyarrow.fs.FileSystem.from_uri's schemes, answered without calling it: for s3:// and gs:// it resolves
# the bucket's region and credentials over the network (seconds, or a hang without one).
_ARROW_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "file", "mock", "abfs", "abfss"})


def resolve_before_ray(cfg: RunConfig, sources: Sources) -> ResolvedRun | None:
    """The run resolved for the shape the config states, before any cluster is joined.

    The shape is the config's own when it sets scaling.num_workers and scaling.use_gpu, or when the
    run starts its own local cluster (no cluster.address, no RAY_ADDRESS): this machine. Otherwise
    (joining a cluster whose GPUs only it knows) None: the driver resolves after connecting."""
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    joins = address not in (None, "", "local")
    if joins and (cfg.scaling.num_workers is None or cfg.scaling.use_gpu is None):
        return None
    if joins and find_autos(cfg, load_deepspeed(cfg.deepspeed)):
        return None  # "auto" settings are chosen for the cluster's memory, known once connected
    # A local cluster is this machine: its GPUs and RAM are the target "auto" settings are chosen for.
    target = None if joins else hardware.this_machine()
    return resolve_run(cfg, shape_from_config(cfg, 0 if joins else _local_gpus()), sources, target)


def _local_gpus() -> int:
    """The GPUs a local Ray cluster started here will have: Ray counts CUDA_VISIBLE_DEVICES when set
    (nvidia-smi sees every GPU of the machine regardless)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(hardware.gpus(use_torch=False))


def check_memory(resolved: ResolvedRun, target: hardware.Target) -> str:
    """The planner's verdict line for `resolved` on `target`; raises DoesNotFit (its one line) if it does not fit.

    An elastic range is checked at each of its sizes: ZeRO-3's states per GPU are largest at the
    minimum, but host RAM per node (more workers on a node) and hpZ's copy can be largest higher up.
    The verdict is that of the size closest to a limit."""
    plans = []
    for w in resolved.cluster.world_sizes:
        plan = estimate_memory(resolved.at_world_size(w), target)
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
        # the node size also sets the shape: hpZ "auto" and the workers per node are resolved from it
        return cfg, dataclasses.replace(shape_from_config(cfg), gpus_per_node=gpus_per_node), target
    here = hardware.this_machine()
    shape = shape_from_config(cfg, here.gpus_per_node or 0)
    if not shape.use_gpu:
        return cfg, shape, hardware.Target(None, here.host_memory_bytes, None)
    return cfg, shape, here if here.gpu_memory_bytes else None
