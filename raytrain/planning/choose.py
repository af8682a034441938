"""The planner's choice for "auto" settings: the fastest predicted setting that fits, and why.

Start at `resolve_auto` (called by raytrain.planning.resolve.resolve_run, so the real run, `--dry-run`
and `python -m raytrain.tools.plan` make the same choice). The keys it may choose, each only when
the user wrote "auto" there (every value the user wrote wins):

- `training.micro_batch_size_per_gpu: auto` (the DeepSpeed JSON's train_micro_batch_size_per_gpu
  then "auto" or absent, as Hugging Face's "auto" fills it from the trainer);
- `model.gradient_checkpointing: auto`;
- `deepspeed.zero_optimization.offload_optimizer: auto` (none, or the CPU with a ratio), or
  `offload_optimizer.ratio: auto` under a section that names the device;
- `deepspeed.zero_optimization.sub_group_size: auto` (with the ratio: the split is by sub-group);
- `deepspeed.zero_optimization.offload_param: auto` (only when nothing else fits).

It enumerates these settings, keeps those whose peaks (raytrain.planning.estimate) fit the GPU
and the host with the fit check's margins, ranks them by predicted tokens/s
(raytrain.planning.throughput) and, among those within TIE of the best, takes the smallest
micro-batch (the shortest step: past the GPU's saturation a larger one mostly amortises the
optimizer step) and, for it, the setting that leaves the most headroom on its tighter limit. bf16
optimizer states are never chosen: they cost accuracy; when only they would make a run fit, the error
says so. On CPU (no throughput model there) it takes the largest
micro-batch that fits, without checkpointing where possible. For an elastic range
(scaling.num_workers: [min, max]) a setting must fit, and its batch divide, at every size of the
range; it is ranked at the maximum.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from raytrain.config import ConfigError, RunConfig
from raytrain.deepspeed_config import load_deepspeed, resolve_deepspeed
from raytrain.hardware import Target
from raytrain.model import param_stats
from raytrain.planning import zero_layout
from raytrain.planning.deepspeed_check import refuse_old_offload_spellings
from raytrain.planning.estimate import (Estimate, MemoryFacts, Setting, configured_setting, estimate, memory_facts,
                                        model_caveat)
from raytrain.planning.memory import (GPU_RESERVE_FRACTION, HOST_RESERVE_FRACTION, DoesNotFit, capped_gpu_memory, fits,
                                      gib)
from raytrain.planning.throughput import Prediction, predict
from raytrain.run_spec import ClusterShape

AUTO = "auto"
MAX_MICRO_BATCH = 128
# Predictions closer than this are a tie (the model's spread against the calibration rows is a
# few percent): the tie goes to the setting with the lowest GPU peak, i.e. the most headroom.
TIE = 0.01
_Z = "deepspeed.zero_optimization."


@dataclass(frozen=True)
class AutoKeys:
    """Which settings the user left to the planner."""

    micro_batch: bool = False
    checkpointing: bool = False
    offload_optimizer: str = ""
    """"" (as written), "auto" (none or the CPU) or "ratio" (the device is written, the ratio is not)."""
    sub_group_size: bool = False
    offload_param: bool = False

    def __bool__(self) -> bool:
        return any(dataclasses.astuple(self))

    def names(self) -> list[str]:
        return [name for name, on in (
            ("training.micro_batch_size_per_gpu", self.micro_batch),
            ("model.gradient_checkpointing", self.checkpointing),
            (f"{_Z}offload_optimizer" + (".ratio" if self.offload_optimizer == "ratio" else ""),
             self.offload_optimizer),
            (f"{_Z}sub_group_size", self.sub_group_size), (f"{_Z}offload_param", self.offload_param)) if on]


@dataclass(frozen=True)
class Candidate:
    estimate: Estimate
    prediction: Prediction | None
    grad_accum: int

    @property
    def setting(self) -> Setting:
        return self.estimate.setting


@dataclass(frozen=True)
class Choice:
    best: Candidate
    runner_up: Candidate | None
    num_fit: int
    lines: tuple[str, ...]


def find_autos(cfg: RunConfig, ds: dict[str, Any]) -> AutoKeys:
    """The "auto" settings of a config, each checked for what it can be (one-line errors)."""
    mb = cfg.training.micro_batch_size_per_gpu
    _only_auto(mb, "training.micro_batch_size_per_gpu", "a positive integer")
    _only_auto(cfg.model.gradient_checkpointing, "model.gradient_checkpointing", "true, false")
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    opt = zero.get("offload_optimizer")
    offload = "auto" if opt == AUTO else "ratio" if isinstance(opt, dict) and opt.get("ratio") == AUTO else ""
    if offload == "ratio" and str(opt.get("device", "none")).lower() != "cpu":
        raise ConfigError(f"{_Z}offload_optimizer.ratio=auto needs offload_optimizer.device=cpu (the ratio splits the "
                          f"optimizer between the GPU and the CPU), got device {opt.get('device', 'none')!r}")
    autos = AutoKeys(micro_batch=mb == AUTO, checkpointing=cfg.model.gradient_checkpointing == AUTO,
                     offload_optimizer=offload, sub_group_size=zero.get("sub_group_size") == AUTO,
                     offload_param=zero.get("offload_param") == AUTO)
    if autos.micro_batch:
        given = {k: ds.get(k) for k in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                        "gradient_accumulation_steps")}
        if isinstance(given["train_micro_batch_size_per_gpu"], int):
            raise ConfigError(f"training.micro_batch_size_per_gpu=auto but deepspeed.train_micro_batch_size_per_gpu="
                              f"{given['train_micro_batch_size_per_gpu']} sets it: drop one of them")
        if isinstance(given["train_batch_size"], int) and (
                isinstance(given["gradient_accumulation_steps"], int) or cfg.training.gradient_accumulation_steps):
            raise ConfigError("training.micro_batch_size_per_gpu=auto but deepspeed.train_batch_size and the gradient "
                              "accumulation steps fix the micro-batch: make train_batch_size \"auto\" or leave the "
                              "accumulation steps free")
    return autos


def _only_auto(value: Any, key: str, what: str) -> None:
    if isinstance(value, str) and value != AUTO:
        raise ConfigError(f"{key} must be {what} or \"auto\" (the planner chooses), got {value!r}")


def resolve_auto(cfg: RunConfig, shape: ClusterShape, hf_config,
                 target: Target | None) -> tuple[RunConfig, Choice | None]:
    """`cfg` with its "auto" settings chosen for `shape` and `target` (unchanged when it has none)."""
    ds_raw = load_deepspeed(cfg.deepspeed)
    refuse_old_offload_spellings(ds_raw)  # the search reads offload_optimizer / offload_param only
    autos = find_autos(cfg, ds_raw)
    if not autos:
        return cfg, None
    target = target or Target()
    gpu_mem = capped_gpu_memory(target.gpu_memory_bytes, cfg.scaling.gpu_memory_fraction)
    if shape.use_gpu and gpu_mem is None:
        raise ConfigError(f"{', '.join(autos.names())}=auto needs the GPU memory of the target, which is unknown here: "
                          f"plan with python -m raytrain.tools.plan --gpu-memory-gib N (or run on the cluster), "
                          f"or set the values")
    template = _placeholders(cfg, ds_raw, autos)
    stats = param_stats(hf_config, cfg.model.trust_remote_code)
    node = target.gpus_per_node or shape.gpus_per_node or (8 if shape.use_gpu else shape.num_workers)
    # An elastic range runs the chosen setting at every size: it must fit at each (ZeRO-3's states per
    # GPU are largest at the minimum, host RAM per node can be largest at the maximum); the ranking
    # by throughput is at the maximum. Costs one memory estimate per size and candidate micro-batch.
    at_sizes = [_facts_at(w, template, shape, hf_config, stats, min(node, w), autos) for w in shape.world_sizes]
    facts, ds_t = tuple(f for f, _ in at_sizes), at_sizes[-1][1]
    _check_offload_optimizer(autos, ds_t)
    grad_accum = _grad_accum_rule(ds_raw, cfg, shape.num_workers)
    base = configured_setting(ds_t, template.model.gradient_checkpointing is True)
    search = dict(cfg=cfg, autos=autos, base=base, grad_accum=grad_accum, gpu_mem=gpu_mem,
                  host_mem=target.host_memory_bytes)
    if autos.micro_batch and not _micro_batches(cfg, autos, base, grad_accum, facts):
        raise ConfigError(_no_micro_batch(cfg, shape))
    choice = _search(facts, **search)
    if choice is None:
        raise DoesNotFit(_nothing_fits(facts, **search), None)
    return apply(cfg, ds_raw, autos, choice.best.setting), choice


def _facts_at(world: int, template: RunConfig, shape: ClusterShape, hf_config, stats, per_node: int,
              autos: AutoKeys) -> tuple[MemoryFacts, dict[str, Any]]:
    """MemoryFacts of the placeholder config at one world size (and the DeepSpeed dict resolved for it).
    Below an elastic range's maximum the batch keys are pinned to any valid values: the memory facts
    do not read them, and the batch rules of every size are _micro_batches' and resolve_world_sizes'."""
    raw, training = template.deepspeed, template.training
    if world != shape.num_workers:
        raw = {**raw, "train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
        training = replace(training, micro_batch_size_per_gpu=None, gradient_accumulation_steps=None)
    ds = resolve_deepspeed(raw, training, world_size=world, use_gpu=shape.use_gpu,
                           hidden_size=hf_config.hidden_size, gpus_per_node=shape.gpus_per_node)
    facts = memory_facts(ds, template, use_gpu=shape.use_gpu, world_size=world, workers_per_node=per_node,
                         stats=stats, hf_config=hf_config)
    if autos.offload_optimizer == "auto":
        facts = replace(facts, pin_memory=True)  # what the chosen section will say
    return facts, ds


def _no_micro_batch(cfg: RunConfig, shape: ClusterShape) -> str:
    # (a train_batch_size the user wrote is checked against the shards and the world size before)
    sizes = shape.world_sizes
    rules = []
    if cfg.data.num_shards:
        rules.append(f"train_batch_size (micro-batch x accumulation x {shape.num_workers} workers) divisible by "
                     f"data.num_shards={cfg.data.num_shards}")
    if shape.elastic:
        rules.append(f"a whole gradient accumulation at every world size of scaling.num_workers=[{sizes[0]}, "
                     f"{sizes[-1]}]")
    return (f"training.micro_batch_size_per_gpu=auto: no micro-batch from 1 to {MAX_MICRO_BATCH} gives "
            f"{' and '.join(rules)}: set the accumulation steps, train_batch_size or data.num_shards so that one does")


def _placeholders(cfg: RunConfig, ds_raw: dict[str, Any], autos: AutoKeys) -> RunConfig:
    """The config with a concrete stand-in for every "auto" setting, so the rest resolves as usual."""
    return apply(cfg, ds_raw, autos, Setting(micro_batch=1, gradient_checkpointing=False,
                                             offload_optimizer=autos.offload_optimizer == "ratio"))


def apply(cfg: RunConfig, ds_raw: dict[str, Any], autos: AutoKeys, s: Setting) -> RunConfig:
    """`cfg` with the "auto" settings replaced by `s`'s values (nothing else is touched)."""
    ds = copy.deepcopy(ds_raw)
    training, model = cfg.training, cfg.model
    if autos.micro_batch:
        training = replace(training, micro_batch_size_per_gpu=s.micro_batch)
        ds["train_micro_batch_size_per_gpu"] = s.micro_batch
    if autos.checkpointing:
        model = replace(model, gradient_checkpointing=s.gradient_checkpointing)
    zero = ds.get("zero_optimization")
    if autos.offload_optimizer == "auto":
        zero["offload_optimizer"] = ({"device": "cpu", "pin_memory": True, "ratio": s.ratio}
                                     if s.offload_optimizer else {"device": "none"})
    elif autos.offload_optimizer == "ratio":
        zero["offload_optimizer"]["ratio"] = s.ratio
    if autos.sub_group_size:
        zero["sub_group_size"] = s.sub_group_size
    if autos.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True} if s.offload_param else {"device": "none"}
    return replace(cfg, training=training, model=model, deepspeed=ds)


