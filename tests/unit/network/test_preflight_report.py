"""raytrain.network.preflight_report without Ray: nccl-tests' bandwidth arithmetic, sizes, the default
minimums, and the report's text."""

from __future__ import annotations

import pytest

from raytrain.config import ConfigError
from raytrain.network.nccl_log import parse_nccl_log
from raytrain.network.preflight_checks import evaluate
from raytrain.network.preflight_report import (
    DEFAULT_CPU_SIZES,
    DEFAULT_GPU_SIZES,
    INTRA,
    ONE_PER_NODE,
    Measurement,
    PreflightReport,
    Thresholds,
    algbw_gbs,
    bus_factor,
    busbw_gbs,
    format_size,
    parse_sizes,
)
from tests.unit.network.nccl_logs import EFA_LOG, IB_LOG, SOCKET_LOG
from tests.unit.network.preflight_facts import GB, ar, efa_node, ib_node, node


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
    assert parse_sizes("1,1K") == [1, 1024]  # one byte is the smallest size, and a valid one
    for bad in ("1T", "abc", "0", ""):
        with pytest.raises(ConfigError, match="--sizes"):
            parse_sizes(bad)
    assert format_size(1 << 30) == "1 GiB" and format_size(3 << 20) == "3 MiB" and format_size(1000) == "1000 B"
    # the largest unit that divides the size; bytes where no unit does
    assert [format_size(n) for n in (512, 1024, 1536, 3 << 10, (1 << 30) + (1 << 20))] == [
        "512 B", "1 KiB", "1536 B", "3 KiB", "1025 MiB"]


def test_default_sweeps():
    # GPU: nccl-tests' -b 1M -e 1G -f 2; CPU (gloo over TCP): 1 MiB .. 16 MiB.
    assert DEFAULT_GPU_SIZES == tuple(parse_sizes("1M,2M,4M,8M,16M,32M,64M,128M,256M,512M,1G"))
    assert DEFAULT_CPU_SIZES == tuple(parse_sizes("1M,2M,4M,8M,16M"))


def test_default_thresholds():
    assert Thresholds.defaults(use_gpu=False) == Thresholds(None, None, from_link_rates=False)
    # On GPU the cross-node minimums come from link rates; 40 per rail only where a rate is unknown.
    assert Thresholds.defaults(use_gpu=True) == Thresholds(300.0, 40.0, from_link_rates=True)
    assert Thresholds.defaults(use_gpu=True, min_ib_busbw_gbs=12) == Thresholds(300.0, 12, from_link_rates=False)
    assert Thresholds.defaults(use_gpu=False, min_nvlink_busbw_gbs=1e6).min_nvlink_busbw_gbs == 1e6


def test_report_render_and_verdict():
    report = PreflightReport(backend="nccl", num_workers=16,
                             nodes=[ib_node("10.0.0.1", nccl_log=parse_nccl_log(IB_LOG)),
                                    ib_node("10.0.0.2", nccl_log=parse_nccl_log(SOCKET_LOG))],
                             thresholds=Thresholds.defaults(use_gpu=True))
    for ip, busbw in (("10.0.0.1", 460), ("10.0.0.2", 455)):
        report.measurements += [ar(INTRA, f"node {ip}", s, busbw * s / (1 << 30), 8) for s in (1 << 20, 1 << 30)]
    report.measurements.append(ar(ONE_PER_NODE, "1 rank per node", 1 << 30, 4.2, 2))
    evaluate(report)
    assert not report.passed
    text = report.render()
    assert "node 10.0.0.1 (10.0.0.1): 8 rank(s); 8 x NVIDIA H200; driver 550.90.07; CUDA 12.4; NCCL 2.21.5" in text
    assert "  RDMA ports: 8 x InfiniBand at 400 Gb/s: mlx5_ib0:1, mlx5_ib1:1," in text
    assert "  NCCL IB devices: [0]mlx5_ib0:1/IB [1]mlx5_ib1:1/IB [RO]" in text
    assert "all_reduce (8 ranks)" in text and "1 GiB" in text
    assert [line for line in text.splitlines() if line.startswith("across")] == ["across nodes, 1 rank per node:"]
    # Each node's table holds its own measurements: all-reduce at both sizes, the other collectives "-".
    node1, node2 = text.split("node 10.0.0.2 (")[0], text.split("node 10.0.0.2 (")[1].split("across nodes")[0]
    for block, busbw in ((node1, 460), (node2, 455)):
        rows = [line.split() for line in block.splitlines() if line.strip().endswith("-")]
        assert [row[:2] for row in rows] == [["1", "MiB"], ["1", "GiB"]]
        assert float(rows[1][4]) == pytest.approx(busbw) and rows[1][5:] == ["-", "-"]
    verdict = text.splitlines()[-1]
    assert verdict.startswith("preflight: FAIL (2 node(s), 16 rank(s), nccl): node 10.0.0.2: NCCL uses NET/Socket")
    assert ("1 rank per node: all-reduce busbw 4.2 GB/s at 1 GiB is below the minimum 40 GB/s "
            "(80% of 1 x 400 Gb/s per rank; --min-ib-busbw-gbs sets your own)") in verdict
    evaluate(report)  # idempotent
    assert report.render().splitlines()[-1] == verdict


