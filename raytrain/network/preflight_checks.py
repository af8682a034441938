"""The preflight's verdict: pure functions of what the workers saw and measured (unit tests feed them directly).

Start at `evaluate(report)`: versions agree across nodes (`check_agreement`), every node has the same
fabric at the same link rate (`check_fabric`), NCCL uses that fabric (`check_transport`: NET/IB on
InfiniBand and RoCE; aws-ofi-nccl on libfabric's efa provider on EFA, never NET/Socket), and all-reduce
bus bandwidth meets the minimums (`check_bandwidth`, from the nodes' link rates).
"""

from __future__ import annotations

from typing import Any

from raytrain.network.nccl_log import LIBFABRIC_NETS, NcclLog
from raytrain.network.preflight_report import (
    ALL_RANKS, INTRA, LINK_RATE_FRACTION, ONE_PER_NODE, Measurement, NodeFacts, PreflightReport, Thresholds,
    format_size, largest)

# Where the EFA installer puts aws-ofi-nccl (Debian/Ubuntu multiarch first), as cluster/aws-efa.yaml
# adds them to the loader path.
_OFI_NCCL_LIB_DIRS = "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu or /opt/amazon/ofi-nccl/lib"
_PASS_DEVICES = "pass the EFA devices into the container (docker --device=/dev/infiniband)"


def evaluate(report: PreflightReport) -> None:
    """Fill the report's `failures`, `notes` and `train_anyway` from its facts and measurements (idempotent)."""
    report.failures = [f for f in report.failures if f.startswith("error: ")]  # keep run errors
    report.notes = []
    report.failures += check_agreement(report.nodes)
    if report.backend == "nccl":  # gloo is TCP whatever the fabric
        report.failures += check_fabric(report.nodes)
    multi_node = len(report.nodes) > 1
    for node in report.nodes:
        failure, note = check_transport(node, multi_node)
        if failure:
            report.failures.append(failure)
        if note:
            report.notes.append(note)
    failures, notes = check_bandwidth(report.measurements, report.thresholds, report.nodes)
    report.failures += failures
    report.notes += notes
    report.train_anyway = _train_anyway(report.nodes)


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


def check_fabric(nodes: list[NodeFacts]) -> list[str]:
    """Every node on the same kind of fabric (a node without one pulls every collective down to TCP, or
    NCCL cannot connect it at all), and every fabric link at the cluster's rate for its kind (a slower
    one is a link trained down, or another NIC, and holds its rail back)."""
    failures = []
    kinds: dict[str, list[str]] = {}
    for node in nodes:
        kinds.setdefault(node.fabric or "no RDMA", []).append(node.node_ip)
    if len(kinds) > 1:
        where = "; ".join(f"{kind} on {', '.join(ips)}" for kind, ips in kinds.items())
        failures.append(f"fabric differs across nodes ({where}): NCCL needs one transport between all nodes, so "
                        f"the run would fall back to TCP or fail to connect: give every node the same fabric, or "
                        f"keep the run on one node type (scaling.accelerator_type)")
    for kind in kinds:
        rates = {(n.node_ip, p): r for n in nodes if (n.fabric or "no RDMA") == kind
                 for p, r in n.link_gbps.items() if p in n.fabric_ports}
        top = max(rates.values(), default=0.0)
        slow = [f"{p} on {ip} at {r:g} Gb/s" for (ip, p), r in sorted(rates.items()) if r < top]
        if slow:
            failures.append(f"{kind} links slower than the cluster's {top:g} Gb/s: {_some(slow)} (a link trained "
                            f"down, or another NIC): reseat or replace the cable, or leave the node out")
    return failures


