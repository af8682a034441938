"""raytrain.driver.tracking: what would fail rank 0's tracker (a retried worker failure) is one line on
the driver, against a real MLflow file store (and a local socket for a server that is down)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import socket
import sys
import threading

import pytest

from raytrain.config import ConfigError, TrackingConfig, load_config
from raytrain.driver.tracking import check_tracking, end_mlflow_run, tracking_env
from raytrain.worker.tracking import RECORD, Tracker


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local file store (no server)
    return f"file://{tmp_path / 'mlruns'}"


def config(uri: str, *more: str):
    return load_config(None, [f"tracking.mlflow_tracking_uri={uri}", *more])


def test_mlflow_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` meets where it is not installed
    with pytest.raises(ConfigError, match=r'needs MLflow, which is not installed here: pip install "raytrain\[mlflow\]"'):
        check_tracking(config("http://127.0.0.1:5000"))


def test_no_mlflow_tracking_uri_asks_nothing_of_mlflow(tmp_path, monkeypatch):
    """Without tracking.mlflow_tracking_uri there is no MLflow to check, pass on or end, installed or not."""
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = load_config(None, [f"checkpoint.storage_path={tmp_path}", "checkpoint.name=r"])
    assert check_tracking(cfg) == [] and tracking_env(cfg) == {}
    assert end_mlflow_run(cfg, str(tmp_path / "r"), "FAILED") is None


@pytest.mark.parametrize("allow", ["true", "false", None])
def test_the_drivers_file_store_opt_in_is_passed_on_to_the_workers_as_it_is(monkeypatch, allow):
    """Workers inherit their cluster's environment: the opt-in the driver's check ran with goes with the run."""
    if allow is None:
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow)
    passed_on = {} if allow is None else {"MLFLOW_ALLOW_FILE_STORE": allow}
    assert tracking_env(config("http://127.0.0.1:5000")) == passed_on


def test_a_file_store_without_mlflows_opt_in_gets_the_whole_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError) as e:
        check_tracking(config(f"file://{tmp_path}/mlruns"))
    assert "MLflow 3 uses only where the environment sets MLFLOW_ALLOW_FILE_STORE=true" in str(e.value)
    assert "sqlite:///PATH/mlflow.db" in str(e.value) and not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("allow", ["true", None])
def test_a_databricks_workspace_is_asked_as_a_server_not_taken_for_a_file_store(tmp_path, monkeypatch, allow):
    # "databricks" has no scheme, as a relative path has: it was refused as a file store without the opt-in, and with
    # it a ./databricks directory was checked and the run accepted, its rank 0 then failing without credentials
    for name in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "DATABRICKS_CONFIG_PROFILE", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    if allow:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow)
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", str(tmp_path / "no-databrickscfg"))  # no profile of the machine's
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^tracking.mlflow_tracking_uri=databricks: MLflow cannot use it \(.*"
                                          r"Databricks"):
        check_tracking(config("databricks"))
    assert not (tmp_path / "databricks").exists()


def test_an_existing_file_store_without_mlflows_opt_in_gets_the_whole_fix(store, monkeypatch):
    """A store that exists is opened, and MLflow's own refusal (its hint at MLFLOW_ALLOW_FILE_STORE) is
    the same one line as for a new store, not "MLflow cannot use it"."""
    import mlflow

    # the store exists (.trash and all), opened under another spelling: MLflow keeps a store it opened per URI
    mlflow.MlflowClient(tracking_uri=store.removeprefix("file://")).create_experiment("raytrain")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(ConfigError) as e:
        check_tracking(config(store))
    assert str(e.value).startswith(f"tracking.mlflow_tracking_uri={store} is a file store, which MLflow 3 uses only "
                                   f"where the environment sets MLFLOW_ALLOW_FILE_STORE=true: set it for the driver")
    assert "\n" not in str(e.value) and "cannot use it" not in str(e.value)


def test_a_new_file_store_is_checked_without_being_created(store, tmp_path):
    """MLflow's FileStore creates its directory, the Default experiment and .trash when opened: a dry run
    (which runs this check) wrote them. A store that does not exist yet is checked on the filesystem instead;
    one that exists is asked (the tests below)."""
    root = pathlib.Path(store.removeprefix("file://"))
    assert check_tracking(config(store)) == []
    assert not root.exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"tracking.mlflow_tracking_uri=/.*afile/mlruns: .*afile, on its path, "
                                          r"is a file, not a directory"):
        check_tracking(config(f"file://{tmp_path}/afile/mlruns"))
    (tmp_path / "ro").mkdir(mode=0o555)
    if not os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere
        with pytest.raises(ConfigError, match=r"ro/mlruns: it cannot be created \(.*ro is not writable\)"):
            check_tracking(config(f"file://{tmp_path}/ro/mlruns"))
    cfg = config(store, f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=r")
    (tmp_path / "runs" / "r").mkdir(parents=True)  # a continued run whose record names a run this new store lacks
    (tmp_path / "runs" / "r" / RECORD).write_text(json.dumps({"mlflow": {
        "tracking_uri": store, "experiment": "raytrain", "run_id": "abc"}}))
    with pytest.raises(ConfigError, match=r"continues MLflow run abc .* which file://.* does not hold"):
        check_tracking(cfg)
    assert not root.exists()


def test_a_database_store_without_the_full_mlflow_package_names_it():
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow package is installed here: sqlite:/// works")
    # raytrain[mlflow] is mlflow-skinny: the line was MLflow's "Model registry functionality is unavailable ..."
    with pytest.raises(ConfigError, match=r"tracking.mlflow_tracking_uri=sqlite:///m.db is a database store, which "
                                          r"needs the full mlflow package .*: pip install mlflow"):
        check_tracking(config("sqlite:///m.db"))


def test_a_new_sqlite_database_is_checked_without_being_created(tmp_path):
    """MLflow's SqlAlchemyStore creates the database's directories, the file and its tables when it opens it: a dry
    run (which runs this check) wrote them. A database that does not exist yet (or lacks MLflow's tables) is checked
    on the filesystem instead; one with MLflow's tables is asked as any other store. Needs SQLAlchemy (the full
    mlflow package); without it a database store is refused first (above)."""
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is None:
        pytest.skip("mlflow-skinny: a database store is refused before it is looked at (above)")
    import mlflow

    assert check_tracking(config(f"sqlite:///{tmp_path}/sub/mlflow.db")) == []
    assert os.listdir(tmp_path) == []  # neither sub/ nor the database
    assert check_tracking(config("sqlite://")) == []  # in memory: no file to look at, asked as MLflow opens it
    (tmp_path / "notes.db").write_text("a text file, not a database")
    with pytest.raises(ConfigError, match=r"notes.db is not an SQLite database this driver can read \(file is not a "
                                          r"database\): name a new file, or an MLflow database"):
        check_tracking(config(f"sqlite:///{tmp_path}/notes.db"))
    real = f"sqlite:///{tmp_path}/mlflow.db"  # one that exists: asked, as before
    client = mlflow.MlflowClient(tracking_uri=real)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(ConfigError, match=r"tracking.mlflow_experiment=gone is a deleted experiment in sqlite:///"):
        check_tracking(config(real, "tracking.mlflow_experiment=gone"))


def test_what_opening_a_new_sqlite_database_would_refuse_is_asked_without_writing(tmp_path):
    """The filesystem half of the check above, which needs no SQLAlchemy: a directory where the file should be,
    and whether a file holds MLflow's tables, read in SQLite's read-only mode (the file is left as it was)."""
    import shutil
    import sqlite3

    from raytrain.driver.tracking import _check_new_sqlite_store, _holds_mlflow_tables

    _check_new_sqlite_store("sqlite:///x", str(tmp_path / "a" / "mlflow.db"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match=r"is a directory, not a database file: name a file in it \(sqlite:////"):
        _check_new_sqlite_store("sqlite:///x", str(tmp_path))
    for name, table in (("mlflow.db", "experiments"), ("other.db", "notes")):
        with sqlite3.connect(tmp_path / name) as db:
            db.execute(f"CREATE TABLE {table} (id INTEGER)")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert _holds_mlflow_tables("sqlite:///x", str(tmp_path / "mlflow.db"))
    assert not _holds_mlflow_tables("sqlite:///x", str(tmp_path / "other.db"))  # MLflow would add its tables
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # locked by a writer (a run logging to it): a database, asked as before, not "not a database"
    with contextlib.closing(sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)) as writer:
        writer.execute("BEGIN EXCLUSIVE")
        assert _holds_mlflow_tables("sqlite:///x", str(tmp_path / "mlflow.db"), lock_wait_s=0.1)
    # a writer killed mid-write (a run stopped while logging) left a hot journal, which only a writer rolls back (as
    # MLflow's own open does): a database, asked as before, not "not a database (attempt to write a readonly ...)"
    with contextlib.closing(sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)) as writer:
        writer.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5000) "
                       "INSERT INTO experiments SELECT i FROM n")  # a few pages, in one transaction
        writer.execute("PRAGMA cache_size=1")  # the change spills to the file before its commit: the journal is hot
        writer.execute("BEGIN")
        writer.execute("UPDATE experiments SET id = -id")
        for suffix in (".db", ".db-journal"):  # the files as a killed writer leaves them
            shutil.copy(tmp_path / f"mlflow{suffix}", tmp_path / f"killed{suffix}")
    assert _holds_mlflow_tables("sqlite:///x", str(tmp_path / "killed.db"))
    assert (tmp_path / "killed.db-journal").exists()  # left for MLflow's open to roll back
    (tmp_path / "notes.txt").write_text("not a database, but a long enough text file to be read as a header\n" * 4)
    with pytest.raises(ConfigError, match=r"notes.txt is not an SQLite database this driver can read \(file is not "
                                          r"a database\): name a new file, or an MLflow database"):
        _holds_mlflow_tables("sqlite:///x", str(tmp_path / "notes.txt"))


def test_a_deleted_experiment_is_refused_with_how_to_restore_it(store):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    client.delete_experiment(client.create_experiment("gone"))
    check_tracking(config(store, "tracking.mlflow_experiment=new"))  # one that does not exist yet: rank 0 creates it
    with pytest.raises(ConfigError, match=r"tracking.mlflow_experiment=gone is a deleted experiment .*: restore it "
                                          r"\(mlflow experiments restore --experiment-id \d+\) or choose another name"):
        check_tracking(config(store, "tracking.mlflow_experiment=gone"))


def test_a_continued_run_needs_its_mlflow_run(store, tmp_path):
    """The MLflow run a continued run's record names must still be there; --fresh starts a new one."""
    import mlflow

    storage = tmp_path / "runs"
    cfg = config(store, f"checkpoint.storage_path={storage}", "checkpoint.name=r")
    Tracker(cfg.tracking, str(storage), "r", {}, active=True).close()  # rank 0 of the first attempt
    assert check_tracking(cfg) == []
    run_id = mlflow.last_active_run().info.run_id
    mlflow.MlflowClient(tracking_uri=store).delete_run(run_id)
    with pytest.raises(ConfigError, match=rf"run 'r' continues MLflow run {run_id}, which is deleted .*: restore it "
                                          rf"\(mlflow runs restore --run-id {run_id}\), or delete .*/r/{RECORD}"):
        check_tracking(cfg)
    assert check_tracking(cfg, fresh=True) == []  # the record goes aside with the run
    other = config(store, f"checkpoint.storage_path={storage}", "checkpoint.name=r", "tracking.mlflow_experiment=b")
    [note] = check_tracking(other)
    assert f"run 'r' logged its earlier steps to MLflow run {run_id}" in note and "continues in a new MLflow run" in note


