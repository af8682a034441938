"""raytrain.network.preflight on a real local Ray cluster: 2 actors, gloo on CPU, real collectives.

Run: RAYTRAIN_TEST_RAY_PORT=6440 RAYTRAIN_TEST_DASHBOARD_PORT=8440 \
     /work/venv/bin/python -m pytest tests/integration/test_preflight.py -x -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from raytrain.config import NETWORK_ENV_PREFIXES, ConfigError, NetworkConfig, load_config
from raytrain.driver.cluster import preflight_cluster
from raytrain.network.preflight import PreflightWorker, _collect_nccl_logs, run_preflight
from raytrain.network.preflight_report import INTRA, OPS, NodeFacts

pytestmark = pytest.mark.integration

ROW = re.compile(r"^\s+(\d+ [KMG]iB)((?:\s+[\d.]+){9})\s*$")


def test_preflight_measures_every_collective_on_gloo(ray_cluster):
    import ray

    lines: list[str] = []
    report = run_preflight(NetworkConfig(), num_workers=2, use_gpu=False, sizes=[1 << 20, 4 << 20], iters=3,
                           warmup_iters=1, timeout_s=120, progress=lines.append)
    assert report.passed, report.render()
    assert [n.num_ranks for n in report.nodes] == [2]
    assert report.nodes[0].node_ip == ray.util.get_node_ip_address()
    # The node's NCCL/Gloo plan reached the workers (Gloo's interface at least, where one is found).
    assert all(k.startswith(NETWORK_ENV_PREFIXES) for k in report.nodes[0].env)

    got = {(m.op, m.size_bytes): m for m in report.measurements}
    assert set(got) == {(op, s) for op in OPS for s in (1 << 20, 4 << 20)}
    for m in report.measurements:
        assert (m.phase, m.group, m.num_ranks) == (INTRA, f"node {report.nodes[0].node_ip}", 2)
        assert m.time_s > 0 and m.algbw_gbs > 0
        assert m.busbw_gbs == pytest.approx(m.algbw_gbs * (1.0 if m.op == "all_reduce" else 0.5))

    # One progress line per measurement, with a rate and an ETA.
    steps = [line for line in lines if line.startswith("preflight [")]
    assert len(steps) == 6 and all(re.search(r"meas/s  eta \d+:\d\d:\d\d$", s) for s in steps)

    text = report.render()
    rows = [ROW.match(line) for line in text.splitlines()]
    rows = [r for r in rows if r]
    assert [r.group(1) for r in rows] == ["1 MiB", "4 MiB"]
    for r in rows:
        numbers = [float(x) for x in r.group(2).split()]  # time_us algbw busbw, for each collective
        assert all(x > 0 for x in numbers)
    assert text.splitlines()[-1].startswith("preflight: PASS (1 node(s), 2 rank(s), gloo)")
    # Placement group and actors are released (asynchronously): the cluster's CPUs come back.
    deadline = time.time() + 60
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(1)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def test_preflight_places_its_workers_as_the_run_would(ray_cluster, monkeypatch):
    """scaling.placement_strategy and scaling.accelerator_type reach the preflight's placement group (here
    neither can be placed: one node, no accelerator type), and a placement the cluster can never make is
    refused at once, as a run refuses it."""
    from tests.integration.test_driver_checks import wait_until_known_fixed

    for option, text in [({"placement_strategy": "STRICT_SPREAD"}, "(STRICT_SPREAD)"),
                         ({"accelerator_type": "H200"}, "'accelerator_type:H200': 0.001")]:
        report = run_preflight(NetworkConfig(), num_workers=2, use_gpu=False, sizes=[1 << 20], iters=1, warmup_iters=0,
                               timeout_s=1, progress=lambda _: None, **option)
        assert any(text in failure and "cannot place 2 workers" in failure for failure in report.failures), \
            report.failures
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    wait_until_known_fixed()
    with pytest.raises(ConfigError, match=r"^scaling.accelerator_type='H200': no node of the Ray cluster at "):
        preflight_cluster(load_config(None, ["scaling.num_workers=2", "scaling.use_gpu=false",
                                             "scaling.accelerator_type=H200"]))


def test_cli_exits_1_below_the_minimum_and_2_on_a_mistake(subprocess_env):
    cmd = [sys.executable, "-m", "raytrain.tools.preflight", "--num-workers", "2", "--no-use-gpu", "--sizes", "1M",
           "--iters", "2", "--warmup-iters", "1"]
    p = subprocess.run([*cmd, "--min-nvlink-busbw-gbs", "1e6"], capture_output=True, text=True,
                       env=subprocess_env, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    verdict = p.stdout.strip().splitlines()[-1]
    assert verdict.startswith("preflight: FAIL (1 node(s), 2 rank(s), gloo): node ")
    assert "is below the minimum 1e+06 GB/s (set by --min-nvlink-busbw-gbs)" in verdict
    assert re.search(r"^preflight \[  1/3\] within each node +all_reduce +1 MiB +busbw +[\d.]+ GB/s", p.stdout, re.M)

    p = subprocess.run([*cmd, "network.env.PATH=/tmp"], capture_output=True, text=True, env=subprocess_env,
                       timeout=300)
    assert p.returncode == 2 and "network.env.PATH: only NCCL_*, GLOO_*, FI_* variables" in p.stderr, p.stderr


def test_nccl_logs_come_from_the_ranks_that_answer(ray_cluster, tmp_path):
    """After a failed setup the driver still reads each node's NCCL log (it says why NCCL did not
    start), without waiting on a rank stuck in a collective."""
    import ray

    # Nested, so Ray pickles it by value: workers cannot import this test module by name.
    class Rank(PreflightWorker):
        def use_log(self, path: str) -> None:
            self.log_file = path

        def stuck(self, release: str) -> None:  # as a rank inside a collective that never completes
            while not os.path.exists(release):
                time.sleep(0.05)

    log = tmp_path / "nccl.rank0.log"
    log.write_text("h:1:1 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so\n"
                   "h:1:1 [0] plugin/net.cc:349 NCCL WARN Failed to initialize any NET plugin\n")
    release = tmp_path / "release"
    ranks = [ray.remote(num_cpus=0.5)(Rank).remote({}, True, False, str(tmp_path)) for _ in range(2)]
    try:
        # An actor's start imports torch: minutes on a CI machine at load 20 on 2 cores (60 s timed out once)
        ray.get(ranks[0].use_log.remote(str(log)), timeout=300)
        ranks[1].stuck.remote(str(release))
        nodes = {"a": NodeFacts("a", "a"), "b": NodeFacts("b", "b")}
        _collect_nccl_logs(ranks, {"a": [0], "b": [1]}, nodes, str(tmp_path), timeout_s=5.0)
        assert nodes["a"].nccl_log.plugin_missing and nodes["a"].nccl_log.failed_nets == {"any"}
        assert nodes["a"].nccl_log_files == [f"{tmp_path}/nccl.rank0.log"]
        assert nodes["b"].nccl_log is None  # no verdict on a rank that did not answer
    finally:
        release.touch()
        for rank in ranks:
            ray.kill(rank)
