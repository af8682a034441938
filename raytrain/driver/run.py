"""Driver side: what each command does on the driver, before and around the workers. Start at `fit`.

- `fit(cfg)`: connect, resolve the run for the live cluster, refuse what cannot fit, place the run
  in storage, build the datasets and the TorchTrainer, train, then summarise (and export).
- `dry_run(cfg)`: the same checks for the requested shape, without Ray (raytrain.driver.checks
  holds the ones both run: paths, addresses, the config resolved before Ray, memory).
- `plan_memory(cfg, ...)`: the memory plan against stated sizes, the live cluster or this machine.

Everything that can be wrong with the user's input is checked before a single worker starts (and
before `ray.init` when the config states its shape); the workers (raytrain.worker.loop) receive the
`RunSpec` built here, as a plain dict.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray.train
from ray.train.torch import TorchTrainer

from raytrain import hardware
from raytrain.checkpoint import layout
from raytrain.checkpoint.reshard import written_by
from raytrain.checkpoint.export import export
from raytrain.checkpoint.model_files import local_model_files, write_model_files
from raytrain.config import ConfigError, RunConfig, check_config
from raytrain.console import say
from raytrain.data.ingest import ShardedIngest
from raytrain.data.pipeline import build_datasets
from raytrain.data.progress import DataProgress
from raytrain.data.sources import inspect_sources
from raytrain.driver.checks import (check_before_ray, check_dry_run_placement, check_memory, check_writable_dir,
                                    checkpoint_space_note, dry_run_target, idle_settings, local_elastic_note,
                                    plans_local_cluster, resolve_before_ray, tightest)
from raytrain.driver.cluster import check_live_placement, check_preflight, cluster_target, connect, live_shape
from raytrain.driver.elastic import policy_installed
from raytrain.driver.live import check_not_live, claimed, live_driver
from raytrain.driver.summary import write_summary
from raytrain.driver.tracking import check_tracking, local_tracking_uri, mlflow_run_outcome, tracking_env
from raytrain.driver.watch import callbacks as watch_callbacks
from raytrain.driver.watch import ExportInterrupted, Terminated, continue_command, run_trainer, signals_stop_the_run
from raytrain.model import model_source
from raytrain.network.backend import torch_config
from raytrain.planning.memory import MemoryPlan, check_fits, estimate_memory
from raytrain.planning.resolve import advice, resolve_run
from raytrain.run_spec import ResolvedRun, RunSpec
from raytrain.worker.engine import warmup_cosine
from raytrain.worker.loop import train_loop_per_worker


@dataclass
class FitResult:
    """What a finished run leaves: its final metrics and where its checkpoint and files are."""

    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    """Every logged window of the run (step, loss, lr, grad_norm, tokens_per_s, ...)."""
    checkpoint_path: str | None
    """The final checkpoint: a local path, or a URI with its scheme (s3://...) for cloud storage."""
    run_path: str
    """The run's directory in checkpoint.storage_path, a path or URI likewise."""
    spec: RunSpec


def fit(cfg: RunConfig, fresh: bool = False, argv: Sequence[str] | None = None) -> FitResult:
    """Train `cfg` on the Ray cluster (connecting or starting one) and return the result.

    A run whose name already exists in the storage path continues from its latest checkpoint;
    `fresh=True` sets the old run aside (renamed, nothing deleted) and starts over. `argv`: the
    command line the run was started with (`python -m raytrain.main`), for the command that
    continues it. Raises ConfigError for bad input (a bad record in the data too: raytrain.data.
    bad_records), raytrain.driver.watch.Interrupted after Ctrl-C, and raytrain.driver.watch.RunFailed where
    Ray Train gave up on the run (past checkpoint.max_failures; the original error is its __cause__).
    """
    cfg = _local_paths(check_config(cfg, "raytrain.fit: config"))  # one edited in code is checked like a loaded one
    _check_paths(cfg, fresh)
    sources = inspect_sources(cfg.data)
    early = resolve_before_ray(cfg, sources)  # a bad config stops here, before ray.init
    if early is not None:  # so does a checkpoint this run cannot resume (again in _place, for the live shape)
        _check_resume_before_ray(early, fresh)
    for note in check_tracking(cfg, fresh):  # the MLflow store, before ray.init: seconds, not a retried worker failure
        say(f"raytrain: note: {note}")
    local_elastic = local_elastic_note(cfg)  # before connect: whether it starts the local cluster
    connect(cfg.cluster, cfg.scaling)
    check_live_placement(cfg)  # a worker group this cluster can never hold: one line, not Ray Train's endless wait
    shape = live_shape(cfg)
    for note in idle_settings(cfg, shape.use_gpu, shape.num_workers) + local_elastic:
        say(f"raytrain: note: {note}")
    # None where unknown: not checked; a local checkpoint.storage_path must be seen by every worker node
    found = cluster_target(shape.use_gpu, storage_path=cfg.checkpoint.storage_path)
    target = hardware.Target(found.gpu_memory_bytes, found.host_memory_bytes, shape.gpus_per_node or found.gpus_per_node)
    resolved = resolve_run(cfg, shape, sources, target)  # "auto" settings are chosen here, for this cluster
    for line in resolved.plan:
        say(f"raytrain: plan: {line}")
    for note in advice(resolved):
        say(f"raytrain: note: {note}")
    say(f"raytrain: {check_memory(resolved, target, cfg)}")
    if (space := checkpoint_space_note(resolved)) is not None:
        say(f"raytrain: note: {space}")
    if cfg.network.preflight:
        check_preflight(cfg)
    name = _run_name(cfg)
    # one driver per run (live.py); SIGTERM takes Ctrl-C's path from here to the end, the export included
    with claimed(_storage_path(cfg.checkpoint.storage_path), name), signals_stop_the_run():
        spec, progress, restored = _place(resolved, fresh, name)
        sources.say_notes()  # only once every check has passed: above an error line they are noise
        command = continue_command(argv, spec.run_name, spec.resume_from)
        say(f"raytrain: model: {model_source(cfg.model, restored)}")
        if cfg.checkpoint.name is None:  # a generated name: the same command again starts another run
            for other, step in unfinished_runs(spec.storage_path, resolved, spec.run_name):
                say(f"raytrain: note: run {other} in {spec.storage_path} stopped at step {step} of "
                    f"{cfg.training.max_steps} with these settings; to continue it instead: "
                    f"{continue_command(argv, other)}")
            say(f"raytrain: run {spec.run_name} in {spec.storage_path}; to continue it after a stop: {command}")
        done = finished_checkpoint(spec.run_uri, cfg.training.max_steps)
        if done is not None:  # nothing to train: no datasets, no workers (tens of seconds saved)
            return _wrap_up(done, spec, cfg, done_before=True)
        moved = write_model_files(spec.run_uri, cfg.model, spec.model)  # export reads these, not the originals
        if moved:
            say(f"raytrain: note: {moved}")
        datasets = build_datasets(cfg.data, cfg.model, cfg.training.seed, sources, resolved.model.vocab_size, progress)
        trainer = _trainer(spec, datasets, progress)
        # (an MLflow run whose workers the driver stopped, or that failed, ends FAILED or KILLED, not RUNNING)
        with progress, policy_installed(spec), mlflow_run_outcome(cfg, spec.run_uri):
            result = run_trainer(trainer, progress, spec.run_uri, cfg.training.max_steps, command,
                                 cfg.checkpoint.max_failures)
            if result.checkpoint is None:
                raise RuntimeError(f"the run ended without a checkpoint (see the worker logs above): {result.error}")
        return _wrap_up(result.checkpoint, spec, cfg)


def finished_checkpoint(run_uri: str, max_steps: int):
    """The run's latest checkpoint if it has reached `max_steps` (the run is done), else None."""
    latest = layout.latest_checkpoint(run_uri)
    return latest if latest is not None and layout.read_metadata(latest)["step"] >= max_steps else None


def _wrap_up(checkpoint, spec: RunSpec, cfg: RunConfig, done_before: bool = False) -> FitResult:
    """A finished run's summary files (and export, when asked), from its final checkpoint. `done_before`:
    the run was done when this command started; its export_dir, when not empty, is most likely its own
    export from an earlier run of the same command, and is left as it is, with a note (`_check_paths`)."""
    meta = layout.read_metadata(checkpoint)
    write_summary(meta["history"], meta["metrics"], spec.storage_path, spec.run_name)
    export_dir = cfg.checkpoint.export_dir
    if export_dir and done_before and _not_empty(export_dir):
        say(f"raytrain: note: checkpoint.export_dir {export_dir} exists and is not empty (the export of an earlier "
            f"run of this command, or other files): not exported again, nothing overwritten; to export the "
            f"checkpoint elsewhere: python -m raytrain.tools.export {layout.checkpoint_uri(spec.run_uri, checkpoint)} "
            f"OUT_DIR")
    elif export_dir:
        try:
            with checkpoint.as_directory() as local, local_model_files(spec.run_uri) as model_dir:
                export(local, export_dir, model_dir=model_dir, key="checkpoint.export_dir")
        except KeyboardInterrupt as e:  # the run is done: "interrupted before training started" would mislead
            raise ExportInterrupted(meta["step"], layout.checkpoint_uri(spec.run_uri, checkpoint), export_dir,
                                    signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT) from None
    return FitResult(metrics=meta["metrics"], history=meta["history"],
                     checkpoint_path=layout.checkpoint_uri(spec.run_uri, checkpoint), run_path=spec.run_uri, spec=spec)


def _check_paths(cfg: RunConfig, fresh: bool) -> None:
    """check_before_ray, except that a run already done (its latest checkpoint at training.max_steps)
    may have a checkpoint.export_dir that is not empty: the same command again finds the export it
    wrote there, and says that the run is done (`_place`) rather than refusing the directory
    (`_wrap_up` leaves it as it is). Reads the run's record only with an export_dir, a
    checkpoint.name and no --fresh."""
    ckpt = cfg.checkpoint
    if ckpt.export_dir and ckpt.name and not fresh:
        check_writable_dir(ckpt.storage_path, "checkpoint.storage_path")  # before the run's record is read there
        run = layout.run_uri(_storage_uri(ckpt.storage_path), ckpt.name)
        if finished_checkpoint(run, cfg.training.max_steps) is not None and _not_empty(ckpt.export_dir, quiet=True):
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(ckpt, export_dir=None))
    check_before_ray(cfg)
    if ckpt.name:  # another driver training this run: refused before ray.init, in a dry run too (live.py)
        check_not_live(_storage_uri(ckpt.storage_path), ckpt.name)
    _check_model_moved(cfg, fresh)


