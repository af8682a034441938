"""NCCL's INFO log: which network NCCL chose, how each channel connects, and why a net plugin did not load.

Start at `parse_nccl_log`: a pure function of NCCL_DEBUG=INFO text (NCCL_DEBUG_SUBSYS=INIT,NET is
enough), so tests feed it excerpts in the formats NCCL and aws-ofi-nccl print. The preflight
(raytrain.network.preflight_report.check_transport) turns a node's NcclLog into a verdict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# "NCCL INFO Using network IB" (init.cc, subsystem INIT): the network plugin this communicator uses.
_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
# "Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA" (net.cc, INIT|NET). The name is the
# plugin's: IB, Socket, IBext / IBext_v8 (HPC-X's SHARP plugin over InfiniBand), Libfabric or
# "AWS Libfabric" (aws-ofi-nccl). A send through another GPU's NIC (PXN) names that proxy rank after the
# device: "[send] via NET/IB/0(1)/GDRDMA" (net.cc sendSetup, proxyRank != rank).
_VIA_NET = re.compile(r"\] via NET/([^/]+)/\d+(?:\(\d+\))?(/GDRDMA)?")
# "... via P2P/CUMEM/read", "via P2P/IPC", "via SHM/direct/direct": paths inside a node.
_VIA_LOCAL = re.compile(r"\] via ((?:P2P|SHM)/[A-Za-z]+)")
# "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>". Without HCAs NCCL 2.28
# logs "NET/IB : No device found.", then "NET/IB : Using [RO]; OOB ..." (no devices) and "Failed to
# initialize NET plugin IB".
_IB_USING = re.compile(r"NET/IB ?: Using ((?:\[\d+\]\S+\s*)+(?:\[RO\])?)")
_IB_NONE = re.compile(r"NET/IB ?: No device found|Failed to initialize NET plugin IB\b")

# The external net plugin (libnccl-net.so; aws-ofi-nccl on EFA) was not found: "NET/Plugin: Could
# not find: libnccl-net.so" (NCCL >= 2.23), "NET/Plugin: No plugin found (libnccl-net.so)" (2.19-2.22),
# "NET/Plugin : No plugin found, using internal implementation" (older).
_PLUGIN_NOT_FOUND = re.compile(r"NET/Plugin ?: (?:Could not find|.*No plugin found)")
# Found but not loadable, with the loader's words: "NET/Plugin: libnccl-net.so: libfabric.so.1: cannot
# open shared object file ..." (plugin/plugin_open.cc), "NET/Plugin: Plugin load returned 2 : <dlerror>
# when loading libnccl-net.so" (2.19-2.22).
_PLUGIN_LOAD_ERROR = re.compile(
    r"NET/Plugin ?: (?:Plugin load returned \d+ : (.+?)(?: :)?(?: when loading \S+)?|(libnccl-net\S*\.so: .+?))\s*$"
    r"|(External network plugin \S+ is unsupported)")  # loaded, but no ncclNet version this NCCL knows
# aws-ofi-nccl prefixes all its lines with "NET/OFI" (include/nccl_ofi_log.h). "Initializing
# aws-ofi-nccl 1.14.2" (PACKAGE_STRING); "Selected provider is efa, fabric is efa-direct (found 32
# nics)" (HEAD) or "Selected Provider is efa (found 4 nics)" (1.7-1.13): libfabric's provider.
_OFI_VERSION = re.compile(r"NET/OFI Initializing aws-ofi-nccl (\S+)")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([\w-]+)")
# The plugin loaded but libfabric offered it no provider (FI_PROVIDER=efa without EFA devices in
# the container, or libfabric without its EFA provider).
_OFI_NO_PROVIDER = re.compile(r"NET/OFI ((?:No eligible providers were found|Couldn't find any optimal provider"
                              r"|OFI fi_getinfo\(\) call failed|aws-ofi-nccl initialization failed).*?)\s*$")
# "Failed to initialize NET plugin Libfabric" (INFO), "Failed to initialize any NET plugin" (WARN,
# NCCL >= 2.24: nothing NCCL_NET allows could start, so the communicator fails).
_NET_FAILED = re.compile(r"Failed to initialize (?:NET plugin (.+?)|(any NET plugin))\s*$")

LIBFABRIC_NETS = ("libfabric", "aws libfabric", "ofi")
"""aws-ofi-nccl's network names, lower case: "Libfabric" (1.13+), "AWS Libfabric" (<= 1.12, or when
NCCL_NET asks for it), "OFI" (when NCCL_NET asks for it)."""


@dataclass
class NcclLog:
    """What one node's NCCL INFO/WARN output says about transports (merged over its ranks)."""

    networks: set[str] = field(default_factory=set)
    """"Using network X" values: the network plugin NCCL selected (IB, Socket, IBext_v8, Libfabric, ...)."""
    net_channels: set[str] = field(default_factory=set)
    """Networks that channels to other nodes actually connect over ("via NET/<name>/...")."""
    gdr: bool = False
    """At least one network channel uses GPUDirect RDMA (/GDRDMA)."""
    local_paths: set[str] = field(default_factory=set)
    """Paths between GPUs of this node: P2P/CUMEM, P2P/IPC, SHM/direct, ..."""
    ib_devices: str | None = None
    """NCCL's own list of the IB devices it opened ("[0]mlx5_0:1/IB ..."), None if not logged."""
    ib_not_found: bool = False
    """NCCL said "NET/IB : No device found"."""
    plugin_missing: bool = False
    """NCCL found no external net plugin (libnccl-net.so) on the loader path."""
    plugin_error: str | None = None
    """The loader's error for a net plugin that exists but did not load (a missing libfabric, say)."""
    ofi_version: str | None = None
    """aws-ofi-nccl's version, when NCCL loaded it ("1.14.2", "1.12.1-aws")."""
    ofi_provider: str | None = None
    """The libfabric provider aws-ofi-nccl selected: "efa" is EFA, "tcp" (or "sockets") is TCP."""
    ofi_error: str | None = None
    """aws-ofi-nccl's words when libfabric offered it no provider ("No eligible providers were found")."""
    failed_nets: set[str] = field(default_factory=set)
    """Networks NCCL could not initialise ("Failed to initialize NET plugin X"); "any" when none could."""
    num_lines: int = 0

    def merge(self, other: "NcclLog") -> None:
        self.networks |= other.networks
        self.net_channels |= other.net_channels
        self.gdr = self.gdr or other.gdr
        self.local_paths |= other.local_paths
        self.ib_devices = self.ib_devices or other.ib_devices
        self.ib_not_found = self.ib_not_found or other.ib_not_found
        self.plugin_missing = self.plugin_missing or other.plugin_missing
        self.plugin_error = self.plugin_error or other.plugin_error
        self.ofi_version = self.ofi_version or other.ofi_version
        self.ofi_provider = self.ofi_provider or other.ofi_provider
        self.ofi_error = self.ofi_error or other.ofi_error
        self.failed_nets |= other.failed_nets
        self.num_lines += other.num_lines

    @property
    def uses_socket(self) -> bool:
        """Traffic between nodes goes (or would go) over TCP sockets."""
        if self.net_channels:
            return "Socket" in self.net_channels
        return "Socket" in self.networks

    @property
    def uses_libfabric(self) -> bool:
        """NCCL chose aws-ofi-nccl's network (whatever libfabric provider is under it)."""
        chosen = self.net_channels or self.networks
        return any(n.lower() in LIBFABRIC_NETS for n in chosen)

    def describe(self) -> str:
        if not self.num_lines:
            return "no NCCL INFO output"
        parts = []
        if self.ofi_version or self.ofi_provider:
            parts.append(f"aws-ofi-nccl {self.ofi_version or '(version not logged)'} on libfabric provider "
                         f"{self.ofi_provider or '(none selected)'}")
        elif self.plugin_error:
            parts.append(f"net plugin did not load ({self.plugin_error})")
        if self.networks:
            parts.append("network " + "/".join(sorted(self.networks)))
        if self.net_channels:
            parts.append("between nodes via " + ", ".join(f"NET/{n}" for n in sorted(self.net_channels))
                         + (" with GPUDirect RDMA" if self.gdr else " without GPUDirect RDMA"))
        if self.local_paths:
            parts.append("within the node via " + ", ".join(sorted(self.local_paths)))
        if "any" in self.failed_nets:
            parts.append("NCCL could initialise no network")
        return "; ".join(parts) or "no transport lines"


