"""The memory model: the peak GPU memory and host RAM of one `Setting` of a run, before anything allocates.

`estimate(facts, setting)` is what every planner path calls: `raytrain.planning.memory.estimate_memory`
(the configured setting and its alternatives, for the table and the fit check) and the search over
"auto" keys (`raytrain.planning.choose`). Measured accuracy: docs/plan-accuracy.md.

The model follows DeepSpeed 0.19.8's ZeRO-3 allocations (runtime/zero/stage3.py), itemised. n =
parameters on one rank, pb = bytes of the model dtype, mw / st = bytes of a master weight / of the
two Adam moments per parameter (4 / 8, or 2 / 4 with `bf16.bf16_master_weights_and_grads` /
`bf16_optimizer_states`):

- GPU, no optimizer offload: parameters pb*n, gradient partition pb*n, master weights mw*n, Adam
  moments st*n, the reduce bucket; while a layer runs, its full gradients (and on more than one
  GPU its gathered parameters plus the prefetch, and the persistent small parameters); at the
  optimizer step each sub-group's gradients are flattened and cast (mw + pb per element).
- Optimizer offload (`offload_optimizer`, `ratio` r): the sub-groups DeepSpeed keeps on the GPU
  (raytrain.planning.zero_layout) hold master, a persistent gradient buffer and the moments there
  (2*mw + st per parameter, stepped by torch's AdamW); everything else is on the host. The bf16
  gradient accumulation buffer of *all* parameters is on the host whatever r is (stage3.py:790-795).
- Host: that accumulation buffer (pinned), the CPU sub-groups' master and moments (pageable) and
  their gradient buffers (pinned each), the GPU sub-groups' pinned staging blocks that torch's
  host allocator keeps cached, parameter offload's pinned partitions, an init transient (the
  accumulation buffer exists pageable and pinned at once), and a per-process allowance. torch's
  pinned allocator rounds every block up to a power of two (ATen CachingHostAllocator.h).
  `pin_memory` defaults to true in DeepSpeed 0.19.8 (runtime/zero/offload_config.py).
- NVMe offload (`device: nvme`): the states live on the drive, not in host RAM; the host holds
  the swap buffers, pinned: the optimizer's buffer_count blocks of the largest sub-group (master
  dtype, swap_tensor/optimizer_utils.py), the parameters' buffer_count x buffer_size elements
  (partitioned_param_swapper.py) and up to max_in_cpu parameter elements of flat fp16 groups
  (stage3.py:888-909). The gradient accumulation buffer stays in host RAM.
- On one GPU ZeRO-3's gather is a view (partition_parameters.py, NoGatherHandle): no gathered-layer
  or persistent-parameter copies there.
- Stages 1 and 2 keep the parameters (and stage 1 the gradients) whole, as N; stage 0 (no ZeRO) keeps the master
  weights and moments whole on every rank too, and for fp32 no master copy at all.
- Activations: `activation_bytes` (Llama-style decoders and their mixtures of experts, GPT-2, GPT-NeoX, Phi3's
  fused projections; other models are approximated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raytrain.model import ParamStats, fused_layers_enabled
from raytrain.planning import zero_layout
from raytrain.planning.activations import GPT2_LIKE, activation_bytes, moe_dims, unread_dropout

GIB = 1024**3

# Kept free on every GPU: the CUDA context, NCCL's buffers and the caching allocator's
# fragmentation, none of which torch.cuda.max_memory_allocated (what the estimate models) counts.
GPU_RESERVE_FRACTION = 0.10
# Host RAM a worker process holds besides its tensors: Python, torch, the Ray worker and, on GPU
# nodes, the CUDA and NCCL libraries. The CPU figure is the measured RSS after imports
# (docs/plan-accuracy.md); the GPU figure is a round allowance for the CUDA libraries on top.
HOST_RESERVE_PER_GPU_WORKER = 4 * GIB
# A GPU worker that offloads nothing still holds ~2 bytes per parameter of its partition on the host,
# on top of a smaller base: fitted on the two measured rows (1.1B: 4.7 GiB, 7.24B: 16.2 GiB of host
# used, docs/plan-accuracy.md), not yet attributed (host-side copies while zero.Init builds and
# partitions the model are the likeliest) and measured at world size 1 only. With offload the rows
# match without it (DeepSpeed's own host buffers take that place). Used as max(4 GiB reserve, this).
HOST_BASE_WITHOUT_OFFLOAD = int(2.64 * GIB)
HOST_BYTES_PER_PARAM_WITHOUT_OFFLOAD = 2
HOST_RESERVE_PER_CPU_WORKER = 1 * GIB
# On CPU, glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MiB: most activation
# tensors) in the heap, so a worker's peak RSS runs above its live tensors: +15% to +32% measured.
CPU_HEAP_RETENTION = 0.30
# Host RAM kept free for the OS, the raylet and Ray's object store: Ray's memory monitor starts
# killing workers at 95% of a node's memory.
HOST_RESERVE_FRACTION = 0.10

# DeepSpeed's defaults (runtime/zero/config.py, offload_config.py) for keys a config leaves out.
_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                  "max_live_parameters": 1_000_000_000, "param_persistence_threshold": 100_000,
                  "sub_group_size": zero_layout.DEFAULT_SUB_GROUP_SIZE}


# Decoders whose layers are Llama's (RMSNorm, GQA attention, SwiGLU MLP): what activation_bytes and
# the throughput model (raytrain.planning.throughput) are written and calibrated for.
LLAMA_LIKE = ("llama", "mistral", "qwen2")
# Mixtures of experts whose attention and norms are those (Qwen3's q/k norms included) and on whose experts
# activation_bytes is measured (tests/unit/planning/test_moe.py); other families' are planned the same way.
MOE_LLAMA_LIKE = ("mixtral", "qwen2_moe", "qwen3_moe")


def model_caveat(hf_config) -> str | None:
    """A line saying how the planner approximates a model that is not a dense Llama-style decoder, else None."""
    model_type = getattr(hf_config, "model_type", "?")
    # A family planned as Llama's drops only attention probabilities in the plan; each other dropout the model
    # applies keeps a mask of its input's size (on a GPU 1 byte a value, 2h a token and layer for the residual
    # branches'; on a CPU the model's dtype, and SDPA with dropout keeps fp32 score matrices): GPTBigCode kept
    # 1.4-2.2x its CPU plan before its keys were read
    unread = unread_dropout(hf_config)
    dropout = (f"; its config sets {', '.join(f'{k}={v:g}' for k, v in unread.items())}, which the plan does not "
               f"count (it counts attention_dropout alone): each dropout the model applies keeps a mask of its "
               f"input's size, more activation memory than planned" if unread else "")
    moe = moe_dims(hf_config)
    if moe:
        return (f"model_type {model_type} is a mixture of {moe.experts} experts ({moe.per_token} per token): its "
                f"activations are modelled on what transformers' experts keep (grouped_mm or the reference loop; "
                f"fused MoE kernels keep less); tokens/s and MFU count the flops of the experts a token runs, at the "
                f"GPU efficiency measured on dense layers: a 4.8B Mixtral shape on an H200 ran at 0.68-0.87 of the "
                f"predicted tokens/s (docs/plan-accuracy.md), so treat tokens/s as an upper bound"
                + ("" if model_type in MOE_LLAMA_LIKE else
                                     "; its attention and norms are planned as Llama's, approximately") + dropout)
    if model_type in GPT2_LIKE:
        return (f"model_type {model_type}'s activations are modelled on its own layers (LayerNorms, its MLP, dropout; "
                f"measured on CPU, not on a GPU), its tokens/s on Llama layers' GPU efficiency: treat tokens/s as "
                f"approximate")
    if model_type not in LLAMA_LIKE or dropout:
        return (f"model_type {model_type} is planned as a Llama-style decoder (activations and tokens/s are modelled "
                f"and calibrated on Llama layers): treat activation memory and tokens/s as approximate" + dropout)
    return None


@dataclass(frozen=True)
class Setting:
    """One point of the planner's search: the settings it may choose for "auto" keys."""

    micro_batch: int
    gradient_checkpointing: bool
    offload_optimizer: bool = False
    ratio: float = 1.0
    """offload_optimizer.ratio: the fraction of sub-groups on the CPU (DeepSpeed rounds it, see zero_layout)."""
    sub_group_size: int = zero_layout.DEFAULT_SUB_GROUP_SIZE
    offload_param: bool = False

    @property
    def offload(self) -> str:
        """"none", "optimizer" or "param+optimizer" (the table's rows)."""
        return "param+optimizer" if self.offload_param else "optimizer" if self.offload_optimizer else "none"


