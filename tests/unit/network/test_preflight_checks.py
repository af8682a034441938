"""raytrain.network.preflight_checks without Ray: versions, fabric, transport (InfiniBand and EFA) and
bandwidth checks on facts and NCCL logs in the formats real nodes print."""

from __future__ import annotations

import pytest

from raytrain.network.nccl_log import NcclLog, parse_nccl_log
from raytrain.network.preflight_checks import (
    check_agreement,
    check_bandwidth,
    check_fabric,
    check_transport,
    evaluate,
    net_minimums,
)
from raytrain.network.preflight_report import ALL_RANKS, INTRA, ONE_PER_NODE, PreflightReport, Thresholds
from tests.unit.network.nccl_logs import (
    EFA_AWS_LIBFABRIC_LOG,
    EFA_LOG,
    EFA_NO_DEVICES_LOG,
    EFA_NO_PLUGIN_PINNED_LOG,
    EFA_NO_PLUGIN_SOCKET_LOG,
    EFA_PLUGIN_LOAD_ERROR_LOG,
    EFA_TCP_PROVIDER_LOG,
    IB_LOG,
    IBEXT_LOG,
    SINGLE_NODE_SOCKET_LOG,
    SOCKET_LOG,
)
from tests.unit.network.preflight_facts import ar, efa_node, ib_node, node

PINNED = {"NCCL_NET": "AWS Libfabric", "FI_PROVIDER": "efa"}  # what raytrain sets on an EFA node


def test_agreement():
    assert check_agreement([node("a"), node("b")]) == []
    failures = check_agreement([node("a"), node("b", nccl="2.19.3"), node("c", driver="535.1")])
    assert len(failures) == 2
    assert failures[0].startswith("driver differs across nodes (550.90.07 on a, b; 535.1 on c)")
    assert "nccl differs across nodes (2.21.5 on a, c; 2.19.3 on b)" in failures[1]
    cpu = dict(gpu_count=0, gpu_name=None, driver=None, cuda=None, nccl=None)
    assert check_agreement([node("a", **cpu), node("b", **cpu)]) == []


def test_transport_socket_where_ib_exists_fails():
    ib = ib_node(rdma_ports=["mlx5_ib0:1", "mlx5_ib1:1"], nccl_log=parse_nccl_log(SOCKET_LOG))
    failure, _ = check_transport(ib, multi_node=True)
    assert "NET/Socket" in failure and "mlx5_ib0:1, mlx5_ib1:1" in failure and "no usable IB device" in failure
    ib.nccl_ib_disable = True
    assert "NCCL_IB_DISABLE=1" in check_transport(ib, multi_node=True)[0]
    # Even on one node: NCCL choosing sockets next to active HCAs will bite the first multi-node run.
    one = ib_node(nccl_log=parse_nccl_log(SINGLE_NODE_SOCKET_LOG))
    assert check_transport(one, multi_node=False)[0] is not None


def test_transport_ib_passes_and_missing_log_fails():
    assert check_transport(ib_node(nccl_log=parse_nccl_log(IB_LOG)), True) == (None, None)
    assert check_transport(ib_node(nccl_log=parse_nccl_log(IBEXT_LOG)), True)[0] is None
    failure, _ = check_transport(ib_node(nccl_log=parse_nccl_log(""), nccl_log_files=["/tmp/x/nccl.rank0.log"]), True)
    assert "unconfirmed" in failure and "/tmp/x/nccl.rank0.log" in failure and "NET/IB" in failure
    failure, note = check_transport(ib_node(nccl_log=parse_nccl_log(IB_LOG.replace("/GDRDMA", ""))), True)
    assert failure is None and "without GPUDirect RDMA" in note and "nvidia_peermem" in note


def test_transport_without_rdma_is_a_note_and_gloo_is_silent():
    failure, note = check_transport(node(nccl_log=parse_nccl_log(SOCKET_LOG)), multi_node=True)
    assert failure is None and "no active InfiniBand, RoCE or EFA port" in note
    assert check_transport(node(nccl_log=parse_nccl_log(SOCKET_LOG)), multi_node=False) == (None, None)
    assert check_transport(node(), multi_node=True) == (None, None)  # gloo: no NCCL log