def parse_nccl_log(text: str) -> NcclLog:
    """Parse NCCL_DEBUG=INFO output (NCCL_DEBUG_SUBSYS=INIT,NET is enough). WARN lines count too:
    NCCL and aws-ofi-nccl report some failures only there."""
    log = NcclLog()
    for line in text.splitlines():
        if "NCCL INFO" not in line and "NCCL WARN" not in line:
            continue
        log.num_lines += 1
        if m := _USING_NETWORK.search(line):
            log.networks.add(m.group(1))
        if m := _VIA_NET.search(line):
            log.net_channels.add(m.group(1))
            log.gdr = log.gdr or bool(m.group(2))
        if m := _VIA_LOCAL.search(line):
            log.local_paths.add(m.group(1))
        if m := _IB_USING.search(line):
            log.ib_devices = m.group(1).strip()
        if _IB_NONE.search(line):
            log.ib_not_found = True
        if _PLUGIN_NOT_FOUND.search(line):
            log.plugin_missing = True
        elif m := _PLUGIN_LOAD_ERROR.search(line):
            log.plugin_error = log.plugin_error or next(g for g in m.groups() if g)
        if m := _OFI_VERSION.search(line):
            log.ofi_version = m.group(1)
        if m := _OFI_PROVIDER.search(line):
            log.ofi_provider = log.ofi_provider or m.group(1)
        if m := _OFI_NO_PROVIDER.search(line):
            log.ofi_error = log.ofi_error or m.group(1)
        if m := _NET_FAILED.search(line):
            log.failed_nets.add(m.group(1) or "any")
    return log
