"""Memory planning: what a run needs per GPU and per node, and whether it fits, before anything allocates.

Start at `estimate_memory`: from a resolved run (raytrain.planning.resolve.resolve_run) it computes the
peak GPU memory and host RAM of the configured setting and of the other offload x checkpointing
choices at the same micro-batch, each with `raytrain.planning.estimate.estimate` (where the items
and their sources are). `check_fits` turns a plan that does not fit into a one-line `ConfigError`
naming the setting that would; `raytrain.planning.table.format_plan` prints the table.
Measured accuracy: docs/plan-accuracy.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from raytrain.config import ConfigError, RunConfig
from raytrain.deepspeed_config import micro_batch_lever
from raytrain.hardware import Target
from raytrain.model import ParamStats, config_from_facts, param_stats
from raytrain.planning.activations import activation_bytes
from raytrain.planning.estimate import (  # noqa: F401  (GIB and the reserves: this module's API, as before)
    CPU_HEAP_RETENTION, GIB, GPU_RESERVE_FRACTION, HOST_RESERVE_FRACTION, Estimate, MemoryFacts, activation_options,
    configured_setting, estimate, memory_facts, model_caveat)
from raytrain.run_spec import ClusterShape, ResolvedRun


class DoesNotFit(ConfigError):
    """The run does not fit its target; the message names the setting that would. `plan`: the
    configured run's plan, None when no setting of its "auto" keys fits (raytrain.planning.choose)."""

    def __init__(self, message: str, plan: "MemoryPlan | None"):
        super().__init__(message)
        self.plan = plan


@dataclass(frozen=True)
class Option(Estimate):
    """An Estimate in a plan's table; `configured` marks the run's own setting."""

    configured: bool = False

    @property
    def gradient_checkpointing(self) -> bool:
        return self.setting.gradient_checkpointing

    @property
    def settings(self) -> list[str]:
        """The KEY=VALUE overrides that select this option's offload and checkpointing."""
        s, prefix = self.setting, "deepspeed.zero_optimization."
        out = []
        if s.offload_optimizer:
            out.append(f"{prefix}offload_optimizer.device=cpu")
            if s.ratio != 1.0:
                out.append(f"{prefix}offload_optimizer.ratio={s.ratio:g}")
        if s.offload_param:
            out.append(f"{prefix}offload_param.device=cpu")
        return out + (["model.gradient_checkpointing=true"] if s.gradient_checkpointing else [])


@dataclass
class MemoryPlan:
    """The memory a resolved run needs, for every offload and checkpointing choice."""

    facts: MemoryFacts
    workers_per_node_assumed: bool
    """True when the node size was not known and a full node (8 GPUs) or one node was assumed."""
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    model_type: str
    options: list[Option]
    activations: dict[bool, int]
    """gradient checkpointing -> activation bytes per worker at the configured micro-batch."""
    gpu_memory_bytes: int | None = None
    """Target GPU memory per GPU (None: unknown), after scaling.gpu_memory_fraction."""
    host_memory_bytes: int | None = None
    """Target host RAM per node (None: unknown)."""
    gpu_memory_fraction: float | None = None
    notes: list[str] = field(default_factory=list)
    micro_batch_lever: str = ""
    """How the user lowers the micro-batch, in the key they set it with (deepspeed_config.micro_batch_lever)."""

    use_gpu = property(lambda self: self.facts.use_gpu)
    world_size = property(lambda self: self.facts.world_size)
    workers_per_node = property(lambda self: self.facts.workers_per_node)
    seq_len = property(lambda self: self.facts.seq_len)
    precision = property(lambda self: self.facts.precision)
    zero_stage = property(lambda self: self.facts.stage)
    num_params = property(lambda self: self.facts.stats.num_params)
    largest_layer_params = property(lambda self: self.facts.stats.largest_layer_params)

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.world_size / self.workers_per_node)

    @property
    def configured(self) -> Option:
        return next(o for o in self.options if o.configured)

    @property
    def model_states(self) -> dict[str, tuple[int, int]]:
        """offload -> (resident bytes on the device, host-side bytes), per worker."""
        return {o.offload: (o.resident_bytes, o.host_state_bytes) for o in self.options if not o.gradient_checkpointing}


def capped_gpu_memory(gpu_memory_bytes: int | None, fraction: float | None) -> int | None:
    """The GPU memory a run may use: scaling.gpu_memory_fraction of the GPU, as the worker caps
    torch's allocator (torch.cuda.set_per_process_memory_fraction)."""
    if gpu_memory_bytes is None or fraction is None:
        return gpu_memory_bytes
    return int(gpu_memory_bytes * fraction)


