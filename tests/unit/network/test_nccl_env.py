"""raytrain.network.nccl_env on fake /sys and / trees: which NCCL/Gloo variables each node gets, and why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raytrain import nccl_variables
from raytrain.network import nccl_env
from raytrain.network.nccl_env import compute_nccl_env, find_ib_ports, select_fabric

NODE_IP = "10.0.0.5"
INTERFACES = {"lo": ["127.0.0.1", "::1"], "docker0": ["172.17.0.1"], "eth0": [NODE_IP], "ib0": ["192.168.1.5"]}
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def write(path: Path, text: str) -> None:
    """A file of the node's filesystem (under tmp_path / "root" or the sysfs), with its directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def add_port(sysfs: Path, device: str, port: int = 1, state: str = "4: ACTIVE", link_layer: str = "InfiniBand",
             gids: list[tuple[str, str | None]] | None = None, rate: str = "400 Gb/sec (4X NDR)") -> None:
    """One port as the kernel lays it out; gids: (gid, type or None when the type file is unreadable)."""
    d = sysfs / "class" / "infiniband" / device / "ports" / str(port)
    (d / "gids").mkdir(parents=True)
    (d / "gid_attrs" / "types").mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "link_layer").write_text(link_layer + "\n")
    (d / "rate").write_text(rate + "\n")
    for i, (gid, gid_type) in enumerate(gids or [("fe80:0000:0000:0000:0c42:a103:0065:d6b6", "IB/RoCE v1")]):
        (d / "gids" / str(i)).write_text(gid + "\n")
        if gid_type is not None:
            (d / "gid_attrs" / "types" / str(i)).write_text(gid_type + "\n")


def add_efa(sysfs: Path, device: str, pci: str, driver_link: bool = True, pci_device_id: str = "0xefa1",
            rate: str = "100 Gb/sec (4X EDR)") -> None:
    """An EFA device as the kernel's efa driver registers it: link layer Unknown (efa_port_link_layer
    returns IB_LINK_LAYER_UNSPECIFIED), state ACTIVE, class/infiniband/<dev>/device -> its PCI function,
    whose driver links to bus/pci/drivers/efa."""
    add_port(sysfs, device, link_layer="Unknown", gids=[("fe80:0000:0000:0000:0472:d2ff:fe63:a1b0", None)], rate=rate)
    function = sysfs / "devices" / "pci0000:00" / pci
    function.mkdir(parents=True)
    (function / "vendor").write_text("0x1d0f\n")
    (function / "device").write_text(pci_device_id + "\n")
    if driver_link:
        (sysfs / "bus" / "pci" / "drivers" / "efa").mkdir(parents=True, exist_ok=True)
        (function / "driver").symlink_to(sysfs / "bus" / "pci" / "drivers" / "efa")
    (sysfs / "class" / "infiniband" / device / "device").symlink_to(function)


def plan_for(tmp_path: Path, node_ip: str = NODE_IP, interfaces: dict | None = None, user_env: dict | None = None,
             forced: dict | None = None, **kw):
    return compute_nccl_env(node_ip, sysfs_root=str(tmp_path / "sys"), interfaces=interfaces or INTERFACES,
                            fs_root=str(tmp_path / "root"), user_env=user_env or {}, forced=forced, **kw)


