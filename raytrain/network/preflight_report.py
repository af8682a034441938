"""The preflight's report: nccl-tests' bandwidth arithmetic, NCCL's INFO log, the facts and the verdict.

Start at `PreflightReport.evaluate`: pure functions of what the workers measured and saw (so unit
tests feed them directly): versions agree across nodes (`check_agreement`), NCCL uses InfiniBand
where it exists (`check_transport`), all-reduce bus bandwidth meets the minimums
(`check_bandwidth`). The measuring itself is raytrain.network.preflight.

GB/s here is 10^9 bytes per second, as nccl-tests prints it (not gigabits: NDR is 400 Gb/s = 50 GB/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from raytrain.config import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter")
MIB = 1 << 20
GIB = 1 << 30
# nccl-tests' `-b 1M -e 1G -f 2`: 11 sizes. The small end shows latency, the large end bandwidth.
DEFAULT_GPU_SIZES = tuple(MIB << i for i in range(11))
# gloo moves CPU memory through TCP: a 1 GiB sweep would take minutes and prove nothing extra.
DEFAULT_CPU_SIZES = tuple(MIB << i for i in range(5))  # 1 MiB .. 16 MiB

# Defaults for GPU runs (CPU runs check nothing unless a minimum is given). The verdict uses the
# all-reduce busbw at the largest size measured, where bandwidth, not latency, dominates. The goal
# is to catch a broken or misconfigured fabric (factors of 2-10), not 10% drift.
#
# Within a node: H100/H200 SXM have NVLink 4 through NVSwitch, 450 GB/s per GPU per direction.
# NCCL's reference all-reduce busbw on 8 x H200 is about 475 GB/s with NVLink SHARP (NVLS);
# rings/trees without NVLS (NCCL_NVLS_ENABLE=0, as in containers without multicast) land lower,
# typically 350-400 GB/s. 300 stays below both, and far above what GPUs talking over PCIe or host
# memory reach (tens of GB/s), so such a node fails clearly. For PCIe-only GPUs pass 0 or a figure
# of your own.
DEFAULT_MIN_NVLINK_BUSBW_GBS = 300.0
# Across nodes, per NIC: NDR InfiniBand is 400 Gb/s = 50 GB/s per direction. With one rank per
# node, all-reduce busbw approaches the link rate of the NIC that rank uses (busbw is normalised
# to it), about 45-48 GB/s on a healthy NDR rail. 40 (80% of line rate) fails a link trained down
# to HDR (25 GB/s), traffic staged through host memory without GPUDirect RDMA on a busy host, and
# TCP (a few GB/s). The all-ranks group is held to this figure times the rails in use per node
# (min(ranks per node, active RDMA ports)): 8 x 40 = 320 GB/s on an 8-rail H100/H200 node.
DEFAULT_MIN_IB_BUSBW_GBS = 40.0

INTRA, ONE_PER_NODE, ALL_RANKS = "intra_node", "one_rank_per_node", "all_ranks"
PHASES = (INTRA, ONE_PER_NODE, ALL_RANKS)


# ---------------------------------------------------------------------------------------------
# nccl-tests arithmetic (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md).


def bus_factor(op: str, num_ranks: int) -> float:
    """busbw / algbw: the share of the data each rank's link must carry, so that busbw compares with
    the hardware's link bandwidth whatever the rank count. 0 for one rank (nothing crosses a link)."""
    n = num_ranks
    if op == "all_reduce":
        return 2 * (n - 1) / n  # a reduce-scatter followed by an all-gather
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")


def algbw_gbs(size_bytes: int, time_s: float) -> float:
    """nccl-tests' algbw: the message size over the time of one collective, in GB/s (10^9 bytes/s).
    `size_bytes` is the full message: the all-reduce buffer, the gathered output of an all-gather,
    the input of a reduce-scatter (n times what each rank receives or sends)."""
    return size_bytes / time_s / 1e9