@pytest.mark.parametrize("record, refusal", [
    ({"mlflow": {"tracking_uri": None, "experiment": "raytrain", "run_id": "0" * 32}},
     rf"run 'r' continues MLflow run {'0' * 32} \({RECORD} in its directory\), which file://.* does not hold: set "
     rf"tracking.mlflow_tracking_uri to the store that holds it, or delete .*/r/{RECORD} to log the rest"),
    ({"mlflow": {"tracking_uri": None, "experiment": "raytrain", "run_id": "../x"}},
     rf"run 'r' continues MLflow run \.\./x \({RECORD} in its directory\), which file://.* does not hold: .*, or "
     rf"delete .*/r/{RECORD} to log the rest"),
    ('{"mlflow": {"run_id": ', rf"/r/{RECORD}: cannot read it \(.*\): check the storage's credentials, or delete the "
                               rf"file to log the rest of the run to a new MLflow run"),
], ids=["a run the store lacks", "an id no store holds", "a record cut short"])
def test_a_continued_run_whose_record_the_store_cannot_serve_is_refused(store, tmp_path, record, refusal):
    """A store that exists (not only a new one) is asked for the recorded run; a record that is not JSON is
    one line naming the file."""
    import mlflow

    mlflow.MlflowClient(tracking_uri=store).create_experiment("raytrain")
    cfg = config(store, f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=r")
    (tmp_path / "runs" / "r").mkdir(parents=True)
    if isinstance(record, dict):
        record["mlflow"]["tracking_uri"] = store
    (tmp_path / "runs" / "r" / RECORD).write_text(record if isinstance(record, str) else json.dumps(record))
    with pytest.raises(ConfigError, match=refusal):
        check_tracking(cfg)
    assert check_tracking(cfg, fresh=True) == []  # --fresh sets the record aside


def test_a_recorded_run_the_store_cannot_read_is_mlflows_own_line_not_a_missing_run(store, tmp_path):
    """The store holds the recorded run but cannot read it (its directory moved by hand into another experiment's):
    MLflow's own error, in one line, not "does not hold", which would send the user to look for another store."""
    import shutil

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    experiment_id, elsewhere = client.create_experiment("raytrain"), client.create_experiment("elsewhere")
    run_id = client.create_run(experiment_id).info.run_id
    root = pathlib.Path(store.removeprefix("file://"))
    shutil.move(root / experiment_id / run_id, root / elsewhere / run_id)
    cfg = config(store, f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=r")
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / RECORD).write_text(json.dumps({"mlflow": {
        "tracking_uri": store, "experiment": "raytrain", "run_id": run_id}}))
    with pytest.raises(ConfigError) as e:
        check_tracking(cfg)
    assert str(e.value).startswith(f"tracking.mlflow_tracking_uri={store}: MLflow cannot use it (Run '{run_id}' ")
    assert "does not hold" not in str(e.value) and "\n" not in str(e.value)


def test_a_server_that_is_down_is_tried_twice_not_eight_times(monkeypatch):
    """MLflow's defaults retry 7 times with exponential backoff and 120 s a request (4 min 14 s
    measured for a refused port); the check retries once, 5 s a request."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # no waiting between the attempts counted here
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    server = socket.create_server(("127.0.0.1", 0))
    attempts = []

    def hang_up() -> None:  # a server that accepts and closes: each attempt is one connection
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at the end of the test
                return
            attempts.append(1)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    uri = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(ConfigError, match=rf"tracking.mlflow_tracking_uri={uri}: MLflow cannot use it \("):
            check_tracking(config(uri))
    finally:
        server.close()
    assert len(attempts) == 2


def test_every_tracking_key_is_in_the_help_and_the_readme(capsys):
    from raytrain.main import main

    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    readme = (pathlib.Path(__file__).parents[3] / "README.md").read_text()
    for key in (f"tracking.{f.name}" for f in dataclasses.fields(TrackingConfig)):
        assert key in shown and f"`{key}`" in readme, key


def test_a_local_store_named_relative_to_the_driver_is_made_absolute(tmp_path, monkeypatch):
    """MLflow reads a relative store against the working directory of the process that opens it, and rank 0's is
    Ray's for the job (/tmp/ray/session_*/...): each local form is made absolute here, a server's URI is not."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    from raytrain.driver.tracking import local_tracking_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    here = str(tmp_path)
    resolved = {"mlruns": f"{here}/mlruns", "./mlruns": f"{here}/mlruns", "~/mlruns": f"{here}/home/mlruns",
                "file:mlruns": f"file://{here}/mlruns", "file:./mlruns": f"file://{here}/mlruns",
                "sqlite:///m.db": f"sqlite:///{here}/m.db",  # sqlite:////tmp/...: SQLAlchemy's absolute form
                "sqlite:///sub/m.db?timeout=30": f"sqlite:///{here}/sub/m.db?timeout=30",
                "sqlite+pysqlite:///m.db": f"sqlite+pysqlite:///{here}/m.db"}
    for uri, absolute in resolved.items():
        assert local_tracking_uri(uri) == absolute, uri
    for uri in ("mlruns", "file:mlruns", "~/mlruns"):  # the directory MLflow opens, from any working directory
        assert local_file_uri_to_path(local_tracking_uri(uri)) == os.path.abspath(os.path.expanduser(uri[5:]
                                                                                   if uri.startswith("file:") else uri))
    as_written = ["/abs/mlruns", "file:///abs/mlruns", "file://host/mlruns", "sqlite:////abs/m.db", "sqlite://",
                  "sqlite:///:memory:", "sqlite:///file:m.db?mode=ro&uri=true", "http://127.0.0.1:5000",
                  "https://mlflow.example.com/x", "databricks", "databricks://profile", "databricks-uc", "uc",
                  "postgresql://user@host/db", "mysql+pymysql://host/db"]
    for uri in as_written:
        assert local_tracking_uri(uri) == uri


def test_a_relative_store_is_the_one_the_driver_checks_and_rank_0_writes(store, tmp_path, monkeypatch):
    """tracking.mlflow_tracking_uri=mlruns: rank 0 wrote the store under Ray's working directory, and the
    continued run's check, in the driver's, refused it ("which mlruns does not hold", exit 2)."""
    from raytrain.driver.run import _local_paths

    driver, ray_session = tmp_path / "driver", tmp_path / "ray_session"
    driver.mkdir()
    ray_session.mkdir()
    monkeypatch.chdir(driver)
    cfg = _local_paths(config("mlruns", f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=r"))
    assert cfg.tracking.mlflow_tracking_uri == str(driver / "mlruns")  # what the run's spec and messages show
    assert check_tracking(cfg) == []
    monkeypatch.chdir(ray_session)  # rank 0's working directory
    Tracker(cfg.tracking, cfg.checkpoint.storage_path, "r", {}, active=True).close()
    assert os.listdir(ray_session) == [] and (driver / "mlruns" / ".trash").is_dir()
    monkeypatch.chdir(driver)
    assert check_tracking(cfg) == []  # the continue finds its MLflow run


def test_a_run_the_driver_stops_ends_its_mlflow_run_failed_or_killed(store, tmp_path, capsys):
    """A bad record's stop and Ctrl-C kill the workers (Ray Train's abort), so rank 0 never ends its MLflow
    run: it showed RUNNING forever. The driver ends it from the record rank 0 wrote."""
    import mlflow

    from raytrain.checkpoint import layout
    from raytrain.driver.tracking import mlflow_run_outcome
    from raytrain.driver.watch import Interrupted

    client = mlflow.MlflowClient(tracking_uri=store)
    experiment_id = client.create_experiment("raytrain")
    storage = tmp_path / "runs"

    def stopped(name: str, error: BaseException | None, finished: bool = False, record: str | None = "raytrain") -> str:
        cfg = config(store, f"checkpoint.storage_path={storage}", f"checkpoint.name={name}")
        run_uri = layout.run_uri(str(storage), name)
        run_id = client.create_run(experiment_id).info.run_id  # opened by rank 0, which was then killed
        if finished:  # rank 0 closed it
            client.set_terminated(run_id, status="FINISHED")
        os.makedirs(run_uri)
        if record is not None:  # the experiment it names (the settings rank 0 logged under)
            pathlib.Path(run_uri, RECORD).write_text(json.dumps({"mlflow": {
                "tracking_uri": store, "experiment": record, "experiment_id": experiment_id, "run_id": run_id}}))
        with contextlib.suppress(type(error) if error else ()):
            with mlflow_run_outcome(cfg, run_uri):
                if error is not None:
                    raise error
            assert error is None, "the error goes on"
        return client.get_run(run_id).info.status

    assert stopped("bad_record", ConfigError("data/train.jsonl line 3: not JSON")) == "FAILED"
    assert stopped("ctrl_c", Interrupted(3, 10, None, "python -m raytrain.main")) == "KILLED"
    assert stopped("done", RuntimeError("after the last step"), finished=True) == "FINISHED"
    assert stopped("running", None) == "RUNNING"  # a run that trains on: rank 0 ends it
    # a record of other settings names an MLflow run this session did not log to; none: rank 0 opened none
    assert stopped("other_settings", ConfigError("bad record"), record="an earlier experiment") == "RUNNING"
    assert stopped("no_record", ConfigError("bad record"), record=None) == "RUNNING"
    assert capsys.readouterr().out == ""  # nothing to say where it went as it should


def test_a_run_the_driver_cannot_end_is_a_note_and_its_own_error_goes_on(tmp_path, monkeypatch, capsys):
    """The store cannot be reached when the run stops (a server gone): one note saying the MLflow run shows
    RUNNING, tried as quickly as the check tries, and the run's own error is the one raised."""
    from raytrain.checkpoint import layout
    from raytrain.driver.tracking import mlflow_run_outcome

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    with socket.create_server(("127.0.0.1", 0)) as closed:
        uri = f"http://127.0.0.1:{closed.getsockname()[1]}"  # nothing listens there once it is closed
    storage, run_id = tmp_path / "runs", "0" * 32
    cfg = config(uri, f"checkpoint.storage_path={storage}", "checkpoint.name=r")
    run_uri = layout.run_uri(str(storage), "r")
    os.makedirs(run_uri)
    pathlib.Path(run_uri, RECORD).write_text(json.dumps({"mlflow": {
        "tracking_uri": uri, "experiment": "raytrain", "run_id": run_id}}))
    error = ConfigError("data/train.jsonl line 3: not JSON")
    with pytest.raises(ConfigError) as raised:
        with mlflow_run_outcome(cfg, run_uri):
            raise error
    assert raised.value is error
    out = capsys.readouterr().out
    assert out.startswith(f"raytrain: note: MLflow run {run_id} in {uri} could not be ended FAILED (")
    assert out.endswith("): it shows RUNNING\n") and out.count("\n") == 1
