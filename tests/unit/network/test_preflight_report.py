"""raytrain.network.preflight_report without Ray: nccl-tests' bandwidth arithmetic, NCCL log parsing, and the checks
that turn facts and measurements into a verdict."""

from __future__ import annotations

import pytest

from raytrain.config import ConfigError
from raytrain.network.preflight_report import (
    ALL_RANKS,
    INTRA,
    ONE_PER_NODE,
    Measurement,
    NodeFacts,
    PreflightReport,
    Thresholds,
    algbw_gbs,
    bus_factor,
    busbw_gbs,
    check_agreement,
    check_bandwidth,
    check_transport,
    format_size,
    parse_nccl_log,
    parse_sizes,
)

GB = 10**9

# Excerpts in the formats NCCL prints (from public NVIDIA/nccl issue threads; host names changed).
IB_LOG = """\
gpu-a:1204:1204 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
gpu-a:1204:1204 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation
gpu-a:1204:1301 [0] NCCL INFO NET/IB : Using [0]mlx5_ib0:1/IB [1]mlx5_ib1:1/IB [RO]; OOB eth0:10.0.0.1<0>
gpu-a:1204:1301 [0] NCCL INFO Using network IB
gpu-a:1204:1301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:1204:1301 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-a:1204:1301 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
gpu-a:1204:1301 [0] NCCL INFO Connected all rings
"""

SOCKET_LOG = """\
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/IB : No device found.
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.12.21<0>
ip-172-31-12-21:45361:45400 [0] NCCL INFO Using network Socket
ip-172-31-12-21:45361:45400 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
ip-172-31-12-21:45361:45400 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
ip-172-31-12-21:45361:45400 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via SHM/direct/direct
"""

# HPC-X's SHARP plugin: the network is named IBext_v8, and is InfiniBand all the same.
IBEXT_LOG = """\
host-7:987:1260 [7] NCCL INFO Using network IBext_v8
host-7:987:1260 [7] NCCL INFO Channel 03/0 : 47[7] -> 39[7] [receive] via NET/IBext_v8/2
"""

# One node, two GPUs: no channel leaves the node, only the network choice says what NCCL loaded.
SINGLE_NODE_SOCKET_LOG = """\
h200:77:77 [0] NCCL INFO NET/IB : No device found.
h200:77:90 [0] NCCL INFO Using network Socket
h200:77:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
"""


# NCCL 2.28.9 (torch 2.11+cu130) on a machine without HCAs, as preflight captured it on the H200 VM.
NCCL_228_NO_IB_LOG = """\
vm:746:746 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
vm:746:746 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
vm:746:746 [0] NCCL INFO NET/IB : No device found.
vm:746:746 [0] NCCL INFO NET/IB : Using [RO]; OOB eth0:192.0.2.2<0>
vm:746:746 [0] NCCL INFO Failed to initialize NET plugin IB
vm:746:746 [0] NCCL INFO NET/Socket : Using [0]eth0:192.0.2.2<0>
vm:746:746 [0] NCCL INFO Initialized NET plugin Socket
vm:746:746 [0] NCCL INFO Assigned NET plugin Socket to comm
vm:746:746 [0] NCCL INFO Using network Socket
vm:746:746 [0] NCCL INFO Channel 00/64 : 0
"""


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("all_reduce", 2) == pytest.approx(1.0)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert bus_factor(op, 1) == 0  # one rank: nothing crosses a link
    with pytest.raises(ValueError, match="all_reduce"):
        bus_factor("broadcast", 2)


def test_algbw_and_busbw():
    # 1 GiB all-reduce on 8 ranks in 4 ms: algbw 268.4 GB/s, busbw x 1.75.
    assert algbw_gbs(1 << 30, 0.004) == pytest.approx((1 << 30) / 0.004 / GB)
    assert busbw_gbs("all_reduce", 1 << 30, 0.004, 8) == pytest.approx((1 << 30) / 0.004 / GB * 1.75)
    m = Measurement(INTRA, "node a", "all_gather", 1 << 30, 8, 0.004)
    assert m.busbw_gbs == pytest.approx(m.algbw_gbs * 7 / 8)


def test_parse_sizes():
    assert parse_sizes("1M,4M") == [1 << 20, 4 << 20]
    assert parse_sizes("1G, 64M,1M,64MiB") == [1 << 20, 64 << 20, 1 << 30]
    assert parse_sizes("512,2K") == [512, 2048]
    for bad in ("1T", "abc", "0", ""):
        with pytest.raises(ConfigError, match="--sizes"):
            parse_sizes(bad)
    assert format_size(1 << 30) == "1 GiB" and format_size(3 << 20) == "3 MiB" and format_size(1000) == "1000 B"


