"""Shared fixtures. One real local Ray cluster (`ray start --head`, as a user would start it) serves
every integration test of the session; unit tests never touch Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.helpers import stop_tree

# Ray reads the auth mode once, when it is imported: set it before any test module imports ray.
os.environ["RAY_AUTH_MODE"] = "token"
# A suite started in the background by a script (`cmd &` without job control) inherits SIGINT
# ignored, and so would every run it starts: the tests' Ctrl-C (quick start, elastic) would land
# nowhere and the run train on (seen: 300 s, then a timeout). Handled here, the runs start with
# SIGINT at its default again (exec keeps only ignored dispositions).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

RAY_PORT = int(os.environ.get("RAYTRAIN_TEST_RAY_PORT", "6390"))
DASHBOARD_PORT = int(os.environ.get("RAYTRAIN_TEST_DASHBOARD_PORT", "8290"))
# The job agent's HTTP port (`ray job submit` goes through it), off Ray's fixed default 52365 so it
# never collides with another cluster on the machine ("No available agent to submit job").
AGENT_PORT = int(os.environ.get("RAYTRAIN_TEST_AGENT_PORT", 52400 + (RAY_PORT - 6390) % 10000))  # a valid port for any RAY_PORT
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="session", autouse=True)
def ray_auth_token():
    """~/.ray/auth_token, made as a user makes it: `ray start --head` (here and in tests that start
    their own heads) refuses to start without a token, and a fresh machine has none yet. Idempotent:
    an existing token is kept."""
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
    # MLFLOW_ALLOW_FILE_STORE: workers inherit the cluster's environment, and MLflow 3 keeps the file
    # store (the local one that needs no server, tests/integration/test_train_e2e.py) behind it.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "TMPDIR": tmpdir, "MLFLOW_ALLOW_FILE_STORE": "true"}
    # --block keeps the head in the foreground: stopping this one process stops this cluster only
    # (`ray stop` would kill every Ray process on the machine). Its output goes to a file: a pipe
    # nobody reads fills up and blocks the head.
    with open(log_path, "w") as log:
        head = subprocess.Popen([RAY_BIN, "start", "--head", "--block", f"--port={RAY_PORT}", "--num-cpus=4",
                                 "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={DASHBOARD_PORT}", f"--dashboard-agent-listen-port={AGENT_PORT}",
                                 "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{RAY_PORT}"
    deadline = time.time() + 120
    while subprocess.run([RAY_BIN, "status", f"--address={address}"], env=env, capture_output=True).returncode:
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


@pytest.fixture
def subprocess_env(ray_cluster):
    """Environment for a child process that should join the test cluster (RAY_ADDRESS, token auth)."""
    return {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token",
            "PYTHONUNBUFFERED": "1"}