def workers_per_node(target: Target, cluster: ClusterShape) -> tuple[int, bool]:
    """(workers per node, assumed): the target's GPUs per node, else the cluster's, else 8 GPUs
    (or, on CPU, all workers on one node)."""
    world, use_gpu = cluster.num_workers, cluster.use_gpu
    per_node = target.gpus_per_node or cluster.gpus_per_node
    assumed = per_node is None
    if per_node is None:
        per_node = min(world, 8) if use_gpu else world
    return min(per_node, world), assumed


def estimate_memory(resolved: ResolvedRun, target: Target = Target(), stats: ParamStats | None = None,
                    written: RunConfig | None = None) -> MemoryPlan:
    """Plan the memory of a resolved run: its configured setting and the other offload and
    checkpointing choices at the same micro-batch (optimizer offload at the configured ratio).

    target: the hardware (GPU memory, host RAM, GPUs per node), shown in the table and used for
    the verdicts; None parts are unknown. stats: parameter sizes, when already known (default: a
    meta-device build of the model, cached). written: the config as the user wrote it, before
    resolve_run made its DeepSpeed dict concrete: the refusal names the key that set the micro-batch.
    """
    run, facts = resolved.config, resolved.deepspeed
    hf_config = config_from_facts(resolved.model, run.model)
    per_node, assumed = workers_per_node(target, resolved.cluster)
    stats = stats or param_stats(hf_config, run.model.trust_remote_code)
    mfacts = memory_facts(resolved.ds_config, run, use_gpu=resolved.cluster.use_gpu,
                          world_size=resolved.cluster.num_workers, workers_per_node=per_node, stats=stats,
                          hf_config=hf_config)
    configured = configured_setting(resolved.ds_config, run.model.gradient_checkpointing is True)
    # DeepSpeed offloads the optimizer from stage 1 and parameters only at stage 3.
    offloads = [(False, False)] + [(True, False)] * (mfacts.stage >= 1) + [(True, True)] * (mfacts.stage == 3)
    if (configured.offload_optimizer, configured.offload_param) not in offloads:
        offloads.append((configured.offload_optimizer, configured.offload_param))
    options = []
    for opt, par in offloads:
        for ckpt in (False, True):
            s = replace(configured, offload_optimizer=opt, offload_param=par, gradient_checkpointing=ckpt,
                        ratio=configured.ratio if configured.offload_optimizer else 1.0)
            e = estimate(mfacts, s)
            options.append(Option(**{k: getattr(e, k) for k in Estimate.__dataclass_fields__},
                                  configured=s == configured))
    activations = {ckpt: activation_bytes(hf_config, configured.micro_batch, mfacts.seq_len, mfacts.pb,
                                          checkpointing=ckpt, **activation_options(mfacts)) for ckpt in (False, True)}
    fraction = run.scaling.gpu_memory_fraction
    return MemoryPlan(
        facts=mfacts, workers_per_node_assumed=assumed, train_batch_size=facts.train_batch_size,
        micro_batch_per_gpu=facts.micro_batch_per_gpu, gradient_accumulation_steps=facts.gradient_accumulation_steps,
        model_type=resolved.model.config_class.removesuffix("Config"), options=options, activations=activations,
        gpu_memory_bytes=capped_gpu_memory(target.gpu_memory_bytes, fraction),
        host_memory_bytes=target.host_memory_bytes, gpu_memory_fraction=fraction,
        notes=list(filter(None, [model_caveat(hf_config)])),
        micro_batch_lever=micro_batch_lever((written or run).deepspeed, (written or run).training,
                                            facts.micro_batch_per_gpu, resolved.cluster.num_workers))


# ---------------------------------------------------------------------------------------------
# Fitting.


def fits(option: Estimate, gpu_memory_bytes: int | None, host_memory_bytes: int | None, use_gpu: bool) -> bool:
    """True unless a known limit is exceeded (after GPU_RESERVE_FRACTION / HOST_RESERVE_FRACTION)."""
    if use_gpu and gpu_memory_bytes is not None and option.worker_bytes > gpu_memory_bytes * (1 - GPU_RESERVE_FRACTION):
        return False
    return not (host_memory_bytes is not None
                and option.host_bytes_per_node > host_memory_bytes * (1 - HOST_RESERVE_FRACTION))


