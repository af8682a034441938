"""Shared fixtures. One real local Ray cluster (`ray start --head`, as a user would start it) serves
every integration test of the session; unit tests never touch Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One OpenMP/MKL thread per process: the pytest processes and every process they start (DeepSpeed
# ranks, command lines, Ray clusters, which pass it on to their workers; Ray gives its workers one
# thread per CPU they hold anyway). The suite runs two pytest processes on 2 cores, each starting
# clusters and ranks of its own: with torch's default of a thread per core, every such process's
# threads competed for the same 2 cores, OpenMP's idle threads spinning while they waited. Measured
# on 2 cores, tests/unit/checkpoint/test_universal.py and tests/unit/worker/test_loop.py alone:
# 73.7 s and 120.6 CPU-s with the default, 52.5 s and 77.7 CPU-s with this. Set before anything
# imports torch (it reads the variable once); an OMP_NUM_THREADS already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The polling of every test cluster's own daemons, slowed (the clusters the tests start inherit this
# environment: the session heads, the elastic, autoscaler and multi-host clusters, the quick start's
# own). Ray's log monitor globs the log directory for new files 10 times a second while there are
# fewer than 1,000; here every 0.5 s (what Ray itself does above 1,000), so a new worker's first lines
# reach its driver up to 0.5 s later. Its open-file limit stays Ray's: at the limit it closes every
# file and moves dead workers' files out without a last read, so a lower one would lose the last lines
# of workers that die. The dashboard records its own processes' CPU and memory (psutil's smaps reads)
# every 5 s and its agent the node's every 5 s; here every 60 and 20 s (the dashboard's own metrics
# and node graphs; the state and job APIs the tests use answer as before). Measured (session 43): two
# heads as ray_cluster below starts them, each after the same two 12-step runs, then 3 minutes idle:
# 18.6 CPU-s with Ray's defaults, 14.7 with these; in that session's suite the two session heads' log
# monitors alone took 118 and 87 CPU-s.
# Ray's usage statistics off (the session heads already start with --disable-usage-stats; this reaches
# the pytest processes and every driver they start): with them on, each process that runs Ray Data
# keeps a thread that asks Prometheus (none here) for cluster counters every 10 s and logs each failure
# with its traceback, and Python 3.11's traceback module ast-parses source lines, which raced an
# ast.parse in the test's own thread (one .ci/run failed with "AST constructor recursion depth
# mismatch", tests/unit/test_layering.py). The quick start test gives its run a user's default back.
for _name, _value in {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "METRICS_RECORD_INTERVAL_S": "60",
                      "REPORTER_UPDATE_INTERVAL_MS": "20000", "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402

from tests.helpers import alive_nodes, stop_tree  # noqa: E402

# Ray reads the auth mode once, when it is imported: set it before any test module imports ray.
os.environ["RAY_AUTH_MODE"] = "token"
# A suite started in the background by a script (`cmd &` without job control) inherits SIGINT
# ignored, and so would every run it starts: the tests' Ctrl-C (quick start, elastic) would land
# nowhere and the run train on (seen: 300 s, then a timeout). Handled here, the runs start with
# SIGINT at its default again (exec keeps only ignored dispositions).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# README's test command runs the suite in two pytest-xdist processes (gw0, gw1): each has a Ray
# cluster of its own, on ports of its own (every port a test derives from RAY_PORT moves with it).
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
RAY_PORT = int(os.environ.get("RAYTRAIN_TEST_RAY_PORT", 6390 + 1000 * WORKER))
DASHBOARD_PORT = int(os.environ.get("RAYTRAIN_TEST_DASHBOARD_PORT", 8290 + 1000 * WORKER))
# The job agent's HTTP port (`ray job submit` goes through it), off Ray's fixed default 52365 so it
# never collides with another cluster on the machine ("No available agent to submit job"), and below
# Linux's ephemeral range (32768-60999): at 53400 it once found the port taken by some process's
# outgoing connection, the agent never started and both job tests timed out (session 34's CI run).
AGENT_PORT = int(os.environ.get("RAYTRAIN_TEST_AGENT_PORT", RAY_PORT + 90))  # elastic takes +10 and its nodes +40.., the fake autoscaler +70
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")

# The slowest files first (seconds with the suite in two processes on 2 cores: `--durations=0` of a
# whole `.ci/run`, session 24, after that session's cuts), the rest in their own order after them.
# With two xdist processes taking whole files (`--dist loadfile --no-loadscope-reorder`), each takes
# the next file when it is free: longest first makes both end together instead of one finishing a
# 7-minute file alone at the end. A file missing here still runs.
SLOW_FIRST = [
    "tests/integration/test_fault_tolerance.py",  # ~280-310 s (session 68's VM)
    "tests/integration/test_elastic.py",  # ~280 s
    "tests/integration/test_quickstart.py",  # ~220 s
    "tests/integration/test_job_submit.py",  # ~70 s (one job of raytrain.main since session 68)
    "tests/integration/test_train_e2e.py",  # ~190 s
    "tests/integration/test_multihost_netns.py",  # ~180 s
    "tests/integration/test_notebook.py",  # ~165 s
    "tests/integration/test_user_path.py",  # ~155 s
    "tests/integration/test_autoscaler.py",  # ~115 s
    "tests/integration/test_object_storage.py",  # ~100 s alone (one run, S3 through moto's server)
    "tests/integration/test_zero3_knobs.py",  # ~100 s (~300 s on a new machine: DeepSpeed's CPU ops built)
    "tests/integration/test_bench_data.py",  # ~85 s
    "tests/unit/tools/test_bench.py",  # ~70 s
    "tests/unit/checkpoint/test_universal.py",  # ~70 s
    "tests/unit/worker/test_loop.py",  # ~60 s
    "tests/integration/test_preflight_cluster.py",  # ~45 s
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))  # stable: ties keep their order


@pytest.fixture(scope="session", autouse=True)
def ray_auth_token():
    """~/.ray/auth_token, made as a user makes it: `ray start --head` (here and in tests that start
    their own heads) refuses to start without a token, and a fresh machine has none yet. Idempotent:
    an existing token is kept, and where its file is there no process starts (`ray get-auth-token` takes 2-10 s
    to start: a mutation run, benchmarks/mutate.py, paid it per mutant)."""
    if Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser().is_file():
        return
    subprocess.run([RAY_BIN, "get-auth-token", "--generate"], env={**os.environ, "RAY_AUTH_MODE": "token"},
                   check=True, capture_output=True)


@pytest.fixture(scope="session")
def ray_cluster(ray_auth_token, tmp_path_factory):
    """Address info of a local head node with 4 logical CPUs: 2 training workers + Ray Data.

    The cluster's processes get their own TMPDIR (short: Ray's unix sockets live under it), so Ray's
    session directory and the workers' temporary checkpoint directories belong to this cluster alone,
    whatever else runs on the machine. Token authentication stays on (Ray 2.60's default).
    """
    import ray

    tmpdir = tempfile.mkdtemp(prefix=f"rt{RAY_PORT}-", dir="/tmp")
    log_path = tmp_path_factory.mktemp("ray-head") / "head.log"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "TMPDIR": tmpdir}
    # Workers inherit the cluster's environment, and MLflow 3 keeps its file store behind
    # MLFLOW_ALLOW_FILE_STORE: the cluster is started without it, as a user's would be, and the run
    # that sets it on its driver only (tests/integration/test_train_e2e.py) finds it on rank 0.
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    # --block keeps the head in the foreground: stopping this one process stops this cluster only
    # (`ray stop` would kill every Ray process on the machine). Its output goes to a file: a pipe
    # nobody reads fills up and blocks the head.
    with open(log_path, "w") as log:
        head = subprocess.Popen([RAY_BIN, "start", "--head", "--block", f"--port={RAY_PORT}", f"--ray-client-server-port={RAY_PORT + 1}", "--num-cpus=4",
                                 "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={DASHBOARD_PORT}", f"--dashboard-agent-listen-port={AGENT_PORT}",
                                 "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{RAY_PORT}"
    deadline = time.time() + 120
    while not alive_nodes(address):
        if head.poll() is not None or time.time() > deadline:
            head.kill()
            pytest.fail(f"ray start --head failed: {log_path.read_text()[-2000:]}")
        time.sleep(1)
    if head.poll() is not None:  # the port answered, but it is someone else's cluster
        pytest.fail(f"ray start --head failed (port {RAY_PORT} taken? set RAYTRAIN_TEST_RAY_PORT): "
                    f"{log_path.read_text()[-2000:]}")
    ray.init(address=address)
    try:
        yield {"address": address, "dashboard": f"http://127.0.0.1:{DASHBOARD_PORT}", "tmpdir": tmpdir}
    finally:
        ray.shutdown()
        stop_tree(head)


@pytest.fixture(scope="module")
def no_ray_driver():
    """For tests that call a command line's main() in-process and assert it never calls ray.init: in a
    whole-suite run the session's cluster fixture has connected this process already. Disconnects
    the driver (the cluster keeps running) for the module, and connects it again afterwards."""
    import ray

    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if address:
        ray.shutdown()
    yield
    if address:
        ray.init(address=address)


@pytest.fixture
def subprocess_env(ray_cluster):
    """Environment for a child process that should join the test cluster (RAY_ADDRESS, token auth)."""
    return {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token",
            "PYTHONUNBUFFERED": "1"}