@dataclass(frozen=True)
class MemoryFacts:
    """What the memory model reads about a run besides its `Setting`, computed once per run."""

    use_gpu: bool
    world_size: int
    workers_per_node: int
    stats: ParamStats
    hf_config: Any
    seq_len: int
    precision: str
    stage: int
    zero: dict[str, Any]
    """zero_optimization with DeepSpeed's defaults filled and the stage3_ prefixes dropped."""
    attn_implementation: str = "sdpa"
    liger_kernel: str = "none"
    raytrain_optimizer: bool = True
    """raytrain builds the optimizer (two param groups), else the JSON's (one group)."""
    pin_memory: bool = True
    bf16_master: bool = False
    bf16_states: bool = False
    fused_layers: bool = False
    """model.fused_layers as the worker resolves it (throughput only: its memory is transformers' layers' +0.1%)."""
    fp8: bool = False
    """model.fp8 on a GPU: the fused layers' projections in FP8 (throughput; activations keep fp8 GEMM inputs)."""
    document_mask: bool = False
    """data.position_ids=per_document under SDPA: transformers masks attention per document with a 4D mask
    (activations: repeated k and v, the mask per layer; throughput: SDPA's masked kernel)."""

    @property
    def pb(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def mw(self) -> int:
        return 2 if self.bf16_master else 4

    @property
    def st(self) -> int:
        return 4 if self.bf16_states else 8

    def nvme(self, section: str) -> bool:
        """zero_optimization.<section> (offload_optimizer / offload_param) names device nvme. A Setting
        says whether that offload is on; the device is the user's (the planner only ever picks cpu)."""
        value = self.zero.get(section)
        return isinstance(value, dict) and str(value.get("device", "none")).lower() == "nvme"

    def sub_groups(self, sub_group_size: int) -> list[int]:
        groups = zero_layout.param_groups(self.stats.param_numels, self.stats.param_ndims, self.raytrain_optimizer)
        if self.stage < 3:  # stages 1-2 flatten each param group whole
            return [sum(math.ceil(n / (self.world_size if self.stage else 1)) for n in g) for g in groups]
        return zero_layout.sub_groups(groups, self.world_size, int(sub_group_size))


def memory_facts(ds: dict[str, Any], run, *, use_gpu: bool, world_size: int, workers_per_node: int,
                 stats: ParamStats, hf_config) -> MemoryFacts:
    """MemoryFacts from a resolved DeepSpeed dict and the run config (`run`: a RunConfig)."""
    raw = ds.get("zero_optimization") or {}
    zero = {**_ZERO_DEFAULTS, **{k.removeprefix("stage3_"): v for k, v in raw.items()}}
    bf16 = ds.get("bf16") or {}
    precision = ("bf16" if bf16.get("enabled") is True else
                 "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32")
    pins = [(raw.get(k) or {}).get("pin_memory", True) for k in ("offload_optimizer", "offload_param")
            if isinstance(raw.get(k), dict) and str(raw[k].get("device", "none")).lower() != "none"]
    return MemoryFacts(
        use_gpu=use_gpu, world_size=world_size, workers_per_node=workers_per_node, stats=stats,
        hf_config=hf_config, seq_len=run.data.seq_len, precision=precision, stage=int(zero.get("stage", 0)),
        zero=zero, attn_implementation=run.model.attn_implementation, liger_kernel=run.model.liger_kernel,
        raytrain_optimizer="optimizer" not in ds, pin_memory=any(pins) if pins else True,
        bf16_master=bool(bf16.get("bf16_master_weights_and_grads")),
        bf16_states=bool(bf16.get("bf16_optimizer_states")),
        fused_layers=fused_layers_enabled(run.model, hf_config),
        fp8=bool(run.model.fp8) and use_gpu,
        document_mask=run.data.position_ids == "per_document" and run.model.attn_implementation == "sdpa")


def activation_options(f: MemoryFacts) -> dict[str, Any]:
    """activation_bytes' keyword arguments for a run. On a GPU, SDPA's fused kernels (and
    flash-attn) return their output (batch, seq, heads, head_dim)-contiguous, so o_proj's input is a
    view of it (one copy); the CPU math path and eager attention make a second one. Dropout keeps a
    bool mask on a GPU and none in its fused attention kernels; on a CPU a mask of the model's dtype,
    and SDPA with dropout keeps its score matrices (`on_gpu`). Under fp16 XGLM's softmax keeps fp32 (`fp16`)."""
    return {"attn_implementation": f.attn_implementation, "liger_kernel": f.liger_kernel,
            "sdpa_out_copies": 1 if f.use_gpu and f.attn_implementation != "eager" else 2, "fp8": f.fp8,
            "on_gpu": f.use_gpu, "fp16": f.precision == "fp16", "document_mask": f.document_mask}


def configured_setting(ds: dict[str, Any], gradient_checkpointing: bool) -> Setting:
    """The Setting a resolved DeepSpeed dict (and model.gradient_checkpointing) describe."""
    zero = ds.get("zero_optimization") or {}

    def on(which: str) -> dict[str, Any] | None:
        section = zero.get(which)
        return section if isinstance(section, dict) and str(section.get("device", "none")).lower() != "none" else None

    opt = on("offload_optimizer")
    return Setting(micro_batch=int(ds["train_micro_batch_size_per_gpu"]),
                   gradient_checkpointing=gradient_checkpointing,
                   offload_optimizer=opt is not None, ratio=float(opt.get("ratio", 1.0)) if opt else 1.0,
                   sub_group_size=int(zero.get("sub_group_size", zero_layout.DEFAULT_SUB_GROUP_SIZE)),
                   offload_param=on("offload_param") is not None)


@dataclass(frozen=True)
class Estimate:
    """What one Setting needs, per worker and per node."""

    setting: Setting
    worker_bytes: int
    """Peak memory of one worker on its device: GPU memory, or host RAM on a CPU run."""
    host_bytes_per_node: int
    """Host RAM of the busiest node: its workers' host-side states, pinned buffers and process allowance."""
    breakdown: tuple[tuple[str, int], ...]
    """Itemised per-worker bytes behind the two totals."""
    params_on_gpu: int
    """Parameters (on one rank) whose optimizer states live on the GPU (all of them without offload)."""
    params_on_host: int
    resident_bytes: int = 0
    """Model states resident on the device (the peak without working set and step transients)."""
    working_bytes: int = 0
    """At the start of backward, on top of resident: activations, a layer's gradients (and gathered parameters)."""
    step_bytes: int = 0
    """At the optimizer step, on top of resident (activations are freed by then)."""
    host_state_bytes: int = 0
    """Host-side states and pinned buffers of one worker (without the process allowance)."""
    sub_groups: tuple[int, ...] = ()
    gpu_sub_groups: int = 0

    @property
    def offload(self) -> str:
        return self.setting.offload


def estimate(f: MemoryFacts, s: Setting, subs: list[int] | None = None) -> Estimate:
    """Peak device memory and host RAM of one setting (see the module docstring for each item).

    subs: `f.sub_groups(s.sub_group_size)` when the caller already has it (the search calls this often)."""
    stats, world, stage, pb, mw, st = f.stats, f.world_size, f.stage, f.pb, f.mw, f.st
    zero = f.zero
    n = math.ceil(stats.num_params / world)  # this rank's partition (DeepSpeed pads to world size)
    params = n if stage == 3 else stats.num_params
    grads = n if stage >= 2 else stats.num_params
    largest = stats.largest_layer_params
    threshold = int(zero["param_persistence_threshold"])
    persistent = sum(x for x in stats.param_numels if x <= threshold)
    on_gpu_host = f.use_gpu  # on CPU "offload" moves nothing anywhere
    opt_off = on_gpu_host and s.offload_optimizer and stage >= 1
    par_off = on_gpu_host and s.offload_param and stage == 3
    opt_nvme, par_nvme = opt_off and f.nvme("offload_optimizer"), par_off and f.nvme("offload_param")
    pin = f.pin_memory and f.use_gpu

    def pinned(nbytes: int) -> int:  # torch's pinned allocator rounds every block up to a power of two
        return 1 << (int(nbytes) - 1).bit_length() if pin and nbytes > 0 else int(nbytes)

    subs = subs if subs is not None else f.sub_groups(s.sub_group_size)
    gpu_subs, cpu_subs = zero_layout.split(subs, s.ratio if stage == 3 else 1.0) if opt_off else (subs, [])
    n_gpu, n_cpu = sum(gpu_subs), sum(cpu_subs)
    master = "bf16 master weights" if f.bf16_master else "fp32 master weights"
    resident: list[tuple[str, int]] = []
    host: list[tuple[str, int]] = []
    working: list[tuple[str, int]] = []
    step: list[tuple[str, int]] = []

    if par_off:
        # Persistent parameters stay on the GPU (partition_parameters.py:1829); the rest are pinned on
        # the host: per parameter by zero.Init, then one flat buffer per param group (stage3.py:888-909);
        # the per-parameter blocks stay in torch's host cache (counted: not yet measured).
        groups = zero_layout.param_groups(stats.param_numels, stats.param_ndims, f.raytrain_optimizer)
        resident.append(("persistent parameters (kept on the GPU)", pb * persistent))
        if par_nvme:
            section = zero["offload_param"]
            in_cpu, blocks = int(section.get("max_in_cpu", 1_000_000_000)), []
            for g in groups:  # flat groups are kept in host RAM up to max_in_cpu elements, the rest on the drive
                size = math.ceil(sum(g) / world)
                blocks.append(min(size, in_cpu))
                in_cpu = max(0, in_cpu - size)
            host.append(("parameter partitions kept in host RAM (offload_param.max_in_cpu, pinned)",
                         sum(pinned(pb * b) for b in blocks if b)))
            buffers = int(section.get("buffer_count", 5)) * int(section.get("buffer_size", 100_000_000))
            host.append(("NVMe swap buffers, parameters (buffer_count x buffer_size, pinned)", pinned(pb * buffers)))
        else:
            host.append(("parameter partitions (pinned, one block per param group)",
                         sum(pinned(pb * math.ceil(sum(g) / world)) for g in groups)))
            host.append(("per-parameter pinned blocks from zero.Init (cached)",
                         sum(pinned(pb * math.ceil(x / world)) for x in stats.param_numels if x > threshold)
                         if pin else 0))
    else:
        resident.append(("parameter partition" if stage == 3 else "parameters", pb * params))
    hpz = int(zero.get("zero_hpz_partition_size") or 1)
    if stage == 3 and 1 < hpz < world:
        resident.append(("hpZ secondary parameter copy", pb * math.ceil(stats.num_params / hpz)))
    if stage == 3 and world > 1 and not par_off:
        resident.append(("persistent small parameters", pb * persistent))
    if zero.get("contiguous_gradients", True):
        resident.append(("reduce bucket", pb * int(zero["reduce_bucket_size"])))
    unfused = not f.use_gpu and f.raytrain_optimizer  # torch's AdamW on CPU: the per-tensor loop
    if opt_off:
        resident += [(f"{master}, GPU sub-groups", mw * n_gpu), ("gradient buffers, GPU sub-groups", mw * n_gpu),
                     ("Adam moments, GPU sub-groups", st * n_gpu)]
        # torch's AdamW (foreach, not fused) on the largest GPU sub-group (stage3.py:313-326)
        step.append(("step: AdamW temporaries, largest GPU sub-group", mw * max(gpu_subs, default=0)))
        cached = {pinned(mw * x) for x in gpu_subs} - {pinned(mw * x) for x in cpu_subs} if pin else set()
        host.append(("gradient accumulation buffer, all parameters (pinned)", pinned(pb * grads)))
        if opt_nvme:  # master, moments and gradients of the offloaded sub-groups pass through these
            count = int(zero["offload_optimizer"].get("buffer_count", 4))
            host.append(("NVMe swap buffers, optimizer (buffer_count x largest sub-group, pinned)",
                         pinned(mw * count * max(subs))))
        else:
            host += [(f"{master}, CPU sub-groups", mw * n_cpu), ("Adam moments, CPU sub-groups", st * n_cpu),
                     ("gradient buffers, CPU sub-groups (pinned each)", sum(pinned(mw * x) for x in cpu_subs))]
        host.append(("pinned staging of GPU sub-groups' gradient buffers (cached)", sum(cached)))
    else:
        sg = max(subs)
        # ZeRO 1-3 partition the master weights and moments. Stage 0 is no ZeRO: DeepSpeed 0.19.8 wraps the
        # optimizer in FP16_Optimizer for fp16 and bf16 (engine.py _do_optimizer_sanity_check: DDP_BFLOAT16),
        # whole on every rank, and leaves it bare for fp32, whose parameters are their own master weights.
        states = n if stage >= 1 else stats.num_params
        masters = 0 if stage == 0 and f.precision == "fp32" else states
        resident += [("gradient partition", pb * grads), (master, mw * masters), ("Adam moments", st * states)]
        # At the step each sub-group's gradients are flattened (model dtype) and cast to the master dtype.
        step += [("step: gradients of one sub-group, master dtype", mw * sg),
                 ("step: flatten / Adam temporaries", max(pb * sg if pb != mw else 0, st * sg if unfused else 0))]
    if stage == 3 and (world > 1 or par_off):
        working.append(("gathered layer + prefetch", pb * min(largest + int(zero["prefetch_bucket_size"]),
                                                              max(int(zero["max_live_parameters"]), largest))))
    if stage >= 2:
        working.append(("full gradients of a layer", pb * largest))
    if opt_off:
        # partition_grads (stage3.py:2006-2050) moves each gradient of a reduce bucket to the host through
        # a GPU copy in the master dtype (non-blocking, so a bucket's worth is in flight): measured +1.8
        # GiB at 6.74B with a 5e8 bucket and little else (calibration row 6.74b-mb1-ckpt-offload).
        working.append(("gradients of a bucket on their way to the host", mw * min(int(zero["reduce_bucket_size"]), n)))
    act = activation_bytes(f.hf_config, s.micro_batch, f.seq_len, pb, checkpointing=s.gradient_checkpointing,
                           **activation_options(f))
    working.append(("activations", act))

    total = lambda items: sum(b for _, b in items)  # noqa: E731
    device = total(resident) + max(total(working), total(step))
    host_states = total(host)
    if opt_off:
        # At init the accumulation buffer exists pageable and pinned at once, and Adam's moments do
        # not exist yet (created at the first step): the init peak is the larger one for big models
        # with few parameters on the host.
        init = host_states - (0 if opt_nvme else st * n_cpu) + max(pb * grads, mw * max(subs))
        if init > host_states:
            host.append(("init: pageable copies before pinning (transient)", init - host_states))
            host_states = init
    if f.use_gpu:
        per_worker = device
        host_per_worker = host_states + HOST_RESERVE_PER_GPU_WORKER
        if not opt_off and not par_off:
            host_per_worker = max(host_per_worker, host_states + HOST_BASE_WITHOUT_OFFLOAD +
                                  HOST_BYTES_PER_PARAM_WITHOUT_OFFLOAD * n)
    else:
        # On CPU the "device" is host RAM: everything a worker holds is on its node.
        per_worker = device + host_states
        host_per_worker = int(per_worker * (1 + CPU_HEAP_RETENTION)) + HOST_RESERVE_PER_CPU_WORKER
    return Estimate(setting=s, worker_bytes=per_worker, host_bytes_per_node=f.workers_per_node * host_per_worker,
                    breakdown=(*resident, *working, *step, *host),
                    params_on_gpu=n_gpu if opt_off else n, params_on_host=n_cpu if opt_off else 0,
                    resident_bytes=total(resident), working_bytes=total(working), step_bytes=total(step),
                    host_state_bytes=host_states,
                    sub_groups=tuple(subs), gpu_sub_groups=len(gpu_subs))


