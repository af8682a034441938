"""Memory planning: what a run needs per GPU and per node, worked out before anything allocates.

Start at `estimate_memory`: from a resolved run (raytrain.planning.resolve.resolve_run) it computes, per worker, the ZeRO-3 model states for three offload settings
(none, optimizer, parameters + optimizer), the activations with and without gradient
checkpointing, and the peak GPU memory and host RAM per node of all six combinations. `check_fits`
turns a plan that does not fit into a one-line `ConfigError` naming the setting that would;
`format_plan` prints the table. Measured accuracy: docs/plan-accuracy.md.

Where the numbers come from (n = parameters / world size, pb = 2 bytes for bf16/fp16, 4 for fp32):

- Model states follow DeepSpeed 0.19's ZeRO-3 allocations (runtime/zero/stage3.py), itemised
  rather than its `estimate_zero3_model_states_mem_needs` shortcut (18 bytes/param + 4 x largest
  layer per GPU without offload, a 1.5x buffer factor on host RAM). Resident: parameter partition
  pb*n, gradient partition pb*n (gradients accumulate in the model dtype), fp32 master weights 4*n
  (a separate copy even in fp32 training, as measured), Adam moments 8*n, the reduce bucket
  (reduce_bucket_size elements) and ZeRO++ hpZ's secondary copy (pb x parameters / hpz).
  While a layer runs its full parameters and, in backward, its full gradients exist on every rank:
  pb x (largest layer + stage3_prefetch_bucket_size, capped by stage3_max_live_parameters) +
  pb x largest layer. At the optimizer step each sub-group's gradients are flattened and cast to
  fp32 (4 + pb bytes per element of a sub-group). Offloading moves the gradient partition, master
  weights, Adam moments and a fp32 gradient buffer (18 bytes/param in bf16) to host RAM, then the
  parameters too; pinned buffers are rounded up to a power of two, as torch's pinned allocator does.
- Activations: see `activation_bytes` (Llama-style decoders; other models are approximated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raytrain.config import ConfigError
from raytrain.hardware import Target
from raytrain.model import ParamStats, config_from_facts, param_stats
from raytrain.run_spec import ResolvedRun

GIB = 1024**3


class DoesNotFit(ConfigError):
    """The configured run does not fit its target; the message names the setting that would."""

    def __init__(self, message: str, plan: "MemoryPlan"):
        super().__init__(message)
        self.plan = plan

# Kept free on every GPU: the CUDA context, NCCL's buffers and the caching allocator's
# fragmentation, none of which torch.cuda.max_memory_allocated (what the estimate models) counts.
GPU_RESERVE_FRACTION = 0.10
# Host RAM a worker process holds besides its tensors: Python, torch, the Ray worker and, on GPU
# nodes, the CUDA and NCCL libraries. The CPU figure is the measured RSS after imports
# (docs/plan-accuracy.md); the GPU figure is a round allowance for the CUDA libraries on top.
HOST_RESERVE_PER_GPU_WORKER = 4 * GIB
HOST_RESERVE_PER_CPU_WORKER = 1 * GIB
# On CPU, glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MiB: most activation
# tensors) in the heap, so a worker's peak RSS runs above its live tensors: +15% to +32% measured.
CPU_HEAP_RETENTION = 0.30
# Host RAM kept free for the OS, the raylet and Ray's object store: Ray's memory monitor starts
# killing workers at 95% of a node's memory.
HOST_RESERVE_FRACTION = 0.10

# DeepSpeed's defaults (runtime/zero/config.py) for keys a config leaves out.
_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                  "max_live_parameters": 1_000_000_000, "param_persistence_threshold": 100_000,
                  "sub_group_size": 1_000_000_000}

OFFLOADS = ("none", "optimizer", "param+optimizer")
_OFFLOAD_SETTINGS = {
    "none": [],
    "optimizer": ["deepspeed.zero_optimization.offload_optimizer.device=cpu"],
    "param+optimizer": ["deepspeed.zero_optimization.offload_optimizer.device=cpu",
                        "deepspeed.zero_optimization.offload_param.device=cpu"],
}
CHECKPOINTING_SETTING = "model.gradient_checkpointing=true"


@dataclass(frozen=True)
class Option:
    """One offload x checkpointing combination and what it needs."""

    offload: str
    """"none", "optimizer" or "param+optimizer" (DeepSpeed offload to CPU)."""
    gradient_checkpointing: bool
    worker_bytes: int
    """Peak memory of one worker on its device: GPU memory, or host RAM on a CPU run."""
    host_bytes_per_node: int
    """Host RAM of the busiest node: its workers' offloaded states plus process overhead."""
    breakdown: tuple[tuple[str, int], ...]
    """Itemised per-worker bytes behind the two totals (resident, working set, transient)."""
    configured: bool = False

    @property
    def settings(self) -> list[str]:
        """The KEY=VALUE overrides that select this option."""
        return _OFFLOAD_SETTINGS[self.offload] + ([CHECKPOINTING_SETTING] if self.gradient_checkpointing else [])