def test_parse_ib_log():
    log = parse_nccl_log(IB_LOG)
    assert log.networks == {"IB"}
    assert log.net_channels == {"IB"} and log.gdr
    assert log.local_paths == {"P2P/CUMEM"}
    assert log.ib_devices == "[0]mlx5_ib0:1/IB [1]mlx5_ib1:1/IB [RO]"
    assert not log.ib_not_found and not log.uses_socket
    assert "via NET/IB with GPUDirect RDMA" in log.describe()


def test_parse_socket_log():
    log = parse_nccl_log(SOCKET_LOG)
    assert log.networks == {"Socket"} and log.net_channels == {"Socket"} and not log.gdr
    assert log.ib_not_found and log.uses_socket
    assert log.local_paths == {"SHM/direct"}
    assert log.ib_devices is None


def test_parse_ibext_and_non_nccl_lines():
    log = parse_nccl_log(IBEXT_LOG + "some other stderr via NET/Socket/0, not an NCCL info line\n")
    assert log.networks == {"IBext_v8"} and log.net_channels == {"IBext_v8"}
    assert not log.uses_socket and log.num_lines == 2


def test_parse_nccl_228_without_hcas():
    log = parse_nccl_log(NCCL_228_NO_IB_LOG)
    assert log.networks == {"Socket"} and log.uses_socket and log.ib_not_found
    assert log.ib_devices is None  # "Using [RO]" lists no device
    assert log.describe() == "network Socket"
    assert parse_nccl_log("h:1:2 [0] NCCL INFO Failed to initialize NET plugin IBext_v8").ib_not_found is False


def test_single_node_socket_choice_counts_without_net_channels():
    log = parse_nccl_log(SINGLE_NODE_SOCKET_LOG)
    assert not log.net_channels and log.uses_socket and log.local_paths == {"P2P/IPC"}


def node(ip: str = "10.0.0.1", **kw) -> NodeFacts:
    base = dict(hostname=ip, num_ranks=8, gpu_count=8, gpu_name="NVIDIA H200", driver="550.90.07", cuda="12.4",
                nccl="2.21.5", torch="2.5.1")
    return NodeFacts(node_ip=ip, **{**base, **kw})


def test_agreement():
    assert check_agreement([node("a"), node("b")]) == []
    failures = check_agreement([node("a"), node("b", nccl="2.19.3"), node("c", driver="535.1")])
    assert len(failures) == 2
    assert failures[0].startswith("driver differs across nodes (550.90.07 on a, b; 535.1 on c)")
    assert "nccl differs across nodes (2.21.5 on a, c; 2.19.3 on b)" in failures[1]
    cpu = dict(gpu_count=0, gpu_name=None, driver=None, cuda=None, nccl=None)
    assert check_agreement([node("a", **cpu), node("b", **cpu)]) == []


def test_transport_socket_where_ib_exists_fails():
    ib_node = node(rdma_ports=["mlx5_ib0:1", "mlx5_ib1:1"], nccl_log=parse_nccl_log(SOCKET_LOG))
    failure, _ = check_transport(ib_node, multi_node=True)
    assert "NET/Socket" in failure and "mlx5_ib0:1, mlx5_ib1:1" in failure and "no usable IB device" in failure
    ib_node.nccl_ib_disable = True
    assert "NCCL_IB_DISABLE=1" in check_transport(ib_node, multi_node=True)[0]
    # Even on one node: NCCL choosing sockets next to active HCAs will bite the first multi-node run.
    one = node(rdma_ports=["mlx5_0:1"], nccl_log=parse_nccl_log(SINGLE_NODE_SOCKET_LOG))
    assert check_transport(one, multi_node=False)[0] is not None


def test_transport_ib_passes_and_missing_log_fails():
    assert check_transport(node(rdma_ports=["mlx5_ib0:1"], nccl_log=parse_nccl_log(IB_LOG)), True) == (None, None)
    assert check_transport(node(rdma_ports=["mlx5_ib0:1"], nccl_log=parse_nccl_log(IBEXT_LOG)), True)[0] is None
    failure, _ = check_transport(node(rdma_ports=["mlx5_ib0:1"], nccl_log=parse_nccl_log(""),
                                      nccl_log_files=["/tmp/x/nccl.rank0.log"]), True)
    assert "unconfirmed" in failure and "/tmp/x/nccl.rank0.log" in failure
    no_gdr = parse_nccl_log(IB_LOG.replace("/GDRDMA", ""))
    failure, note = check_transport(node(rdma_ports=["mlx5_ib0:1"], nccl_log=no_gdr), True)
    assert failure is None and "without GPUDirect RDMA" in note