def _check_offload_optimizer(autos: AutoKeys, ds: dict[str, Any]) -> None:
    if not (autos.offload_optimizer or autos.offload_param):
        return
    stage = int(ds["zero_optimization"].get("stage", 0))
    key = f"{_Z}" + ("offload_param" if not autos.offload_optimizer else
                     "offload_optimizer.ratio" if autos.offload_optimizer == "ratio" else "offload_optimizer")
    if stage == 0 or (stage < 3 and (autos.offload_optimizer == "ratio" or autos.offload_param)):
        raise ConfigError(f"{key}=auto needs ZeRO stage 3 (zero_optimization.stage is {stage}): set stage 3 or write "
                          f"the offload setting yourself")
    opt = ds.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower()
    if opt and (kind not in ("adam", "adamw") or (opt.get("params") or {}).get("torch_adam")):
        torch_adam = " with torch_adam" if kind in ("adam", "adamw") else ""
        raise ConfigError(f"{key}=auto plans DeepSpeed's CPU Adam for the host side, but the DeepSpeed JSON's "
                          f"optimizer is {opt.get('type')!r}{torch_adam}: write the offload setting yourself, or "
                          f"drop the optimizer section (raytrain's AdamW)")


def _grad_accum_rule(ds_raw: dict[str, Any], cfg: RunConfig, world: int):
    """Gradient accumulation as a function of the micro-batch (None: that micro-batch is not allowed)."""
    tbs, gas = ds_raw.get("train_batch_size"), ds_raw.get("gradient_accumulation_steps")
    fixed = gas if isinstance(gas, int) else cfg.training.gradient_accumulation_steps
    if isinstance(tbs, int) and not fixed:
        return lambda mb: tbs // (mb * world) if tbs % (mb * world) == 0 else None
    return lambda mb: fixed or 1