def busbw_gbs(op: str, size_bytes: int, time_s: float, num_ranks: int) -> float:
    return algbw_gbs(size_bytes, time_s) * bus_factor(op, num_ranks)


def parse_sizes(text: str) -> list[int]:
    """"1M,4M,1G" -> bytes. K/M/G are powers of 1024, as in nccl-tests' -b/-e; plain numbers are bytes."""
    sizes = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", item, re.IGNORECASE)
        if not m:
            raise ConfigError(f"--sizes: {item.strip()!r} is not a size; write for example 1M,64M,1G")
        size = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": MIB, "G": GIB}[m.group(2).upper()]
        if size < 1:
            raise ConfigError(f"--sizes: {item.strip()!r} is zero; sizes must be positive")
        sizes.append(size)
    return sorted(set(sizes))


def format_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"


# ---------------------------------------------------------------------------------------------
# NCCL's INFO log: which network it chose and how each channel connects.

# "NCCL INFO Using network IB" (init.cc, subsystem INIT): the network plugin this communicator uses.
_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
# "Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA" (net.cc, INIT|NET). The name is the
# plugin's: IB, Socket, IBext / IBext_v8 (HPC-X's SHARP plugin over InfiniBand), "AWS Libfabric".
_VIA_NET = re.compile(r"\] via NET/([^/]+)/\d+(/GDRDMA)?")
# "... via P2P/CUMEM/read", "via P2P/IPC", "via SHM/direct/direct": paths inside a node.
_VIA_LOCAL = re.compile(r"\] via ((?:P2P|SHM)/[A-Za-z]+)")
# "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>". Without HCAs NCCL 2.28
# logs "NET/IB : No device found.", then "NET/IB : Using [RO]; OOB ..." (no devices) and "Failed to
# initialize NET plugin IB".
_IB_USING = re.compile(r"NET/IB ?: Using ((?:\[\d+\]\S+\s*)+(?:\[RO\])?)")
_IB_NONE = re.compile(r"NET/IB ?: No device found|Failed to initialize NET plugin IB\b")


@dataclass
class NcclLog:
    """What one node's NCCL INFO output says about transports (merged over its ranks)."""

    networks: set[str] = field(default_factory=set)
    """"Using network X" values: the network plugin NCCL selected (IB, Socket, IBext_v8, ...)."""
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
    num_lines: int = 0

    def merge(self, other: "NcclLog") -> None:
        self.networks |= other.networks
        self.net_channels |= other.net_channels
        self.gdr = self.gdr or other.gdr
        self.local_paths |= other.local_paths
        self.ib_devices = self.ib_devices or other.ib_devices
        self.ib_not_found = self.ib_not_found or other.ib_not_found
        self.num_lines += other.num_lines

    @property
    def uses_socket(self) -> bool:
        """Traffic between nodes goes (or would go) over TCP sockets."""
        if self.net_channels:
            return "Socket" in self.net_channels
        return "Socket" in self.networks

    def describe(self) -> str:
        if not self.num_lines:
            return "no NCCL INFO output"
        parts = []
        if self.networks:
            parts.append("network " + "/".join(sorted(self.networks)))
        if self.net_channels:
            parts.append("between nodes via " + ", ".join(f"NET/{n}" for n in sorted(self.net_channels))
                         + (" with GPUDirect RDMA" if self.gdr else " without GPUDirect RDMA"))
        if self.local_paths:
            parts.append("within the node via " + ", ".join(sorted(self.local_paths)))
        return "; ".join(parts) or "no transport lines"


def parse_nccl_log(text: str) -> NcclLog:
    """Parse NCCL_DEBUG=INFO output (NCCL_DEBUG_SUBSYS=INIT,NET is enough)."""
    log = NcclLog()
    for line in text.splitlines():
        if "NCCL INFO" not in line:
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
    return log


# ---------------------------------------------------------------------------------------------
# The report.


