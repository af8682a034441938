"""The preflight's report: nccl-tests' bandwidth arithmetic, what each node is, what was measured, the text.

Start at `PreflightReport`: the facts the workers saw (`NodeFacts`, with each node's NCCL log parsed
by raytrain.network.nccl_log), the measurements, and `render()`. The verdict (`failures`, `notes`)
comes from raytrain.network.preflight_checks.evaluate; the measuring is raytrain.network.preflight.

GB/s here is 10^9 bytes per second, as nccl-tests prints it (not gigabits: NDR is 400 Gb/s = 50 GB/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from raytrain.config import ConfigError
from raytrain.network.nccl_log import NcclLog

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
# Across nodes, from the link rates the nodes report (ports/N/rate): all-reduce busbw approaches
# the rate of the links the ranks use (busbw is normalised to it), so 80% of that rate is the
# minimum. One rank per node drives its share of the node's links, at least one: 400 Gb/s = 50 GB/s
# on an NDR rail (minimum 40 GB/s; a healthy one reaches 45-48), 4 x 100 Gb/s EFA per GPU on p5,
# one 100 Gb/s EFA on p4d (two GPUs share it). All ranks drive all the node's links: 8 x 400 Gb/s
# -> 320 GB/s on ND H100 v5 and on p5, 4 x 100 Gb/s -> 40 GB/s on p4d. This fails traffic staged
# through host memory on a busy host and TCP (a few GB/s); a link trained down (a lower rate than
# the cluster's other links) fails on its own (preflight_checks.check_fabric).
LINK_RATE_FRACTION = 0.8
# Where a node's link rates are unknown, or given by --min-ib-busbw-gbs: this figure per NIC, times
# the rails in use per node (min(ranks per node, fabric ports)) for all ranks: 8 x 40 = 320 GB/s.
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
    fabric: str = ""
    """"InfiniBand", "RoCE", "EFA", or "" (no RDMA port): raytrain.network.nccl_env.select_fabric's choice."""
    rdma_ports: list[str] = field(default_factory=list)
    """The InfiniBand/RoCE ports NCCL should use (the plan's NCCL_IB_HCA); empty on EFA."""
    efa_devices: list[str] = field(default_factory=list)
    """Active EFA devices (aws-ofi-nccl uses them; NCCL's own IB transport cannot)."""
    link_gbps: dict[str, float] = field(default_factory=dict)
    """Link rate (Gb/s, ports/N/rate) of each of those ports whose rate could be read."""
    nccl_ib_disable: bool = False
    """NCCL_IB_DISABLE=1 was in the workers' environment."""
    env: dict[str, str] = field(default_factory=dict)
    """NCCL_*/GLOO_*/FI_* variables the workers ran with: raytrain's plan, network.env, inherited ones."""
    plan_notes: list[str] = field(default_factory=list)
    nccl_log: NcclLog | None = None
    """None with gloo, and where none of the node's ranks answered (stuck in a collective)."""
    nccl_log_files: list[str] = field(default_factory=list)

    # Facts that must be equal on every node.
    AGREE = ("gpu_count", "gpu_name", "driver", "cuda", "nccl", "torch")

    @property
    def fabric_ports(self) -> list[str]:
        return self.efa_devices or self.rdma_ports


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
    from_link_rates: bool = False
    """Across nodes, hold the groups to LINK_RATE_FRACTION of the nodes' link rates instead, and to
    min_ib_busbw_gbs only where a node's rates are unknown (the GPU default)."""

    @classmethod
    def defaults(cls, use_gpu: bool, min_nvlink_busbw_gbs: float | None = None,
                 min_ib_busbw_gbs: float | None = None) -> "Thresholds":
        """Given values win; otherwise the NVLink and link-rate defaults on GPU and nothing on CPU."""
        return cls(
            min_nvlink_busbw_gbs if min_nvlink_busbw_gbs is not None else
            (DEFAULT_MIN_NVLINK_BUSBW_GBS if use_gpu else None),
            min_ib_busbw_gbs if min_ib_busbw_gbs is not None else (DEFAULT_MIN_IB_BUSBW_GBS if use_gpu else None),
            from_link_rates=use_gpu and min_ib_busbw_gbs is None)


@dataclass
class PreflightReport:
    """Everything preflight found; `passed` is the verdict, `render()` the text it prints."""

    backend: str
    num_workers: int
    nodes: list[NodeFacts] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    thresholds: Thresholds = field(default_factory=Thresholds)
    failures: list[str] = field(default_factory=list)
    """What fails the run (raytrain.network.preflight_checks.evaluate); "error: ..." when it could not run."""
    notes: list[str] = field(default_factory=list)
    train_anyway: str = "set network.preflight=false to train anyway"
    """What a user sets to train despite the failures (evaluate adds NCCL_NET where raytrain's own
    NCCL_NET would stop NCCL anyway)."""
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def verdict(self) -> str:
        shape = f"{len(self.nodes)} node(s), {self.num_workers} rank(s), {self.backend}"
        if self.passed:
            return f"preflight: PASS ({shape})" + (f": {'; '.join(self._headline())}" if self._headline() else "")
        return f"preflight: FAIL ({shape}): " + "; ".join(self.failures)

    def _headline(self) -> list[str]:
        out = []
        for phase, label in ((INTRA, "within nodes"), (ONE_PER_NODE, "1 rank per node"), (ALL_RANKS, "all ranks")):
            best = largest(self.measurements, phase, "all_reduce")
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
            lines.append("  RDMA ports: " + _fabric_line(node))
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


def largest(measurements: list[Measurement], phase: str, op: str) -> list[Measurement]:
    """Every group's measurement of `op` at that group's largest size."""
    out = {}
    for m in measurements:
        if m.phase == phase and m.op == op and (m.group not in out or m.size_bytes > out[m.group].size_bytes):
            out[m.group] = m
    return list(out.values())


def _fabric_line(node: NodeFacts) -> str:
    ports = node.fabric_ports
    if not ports:
        return "none active"
    rates = sorted({node.link_gbps[p] for p in ports if p in node.link_gbps})
    at = f" at {'/'.join(f'{r:g}' for r in rates)} Gb/s" if rates else ""
    names = ", ".join(ports[:8]) + (f" and {len(ports) - 8} more" if len(ports) > 8 else "")
    return f"{len(ports)} x {node.fabric or 'RDMA'}{at}: {names}"
