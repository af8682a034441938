"""Tracking with the real backends: an MLflow local file store and TensorBoard event files."""

import contextlib
import math
import os

import pytest

from raytrain.checkpoint import layout
from raytrain.config import TrackingConfig
from raytrain.worker.tracking import RECORD, Tracker

HISTORY = [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + s,
            "data_wait_frac": 0.01, "memory_gib": 0.5, "step_time_s": 0.1, "eta_s": 0.0} for s in (5, 10, 15)]
HISTORY[-1].update(checkpoint_save_s=0.5, checkpoint_size_gib=0.01, checkpoint_gbps=0.02, eval_loss=0.4, eval_ppl=math.e ** 0.4)


def test_mlflow_and_tensorboard_receive_namespaced_metrics(tmp_path, monkeypatch):
    import mlflow

    # MLflow 3 keeps its file store in maintenance mode behind this switch; it is the local store
    # that needs no database server.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}"
    cfg = TrackingConfig(tensorboard=True, mlflow_tracking_uri=uri, mlflow_experiment="t")
    tracker = Tracker(cfg, str(tmp_path), "run1", {"config": {"training": {"max_steps": 15}}}, active=True)
    for m in HISTORY:
        tracker.log(m, m["step"])
    tracker.close()

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("t").experiment_id])[0]
    assert [p.value for p in client.get_metric_history(run.info.run_id, "train/loss")] == [1.0, 0.5, 5.0 / 15]
    assert run.data.metrics["eval/loss"] == 0.4 and run.data.metrics["checkpoint/save_s"] == 0.5
    assert run.data.params["training.max_steps"] == "15"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run1" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(5, 1.0), (10, 0.5),
                                                                         (15, pytest.approx(5.0 / 15))]
    assert events.Scalars("perf/tokens_per_s")[-1].value == 1015.0 and "eval/ppl" in events.Tags()["scalars"]

    # a restarted worker group continues the same MLflow run instead of opening a new one
    again = Tracker(cfg, str(tmp_path), "run1", {}, active=True)
    again.log({"loss": 0.1}, 20)
    again.close()
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_inactive_tracker_writes_nothing(tmp_path):
    Tracker(TrackingConfig(), str(tmp_path), "run2", {}, active=False).log(HISTORY[0], 5)
    assert not (tmp_path / "run2").exists()


def test_one_mlflow_run_per_raytrain_run(tmp_path, monkeypatch):
    """A restarted worker group or a continued run logs to the run's MLflow run; a new run of the same
    name (--fresh sets the directory aside with its record; another storage path) gets its own. The
    name is the user's checkpoint.name, quotes and all."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}"
    cfg = TrackingConfig(tensorboard=False, mlflow_tracking_uri=uri, mlflow_experiment="t")
    storage, name = str(tmp_path / "runs"), "run 'a'"
    os.makedirs(layout.run_uri(storage, name))  # Ray Train's, with its checkpoints

    def attempt(step: int, where: str = storage) -> str:
        tracker = Tracker(cfg, where, name, {}, active=True)
        tracker.log({"loss": float(step)}, step)
        tracker.close()
        return mlflow.last_active_run().info.run_id

    first = attempt(1)
    assert attempt(2) == first  # a restart or a continued run
    layout.set_aside(layout.run_uri(storage, name))  # what --fresh does
    fresh = attempt(3)
    elsewhere = attempt(4, str(tmp_path / "other_runs"))
    assert len({first, fresh, elsewhere}) == 3
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    assert [m.value for m in client.get_metric_history(first, "train/loss")] == [1.0, 2.0]
    assert [m.value for m in client.get_metric_history(fresh, "train/loss")] == [3.0]
    assert client.get_run(fresh).data.tags["raytrain_run"] == name
    assert os.listdir(layout.run_uri(storage, name)) == [RECORD]  # tensorboard=false: no event files

    # the same run continued under another experiment opens a new MLflow run, which its restarts continue
    cfg = TrackingConfig(tensorboard=False, mlflow_tracking_uri=uri, mlflow_experiment="u")
    moved = attempt(5)
    assert moved not in {first, fresh, elsewhere} and attempt(6) == moved
    assert [m.value for m in client.get_metric_history(moved, "train/loss")] == [5.0, 6.0]


def test_tensorboard_of_a_cloud_run_is_set_aside_for_a_new_run_of_its_name(tmp_path, monkeypatch):
    """On cloud storage the event files are on rank 0's node (~/raytrain_tensorboard/RUN): a restart
    appends to them, a new run of the name (after --fresh) moves the earlier run's aside, as --fresh
    does with STORAGE/RUN on local storage. A file:// URI stands for the cloud here (pyarrow's)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    storage = f"file://{tmp_path / 'bucket'}"
    cfg = TrackingConfig(tensorboard=True)
    local = tmp_path / "home" / "raytrain_tensorboard"

    def attempt(step: int) -> None:
        tracker = Tracker(cfg, storage, "r", {}, active=True)
        tracker.log({"loss": float(step)}, step)
        tracker.close()

    def steps(logdir) -> list[int]:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(logdir))
        events.Reload()
        return [e.step for e in events.Scalars("train/loss")]

    attempt(1)
    attempt(2)  # a restarted worker group: the same directory, nothing set aside
    assert os.listdir(local) == ["r"] and steps(local / "r")[-1] == 2
    layout.set_aside(layout.run_uri(storage, "r"))  # --fresh
    attempt(3)
    [aside] = [d for d in os.listdir(local) if d.startswith("r.replaced-")]
    assert steps(local / aside)[-1] == 2 and steps(local / "r") == [3]