def check_transport(node: NodeFacts, multi_node: bool) -> tuple[str | None, str | None]:
    """(failure, note) for one node's NCCL transport. A node with a fabric must not use NET/Socket (on
    EFA: nor aws-ofi-nccl on libfabric's tcp provider); without one TCP is expected (a note when it
    matters: several nodes)."""
    log = node.nccl_log
    if log is None:  # gloo: always TCP, nothing to confirm
        return None, None
    if node.efa_devices:
        return _check_efa(node, log, multi_node)
    if not node.rdma_ports:
        if multi_node and log.uses_socket:
            return None, (f"node {node.node_ip} has no active InfiniBand, RoCE or EFA port: NCCL runs over TCP "
                          f"(NET/Socket) between nodes")
        return None, None
    if not log.num_lines:
        return _unconfirmed(node, "NET/IB"), None
    if log.uses_socket:
        why = ("NCCL_IB_DISABLE=1 is set" if node.nccl_ib_disable else
               "NCCL found no usable IB device" if log.ib_not_found else "NCCL did not select its IB transport")
        return (f"node {node.node_ip}: NCCL uses NET/Socket (TCP) although RDMA ports "
                f"{', '.join(node.rdma_ports)} are active ({why}); check NCCL_IB_HCA, NCCL_IB_DISABLE and the "
                f"RDMA libraries (libibverbs) in the image"), None
    return None, _gdr_note(node, log, multi_node, "load nvidia_peermem")


def _check_efa(node: NodeFacts, log: NcclLog, multi_node: bool) -> tuple[str | None, str | None]:
    where, devices = f"node {node.node_ip}", _some(node.efa_devices)
    if not log.num_lines:
        return _unconfirmed(node, "aws-ofi-nccl"), None
    plugin = "aws-ofi-nccl" + (f" {log.ofi_version}" if log.ofi_version else "")
    provider = log.ofi_provider
    if provider and not provider.startswith("efa"):  # efa, or efa-direct where a libfabric names it so
        tcp = ", i.e. TCP," if provider in ("tcp", "sockets", "udp") else ", not efa,"
        return (f"{where}: {plugin} runs on libfabric's {provider} provider{tcp} although EFA devices {devices} "
                f"are present: {_PASS_DEVICES} and leave FI_PROVIDER=efa"), None
    if log.uses_libfabric:
        return None, _gdr_note(node, log, multi_node, "p4d, p5 and later support it through the EFA installer's "
                                                      "libfabric")
    if node.env.get("NCCL_NET", "").lower() == "socket":
        why, fix = "NCCL_NET=Socket is set", "drop NCCL_NET=Socket"
    elif log.ofi_version or log.ofi_error:  # the plugin loaded and found no provider
        why = f"{plugin} found no EFA provider in libfabric" + (f": {log.ofi_error}" if log.ofi_error else "")
        fix = f"{_PASS_DEVICES}, and check that `fi_info -p efa` lists them there"
    elif log.plugin_error:
        why = f"the aws-ofi-nccl plugin did not load: {log.plugin_error}"
        fix = "put the library it names on the loader path (libfabric: the EFA installer's /opt/amazon/efa/lib)"
    else:
        why = ("NCCL found no aws-ofi-nccl plugin libnccl-net.so" if log.plugin_missing else
               "NCCL did not load aws-ofi-nccl")
        fix = (f"put {_OFI_NCCL_LIB_DIRS} (the EFA installer's) on the loader path in the image "
               f"(ldconfig or LD_LIBRARY_PATH)")
    chosen = "/".join(sorted(log.net_channels or log.networks))
    what = ("uses NET/Socket (TCP)" if log.uses_socket else f"uses NET/{chosen}, not aws-ofi-nccl," if chosen
            else "has no network")
    return f"{where}: NCCL {what} although EFA devices {devices} are present ({why}): {fix}", None


def _unconfirmed(node: NodeFacts, transport: str) -> str:
    return (f"node {node.node_ip}: no NCCL INFO output in {', '.join(node.nccl_log_files) or 'the log files'}, "
            f"so the {transport} transport is unconfirmed (is NCCL_DEBUG_FILE honoured?)")


def _gdr_note(node: NodeFacts, log: NcclLog, multi_node: bool, fix: str) -> str | None:
    if multi_node and log.net_channels and not log.gdr:
        return (f"node {node.node_ip}: NCCL uses NET/{'/'.join(sorted(log.net_channels))} without GPUDirect "
                f"RDMA: network traffic is staged through host memory ({fix})")
    return None


