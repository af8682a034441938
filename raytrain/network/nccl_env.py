"""NCCL over InfiniBand, RoCE or EFA: each node's NCCL/Gloo environment, derived from its own hardware.

Start at `compute_nccl_env`: a pure function of /sys, the interface table and the environment, so
tests run it on fake trees. Ray Train's backend (raytrain.network.backend) calls it on every worker
before the torch process group is created. `select_fabric` says which RDMA ports NCCL should use
between nodes; the preflight reads the same choice.

Precedence, highest first, and nothing below a level ever overwrites it:
  1. `network.env` (forced for this run; a misspelt NCCL_* name is refused when the config is read,
     raytrain.nccl_variables),
  2. the worker's own environment (the user's shell, Ray runtime_env, the container image),
  3. NCCL's config files ($NCCL_CONF_FILE or ~/.nccl.conf, then /etc/nccl.conf: the admin's
     choices; an environment variable would silently beat them, which is what ray#42652 was about),
  4. what raytrain computes here.
Every kept or skipped value is a line in `NcclPlan.notes`, printed once per node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain import nccl_variables


# Interfaces that never carry node-to-node traffic: loopback, container and VM bridges, veth pairs,
# CNI overlays. NCCL's own default (^docker,lo) only knows the first two.
_HOST_LOCAL_PREFIXES = ("docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "vxlan", "tunl",
                        "kube-")
_ROCE_V2 = "RoCE v2"
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_IPV4_MAPPED_GID = "0000:0000:0000:0000:0000:ffff:"
# Any of these means the peer-memory module that lets an HCA DMA straight into GPU memory is
# loaded; the same paths NCCL probes (nvidia_peermem today, nv_peer_mem on older MLNX_OFED).
_PEERMEM_PATHS = ("module/nvidia_peermem", "module/nv_peer_mem", "kernel/mm/memory_peers/nv_mem/version",
                  "kernel/mm/memory_peers/nv_mem_nc/version")
# Azure's HPC images ship every SKU's flat /opt/microsoft/<sku>-topo.xml on every VM, so those say
# nothing about this VM; the per-SKU directory is linked at boot on the matching SKU only.
_AZURE_SKU_DIRS = ("ndv5", "ndv4", "ndv2", "ncv4")
# AWS Elastic Fabric Adapter: the PCI ids of Amazon (0x1d0f) that the kernel's efa driver binds
# (drivers/infiniband/hw/efa/efa_main.c, efa_pci_tbl), for a /sys without the driver link.
_AMAZON_PCI_VENDOR = "0x1d0f"
_EFA_PCI_DEVICES = ("0xefa0", "0xefa1", "0xefa2", "0xefa3", "0xefa4")
# ports/N/rate as the kernel prints it: "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)".
_RATE = re.compile(r"^(\d+(?:\.\d+)?) Gb/sec")
# The name NCCL_NET gives aws-ofi-nccl: versions <= 1.12 call their network "AWS Libfabric", 1.13+
# "Libfabric" but rename themselves to "AWS Libfabric" when NCCL_NET asks for it (aws-ofi-nccl
# commit 7c014f0d, nvidia_plugin_name_fixup), so this one name matches every version.
AWS_OFI_NCCL_NET = "AWS Libfabric"


@dataclass
class IbPort:
    """One port of an RDMA device, as /sys/class/infiniband describes it."""

    device: str
    """HCA name, e.g. mlx5_ib0 (Azure) or mlx5_0."""
    port: int
    active: bool
    """state reads "4: ACTIVE": the only state in which NCCL can use the port."""
    link_layer: str
    """"InfiniBand", "Ethernet" for RoCE, "Unknown" for EFA (its driver reports no link layer)."""
    roce_v2_gid_index: int | None = None
    """Ethernet ports: index of the best RoCE v2 GID (None: the port can only do RoCE v1)."""
    is_efa: bool = False
    """An AWS Elastic Fabric Adapter (device/driver is efa, or Amazon's EFA PCI ids): NCCL reaches it only
    through the aws-ofi-nccl plugin, never through its own IB transport."""
    rate_gbps: float | None = None
    """ports/N/rate in Gb/s ("400 Gb/sec (4X NDR)" -> 400); None where unreadable. EFA drivers without the
    2024 patch "RDMA/efa: Report link speed according to device attributes" report 100 whatever the link."""

    @property
    def name(self) -> str:
        return f"{self.device}:{self.port}"


@dataclass
class Fabric:
    """The RDMA ports NCCL should use between nodes, all of one kind."""

    kind: str = ""
    """"InfiniBand", "RoCE", "EFA", or "" (none: NCCL uses TCP sockets between nodes)."""
    ports: list[IbPort] = field(default_factory=list)


@dataclass
class NcclPlan:
    """What raytrain sets in one worker process, and why."""

    env: dict[str, str] = field(default_factory=dict)
    """Variables to set: computed values nobody else set, plus `network.env`."""
    notes: list[str] = field(default_factory=list)
    """One line per decision or kept value, for the log and the run record."""


def compute_nccl_env(node_ip: str, sysfs_root: str = "/sys", interfaces: dict[str, list[str]] | None = None,
                     fs_root: str = "/", user_env: Mapping[str, str] | None = None,
                     forced: Mapping[str, str] | None = None, auto_configure: bool = True,
                     multi_node: bool = True) -> NcclPlan:
    """The NCCL/Gloo variables for the node whose Ray IP is `node_ip`.

    `interfaces` maps interface name -> addresses (None: read this machine's with psutil);
    `user_env` is the process environment (None: os.environ); `forced` is `network.env`;
    `multi_node`: the process group spans several nodes (only then does EFA's plugin matter).
    """
    user_env = os.environ if user_env is None else user_env
    forced = dict(forced or {})
    plan = NcclPlan()
    computed: dict[str, str] = {}
    if auto_configure:
        if interfaces is None:
            interfaces = _local_interfaces()
        computed = _compute(node_ip, sysfs_root, interfaces, fs_root, plan.notes, multi_node)
    else:
        plan.notes.append("network.auto_configure is false: only network.env is applied")

    from_files = _nccl_conf_values(fs_root, {**user_env, **forced})
    for key, value in computed.items():
        if key in forced:
            continue  # reported with the forced values below
        if key in user_env:
            if user_env[key] != value:
                plan.notes.append(f"kept {key}={user_env[key]} from the worker environment (raytrain would set {value})")
        elif key in from_files:
            file_value, path = from_files[key]
            plan.notes.append(f"kept {key}={file_value} from {path} (raytrain would set {value})")
        else:
            plan.env[key] = value
    for key, value in forced.items():
        plan.env[key] = value
        if key.startswith("NCCL_") and key not in nccl_variables.KNOWN:
            plan.notes.append(_unknown_note(key, value))
        elif key in user_env and user_env[key] != value:
            plan.notes.append(f"{key}={value} from network.env replaces the worker environment's {user_env[key]}")
        else:
            plan.notes.append(f"{key}={value} forced by network.env")
    if plan.env.get("NCCL_IB_DISABLE", user_env.get("NCCL_IB_DISABLE")) == "1":
        plan.notes.append("NCCL_IB_DISABLE=1 is set: NCCL will use TCP sockets whatever the HCAs above")
    return plan


def _unknown_note(key: str, value: str) -> str:
    """network.env's name that no NCCL up to nccl_variables.NEWEST_RELEASE reads. A misspelling of one
    it reads was refused on the driver (raytrain.config.NetworkConfig); this one may be a newer NCCL's
    or a plugin's variable, so it is set, and said to be unknown (NCCL says nothing of a name it ignores)."""
    like = nccl_variables.nearest(key)
    return (f"{key}={value} set by network.env, but NCCL up to {nccl_variables.NEWEST_RELEASE} reads no variable of "
            f"that name{f' (nearest: {like})' if like else ''}: it does nothing unless this node's NCCL is newer or "
            f"a plugin reads it")


def _compute(node_ip: str, sysfs_root: str, interfaces: Mapping[str, list[str]], fs_root: str,
             notes: list[str], multi_node: bool) -> dict[str, str]:
    env: dict[str, str] = {}
    ifname = _socket_ifname(node_ip, interfaces, notes)
    if ifname is not None:
        # Bootstrap and (without IB) all data go over the interface Ray itself reaches this node on.
        # "=" makes NCCL match the name exactly (plain "eth0" would also match eth0.100, eth01).
        env["NCCL_SOCKET_IFNAME"] = f"={ifname}"
        env["GLOO_SOCKET_IFNAME"] = ifname

    ports = find_ib_ports(sysfs_root)
    fabric = select_fabric(ports, notes)
    if fabric.kind == "EFA":
        env.update(_efa_env(fabric.ports, node_ip, notes, multi_node))
        return env  # no NCCL_IB_*, GDR level or topology file: aws-ofi-nccl decides those on EFA
    if not fabric.ports:
        why = "no RDMA devices in /sys/class/infiniband" if not ports else "no usable port (see above)"
        over = ifname or "the interface NCCL picks by default"
        notes.append(f"no active RDMA port (InfiniBand, RoCE or EFA) on {node_ip}: NCCL will use TCP sockets "
                     f"(NET/Socket) over {over} ({why}); expect a fraction of RDMA bandwidth between nodes")
    else:
        # Exact names ("=" prefix): a plain mlx5_1 would also select mlx5_10..mlx5_17.
        env["NCCL_IB_HCA"] = "=" + ",".join(p.name for p in fabric.ports)
        notes.append(f"{len(fabric.ports)} active {fabric.kind} port(s) on {node_ip}: NCCL_IB_HCA={env['NCCL_IB_HCA']}")
        if fabric.kind == "RoCE":
            env.update(_roce_env(fabric.ports, notes))
        env.update(_ib_extras(sysfs_root, notes))
        # NCCL_CROSS_NIC stays at NCCL's default (2: decided from the topology): forcing 0 or 1
        # only helps on a known rail layout, which /sys cannot tell us.

    topo = _platform_topology(fs_root, notes)
    env.update(topo)
    return env


def select_fabric(ports: list[IbPort], notes: list[str]) -> Fabric:
    """The ports NCCL should use between nodes: EFA devices, else InfiniBand, else RoCE v2; one note per
    port left out."""
    for p in ports:
        if not p.active:
            notes.append(f"{p.name} ({p.link_layer}) is not ACTIVE: left out")
    active = [p for p in ports if p.active]
    efa = [p for p in active if p.is_efa]
    verbs = [p for p in active if not p.is_efa]
    for p in verbs:
        if p.link_layer not in ("InfiniBand", "Ethernet"):
            notes.append(f"{p.name} has link layer {p.link_layer} and is not an EFA device: left out")
    ib = [p for p in verbs if p.link_layer == "InfiniBand"]
    roce = [p for p in verbs if p.link_layer == "Ethernet"]
    if efa:
        # EC2 offers no InfiniBand between instances: verbs ports next to EFA serve something else
        # (the mlx5 NICs of some HyperPod nodes, aws-samples/aws-do-eks#63).
        if ib or roce:
            notes.append(f"{', '.join(p.name for p in ib + roce)} left out: this node's fabric is EFA")
        return Fabric("EFA", efa)
    if ib and roce:
        # e.g. Azure's accelerated-networking NIC mlx5_an0 next to the mlx5_ib* fabric: NCCL pairs
        # list entries across ranks, and a RoCE port cannot reach an InfiniBand one.
        notes.append(f"Ethernet ports {', '.join(p.name for p in roce)} left out: this node has an InfiniBand fabric")
        return Fabric("InfiniBand", ib)
    if ib:
        return Fabric("InfiniBand", ib)
    for p in roce:
        if p.roce_v2_gid_index is None:
            notes.append(f"{p.name} has no RoCE v2 GID (RoCE v1 is not routable): left out")
    roce = [p for p in roce if p.roce_v2_gid_index is not None]
    return Fabric("RoCE", roce) if roce else Fabric()


def _efa_env(efa: list[IbPort], node_ip: str, notes: list[str], multi_node: bool) -> dict[str, str]:
    # Left unset as aws-ofi-nccl's doc/efa-env-var.md advises (libfabric >= 1.18, plugin >= 1.7):
    # FI_EFA_USE_DEVICE_RDMA, NCCL_PROTO=simple (plugin <= 1.5), FI_EFA_FORK_SAFE (the plugin sets it),
    # RDMAV_FORK_SAFE (breaks newer kernels); NCCL_TOPO_FILE: the plugin sets its own per instance type.
    notes.append(f"{len(efa)} EFA device(s) on {node_ip} ({_some(p.name for p in efa)}): NCCL reaches EFA only "
                 "through the aws-ofi-nccl plugin, which picks the devices and the topology file itself, so "
                 "NCCL_IB_HCA, NCCL_NET_GDR_LEVEL and NCCL_TOPO_FILE stay unset")
    # aws-ofi-nccl keeps only libfabric's efa provider when built with --enable-platform-aws, which
    # configure turns on only on an EC2 instance (m4/ax_platform_aws.m4); a plugin built elsewhere
    # takes the first provider, tcp included ("Selected Provider is tcp", aws-ofi-nccl#803).
    notes.append("FI_PROVIDER=efa: libfabric offers aws-ofi-nccl its EFA provider only, never its tcp one")
    env = {"FI_PROVIDER": "efa"}
    # NCCL_NET restricts NCCL to the named network: without the plugin, NCCL fails at its first
    # communicator ("Failed to initialize any NET plugin", plugin/net.cc ncclNetInit) instead of
    # silently training over NET/Socket. NCCL initialises a network for one node too, so a one-node
    # run, whose traffic never leaves the node, would fail as well: there it stays unset.
    if multi_node:
        env["NCCL_NET"] = AWS_OFI_NCCL_NET
        notes.append(f"NCCL_NET={AWS_OFI_NCCL_NET}: NCCL stops at its first communicator when aws-ofi-nccl is "
                     "missing or cannot start, instead of falling back to TCP (NET/Socket)")
    else:
        notes.append("one node: NCCL_NET left unset, no traffic leaves the node")
    return env


def _roce_env(roce: list[IbPort], notes: list[str]) -> dict[str, str]:
    env = {}
    indices = {p.roce_v2_gid_index for p in roce}
    if len(indices) == 1:
        # One index for all HCAs: older NCCL uses GID 0 (RoCE v1, link-local) unless told.
        env["NCCL_IB_GID_INDEX"] = str(indices.pop())
    else:
        per_port = ", ".join(f"{p.name}: {p.roce_v2_gid_index}" for p in roce)
        notes.append(f"RoCE v2 GID index differs across HCAs ({per_port}): NCCL_IB_GID_INDEX left for NCCL >= 2.21 "
                     "to pick per device")
    # Several queue pairs per connection give ECMP more flows to hash over paths; RoCE fabrics lack
    # InfiniBand's adaptive routing. Costs a little HCA memory per peer.
    env["NCCL_IB_QPS_PER_CONNECTION"] = "4"
    return env


def _ib_extras(sysfs_root: str, notes: list[str]) -> dict[str, str]:
    env = {}
    module = next((p for p in _PEERMEM_PATHS if os.path.exists(os.path.join(sysfs_root, p))), None)
    if module is not None:
        # NCCL's default allows GPUDirect RDMA only when GPU and HCA share a PCIe switch (PXB); in
        # VMs the virtual PCIe tree hides that, so allow it up to the host bridge (same CPU socket).
        env["NCCL_NET_GDR_LEVEL"] = "PHB"
        notes.append(f"GPUDirect RDMA available (/sys/{module}): NCCL_NET_GDR_LEVEL=PHB")
    else:
        notes.append("nvidia_peermem not loaded: GPUDirect RDMA only through DMA-BUF where kernel and driver "
                     "support it, otherwise network traffic is staged through host memory")
    if _read(os.path.join(sysfs_root, "class/dmi/id/sys_vendor")) == "Microsoft Corporation":
        # Hyper-V (Azure) hides the physical PCIe path, so NCCL's auto mode cannot enable relaxed
        # ordering; Azure's own HPC images force it on (in /etc/nccl.conf) for their IB HCAs.
        env["NCCL_IB_PCI_RELAXED_ORDERING"] = "1"
    return env


def _platform_topology(fs_root: str, notes: list[str]) -> dict[str, str]:
    found = [sku for sku in _AZURE_SKU_DIRS if os.path.isfile(_under(fs_root, f"/opt/microsoft/{sku}/topo.xml"))]
    if len(found) > 1:
        notes.append(f"several Azure topology files ({', '.join(found)}): NCCL_TOPO_FILE left unset")
        return {}
    if not found:
        return {}
    # The VM's real PCIe/NUMA layout; without it NCCL misreads the virtual topology and runs slower.
    env = {"NCCL_TOPO_FILE": f"/opt/microsoft/{found[0]}/topo.xml"}
    graph = f"/opt/microsoft/{found[0]}/graph.xml"
    if os.path.isfile(_under(fs_root, graph)):
        env["NCCL_GRAPH_FILE"] = graph  # NCv4 ships hand-tuned rings with its topology
    notes.append(f"Azure {found[0]} topology: NCCL_TOPO_FILE={env['NCCL_TOPO_FILE']}")
    return env


# ---------------------------------------------------------------------------------------------
# Reading the machine.


def find_ib_ports(sysfs_root: str = "/sys") -> list[IbPort]:
    """Every port under <sysfs_root>/class/infiniband, in natural device order (mlx5_2 before mlx5_10)."""
    base = os.path.join(sysfs_root, "class", "infiniband")
    if not os.path.isdir(base):
        return []
    ports = []
    for device in sorted(os.listdir(base), key=_natural):
        ports_dir = os.path.join(base, device, "ports")
        if not os.path.isdir(ports_dir):
            continue
        for port in sorted(os.listdir(ports_dir), key=_natural):
            d = os.path.join(ports_dir, port)
            link_layer = _read(os.path.join(d, "link_layer")) or "InfiniBand"
            rate = _RATE.match(_read(os.path.join(d, "rate")))
            ports.append(IbPort(
                device=device, port=int(port), active=_read(os.path.join(d, "state")).endswith("ACTIVE"),
                link_layer=link_layer,
                roce_v2_gid_index=_best_roce_v2_gid(d) if link_layer == "Ethernet" else None,
                is_efa=_is_efa(os.path.join(base, device)), rate_gbps=float(rate.group(1)) if rate else None))
    return ports


def _is_efa(device_dir: str) -> bool:
    pci = os.path.join(device_dir, "device")
    if os.path.basename(os.path.realpath(os.path.join(pci, "driver"))) == "efa":
        return True
    return (_read(os.path.join(pci, "vendor")).lower() == _AMAZON_PCI_VENDOR
            and _read(os.path.join(pci, "device")).lower() in _EFA_PCI_DEVICES)


def _best_roce_v2_gid(port_dir: str) -> int | None:
    """Lowest-index RoCE v2 GID, preferring IPv4-mapped, then global IPv6, then link-local (fe80)."""
    gids_dir = os.path.join(port_dir, "gids")
    if not os.path.isdir(gids_dir):
        return None
    candidates = []
    for entry in os.listdir(gids_dir):
        if not entry.isdigit():
            continue
        gid = _read(os.path.join(gids_dir, entry)).lower()
        # Unpopulated table slots read as zeros (and their type file fails to read).
        if not gid or gid == _ZERO_GID:
            continue
        if _read(os.path.join(port_dir, "gid_attrs", "types", entry)) != _ROCE_V2:
            continue
        preference = 0 if gid.startswith(_IPV4_MAPPED_GID) else 2 if gid.startswith("fe80:") else 1
        candidates.append((preference, int(entry)))
    return min(candidates)[1] if candidates else None


def _socket_ifname(node_ip: str, interfaces: Mapping[str, list[str]], notes: list[str]) -> str | None:
    owners = sorted(name for name, addrs in interfaces.items() if node_ip in addrs)
    usable = [n for n in owners if n != "lo" and not n.startswith(_HOST_LOCAL_PREFIXES)]
    if usable:
        if len(usable) > 1:
            notes.append(f"node IP {node_ip} is on {', '.join(usable)}: using {usable[0]}")
        return usable[0]
    if owners:
        notes.append(f"node IP {node_ip} is on {', '.join(owners)} (loopback or container bridge): "
                     "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME left unset, NCCL and Gloo pick by their defaults")
    else:
        notes.append(f"node IP {node_ip} is on no interface of this machine (NAT?): "
                     "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME left unset")
    return None


def _local_interfaces() -> dict[str, list[str]]:
    import psutil  # ships with Ray

    # IPv6 link-local addresses carry a %scope suffix that Ray's node IP never has.
    return {name: [a.address.split("%")[0] for a in addrs]
            for name, addrs in psutil.net_if_addrs().items()}


def _nccl_conf_values(fs_root: str, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """KEY -> (value, file) from the config files NCCL itself reads, in NCCL's order (first wins)."""
    paths = []
    if env.get("NCCL_CONF_FILE"):
        paths.append(env["NCCL_CONF_FILE"])
    elif env.get("HOME"):
        paths.append(os.path.join(env["HOME"], ".nccl.conf"))
    paths.append("/etc/nccl.conf")
    values: dict[str, tuple[str, str]] = {}
    for path in paths:
        try:
            with open(_under(fs_root, path)) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, sep, value = line.partition("=")
            if sep and key.strip() and not line.startswith("#"):
                values.setdefault(key.strip(), (value, path))
    return values


def _under(fs_root: str, path: str) -> str:
    return os.path.join(fs_root, path.lstrip("/"))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # absent, or sysfs refusing to read an unpopulated entry (EINVAL)
        return ""


def _some(names: Iterable[str], shown: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