def _check_model_moved(cfg: RunConfig, fresh: bool) -> None:
    """A continued run whose model directory (or tokenizer) is gone: one line naming the run's own copy
    of them, rather than transformers' "cannot load its config". The weights come from the checkpoint,
    but every session reads the model's config and tokenizer from where the run config says (the
    driver's checks, Ray Data's tokenizing tasks); STORAGE/RUN/model/ holds copies of them for the
    export, not a model directory to train from (no weights: model.pretrained=true refuses it, and as
    model.name_or_path it would change the run's recorded settings). Reads one listing, only for a
    continued run (checkpoint.name, no --fresh) with a local model path that does not exist."""
    import pyarrow.fs

    from raytrain.checkpoint.model_files import model_files_uri

    ckpt, model = cfg.checkpoint, cfg.model
    missing = [(key, path) for key, path in (("model.name_or_path", model.name_or_path),
                                             ("model.tokenizer", model.tokenizer))
               if path and path.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(path))]
    if not missing or not ckpt.name or fresh:
        return
    copy = model_files_uri(layout.run_uri(_storage_uri(ckpt.storage_path), ckpt.name))
    try:
        fs, path = layout.filesystem(copy)
        if fs.get_file_info(path).type != pyarrow.fs.FileType.Directory:
            return
    except (OSError, ValueError):  # storage that cannot be read: the model's own check says what is missing
        return
    key, path = missing[0]
    raise ConfigError(f"{key}={path} does not exist (moved or deleted?), and run {ckpt.name!r} continues from its "
                      f"checkpoint: its weights come from there, but every session reads the model's config and "
                      f"tokenizer from {key} ({copy} holds the run's copy for the export, not a model to train "
                      f"from): put the directory back, or set {key} to where it is now")


