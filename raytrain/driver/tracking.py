"""Driver side of experiment tracking: the tracking section checked before any worker starts, and the
environment rank 0's tracker needs from the driver's. Start at `check_tracking`.

Rank 0 opens its tracker at the start of every worker group (raytrain.worker.tracking): whatever fails
there, Ray Train retries as a worker failure checkpoint.max_failures times, each after the model is
built. So the driver asks the same MLflow store first (`fit` before ray.init, and `--dry-run`), without
writing to it: a file store or a sqlite:/// database that opening would create is checked on the filesystem
instead. A local store named relative to the driver's directory is made absolute first (`local_tracking_uri`,
from raytrain.driver.run._local_paths): the check, rank 0 and the run's record all use that one value.

Rank 0 ends its MLflow run FINISHED, or FAILED where the loop raised; a run the driver stops (a bad record,
Ctrl-C) kills the workers before they can. `mlflow_run_outcome` around the driver's wait for the run ends the
MLflow run FAILED (KILLED after Ctrl-C) from the driver, which outlives its workers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import re
import urllib.parse
import urllib.request
from collections.abc import Iterator

from raytrain.checkpoint import layout
from raytrain.config import ConfigError, RunConfig
from raytrain.config_files import first_line
from raytrain.console import say
from raytrain.driver.checks import check_writable_dir
from raytrain.driver.cluster import environ_defaults
from raytrain.driver.watch import Interrupted
from raytrain.worker.tracking import RECORD, read_record, same_mlflow_run

# MLflow's HTTP client retries a failed request 7 times with exponential backoff and gives each one
# 120 s (mlflow/environment_variables.py, MLFLOW_HTTP_REQUEST_*): a server that is down was reported
# after 4 min 14 s, which suits rank 0 riding out a rate limit mid-run, not a check of the URI. The
# check retries once and gives each request 5 s (a server that is up answers in milliseconds): a few
# seconds at most. Rank 0 keeps MLflow's defaults. A value the environment sets wins here too.
QUICK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


_SQLITE = re.compile(r"(sqlite(?:\+\w+)?):///([^?]*)(.*)", re.DOTALL)  # scheme (a driver too), path, ?query


def local_tracking_uri(uri: str) -> str:
    """`uri` with a local store's relative path made absolute against this (the driver's) working directory, ~
    expanded: rank 0 runs in Ray's working directory for the job (/tmp/ray/session_*/...), where MLflow read
    `mlruns` as a store of its own that the driver never saw. The forms MLflow reads (3.18):
    - a plain path (`mlruns`, `~/mlruns`): a file store; made absolute, still a plain path;
    - file:PATH, file:./PATH: a file store; a relative PATH becomes file:///ABS (file:///ABS stays as it is;
      file://HOST/PATH names a host, and is left to MLflow);
    - sqlite:///PATH (and sqlite+DRIVER:///PATH): SQLAlchemy reads PATH relative to the working directory,
      sqlite:////ABS absolute; a relative PATH becomes sqlite:////ABS, its ?query kept. In memory (sqlite://,
      :memory:) and SQLite's own URI form (sqlite:///file:...) are left as they are;
    - http(s)://, databricks, databricks-uc, uc:, postgresql://, mysql://, ...: a server, left as it is.
    Resolved once, before any check: the value the driver checks is the one rank 0 opens and the run's record
    (raytrain.worker.tracking.RECORD) and raytrain.json show."""
    parsed = urllib.parse.urlparse(uri)
    if uri in DATABRICKS_NAMES:
        return uri
    if parsed.scheme == "" and not uri.startswith("/"):
        return os.path.abspath(os.path.expanduser(uri))
    if parsed.scheme == "file" and not parsed.netloc and not parsed.path.startswith("/"):
        path = urllib.request.url2pathname(parsed.path)
        return pathlib.Path(os.path.abspath(os.path.expanduser(path))).as_uri()
    sqlite = _SQLITE.fullmatch(uri)
    if sqlite:
        scheme, path, query = sqlite.groups()
        if path and not path.startswith("/") and path != ":memory:" and not path.startswith("file:"):
            return f"{scheme}:///{os.path.abspath(os.path.expanduser(path))}{query}"
    return uri


def check_tracking(cfg: RunConfig, fresh: bool = False) -> list[str]:
    """Use tracking.mlflow_tracking_uri from the driver as rank 0 will; returns the notes to print.

    Refused in one line each: mlflow not installed; a store MLflow cannot use (a server down, a wrong
    URI, a file store MLflow 3 refuses without MLFLOW_ALLOW_FILE_STORE=true, a sqlite:/// file that is not a
    database); a deleted tracking.mlflow_experiment (MLflow keeps a deleted experiment's name, and
    set_experiment refuses it); a run that continues (checkpoint.name exists, no --fresh) whose recorded MLflow run is
    deleted or not in the store; a database store without the full mlflow package. Reads the run's
    record; writes nothing (a store that does not exist yet is not opened: `_new_store_checked`)."""
    uri = cfg.tracking.mlflow_tracking_uri
    if not uri:
        return []
    try:
        import mlflow
    except ImportError:
        raise ConfigError(f'tracking.mlflow_tracking_uri={uri} needs MLflow, which is not installed here: '
                          f'pip install "raytrain[mlflow]" (or unset tracking.mlflow_tracking_uri)') from None
    _check_database_store(uri)
    run_uri, recorded = _recorded(cfg, fresh)
    same = same_mlflow_run(recorded, cfg.tracking)
    if _new_store_checked(uri):  # nothing in it yet: no experiment to be deleted, no run to continue
        experiment = run = None
    else:
        with environ_defaults(QUICK_HTTP):
            try:
                client = mlflow.MlflowClient(tracking_uri=uri)
                experiment = client.get_experiment_by_name(cfg.tracking.mlflow_experiment)
                run = _get_run(client, recorded["run_id"]) if same else None
            except Exception as e:  # MlflowException, requests' ConnectionError, OSError, ...
                raise ConfigError(_unusable(uri, e)) from None
    if experiment is not None and experiment.lifecycle_stage == "deleted":
        raise ConfigError(f"tracking.mlflow_experiment={cfg.tracking.mlflow_experiment} is a deleted experiment in "
                          f"{uri} (MLflow keeps its name until it is purged): restore it (mlflow experiments restore "
                          f"--experiment-id {experiment.experiment_id}) or choose another name")
    if recorded is None:
        return []
    name, run_id = cfg.checkpoint.name, recorded["run_id"]
    if not same:
        return [f"run {name!r} logged its earlier steps to MLflow run {run_id} (experiment "
                f"{recorded['experiment']} in {recorded['tracking_uri']}); with other tracking settings it "
                f"continues in a new MLflow run"]
    fix = f"or delete {run_uri}/{RECORD} to log the rest of the run to a new MLflow run"
    if run is None:
        raise ConfigError(f"run {name!r} continues MLflow run {run_id} ({RECORD} in its directory), which {uri} "
                          f"does not hold: set tracking.mlflow_tracking_uri to the store that holds it, {fix}")
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError(f"run {name!r} continues MLflow run {run_id}, which is deleted in {uri}: restore it "
                          f"(mlflow runs restore --run-id {run_id}), {fix}")
    return []


def tracking_env(cfg: RunConfig) -> dict[str, str]:
    """What `check_tracking` ran with that rank 0's tracker needs too. Workers inherit their cluster's
    environment, not the driver's: a driver started with MLFLOW_ALLOW_FILE_STORE=true (MLflow 3's
    opt-in to a file:// store) passed its check while rank 0, on a cluster started without it, raised
    at setup, and Ray Train retried that as a worker failure max_failures times. Ray Train merges these
    into its workers' runtime env (the job's working_dir and env vars stay)."""
    if cfg.tracking.mlflow_tracking_uri and "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        return {"MLFLOW_ALLOW_FILE_STORE": os.environ["MLFLOW_ALLOW_FILE_STORE"]}
    return {}


@contextlib.contextmanager
def mlflow_run_outcome(cfg: RunConfig, run_uri: str) -> Iterator[None]:
    """Around the driver's wait for the run (raytrain.driver.watch.run_trainer): where it raises, the run's MLflow
    run (its record in `run_uri`) still RUNNING is ended KILLED after Ctrl-C (`Interrupted`, KeyboardInterrupt),
    else FAILED (a bad record's stop, Ray Train's last worker failure), and the error goes on as it was.

    The driver's side, not rank 0's: a bad record or Ctrl-C stops the run by killing its workers (Ray Train's
    abort), so rank 0's `finally` never runs, and a worker process that dies (out of memory, a lost node) runs
    nothing either; the driver outlives them all and reads the MLflow run's id from the record rank 0 wrote
    when it opened it. A run that ended otherwise (rank 0 closed it FINISHED, or FAILED on its own exception)
    is left as it is."""
    try:
        yield
    except BaseException as e:
        status = "KILLED" if isinstance(e, (Interrupted, KeyboardInterrupt)) else "FAILED"
        note = end_mlflow_run(cfg, run_uri, status)
        if note:
            say(f"raytrain: note: {note}")
        raise


def end_mlflow_run(cfg: RunConfig, run_uri: str, status: str) -> str | None:
    """End the MLflow run that run `run_uri`'s record names with `status` where it is still RUNNING, and under
    these tracking settings (a record of other settings names a run this session did not log to). None where
    that is done or there is nothing to do; else a note saying why not (it never hides the run's own error):
    the store cannot be reached, tried as quickly as `check_tracking` tries it."""
    uri = cfg.tracking.mlflow_tracking_uri
    if not uri:
        return None
    try:
        recorded = (read_record(run_uri) or {}).get("mlflow")
    except (OSError, ValueError):  # storage that cannot be read now, a record cut short: no run id to name
        return None
    if not same_mlflow_run(recorded, cfg.tracking):
        return None
    run_id = recorded["run_id"]
    try:
        import mlflow

        with environ_defaults(QUICK_HTTP):
            client = mlflow.MlflowClient(tracking_uri=uri)
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status=status)
    except Exception as e:  # MlflowException, requests' ConnectionError, OSError, ...
        return f"MLflow run {run_id} in {uri} could not be ended {status} ({first_line(e)}): it shows RUNNING"
    return None


def _recorded(cfg: RunConfig, fresh: bool) -> tuple[str | None, dict | None]:
    """(the run's directory, its record's "mlflow" entry) for a run that continues; (None, None) for a
    new one: a generated name, or --fresh (which sets the directory aside with its record)."""
    name = cfg.checkpoint.name
    if name is None or fresh:
        return None, None
    run_uri = layout.run_uri(cfg.checkpoint.storage_path, name)
    try:
        record = read_record(run_uri)
    except (OSError, ValueError) as e:  # pyarrow (no network, no credentials), a record cut short (not JSON)
        raise ConfigError(f"{run_uri}/{RECORD}: cannot read it ({first_line(e)}): check the storage's credentials, "
                          f"or delete the file to log the rest of the run to a new MLflow run") from None
    return run_uri, (record or {}).get("mlflow")


def _get_run(client, run_id: str):
    """The MLflow run, or None where the store does not hold it (nor could: an id MLflow refuses, from a
    record edited by hand; its own "Invalid value" line said to fix the URI)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def _check_database_store(uri: str) -> None:
    """A database store (sqlite:///, postgresql://, ...) needs SQLAlchemy, which the full mlflow package brings and
    mlflow-skinny (what raytrain[mlflow] installs) does not: MLflow registers those schemes only where it can import
    it (mlflow/tracking/_tracking_service/utils.py, 3.18), and its own error names neither the package nor the fix."""
    from mlflow.store.db.db_types import DATABASE_ENGINES

    scheme = urllib.parse.urlparse(uri).scheme.partition("+")[0]  # postgresql+psycopg2:// is postgresql's
    if scheme in DATABASE_ENGINES and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(f"tracking.mlflow_tracking_uri={uri} is a database store, which needs the full mlflow "
                          f"package (raytrain[mlflow] installs mlflow-skinny, without database stores): pip install "
                          f"mlflow, or use a tracking server (http://HOST:5000)")


def _new_store_checked(uri: str) -> bool:
    """Whether `uri` is a local store that opening would create (a file store, a sqlite:/// database), checked on
    the filesystem instead of opened; False: a store to ask."""
    root = _unopened_file_store(uri)
    if root is not None:
        _check_new_file_store(uri, root)
        return True
    database = _unopened_sqlite_store(uri)
    if database is not None:
        _check_new_sqlite_store(uri, database)
        return True
    return False


DATABRICKS_NAMES = ("databricks", "databricks-uc", "uc")
"""MLflow's names of a Databricks workspace as a tracking URI: no scheme, yet not paths."""


def _unopened_file_store(uri: str) -> str | None:
    """The directory of a file store that opening would write to, else None. MLflow's FileStore creates its root
    directory, the Default experiment (0/meta.yaml) and .trash when it is opened (mlflow/store/tracking/
    file_store.py, 3.18), so opening a new one is how a dry run wrote a store; one that holds .trash is left as
    it is, and is asked as any other store."""
    if urllib.parse.urlparse(uri).scheme not in ("", "file") or uri in DATABRICKS_NAMES:
        return None
    from mlflow.utils.file_utils import local_file_uri_to_path

    root = local_file_uri_to_path(uri)
    return None if os.path.isdir(os.path.join(root, ".trash")) else root


def _check_new_file_store(uri: str, root: str) -> None:
    """What opening the file store at `root` would refuse, asked without creating it: MLflow 3's opt-in, and a
    directory that can be created (rank 0's tracker creates it)."""
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE

    if not MLFLOW_ALLOW_FILE_STORE.get():
        raise ConfigError(_file_store_opt_in(uri))
    check_writable_dir(root, "tracking.mlflow_tracking_uri", instead="a tracking server (http://HOST:5000)")


def _unopened_sqlite_store(uri: str) -> str | None:
    """The database file of a sqlite:/// store that opening would write to, else None. MLflow's SqlAlchemyStore
    creates the file's directories, the file, and its tables where the file lacks them when it opens the store
    (mlflow/store/db/utils.py, 3.18): opening a new one is how a dry run wrote a database. One that holds MLflow's
    tables is asked as any other store. Runs after `_check_database_store`: SQLAlchemy is there, and reads the
    path as MLflow has it read."""
    if urllib.parse.urlparse(uri).scheme.partition("+")[0] != "sqlite":
        return None
    from sqlalchemy.engine import make_url

    path = make_url(uri).database
    if not path or path == ":memory:" or path.startswith("file:"):
        return None  # in memory (no file), or SQLite's own URI form: asked as MLflow opens it
    return None if os.path.isfile(path) and _holds_mlflow_tables(uri, path) else path


def _holds_mlflow_tables(uri: str, path: str, lock_wait_s: float = 5.0) -> bool:
    """Whether the SQLite file `path` holds MLflow's experiments table, read through SQLite's read-only mode
    (Python's sqlite3: no journal, no tables created). A database another process holds locked for over
    `lock_wait_s` (SQLite's default wait) is taken for one: MLflow's own open asks it again. So is one that a writer
    killed mid-write (a run stopped while logging) left with a hot journal, which only a writer can roll back (the
    read-only mode says "attempt to write a readonly database"): MLflow's own open rolls it back."""
    import sqlite3

    read_only = f"{pathlib.Path(path).resolve().as_uri()}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(read_only, uri=True, timeout=lock_wait_s)) as db:
            table = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'experiments'")
            return table.fetchone() is not None
    except sqlite3.DatabaseError as e:  # not a database, unreadable (OperationalError is one), or locked
        if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "readonly" in str(e)):
            return True  # another process writes to it (a run logging), or one left a hot journal: asked as before
        raise ConfigError(f"tracking.mlflow_tracking_uri={uri}: {path} is not an SQLite database this driver can "
                          f"read ({e}): name a new file, or an MLflow database") from None