def test_one_active_infiniband_hca(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    plan = plan_for(tmp_path)
    assert plan.env["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert plan.env["NCCL_SOCKET_IFNAME"] == "=eth0"
    assert plan.env["GLOO_SOCKET_IFNAME"] == "eth0"
    # InfiniBand link layer: no GID index, no RoCE tuning, and bare metal keeps NCCL's relaxed-ordering auto mode.
    for key in ("NCCL_IB_GID_INDEX", "NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_NET_GDR_LEVEL"):
        assert key not in plan.env
    assert any("1 active InfiniBand port" in n for n in plan.notes)


def test_hca_names_are_exact_and_in_natural_order(tmp_path):
    for dev in ("mlx5_10", "mlx5_2", "mlx5_1"):
        add_port(tmp_path / "sys", dev)
    # Without "=", NCCL would read mlx5_1 as a prefix that also selects mlx5_10.
    assert plan_for(tmp_path).env["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_2:1,mlx5_10:1"


def test_azure_nd_h100_v5_node(tmp_path):
    sysfs = tmp_path / "sys"
    for i in range(8):
        add_port(sysfs, f"mlx5_ib{i}", state="1: DOWN" if i == 3 else "4: ACTIVE")
    # The accelerated-networking NIC is an RDMA device too, but Ethernet and on another network.
    add_port(sysfs, "mlx5_an0", link_layer="Ethernet",
             gids=[("fe80:0000:0000:0000:0222:48ff:fe65:bc8d", "RoCE v2")])
    (sysfs / "class" / "dmi" / "id").mkdir(parents=True)
    (sysfs / "class" / "dmi" / "id" / "sys_vendor").write_text("Microsoft Corporation\n")
    (sysfs / "module" / "nvidia_peermem").mkdir(parents=True)
    root = tmp_path / "root" / "opt" / "microsoft"
    (root / "ndv5").mkdir(parents=True)
    for name in ("ndv4-topo.xml", "ndv5-topo.xml", "ndv5/topo.xml"):
        (root / name).write_text("<system/>")

    plan = plan_for(tmp_path)
    assert plan.env["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_ib{i}:1" for i in range(8) if i != 3)
    assert plan.env["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert plan.env["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    assert plan.env["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5/topo.xml"  # the node's path, not the fake root's
    assert "NCCL_IB_GID_INDEX" not in plan.env
    assert any("mlx5_ib3:1" in n and "not ACTIVE" in n for n in plan.notes)
    assert any("mlx5_an0:1" in n and "left out" in n for n in plan.notes)


def test_down_port_is_listed_by_find_ib_ports_but_not_used(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0", port=1)
    add_port(tmp_path / "sys", "mlx5_0", port=2, state="1: DOWN")
    ports = find_ib_ports(str(tmp_path / "sys"))
    assert [(p.name, p.active) for p in ports] == [("mlx5_0:1", True), ("mlx5_0:2", False)]
    assert plan_for(tmp_path).env["NCCL_IB_HCA"] == "=mlx5_0:1"


ROCE_TABLE = [
    ("fe80:0000:0000:0000:a288:c2ff:fe3b:506a", "IB/RoCE v1"),
    ("fe80:0000:0000:0000:a288:c2ff:fe3b:506a", "RoCE v2"),
    ("0000:0000:0000:0000:0000:ffff:0ac8:010a", "IB/RoCE v1"),
    (ZERO, "RoCE v2"),  # an unpopulated slot must never win, whatever its type file says
    ("0000:0000:0000:0000:0000:ffff:0ac8:010a", "RoCE v2"),
    ("2010:0200:0000:0002:a288:c2ff:fe3b:506a", "RoCE v2"),
]


@pytest.mark.parametrize("table, expected", [
    (ROCE_TABLE, 4),  # IPv4-mapped RoCE v2
    (ROCE_TABLE[:4] + [ROCE_TABLE[5]], 4),  # no IPv4 v2: global IPv6 (index 4 here) beats link-local
    (ROCE_TABLE[:2] + [(ZERO, None)], 1),  # only link-local v2 left
])
def test_roce_gid_index_is_the_best_roce_v2_gid(tmp_path, table, expected):
    add_port(tmp_path / "sys", "mlx5_0", link_layer="Ethernet", gids=table)
    plan = plan_for(tmp_path)
    assert plan.env["NCCL_IB_GID_INDEX"] == str(expected)
    assert plan.env["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert plan.env["NCCL_IB_QPS_PER_CONNECTION"] == "4"
    assert any("RoCE" in n for n in plan.notes)


def test_roce_port_without_v2_gid_is_left_out(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0", link_layer="Ethernet", gids=ROCE_TABLE[:1] + ROCE_TABLE[2:4])
    plan = plan_for(tmp_path)
    assert "NCCL_IB_HCA" not in plan.env
    assert any("no RoCE v2 GID" in n for n in plan.notes)
    assert any("NCCL will use TCP sockets" in n for n in plan.notes)


def test_roce_gid_index_differing_across_hcas_is_left_to_nccl(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0", link_layer="Ethernet", gids=ROCE_TABLE)
    add_port(tmp_path / "sys", "mlx5_1", link_layer="Ethernet", gids=ROCE_TABLE[:2])
    plan = plan_for(tmp_path)
    assert plan.env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    assert "NCCL_IB_GID_INDEX" not in plan.env
    assert any("mlx5_0:1: 4" in n and "mlx5_1:1: 1" in n for n in plan.notes)


def test_no_infiniband_means_tcp_sockets_said_plainly(tmp_path):
    (tmp_path / "sys" / "module" / "nvidia_peermem").mkdir(parents=True)
    plan = plan_for(tmp_path)
    assert set(plan.env) == {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}  # no IB-only settings, GDR included
    assert any(n.startswith(f"no active RDMA port (InfiniBand, RoCE or EFA) on {NODE_IP}: NCCL will use TCP sockets "
                            "(NET/Socket) over eth0") and "no RDMA devices" in n for n in plan.notes)


def test_all_ports_down_means_tcp_sockets(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0", state="1: DOWN")
    plan = plan_for(tmp_path)
    assert "NCCL_IB_HCA" not in plan.env
    assert any("NCCL will use TCP sockets" in n and "no usable port" in n for n in plan.notes)


def test_user_environment_is_kept_and_network_env_wins(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    add_port(tmp_path / "sys", "mlx5_1")
    user = {"NCCL_IB_HCA": "=mlx5_1:1", "NCCL_DEBUG": "WARN"}
    forced = {"NCCL_SOCKET_IFNAME": "=ib0", "NCCL_DEBUG": "INFO"}
    plan = plan_for(tmp_path, user_env=user, forced=forced)
    assert "NCCL_IB_HCA" not in plan.env  # the worker keeps its own value
    assert plan.env["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert plan.env["NCCL_DEBUG"] == "INFO"
    assert plan.env["GLOO_SOCKET_IFNAME"] == "eth0"  # computed where nobody else decided
    assert any("kept NCCL_IB_HCA==mlx5_1:1 from the worker environment" in n for n in plan.notes)
    assert any("NCCL_DEBUG=INFO from network.env replaces" in n for n in plan.notes)


def test_nccl_conf_files_are_kept(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    write(tmp_path / "root" / "etc" / "nccl.conf", "# admin\nNCCL_IB_HCA==mlx5_0:1,mlx5_9:1\n")
    write(tmp_path / "root" / "home" / "u" / ".nccl.conf", "GLOO_SOCKET_IFNAME=ib0\n")
    plan = plan_for(tmp_path, user_env={"HOME": "/home/u"})
    # An environment variable would silently beat the files NCCL reads, so raytrain leaves these alone.
    assert "NCCL_IB_HCA" not in plan.env and "GLOO_SOCKET_IFNAME" not in plan.env
    assert any("from /etc/nccl.conf" in n for n in plan.notes)
    assert any("from /home/u/.nccl.conf" in n for n in plan.notes)


@pytest.mark.parametrize("module", ["module/nvidia_peermem", "module/nv_peer_mem",
                                    "kernel/mm/memory_peers/nv_mem/version"])
def test_gpudirect_rdma_with_peer_memory_module(tmp_path, module):
    add_port(tmp_path / "sys", "mlx5_0")
    (tmp_path / "sys" / module).mkdir(parents=True)
    assert plan_for(tmp_path).env["NCCL_NET_GDR_LEVEL"] == "PHB"


def test_no_peer_memory_module_leaves_gdr_level(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    plan = plan_for(tmp_path)
    assert "NCCL_NET_GDR_LEVEL" not in plan.env
    assert any("nvidia_peermem not loaded" in n for n in plan.notes)


def test_topology_file_of_this_sku_only(tmp_path):
    ms = tmp_path / "root" / "opt" / "microsoft"
    (ms / "ncv4").mkdir(parents=True)
    (ms / "ndv5-topo.xml").write_text("<system/>")
    assert "NCCL_TOPO_FILE" not in plan_for(tmp_path).env  # flat files ship on every SKU
    (ms / "ncv4" / "topo.xml").write_text("<system/>")
    (ms / "ncv4" / "graph.xml").write_text("<graphs/>")
    env = plan_for(tmp_path).env
    assert env["NCCL_TOPO_FILE"] == "/opt/microsoft/ncv4/topo.xml"
    assert env["NCCL_GRAPH_FILE"] == "/opt/microsoft/ncv4/graph.xml"


@pytest.mark.parametrize("node_ip, interfaces", [
    ("127.0.0.1", {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"]}),
    ("172.17.0.1", {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.0.0.5"]}),
    ("172.18.0.1", {"br-1a2b": ["172.18.0.1"], "veth9f": ["172.18.0.1"]}),
    ("10.9.9.9", {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"]}),  # node IP on no interface
])
def test_socket_ifname_never_loopback_or_container_bridge(tmp_path, node_ip, interfaces):
    plan = plan_for(tmp_path, node_ip=node_ip, interfaces=interfaces)
    assert "NCCL_SOCKET_IFNAME" not in plan.env and "GLOO_SOCKET_IFNAME" not in plan.env
    assert any(f"node IP {node_ip}" in n and "left unset" in n for n in plan.notes)


def test_socket_ifname_follows_node_ip_past_bridges(tmp_path):
    interfaces = {"docker0": ["172.17.0.1"], "bond0": ["10.1.2.3"], "eth0": [NODE_IP]}
    assert plan_for(tmp_path, node_ip="10.1.2.3", interfaces=interfaces).env["NCCL_SOCKET_IFNAME"] == "=bond0"


def test_auto_configure_false_applies_only_network_env(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    plan = plan_for(tmp_path, forced={"NCCL_DEBUG": "INFO"}, auto_configure=False)
    assert plan.env == {"NCCL_DEBUG": "INFO"}


def test_ports_report_their_link_rate(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    add_port(tmp_path / "sys", "mlx5_1", rate="2.5 Gb/sec (1X SDR)")
    add_port(tmp_path / "sys", "mlx5_2", rate="")
    assert [p.rate_gbps for p in find_ib_ports(str(tmp_path / "sys"))] == [400.0, 2.5, None]


def p5_node(sysfs: Path, num_devices: int = 32) -> None:
    # p5.48xlarge: 32 EFA devices, named rdmap<bus>s<slot> by udev (efa_<n> by the kernel).
    for i in range(num_devices):
        add_efa(sysfs, f"rdmap{79 + i}s0", pci=f"0000:{79 + i:02x}:00.0")


def test_efa_node_gets_aws_ofi_nccl_settings_and_no_ib_ones(tmp_path):
    sysfs = tmp_path / "sys"
    p5_node(sysfs)
    (sysfs / "module" / "nvidia_peermem").mkdir(parents=True)  # loaded on the DLAMI: still no GDR level
    ports = find_ib_ports(str(sysfs))
    assert len(ports) == 32 and all(p.is_efa and p.active and p.link_layer == "Unknown" for p in ports)
    assert ports[0].rate_gbps == 100.0
    plan = plan_for(tmp_path, interfaces={"lo": ["127.0.0.1"], "enp71s0": [NODE_IP]})
    assert plan.env == {"NCCL_SOCKET_IFNAME": "=enp71s0", "GLOO_SOCKET_IFNAME": "enp71s0", "FI_PROVIDER": "efa",
                        "NCCL_NET": "AWS Libfabric"}
    assert any(n.startswith(f"32 EFA device(s) on {NODE_IP} (rdmap79s0:1, rdmap80s0:1, rdmap81s0:1, rdmap82s0:1 "
                            "and 28 more): NCCL reaches EFA only through the aws-ofi-nccl plugin") for n in plan.notes)
    assert any(n.startswith("NCCL_NET=AWS Libfabric: NCCL stops") for n in plan.notes)
    assert not any("NCCL will use TCP" in n for n in plan.notes)


def test_efa_on_one_node_leaves_nccl_net_unset(tmp_path):
    # NCCL initialises a network for a one-node communicator too: pinned to a missing plugin, a run
    # whose traffic never leaves the node would fail.
    p5_node(tmp_path / "sys", num_devices=4)
    plan = plan_for(tmp_path, multi_node=False)
    assert plan.env["FI_PROVIDER"] == "efa" and "NCCL_NET" not in plan.env
    assert "one node: NCCL_NET left unset, no traffic leaves the node" in plan.notes
    # Exactly 4 devices: all named, no "and 0 more"; no verbs port, so no "left out" note.
    assert any(n.startswith(f"4 EFA device(s) on {NODE_IP} (rdmap79s0:1, rdmap80s0:1, rdmap81s0:1, rdmap82s0:1): ")
               for n in plan.notes)
    assert not any("left out" in n for n in plan.notes)


def test_efa_recognised_by_pci_ids_without_a_driver_link(tmp_path):
    add_efa(tmp_path / "sys", "efa_0", pci="0000:10:1c.0", driver_link=False, pci_device_id="0xefa2")
    add_efa(tmp_path / "sys", "efa_1", pci="0000:10:1d.0", driver_link=False, pci_device_id="0x1234")
    assert [(p.device, p.is_efa) for p in find_ib_ports(str(tmp_path / "sys"))] == [("efa_0", True), ("efa_1", False)]
    plan = plan_for(tmp_path)
    assert plan.env["NCCL_NET"] == "AWS Libfabric"
    # An "Unknown" link layer that is not EFA is neither InfiniBand nor RoCE: NCCL cannot use it.
    assert any("efa_1:1 has link layer Unknown and is not an EFA device: left out" in n for n in plan.notes)


def test_efa_settings_keep_the_precedence_rules(tmp_path):
    p5_node(tmp_path / "sys", num_devices=4)
    write(tmp_path / "root" / "etc" / "nccl.conf", "NCCL_NET=OFI\n")
    plan = plan_for(tmp_path, user_env={"FI_PROVIDER": "efa;ofi_rxd"}, forced={"FI_EFA_USE_HUGE_PAGE": "0"})
    assert "FI_PROVIDER" not in plan.env and "NCCL_NET" not in plan.env
    assert plan.env["FI_EFA_USE_HUGE_PAGE"] == "0"
    assert any("kept FI_PROVIDER=efa;ofi_rxd from the worker environment (raytrain would set efa)" in n
               for n in plan.notes)
    assert any("kept NCCL_NET=OFI from /etc/nccl.conf (raytrain would set AWS Libfabric)" in n for n in plan.notes)


def test_select_fabric_prefers_efa_and_leaves_verbs_ports_out(tmp_path):
    sysfs = tmp_path / "sys"
    p5_node(sysfs, num_devices=2)
    add_port(sysfs, "mlx5_0", link_layer="InfiniBand")  # e.g. a storage NIC next to the EFA devices
    notes: list[str] = []
    fabric = select_fabric(find_ib_ports(str(sysfs)), notes)
    assert (fabric.kind, [p.name for p in fabric.ports]) == ("EFA", ["rdmap79s0:1", "rdmap80s0:1"])
    assert notes == ["mlx5_0:1 left out: this node's fabric is EFA"]
    assert "NCCL_IB_HCA" not in plan_for(tmp_path).env


@pytest.mark.parametrize("name, meant", [
    ("NCCL_IB_HCAA", "NCCL_IB_HCA"), ("NCCL_SOCKET_IFNAM", "NCCL_SOCKET_IFNAME"), ("NCCL_DEBGU", "NCCL_DEBUG"),
    ("NCCL_AGLO", "NCCL_ALGO"), ("NCCL_NET_GDR_LVL", "NCCL_NET_GDR_LEVEL"), ("NCLL_DEBUG", "NCCL_DEBUG"),
    ("NCCL_IB_HCA", None), ("NCCL_BLOCKING_WAIT", None),  # PyTorch's older name: read
    ("NCCL_DEBUG_SUBSYSTEM", None), ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", None),  # not one typo: a note, not an error
    ("GLOO_SOCKET_IFNAME", None),
    ("NCCL_PXN_LEVEL", None)])  # two neighbours changed (NCCL_P2P_LEVEL): a note, not a refusal that stops the run
def test_a_misspelt_nccl_name_is_told_from_an_unknown_one(name, meant):
    assert nccl_variables.misspelling_of(name) == meant


def test_every_nccl_variable_raytrain_sets_is_known():
    names = set(re.findall(r"\bNCCL_[A-Z0-9_]+\b(?!\*)", Path(nccl_env.__file__).read_text()))  # not NCCL_IB_*
    assert {"NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_TOPO_FILE"} <= names
    assert names <= nccl_variables.KNOWN, names - nccl_variables.KNOWN


def test_network_env_names_nccl_does_not_read_are_set_with_a_note_not_forced(tmp_path):
    plan = plan_for(tmp_path, forced={"NCCL_NEW_KNOB": "1", "NCCL_DEBUG": "INFO"})
    assert plan.env["NCCL_NEW_KNOB"] == "1" and plan.env["NCCL_DEBUG"] == "INFO"
    assert "NCCL_DEBUG=INFO forced by network.env" in plan.notes
    [note] = [n for n in plan.notes if n.startswith("NCCL_NEW_KNOB")]
    assert note.startswith(f"NCCL_NEW_KNOB=1 set by network.env, but NCCL up to {nccl_variables.NEWEST_RELEASE} reads "
                           "no variable of that name") and "forced" not in note


def test_unknown_network_env_name_note_points_at_the_nearest_known_one(tmp_path):
    # Too far from NCCL_DEBUG_SUBSYS to be refused as a typo, yet NCCL ignores it without a word: the note is
    # the user's one chance to see which name NCCL reads. A name like none gets no "(nearest: None)".
    plan = plan_for(tmp_path, forced={"NCCL_DEBUG_SUBSYSTEM": "INIT,NET", "NCCL_NEW_KNOB": "1"})
    tail = "it does nothing unless this node's NCCL is newer or a plugin reads it"
    head = f"set by network.env, but NCCL up to {nccl_variables.NEWEST_RELEASE} reads no variable of that name"
    assert f"NCCL_DEBUG_SUBSYSTEM=INIT,NET {head} (nearest: NCCL_DEBUG_SUBSYS): {tail}" in plan.notes
    assert f"NCCL_NEW_KNOB=1 {head}: {tail}" in plan.notes


def test_notes_only_for_what_someone_else_decided(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    user = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth9", "NCCL_IB_DISABLE": "1"}
    plan = plan_for(tmp_path, user_env=user, forced={"NCCL_SOCKET_IFNAME": "=ib0"})
    # The same value as raytrain's says nothing; a forced key is reported once, as forced, never as kept.
    assert not any("GLOO_SOCKET_IFNAME" in n or n.startswith("kept NCCL_SOCKET_IFNAME") for n in plan.notes)
    assert "NCCL_SOCKET_IFNAME==ib0 from network.env replaces the worker environment's =eth9" in plan.notes
    assert "NCCL_IB_DISABLE=1 is set: NCCL will use TCP sockets whatever the HCAs above" in plan.notes


def test_default_environment_and_interfaces_are_this_process_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "=mlx5_7:1")
    add_port(tmp_path / "sys", "mlx5_0")
    plan = compute_nccl_env("127.0.0.1", sysfs_root=str(tmp_path / "sys"), fs_root=str(tmp_path / "root"))
    assert "NCCL_IB_HCA" not in plan.env and "NCCL_SOCKET_IFNAME" not in plan.env  # psutil: 127.0.0.1 is on lo
    assert any(n.startswith("kept NCCL_IB_HCA==mlx5_7:1 from the worker environment") for n in plan.notes)
    assert any("node IP 127.0.0.1 is on lo" in n and "(loopback or container bridge)" in n for n in plan.notes)


def test_node_ip_on_two_usable_interfaces_takes_the_first_and_says_so(tmp_path):
    two = {"eth1": [NODE_IP], "bond0": [NODE_IP], "lo": ["127.0.0.1"]}
    plan = plan_for(tmp_path, interfaces=two)
    assert plan.env["NCCL_SOCKET_IFNAME"] == "=bond0"
    assert f"node IP {NODE_IP} is on bond0, eth1: using bond0" in plan.notes
    assert not any(n.startswith("node IP") for n in plan_for(tmp_path).notes)  # one usable interface: no note


def test_several_azure_topology_files_leave_it_unset(tmp_path):
    ms = tmp_path / "root" / "opt" / "microsoft"
    write(ms / "ndv5" / "topo.xml", "<system/>")
    assert "NCCL_GRAPH_FILE" not in plan_for(tmp_path).env  # ND v5 ships no graph file
    write(ms / "ndv4" / "topo.xml", "<system/>")
    plan = plan_for(tmp_path)
    assert "NCCL_TOPO_FILE" not in plan.env
    assert "several Azure topology files (ndv5, ndv4): NCCL_TOPO_FILE left unset" in plan.notes


def test_roce_prefers_ipv4_mapped_over_a_lower_global_ipv6_gid(tmp_path):
    table = [ROCE_TABLE[5], ROCE_TABLE[1], ROCE_TABLE[4]]  # global IPv6 at 0, link-local at 1, IPv4-mapped at 2
    add_port(tmp_path / "sys", "mlx5_0", link_layer="Ethernet", gids=table)
    plan = plan_for(tmp_path)
    assert plan.env["NCCL_IB_GID_INDEX"] == "2"
    assert not any("no RoCE v2 GID" in n for n in plan.notes)


def test_no_usable_roce_port_is_no_fabric(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0", link_layer="Ethernet", gids=ROCE_TABLE[:1])
    fabric = select_fabric(find_ib_ports(str(tmp_path / "sys")), [])
    assert (fabric.kind, fabric.ports) == ("", [])  # the preflight reports this node as "no RDMA"


def test_unreadable_sysfs_corners_are_skipped(tmp_path):
    sysfs = tmp_path / "sys"
    (sysfs / "class" / "infiniband" / "mlx5_9").mkdir(parents=True)  # a device without ports/
    add_port(sysfs, "mlx5_0", link_layer="Ethernet", gids=ROCE_TABLE[4:5])
    gids = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "gids"
    (gids / "README").write_text(ROCE_TABLE[4][0])  # not a GID table slot
    (gids.parent / "gid_attrs" / "types" / "README").write_text("RoCE v2")
    add_port(sysfs, "mlx5_1", link_layer="Ethernet")
    for f in (sysfs / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "gids").iterdir():
        f.unlink()
    (sysfs / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "gids").rmdir()  # a port without a GID table
    ports = find_ib_ports(str(sysfs))
    assert [(p.name, p.roce_v2_gid_index) for p in ports] == [("mlx5_0:1", 0), ("mlx5_1:1", None)]


def test_efa_driver_link_is_enough_for_a_new_pci_id(tmp_path):
    add_efa(tmp_path / "sys", "rdmap0s0", pci="0000:10:1c.0", pci_device_id="0xefa9")
    assert [p.is_efa for p in find_ib_ports(str(tmp_path / "sys"))] == [True]


def test_nccl_conf_lines_without_a_value_are_not_settings(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    write(tmp_path / "root" / "etc" / "nccl.conf", "NCCL_IB_HCA\n#NCCL_SOCKET_IFNAME==ib0\n")
    assert plan_for(tmp_path).env["NCCL_IB_HCA"] == "=mlx5_0:1"


def test_node_ip_on_no_interface_is_said_so(tmp_path):
    plan = plan_for(tmp_path, node_ip="10.9.9.9")
    assert ("node IP 10.9.9.9 is on no interface of this machine (NAT?): NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME left "
            "unset") in plan.notes


def test_nccl_conf_file_replaces_the_home_one(tmp_path):
    add_port(tmp_path / "sys", "mlx5_0")
    write(tmp_path / "root" / "cfg" / "nccl.conf", "NCCL_IB_HCA==mlx5_0:1\n")
    write(tmp_path / "root" / "home" / "u" / ".nccl.conf", "GLOO_SOCKET_IFNAME=ib0\n")
    plan = plan_for(tmp_path, user_env={"HOME": "/home/u", "NCCL_CONF_FILE": "/cfg/nccl.conf"})
    assert "NCCL_IB_HCA" not in plan.env and plan.env["GLOO_SOCKET_IFNAME"] == "eth0"  # as NCCL: one or the other
    assert any(n.startswith("kept NCCL_IB_HCA==mlx5_0:1 from /cfg/nccl.conf") for n in plan.notes)
