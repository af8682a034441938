"""raytrain.network.preflight_report without Ray: nccl-tests' bandwidth arithmetic, sizes, the default
minimums, and the report's text."""

from __future__ import annotations

import pytest

from raytrain.config import ConfigError
from raytrain.network.nccl_log import parse_nccl_log
from raytrain.network.preflight_checks import evaluate
from raytrain.network.preflight_report import (
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
    for bad in ("1T", "abc", "0", ""):
        with pytest.raises(ConfigError, match="--sizes"):
            parse_sizes(bad)
    assert format_size(1 << 30) == "1 GiB" and format_size(3 << 20) == "3 MiB" and format_size(1000) == "1000 B"


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
    assert "all_reduce (8 ranks)" in text and "1 GiB" in text and "across nodes, 1 rank per node:" in text
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
    assert "  RDMA ports: 32 x EFA at 100 Gb/s: rdmap79s0:1, rdmap80s0:1, " in text and "and 24 more" in text
    assert "  NCCL: aws-ofi-nccl 1.21.1 on libfabric provider efa; network Libfabric" in text
    assert report.passed, text


def test_passing_verdict_names_the_figures():
    report = PreflightReport(backend="gloo", num_workers=2, nodes=[node("a", num_ranks=2)])
    report.measurements = [ar(INTRA, "node a", 4 << 20, 1.5, 2)]
    evaluate(report)
    assert report.passed
    assert report.verdict() == ("preflight: PASS (1 node(s), 2 rank(s), gloo): all-reduce busbw within nodes "
                                "1.5 GB/s at 4 MiB")