def dry_run(cfg: RunConfig, *, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
            gpus_per_node: int | None = None, fresh: bool = False) -> tuple[ResolvedRun, list[str]]:
    """Every check of a real run that needs no Ray, for the requested shape: the run resolved ("auto"
    settings chosen for the target), and notes for stderr (the data sources' notes, the plan's lines,
    advice, what a real run would do with the run's storage now, then the memory planner's verdict),
    which the caller prints once every check has passed.
    Writes nothing. The checkpoint a real run would resume (`fresh` as for `fit`)
    is checked as a real run checks it: it reads raytrain.json and Ray Train's record, which for a
    cloud storage path needs its credentials (the storage path is looked up first: checks.check_storage_uri).

    Memory is planned against the stated sizes, else this machine (its GPUs for a GPU run)."""
    cfg = _local_paths(check_config(cfg))
    _check_paths(cfg, fresh)
    cfg, shape, target = dry_run_target(cfg, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                                        gpus_per_node=gpus_per_node)
    sources = inspect_sources(cfg.data)
    resolved = resolve_run(cfg, shape, sources, target)
    check_dry_run_placement(cfg, gpu_memory_gib, host_memory_gib, gpus_per_node)  # the real run's local cluster
    storage = _storage_uri(cfg.checkpoint.storage_path)
    checkpoint, own, resuming = _check_resume_before_ray(resolved, fresh)
    tracking = check_tracking(cfg, fresh)
    notes = [f"note: {note}" for note in sources.notes]
    notes += [f"plan: {line}" for line in resolved.plan] + [f"note: {note}" for note in advice(resolved)]
    notes.extend(f"note: {note}" for note in idle_settings(cfg, shape.use_gpu, shape.num_workers))
    if plans_local_cluster(cfg.cluster):  # else the dry run may plan a run submitted elsewhere (docstring there)
        notes.extend(f"note: {note}" for note in local_elastic_note(cfg))
    notes.append(f"note: a real run now {_would_place(resolved.config, storage, checkpoint, own, fresh)}")
    notes.extend(resuming)
    notes.extend(f"note: {note}" for note in tracking)
    if (space := checkpoint_space_note(resolved)) is not None:
        notes.append(f"note: {space}")
    if target is None:
        notes.append("memory: not checked: this machine has no GPU to plan a GPU run against; state the "
                     "target's sizes with --gpu-memory-gib, --host-memory-gib and --gpus-per-node")
    else:
        notes.append(check_memory(resolved, target, cfg))
    return resolved, notes


def plan_memory(cfg: RunConfig, *, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
                gpus_per_node: int | None = None) -> MemoryPlan:
    """The memory plan of `cfg`, checked against its target (raises planning.memory.DoesNotFit).

    The target: the stated sizes (a cluster that may not exist yet; the config gives its shape),
    else the Ray cluster at cluster.address / RAY_ADDRESS, else this machine (as for a dry run).
    """
    stated = any(v is not None for v in (gpu_memory_gib, host_memory_gib, gpus_per_node))
    if not stated and (cfg.cluster.address or os.environ.get("RAY_ADDRESS")):
        connect(cfg.cluster, cfg.scaling)
        shape = live_shape(cfg)
        found = cluster_target(shape.use_gpu)
        target = hardware.Target(found.gpu_memory_bytes, found.host_memory_bytes,
                                 shape.gpus_per_node or found.gpus_per_node)
    else:
        cfg, shape, target = dry_run_target(cfg, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                                            gpus_per_node=gpus_per_node)
    sources = inspect_sources(cfg.data)
    resolved = resolve_run(cfg, shape, sources, target)
    plan = estimate_memory(tightest(resolved), target or hardware.Target(), written=cfg)
    plan.notes.extend(resolved.plan)
    check_fits(plan)
    # The table is the minimum's (ZeRO-3's states per GPU largest); host RAM per node grows with
    # the workers on it, so an elastic range is also checked at each of its other sizes.
    check_memory(resolved, target or hardware.Target(), cfg)
    sources.say_notes()  # once the checks have passed, as a run prints them
    return plan


def _run_name(cfg: RunConfig) -> str:
    return cfg.checkpoint.name or datetime.datetime.now().strftime("raytrain-%Y%m%d-%H%M%S")


def _place(resolved: ResolvedRun, fresh: bool, name: str | None = None) -> tuple[RunSpec, DataProgress, str | None]:
    """The run's name and storage directory, ready (continued, or set aside with fresh=True), and
    its resume checkpoint checked against the run's shape: the final RunSpec, the run's counter
    for this session (progress, skips, bad records, the step reached), and the checkpoint the workers
    will restore, as the user would write it (None: a new run; its weights are model.name_or_path's)."""
    cfg = resolved.config
    name = name or _run_name(cfg)
    storage = _storage_path(cfg.checkpoint.storage_path)
    run = layout.run_uri(storage, name)
    checkpoint, own = resume_checkpoint(cfg, storage, name, fresh)
    resuming = check_resume(checkpoint, resolved, own_run=own)  # before --fresh moves anything
    if fresh and _not_empty(run):
        aside = layout.set_aside(run)
        say(f"raytrain: --fresh: moved the existing run {name!r} to {aside}")
    elif own:
        say(f"raytrain: {_continuing(cfg, storage, name, checkpoint)}")
    for line in resuming:
        say(f"raytrain: {line}")
    progress = DataProgress(cfg.data, name)
    restored = None if checkpoint is None else _shown(checkpoint, cfg, own)
    return RunSpec.place(resolved, run_name=name, storage_path=storage, resume_from=cfg.checkpoint.resume_from,
                         counter=progress.name), progress, restored


