"""Experiment tracking (rank 0 of the workers).

The worker's metrics dict is the single source: `Tracker.log` sends it to TensorBoard (default)
and MLflow (optional), namespaced as train/*, perf/*, system/*, checkpoint/*, eval/*.
(The end-of-run summary.md and loss curve are the driver's: raytrain.driver.summary. The driver
checks the tracking section before any worker starts: raytrain.driver.tracking.)

One raytrain run, one MLflow run: which one is recorded in the run's directory (STORAGE/RUN/
tracking.json, written by rank 0 when it opens the MLflow run). A restarted worker group and a
continued run read it and log to the same MLflow run; a run directory without it (a new name, a
name reused in another storage path, or --fresh, which sets the old directory aside with its
record) opens a new one. The same record tells rank 0 whether TensorBoard's local directory of a
run on cloud storage (`tensorboard_dir`) holds an earlier run of that name, to set aside.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

from raytrain.checkpoint import layout
from raytrain.config import TrackingConfig
from raytrain.console import emit

NAMESPACE = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
    "data_wait_frac": "perf/data_wait_frac", "memory_gib": "system/memory_gib",
    "checkpoint_save_s": "checkpoint/save_s", "checkpoint_size_gib": "checkpoint/size_gib",
    "checkpoint_gbps": "checkpoint/throughput_gbps", "resume_s": "checkpoint/resume_s",
    "eval_loss": "eval/loss", "eval_ppl": "eval/ppl",
}
RECORD = "tracking.json"
"""The run directory's record of its MLflow run: {"mlflow": {tracking_uri, experiment, experiment_id, run_id}}."""


def tensorboard_dir(storage_path: str, name: str) -> str:
    """Event files live with the run on local or shared storage; for a cloud URI, on rank 0's node
    (TensorBoard's writer appends to local files; it cannot write s3://, gs://, abfs:// alike)."""
    if "://" in storage_path:
        return os.path.join(os.path.expanduser("~/raytrain_tensorboard"), name)
    return os.path.join(layout.run_uri(storage_path, name), layout.TENSORBOARD_DIR)


def read_record(run_uri: str) -> dict[str, Any] | None:
    """Run `run_uri`'s tracking record (its tracking.json), or None where it has none. Read by rank 0
    and, before the workers start, by the driver's check (raytrain.driver.tracking)."""
    import pyarrow.fs

    fs, path = layout.filesystem(f"{run_uri.rstrip('/')}/{RECORD}")
    if fs.get_file_info(path).type == pyarrow.fs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def _write_record(run_uri: str, record: dict[str, Any]) -> None:
    fs, path = layout.filesystem(f"{run_uri.rstrip('/')}/{RECORD}")
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)  # rank 0 may get here before Ray Train writes the run
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(record, indent=2).encode())


def same_mlflow_run(recorded: dict[str, Any] | None, cfg: TrackingConfig) -> bool:
    """Whether a run whose record holds `recorded` (its "mlflow" entry) continues that MLflow run
    under `cfg`: the same tracking URI and experiment; after either changed it opens a new one."""
    return bool(recorded) and (recorded["tracking_uri"], recorded["experiment"]) == (
        cfg.mlflow_tracking_uri, cfg.mlflow_experiment)


