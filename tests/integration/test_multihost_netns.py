"""Two hosts on one machine: raytrain trains across network namespaces, each node picking its own NIC.

The test builds two "hosts" as network namespaces joined by one veth pair and nothing else:

    namespace A: lo, rt0 10.77.0.1/24  <-- veth -->  namespace B: lo, rt1 10.77.0.2/24

A Ray head runs in A, a worker node in B, and `python -m raytrain.main` runs in A against the head.
Processes and the filesystem are shared (tmp dirs stand in for the cluster's shared storage), the
network is not: with no other interface and no route out, every packet of the run stays on
127.0.0.1 inside one namespace or on 10.77.0.0/24 between the two. Each node's workers must set
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that holds *that node's* Ray IP: rt0 on A,
rt1 on B (an interface the other namespace does not even have).

Needs root and iproute2 (`ip netns`); skips otherwise, fails on CI (which has both). 2-3.5 minutes on a busy 2-core machine.
Run: /work/venv/bin/python -m pytest tests/integration/test_multihost_netns.py -x -q
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

from tests.helpers import require

pytestmark = pytest.mark.integration

RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")
SUBNET = ipaddress.ip_network("10.77.0.0/24")
# Ports are per namespace, so Ray's default port cannot collide with other clusters on the machine.
GCS_PORT = 6379
CPUS_PER_NODE = 3
# 2 logical CPUs per worker on 3-CPU nodes: a second worker cannot fit next to the first, so the
# placement group lands one worker per host (raytrain has no placement_strategy setting yet), and
# each node keeps one CPU for Ray Data.
CPUS_PER_WORKER = 2
MAX_STEPS = 6


@dataclass
class Host:
    netns: str
    ifname: str
    ip: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _in(host: Host, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", host.netns, *argv]


def _skip_unless_netns_possible() -> None:
    """Skips on a developer's machine without root or iproute2; fails on CI (tests.helpers.require)."""
    require(os.geteuid() == 0, "creating network namespaces needs root")
    require(shutil.which("ip") is not None, "`ip` not found: install iproute2 (apt-get install -y iproute2)")
    probe = f"rtprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    require(made.returncode == 0, f"`ip netns add` is not permitted here (needs CAP_SYS_ADMIN): {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def _kill_namespace_processes(host: Host) -> None:
    """SIGTERM, then SIGKILL, every process left in `host`'s namespace: all were started by this test."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", host.netns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 5
        while pids and time.time() < deadline and _ip("netns", "pids", host.netns, check=False).stdout.split():
            time.sleep(0.5)


@pytest.fixture
def hosts():
    """Namespaces A and B joined by the veth pair rt0 <-> rt1; deleted (with the pair) afterwards."""
    _skip_unless_netns_possible()
    tag = os.getpid()
    a, b = Host(f"rtA{tag}", "rt0", "10.77.0.1"), Host(f"rtB{tag}", "rt1", "10.77.0.2")
    try:
        for h in (a, b):
            _ip("netns", "add", h.netns)
        # Created straight inside the namespaces: the machine's own namespace never holds rt0/rt1,
        # so this cannot clash with its interfaces, nor with another run of this test.
        _ip("-n", a.netns, "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname, "netns", b.netns)
        for h in (a, b):
            _ip("-n", h.netns, "link", "set", "lo", "up")  # Ray's local services talk over 127.0.0.1
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/{SUBNET.prefixlen}", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
        yield a, b
    finally:
        for h in (a, b):
            _kill_namespace_processes(h)
            _ip("netns", "del", h.netns, check=False)  # takes the veth pair with it


@pytest.fixture
def cluster(hosts):
    """A Ray head in namespace A and a worker node in B: (a, b, GCS address, alive node IPs, temp dir)."""
    a, b = hosts
    # Short path: Ray's unix sockets live under the temp dir and must fit in 107 characters.
    # One temp dir per node: two raylets on one filesystem must not share a session directory.
    root = tempfile.mkdtemp(prefix="rtnetns-", dir="/tmp")
    address = f"{a.ip}:{GCS_PORT}"
    # RAY_ADDRESS reaches every process of both nodes. Without it, Ray internals that look for
    # "the local cluster" (Train's PlacementGroupCleaner queries the state API with no address)
    # find every GCS in the machine's shared process table and pick the newest one: on a real host
    # that is this cluster, here it can be someone else's, unreachable from the namespace.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": address}
    common = ["--block", f"--num-cpus={CPUS_PER_NODE}", "--num-gpus=0", "--object-store-memory=200000000",
              "--disable-usage-stats"]
    nodes = []
    try:
        # The dashboard serves the state API, which Ray Train's PlacementGroupCleaner polls (without
        # it, it logs a warning every second); on A's own address, so B's processes can reach it.
        for host, args in ((a, ["--head", f"--port={GCS_PORT}", "--include-dashboard=true",
                                f"--dashboard-host={a.ip}"]),
                           (b, [f"--address={address}"])):
            log = open(os.path.join(root, f"{host.ifname}.log"), "w")
            # --block keeps `ray start` in the foreground (`ip netns exec` execs it): this Popen is the
            # node's own process. Never `ray stop`: it would stop every Ray cluster on the machine.
            nodes.append(subprocess.Popen(
                _in(host, [RAY_BIN, "start", f"--node-ip-address={host.ip}",
                           f"--temp-dir={os.path.join(root, host.ifname)}", *common, *args]),
                env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            if host is a:
                _wait_for_port(a, GCS_PORT, nodes, root)  # the worker node needs the head's GCS up
        node_ips = _wait_for_nodes(a, address, 2, nodes, root)
        yield a, b, address, node_ips, root
    finally:
        # Every process in the two namespaces is one of this cluster's, started here; stopping them
        # all at once is much faster than `ray start --block`'s own graceful, one-by-one shutdown.
        for h in (a, b):
            _kill_namespace_processes(h)
        for p in nodes:
            p.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


# Polls the cluster from namespace A until `n` nodes are alive; prints their node IPs as JSON.
_NODES = """
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + 90
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= int(sys.argv[2]) or time.time() > deadline:
        break
    time.sleep(1)
print(json.dumps(alive))
"""


def _wait_for_port(host: Host, port: int, nodes: list[subprocess.Popen], root: str) -> None:
    probe = f"import socket; socket.create_connection(('{host.ip}', {port}), timeout=2).close()"
    deadline = time.time() + 120
    while subprocess.run(_in(host, [sys.executable, "-c", probe]), capture_output=True).returncode:
        if any(p.poll() is not None for p in nodes) or time.time() > deadline:
            pytest.fail(f"the Ray head did not open {host.ip}:{port}: {_logs(root)}")
        time.sleep(1)


def _wait_for_nodes(a: Host, address: str, n: int, nodes: list[subprocess.Popen], root: str) -> list[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    deadline = time.time() + 120
    while True:
        for p in nodes:
            if p.poll() is not None:
                pytest.fail(f"ray start exited with {p.returncode}: {_logs(root)}")
        probe = subprocess.run(_in(a, [sys.executable, "-c", _NODES, address, str(n)]), env=env,
                               capture_output=True, text=True, timeout=150)
        if probe.returncode == 0:
            alive = json.loads(probe.stdout.strip().splitlines()[-1])
            if len(alive) >= n:
                return alive
        if time.time() > deadline:
            pytest.fail(f"{n} Ray node(s) not up after 120 s: {probe.stderr[-2000:]}\n{_logs(root)}")
        time.sleep(2)


def _logs(root: str) -> str:
    out = []
    for name in ("rt0.log", "rt1.log"):
        path = os.path.join(root, name)
        if os.path.exists(path):
            out.append(f"--- {name}\n" + open(path).read()[-2000:])
    return "\n".join(out)


def _established_tcp(host: Host) -> list[tuple[str, str]]:
    """(local, remote) addresses of the ESTABLISHED TCP connections in `host`'s namespace.

    Read from inside the namespace (/proc/net is the reader's). gRPC listens on dual-stack
    sockets, so most of Ray's connections are in tcp6 as IPv4-mapped addresses.
    """
    conns = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = subprocess.run(_in(host, ["cat", table]), capture_output=True, text=True, check=True).stdout
        for line in text.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01":  # TCP_ESTABLISHED
                conns.append(tuple(_proc_net_ip(f.split(":")[0]) for f in fields[1:3]))
    return conns


def _proc_net_ip(hex_ip: str) -> str:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def _tx_bytes(host: Host) -> int:
    stats = json.loads(_ip("-n", host.netns, "-s", "-j", "link", "show", host.ifname).stdout)
    return stats[0]["stats64"]["tx"]["bytes"]


def test_trains_across_two_namespace_hosts_each_on_its_own_interface(cluster, tmp_path):
    a, b, address, node_ips, root = cluster
    assert node_ips == [a.ip, b.ip]  # Ray sees exactly the two namespace hosts, by their own addresses
    storage = tmp_path / "runs"  # one filesystem: stands in for the shared storage of a real cluster
    tx_before = {h.ifname: _tx_bytes(h) for h in (a, b)}

    env = {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(
        _in(a, [sys.executable, "-m", "raytrain.main", "scaling.num_workers=2",
                f"scaling.cpus_per_worker={CPUS_PER_WORKER}", f"checkpoint.storage_path={storage}",
                "checkpoint.name=netns", f"training.max_steps={MAX_STEPS}", "training.log_every_n_steps=3",
                "training.warmup_steps=2", "training.micro_batch_size_per_gpu=4",
                "data.num_builtin_documents=200",  # ~60k tokens: enough for 6 steps of 2x4x128
                # a user's own NCCL setting reaches every node's workers
                "network.env.NCCL_IB_HCA==mlx5_test:1"]),
        capture_output=True, text=True, env=env, timeout=300)
    output = p.stdout + p.stderr
    (tmp_path / "raytrain.log").write_text(output)  # kept by pytest for a look after a failure
    assert p.returncode == 0, output[-4000:] + _logs(root)

    # Each node's workers chose the interface carrying that node's Ray IP: the checkpoint holds one
    # env file per node, so both hosts trained, each on its own interface (rt1 exists only in
    # namespace B, so only a worker there could have chosen it).
    ckpt = re.search(r"^raytrain: checkpoint (/\S+)$", p.stdout, re.M).group(1)
    assert ckpt.startswith(str(storage))
    applied = [json.load(open(os.path.join(ckpt, f"nccl_env_node{n}.json"))) for n in (0, 1)]
    assert sorted((e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in applied) == [
        ("rt0", "=rt0"), ("rt1", "=rt1")], applied
    # The files are apply_nccl_env's record of what it set, and it refuses to run once a process group
    # exists (raytrain.network.backend): the workers had these values set before Ray Train built their group.
    assert all(e["NCCL_IB_HCA"] == "=mlx5_test:1" for e in applied), applied
    meta = json.load(open(os.path.join(ckpt, "raytrain.json")))
    assert meta["step"] == MAX_STEPS

    # Traffic stayed on the namespaces' own addresses: every open connection is loopback or
    # 10.77.0.0/24, B holds connections to the head at 10.77.0.1, and training moved real bytes
    # over the veth pair in both directions (gloo all-gathers and reduce-scatters every step).
    allowed = {"127.0.0.1", "::1"} | {str(ip) for ip in SUBNET.hosts()}
    for h in (a, b):
        conns = _established_tcp(h)
        assert conns and all(local in allowed and remote in allowed for local, remote in conns), (h, conns)
    assert any(local == b.ip and remote == a.ip for local, remote in _established_tcp(b))
    assert "Found multiple active Ray instances" not in output  # nothing looked beyond this cluster
    for h in (a, b):
        assert _tx_bytes(h) - tx_before[h.ifname] > 1_000_000, (h, tx_before)