def _continuing(cfg: RunConfig, storage: str, name: str, checkpoint) -> str:
    """What placing run `name` does with its own latest `checkpoint`: continue it, or nothing (done)."""
    step = layout.read_metadata(checkpoint)["step"]
    if step >= cfg.training.max_steps:
        return (f"run {name!r} in {storage} is already done at step {step} (training.max_steps="
                f"{cfg.training.max_steps}): nothing to train (raise training.max_steps to train further, or pass "
                f"--fresh to start over; the old run is kept under another name)")
    started = f", started from {cfg.checkpoint.resume_from}" if cfg.checkpoint.resume_from else ""
    return (f"run {name!r} exists in {storage}: continuing from its latest checkpoint (step {step}{started}) "
            f"(pass --fresh to start over; the old run is kept under another name)")


def _would_place(cfg: RunConfig, storage: str, checkpoint, own: bool, fresh: bool) -> str:
    """What `_place` would do with the run's storage now, for a dry run, which moves nothing: the end of a
    sentence that starts "a real run now". Its reads are resume_checkpoint's and one listing for --fresh."""
    name = cfg.checkpoint.name
    if own:
        return f"finds {_continuing(cfg, storage, name, checkpoint)}"
    source = f": {model_source(cfg.model)}" if checkpoint is None else (
        f" from checkpoint.resume_from={cfg.checkpoint.resume_from} (step {layout.read_metadata(checkpoint)['step']}: "
        f"its weights, optimizer state and data position)")
    if name is not None and fresh and _not_empty(run := layout.run_uri(storage, name)):
        return (f"moves the existing run {name!r} to {run}.replaced-<date>-<time> (--fresh; nothing is deleted) "
                f"and starts it over{source}")
    new = f"starts a new run {name!r} in {storage}" if name is not None else \
        f"starts a new run in {storage}, named raytrain-<date>-<time> (checkpoint.name names it)"
    return f"{new}{source}"


def resume_checkpoint(cfg: RunConfig, storage: str, name: str | None, fresh: bool):
    """(the checkpoint Ray Train will hand the workers, whether it is the run's own): the latest
    checkpoint of run `name` in `storage` when it exists (and `fresh` is off), else
    checkpoint.resume_from's, else (None, False). Reads, never writes: a dry run asks it too.

    resume_from with an existing run is refused unless that run was started from the same
    checkpoint: then the run's own latest wins, so a run started with --resume-from continues with
    the same command line (raytrain.driver.watch.continue_command)."""
    resume_from = cfg.checkpoint.resume_from
    given = (ray.train.Checkpoint(resume_from) if resume_from else None), False
    if name is None:  # a generated name: a new run
        return given
    run = layout.run_uri(storage, name)
    if fresh and resume_from and _inside(resume_from, run):
        raise ConfigError(f"--fresh sets run {name!r} aside, and checkpoint.resume_from={resume_from} is inside it: "
                          f"drop --fresh to continue the run, or resume that checkpoint under a new checkpoint.name")
    if fresh:
        return given
    latest = layout.latest_checkpoint(run)  # a broken record raises its one line (layout.BrokenRun)
    if latest is None:
        return given
    _check_own_latest(run, name, layout.checkpoint_uri(run, latest))
    started_from = layout.read_metadata(latest)["spec"].get("resume_from")
    if resume_from and started_from != resume_from:
        was = f"started from {started_from}" if started_from else "started without one"
        raise ConfigError(f"checkpoint.resume_from={resume_from} is set but run {name!r} already exists in {storage} "
                          f"({was}), and it would continue from its own latest checkpoint: choose a new "
                          f"checkpoint.name")
    return latest, True


def _check_own_latest(run: str, name: str, latest: str) -> None:
    """Run `name`'s latest checkpoint `latest`, which Ray Train hands every worker group it starts, checked as a
    --resume-from checkpoint is (layout.check_is_checkpoint): a shard file deleted from it or cut short (a copy
    or sync that stopped) failed every worker at DeepSpeed's load, and Ray Train retried it checkpoint.max_failures
    times, each after a full engine build, then ended on a traceback. One line instead, naming the file and an
    earlier complete checkpoint to continue from. Costs one listing of its tag directory (and, on a local or
    shared filesystem, two small reads per shard file)."""
    try:
        layout.check_is_checkpoint(latest, "checkpoint", shown=f"run {name!r}'s latest checkpoint {latest}")
    except layout.IncompleteCheckpoint as e:
        earlier = layout.latest_complete_checkpoint(run, but=latest)
        other = (f"continue from its latest complete one under a new name (--resume-from {earlier} "
                 f"checkpoint.name=NEW_NAME), or " if earlier else "")
        raise ConfigError(f"{e.problem}: Ray Train continues run {name!r} from its latest checkpoint only: put the "
                          f"files back, or {other}pass --fresh to start over (the old run is kept under another "
                          f"name)") from None


def _check_resume_before_ray(resolved: ResolvedRun, fresh: bool) -> tuple[Any, bool, list[str]]:
    """`check_resume` of the checkpoint a run would resume, before ray.init and without creating
    the storage directory (a dry run writes nothing): (that checkpoint, whether it is the run's own, its notes)."""
    cfg = resolved.config
    checkpoint, own = resume_checkpoint(cfg, _storage_uri(cfg.checkpoint.storage_path), cfg.checkpoint.name, fresh)
    return checkpoint, own, check_resume(checkpoint, resolved, own_run=own)


