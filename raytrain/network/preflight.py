"""The preflight: is this cluster's fabric fit to train on? Answer before training (driver side).

Start at `run_preflight` (the driver calls it when `network.preflight: true`). It places one Ray
actor per GPU (a placement group of the run's scaling.placement_strategy, PACK by default, on nodes of
its scaling.accelerator_type: the layout Ray Train gives training), applies raytrain's
per-node NCCL/Gloo environment (`raytrain.network.nccl_env.compute_nccl_env`, `network.env` winning) with
NCCL's INFO log switched on, builds a torch process group (nccl on GPU, gloo on CPU), and:

1. checks that GPU count and model, driver, CUDA, NCCL and torch versions agree across nodes;
2. times all-reduce, all-gather and reduce-scatter over message sizes (default 1 MiB to 1 GiB),
   within each node, across nodes with one rank per node, and across all ranks; algbw and busbw
   use nccl-tests' definitions (doc/PERFORMANCE.md there), so the numbers compare with theirs;
3. reads each rank's NCCL log (raytrain.network.nccl_log) and fails a node whose fabric NCCL does
   not use: NET/Socket (TCP) next to active InfiniBand/RoCE ports, or on EFA, aws-ofi-nccl missing or
   on libfabric's tcp provider;
4. returns a PreflightReport (raytrain.network.preflight_report): a table per node and one per
   cross-node group, then one verdict line (raytrain.network.preflight_checks) against minimum
   all-reduce busbw figures derived from the nodes' link rates.

The command line is raytrain.tools.preflight.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch
import torch.distributed as dist

from raytrain import console, hardware
from raytrain.config import NETWORK_ENV_PREFIXES, ConfigError, NetworkConfig
from raytrain.network.nccl_env import compute_nccl_env, find_ib_ports, select_fabric
from raytrain.network.nccl_log import NcclLog, parse_nccl_log
from raytrain.network.preflight_checks import evaluate
from raytrain.network.preflight_report import (
    ALL_RANKS, DEFAULT_CPU_SIZES, DEFAULT_GPU_SIZES, INTRA, MIB, ONE_PER_NODE, OPS, PHASES, Measurement, NodeFacts,
    PreflightReport, Thresholds, format_size)

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
        self.device_index = 0

    def facts(self) -> dict[str, Any]:
        """This process's node and versions. Does not initialise CUDA (CUDA_VISIBLE_DEVICES may still change)."""
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if self.use_gpu else []
        fabric = select_fabric(find_ib_ports(), notes=[])  # the plan's choice; its notes come with setup()
        names = [p.name for p in fabric.ports]
        facts: dict[str, Any] = {
            "node_ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "gpu_ids": gpu_ids,
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None,
            "gpu_count": 0, "gpu_name": None, "driver": None, "fabric": fabric.kind,
            "rdma_ports": names if fabric.kind != "EFA" else [], "efa_devices": names if fabric.kind == "EFA" else [],
            "link_gbps": {p.name: p.rate_gbps for p in fabric.ports if p.rate_gbps is not None},
        }
        if self.use_gpu:
            try:
                version = torch.cuda.nccl.version()
                facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            except Exception:  # a CPU build of torch has no NCCL
                pass
            found = hardware.gpus(use_torch=False)  # torch would initialise CUDA here
            facts.update(gpu_count=len(found), gpu_name=" + ".join(sorted({g.name for g in found})) or None,
                         driver=found[0].driver if found else None)
        return facts

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def apply_env(self, rank: int, visible_devices: str | None, device_index: int, multi_node: bool) -> dict[str, Any]:
        """Apply the node's NCCL/Gloo plan with NCCL's INFO log on; what the process group will see.

        Its own call, before `setup`: the environment is known even when NCCL then fails to start."""
        plan = compute_nccl_env(ray.util.get_node_ip_address(), forced=self.forced_env,
                                auto_configure=self.auto_configure, multi_node=multi_node)
        os.environ.update(plan.env)
        self.device_index = device_index
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
        applied = {k: v for k, v in os.environ.items() if k.startswith(NETWORK_ENV_PREFIXES)
                   and k not in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")}
        return {"env": applied, "notes": plan.notes, "ib_disable": os.environ.get("NCCL_IB_DISABLE") == "1"}

    def setup(self, rank: int, world_size: int, master: str, groups: dict[str, list[int]], timeout_s: float) -> None:
        """Build the process group and the subgroups, and connect every communicator."""
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
        device = torch.device("cuda", self.device_index) if self.use_gpu else torch.device("cpu")
        for phase in PHASES:
            if phase in self.groups:
                self._sync(self.groups[phase], device)

    def measure(self, phase: str, op: str, size_bytes: int, warmup_iters: int, iters: int) -> dict[str, Any] | None:
        """Time `iters` calls of `op` after `warmup_iters`; None when this rank is not in `phase`'s group."""
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
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The driver side.


def run_preflight(network: NetworkConfig, num_workers: int, use_gpu: bool, sizes: Sequence[int] | None = None, *,
                  iters: int = 20, warmup_iters: int = 5, min_nvlink_busbw_gbs: float | None = None,
                  min_ib_busbw_gbs: float | None = None, cpus_per_worker: float = 1.0,
                  accelerator_type: str | None = None, placement_strategy: str = "PACK",
                  timeout_s: float = 600.0, progress: Callable[[str], None] | None = None) -> PreflightReport:
    """Run the preflight on the Ray cluster this process is connected to (ray.init done).

    `sizes` in bytes (None: 1 MiB-1 GiB on GPU, 1-16 MiB on CPU); `iters`/`warmup_iters` per size
    (nccl-tests' -n 20 -w 5); minimums in GB/s (None: the defaults on GPU, unchecked on CPU);
    `timeout_s` bounds placement, process-group setup and each measurement; `progress` receives
    the progress lines (None: print them). Never raises for what it measures: failures are in the
    report (`passed` False), including a collective that hung. `cpus_per_worker`, `accelerator_type` and
    `placement_strategy` are the run's scaling settings: the preflight measures the nodes and the layout
    Ray Train will give the training workers.
    """
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if num_workers < 1:
        raise ConfigError(f"--num-workers must be at least 1, got {num_workers}")
    if iters < 1 or warmup_iters < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup-iters >= 0, got {iters} and {warmup_iters}")
    sizes = sorted(sizes or (DEFAULT_GPU_SIZES if use_gpu else DEFAULT_CPU_SIZES))
    forced = dict(network.env)  # validated by NetworkConfig: NCCL_*/GLOO_*/FI_* only, values as strings
    thresholds = Thresholds.defaults(use_gpu, min_nvlink_busbw_gbs, min_ib_busbw_gbs)
    report = PreflightReport(backend="nccl" if use_gpu else "gloo", num_workers=num_workers, thresholds=thresholds)
    say = progress or console.say
    started = time.perf_counter()

    bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    # What Ray Train adds to each worker's bundle for scaling.accelerator_type (ray/air/config.py, ray 2.60.0):
    # the preflight then lands on the nodes of that type, as training will.
    accelerator = {f"accelerator_type:{accelerator_type}": 0.001} if accelerator_type else {}
    bundle.update(accelerator)
    # The run's scaling.placement_strategy (PACK by default: as few nodes as possible), as Ray Train places it.
    pg = placement_group([dict(bundle)] * num_workers, strategy=placement_strategy)
    actors: list[Any] = []
    node_ranks: dict[str, list[int]] = {}
    nodes: dict[str, NodeFacts] = {}
    log_dir = f"/tmp/raytrain_preflight/{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        say(f"preflight: placing {num_workers} worker(s) of {bundle} ...")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            report.failures.append(f"error: the cluster cannot place {num_workers} workers of {bundle} "
                                   f"({placement_strategy}) within {timeout_s:g}s: lower --num-workers or add nodes")
            return report
        worker_cls = ray.remote(PreflightWorker)
        actors = [worker_cls.options(num_cpus=cpus_per_worker, num_gpus=1 if use_gpu else 0, resources=accelerator,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i))
                  .remote(forced, network.auto_configure, use_gpu, log_dir) for i in range(num_workers)]
        facts = ray.get([a.facts.remote() for a in actors], timeout=timeout_s)

        # Ranks: node by node, GPUs in order, so each node's ranks are contiguous (as in Ray Train).
        order = sorted(range(num_workers), key=lambda i: (facts[i]["node_ip"], _gpu_key(facts[i]["gpu_ids"]), i))
        actors = [actors[i] for i in order]
        facts = [facts[i] for i in order]
        for rank, f in enumerate(facts):
            node_ranks.setdefault(f["node_ip"], []).append(rank)
        groups = _groups(node_ranks, num_workers)

        for ip, ranks in node_ranks.items():
            f = facts[ranks[0]]
            nodes[ip] = NodeFacts(node_ip=ip, hostname=f["hostname"], num_ranks=len(ranks), gpu_count=f["gpu_count"],
                                  gpu_name=f["gpu_name"], driver=f["driver"], cuda=f["cuda"], nccl=f["nccl"],
                                  torch=f["torch"], fabric=f["fabric"], rdma_ports=f["rdma_ports"],
                                  efa_devices=f["efa_devices"], link_gbps=f["link_gbps"])
        report.nodes = list(nodes.values())

        applied = []
        for rank, (actor, f) in enumerate(zip(actors, facts)):
            local = [g for r in node_ranks[f["node_ip"]] for g in facts[r]["gpu_ids"]]
            visible = ",".join(local) if use_gpu and local else None
            applied.append(actor.apply_env.remote(rank, visible, local.index(f["gpu_ids"][0]) if visible else 0,
                                                  len(node_ranks) > 1))
        applied = ray.get(applied, timeout=timeout_s)
        for ip, ranks in node_ranks.items():
            first = applied[ranks[0]]
            nodes[ip].env, nodes[ip].plan_notes = first["env"], first["notes"]
            nodes[ip].nccl_ib_disable = first["ib_disable"]
        master = f"{facts[0]['node_ip']}:{ray.get(actors[0].free_port.remote(), timeout=timeout_s)}"
        ray.get([a.setup.remote(rank, num_workers, master, groups, timeout_s) for rank, a in enumerate(actors)],
                timeout=timeout_s)

        phases = [p for p in PHASES if any(name.split(":")[0] == p for name in groups)]
        steps = [(p, op, s) for p in phases for op in OPS for s in sizes]
        say(f"preflight: {len(report.nodes)} node(s), {num_workers} rank(s), {report.backend}; "
            f"{len(steps)} measurements ({len(phases)} group kind(s) x {len(OPS)} collectives x {len(sizes)} sizes, "
            f"{warmup_iters} warmup + {iters} timed calls each)")
        _measure_all(actors, steps, groups, warmup_iters, iters, timeout_s, report, say)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
        report.failures.append(f"error: {type(e).__name__}: {_remote_error_line(e)}")
    finally:
        if use_gpu and nodes:
            # Also after an error: NCCL failing to start says why in its log (a missing net plugin).
            # A rank stuck in a collective cannot answer, so then only a short wait.
            _collect_nccl_logs(actors, node_ranks, nodes, log_dir, timeout_s if not report.failures else 30.0)
        if actors:
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=60)
            except Exception:  # a hung or dead rank: killing the actor below ends it anyway
                pass
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
        report.elapsed_s = time.perf_counter() - started
    evaluate(report)
    return report


