"""Experiment tracking (rank 0) and the end-of-run summary (driver).

The worker's metrics dict is the single source: `Tracker.log` sends it to TensorBoard (default)
and MLflow (optional), namespaced as train/*, perf/*, system/*, checkpoint/*, eval/*.
`write_summary` turns the run's metrics history into summary.md and loss_curve.png next to the
checkpoints.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

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
    return os.path.join(storage_path, name, "tensorboard")


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


def write_summary(history: list[dict[str, Any]], final: dict[str, Any], storage_path: str, name: str) -> list[str]:
    """Write summary.md and loss_curve.png into the run directory; return their paths."""
    import pyarrow.fs
    from matplotlib.figure import Figure  # not pyplot: leaves the caller's (a notebook's) backend alone

    rows = [("final step", f"{int(final['step'])}"), ("final loss", f"{final['loss']:.4f}")]
    for key, label, fmt in (("eval_loss", "eval loss", "{:.4f}"), ("eval_ppl", "eval perplexity", "{:.2f}"),
                            ("tokens_per_s", "tokens/s (last window)", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
                            ("memory_gib", "peak memory GiB", "{:.2f}"), ("data_wait_frac", "data wait", "{:.2%}")):
        if final.get(key) is not None:
            rows.append((label, fmt.format(final[key])))
    saves = [m for m in history if "checkpoint_save_s" in m]
    if saves:
        rows.append(("checkpoint save (last)", f"{saves[-1]['checkpoint_save_s']:.2f} s, "
                                               f"{saves[-1]['checkpoint_size_gib']:.3f} GiB"))
    table = "\n".join(["| metric | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows])
    text = f"# raytrain run {name}\n\n{table}\n\n![loss](loss_curve.png)\n"

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], label="train loss")
    evals = [m for m in history if m.get("eval_loss") is not None]
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.legend()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")

    fs, root = pyarrow.fs.FileSystem.from_uri(storage_path)
    run_dir = f"{root.rstrip('/')}/{name}"
    fs.create_dir(run_dir, recursive=True)
    written = []
    for filename, data in (("summary.md", text.encode()), ("loss_curve.png", png.getvalue())):
        with fs.open_output_stream(f"{run_dir}/{filename}") as f:
            f.write(data)
        written.append(f"{storage_path.rstrip('/')}/{name}/{filename}")
    return written