@pytest.mark.parametrize("tensorboard, cloud, files", [
    (True, False, {"r": ["tensorboard"]}),  # the run's event files, where a restart writes too
    (False, True, {}),  # nothing to log to, nothing to record
])
def test_a_run_without_mlflow_keeps_no_tracking_record(tmp_path, monkeypatch, tensorboard, cloud, files):
    """The record names the run's MLflow run; only a run on cloud storage with TensorBoard (whose local
    event files it guards) needs one without MLflow."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    storage = tmp_path / "bucket"
    for step in (1, 2):
        tracker = Tracker(TrackingConfig(tensorboard=tensorboard), f"file://{storage}" if cloud else str(storage),
                          "r", {}, active=True)
        tracker.log({"loss": float(step)}, step)
        tracker.close()
    assert ({run: os.listdir(storage / run) for run in os.listdir(storage)} if storage.exists() else {}) == files
    assert not (tmp_path / "home").exists()
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(storage / "r" / "tensorboard"))
        events.Reload()
        assert events.Scalars("train/loss")[-1].step == 2


def test_a_loop_that_raises_ends_its_mlflow_run_failed(tmp_path, monkeypatch):
    """The worker loop closes its tracker in a `finally`: a loop that raised ended the MLflow run FINISHED. A
    retried worker group reopens it RUNNING; one that completes ends it FINISHED."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}"
    cfg = TrackingConfig(tensorboard=False, mlflow_tracking_uri=uri, mlflow_experiment="t")
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)

    def attempt(error: Exception | None) -> str:
        tracker = Tracker(cfg, str(tmp_path), "run1", {}, active=True)
        with pytest.raises(RuntimeError) if error else contextlib.nullcontext():
            try:
                if error:
                    raise error
            finally:
                tracker.close()
        return client.get_run(mlflow.last_active_run().info.run_id).info.status

    assert attempt(RuntimeError("NCCL timeout")) == "FAILED"
    assert attempt(None) == "FINISHED"


def test_a_continued_run_logs_its_changed_settings_beside_the_first(tmp_path, monkeypatch):
    """MLflow's params cannot change: a run continued from training.max_steps=5 to 10 still showed 5. Each continue
    that changes a setting logs it as KEY:continue_N; a restarted worker group logs nothing new."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}"
    cfg = TrackingConfig(tensorboard=False, mlflow_tracking_uri=uri, mlflow_experiment="t")

    def session(max_steps: int, **more) -> dict[str, str]:
        spec = {"config": {"training": {"max_steps": max_steps, "seed": 1, **more}}}
        Tracker(cfg, str(tmp_path), "run1", spec, active=True).close()
        run_id = mlflow.last_active_run().info.run_id
        return mlflow.tracking.MlflowClient(tracking_uri=uri).get_run(run_id).data.params

    assert session(5) == {"training.max_steps": "5", "training.seed": "1"}
    assert session(10) == {"training.max_steps": "5", "training.seed": "1", "training.max_steps:continue_1": "10"}
    assert session(10) == session(10)  # a restart of the same session
    assert session(20, precision="bf16") == {"training.max_steps": "5", "training.seed": "1",
                                             "training.max_steps:continue_1": "10",
                                             "training.max_steps:continue_2": "20", "training.precision": "bf16"}
    assert session(10)["training.max_steps:continue_3"] == "10"  # back to 10: the highest N is the value now
    for max_steps in range(11, 19):  # continue_4 .. continue_11: N counts, not sorts as text
        session(max_steps)
    params = session(10)
    assert params["training.max_steps:continue_11"] == "18" and params["training.max_steps:continue_12"] == "10"


def test_a_settings_value_is_logged_cut_to_mlflows_limit(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}"
    cfg = TrackingConfig(tensorboard=False, mlflow_tracking_uri=uri, mlflow_experiment="t")
    path = "/data/" + "x" * 600
    Tracker(cfg, str(tmp_path), "run1", {"config": {"data": {"path": path}}}, active=True).close()
    params = mlflow.tracking.MlflowClient(tracking_uri=uri).get_run(mlflow.last_active_run().info.run_id).data.params
    assert params == {"data.path": path[:500]}