def test_transport_without_rdma_is_a_note_and_gloo_is_silent():
    assert check_transport(node(nccl_log=parse_nccl_log(SOCKET_LOG)), multi_node=True)[0] is None
    assert "no active InfiniBand" in check_transport(node(nccl_log=parse_nccl_log(SOCKET_LOG)), True)[1]
    assert check_transport(node(nccl_log=parse_nccl_log(SOCKET_LOG)), multi_node=False) == (None, None)
    assert check_transport(node(), multi_node=True) == (None, None)  # gloo: no NCCL log


def ar(phase: str, group: str, size: int, busbw: float, n: int) -> Measurement:
    """An all-reduce measurement whose busbw is `busbw` GB/s."""
    time_s = size / (busbw * GB / bus_factor("all_reduce", n)) if n > 1 else 1e-3
    return Measurement(phase, group, "all_reduce", size, n, time_s)


def test_bandwidth_uses_largest_size_per_group():
    t = Thresholds(min_nvlink_busbw_gbs=300, min_ib_busbw_gbs=40)
    ms = [ar(INTRA, "node a", 1 << 20, 20, 8), ar(INTRA, "node a", 1 << 30, 450, 8),  # small size: latency
          ar(INTRA, "node b", 1 << 30, 120, 8),
          ar(ONE_PER_NODE, "1 rank per node", 1 << 30, 47, 2),
          ar(ALL_RANKS, "all ranks", 1 << 30, 300, 16)]
    failures, notes = check_bandwidth(ms, t, rails_per_node=8)
    assert len(failures) == 2 and not notes
    assert failures[0].startswith("node b: all-reduce busbw 120.0 GB/s at 1 GiB is below the minimum 300 GB/s")
    assert "--min-nvlink-busbw-gbs" in failures[0]
    assert "all ranks" in failures[1] and "320 GB/s (40 x 8 rails)" in failures[1]
    # No RDMA rails: the all-ranks group is not held to an IB figure.
    assert len(check_bandwidth(ms, t, rails_per_node=0)[0]) == 1


def test_bandwidth_unchecked_on_cpu_and_one_rank_is_a_note():
    ms = [ar(INTRA, "node a", 4 << 20, 0.5, 2)]
    assert Thresholds.defaults(use_gpu=False) == Thresholds(None, None)
    assert check_bandwidth(ms, Thresholds.defaults(use_gpu=False), 0) == ([], [])
    assert Thresholds.defaults(use_gpu=True) == Thresholds(300.0, 40.0)
    assert Thresholds.defaults(use_gpu=False, min_nvlink_busbw_gbs=1e6).min_nvlink_busbw_gbs == 1e6
    failures, notes = check_bandwidth([ar(INTRA, "node a", 1 << 30, 0, 1)], Thresholds(300, 40), 0)
    assert failures == [] and "1 rank" in notes[0]


def test_report_render_and_verdict():
    report = PreflightReport(backend="nccl", num_workers=16,
                             nodes=[node("10.0.0.1", rdma_ports=["mlx5_ib0:1"], nccl_log=parse_nccl_log(IB_LOG)),
                                    node("10.0.0.2", rdma_ports=["mlx5_ib0:1"], nccl_log=parse_nccl_log(SOCKET_LOG))],
                             thresholds=Thresholds(300, 40))
    for ip, busbw in (("10.0.0.1", 460), ("10.0.0.2", 455)):
        report.measurements += [ar(INTRA, f"node {ip}", s, busbw * s / (1 << 30), 8) for s in (1 << 20, 1 << 30)]
    report.measurements.append(ar(ONE_PER_NODE, "1 rank per node", 1 << 30, 4.2, 2))
    report.evaluate()
    assert not report.passed
    text = report.render()
    assert "node 10.0.0.1 (10.0.0.1): 8 rank(s); 8 x NVIDIA H200; driver 550.90.07; CUDA 12.4; NCCL 2.21.5" in text
    assert "all_reduce (8 ranks)" in text and "1 GiB" in text and "across nodes, 1 rank per node:" in text
    verdict = text.splitlines()[-1]
    assert verdict.startswith("preflight: FAIL (2 node(s), 16 rank(s), nccl): node 10.0.0.2: NCCL uses NET/Socket")
    assert "1 rank per node: all-reduce busbw 4.2 GB/s" in verdict
    report.evaluate()  # idempotent
    assert report.render().splitlines()[-1] == verdict


def test_passing_verdict_names_the_figures():
    report = PreflightReport(backend="gloo", num_workers=2, nodes=[node("a", num_ranks=2)])
    report.measurements = [ar(INTRA, "node a", 4 << 20, 1.5, 2)]
    report.evaluate()
    assert report.passed
    assert report.verdict() == ("preflight: PASS (1 node(s), 2 rank(s), gloo): all-reduce busbw within nodes "
                                "1.5 GB/s at 4 MiB")
