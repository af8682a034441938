"""raytrain.driver.cluster.connect in a process that is connected to Ray already (a notebook's second fit()):
the settings that only size a local cluster raytrain starts get a note instead of nothing.

One small local cluster (1 CPU, no dashboard) for the module, or the session's cluster where a whole-suite
run has connected this process already (tests/conftest.py: ray_cluster)."""

import logging

import pytest

from raytrain.config import ClusterConfig, ScalingConfig
from raytrain.driver.cluster import connect


@pytest.fixture(scope="module")
def connected():
    """This process connected to a Ray cluster; its logical CPUs."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    try:
        yield ray.cluster_resources()["CPU"]
    finally:
        if started:
            ray.shutdown()


def test_a_num_cpus_the_connected_cluster_does_not_have_gets_a_note(connected, monkeypatch, capsys):
    """A second fit() with cluster.num_cpus=6 ran on the first one's cluster (4 CPUs) without a word; the README
    promises a note for a cluster.num_cpus that has no effect."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # connect() would set it for the rest of the session
    other = int(connected) + 5
    for address in (None, "local"):  # both would start a local cluster of that size in a new process
        connect(ClusterConfig(address=address, num_cpus=other), ScalingConfig(num_workers=3))
        assert capsys.readouterr().out.splitlines() == [
            f"raytrain: note: cluster.num_cpus={other} has no effect: Ray is already initialized in this process with "
            f"{connected:g} CPUs (an earlier fit() or your own ray.init()), and a running cluster keeps its CPUs: "
            f"call ray.shutdown() first, or run in a new process"]
    # nothing to say: the cluster has that many; a value the user did not set; an address (idle_settings' note)
    for cluster in (ClusterConfig(num_cpus=int(connected)), ClusterConfig(), ClusterConfig(address="auto",
                                                                                          num_cpus=other)):
        connect(cluster, ScalingConfig())
        assert capsys.readouterr().out == "", cluster
