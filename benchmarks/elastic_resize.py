"""Elastic resize timings: how long an elastic run (scaling.num_workers: [2, 3]) takes from a node's
loss to training again on the workers left, and from a node's return to training on it.

    python benchmarks/elastic_resize.py                                   # T=0 (shrink at once), 10 s resize checks
    python benchmarks/elastic_resize.py --replacement-timeout-s 20 --resize-interval-s 60 --repeat 2

The cluster and the run are tests/integration/test_elastic.py's (imported from it): a head of 4 CPUs
(driver, Ray Train's controller, Ray Data) and 3 worker nodes of 1 CPU and one Train worker slot
each, every node a `ray start --block` process of its own on this machine; the built-in 2-layer
Llama (32-token rows, ZeRO-3 fp32 on CPU/gloo), a checkpoint every 2 steps. A node's raylet is
SIGKILLed (a dead host: no drain notice) once the 3 workers have checkpointed, a new node is started
once the 2 workers have checkpointed past the restart, then the run is stopped with Ctrl-C and the
cluster by pid. Times are wall-clock from the kill / the new node's `ray start` to the first step
that every rank of the new group finished (data.sample_log's per-step records, written by the
workers), on this machine's clock; a step is ~0.1 s here, so the numbers are restart costs.

Prints one JSON object per repeat and their summary; nothing is asserted (tests assert behaviour,
benchmarks measure). Ports: as the test's (RAYTRAIN_TEST_ELASTIC_PORT, RAYTRAIN_TEST_ELASTIC_AGENT_PORT).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "token")

from tests.integration.test_elastic import Cluster, groups, registered_step, run, wait_for  # noqa: E402


def once(root: Path, timeout_s: float, interval_s: float, every: int) -> dict:
    cluster = Cluster(root, quick_node_death=False)  # Ray's own node-death detection, as in production
    marks: dict[str, float] = {}
    try:
        cluster.start(workers=3)
        env = {**os.environ, "RAY_ADDRESS": cluster_address(), "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
        # long enough never to end by itself: stopped below
        proc = run(env, root, "elastic", "training.max_steps=100000", "scaling.num_workers=[2, 3]",
                   f"scaling.replacement_timeout_s={timeout_s}", f"scaling.resize_interval_s={interval_s}",
                   f"checkpoint.every_n_steps={every}", "checkpoint.max_failures=3")
        run_dir = root / "runs" / "elastic"
        first = wait_for(lambda: [g for g in groups(run_dir) if g["world_size"] == 3 and g["steps"]],
                         "training on 3 workers", proc, timeout=900)[0]
        wait_for(lambda: registered_step(run_dir) >= min(first["steps"]) + 2 * every, "checkpoints on 3 workers",
                 proc)
        marks["lost"] = cluster.kill(cluster.alive_slots()[-1])
        two = wait_for(lambda: [g for g in groups(run_dir) if g["world_size"] == 2 and g["steps"]],
                       "training on 2 workers", proc)[0]
        marks["training_on_2"] = min(s["t"] for s in two["steps"].values())
        wait_for(lambda: registered_step(run_dir) >= min(two["steps"]) + every, "a checkpoint on 2 workers", proc,
                 every_s=0.1)
        marks["returned"] = cluster.add()
        three = wait_for(lambda: [g for g in groups(run_dir) if g["world_size"] == 3 and g["steps"]
                                  and g["name"] > two["name"]], "training on 3 workers again", proc)[0]
        marks["training_on_3"] = min(s["t"] for s in three["steps"].values())
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: raytrain aborts the run through Ray Train
        try:
            proc.wait(timeout=120)
        except Exception:  # noqa: BLE001
            proc.kill()
    finally:
        cluster.stop()
    by_name = {g["name"]: g for g in groups(run_dir)}
    # the steps the 2 workers trained after the checkpoint the grow resumed from (discarded, redone)
    redone = max(by_name[two["name"]]["steps"]) - min(by_name[three["name"]]["steps"]) + 1
    log = (root / "elastic.log").read_text()
    conversions = [float(s) for s in re.findall(r"converted in ([0-9.]+) s", log)]
    return {"loss_to_training_s": round(marks["training_on_2"] - marks["lost"], 1),
            "return_to_training_s": round(marks["training_on_3"] - marks["returned"], 1),
            "conversions_s": conversions, "steps_redone_by_the_grow": max(redone, 0),
            "sizes": [g["world_size"] for g in groups(run_dir)]}


def cluster_address() -> str:
    from tests.integration.test_elastic import ADDRESS

    return ADDRESS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replacement-timeout-s", type=float, default=0.0)
    parser.add_argument("--resize-interval-s", type=float, default=10.0)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    import ray
    import deepspeed
    import torch

    print(json.dumps({"ray": ray.__version__, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "cpus": os.cpu_count(), "replacement_timeout_s": args.replacement_timeout_s,
                      "resize_interval_s": args.resize_interval_s}), flush=True)
    results = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="raytrain-elastic-bench-") as tmp:
            started = time.time()
            result = once(Path(tmp), args.replacement_timeout_s, args.resize_interval_s, args.checkpoint_every)
            result["wall_s"] = round(time.time() - started, 1)
            results.append(result)
            print(json.dumps(result), flush=True)
    for key in ("loss_to_training_s", "return_to_training_s"):
        values = [r[key] for r in results]
        print(f"{key}: min {min(values)} max {max(values)} over {len(values)} run(s)")


if __name__ == "__main__":
    main()