def _micro_batches(cfg: RunConfig, autos: AutoKeys, base: Setting, grad_accum,
                   fs: tuple[MemoryFacts, ...]) -> list[int]:
    """The micro-batches the batch rules allow. Every step takes train_batch_size / num_shards rows from
    each data shard (raytrain.data.ingest.MicroBatches), so train_batch_size = mb x accumulation x the
    maximum world size must be a multiple of data.num_shards; an elastic range keeps train_batch_size
    and the micro-batch, so each of its sizes needs a whole accumulation (resolve._check_batch_sizes)."""
    if not autos.micro_batch:
        return [base.micro_batch]
    sizes = [f.world_size for f in fs]

    def allowed(mb: int) -> bool:
        accumulation = grad_accum(mb)
        if not accumulation:
            return False
        batch = mb * accumulation * sizes[-1]
        whole_shards = not cfg.data.num_shards or batch % cfg.data.num_shards == 0
        return whole_shards and all(batch % (mb * w) == 0 for w in sizes)

    return [mb for mb in range(1, MAX_MICRO_BATCH + 1) if allowed(mb)]


def _structures(f: MemoryFacts, autos: AutoKeys, base: Setting, with_param_offload: bool) -> list[Setting]:
    """The non-micro-batch part of every candidate (micro_batch=1); `base`: the settings as written."""
    ckpts = (False, True) if autos.checkpointing else (base.gradient_checkpointing,)
    sgs_list = zero_layout.SUB_GROUP_SIZES if autos.sub_group_size else (base.sub_group_size,)
    out = []
    for sgs in sgs_list:
        offloads = [(base.offload_optimizer, base.ratio)]
        if autos.offload_optimizer and f.use_gpu:
            num = len(f.sub_groups(sgs))
            offloads = [(True, zero_layout.ratio_for(num, k)) for k in range(num)] if f.stage == 3 else [(True, 1.0)]
            # bf16 master weights with fp32 moments need optimizer offload (DeepSpeed asserts otherwise)
            needs_offload = f.bf16_master and not f.bf16_states
            if autos.offload_optimizer == "auto" and not with_param_offload and not needs_offload:
                offloads.insert(0, (False, 1.0))
        for opt, ratio in offloads:
            for ckpt in ckpts:
                param = with_param_offload or (base.offload_param and not autos.offload_param)
                out.append(replace(base, micro_batch=1, gradient_checkpointing=ckpt, offload_optimizer=opt, ratio=ratio,
                                   sub_group_size=sgs, offload_param=param))
    return list(dict.fromkeys(out))