def _not_empty(uri: str, quiet: bool = False) -> bool:
    """Whether `uri` (a path or URI) is a file or a directory that holds anything: one listing of its top
    level. --fresh sets aside such a run directory, not only one with checkpoints (or a broken record):
    an attempt stopped before its first checkpoint leaves its tensorboard/ events and samples/ digests,
    and the new run's would mix with them; an empty directory is left as it is. `quiet`: False rather
    than pyarrow's error where it cannot be read (the caller's next check says it in one line)."""
    import pyarrow.fs

    try:
        fs, path = layout.filesystem(uri)
        info = fs.get_file_info(path)
        return info.type == pyarrow.fs.FileType.File or (
            info.type == pyarrow.fs.FileType.Directory and bool(fs.get_file_info(pyarrow.fs.FileSelector(path))))
    except (OSError, ValueError, pyarrow.lib.ArrowException):
        # pyarrow: an unknown scheme (ArrowInvalid), no credentials or network (Azure's: a bare ArrowException)
        if quiet:
            return False
        raise


def _inside(path: str, run: str) -> bool:
    """Whether `path` (local or URI) is `run` or lies under it, on the same filesystem."""
    fs, inner = layout.filesystem(path)
    run_fs, outer = layout.filesystem(run)
    inner, outer = inner.rstrip("/"), outer.rstrip("/")
    if fs.type_name == "local":  # storage given through a symlink (/shared -> /mnt/nfs): the same directories
        inner, outer = os.path.realpath(inner), os.path.realpath(outer)
    return fs.type_name == run_fs.type_name and (inner == outer or inner.startswith(outer + "/"))


# What a checkpoint's weights must match: ModelFacts' sizes, and the transformers config's head
# counts (another attention layout with the same hidden size would load silently: same shapes).
_MODEL_SHAPE = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_parameters")
_CONFIG_SHAPE = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _model_shape(facts: dict[str, Any]) -> dict[str, Any]:
    config = facts.get("hf_config") or {}
    return {k: facts.get(k) for k in _MODEL_SHAPE} | {k: config.get(k) for k in _CONFIG_SHAPE}


def check_resume(checkpoint, resolved: ResolvedRun, own_run: bool = False) -> list[str]:
    """What Ray Train will hand the workers (the run's latest checkpoint, else resume_from) must
    hold this run's model (the ModelFacts its raytrain.json records), be before training.max_steps
    (a resume_from one: the run's own at max_steps is a done run), have a data position this run
    can read (the same data shards), DeepSpeed settings it can be loaded with (`_layout_changes`), and
    the optimizer settings this run sets: the checkpoint's own would silently replace them
    (`_optimizer_changes`). Another number of workers is fine: the first
    group of another size converts the checkpoint (raytrain.checkpoint.reshard). Returns the notes to
    print, one line each: that resize, and data settings other than the checkpoint's (`_data_changes`)."""
    if checkpoint is None:
        return []
    meta = layout.read_metadata(checkpoint)
    cfg = resolved.config
    shown = _shown(checkpoint, cfg, own_run)
    was, now = _model_shape(meta["spec"]["model"]), _model_shape(dataclasses.asdict(resolved.model))
    if was != now:
        differ = [k for k in was if was[k] != now[k]]
        fix = ("set the model back to the run's (model.name_or_path, model.config), or pass --fresh to start over"
               if own_run else "give checkpoint.resume_from a checkpoint of this model, or set the model to the "
               "checkpoint's (model.name_or_path, model.config)")
        old, new = (", ".join(f"{k}={shape[k]}" for k in differ) for shape in (was, now))
        raise ConfigError(f"checkpoint {shown} holds another model ({old}) than this run's ({new}): {fix}")
    if not own_run and meta["step"] >= cfg.training.max_steps:
        raise ConfigError(f"checkpoint.resume_from={cfg.checkpoint.resume_from} is at step {meta['step']} >= "
                          f"training.max_steps={cfg.training.max_steps}: nothing to train; training.max_steps counts "
                          f"the checkpoint's steps too: set it above {meta['step']} (training.max_steps="
                          f"{meta['step'] + cfg.training.max_steps} trains {cfg.training.max_steps} more)")
    # a done run trains nothing: its engine is never built, no worker starts and no data is read
    done = own_run and meta["step"] >= cfg.training.max_steps
    old_world, old_shards = written_by(meta)
    shape, num_shards = resolved.cluster, resolved.config.data.num_shards
    new_shards = num_shards or shape.num_workers
    if old_shards != new_shards and old_world == shape.num_workers and not done:
        # the same workers, another shard count: the advice about worker counts below does not apply
        before = meta["spec"]["config"]["data"].get("num_shards")
        now = f"data.num_shards={num_shards}" if num_shards is not None else "one per worker"
        fix = f"set data.num_shards back to {before}" if before is not None else \
            "drop data.num_shards (the checkpoint's run had one shard per worker)"
        raise ConfigError(f"checkpoint {shown} was written with {old_shards} data shards and this run has "
                          f"{new_shards} ({now}) on as many workers: its data position is the rows read from each "
                          f"of its shards, which another count cannot place: {fix}")
    if old_shards != new_shards and not done:
        where = f"data.num_shards={meta['spec']['config']['data'].get('num_shards')}"
        raise ConfigError(f"checkpoint {shown} was written by {old_world} workers with {where} ({old_shards} "
                          f"data shards), and this run has {shape.num_workers} workers and {new_shards} shards: resuming "
                          f"on another number of workers needs the same data.num_shards, divisible by both (start runs "
                          f"with e.g. data.num_shards=48 to allow it), else resume on {old_world} workers")
    unloadable = _layout_changes(meta["spec"].get("deepspeed", {}), resolved.deepspeed)
    if unloadable and not done:
        fix = "set them back, or pass --fresh to start over (the old run is kept under another name), or" if own_run \
            else "set them back, or"
        raise ConfigError(f"checkpoint {shown} was written with other DeepSpeed settings ({', '.join(unloadable)}), "
                          f"and DeepSpeed cannot load it with this run's (every worker would fail at the load): {fix} "
                          f"train its weights with these settings: export it (python -m raytrain.tools.export) and "
                          f"start a new run with model.name_or_path=OUT_DIR model.pretrained=true")
    changed = _optimizer_changes(meta["spec"].get("config", {}), json.loads(json.dumps(cfg.to_dict())))
    if changed and not done:
        fix = ("set them back, or pass --fresh to start over (the old run is kept under another name), or"
               if own_run else "set them back, or")
        raise ConfigError(f"checkpoint {shown} was written with other optimizer settings ({', '.join(changed)}), and "
                          f"resuming it keeps its own (DeepSpeed loads the optimizer's learning rate, betas, eps and "
                          f"weight decay with its state), so this run's would be ignored: {fix} train its weights "
                          f"with a new optimizer: export it (python -m raytrain.tools.export) and start a new run "
                          f"with model.name_or_path=OUT_DIR model.pretrained=true")
    notes = []
    if shape.elastic and not done:
        notes.append(f"resuming step {meta['step']} (written by {old_world} workers); a worker group of another "
                     f"size converts it to DeepSpeed's universal checkpoint first")
    elif old_world != shape.num_workers and not done:
        notes.append(f"resuming step {meta['step']} on {shape.num_workers} workers (written by {old_world}): the "
                     f"workers convert it to DeepSpeed's universal checkpoint first")
    if not done:
        notes += _batch_change(meta, resolved) + _schedule_change(meta, resolved)
    changes = _data_changes(meta["spec"].get("config", {}), json.loads(json.dumps(cfg.to_dict())))
    starts = tuple(meta["spec"].get("model", {}).get("document_start_ids", ())), resolved.model.document_start_ids
    if starts[0] != starts[1]:  # the same settings, rows cut another way (raytrain before 2026-12-04 put no BOS)
        changes.append(f"ids before each document {list(starts[0])} -> {list(starts[1])}")
    if changes and not done:  # a done run reads no data
        # A note, not a refusal: continuing training on new or re-cut data from a checkpoint is a real
        # use (more data appended, a longer seq_len, a fine-tuning set after pre-training), and
        # raytrain has no setting that resets the position. What it costs: the workers skip the
        # checkpoint's count of rows in each shard of the new data (never trained on this epoch), or
        # re-read rows, and the shuffle windows move. The note names the way to start the data at 0.
        back = "set them back to resume the same rows; " if own_run else ""
        notes.append(f"note: checkpoint {shown} was written with other data settings ({', '.join(changes)}): its "
                     f"data position (the epoch and the rows read from each data shard by step {meta['step']}) is "
                     f"applied to this run's data as it is, so rows are skipped or read twice; {back}to read this "
                     f"data from its start, export the checkpoint (python -m raytrain.tools.export) and start a new "
                     f"run with model.name_or_path=OUT_DIR model.pretrained=true (the optimizer state is not kept)")
    return notes


