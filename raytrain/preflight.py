"""`python -m raytrain.preflight`: is this cluster's fabric fit to train on? Answer before training.

    python -m raytrain.preflight                          # one task per GPU of the running cluster
    python -m raytrain.preflight --sizes 1M,64M,1G --min-ib-busbw-gbs 45
    python -m raytrain.preflight --no-use-gpu --num-workers 2 --sizes 1M,4M   # CPU + gloo (tests)

Start at `run_preflight` (the driver calls it when `network.preflight: true`). It places one Ray
actor per GPU (a PACK placement group: the layout Ray Train gives training), applies raytrain's
per-node NCCL/Gloo environment (`raytrain.network.compute_nccl_env`, `network.env` winning) with
NCCL's INFO log switched on, builds a torch process group (nccl on GPU, gloo on CPU), and:

1. checks that GPU count and model, driver, CUDA, NCCL and torch versions agree across nodes;
2. times all-reduce, all-gather and reduce-scatter over message sizes (default 1 MiB to 1 GiB),
   within each node, across nodes with one rank per node, and across all ranks; algbw and busbw
   use nccl-tests' definitions (doc/PERFORMANCE.md there), so the numbers compare with theirs;
3. reads each rank's NCCL log and fails a node that has active InfiniBand/RoCE ports but whose
   NCCL chose NET/Socket (TCP);
4. prints a table per node and one per cross-node group, then one verdict line against minimum
   all-reduce busbw figures, and exits 1 on failure (2 on a configuration mistake).

GB/s here is 10^9 bytes per second, as nccl-tests prints it (not gigabits: NDR is 400 Gb/s = 50 GB/s).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrain.config import ConfigError, NetworkConfig

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


# ---------------------------------------------------------------------------------------------
# The worker: one Ray actor per GPU (or per CPU rank).


class PreflightWorker:
    """Holds one rank of the preflight process group. Created through `ray.remote` by run_preflight."""

    def __init__(self, forced_env: dict[str, str], auto_configure: bool, use_gpu: bool, log_dir: str):
        self.forced_env = forced_env
        self.auto_configure = auto_configure
        self.use_gpu = use_gpu
        self.log_dir = log_dir
        self.groups: dict[str, Any] = {}
        self.log_file: str | None = None

    def facts(self) -> dict[str, Any]:
        """This process's node and versions. Does not initialise CUDA (CUDA_VISIBLE_DEVICES may still change)."""
        import ray
        import torch

        from raytrain.network import find_ib_ports

        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if self.use_gpu else []
        facts: dict[str, Any] = {
            "node_ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "gpu_ids": gpu_ids,
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None,
            "gpu_count": 0, "gpu_name": None, "driver": None,
            "rdma_ports": [p.name for p in find_ib_ports() if p.active],
        }
        if self.use_gpu:
            try:
                version = torch.cuda.nccl.version()
                facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            except Exception:  # a CPU build of torch has no NCCL
                pass
            facts.update(_nvidia_smi())
        return facts

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, rank: int, world_size: int, master: str, groups: dict[str, list[int]],
              visible_devices: str | None, device_index: int, timeout_s: float) -> dict[str, Any]:
        """Apply the node's NCCL/Gloo plan, then build the process group and the subgroups."""
        import ray
        import torch
        import torch.distributed as dist

        from raytrain.network import compute_nccl_env

        plan = compute_nccl_env(ray.util.get_node_ip_address(), forced=self.forced_env,
                                auto_configure=self.auto_configure)
        os.environ.update(plan.env)
        if self.use_gpu:
            os.makedirs(self.log_dir, exist_ok=True)
            self.log_file = os.path.join(self.log_dir, f"nccl.rank{rank}.log")
            # NCCL reads these once, at its first communicator; INIT,NET is enough for the network
            # choice and every channel's path, and keeps the log to a few hundred lines per rank.
            os.environ.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                               "NCCL_DEBUG_FILE": self.log_file})
            if visible_devices is not None:
                # As Ray Train does: every rank of a node sees the node's GPUs, so NCCL can detect
                # NVLink/P2P between them (set before CUDA initialises in this process).
                os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
            torch.cuda.set_device(device_index)
        dist.init_process_group("nccl" if self.use_gpu else "gloo", init_method=f"tcp://{master}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # new_group is collective: every rank creates every group, in the same order.
        for name, ranks in sorted(groups.items()):
            group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(ranks)
            if rank in ranks:
                self.groups[name.split(":")[0]] = group
        # Connect every communicator now (NCCL does it at a group's first collective), so that no
        # measurement includes it and the NCCL log is complete. Same phase order on every rank.
        device = torch.device("cuda", device_index) if self.use_gpu else torch.device("cpu")
        for phase in PHASES:
            if phase in self.groups:
                self._sync(self.groups[phase], device)
        applied = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))
                   and k not in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")}
        return {"env": applied, "notes": plan.notes, "ib_disable": os.environ.get("NCCL_IB_DISABLE") == "1"}

    def measure(self, phase: str, op: str, size_bytes: int, warmup_iters: int, iters: int) -> dict[str, Any] | None:
        """Time `iters` calls of `op` after `warmup_iters`; None when this rank is not in `phase`'s group."""
        import torch
        import torch.distributed as dist

        group = self.groups.get(phase)
        if group is None:
            return None
        n = dist.get_world_size(group)
        device = torch.device("cuda", torch.cuda.current_device()) if self.use_gpu else torch.device("cpu")
        # float32, as nccl-tests' default. Zeros: sums stay finite, no denormals slowing CPU reductions.
        numel = max(n, size_bytes // 4 // n * n)
        full = torch.zeros(numel, dtype=torch.float32, device=device)
        shard = torch.zeros(numel // n, dtype=torch.float32, device=device)
        # torch >= 2.13 names the flat-tensor collectives *_single (the old names warn); same calls.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if op == "all_reduce":
            def call(): dist.all_reduce(full, group=group)
        elif op == "all_gather":
            def call(): all_gather(full, shard, group=group)
        else:
            def call(): reduce_scatter(shard, full, group=group)
        for _ in range(warmup_iters):
            call()
        self._sync(group, device)  # start together: the slowest rank's arrival is not timed
        start = time.perf_counter()
        for _ in range(iters):
            call()
        if self.use_gpu:
            torch.cuda.synchronize()  # the calls only queued kernels; this waits for them
        elapsed = time.perf_counter() - start
        return {"time_s": elapsed / iters, "size_bytes": numel * 4, "num_ranks": n}

    def _sync(self, group: Any, device: Any) -> None:
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, device=device), group=group)
        if self.use_gpu:
            torch.cuda.synchronize()

    def nccl_log(self) -> str:
        if not self.log_file:
            return ""
        try:
            with open(self.log_file, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _nvidia_smi() -> dict[str, Any]:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    names = sorted({r[0] for r in rows})
    return {"gpu_count": len(rows), "gpu_name": " + ".join(names) or None,
            "driver": rows[0][1] if rows and len(rows[0]) > 1 else None}


# ---------------------------------------------------------------------------------------------
# The driver side.


def run_preflight(network: NetworkConfig, num_workers: int, use_gpu: bool, sizes: Sequence[int] | None = None, *,
                  iters: int = 20, warmup_iters: int = 5, min_nvlink_busbw_gbs: float | None = None,
                  min_ib_busbw_gbs: float | None = None, cpus_per_worker: float = 1.0,
                  timeout_s: float = 600.0, progress: Callable[[str], None] | None = None) -> PreflightReport:
    """Run the preflight on the Ray cluster this process is connected to (ray.init done).

    `sizes` in bytes (None: 1 MiB-1 GiB on GPU, 1-16 MiB on CPU); `iters`/`warmup_iters` per size
    (nccl-tests' -n 20 -w 5); minimums in GB/s (None: the defaults on GPU, unchecked on CPU);
    `timeout_s` bounds placement, process-group setup and each measurement; `progress` receives
    the progress lines (None: print them). Never raises for what it measures: failures are in the
    report (`passed` False), including a collective that hung.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raytrain.network import torch_config

    if num_workers < 1:
        raise ConfigError(f"--num-workers must be at least 1, got {num_workers}")
    if iters < 1 or warmup_iters < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup-iters >= 0, got {iters} and {warmup_iters}")
    sizes = sorted(sizes or (DEFAULT_GPU_SIZES if use_gpu else DEFAULT_CPU_SIZES))
    # Validates network.env the way training does (NCCL_*/GLOO_* only, values as strings).
    forced = dict(torch_config(network, backend="nccl" if use_gpu else "gloo").network.env)
    thresholds = Thresholds.defaults(use_gpu, min_nvlink_busbw_gbs, min_ib_busbw_gbs)
    report = PreflightReport(backend="nccl" if use_gpu else "gloo", num_workers=num_workers, thresholds=thresholds)
    say = progress or (lambda line: print(line, flush=True))
    started = time.perf_counter()

    bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    # PACK: as few nodes as possible, the placement Ray Train gives the training workers.
    pg = placement_group([dict(bundle)] * num_workers, strategy="PACK")
    actors: list[Any] = []
    try:
        say(f"preflight: placing {num_workers} worker(s) of {bundle} ...")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            report.failures.append(f"error: the cluster cannot place {num_workers} workers of {bundle} within "
                                   f"{timeout_s:g}s: lower --num-workers or add nodes")
            return report
        log_dir = f"/tmp/raytrain_preflight/{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        worker_cls = ray.remote(PreflightWorker)
        actors = [worker_cls.options(num_cpus=cpus_per_worker, num_gpus=1 if use_gpu else 0,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i))
                  .remote(forced, network.auto_configure, use_gpu, log_dir) for i in range(num_workers)]
        facts = ray.get([a.facts.remote() for a in actors], timeout=timeout_s)

        # Ranks: node by node, GPUs in order, so each node's ranks are contiguous (as in Ray Train).
        order = sorted(range(num_workers), key=lambda i: (facts[i]["node_ip"], _gpu_key(facts[i]["gpu_ids"]), i))
        actors = [actors[i] for i in order]
        facts = [facts[i] for i in order]
        node_ranks: dict[str, list[int]] = {}
        for rank, f in enumerate(facts):
            node_ranks.setdefault(f["node_ip"], []).append(rank)
        groups = _groups(node_ranks, num_workers)

        nodes = {}
        for ip, ranks in node_ranks.items():
            f = facts[ranks[0]]
            nodes[ip] = NodeFacts(node_ip=ip, hostname=f["hostname"], num_ranks=len(ranks), gpu_count=f["gpu_count"],
                                  gpu_name=f["gpu_name"], driver=f["driver"], cuda=f["cuda"], nccl=f["nccl"],
                                  torch=f["torch"], rdma_ports=f["rdma_ports"])
        report.nodes = list(nodes.values())

        master = f"{facts[0]['node_ip']}:{ray.get(actors[0].free_port.remote(), timeout=timeout_s)}"
        setups = []
        for rank, (actor, f) in enumerate(zip(actors, facts)):
            local = [g for r in node_ranks[f["node_ip"]] for g in facts[r]["gpu_ids"]]
            visible = ",".join(local) if use_gpu and local else None
            index = local.index(f["gpu_ids"][0]) if visible else 0
            setups.append(actor.setup.remote(rank, num_workers, master, groups, visible, index, timeout_s))
        setup_results = ray.get(setups, timeout=timeout_s)
        for ip, ranks in node_ranks.items():
            first = setup_results[ranks[0]]
            nodes[ip].env, nodes[ip].plan_notes = first["env"], first["notes"]
            nodes[ip].nccl_ib_disable = first["ib_disable"]

        phases = [p for p in PHASES if any(name.split(":")[0] == p for name in groups)]
        steps = [(p, op, s) for p in phases for op in OPS for s in sizes]
        say(f"preflight: {len(report.nodes)} node(s), {num_workers} rank(s), {report.backend}; "
            f"{len(steps)} measurements ({len(phases)} group kind(s) x {len(OPS)} collectives x {len(sizes)} sizes, "
            f"{warmup_iters} warmup + {iters} timed calls each)")
        _measure_all(actors, steps, groups, warmup_iters, iters, timeout_s, report, say)

        if use_gpu:
            logs = ray.get([a.nccl_log.remote() for a in actors], timeout=timeout_s)
            for ip, ranks in node_ranks.items():
                merged = NcclLog()
                for r in ranks:
                    merged.merge(parse_nccl_log(logs[r]))
                nodes[ip].nccl_log = merged
                nodes[ip].nccl_log_files = [f"{log_dir}/nccl.rank{r}.log" for r in ranks]
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
        report.failures.append(f"error: {type(e).__name__}: {_first_line(e)}")
    finally:
        if actors:
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=60)
            except Exception:  # a hung or dead rank: killing the actor below ends it anyway
                pass
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
        report.elapsed_s = time.perf_counter() - started
    report.evaluate()
    return report


def _measure_all(actors: list[Any], steps: list[tuple[str, str, int]], groups: dict[str, list[int]],
                 warmup_iters: int, iters: int, timeout_s: float, report: PreflightReport,
                 say: Callable[[str], None]) -> None:
    import ray

    # ETA weighs each step by its bytes plus a latency floor: large messages dominate the time.
    weights = [(warmup_iters + iters) * (size + 4 * MIB) for _, _, size in steps]
    total, done = sum(weights), 0
    start = time.perf_counter()
    labels = {INTRA: "within each node", ONE_PER_NODE: "1 rank per node", ALL_RANKS: "all ranks"}
    for i, (phase, op, size) in enumerate(steps):
        results = ray.get([a.measure.remote(phase, op, size, warmup_iters, iters) for a in actors], timeout=timeout_s)
        by_group: dict[str, list[dict[str, Any]]] = {}
        for name, ranks in groups.items():
            if name.split(":")[0] == phase:
                by_group[name.partition(":")[2]] = [results[r] for r in ranks]
        for label, rows in by_group.items():
            report.measurements.append(Measurement(
                phase=phase, group=label, op=op, size_bytes=rows[0]["size_bytes"], num_ranks=rows[0]["num_ranks"],
                time_s=sum(r["time_s"] for r in rows) / len(rows)))
        done += weights[i]
        elapsed = time.perf_counter() - start
        low = min(report.measurements[-len(by_group):], key=lambda m: m.busbw_gbs)
        eta = elapsed / done * (total - done)
        say(f"preflight [{i + 1:>3}/{len(steps)}] {labels[phase]:<16} {op:<14} {format_size(size):>8}  "
            f"busbw {low.busbw_gbs:8.2f} GB/s  algbw {low.algbw_gbs:8.2f} GB/s  "
            f"{(i + 1) / elapsed:5.2f} meas/s  eta {datetime.timedelta(seconds=round(eta))}")


def _groups(node_ranks: dict[str, list[int]], world_size: int) -> dict[str, list[int]]:
    """"phase:label" -> ranks. Groups of one rank are measured only when the whole run is one rank."""
    groups = {}
    for ip, ranks in node_ranks.items():
        if len(ranks) > 1 or world_size == 1:
            groups[f"{INTRA}:node {ip}"] = ranks
    if len(node_ranks) > 1:
        groups[f"{ONE_PER_NODE}:1 rank per node"] = [ranks[0] for ranks in node_ranks.values()]
        if world_size > len(node_ranks):
            groups[f"{ALL_RANKS}:all ranks"] = list(range(world_size))
    return groups


def _gpu_key(gpu_ids: list[str]) -> tuple:
    return tuple(int(g) if g.isdigit() else g for g in gpu_ids)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # A RayTaskError carries the remote traceback; its last line is the remote exception.
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m raytrain.preflight", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Check the cluster's GPUs and network before training: versions agree across nodes, "
                    "NCCL uses InfiniBand where it exists, collective bus bandwidth meets a minimum. "
                    "Exit 0 pass, 1 fail, 2 configuration mistake.")
    p.add_argument("--config", help="YAML run config: its network, scaling and cluster sections apply")
    p.add_argument("--num-workers", type=int, help="ranks (same as scaling.num_workers=N); default: one per "
                                                   "GPU in the cluster, 2 on a CPU-only cluster")
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=None,
                   help="same as scaling.use_gpu; default: true when the cluster has GPUs")
    p.add_argument("--sizes", help="comma-separated message sizes (K/M/G = KiB/MiB/GiB); default 1M..1G doubling "
                                   "on GPU, 1M..16M on CPU")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size")
    p.add_argument("--warmup-iters", type=int, default=5, help="untimed calls per size first")
    p.add_argument("--min-nvlink-busbw-gbs", type=float,
                   help=f"minimum all-reduce busbw within a node, GB/s (10^9 bytes/s) at the largest size; "
                        f"default {DEFAULT_MIN_NVLINK_BUSBW_GBS:g} on GPU (NVLink/NVSwitch), unchecked on CPU; "
                        f"0 disables")
    p.add_argument("--min-ib-busbw-gbs", type=float,
                   help=f"minimum all-reduce busbw across nodes per NIC, GB/s, 1 rank per node (all ranks: x rails "
                        f"per node); default {DEFAULT_MIN_IB_BUSBW_GBS:g} on GPU (NDR 400 Gb/s), unchecked on CPU")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="limit for placing workers, building the process group and each measurement")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="raytrain config overrides, e.g. network.env.NCCL_IB_HCA==mlx5_0 cluster.address=HOST:6379")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from raytrain.config import load_config
        from raytrain.driver import connect
        from raytrain.resolve import shape_from_cluster

        overrides = list(args.overrides)
        if args.num_workers is not None:
            overrides.append(f"scaling.num_workers={args.num_workers}")
        if args.use_gpu is not None:
            overrides.append(f"scaling.use_gpu={str(args.use_gpu).lower()}")
        cfg = load_config(args.config, overrides)
        sizes = parse_sizes(args.sizes) if args.sizes else None
        import ray

        connect(cfg.cluster, cfg.scaling)
        shape = shape_from_cluster(cfg, ray.cluster_resources(), None)
        report = run_preflight(cfg.network, shape.num_workers, shape.use_gpu, sizes, iters=args.iters,
                               warmup_iters=args.warmup_iters, min_nvlink_busbw_gbs=args.min_nvlink_busbw_gbs,
                               min_ib_busbw_gbs=args.min_ib_busbw_gbs, cpus_per_worker=cfg.scaling.cpus_per_worker,
                               timeout_s=args.timeout_s)
    except ConfigError as e:
        print(f"raytrain.preflight: error: {e}", file=sys.stderr)
        return 2
    print(report.render(), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