@pytest.mark.parametrize("log", [EFA_LOG, EFA_AWS_LIBFABRIC_LOG])
def test_efa_with_gdrdma_passes(log):
    assert check_transport(efa_node(env=PINNED, nccl_log=parse_nccl_log(log)), multi_node=True) == (None, None)


def test_efa_without_gdrdma_is_a_note():
    failure, note = check_transport(efa_node(nccl_log=parse_nccl_log(EFA_LOG.replace("/GDRDMA", ""))), True)
    assert failure is None and "NCCL uses NET/Libfabric without GPUDirect RDMA" in note


def test_efa_plugin_missing_falls_back_to_socket():
    failure, _ = check_transport(efa_node(nccl_log=parse_nccl_log(EFA_NO_PLUGIN_SOCKET_LOG)), multi_node=True)
    assert failure.startswith("node 10.1.0.5: NCCL uses NET/Socket (TCP) although EFA devices rdmap79s0:1, "
                              "rdmap80s0:1, rdmap81s0:1, rdmap82s0:1 and 28 more are present (NCCL found no "
                              "aws-ofi-nccl plugin libnccl-net.so): ")
    assert "put /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu or /opt/amazon/ofi-nccl/lib" in failure
    assert "on the loader path" in failure


def test_efa_plugin_missing_with_nccl_net_pinned():
    # NCCL stopped instead of falling back: no network at all, and the same fix.
    failure, _ = check_transport(efa_node(env=PINNED, nccl_log=parse_nccl_log(EFA_NO_PLUGIN_PINNED_LOG)), False)
    assert "NCCL has no network although EFA devices" in failure and "/opt/amazon/ofi-nccl/lib" in failure
    # NCCL_NET unset and an InfiniBand NIC next to the EFA devices: NCCL's own IB transport is no EFA.
    failure, _ = check_transport(efa_node(nccl_log=parse_nccl_log(IB_LOG)), True)
    assert failure.startswith("node 10.1.0.5: NCCL uses NET/IB, not aws-ofi-nccl, although EFA devices")


def test_efa_plugin_that_does_not_load_names_the_library():
    failure, _ = check_transport(efa_node(nccl_log=parse_nccl_log(EFA_PLUGIN_LOAD_ERROR_LOG)), True)
    assert "NCCL uses NET/Socket (TCP)" in failure and "libfabric.so.1: cannot open shared object file" in failure
    assert "/opt/amazon/efa/lib" in failure


def test_efa_on_libfabrics_tcp_provider_fails():
    # "Using network AWS Libfabric" is no proof: the provider under the plugin is TCP (aws-ofi-nccl#803).
    failure, _ = check_transport(efa_node(nccl_log=parse_nccl_log(EFA_TCP_PROVIDER_LOG)), multi_node=False)
    assert failure.startswith("node 10.1.0.5: aws-ofi-nccl 1.12.1-aws runs on libfabric's tcp provider, i.e. TCP, "
                              "although EFA devices")
    assert "--device=/dev/infiniband" in failure and "FI_PROVIDER=efa" in failure


def test_efa_devices_missing_in_the_container():
    failure, _ = check_transport(efa_node(nccl_log=parse_nccl_log(EFA_NO_DEVICES_LOG)), multi_node=True)
    assert "NCCL uses NET/Socket (TCP)" in failure
    assert "aws-ofi-nccl 1.14.0 found no EFA provider in libfabric: OFI fi_getinfo() call failed" in failure
    assert "--device=/dev/infiniband" in failure and "fi_info -p efa" in failure


def test_efa_socket_by_choice_and_no_log():
    chosen = efa_node(env={"NCCL_NET": "Socket"}, nccl_log=parse_nccl_log(SOCKET_LOG))
    assert "(NCCL_NET=Socket is set): drop NCCL_NET=Socket" in check_transport(chosen, True)[0]
    failure, _ = check_transport(efa_node(nccl_log=parse_nccl_log(""), nccl_log_files=["/tmp/r/nccl.rank0.log"]), True)
    assert "aws-ofi-nccl transport is unconfirmed" in failure and "/tmp/r/nccl.rank0.log" in failure


