"""raytrain.driver.cluster: connect in a process that is connected to Ray already (a notebook's second fit()):
the settings that only size a local cluster raytrain starts get a note instead of nothing, and an address that is
another cluster is refused; the run's shape read from that cluster; the address probe and the comparison of two
addresses, without Ray.

One small local cluster (1 CPU, no dashboard) for the tests that take `connected`, or the session's cluster where
a whole-suite run has connected this process already (tests/conftest.py: ray_cluster)."""

import logging
import socket

import pytest

from raytrain.config import ClusterConfig, ConfigError, ScalingConfig, load_config
from raytrain.driver.cluster import (_same_endpoint, check_connected_to, connect, live_shape, probe_address,
                                     storage_marker)


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


def test_an_address_that_is_another_cluster_is_refused_once_connected(connected):
    """Ray keeps a process's first connection: a second fit() with another cluster.address would silently train on
    the first cluster. The connected cluster's own address, however written, passes."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    host, _, port = gcs.rpartition(":")
    for same in (gcs, f"127.0.0.1:{port}", f"localhost:{port}"):  # a notebook's 127.0.0.1 is its node's IP
        check_connected_to(same, f"cluster.address={same}")
    for not_compared in (None, "auto", "local", f"ray://{host}:10001"):  # what this process holds; Ray Client's
        check_connected_to(not_compared, "cluster.address")
    other = f"{host}:{int(port) + 1}"
    with pytest.raises(ConfigError) as e:
        check_connected_to(other, f"cluster.address={other}")
    assert str(e.value) == (
        f"cluster.address={other} is not the Ray cluster this process is connected to ({gcs}, by an earlier fit() or "
        f"your own ray.init(); Ray joins one cluster per process): call ray.shutdown() first, or leave the address "
        f"out to use the connected cluster")


def test_the_live_shape_is_the_connected_clusters_and_the_drivers_node_runs_a_cpu_runs_workers(connected):
    """The driver's node is a CPU node with no GPU: a CPU run's workers may share it (its packages stand for
    theirs), a GPU run's may not; no GPU node means no GPUs per node."""
    cpu = live_shape(load_config(None, ["scaling.use_gpu=false", "scaling.num_workers=1"]))
    assert (cpu.num_workers, cpu.use_gpu, cpu.gpus_per_node, cpu.cpus_total, cpu.driver_on_worker_node) == (
        1, False, None, connected, True)
    gpu = live_shape(load_config(None, ["scaling.use_gpu=true", "scaling.num_workers=2"]))
    assert (gpu.num_workers, gpu.use_gpu, gpu.gpus_per_node, gpu.driver_on_worker_node) == (2, True, None, False)


def test_two_addresses_are_one_endpoint_by_port_and_resolved_host():
    """check_connected_to compares the user's address with the GCS's, which names this machine by its node IP."""
    import ray

    node_ip = ray.util.get_node_ip_address()  # no ray.init: the IP this machine's node would have
    for a, b in (("127.0.0.1:6379", "127.0.0.1:6379"), ("localhost:6379", f"{node_ip}:6379"),
                 ("[::1]:6379", "127.0.0.1:6379"), ("127.0.1.1:6379", f"{node_ip}:6379"),
                 ("198.51.100.7:6379", "198.51.100.7:6379")):  # another machine, written alike
        assert _same_endpoint(a, b) and _same_endpoint(b, a), (a, b)
    for a, b in (("127.0.0.1:6379", "127.0.0.1:6380"), ("198.51.100.7:6379", f"{node_ip}:6379"),
                 ("198.51.100.7:6379", "198.51.100.8:6379"), ("localhost:6379", "198.51.100.7:6379")):
        assert not _same_endpoint(a, b) and not _same_endpoint(b, a), (a, b)


def _closed_port() -> int:
    """A port nothing listens on: bound, never listened, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_nothing_answers_at_is_one_line_naming_the_key_and_the_fix():
    """Without the probe ray.init retried for minutes; the line names the setting, the endpoint and why."""
    port = _closed_port()
    fix = ("start the cluster (ray start --head) or fix the address (the head's GCS port, 6379 by default; "
           "ray://HOST:10001 for Ray Client), or unset it for a local cluster")
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):  # Ray Client's scheme is not the host's
        with pytest.raises(ConfigError) as e:
            probe_address(address, f"cluster.address={address}")
        assert str(e.value) == (f"cluster.address={address}: nothing answers at 127.0.0.1:{port} (Connection "
                                f"refused): {fix}")
    with pytest.raises(ConfigError) as e:  # an IPv6 literal's brackets are not the host's (refused or unroutable)
        probe_address(f"[::1]:{port}", "the environment's RAY_ADDRESS")
    assert str(e.value).startswith(f"the environment's RAY_ADDRESS: nothing answers at ::1:{port} (") and (
        "does not resolve" not in str(e.value)), e.value
    for found_by_ray in ("auto", "local"):  # on this machine: nothing to probe
        probe_address(found_by_ray, "cluster.address")
    with socket.socket() as server:  # a port whose backlog is full: the connection is never answered
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        held = []
        with pytest.raises(ConfigError) as e:
            for _ in range(8):  # fills the backlog (one connection on Linux), then the probe waits and gives up
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                probe_address(f"127.0.0.1:{port}", "cluster.address", timeout_s=0.2)
        for connection in held:
            connection.close()
    assert str(e.value) == f"cluster.address: nothing answers at 127.0.0.1:{port} (no answer within 0.2 s): {fix}"


def test_no_storage_marker_where_it_cannot_be_written():
    """The check is then skipped: the run's own first write reports it."""
    with storage_marker("/proc/raytrain-runs/a") as marker:  # /proc takes no new file, even from root
        assert marker is None
