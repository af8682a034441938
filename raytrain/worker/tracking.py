"""Experiment tracking (rank 0 of the workers).

The worker's metrics dict is the single source: `Tracker.log` sends it to TensorBoard (default)
and MLflow (optional), namespaced as train/*, perf/*, system/*, checkpoint/*, eval/*.
(The end-of-run summary.md and loss curve are the driver's: raytrain.driver.summary.)
"""

from __future__ import annotations

import math
import os
from typing import Any

from raytrain.checkpoint import layout
from raytrain.config import TrackingConfig

NAMESPACE = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
    "data_wait_frac": "perf/data_wait_frac", "memory_gib": "system/memory_gib",
    "checkpoint_save_s": "checkpoint/save_s", "checkpoint_size_gib": "checkpoint/size_gib",
    "checkpoint_gbps": "checkpoint/throughput_gbps", "resume_s": "checkpoint/resume_s",
    "eval_loss": "eval/loss", "eval_ppl": "eval/ppl",
}


def tensorboard_dir(storage_path: str, name: str) -> str:
    """Event files live with the run on local or shared storage; for a cloud URI, on rank 0's node."""
    if "://" in storage_path:
        return os.path.join(os.path.expanduser("~/raytrain_tensorboard"), name)
    return os.path.join(layout.run_uri(storage_path, name), "tensorboard")


class Tracker:
    """Rank 0's sink for metrics. Other ranks get a Tracker that does nothing."""

    def __init__(self, cfg: TrackingConfig, storage_path: str, name: str, run: dict[str, Any], active: bool):
        self._tb = self._mlflow = None
        if not active:
            return
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir(storage_path, name))
        if cfg.mlflow_tracking_uri:
            import mlflow

            mlflow.set_tracking_uri(cfg.mlflow_tracking_uri)
            mlflow.set_experiment(cfg.mlflow_experiment)
            # One MLflow run per raytrain run name: a restarted worker group continues the same run.
            existing = mlflow.search_runs(filter_string=f"tags.raytrain_run = '{name}'", output_format="list")
            if existing:
                mlflow.start_run(run_id=existing[0].info.run_id)
            else:
                mlflow.start_run(run_name=name, tags={"raytrain_run": name})
                mlflow.log_params(_flat_params(run))
            self._mlflow = mlflow

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
        if self._tb is not None:
            self._tb.close()
        if self._mlflow is not None:
            self._mlflow.end_run()


def _flat_params(run: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for section in ("model", "data", "training", "scaling", "checkpoint"):
        for key, value in (run.get(section) or {}).items():
            out[f"{section}.{key}"] = str(value)[:500]  # MLflow caps param values
    return out