@dataclass
class NodeFacts:
    """One node as its first worker saw it."""

    node_ip: str
    hostname: str
    num_ranks: int = 0
    """Preflight workers placed on this node."""
    gpu_count: int = 0
    """GPUs the node has (nvidia-smi lists them all, whatever CUDA_VISIBLE_DEVICES says)."""
    gpu_name: str | None = None
    driver: str | None = None
    cuda: str | None = None
    """CUDA version torch was built with (torch.version.cuda)."""
    nccl: str | None = None
    """NCCL version torch loads (torch.cuda.nccl.version())."""
    torch: str | None = None
    rdma_ports: list[str] = field(default_factory=list)
    """Active InfiniBand/RoCE ports (raytrain.network.find_ib_ports)."""
    nccl_ib_disable: bool = False
    """NCCL_IB_DISABLE=1 was in the workers' environment."""
    env: dict[str, str] = field(default_factory=dict)
    """NCCL_*/GLOO_* variables the workers ran with: raytrain's plan, network.env, inherited ones."""
    plan_notes: list[str] = field(default_factory=list)
    nccl_log: NcclLog | None = None
    """None with gloo."""
    nccl_log_files: list[str] = field(default_factory=list)

    # Facts that must be equal on every node.
    AGREE = ("gpu_count", "gpu_name", "driver", "cuda", "nccl", "torch")


@dataclass
class Measurement:
    """One collective at one size in one group: the mean over the group's ranks of the time per
    call (nccl-tests' default, -a 1)."""

    phase: str
    """intra_node, one_rank_per_node or all_ranks."""
    group: str
    """"node 10.0.0.1", "1 rank per node", "all ranks"."""
    op: str
    size_bytes: int
    num_ranks: int
    time_s: float

    @property
    def algbw_gbs(self) -> float:
        return algbw_gbs(self.size_bytes, self.time_s)

    @property
    def busbw_gbs(self) -> float:
        return busbw_gbs(self.op, self.size_bytes, self.time_s, self.num_ranks)


@dataclass
class Thresholds:
    """Minimum all-reduce busbw (GB/s) at the largest size measured; None: not checked."""

    min_nvlink_busbw_gbs: float | None = None
    """Each node's intra-node group (2+ ranks on the node)."""
    min_ib_busbw_gbs: float | None = None
    """Per NIC: the 1-rank-per-node group; the all-ranks group gets this x rails per node."""

    @classmethod
    def defaults(cls, use_gpu: bool, min_nvlink_busbw_gbs: float | None = None,
                 min_ib_busbw_gbs: float | None = None) -> "Thresholds":
        """Given values win; otherwise the NVLink/NDR defaults on GPU and nothing on CPU."""
        return cls(
            min_nvlink_busbw_gbs if min_nvlink_busbw_gbs is not None else
            (DEFAULT_MIN_NVLINK_BUSBW_GBS if use_gpu else None),
            min_ib_busbw_gbs if min_ib_busbw_gbs is not None else (DEFAULT_MIN_IB_BUSBW_GBS if use_gpu else None))