def _collect_nccl_logs(actors: list[Any], node_ranks: dict[str, list[int]], nodes: dict[str, NodeFacts],
                       log_dir: str, timeout_s: float) -> None:
    """Each node's NCCL log, merged over its ranks; a node none of whose ranks answers keeps None."""
    refs = [a.nccl_log.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    texts = {}
    for rank, ref in enumerate(refs):
        if ref in ready:
            try:
                texts[rank] = ray.get(ref)
            except ray.exceptions.RayError:  # a dead rank: its node is judged by the others
                pass
    for ip, ranks in node_ranks.items():
        if any(r in texts for r in ranks):
            merged = NcclLog()
            for r in ranks:
                merged.merge(parse_nccl_log(texts.get(r, "")))
            nodes[ip].nccl_log = merged
            nodes[ip].nccl_log_files = [f"{log_dir}/nccl.rank{r}.log" for r in ranks]


def _measure_all(actors: list[Any], steps: list[tuple[str, str, int]], groups: dict[str, list[int]],
                 warmup_iters: int, iters: int, timeout_s: float, report: PreflightReport,
                 say: Callable[[str], None]) -> None:

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


def _remote_error_line(e: BaseException) -> str:
    text = str(e).strip()
    # A RayTaskError carries the remote traceback; its last line is the remote exception.
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