def _batch_change(meta: dict[str, Any], resolved: ResolvedRun) -> list[str]:
    """A note where the resumed run's global batch differs from the checkpoint's. A "auto" train_batch_size is
    derived from the world size (micro-batch x accumulation x workers; an elastic range's at its maximum), so
    continuing an elastic run, which kept its batch at every size, on a fixed number of workers, or a run on
    another number of workers, changed the batch (16 -> 8 rows a step) without a word. Not a refusal: a new
    batch may be wanted, and the data position (rows read per shard) holds at any batch."""
    was = meta["spec"].get("deepspeed", {}).get("train_batch_size")
    facts, shape = resolved.deepspeed, resolved.cluster
    if was is None or was == facts.train_batch_size:
        return []
    workers = f"the range's maximum {shape.num_workers}" if shape.elastic else f"{shape.num_workers}"
    return [f"note: the checkpoint was trained with train_batch_size {was}, and this run's is {facts.train_batch_size} "
            f"(micro-batch {facts.micro_batch_per_gpu} x gradient accumulation {facts.gradient_accumulation_steps} x "
            f"{workers} workers): from step {meta['step'] + 1} each step trains on {facts.train_batch_size} rows, at "
            f"the same learning rates; to keep the checkpoint's batch, set deepspeed.train_batch_size={was}"]


def _schedule_change(meta: dict[str, Any], resolved: ResolvedRun) -> list[str]:
    """A note where raytrain's warmup + cosine schedule (raytrain.worker.engine.warmup_cosine) gives the resumed
    step another learning rate than the checkpoint's run had there: training.max_steps raised to train further
    stretches the cosine over the new length, so the rate jumps back up (1e-4 to 7.75e-4 at step 21 of 20 -> 40),
    with no warmup. Not a refusal: raising max_steps is how a run is trained further (README), and a new decay
    is what some want. The rate is recomputed per step from these settings, so nothing else is kept."""
    old = meta["spec"].get("config", {}).get("training", {})
    if resolved.deepspeed.has_scheduler or meta["spec"].get("deepspeed", {}).get("has_scheduler", True):
        return []  # a DeepSpeed scheduler (then or now): its own state and settings
    training, step = resolved.config.training, meta["step"]
    keys = [k for k in ("max_steps", "warmup_steps", "min_lr_ratio") if k in old and old[k] != getattr(training, k)]
    if not keys:
        return []
    was = training.learning_rate * warmup_cosine(dataclasses.replace(training, **{k: old[k] for k in keys}))(step)
    now = training.learning_rate * warmup_cosine(training)(step)
    if math.isclose(was, now, rel_tol=0.01):
        return []
    changes = ", ".join(f"training.{k} {old[k]} -> {getattr(training, k)}" for k in keys)
    return [f"note: the learning rate schedule changed since the checkpoint ({changes}): the warmup + cosine "
            f"schedule is recomputed for the new settings, so step {step + 1} trains at a learning rate of {now:.3g} "
            f"where the checkpoint's schedule stood at {was:.3g}, with no warmup in between"]