def _search(fs: tuple[MemoryFacts, ...], *, cfg, autos, base, grad_accum, gpu_mem, host_mem) -> Choice | None:
    """`fs`: the facts at every world size the run may have, the maximum (ranked at) last."""
    f = fs[-1]
    mbs = _micro_batches(cfg, autos, base, grad_accum, fs)
    cand = _candidates(fs, autos, base, mbs, grad_accum, cfg, gpu_mem, host_mem, with_param_offload=False)
    if not cand and autos.offload_param and f.use_gpu:
        cand = _candidates(fs, autos, base, mbs, grad_accum, cfg, gpu_mem, host_mem, with_param_offload=True)
    if not cand:
        return None
    if not f.use_gpu:
        best = max(cand, key=lambda c: (not c.setting.gradient_checkpointing, c.setting.micro_batch))
        lines = (_line_cpu(best, autos), *filter(None, [model_caveat(f.hf_config)]))
        return Choice(best=best, runner_up=None, num_fit=len(cand), lines=lines)
    top = max(c.prediction.tokens_per_s for c in cand)
    usage = lambda c: max(c.estimate.worker_bytes / gpu_mem, c.estimate.host_bytes_per_node / host_mem  # noqa: E731
                          if host_mem else 0.0)
    best = min((c for c in cand if c.prediction.tokens_per_s >= top * (1 - TIE)),
               key=lambda c: (c.setting.micro_batch, usage(c), -c.prediction.tokens_per_s))
    kind = lambda c: (c.setting.offload, c.setting.gradient_checkpointing)  # noqa: E731
    others = [c for c in cand if kind(c) != kind(best)]
    runner_up = max(others, key=lambda c: c.prediction.tokens_per_s) if others else None
    return Choice(best=best, runner_up=runner_up, num_fit=len(cand),
                  lines=_lines(f, best, runner_up, autos, len(cand), gpu_mem, host_mem))