class Tracker:
    """Rank 0's sink for metrics. Other ranks get a Tracker that does nothing. `run`: the RunSpec as a
    dict (its "config" becomes the MLflow run's params)."""

    def __init__(self, cfg: TrackingConfig, storage_path: str, name: str, run: dict[str, Any], active: bool):
        self._tb = self._mlflow = None
        if not active:
            return
        run_uri = layout.run_uri(storage_path, name)
        cloud_tb = cfg.tensorboard and "://" in storage_path
        # One small read at start, only where the record decides something.
        record = read_record(run_uri) if cfg.mlflow_tracking_uri or cloud_tb else None
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            logdir = tensorboard_dir(storage_path, name)
            if cloud_tb and record is None and os.path.isdir(logdir) and os.listdir(logdir):
                # What --fresh does to STORAGE/RUN on local storage (raytrain.driver.run._place), here on
                # this node: a new run's events would otherwise mix with the earlier run's of the name.
                aside = layout.set_aside(logdir)
                emit(f"raytrain: note: run {name!r} is a new run: moved the TensorBoard event files of an earlier "
                     f"run of that name on this node to {aside}")
            self._tb = SummaryWriter(logdir)
        mlflow_run = None
        if cfg.mlflow_tracking_uri:
            self._mlflow, mlflow_run = _open_mlflow_run(cfg, name, run_uri, run, (record or {}).get("mlflow"))
        if (cfg.mlflow_tracking_uri or cloud_tb) and (record is None or record.get("mlflow") != mlflow_run):
            _write_record(run_uri, {"mlflow": mlflow_run})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {NAMESPACE[k]: float(v) for k, v in metrics.items()
                   if k in NAMESPACE and v is not None and math.isfinite(float(v))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()  # a killed worker must not lose the last window
        if self._mlflow is not None:
            self._mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        """Called in the worker loop's `finally`: the MLflow run ends FINISHED, or FAILED where an exception is
        on its way out of the loop (sys.exc_info() holds it inside a `finally`), so that a run whose last
        worker failure ends it does not show FINISHED. A retried worker group reopens it RUNNING. A worker
        that is killed (a bad record's stop, Ctrl-C) gets here not at all: the driver ends that MLflow run
        (raytrain.driver.tracking.mlflow_run_outcome)."""
        if self._tb is not None:
            self._tb.close()
        if self._mlflow is not None:
            self._mlflow.end_run(status="FINISHED" if sys.exc_info()[0] is None else "FAILED")


def _open_mlflow_run(cfg: TrackingConfig, name: str, run_uri: str, run: dict[str, Any],
                     recorded: dict[str, Any] | None):
    """(mlflow, the run's "mlflow" record): the recorded MLflow run continued, else a new one with
    the run config as its params. The driver has checked both (raytrain.driver.tracking): the
    experiment is not deleted, the recorded run exists and is not deleted."""
    import mlflow

    mlflow.set_tracking_uri(cfg.mlflow_tracking_uri)
    if same_mlflow_run(recorded, cfg):
        mlflow.start_run(run_id=recorded["run_id"])
        _log_changed_params(mlflow, recorded["run_id"], _flat_params(run))
        return mlflow, recorded
    experiment = mlflow.set_experiment(cfg.mlflow_experiment)
    started = mlflow.start_run(run_name=name, tags={"raytrain_run": name, "raytrain_run_uri": run_uri})
    mlflow.log_params(_flat_params(run))
    return mlflow, {"tracking_uri": cfg.mlflow_tracking_uri, "experiment": cfg.mlflow_experiment,
                    "experiment_id": experiment.experiment_id, "run_id": started.info.run_id}


_CONTINUE = re.compile(r"(.+):continue_(\d+)")


def _log_changed_params(mlflow, run_id: str, params: dict[str, str]) -> None:
    """A continued run's settings that differ from those its MLflow run holds, logged beside them: MLflow's
    params cannot change (logging another value raises), so a run continued from training.max_steps=5 to 10
    still shows 5. Each continue that changes something logs its new values as KEY:continue_N (N counts those
    continues: training.max_steps=5, training.max_steps:continue_1=10, ...); the unsuffixed params stay the
    first session's, the highest N of a key is its value now. A key the run lacks (a newer raytrain's) is
    logged as it is. A restarted worker group, with the same settings, logs nothing."""
    held = mlflow.MlflowClient().get_run(run_id).data.params
    latest, last_n = dict(held), 0
    for key in sorted(held, key=lambda k: int(m[2]) if (m := _CONTINUE.fullmatch(k)) else 0):
        if (m := _CONTINUE.fullmatch(key)) is not None:
            latest[m[1]], last_n = held[key], max(last_n, int(m[2]))
    new = {key: value for key, value in params.items() if key not in latest}
    changed = {f"{key}:continue_{last_n + 1}": value for key, value in params.items()
               if key in latest and latest[key] != value}
    if new or changed:
        mlflow.log_params({**new, **changed})


def _flat_params(run: dict[str, Any]) -> dict[str, str]:
    """The user's run config (the spec's "config": the spec's own "model" and "data" are derived facts)."""
    config = run.get("config") or {}
    out: dict[str, str] = {}
    for section in ("model", "data", "training", "scaling", "checkpoint"):
        for key, value in (config.get(section) or {}).items():
            out[f"{section}.{key}"] = str(value)[:500]  # MLflow caps param values
    return out
