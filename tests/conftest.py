"""Shared fixtures. One real local Ray cluster (`ray start --head`, as a user would start it) serves
every integration test of the session; unit tests never touch Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

RAY_PORT = int(os.environ.get("RAYTRAIN_TEST_RAY_PORT", "6390"))
DASHBOARD_PORT = int(os.environ.get("RAYTRAIN_TEST_DASHBOARD_PORT", "8290"))
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="session")
def ray_cluster():
    """Address info of a local head node with 4 logical CPUs: 2 training workers + Ray Data.

    Token authentication stays on (Ray 2.60's default): the head writes ~/.ray/auth_token and
    clients on this machine read it, as they would on a user's machine.
    """
    import ray

    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([RAY_BIN, "start", "--head", f"--port={RAY_PORT}", "--num-cpus=4", "--num-gpus=0",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True)
    address = f"127.0.0.1:{RAY_PORT}"
    os.environ["RAY_AUTH_MODE"] = "token"
    ray.init(address=address)
    try:
        yield {"address": address, "dashboard": f"http://127.0.0.1:{DASHBOARD_PORT}"}
    finally:
        ray.shutdown()
        subprocess.run([RAY_BIN, "stop", "--force"], capture_output=True, env=env)
        time.sleep(1)


@pytest.fixture
def subprocess_env(ray_cluster):
    """Environment for a child process that should join the test cluster (RAY_ADDRESS, token auth)."""
    return {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token",
            "PYTHONUNBUFFERED": "1"}