def test_fabric_must_be_one_kind_across_nodes():
    assert check_fabric([efa_node("a"), efa_node("b")]) == []
    assert check_fabric([node("a"), node("b")]) == []  # TCP everywhere: one kind, a note elsewhere
    failures = check_fabric([efa_node("a"), efa_node("b"), node("c")])
    assert len(failures) == 1
    assert failures[0].startswith("fabric differs across nodes (EFA on a, b; no RDMA on c): ")
    assert "scaling.accelerator_type" in failures[0]
    assert check_fabric([ib_node("a"), efa_node("b")])[0].startswith("fabric differs across nodes (InfiniBand on a; "
                                                                     "EFA on b)")


def test_a_link_slower_than_the_others_fails():
    slow = ib_node("b")
    slow.link_gbps["mlx5_ib3:1"] = 200.0  # trained down to HDR
    failures = check_fabric([ib_node("a"), slow])
    assert failures == ["InfiniBand links slower than the cluster's 400 Gb/s: mlx5_ib3:1 on b at 200 Gb/s (a link "
                        "trained down, or another NIC): reseat or replace the cable, or leave the node out"]


def test_mixed_cluster_fails_the_report():
    report = PreflightReport(backend="nccl", num_workers=16, thresholds=Thresholds.defaults(use_gpu=True),
                             nodes=[efa_node("10.1.0.5", env=PINNED, nccl_log=parse_nccl_log(EFA_LOG)),
                                    node("10.1.0.6", nccl_log=parse_nccl_log(SOCKET_LOG))])
    evaluate(report)
    assert report.failures[0].startswith("fabric differs across nodes (EFA on 10.1.0.5; no RDMA on 10.1.0.6)")
    assert any("10.1.0.6 has no active InfiniBand, RoCE or EFA port" in n for n in report.notes)
    report.backend = "gloo"  # gloo is TCP whatever the fabric
    evaluate(report)
    assert report.passed


def test_train_anyway_names_nccl_net_where_raytrain_pinned_it():
    stuck = PreflightReport(backend="nccl", num_workers=8,
                            nodes=[efa_node(env=PINNED, nccl_log=parse_nccl_log(EFA_NO_PLUGIN_PINNED_LOG))])
    evaluate(stuck)
    assert not stuck.passed
    assert stuck.train_anyway.startswith("set network.preflight=false and network.env.NCCL_NET=Socket to train over "
                                         "TCP anyway (NCCL_NET names aws-ofi-nccl on 10.1.0.5")
    slow = PreflightReport(backend="nccl", num_workers=8, measurements=[ar(INTRA, "node 10.1.0.5", 1 << 30, 90, 8)],
                           thresholds=Thresholds.defaults(use_gpu=True),
                           nodes=[efa_node(env=PINNED, nccl_log=parse_nccl_log(EFA_LOG))])
    evaluate(slow)  # the plugin works; only the NVLink figure fails
    assert not slow.passed and slow.train_anyway == "set network.preflight=false to train anyway"


