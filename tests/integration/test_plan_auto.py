"""The real run chooses "auto" settings on the driver with the same code as `--dry-run`: `python -m
raytrain.main` on a real local Ray cluster (CPU, gloo, the built-in model) prints the planner's
line before the workers start, and the workers train with the micro-batch it chose."""

import json
import os
import re
import subprocess
import sys

import pytest

from raytrain.config import load_config
from raytrain.driver.run import dry_run

pytestmark = pytest.mark.integration


def test_auto_micro_batch_is_chosen_on_the_driver_and_trained_with(ray_cluster, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    # A fixed global batch of 32 rows bounds the search (micro-batch x accumulation x 2 workers = 32): on
    # CPU the planner takes the largest micro-batch that fits host RAM, which unbounded is its cap of 128
    # (2 steps of 2 x 128 rows; alone the test took 31 s with this bound, its time in the suite barely moved).
    common = ["training.micro_batch_size_per_gpu=auto", "deepspeed.train_batch_size=32", "scaling.num_workers=2",
              "scaling.cpus_per_worker=0.5", "data.seq_len=64", "data.num_builtin_documents=40"]  # ~200 rows
    resolved, notes = dry_run(load_config(None, common))  # in-process: no Ray involved
    micro = resolved.deepspeed.micro_batch_per_gpu
    assert micro == 16  # the largest of 1, 2, 4, 8, 16 (each with its accumulation to 32 rows): all fit
    assert notes[0].startswith(f"plan: chose micro-batch {micro}, ")
    p = subprocess.run([sys.executable, "-m", "raytrain.main", *common, "training.max_steps=2",
                        "training.log_every_n_steps=1", f"checkpoint.storage_path={tmp_path}", "checkpoint.name=auto",
                        "data.progress_every_s=0", "tracking.tensorboard=false"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    plan = [line for line in p.stdout.splitlines() if line.startswith("raytrain: plan: ")]
    assert len(plan) == 1 and plan[0].startswith(f"raytrain: plan: chose micro-batch {micro}, "), plan
    # the plan line comes before anything a worker prints
    assert p.stdout.index(plan[0]) < (p.stdout + p.stderr).find("step 1/2")
    spec = json.loads(next(tmp_path.glob("auto/checkpoint_*/raytrain.json")).read_text())["spec"]
    assert spec["deepspeed"]["micro_batch_per_gpu"] == micro and spec["plan"] == [plan[0][len("raytrain: plan: "):]]
    tokens = [int(m.group(1).replace(",", "")) for m in re.finditer(r"tok/s ([\d,]+)", p.stdout + p.stderr)]
    assert tokens  # it trained