def _candidates(fs, autos, base, mbs, grad_accum, cfg, gpu_mem, host_mem, *, with_param_offload) -> list[Candidate]:
    """Every (structure, micro-batch) that fits at every world size, with its prediction at the
    maximum (estimates only where needed)."""
    out = []
    f = fs[-1]
    peak = cfg.training.peak_tflops_per_gpu * 1e12
    subs_by_size = {}

    def subs_of(g: MemoryFacts, sub_group_size: int) -> list[int]:
        key = (g.world_size, sub_group_size)
        return subs_by_size[key] if key in subs_by_size else subs_by_size.setdefault(key, g.sub_groups(sub_group_size))

    for s0 in _structures(f, autos, base, with_param_offload):
        subs = subs_of(f, s0.sub_group_size)

        def fit(mb: int, s0=s0) -> bool:
            return all(fits(estimate(g, replace(s0, micro_batch=mb), subs_of(g, s0.sub_group_size)), gpu_mem, host_mem,
                            g.use_gpu) for g in fs)

        lo, hi = 0, len(mbs)  # memory grows with the micro-batch: the fitting ones are a prefix of mbs
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if fit(mbs[mid]) else (lo, mid)
        for mb in mbs[:lo]:
            e = estimate(f, replace(s0, micro_batch=mb), subs)
            pred = predict(f, e, grad_accum=grad_accum(mb), cpus_per_worker=cfg.scaling.cpus_per_worker,
                           peak_flops=peak) if f.use_gpu else None
            out.append(Candidate(estimate=e, prediction=pred, grad_accum=grad_accum(mb)))
    return out