# The DeepSpeed facts that decide whether engine.load_checkpoint can read a checkpoint at all, each with
# the key that sets it (measured on DeepSpeed 0.19.8, CPU, world size 1, a checkpoint saved after one step):
# - zero_stage: stage 2 and 3 write other shard layouts (3 -> 2: check_ckpt_list's bare AssertionError);
# - precision: bf16 names its optimizer files bf16_zero_pp_rank_* (fp32 <-> bf16: FileNotFoundError); fp16 <-> fp32
#   would load (read in stage3.py's load_state_dict, not run: fp16 needs a GPU) with the checkpoint's loss scaler
#   in place of the run's: fp16 from an fp32 checkpoint would lose its dynamic loss scaling without a word;
# - offload_optimizer from none to cpu/nvme, from a checkpoint of torch's AdamW (raytrain's own, or the JSON's
#   with torch_adam): DeepSpeed's CPU Adam reads a param group key torch's never saved (KeyError
#   'bias_correction'). The other way, and another ratio, load: not refused; nor is a JSON optimizer DeepSpeed
#   builds itself (FusedAdam saves that key; not run: it needs a GPU).
_LAYOUT = {"zero_stage": "deepspeed.zero_optimization.stage", "precision": "training.precision",
           "offload_optimizer": "deepspeed.zero_optimization.offload_optimizer.device"}


def _layout_changes(recorded: dict[str, Any], facts) -> list[str]:
    """`key=old -> new` for each DeepSpeed fact of this run (`facts`: DeepSpeedFacts) that a checkpoint
    written with `recorded` (its raytrain.json's DeepSpeedFacts) cannot be loaded with. A fact the
    checkpoint does not record is not compared."""
    changes = []
    for field, key in _LAYOUT.items():
        was, now = recorded.get(field), getattr(facts, field)
        torch_adamw = recorded.get("optimizer_type") is None or recorded.get("torch_adam")
        if was is None or was == now or (field == "offload_optimizer" and (was != "none" or not torch_adamw)):
            continue
        changes.append(f"{key}={was} -> {now}")
    return changes


# What a resumed checkpoint brings back whatever this run sets (measured on DeepSpeed 0.19.8, ZeRO-3, CPU):
# torch's Optimizer.load_state_dict restores every param group's lr, betas, eps and weight_decay (raytrain's
# AdamW or CPU Adam, or the JSON's optimizer), and raytrain's LambdaLR its base_lrs, the schedule's peak. This
# run's own: the schedule's shape (training.warmup_steps, min_lr_ratio, max_steps: the LambdaLR's function is
# built anew) and a JSON scheduler's params, its lr included (DeepSpeed's schedulers save their step count only).
_RESTORED = {"learning_rate": "lr", "adam_betas": "betas", "adam_epsilon": "eps", "weight_decay": "weight_decay"}


def _optimizer_changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key=old -> new` for each optimizer setting that resuming a checkpoint would replace with the
    checkpoint's own: the run config it records (its raytrain.json) against this run's, both as
    raytrain.json holds them (the DeepSpeed dicts resolved). A key the checkpoint does not record is
    not compared. A JSON optimizer's values are named as training.X where this run's equals it (filled
    from it: "auto"), else as deepspeed.optimizer.params.X."""

    def settings(config: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        training, ds = config.get("training", {}), config.get("deepspeed")
        ds = ds if isinstance(ds, dict) else {}
        optimizer = ds.get("optimizer")
        keys = [key for key in _RESTORED if not (key == "learning_rate" and ds.get("scheduler"))]  # it sets lr
        if not isinstance(optimizer, dict):  # raytrain's own AdamW, built from the training section
            return {key: (f"training.{key}", training[key]) for key in keys if key in training}
        params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
        return {key: (f"deepspeed.optimizer.params.{_RESTORED[key]}", params[_RESTORED[key]]) for key in keys
                if _RESTORED[key] in params}

    old, new = settings(recorded), settings(now)
    changes = []
    for key in old.keys() & new.keys():
        (_, was), (name, value) = old[key], new[key]
        if was != value:
            name = f"training.{key}" if now["training"].get(key) == value else name
            changes.append(f"{name}={json.dumps(was)} -> {json.dumps(value)}")
    return sorted(changes)


# What decides which rows each data shard holds and in which order: the checkpoint's data position
# (epoch, rows read from each shard; raytrain.data.ingest) means the same rows only under the same
# values. Not compared: what changes speed or logging only (prefetch, concurrency, eval cadence).
_DATA_ROWS = ("path", "format", "text_column", "text_document", "hf_split", "seq_len", "tokenize_batch_size",
              "shuffle_buffer_size", "eval_fraction")


def _data_changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key=old -> new` for each setting that places the training rows and differs between the run
    config a checkpoint records (its raytrain.json) and this run's (both as raytrain.json holds them).
    A key the checkpoint does not record (an older raytrain) is not compared."""
    keys = [("data", k) for k in _DATA_ROWS] + [("training", "seed")]
    if recorded.get("data", {}).get("path") is None and now["data"]["path"] is None:
        keys.append(("data", "num_builtin_documents"))  # the built-in corpus' size; unused with a path
    changes = [f"{section}.{key}={recorded[section][key]} -> {now[section][key]}" for section, key in keys
               if key in recorded.get(section, {}) and recorded[section][key] != now[section][key]]
    old_model, new_model = recorded.get("model", {}), now["model"]
    if "tokenizer" in old_model:  # the tokenizer is model.tokenizer, else the model's own
        old_tok, new_tok = (m.get("tokenizer") or m.get("name_or_path") for m in (old_model, new_model))
        if old_tok != new_tok:
            changes.append(f"tokenizer {old_tok} -> {new_tok}")
    return changes


def _shown(checkpoint, cfg: RunConfig, own_run: bool) -> str:
    """The checkpoint check_resume speaks of, as the user would write it: checkpoint.resume_from as given,
    the run's own as a path or URI in its storage (Ray's Checkpoint.path drops a URI's scheme)."""
    if own_run and cfg.checkpoint.name:
        run = layout.run_uri(_storage_uri(cfg.checkpoint.storage_path), cfg.checkpoint.name)
        return layout.checkpoint_uri(run, checkpoint)
    return cfg.checkpoint.resume_from or checkpoint.path


