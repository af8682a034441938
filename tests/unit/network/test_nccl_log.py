"""raytrain.network.nccl_log on NCCL_DEBUG=INFO excerpts in NCCL's and aws-ofi-nccl's own formats."""

from __future__ import annotations

import pytest

from raytrain.network.nccl_log import NcclLog, parse_nccl_log
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
    NCCL_228_NO_IB_LOG,
    SINGLE_NODE_SOCKET_LOG,
    SOCKET_LOG,
)


def test_parse_ib_log():
    log = parse_nccl_log(IB_LOG)
    assert log.networks == {"IB"}
    assert log.net_channels == {"IB"} and log.gdr
    assert log.local_paths == {"P2P/CUMEM"}
    assert log.ib_devices == "[0]mlx5_ib0:1/IB [1]mlx5_ib1:1/IB [RO]"
    assert not log.ib_not_found and not log.uses_socket and not log.uses_libfabric
    # NCCL's internal IB transport needs no plugin: "No plugin found" is only a fact here.
    assert log.plugin_missing and log.ofi_version is None
    assert log.describe() == ("network IB; between nodes via NET/IB with GPUDirect RDMA; "
                              "within the node via P2P/CUMEM")


def test_parse_socket_log():
    log = parse_nccl_log(SOCKET_LOG)
    assert log.networks == {"Socket"} and log.net_channels == {"Socket"} and not log.gdr
    assert log.ib_not_found and log.uses_socket
    assert log.local_paths == {"SHM/direct"}
    assert log.ib_devices is None
    assert log.describe() == ("network Socket; between nodes via NET/Socket without GPUDirect RDMA; "
                              "within the node via SHM/direct")


@pytest.mark.parametrize("channel, gdr", [
    ("[send] via NET/IB/0(1)/GDRDMA", True),  # PXN: sent through local rank 1's NIC
    ("[send] via NET/IB/2(3)", False),
    ("[send] via NET/IB/0/GDRDMA(PCI)/Shared", True),  # NCCL >= 2.27: GDR over PCI, shared buffers
])
def test_gdr_on_proxied_and_annotated_channels(channel, gdr):
    log = parse_nccl_log(f"gpu-b:88:120 [1] NCCL INFO Channel 00/0 : 9[1] -> 0[0] {channel}")
    assert log.net_channels == {"IB"} and log.gdr is gdr


def test_channels_decide_the_transport_over_the_network_choice():
    assert not NcclLog(networks={"IB", "Socket"}, net_channels={"IB"}).uses_socket
    assert not NcclLog(networks={"Libfabric"}, net_channels={"Socket"}).uses_libfabric


def test_describe_without_transport_lines():
    assert parse_nccl_log("").describe() == "no NCCL INFO output"
    assert parse_nccl_log("Traceback: not from NCCL\n").describe() == "no NCCL INFO output"
    assert parse_nccl_log("h:1:2 [0] NCCL INFO Connected all rings\n").describe() == "no transport lines"


def test_parse_ibext_and_non_nccl_lines():
    log = parse_nccl_log(IBEXT_LOG + "some other stderr via NET/Socket/0, not an NCCL info line\n")
    assert log.networks == {"IBext_v8"} and log.net_channels == {"IBext_v8"}
    assert not log.uses_socket and log.num_lines == 2


def test_parse_nccl_228_without_hcas():
    log = parse_nccl_log(NCCL_228_NO_IB_LOG)
    assert log.networks == {"Socket"} and log.uses_socket and log.ib_not_found
    assert log.ib_devices is None  # "Using [RO]" lists no device
    assert log.failed_nets == {"IB"} and log.plugin_missing
    assert log.describe() == "network Socket"
    assert parse_nccl_log("h:1:2 [0] NCCL INFO Failed to initialize NET plugin IBext_v8").ib_not_found is False


def test_single_node_socket_choice_counts_without_net_channels():
    log = parse_nccl_log(SINGLE_NODE_SOCKET_LOG)
    assert not log.net_channels and log.uses_socket and log.local_paths == {"P2P/IPC"}