def test_render_shows_efa_devices_and_the_plugin():
    report = PreflightReport(backend="nccl", num_workers=8, nodes=[efa_node(nccl_log=parse_nccl_log(EFA_LOG))])
    evaluate(report)
    text = report.render()
    devices = ", ".join(f"rdmap{79 + i}s0:1" for i in range(8))
    assert f"  RDMA ports: 32 x EFA at 100 Gb/s: {devices} and 24 more\n" in text  # the first 8 named
    assert "  NCCL: aws-ofi-nccl 1.21.1 on libfabric provider efa; network Libfabric" in text
    assert report.passed, text


def test_passing_verdict_names_the_figures():
    report = PreflightReport(backend="gloo", num_workers=2, nodes=[node("a", num_ranks=2)])
    report.measurements = [ar(INTRA, "node a", 4 << 20, 1.5, 2)]
    evaluate(report)
    assert report.passed
    assert report.verdict() == ("preflight: PASS (1 node(s), 2 rank(s), gloo): all-reduce busbw within nodes "
                                "1.5 GB/s at 4 MiB")


def test_render_of_a_cpu_node_without_rdma_nccl_or_env():
    report = PreflightReport(backend="gloo", num_workers=2,
                             nodes=[node("a", num_ranks=2, gpu_count=0, gpu_name=None, driver=None, cuda=None)])
    text = report.render()
    assert text.splitlines()[:2] == ["node a (a): 2 rank(s); no GPU; driver -; CUDA -; NCCL 2.21.5; torch 2.5.1",
                                     "  RDMA ports: none active"]
    assert "NCCL:" not in text and "env:" not in text


def test_render_shows_the_workers_env_sorted_and_ports_whose_rate_is_unknown():
    facts = ib_node(rdma_ports=["mlx5_1:1", "mlx5_0:1"], link_gbps={},
                    env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1"})
    text = PreflightReport(backend="nccl", num_workers=8, nodes=[facts]).render()
    assert "  RDMA ports: 2 x InfiniBand: mlx5_1:1, mlx5_0:1\n" in text
    assert "  env: NCCL_IB_HCA==mlx5_0:1,mlx5_1:1 NCCL_SOCKET_IFNAME=eth0\n" in text


@pytest.mark.parametrize("num_ports, more", [(8, ""), (9, " and 1 more")])
def test_the_rdma_ports_line_names_eight_ports_and_counts_the_rest(num_ports, more):
    text = PreflightReport(backend="nccl", num_workers=8, nodes=[ib_node(num_ports=num_ports)]).render()
    ports = ", ".join(f"mlx5_ib{i}:1" for i in range(8))
    assert f"  RDMA ports: {num_ports} x InfiniBand at 400 Gb/s: {ports}{more}\n" in text


def test_passing_verdict_names_the_slowest_group_and_nothing_for_one_rank():
    report = PreflightReport(backend="gloo", num_workers=4, nodes=[node("a", num_ranks=2), node("b", num_ranks=2)])
    report.measurements = [ar(INTRA, "node a", 4 << 20, 3.0, 2), ar(INTRA, "node b", 4 << 20, 1.5, 2)]
    assert report.verdict().endswith("): all-reduce busbw within nodes 1.5 GB/s at 4 MiB")
    # a one-rank run measures a group of one: nothing crosses a link, so no figure to name
    one = PreflightReport(backend="gloo", num_workers=1, nodes=[node("a", num_ranks=1)])
    one.measurements = [ar(INTRA, "node a", 4 << 20, 0.0, 1)]
    assert one.verdict() == "preflight: PASS (1 node(s), 1 rank(s), gloo)"