GENERATED_NAME = re.compile(r"raytrain-\d{8}-\d{6}")
"""What _place names a run that has no checkpoint.name."""


def unfinished_runs(storage: str, resolved: ResolvedRun, this_run: str, look_at: int = 3) -> list[tuple[str, int]]:
    """(name, step) of the earlier runs in `storage` with generated names and the same settings
    that stopped before training.max_steps (Ctrl-C, a failure): the `look_at` newest are read, one
    raytrain.json each. What re-running a command without checkpoint.name says it could continue."""
    import pyarrow.fs

    fs, path = layout.filesystem(storage)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path))
    except OSError:  # storage that cannot be listed: nothing to say
        return []
    names = sorted((i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory
                    and GENERATED_NAME.fullmatch(i.base_name) and i.base_name != this_run), reverse=True)
    wanted = _settings(resolved.config.to_dict())
    found = []
    for name in names[:look_at]:
        if live_driver(storage, name) is not None:  # training now, from another terminal: not one to continue
            continue
        try:
            checkpoint = layout.latest_checkpoint(layout.run_uri(storage, name))
        except layout.BrokenRun:  # another run's problem: its own command says it when it is run
            continue
        if checkpoint is None:
            continue
        meta = layout.read_metadata(checkpoint)
        if meta["step"] < resolved.config.training.max_steps and _settings(meta["spec"]["config"]) == wanted:
            found.append((name, meta["step"]))
    return found


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """A run config without what names and places a run."""
    checkpoint = {k: v for k, v in config["checkpoint"].items() if k not in ("name", "resume_from")}
    return json.loads(json.dumps({**config, "checkpoint": checkpoint}))  # as raytrain.json holds it


def _trainer(spec: RunSpec, datasets: dict[str, Any], progress: DataProgress) -> TorchTrainer:
    cfg, shape = spec.config, spec.cluster
    resources: dict[str, float] = {"CPU": cfg.scaling.cpus_per_worker}
    if shape.use_gpu:
        resources["GPU"] = 1
    # Ray Train's elastic mode takes a tuple (a list is refused); its monitor interval is the grow check.
    elastic = {"num_workers": (shape.min_workers, shape.num_workers),
               "elastic_resize_monitor_interval_s": cfg.scaling.resize_interval_s} if shape.elastic else {}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=spec.to_dict(),
        scaling_config=ray.train.ScalingConfig(**{"num_workers": shape.num_workers, **elastic}, use_gpu=shape.use_gpu,
                                               resources_per_worker=resources,
                                               accelerator_type=cfg.scaling.accelerator_type,
                                               placement_strategy=cfg.scaling.placement_strategy),
        run_config=ray.train.RunConfig(
            name=spec.run_name, storage_path=spec.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            # Ray Train's INFO lines on the console (resources requested, the worker group's ranks,
            # "Checkpoint successfully created at", "Setting up process group"): raytrain prints what
            # they say in its own lines. Warnings and errors still show; the log files keep all.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            callbacks=watch_callbacks(progress, cfg.checkpoint.max_failures),
            worker_runtime_env={"env_vars": {**tracking_env(cfg), **hardware.allocator_env(shape.use_gpu)}}),
        datasets=datasets,
        dataset_config=ShardedIngest(cfg.data.num_shards),
        # raytrain's backend sets each node's NCCL/Gloo environment before the process group exists.
        torch_config=torch_config(cfg.network, backend="nccl" if shape.use_gpu else "gloo"),
    )


def _local_paths(cfg: RunConfig) -> RunConfig:
    """`cfg` with its local resume_from and export_dir absolute: Ray Train and the workers read them
    from other working directories, and pyarrow refuses a relative path (ArrowInvalid, after
    ray.init). The same files: nothing else about them changes. Likewise model.name_or_path and
    model.tokenizer where they name a directory here (~ expanded, which transformers does not do):
    relative, they passed every driver check and then failed in every worker and tokenizing task (their
    working directory is not the driver's; measured: a ~9-minute run of Ray Train's retries, exit 1),
    or, under a name that is also a hub id, loaded the hub's. Not a directory here: left as written (a
    hub id, or a path the model's own check names). Likewise a local MLflow store's path in
    tracking.mlflow_tracking_uri (a plain path, file:PATH, sqlite:///PATH; a server's URI as it is:
    raytrain.driver.tracking.local_tracking_uri): relative, rank 0 wrote it under Ray's working directory and
    the driver's check of the continued run looked in its own."""
    ckpt, model, tracking = cfg.checkpoint, cfg.model, cfg.tracking
    paths = {key: _storage_uri(value) for key in ("resume_from", "export_dir")
             if (value := getattr(ckpt, key)) and "://" not in value}
    dirs = {key: _storage_uri(value) for key in ("name_or_path", "tokenizer")
            if (value := getattr(model, key)) and "://" not in value and os.path.isdir(os.path.expanduser(value))}
    if paths:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(ckpt, **paths))
    if tracking.mlflow_tracking_uri:
        uri = local_tracking_uri(tracking.mlflow_tracking_uri)
        cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(tracking, mlflow_tracking_uri=uri))
    return dataclasses.replace(cfg, model=dataclasses.replace(model, **dirs)) if dirs else cfg


def _storage_uri(path: str) -> str:
    """A local path made absolute (~ expanded); a URI as it is. Creates nothing."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _storage_path(path: str) -> str:
    """The run storage, a local directory created when missing."""
    if "://" in path:
        return path
    local = _storage_uri(path)
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"checkpoint.storage_path={path}: cannot create it ({e.strerror}); "
                          f"choose a writable directory or a cloud URI") from None
    return local