def test_parse_efa_at_head():
    log = parse_nccl_log(EFA_LOG)
    assert (log.ofi_version, log.ofi_provider) == ("1.21.1", "efa")
    assert log.networks == {"Libfabric"} and log.net_channels == {"Libfabric"} and log.gdr
    assert log.uses_libfabric and not log.uses_socket and not log.plugin_missing
    assert log.describe().startswith("aws-ofi-nccl 1.21.1 on libfabric provider efa; network Libfabric; "
                                     "between nodes via NET/Libfabric with GPUDirect RDMA")


def test_parse_efa_named_aws_libfabric_by_nccl_net():
    log = parse_nccl_log(EFA_AWS_LIBFABRIC_LOG)
    assert (log.ofi_version, log.ofi_provider) == ("1.13.2-aws", "efa")  # "Selected Provider is" (<= 1.13)
    assert log.net_channels == {"AWS Libfabric"} and log.gdr and log.uses_libfabric


def test_parse_efa_without_the_plugin():
    socket = parse_nccl_log(EFA_NO_PLUGIN_SOCKET_LOG)
    assert socket.plugin_missing and socket.uses_socket and socket.ofi_version is None
    assert socket.num_lines == 6  # the WARN line counts too
    pinned = parse_nccl_log(EFA_NO_PLUGIN_PINNED_LOG)
    assert pinned.plugin_missing and pinned.failed_nets == {"any"} and not pinned.networks
    assert not pinned.uses_socket and not pinned.uses_libfabric
    assert pinned.describe() == "NCCL could initialise no network"


def test_parse_plugin_that_does_not_load():
    log = parse_nccl_log(EFA_PLUGIN_LOAD_ERROR_LOG)
    assert not log.plugin_missing and log.uses_socket
    assert log.plugin_error == ("libnccl-net.so: libfabric.so.1: cannot open shared object file: "
                                "No such file or directory")
    old = parse_nccl_log("h:1:1 [0] NCCL INFO NET/Plugin: Plugin load returned 2 : libfabric.so.1: cannot open "
                         "shared object file: No such file or directory when loading libnccl-net.so")  # NCCL 2.21
    assert old.plugin_error == "libfabric.so.1: cannot open shared object file: No such file or directory"
    # The collective-net symbols are optional: their absence is no load error.
    assert parse_nccl_log(EFA_TCP_PROVIDER_LOG).plugin_error is None
    assert log.describe() == ("net plugin did not load (libnccl-net.so: libfabric.so.1: cannot open shared object "
                              "file: No such file or directory); network Socket")


def test_parse_tcp_provider_and_missing_devices():
    tcp = parse_nccl_log(EFA_TCP_PROVIDER_LOG)
    assert (tcp.ofi_version, tcp.ofi_provider) == ("1.12.1-aws", "tcp")
    assert tcp.uses_libfabric and not tcp.uses_socket  # libfabric, and TCP all the same
    none = parse_nccl_log(EFA_NO_DEVICES_LOG)
    assert none.ofi_version == "1.14.0" and none.ofi_provider is None
    assert none.ofi_error == "OFI fi_getinfo() call failed: No data available"  # the WARN line comes first
    assert none.uses_socket and none.failed_nets == {"IB"}
    assert none.describe() == "aws-ofi-nccl 1.14.0 on libfabric provider (none selected); network Socket"


def test_merge_keeps_every_rank_finding():
    merged = NcclLog()
    for text in (EFA_NO_PLUGIN_PINNED_LOG, EFA_LOG):
        merged.merge(parse_nccl_log(text))
    assert merged.plugin_missing and merged.ofi_provider == "efa" and merged.failed_nets == {"any"}
    assert merged.num_lines == 3 + 8


@pytest.mark.parametrize("text", [IB_LOG, SOCKET_LOG, EFA_LOG, EFA_PLUGIN_LOAD_ERROR_LOG, EFA_NO_DEVICES_LOG])
def test_merge_with_a_rank_that_logged_nothing(text):
    alone = parse_nccl_log(text)
    first, last = NcclLog(), parse_nccl_log(text)
    first.merge(parse_nccl_log(text))
    last.merge(NcclLog())
    assert first == alone and last == alone