def test_minimums_from_link_rates():
    rates = Thresholds.defaults(use_gpu=True)
    # ND H100 v5 and p5: 8 x 400 Gb/s and 32 x 100 Gb/s per node, 8 GPUs: 40 GB/s per rank, 320 per node.
    for nodes in ([ib_node("a"), ib_node("b")], [efa_node("a"), efa_node("b")]):
        got = net_minimums(nodes, rates)
        assert got[ONE_PER_NODE][0] == pytest.approx(40) and got[ALL_RANKS][0] == pytest.approx(320)
    p5 = net_minimums([efa_node("a"), efa_node("b")], rates)
    assert p5[ONE_PER_NODE][1] == "80% of 4 x 100 Gb/s per rank; --min-ib-busbw-gbs sets your own"
    # p4d: 4 x 100 Gb/s for 8 GPUs. The 40-per-rail rule would ask 160 GB/s of a 50 GB/s node.
    p4d = net_minimums([efa_node("a", num_devices=4), efa_node("b", num_devices=4)], rates)
    assert p4d[ONE_PER_NODE][0] == pytest.approx(10) and p4d[ALL_RANKS][0] == pytest.approx(40)
    # 4 of 8 GPUs per node: half the node's links.
    half = net_minimums([ib_node("a", num_ranks=4), ib_node("b", num_ranks=4)], rates)
    assert half[ALL_RANKS] == (160, "80% of 8 x 400 Gb/s per node x 4/8 GPUs; --min-ib-busbw-gbs sets your own")
    # The weakest node sets the figure.
    assert net_minimums([ib_node("a"), ib_node("b", gbps=200)], rates)[ALL_RANKS][0] == pytest.approx(160)
    assert net_minimums([ib_node("a", gbps=200), ib_node("b")], rates)[ONE_PER_NODE][0] == pytest.approx(20)
    # Within a node too: one rank's figure is set by the slowest of its links.
    slow_link = ib_node("b")
    slow_link.link_gbps["mlx5_ib5:1"] = 100.0
    assert net_minimums([ib_node("a"), slow_link], rates)[ONE_PER_NODE][0] == pytest.approx(10)
    # One GPU and one rank per node on one NIC: the rank drives the whole link.
    single = [ib_node(ip, num_ports=1, gpu_count=1, num_ranks=1) for ip in ("a", "b")]
    assert net_minimums(single, rates)[ALL_RANKS] == (40, "80% of 1 x 400 Gb/s per node; --min-ib-busbw-gbs sets "
                                                          "your own")


def test_minimums_per_rail_where_rates_are_unknown_or_given():
    unknown = [ib_node("a", link_gbps={}), ib_node("b", link_gbps={})]
    assert net_minimums(unknown, Thresholds.defaults(use_gpu=True)) == {
        ONE_PER_NODE: (40.0, "set by --min-ib-busbw-gbs"),
        ALL_RANKS: (320.0, "40 x 8 rails, set by --min-ib-busbw-gbs")}
    given = net_minimums([efa_node("a"), efa_node("b")], Thresholds.defaults(use_gpu=True, min_ib_busbw_gbs=30))
    assert given[ONE_PER_NODE][0] == 30 and given[ALL_RANKS][0] == 240  # min(8 ranks, 32 devices) rails
    # No RDMA port on a node: 1 rank per node still held to the per-NIC figure, all ranks not checked.
    assert net_minimums([node("a"), node("b")], Thresholds.defaults(use_gpu=True)) == {
        ONE_PER_NODE: (40.0, "set by --min-ib-busbw-gbs")}
    assert net_minimums([ib_node("a")], Thresholds.defaults(use_gpu=False)) == {}


def test_bandwidth_uses_largest_size_per_group():
    t = Thresholds(min_nvlink_busbw_gbs=300, min_ib_busbw_gbs=40)
    ms = [ar(INTRA, "node a", 1 << 20, 20, 8), ar(INTRA, "node a", 1 << 30, 450, 8),  # small size: latency
          ar(INTRA, "node b", 1 << 30, 120, 8),
          ar(ONE_PER_NODE, "1 rank per node", 1 << 30, 47, 2),
          ar(ALL_RANKS, "all ranks", 1 << 30, 300, 16)]
    failures, notes = check_bandwidth(ms, t, [ib_node("a"), ib_node("b")])
    assert len(failures) == 2 and not notes
    assert failures[0] == ("node b: all-reduce busbw 120.0 GB/s at 1 GiB is below the minimum 300 GB/s "
                           "(set by --min-nvlink-busbw-gbs)")
    assert failures[1].startswith("all ranks: all-reduce busbw 300.0 GB/s at 1 GiB is below the minimum 320 GB/s "
                                  "(40 x 8 rails, set by --min-ib-busbw-gbs)")
    # No RDMA rails: the all-ranks group is not held to an IB figure.
    assert len(check_bandwidth(ms, t, [node("a"), node("b")])[0]) == 1


