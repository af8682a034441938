"""Facts and measurements for the preflight's unit tests: a node as its first worker reports it, and an
all-reduce measurement with a chosen bus bandwidth."""

from __future__ import annotations

from raytrain.network.preflight_report import Measurement, NodeFacts, bus_factor

GB = 10**9


def node(ip: str = "10.0.0.1", **kw) -> NodeFacts:
    base = dict(hostname=ip, num_ranks=8, gpu_count=8, gpu_name="NVIDIA H200", driver="550.90.07", cuda="12.4",
                nccl="2.21.5", torch="2.5.1")
    return NodeFacts(node_ip=ip, **{**base, **kw})


def ib_node(ip: str = "10.0.0.1", num_ports: int = 8, gbps: float = 400.0, **kw) -> NodeFacts:
    """An Azure ND H100/H200 v5 VM: 8 NDR InfiniBand ports."""
    ports = kw.pop("rdma_ports", [f"mlx5_ib{i}:1" for i in range(num_ports)])
    rates = kw.pop("link_gbps", {p: gbps for p in ports})
    return node(ip, fabric="InfiniBand", rdma_ports=ports, link_gbps=rates, **kw)


def efa_node(ip: str = "10.1.0.5", num_devices: int = 32, gbps: float = 100.0, **kw) -> NodeFacts:
    """A p5.48xlarge (32 EFA devices at 100 Gb/s) or, with 4 devices, a p4d.24xlarge."""
    devices = [f"rdmap{79 + i}s0:1" for i in range(num_devices)]
    return node(ip, fabric="EFA", efa_devices=devices, link_gbps={d: gbps for d in devices}, **kw)


def ar(phase: str, group: str, size: int, busbw: float, n: int) -> Measurement:
    """An all-reduce measurement whose busbw is `busbw` GB/s."""
    time_s = size / (busbw * GB / bus_factor("all_reduce", n)) if n > 1 else 1e-3
    return Measurement(phase, group, "all_reduce", size, n, time_s)