@dataclass
class PreflightReport:
    """Everything preflight found; `passed` is the verdict, `render()` the text it prints."""

    backend: str
    num_workers: int
    nodes: list[NodeFacts] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    thresholds: Thresholds = field(default_factory=Thresholds)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def evaluate(self) -> None:
        """Fill `failures` and `notes` from the facts and measurements (idempotent)."""
        self.failures = [f for f in self.failures if f.startswith("error: ")]  # keep run errors
        self.notes = []
        self.failures += check_agreement(self.nodes)
        multi_node = len(self.nodes) > 1
        for node in self.nodes:
            failure, note = check_transport(node, multi_node)
            if failure:
                self.failures.append(failure)
            if note:
                self.notes.append(note)
        failures, notes = check_bandwidth(self.measurements, self.thresholds, _rails_per_node(self.nodes))
        self.failures += failures
        self.notes += notes

    def verdict(self) -> str:
        shape = f"{len(self.nodes)} node(s), {self.num_workers} rank(s), {self.backend}"
        if self.passed:
            return f"preflight: PASS ({shape})" + (f": {'; '.join(self._headline())}" if self._headline() else "")
        return f"preflight: FAIL ({shape}): " + "; ".join(self.failures)

    def _headline(self) -> list[str]:
        out = []
        for phase, label in ((INTRA, "within nodes"), (ONE_PER_NODE, "1 rank per node"), (ALL_RANKS, "all ranks")):
            best = _largest(self.measurements, phase, "all_reduce")
            if best and best[0].num_ranks > 1:
                low = min(best, key=lambda m: m.busbw_gbs)
                out.append(f"all-reduce busbw {label} {low.busbw_gbs:.1f} GB/s at {format_size(low.size_bytes)}")
        return out

    def render(self) -> str:
        lines = []
        for node in self.nodes:
            gpus = (f"{node.gpu_count} x {node.gpu_name}" if node.gpu_count else "no GPU")
            lines.append(f"node {node.node_ip} ({node.hostname}): {node.num_ranks} rank(s); {gpus}; "
                         f"driver {node.driver or '-'}; CUDA {node.cuda or '-'}; NCCL {node.nccl or '-'}; "
                         f"torch {node.torch or '-'}")
            lines.append("  RDMA ports: " + (", ".join(node.rdma_ports) or "none active"))
            if node.nccl_log is not None:
                lines.append("  NCCL: " + node.nccl_log.describe())
                if node.nccl_log.ib_devices:
                    lines.append("  NCCL IB devices: " + node.nccl_log.ib_devices)
            if node.env:
                lines.append("  env: " + " ".join(f"{k}={v}" for k, v in sorted(node.env.items())))
            lines += [f"  note: {n}" for n in node.plan_notes]
            lines += _table(self.measurements, INTRA, f"node {node.node_ip}", "  ")
        for phase in (ONE_PER_NODE, ALL_RANKS):
            groups = sorted({m.group for m in self.measurements if m.phase == phase})
            for group in groups:
                lines.append(f"across nodes, {group}:")
                lines += _table(self.measurements, phase, group, "  ")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(self.verdict())
        return "\n".join(lines)


def _table(measurements: list[Measurement], phase: str, group: str, indent: str) -> list[str]:
    rows = [m for m in measurements if m.phase == phase and m.group == group]
    if not rows:
        return []
    by_key = {(m.op, m.size_bytes): m for m in rows}
    sizes = sorted({m.size_bytes for m in rows})
    n = rows[0].num_ranks
    ranks = f" ({n} rank{'s' if n != 1 else ''})"
    head1 = f"{'':>10}" + "".join(f"  {op + ranks if i == 0 else op:^29}" for i, op in enumerate(OPS))
    head2 = f"{'size':>10}" + "  ".join(["", *[f"{'time_us':>9} {'algbw':>9} {'busbw':>9}" for _ in OPS]])
    out = [indent + head1.rstrip(), indent + head2 + "   (GB/s)"]
    for size in sizes:
        cells = []
        for op in OPS:
            m = by_key.get((op, size))
            cells.append(f"{m.time_s * 1e6:9.1f} {m.algbw_gbs:9.2f} {m.busbw_gbs:9.2f}" if m else f"{'-':>29}")
        out.append(indent + f"{format_size(size):>10}" + "  ".join(["", *cells]))
    return out


def _largest(measurements: list[Measurement], phase: str, op: str) -> list[Measurement]:
    """Every group's measurement of `op` at that group's largest size."""
    out = {}
    for m in measurements:
        if m.phase == phase and m.op == op and (m.group not in out or m.size_bytes > out[m.group].size_bytes):
            out[m.group] = m
    return list(out.values())


def _rails_per_node(nodes: list[NodeFacts]) -> int:
    """Inter-node links one node drives at once: a rank per NIC at most (0: no RDMA anywhere)."""
    if not nodes:
        return 0
    return min(min(n.num_ranks, len(n.rdma_ports)) for n in nodes)


# ---------------------------------------------------------------------------------------------
# The checks: pure functions of the facts, so unit tests feed them directly.


