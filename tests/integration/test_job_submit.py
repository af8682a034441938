"""`ray job submit` as a user runs it, against a `ray start --head` cluster with token auth:
the upload leaves out checkpoints, data and virtualenvs; progress streams to `ray job logs`; a
job that is stopped lets go of its run and leaves its latest checkpoint for the same command to continue
from; the same job submitted while it trains is refused."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import registered_step, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A copy of the project as a user's checkout, plus what must never be uploaded."""
    root = tmp_path_factory.mktemp("checkout") / "raytrain"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, root / f)
    for junk in (".venv/lib/big.bin", "runs/old/checkpoint.pt", "data/corpus.parquet"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_bytes(b"x" * 1024)
    return root


def job(ray_cluster, *args, check=True, timeout=600):
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_API_SERVER_ADDRESS": ray_cluster["dashboard"]}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([RAY, "job", *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert not check or p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def submit(ray_cluster, workdir, *cmd):
    # A freshly started head answers "No available agent to submit job" until its job agent is up.
    for _ in range(60):
        out = job(ray_cluster, "submit", "--no-wait", "--working-dir", str(workdir), "--", *cmd, check=False)
        if "No available agent" not in out:
            break
        time.sleep(2)
    found = re.search(r"raysubmit_\w+", out)
    assert found, out[-3000:]
    return found.group(0)


# Each `ray job status` is a Python process of ~1.5 CPU-seconds: on 2 cores, polling it takes a core
# from the job being watched. So the waits ask the job API over HTTP from this process (the SDK that
# `ray job status` itself calls), every 2 s; submit, stop and logs stay the CLI a user types.
POLL_S = 2


def status_of(ray_cluster, job_id) -> str:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(ray_cluster["dashboard"]).get_job_status(job_id).value.lower()  # "running", "stopped", ...


def wait_status(ray_cluster, job_id, wanted, timeout=600):
    """Wait until the job reaches one of `wanted`; fail at once when it ends in another state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = status_of(ray_cluster, job_id)
        if status in wanted:
            return status
        if status in ("succeeded", "stopped", "failed"):
            raise AssertionError(f"job {job_id} ended as {status!r}, not {wanted}: "
                                 f"{job(ray_cluster, 'logs', job_id)[-3000:]}")
        time.sleep(POLL_S)
    raise AssertionError(f"job {job_id} never reached {wanted}: {status}")


def test_upload_leaves_out_checkpoints_data_and_virtualenvs(ray_cluster, workdir):
    job_id = submit(ray_cluster, workdir, sys.executable, "-c",
                    "import os; print('FILES', sorted(os.path.join(d, f) for d, _, fs in os.walk('.') for f in fs))")
    wait_status(ray_cluster, job_id, ["succeeded"])
    logs = job(ray_cluster, "logs", job_id)
    files = next(line for line in logs.splitlines() if line.startswith("FILES"))  # not the entrypoint echo
    # the whole package, every subpackage (an unanchored "data/" in .rayignore once left out raytrain/data/:
    # the job then imported it from the installed copy, silently, or failed without one)
    package = subprocess.run(["git", "ls-files", "raytrain"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assert package and [f for f in package if f"./{f}'" not in files] == [], files
    assert "cluster/ib.yaml" in files
    for junk in (".venv", "runs/old", "data/corpus.parquet"):
        assert junk not in files, junk


def test_stopped_job_leaves_its_run_for_the_same_command_to_continue(ray_cluster, workdir, tmp_path):
    # sys.executable: the cluster's Python (what `python` means on a real head node's PATH)
    cmd = [sys.executable, "-m", "raytrain.main", "training.max_steps=25", "checkpoint.every_n_steps=5",
           f"checkpoint.storage_path={tmp_path}", "checkpoint.name=submitted", "data.num_builtin_documents=400",
           "data.progress_every_s=1"]
    first = submit(ray_cluster, workdir, *cmd)
    # the same job submitted again while the first trains: refused before Ray, naming the job that holds the run
    deadline = time.time() + 600
    while not (tmp_path / ".raytrain-live" / "submitted.json").exists():
        assert time.time() < deadline and status_of(ray_cluster, first) in ("running", "pending"), \
            job(ray_cluster, "logs", first)[-3000:]
        time.sleep(0.5)
    rival = submit(ray_cluster, workdir, *cmd)
    wait_status(ray_cluster, rival, ["failed"])
    said = job(ray_cluster, "logs", rival)
    assert re.search(rf"^raytrain: error: run 'submitted' in {tmp_path} is in progress: its driver \(pid \d+ on "
                     rf"\S+, Ray job {first}, started .*\(`ray job stop {first}`\)", said, re.M), said[-3000:]
    # stopped once Ray Train has registered step 10 (the checkpoint a rerun continues from), not when
    # its files appear: they reach storage before the controller registers them (seen on a fast machine:
    # stopped in between, a resubmitted job rightly continued from step 5)
    deadline, polled = time.time() + 600, 0.0
    while (registered_step(str(tmp_path / "submitted")) or 0) < 10:
        if time.time() - polled > POLL_S:
            polled = time.time()
            status = status_of(ray_cluster, first)
            assert status in ("running", "pending"), job(ray_cluster, "logs", first)[-3000:]  # ended early
        assert time.time() < deadline, job(ray_cluster, "logs", first)[-3000:]
        time.sleep(0.5)
    job(ray_cluster, "stop", first)
    wait_status(ray_cluster, first, ["stopped", "failed"])
    logs = job(ray_cluster, "logs", first)
    # What a user watching `ray job logs` sees (the feature itself, so read from the logs): rank 0's
    # progress lines, forwarded from a live worker ...
    assert re.search(r"step 10/25  loss [\d.]+", logs), logs[-3000:]
    # and so do the driver's tokenization progress lines, of any pass: the counts come in whole tokenize
    # batches (400 documents are two), so under load the driver's first reading can come after pass 1.
    # Session 39's first .ci/run found no pass-1 line (the log's head was not kept: the cause is inferred).
    assert re.search(r"^raytrain: data: pass \d+: \S+ documents of 400 documents \(\d+%\), ", logs, re.M), logs[-3000:]

    assert "Reporting training result" not in logs  # Ray's per-report INFO line, silenced by the worker

    # The same job submitted again continues from its latest checkpoint: the stopped job let go of the run
    # (no live driver holds it), and the run's command names it with the step it stopped at. The continuing
    # itself is the driver's, the same with or without a job: the quick start's printed command
    # (test_quickstart.py) and the object-storage file's second run continue for real. Not submitted here:
    # that second job was ~45 s of this file's time (docs/status.md #16, session 68).
    from raytrain.checkpoint import layout
    from raytrain.config import load_config
    from raytrain.driver import live
    from raytrain.driver.run import resume_checkpoint

    wait_until(lambda: live.live_driver(str(tmp_path), "submitted") is None, 60, "the stopped job's driver to let go")
    latest, own = resume_checkpoint(load_config(None, cmd[3:]), str(tmp_path), "submitted", fresh=False)
    meta = layout.read_metadata(latest)
    assert own and meta["step"] >= 10 and meta["step"] % 5 == 0, (latest, own, meta["step"])
    assert [m["step"] for m in meta["history"]] == list(range(5, meta["step"] + 1, 5))  # whole, to where it stopped