def test_bandwidth_on_p4d_passes_at_its_line_rate():
    # 2 x p4d, 8 GPUs each on 4 x 100 Gb/s EFA: ~11.5 GB/s per rank and ~46 GB/s all ranks is healthy.
    p4d = [efa_node("a", num_devices=4), efa_node("b", num_devices=4)]
    ms = [ar(ONE_PER_NODE, "1 rank per node", 1 << 30, 11.5, 2), ar(ALL_RANKS, "all ranks", 1 << 30, 46, 16)]
    assert check_bandwidth(ms, Thresholds.defaults(use_gpu=True), p4d) == ([], [])
    ms[1] = ar(ALL_RANKS, "all ranks", 1 << 30, 40, 16)  # exactly the minimum meets it
    assert check_bandwidth(ms, Thresholds.defaults(use_gpu=True), p4d) == ([], [])
    ms[1] = ar(ALL_RANKS, "all ranks", 1 << 30, 4.5, 16)  # TCP
    failures, _ = check_bandwidth(ms, Thresholds.defaults(use_gpu=True), p4d)
    assert failures == ["all ranks: all-reduce busbw 4.5 GB/s at 1 GiB is below the minimum 40 GB/s (80% of 4 x "
                        "100 Gb/s per node; --min-ib-busbw-gbs sets your own)"]


def test_bandwidth_unchecked_on_cpu_and_one_rank_is_a_note():
    ms = [ar(INTRA, "node a", 4 << 20, 0.5, 2)]
    assert check_bandwidth(ms, Thresholds.defaults(use_gpu=False), [node("a")]) == ([], [])
    failures, notes = check_bandwidth([ar(INTRA, "node a", 1 << 30, 0, 1)], Thresholds(300, 40), [node("a")])
    assert failures == [] and "1 rank" in notes[0]


def test_efa_failures_name_what_the_log_says_and_no_more():
    four = dict(num_devices=4, nccl_log_files=[])
    # A provider other than TCP: "not efa", and no version where the plugin logged none.
    verbs = NcclLog(ofi_provider="verbs", networks={"Libfabric"}, num_lines=5)
    failure, _ = check_transport(efa_node(nccl_log=verbs, **four), multi_node=True)
    assert failure.startswith("node 10.1.0.5: aws-ofi-nccl runs on libfabric's verbs provider, not efa, although EFA "
                              "devices rdmap79s0:1, rdmap80s0:1, rdmap81s0:1, rdmap82s0:1 are present: ")
    # The plugin loaded (its version logged) but said nothing more: no ": None" after it.
    quiet = NcclLog(ofi_version="1.14.0", networks={"Socket"}, num_lines=5)
    failure, _ = check_transport(efa_node(nccl_log=quiet, **four), multi_node=True)
    assert "(aws-ofi-nccl 1.14.0 found no EFA provider in libfabric): pass the EFA devices" in failure
    # No word of a plugin at all; NCCL picked IB without logging a channel.
    ib = NcclLog(networks={"IB"}, num_lines=5)
    failure, _ = check_transport(efa_node(nccl_log=ib, **four), multi_node=True)
    assert "NCCL uses NET/IB, not aws-ofi-nccl, although EFA devices" in failure
    assert "(NCCL did not load aws-ofi-nccl): put /opt/amazon/ofi-nccl" in failure


def test_socket_next_to_ib_without_a_reason_in_the_log():
    log = NcclLog(networks={"Socket"}, net_channels={"Socket"}, num_lines=5)
    failure, _ = check_transport(ib_node(nccl_log=log), multi_node=True)
    assert "are active (NCCL did not select its IB transport)" in failure


def test_one_node_report_has_no_cross_node_notes():
    one = PreflightReport(backend="nccl", num_workers=8, nodes=[node("10.1.0.6", nccl_log=parse_nccl_log(SOCKET_LOG))])
    evaluate(one)
    assert one.passed and one.notes == []