def _check_new_sqlite_store(uri: str, path: str) -> None:
    """What opening the new database `path` would fail on, asked without creating it: a directory in its place,
    a file (empty, or another program's database, where MLflow adds its tables) that cannot be written, a
    directory that cannot be created or written (MLflow creates the missing ones)."""
    if os.path.isdir(path):
        raise ConfigError(f"tracking.mlflow_tracking_uri={uri}: {path} is a directory, not a database file: name a "
                          f"file in it (sqlite:///{os.path.join(path, 'mlflow.db')})")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"tracking.mlflow_tracking_uri={uri}: {path} is not writable: choose a writable file "
                              f"or a tracking server (http://HOST:5000)")
        return
    check_writable_dir(os.path.dirname(os.path.abspath(path)), "tracking.mlflow_tracking_uri",
                       instead="a tracking server (http://HOST:5000)")


def _file_store_opt_in(uri: str) -> str:
    return (f"tracking.mlflow_tracking_uri={uri} is a file store, which MLflow 3 uses only where the "
            f"environment sets MLFLOW_ALLOW_FILE_STORE=true: set it for the driver (raytrain passes it on to "
            f"the workers), or use a tracking server or a database store (sqlite:///PATH/mlflow.db, with the "
            f"full mlflow package)")


def _unusable(uri: str, error: Exception) -> str:
    if "MLFLOW_ALLOW_FILE_STORE" in str(error):  # MLflow 3's file store refusal: its hint, whole and short
        return _file_store_opt_in(uri)
    return (f"tracking.mlflow_tracking_uri={uri}: MLflow cannot use it ({first_line(error)}): start the server, "
            f"fix the URI, or unset it")