def describe(c: Candidate) -> str:
    s, e = c.setting, c.estimate
    parts = [f"micro-batch {s.micro_batch}" + (f" x {c.grad_accum} accumulation" if c.grad_accum > 1 else "")]
    if s.offload_optimizer and s.ratio < 1:
        parts.append(f"optimizer offload ratio {s.ratio:g} (sub_group_size {_count_e(s.sub_group_size)}: states of "
                     f"{_count(e.params_on_host)} of {_count(e.params_on_host + e.params_on_gpu)} params on the host)")
    elif s.offload_optimizer:
        parts.append("full optimizer offload")
    else:
        parts.append("no offload")
    if s.offload_param:
        parts.append("parameter offload")
    parts.append("checkpointing" if s.gradient_checkpointing else "no checkpointing")
    return ", ".join(parts)


def _count_e(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _lines(f, best: Candidate, runner_up: Candidate | None, autos: AutoKeys, num_fit: int,
           gpu_mem, host_mem) -> tuple[str, ...]:
    p, e = best.prediction, best.estimate
    usable_gpu = gpu_mem * (1 - GPU_RESERVE_FRACTION)
    host = (f"host {gib(e.host_bytes_per_node)}" + (f" of {gib(host_mem * (1 - HOST_RESERVE_FRACTION))} usable"
                                                   if host_mem else ""))
    first = (f"chose {describe(best)}: {p.tokens_per_s:,.0f} tokens/s per GPU predicted ({p.mfu:.1%} MFU), "
             f"GPU peak {gib(e.worker_bytes)} of {gib(usable_gpu)} usable, {host}")
    second = (f"runner-up {describe(runner_up)}: {runner_up.prediction.tokens_per_s:,.0f} tokens/s"
              if runner_up else "no other kind of setting fits")
    if runner_up and runner_up.prediction.tokens_per_s > p.tokens_per_s:
        second += (f" ({runner_up.prediction.tokens_per_s / p.tokens_per_s - 1:.1%} more, within the {TIE:.0%} the "
                   f"model cannot tell apart, where the smaller micro-batch, then the most headroom, wins)")
    second += (f"; {num_fit} settings of {', '.join(autos.names())} fit; ranked by raytrain/planning/throughput.py "
               f"(calibrated on one H200)")
    return (first, second, *filter(None, [model_caveat(f.hf_config)]))


def _line_cpu(best: Candidate, autos: AutoKeys) -> str:
    e = best.estimate
    return (f"chose {describe(best)} for {', '.join(autos.names())}: the largest micro-batch that fits host RAM "
            f"({gib(e.host_bytes_per_node)} per node; on CPU there is no throughput model)")


def _nothing_fits(fs: tuple[MemoryFacts, ...], *, cfg, autos, base, grad_accum, gpu_mem, host_mem) -> str:
    names = ", ".join(autos.names())
    f = fs[-1]
    mb = min(_micro_batches(cfg, autos, base, grad_accum, fs) or [base.micro_batch])

    def usable(e: Estimate) -> float:
        gpu = e.worker_bytes / (gpu_mem * (1 - GPU_RESERVE_FRACTION)) if gpu_mem and f.use_gpu else 0.0
        return max(gpu, e.host_bytes_per_node / (host_mem * (1 - HOST_RESERVE_FRACTION)) if host_mem else 0.0)

    # the closest structure is the one whose worst world size comes closest; that size is named
    def worst(s: Setting) -> tuple[float, int, Estimate]:
        return max(((usable(e), g.world_size, e) for g, e in ((g, estimate(g, s)) for g in fs)), key=lambda t: t[0])

    _, at, smallest = min((worst(replace(s, micro_batch=mb))
                           for s in _structures(f, autos, base, autos.offload_param and f.use_gpu)), key=lambda t: t[0])
    closest = f"the closest, {describe(Candidate(smallest, None, grad_accum(mb) or 1))}, needs "
    if len(fs) > 1:
        closest = f"at {at} workers (scaling.num_workers=[{fs[0].world_size}, {f.world_size}]) {closest}"
    if f.use_gpu:
        gpu_usable = (gpu_mem or 0) * (1 - GPU_RESERVE_FRACTION)
        host_usable = (host_mem or 0) * (1 - HOST_RESERVE_FRACTION)
        need = (f"{closest}{gib(smallest.worker_bytes)} per GPU and {gib(smallest.host_bytes_per_node)} host RAM per "
                f"node ({gib(gpu_usable)} and {gib(host_usable)} usable)")
        # What more GPUs change: ZeRO-3 divides the model states (on the GPU, and on each node's host); the
        # activations, a gathered layer and the step's transients stay whole on every GPU.
        undivided = smallest.worker_bytes - smallest.resident_bytes
        if gpu_mem and smallest.worker_bytes > gpu_usable and undivided > gpu_usable:
            hint = (f"more GPUs would not help: what ZeRO-3 does not divide among them needs {gib(undivided)} per GPU "
                    f"alone ({gib(dict(smallest.breakdown)['activations'])} of activations at micro-batch "
                    f"{smallest.setting.micro_batch} x data.seq_len {f.seq_len}); lower data.seq_len")
        elif gpu_mem and smallest.worker_bytes > gpu_usable:
            hint = ("add GPUs with scaling.num_workers (ZeRO-3 divides the model states among them), or lower "
                    "data.seq_len")
        elif smallest.offload != "none":  # the host RAM: each node holds its workers' share of the offloaded states
            hint = ("add nodes with scaling.num_workers (each node's RAM holds its workers' share of the offloaded "
                    "states), or use nodes with more RAM")
        else:
            hint = (f"use nodes with more RAM (a GPU worker's process needs "
                    f"{gib(smallest.host_bytes_per_node / f.workers_per_node)} of it without offload)")
    else:
        per_node = next(g.workers_per_node for g in fs if g.world_size == at)
        need = (f"{closest}{gib(smallest.host_bytes_per_node)} host RAM per node ({per_node} workers x "
                f"{gib(smallest.worker_bytes)}; {gib((host_mem or 0) * (1 - HOST_RESERVE_FRACTION))} usable)")
        hint = "lower data.seq_len, or train on GPUs (scaling.use_gpu=true)"
    if f.use_gpu and not f.bf16_states and f.precision == "bf16":
        bf16 = tuple(replace(g, bf16_master=True, bf16_states=True) for g in fs)
        choice = _search(bf16, cfg=cfg, autos=autos, base=base, grad_accum=grad_accum, gpu_mem=gpu_mem,
                         host_mem=host_mem)
        if choice is not None:
            master = "" if f.bf16_master else "deepspeed.bf16.bf16_master_weights_and_grads=true "
            hint = (f"with bf16 optimizer states ({master}deepspeed.bf16.bf16_optimizer_states=true: they cost "
                    f"accuracy, so raytrain never picks them itself) {describe(choice.best)} fits")
    return f"no setting of {names} fits: {need}; {hint}"