@dataclass
class MemoryPlan:
    """The memory a resolved run needs, for every offload and checkpointing choice."""

    use_gpu: bool
    world_size: int
    workers_per_node: int
    workers_per_node_assumed: bool
    """True when the node size was not known and a full node (8 GPUs) or one node was assumed."""
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    seq_len: int
    precision: str
    zero_stage: int
    model_type: str
    num_params: int
    largest_layer_params: int
    model_states: dict[str, tuple[int, int]]
    """offload -> (resident bytes on the device, offloaded bytes in host RAM), per worker."""
    activations: dict[bool, int]
    """gradient checkpointing -> activation bytes per worker at the configured micro-batch."""
    options: list[Option]
    gpu_memory_bytes: int | None = None
    """Target GPU memory per GPU (None: unknown)."""
    host_memory_bytes: int | None = None
    """Target host RAM per node (None: unknown)."""

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.world_size / self.workers_per_node)

    @property
    def configured(self) -> Option:
        return next(o for o in self.options if o.configured)


# ---------------------------------------------------------------------------------------------
# Estimates.


def activation_bytes(hf_config, micro_batch: int, seq_len: int, bytes_per_value: int, *,
                     checkpointing: bool, attn_implementation: str = "sdpa", liger_kernel: str = "none") -> int:
    """Activation memory of one worker at the start of backward (its peak), in bytes.

    Korthikanti et al. (2022) give s*b*h*(34 + 5*a*s/h) bytes per layer for a GPT layer in fp16.
    A Hugging Face Llama layer keeps different tensors for backward; per token, with e bytes per
    activation (2 for bf16/fp16, 4 for fp32):
      2 RMSNorms   2 x (4h + 2*e*h)     fp32 upcast of the input, the normalised value (kept by the
                                        weight multiply) and the output (kept by the next projections)
      attention    e*(q + 2*kv)         rotated q, k and v, kept by SDPA (no GQA copies)
                   2*e*q + 4*a          SDPA's output, the o_proj input (a copy) and the fp32 logsumexp
      SwiGLU MLP   4*e*i                gate, silu(gate), up and their product (the down_proj input)
      eager attn   a*s*(4 + e)          + fp32 softmax probabilities and their cast (SDPA/flash: none)
    Outside the layers: the final norm and the logits. HF's loss upcasts the logits to fp32, and at
    the start of backward the fp32 log-softmax (kept), its incoming gradient and the gradient w.r.t.
    the logits coexist: 12*vocab bytes per token, often more than a whole layer.
    With checkpointing each layer keeps only its input (e*h per token) and one layer at a time is
    recomputed with its full activations.
    Liger kernels (model.liger_kernel): "loss" computes the loss in chunks without materialising
    the logits (12*vocab -> 0); "all" also keeps only the input and output of each RMSNorm (2*e*h)
    and gate, up and their product in the MLP (3*e*i), recomputing silu in backward.
    """
    h = hf_config.hidden_size
    num_layers = hf_config.num_hidden_layers
    heads = getattr(hf_config, "num_attention_heads", None) or max(1, h // 64)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter = getattr(hf_config, "intermediate_size", None) or 4 * h
    vocab = hf_config.vocab_size
    e = bytes_per_value
    q, kv = heads * head_dim, kv_heads * head_dim

    fused = liger_kernel == "all"
    norm = (e * h if fused else 4 * h + e * h) + e * h
    attention = e * (q + 2 * kv) + 2 * e * q + 4 * heads
    if attn_implementation == "eager":
        attention += heads * seq_len * (4 + (e if e < 4 else 0))
    mlp = (3 if fused else 4) * e * inter
    layer = 2 * norm + attention + mlp
    layers = num_layers * e * h + layer if checkpointing else num_layers * layer
    logits = 0 if liger_kernel in ("loss", "all") else 12 * vocab
    per_token = layers + norm + logits
    return micro_batch * seq_len * per_token


def estimate_memory(resolved: ResolvedRun, target: Target = Target(), stats: ParamStats | None = None) -> MemoryPlan:
    """Plan the memory of a resolved run for every offload/checkpointing choice.

    target: the hardware (GPU memory, host RAM, GPUs per node), shown in the table and used for
    the verdicts; None parts are unknown. Workers per node: target's GPUs per node, else the
    resolved cluster's, else 8 GPUs or, on CPU, all workers on one node.
    stats: parameter sizes, when already known (default: a meta-device build of the model, cached).
    """
    ds = resolved.ds_config
    facts = resolved.deepspeed
    run = resolved.config
    hf_config = config_from_facts(resolved.model, run.model)
    use_gpu = resolved.cluster.use_gpu
    world = resolved.cluster.num_workers
    per_node = target.gpus_per_node or resolved.cluster.gpus_per_node
    assumed = per_node is None
    if per_node is None:
        per_node = min(world, 8) if use_gpu else world
    per_node = min(per_node, world)
    stats = stats or param_stats(hf_config, run.model.trust_remote_code)
    train_batch, micro_batch, grad_accum = (facts.train_batch_size, facts.micro_batch_per_gpu,
                                            facts.gradient_accumulation_steps)
    prec = facts.precision
    pb = 4 if prec == "fp32" else 2
    seq_len = run.data.seq_len
    zero = {**_ZERO_DEFAULTS, **{k.removeprefix("stage3_"): v for k, v in ds.get("zero_optimization", {}).items()}}
    stage = int(zero.get("stage", 0))
    # DeepSpeed offloads the optimizer from stage 1 and parameters only at stage 3.
    offloads = list(OFFLOADS[:1 + (stage >= 1) + (stage == 3)])
    gpu_memory_bytes, host_memory_bytes = target.gpu_memory_bytes, target.host_memory_bytes

    activations = {ckpt: activation_bytes(hf_config, micro_batch, seq_len, pb, checkpointing=ckpt,
                                          attn_implementation=run.model.attn_implementation,
                                          liger_kernel=run.model.liger_kernel)
                   for ckpt in (False, True)}
    configured_offload = _configured_offload(facts.offload_optimizer, facts.offload_param)
    if configured_offload not in offloads:
        offloads.append(configured_offload)
    # Without its own optimizer section the worker uses torch's AdamW: fused on GPU, but on CPU the
    # per-tensor loop, whose sqrt/divide temporaries take two more fp32 copies of a sub-group.
    unfused_adam = not use_gpu and "optimizer" not in ds
    model_states = {}
    options = []
    for offload in offloads:
        resident, host, working, step = _model_state_items(stats, world, pb, zero, offload, use_gpu, unfused_adam)
        model_states[offload] = (sum(b for _, b in resident), sum(b for _, b in host))
        for ckpt in (False, True):
            act = activations[ckpt]
            peak_work = sum(b for _, b in working) + act
            peak_step = sum(b for _, b in step)
            device = sum(b for _, b in resident) + max(peak_work, peak_step)
            breakdown = (*resident, *working, ("activations", act), *step, *host)
            if use_gpu:
                host_per_worker = sum(b for _, b in host) + HOST_RESERVE_PER_GPU_WORKER
                per_worker = device
            else:
                # On CPU the "device" is host RAM: everything a worker holds is on its node.
                per_worker = device + sum(b for _, b in host)
                host_per_worker = int(per_worker * (1 + CPU_HEAP_RETENTION)) + HOST_RESERVE_PER_CPU_WORKER
            options.append(Option(offload=offload, gradient_checkpointing=ckpt, worker_bytes=per_worker,
                                  host_bytes_per_node=per_node * host_per_worker, breakdown=breakdown,
                                  configured=(offload == configured_offload
                                              and ckpt == run.model.gradient_checkpointing)))
    return MemoryPlan(
        use_gpu=use_gpu, world_size=world, workers_per_node=per_node, workers_per_node_assumed=assumed,
        train_batch_size=train_batch, micro_batch_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum,
        seq_len=seq_len, precision=prec, zero_stage=stage, model_type=resolved.model.config_class.removesuffix("Config"),
        num_params=stats.num_params, largest_layer_params=stats.largest_layer_params, model_states=model_states,
        activations=activations, options=options, gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=host_memory_bytes)


def _configured_offload(optimizer_device: str, param_device: str) -> str:
    # NVMe offload is planned as CPU offload for the GPU side (host RAM is then an overestimate).
    if param_device != "none":
        return "param+optimizer"
    return "optimizer" if optimizer_device != "none" else "none"


def _model_state_items(stats: ParamStats, world: int, pb: int, zero: dict[str, Any], offload: str,
                       use_gpu: bool, unfused_adam: bool):
    """Per-worker (resident on device, host, working set on device, step transient on device) items.

    Stage 3 partitions parameters, gradients and optimizer states; stage 2 keeps the parameters
    whole, stage 1 the gradients too, stage 0 everything (approximations: raytrain is built for 3).
    """
    stage = int(zero.get("stage", 0))
    n = math.ceil(stats.num_params / world)  # this rank's partition (DeepSpeed pads to world size)
    params = n if stage == 3 else stats.num_params
    grads = n if stage >= 2 else stats.num_params
    optim = n if stage >= 1 else stats.num_params
    largest = stats.largest_layer_params
    sub_group = min(optim, int(zero["sub_group_size"])) if stage == 3 else optim
    persistent = sum(x for x in stats.param_numels if x <= int(zero["param_persistence_threshold"]))
    hpz = int(zero.get("zero_hpz_partition_size") or 1)
    pin = use_gpu and any((zero.get(k) or {}).get("pin_memory") for k in ("offload_optimizer", "offload_param"))
    on_host_opt = use_gpu and offload != "none"
    on_host_param = use_gpu and offload == "param+optimizer"

    def pinned(nbytes: int) -> int:
        # torch's pinned-memory allocator rounds every buffer up to the next power of two.
        return 1 << (nbytes - 1).bit_length() if pin and nbytes > 0 else nbytes

    def sub_groups(bytes_per_element: int) -> int:  # one pinned buffer per optimizer sub-group
        full, rest = divmod(optim, sub_group)
        return full * pinned(sub_group * bytes_per_element) + pinned(rest * bytes_per_element)

    resident, host = [], []
    (host if on_host_param else resident).append(
        ("parameter partition" if stage == 3 else "parameters", pinned(pb * params) if on_host_param else pb * params))
    if stage == 3 and 1 < hpz < world:
        (host if on_host_param else resident).append(
            ("hpZ secondary parameter copy", pb * math.ceil(stats.num_params / hpz)))
    if stage == 3:
        resident.append(("persistent small parameters", pb * persistent))
    if zero.get("contiguous_gradients", True):
        resident.append(("reduce bucket", pb * int(zero["reduce_bucket_size"])))
    if on_host_opt:
        host += [("gradient partition", pinned(pb * grads)), ("fp32 master weights", 4 * optim),
                 ("Adam moments", 8 * optim), ("fp32 gradients", sub_groups(4))]
        step = []
    else:
        resident += [("gradient partition", pb * grads), ("fp32 master weights", 4 * optim), ("Adam moments", 8 * optim)]
        # At the step each sub-group's gradients are flattened (model dtype) and cast to fp32.
        step = [("step: fp32 gradient copy", 4 * sub_group),
                ("step: flatten / Adam temporaries", max(pb * sub_group if pb < 4 else 0,
                                                         8 * sub_group if unfused_adam else 0))]
    working = []
    if stage == 3:
        working.append(("gathered layer + prefetch", pb * min(largest + int(zero["prefetch_bucket_size"]),
                                                              max(int(zero["max_live_parameters"]), largest))))
    if stage >= 2:
        working.append(("full gradients of a layer", pb * largest))
    return resident, host, working, step


# ---------------------------------------------------------------------------------------------
# Fitting.


def fits(option: Option, gpu_memory_bytes: int | None, host_memory_bytes: int | None, use_gpu: bool) -> bool:
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
    need = _need(plan, current)
    have = _have(plan, gpu_mem_bytes, host_mem_bytes)
    rank = {"none": 0, "optimizer": 1, "param+optimizer": 2}
    candidates = sorted(
        (o for o in plan.options
         if rank[o.offload] >= rank[current.offload] and o.gradient_checkpointing >= current.gradient_checkpointing
         and o is not current and (plan.use_gpu or o.offload == current.offload)),
        key=lambda o: (rank[o.offload], o.gradient_checkpointing))
    for option in candidates:
        if fits(option, gpu_mem_bytes, host_mem_bytes, plan.use_gpu):
            changes = [s for s in option.settings if s not in current.settings]
            raise DoesNotFit(f"this run needs {need} ({have}); with {' '.join(changes)}: "
                              f"{_need(plan, option)} (python -m raytrain.tools.plan shows every option)", plan)
    act = plan.activations[current.gradient_checkpointing]
    more = ("add GPUs with scaling.num_workers (model states shrink with the world size)" if plan.use_gpu
            else "train on GPUs (scaling.use_gpu=true)")
    raise DoesNotFit(
        f"this run needs {need} ({have}) and no offload or checkpointing setting makes it fit: lower "
        f"deepspeed.train_micro_batch_size_per_gpu={plan.micro_batch_per_gpu} (activations: {_gib(act)} of it, "
        f"linear in the micro-batch) or data.seq_len, or {more}", plan)


def _need(plan: MemoryPlan, option: Option) -> str:
    if plan.use_gpu:
        return f"{_gib(option.worker_bytes)} per GPU and {_gib(option.host_bytes_per_node)} host RAM per node"
    return (f"{_gib(option.host_bytes_per_node)} host RAM per node "
            f"({plan.workers_per_node} workers x {_gib(option.worker_bytes)})")


def _have(plan: MemoryPlan, gpu_mem: int | None, host_mem: int | None) -> str:
    parts = []
    if plan.use_gpu and gpu_mem is not None:
        parts.append(f"the GPUs have {_gib(gpu_mem)}, {_gib(gpu_mem * (1 - GPU_RESERVE_FRACTION))} usable")
    if host_mem is not None:
        parts.append(f"the nodes have {_gib(host_mem)} RAM, {_gib(host_mem * (1 - HOST_RESERVE_FRACTION))} usable")
    return "; ".join(parts)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------
# The table.


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: batch arithmetic, parameters, model states, activations, and what fits."""
    device = "GPU" if plan.use_gpu else "worker"
    node_note = " (assumed: pass --gpus-per-node)" if plan.workers_per_node_assumed and plan.num_nodes > 1 else ""
    lines = [
        f"model       {plan.model_type}, {plan.num_params:,} parameters (largest layer {plan.largest_layer_params:,}), "
        f"{plan.precision}, ZeRO-{plan.zero_stage}",
        f"cluster     {plan.world_size} {'GPU' if plan.use_gpu else 'CPU'} workers = {plan.num_nodes} node(s) x "
        f"{plan.workers_per_node}{node_note}",
        f"batch       train_batch_size {plan.train_batch_size} = micro-batch {plan.micro_batch_per_gpu} x "
        f"gradient_accumulation_steps {plan.gradient_accumulation_steps} x world size {plan.world_size}; "
        f"seq_len {plan.seq_len} ({plan.train_batch_size * plan.seq_len:,} tokens per step)",
        f"target      {_target(plan)}",
        "",
        f"model states per {device} (ZeRO-{plan.zero_stage} over {plan.world_size})"
        + ("   on GPU      in host RAM per node" if plan.use_gpu else "   in host RAM"),
    ]
    for offload in (plan.model_states if plan.use_gpu else ("none",)):
        resident, host = plan.model_states[offload]
        label = "no offload" if offload == "none" else f"offload {offload} to cpu"
        if plan.use_gpu:
            lines.append(f"  {label:<40} {_gib(resident):>11}  {_gib(host * plan.workers_per_node):>11}")
        else:
            lines.append(f"  {label:<40} {_gib(resident + host):>11}")
    lines.append(f"activations per {device} (micro-batch {plan.micro_batch_per_gpu} x seq_len {plan.seq_len})")
    for ckpt in (False, True):
        label = "gradient checkpointing" if ckpt else "no checkpointing"
        lines.append(f"  {label:<40} {_gib(plan.activations[ckpt]):>11}")
    lines += ["", f"peak (states + working set + activations)       per {device:<6}  host per node  fits"]
    target_known = plan.gpu_memory_bytes is not None or plan.host_memory_bytes is not None
    for option in plan.options:
        if not plan.use_gpu and option.offload != "none":
            continue
        label = ("no offload" if option.offload == "none" else "offload " + option.offload) + \
                (", checkpointing" if option.gradient_checkpointing else "")
        fit = fits(option, plan.gpu_memory_bytes, plan.host_memory_bytes, plan.use_gpu)
        verdict = ("yes" if fit else "no") if target_known else "?"
        mark = "  <- configured" if option.configured else ""
        lines.append(f"  {label:<45} {_gib(option.worker_bytes):>11}  {_gib(option.host_bytes_per_node):>13}  "
                     f"{verdict:<4}{mark}")
    return "\n".join(lines)


def _target(plan: MemoryPlan) -> str:
    parts = []
    if plan.use_gpu:
        parts.append(f"{_gib(plan.gpu_memory_bytes)} per GPU ({_gib(plan.gpu_memory_bytes * (1 - GPU_RESERVE_FRACTION))} "
                     f"usable)" if plan.gpu_memory_bytes else "GPU memory unknown (pass --gpu-memory-gib)")
    parts.append(f"{_gib(plan.host_memory_bytes)} host RAM per node "
                 f"({_gib(plan.host_memory_bytes * (1 - HOST_RESERVE_FRACTION))} usable)"
                 if plan.host_memory_bytes else "host RAM unknown (pass --host-memory-gib)")
    return ", ".join(parts)