def check_agreement(nodes: list[NodeFacts]) -> list[str]:
    """One failure per fact (GPU count, model, driver, CUDA, NCCL, torch) that differs across nodes."""
    failures = []
    for key in NodeFacts.AGREE:
        values: dict[Any, list[str]] = {}
        for node in nodes:
            values.setdefault(getattr(node, key), []).append(node.node_ip)
        if len(values) > 1:
            where = "; ".join(f"{v if v is not None else 'unknown'} on {', '.join(ips)}" for v, ips in values.items())
            failures.append(f"{key} differs across nodes ({where}): give every node the same image and hardware")
    return failures


def check_transport(node: NodeFacts, multi_node: bool) -> tuple[str | None, str | None]:
    """(failure, note) for one node's NCCL transport. A node with active RDMA ports must not use
    NET/Socket; without RDMA ports TCP is expected (a note when it matters: several nodes)."""
    log = node.nccl_log
    if log is None:  # gloo: always TCP, nothing to confirm
        return None, None
    if not node.rdma_ports:
        if multi_node and log.uses_socket:
            return None, (f"node {node.node_ip} has no active InfiniBand/RoCE port: NCCL runs over TCP "
                          f"(NET/Socket) between nodes")
        return None, None
    if not log.num_lines:
        return (f"node {node.node_ip}: no NCCL INFO output in {', '.join(node.nccl_log_files) or 'the log files'}, "
                f"so the NET/IB transport is unconfirmed (is NCCL_DEBUG_FILE honoured?)"), None
    if log.uses_socket:
        why = ("NCCL_IB_DISABLE=1 is set" if node.nccl_ib_disable else
               "NCCL found no usable IB device" if log.ib_not_found else "NCCL did not select its IB transport")
        return (f"node {node.node_ip}: NCCL uses NET/Socket (TCP) although RDMA ports "
                f"{', '.join(node.rdma_ports)} are active ({why}); check NCCL_IB_HCA, NCCL_IB_DISABLE and the "
                f"RDMA libraries (libibverbs) in the image"), None
    if multi_node and log.net_channels and not log.gdr:
        return None, (f"node {node.node_ip}: NCCL uses NET/{'/'.join(sorted(log.net_channels))} without GPUDirect "
                      f"RDMA: network traffic is staged through host memory (load nvidia_peermem)")
    return None, None


def check_bandwidth(measurements: list[Measurement], thresholds: Thresholds,
                    rails_per_node: int) -> tuple[list[str], list[str]]:
    """All-reduce busbw at each group's largest size against the minimums; (failures, notes)."""
    failures, notes = [], []
    checks = ((INTRA, thresholds.min_nvlink_busbw_gbs, "--min-nvlink-busbw-gbs"),
              (ONE_PER_NODE, thresholds.min_ib_busbw_gbs, "--min-ib-busbw-gbs"),
              (ALL_RANKS, None if thresholds.min_ib_busbw_gbs is None or not rails_per_node
               else thresholds.min_ib_busbw_gbs * rails_per_node, "--min-ib-busbw-gbs"))
    for phase, minimum, flag in checks:
        for m in _largest(measurements, phase, "all_reduce"):
            if m.num_ranks < 2:
                notes.append(f"{m.group}: 1 rank, so bus bandwidth is 0 by definition and was not checked; "
                             f"no data left the GPU (in-place all-reduce is a no-op, all-gather and "
                             f"reduce-scatter copy within device memory)")
                continue
            if minimum is None:
                continue
            if m.busbw_gbs < minimum:
                per = f" ({thresholds.min_ib_busbw_gbs:g} x {rails_per_node} rails)" if phase == ALL_RANKS else ""
                failures.append(f"{m.group}: all-reduce busbw {m.busbw_gbs:.1f} GB/s at {format_size(m.size_bytes)} "
                                f"is below the minimum {minimum:g} GB/s{per} (set by {flag})")
    return failures, notes