def check_fits(plan: MemoryPlan) -> None:
    """Raise ConfigError (one line) if the configured run does not fit, naming the setting that would.

    Alternatives are tried cheapest first: gradient checkpointing (~1/3 more compute), optimizer
    offload (CPU Adam, PCIe traffic each step), then parameter offload (PCIe traffic every layer).
    A limit the plan's target does not know (None) is not checked.
    """
    gpu_mem_bytes, host_mem_bytes = plan.gpu_memory_bytes, plan.host_memory_bytes
    current = plan.configured
    if fits(current, gpu_mem_bytes, host_mem_bytes, plan.use_gpu):
        return
    need = need_text(plan.use_gpu, plan.workers_per_node, current)
    have = have_text(plan.use_gpu, gpu_mem_bytes, host_mem_bytes)
    rank = {"none": 0, "optimizer": 1, "param+optimizer": 2}
    others = [o for o in plan.options if o.gradient_checkpointing >= current.gradient_checkpointing
              and o is not current and (plan.use_gpu or o.offload == current.offload)]
    # More offload or checkpointing frees GPU memory, the cheapest first. Where none fits, less offload:
    # the host RAM may be the limit (pinned optimizer states at 12-16 bytes a parameter), the nearest first.
    candidates = (sorted((o for o in others if rank[o.offload] >= rank[current.offload]),
                         key=lambda o: (rank[o.offload], o.gradient_checkpointing))
                  + sorted((o for o in others if rank[o.offload] < rank[current.offload]),
                           key=lambda o: (-rank[o.offload], o.gradient_checkpointing)))
    for option in candidates:
        if fits(option, gpu_mem_bytes, host_mem_bytes, plan.use_gpu):
            turned_off = [f"deepspeed.zero_optimization.{which}.device=none" for which in
                          ("offload_optimizer", "offload_param")
                          if getattr(current.setting, which) and not getattr(option.setting, which)]
            changes = [s for s in option.settings if s not in current.settings] + turned_off
            raise DoesNotFit(f"this run needs {need} ({have}); with {' '.join(changes)}: "
                             f"{need_text(plan.use_gpu, plan.workers_per_node, option)} "
                             f"(python -m raytrain.tools.plan shows every option)", plan)
    act = plan.activations[current.gradient_checkpointing]
    more = ("add GPUs with scaling.num_workers (model states shrink with the world size)" if plan.use_gpu
            else "train on GPUs (scaling.use_gpu=true)")
    raise DoesNotFit(
        f"this run needs {need} ({have}) and no offload or checkpointing setting makes it fit: activations take "
        f"{gib(act)} of it at micro-batch {plan.micro_batch_per_gpu}, linear in the micro-batch: "
        f"{plan.micro_batch_lever}, or lower data.seq_len, or {more}", plan)


def need_text(use_gpu: bool, per_node: int, option: Estimate) -> str:
    if use_gpu:
        return f"{gib(option.worker_bytes)} per GPU and {gib(option.host_bytes_per_node)} host RAM per node"
    return f"{gib(option.host_bytes_per_node)} host RAM per node ({per_node} workers x {gib(option.worker_bytes)})"


def verdict(plan: MemoryPlan) -> str:
    """The planner's one line for the configured run, once check_fits has passed."""
    have = have_text(plan.use_gpu, plan.gpu_memory_bytes, plan.host_memory_bytes)
    unknown = [what for what, known in (("GPU memory", not plan.use_gpu or plan.gpu_memory_bytes is not None),
                                        ("host RAM", plan.host_memory_bytes is not None)) if not known]
    need = need_text(plan.use_gpu, plan.workers_per_node, plan.configured)
    if not have:
        return f"memory: not checked, the target's {' and '.join(unknown)} unknown; this run needs {need}"
    return (f"memory: fits: this run needs {need} ({have}"
            + (f"; {' and '.join(unknown)} unknown, not checked" if unknown else "") + ")")


def have_text(use_gpu: bool, gpu_mem: int | None, host_mem: int | None) -> str:
    parts = []
    if use_gpu and gpu_mem is not None:
        parts.append(f"the GPUs have {gib(gpu_mem)}, {gib(gpu_mem * (1 - GPU_RESERVE_FRACTION))} usable")
    if host_mem is not None:
        parts.append(f"the nodes have {gib(host_mem)} RAM, {gib(host_mem * (1 - HOST_RESERVE_FRACTION))} usable")
    return "; ".join(parts)


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"
