"""A real autoscaling cluster on one machine: Ray's fake multi-node provider with
cluster/fake-multinode.yaml adds worker nodes when a raytrain run asks for more than the head
holds, and the run finishes."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import RAY_PORT
from tests.helpers import alive_nodes, stop_tree

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PORT = int(os.environ.get("RAYTRAIN_TEST_FAKE_PORT", RAY_PORT + 70))


def test_fake_autoscaler_adds_nodes_and_the_run_finishes(tmp_path):
    ip = socket.gethostbyname(socket.gethostname())
    cluster = yaml.safe_load((REPO / "cluster" / "fake-multinode.yaml").read_text())
    cluster["provider"]["gcs_address"] = f"{ip}:{PORT}"  # the shipped file assumes the default 6379
    config = tmp_path / "fake.yaml"
    config.write_text(yaml.safe_dump(cluster))
    marker = f"{os.getpid()}-{time.time_ns()}"  # inherited by every process of this fake cluster
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "token", "RAYTRAIN_TEST_FAKE_CLUSTER": marker}
    env.pop("RAY_ADDRESS", None)
    log_path = tmp_path / "head.log"  # a file, not a pipe nobody reads: a full pipe would block the head
    with open(log_path, "w") as log:
        head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={PORT}", f"--ray-client-server-port={PORT + 1}", "--num-cpus=2", "--num-gpus=0",
                                 f"--autoscaling-config={config}", "--include-dashboard=false", "--disable-usage-stats"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = f"{ip}:{PORT}"
        deadline = time.time() + 120
        while not alive_nodes(address):
            assert head.poll() is None and time.time() < deadline, log_path.read_text()[-2000:]
            time.sleep(1)
        # 2 workers x 1.5 CPUs cannot fit on the 2-CPU head: Ray Train's request makes the
        # autoscaler launch fake worker nodes (2 CPUs each).
        run = subprocess.run([sys.executable, "-m", "raytrain.main", "scaling.num_workers=2",
                              "scaling.cpus_per_worker=1.5", "training.max_steps=6", "training.log_every_n_steps=2",
                              "data.num_builtin_documents=200", f"checkpoint.storage_path={tmp_path / 'runs'}",
                              "checkpoint.name=autoscaled"],
                             env={**env, "RAY_ADDRESS": address}, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "raytrain: done at step 6" in run.stdout
        status = subprocess.run([RAY, "status", f"--address={address}"], env=env, capture_output=True, text=True).stdout
        assert "ray.worker.cpu" in status, status  # the autoscaler launched worker nodes
    finally:
        stop_tree(head)  # all at once: the head's own graceful stop takes ~30 s, one process after another
        # The fake provider's worker nodes (raylets and their agents) are not children of the head
        # and outlive it: stop every process that carries this cluster's marker.
        _kill_marked(marker)


def _kill_marked(marker: str) -> None:
    needle = f"RAYTRAIN_TEST_FAKE_CLUSTER={marker}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and int(pid) != os.getpid():
                    os.kill(int(pid), 9)
        except (OSError, ValueError):
            pass