def _train_anyway(nodes: list[NodeFacts]) -> str:
    # raytrain pins NCCL_NET to aws-ofi-nccl on EFA nodes: where the plugin cannot start, NCCL stops at
    # its first communicator whether the preflight runs or not.
    stuck = [n.node_ip for n in nodes if n.efa_devices and n.nccl_log is not None and not n.nccl_log.uses_libfabric
             and n.env.get("NCCL_NET", "").lower() in LIBFABRIC_NETS]
    if stuck:
        return (f"set network.preflight=false and network.env.NCCL_NET=Socket to train over TCP anyway (NCCL_NET "
                f"names aws-ofi-nccl on {_some(stuck)}, so NCCL stops there while the plugin cannot start)")
    return "set network.preflight=false to train anyway"


# ---------------------------------------------------------------------------------------------
# Bandwidth.


def net_minimums(nodes: list[NodeFacts], thresholds: Thresholds) -> dict[str, tuple[float, str]]:
    """Phase -> (minimum all-reduce busbw in GB/s, how it was derived) for the cross-node groups; a phase
    left out is not checked. The weakest node sets each figure: every collective waits for it."""
    per_rail = thresholds.min_ib_busbw_gbs
    one: list[tuple[float, str]] = []
    every: list[tuple[float, str] | None] = []
    for node in nodes:
        ports = node.fabric_ports
        rates = [node.link_gbps[p] for p in ports if p in node.link_gbps]
        if thresholds.from_link_rates and ports and len(rates) == len(ports):
            gpus = max(node.gpu_count, node.num_ranks, 1)
            # One rank drives its GPU's share of the links, at least one (p4d: 2 GPUs per EFA).
            links = max(1, len(ports) // gpus)
            one.append((_gbs(min(rates) * links), f"{LINK_RATE_FRACTION:.0%} of {links} x {min(rates):g} Gb/s "
                                                  f"per rank; --min-ib-busbw-gbs sets your own"))
            share = min(1.0, node.num_ranks / gpus)
            every.append((_gbs(sum(rates) * share), f"{LINK_RATE_FRACTION:.0%} of {len(ports)} x {min(rates):g} Gb/s "
                          f"per node{f' x {node.num_ranks}/{gpus} GPUs' if share < 1 else ''}; --min-ib-busbw-gbs "
                          f"sets your own"))
        elif per_rail is not None:
            rails = min(node.num_ranks, len(ports))
            one.append((per_rail, "set by --min-ib-busbw-gbs"))
            every.append((per_rail * rails, f"{per_rail:g} x {rails} rails, set by --min-ib-busbw-gbs")
                         if rails else None)
    out = {}
    if one:
        out[ONE_PER_NODE] = min(one)
    if every and all(e is not None for e in every):
        out[ALL_RANKS] = min(e for e in every if e is not None)
    return out


def check_bandwidth(measurements: list[Measurement], thresholds: Thresholds,
                    nodes: list[NodeFacts]) -> tuple[list[str], list[str]]:
    """All-reduce busbw at each group's largest size against the minimums; (failures, notes)."""
    failures, notes = [], []
    minimums = {INTRA: (thresholds.min_nvlink_busbw_gbs, "set by --min-nvlink-busbw-gbs"),
                **net_minimums(nodes, thresholds)}
    for phase in (INTRA, ONE_PER_NODE, ALL_RANKS):
        minimum, why = minimums.get(phase, (None, ""))
        for m in largest(measurements, phase, "all_reduce"):
            if m.num_ranks < 2:
                notes.append(f"{m.group}: 1 rank, so bus bandwidth is 0 by definition and was not checked; "
                             f"no data left the GPU (in-place all-reduce is a no-op, all-gather and "
                             f"reduce-scatter copy within device memory)")
                continue
            if minimum is not None and m.busbw_gbs < minimum:
                failures.append(f"{m.group}: all-reduce busbw {m.busbw_gbs:.1f} GB/s at {format_size(m.size_bytes)} "
                                f"is below the minimum {minimum:g} GB/s ({why})")
    return failures, notes


def _gbs(gbit_per_s: float) -> float:
    return round(LINK_RATE_FRACTION * gbit_per_s / 8, 3)  # Gb/s of link -> GB/s of busbw


def _some(items: list[str], shown: int = 4) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
