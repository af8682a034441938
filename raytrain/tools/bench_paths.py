"""The three paths `python -m raytrain.tools.bench` measures, each run in its own child process.

- `run_raytrain`: the product path, `raytrain.fit(cfg)`: Ray Train + Ray Data + ZeRO-3 in the worker.
- `run_deepspeed`: the worker's own engine setup and step (raytrain.worker.engine) without Ray:
  one process, synthetic tokens already on the device.
- `run_torch`: plain PyTorch behind the same step function: fp32 weights, autocast, fused AdamW.

The in-process paths time windows exactly as the worker does (raytrain.worker.metrics), plus a
per-phase breakdown (CUDA events) and one profiled step (communication and attention kernels).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import raytrain
from raytrain import compat, hardware
from raytrain.config import RunConfig, load_config
from raytrain.data.sources import inspect_sources
from raytrain.deepspeed_config import DeepSpeedFacts
from raytrain.model import config_from_facts, enable_checkpointing, flops_per_token
from raytrain.planning.estimate import estimate
from raytrain.planning.memory import GIB, estimate_memory, fits
from raytrain.planning.resolve import resolve_run
from raytrain.planning.table import option_label as describe_setting
from raytrain.planning.throughput import predict
from raytrain.run_spec import ClusterShape, ResolvedRun
from raytrain.worker.engine import build_engine, build_optimizer, train_step
from raytrain.worker.kernels import apply_liger
from raytrain.worker.metrics import StepMeter, TrainMetrics


def this_target(num_gpus: int, use_gpu: bool) -> hardware.Target:
    """This machine as the driver sees a one-node cluster of it (raytrain.driver.cluster.cluster_target)."""
    here = hardware.this_machine()
    return hardware.Target(here.gpu_memory_bytes if use_gpu else None, here.host_memory_bytes,
                           num_gpus if use_gpu else None)


def resolve(overrides: list[str], num_gpus: int, use_gpu: bool, target: hardware.Target | None = None) -> ResolvedRun:
    """The run as raytrain resolves it for a world of `num_gpus` on this machine (every path gets this
    DeepSpeed dict; "auto" settings are chosen for this machine's GPU memory and RAM, as the driver
    chooses them on a one-node cluster of it). `target`: another machine (predictions made elsewhere)."""
    cfg = load_config(None, overrides)
    shape = ClusterShape(num_workers=num_gpus, use_gpu=use_gpu, gpus_per_node=num_gpus if use_gpu else None)
    sources = inspect_sources(cfg.data)
    resolved = resolve_run(cfg, shape, sources, target=target or this_target(num_gpus, use_gpu))
    sources.say_notes()  # as a run prints them (data.path given with --set)
    return resolved


def predicted(resolved: ResolvedRun, param_groups: int | None = None,
              target: hardware.Target | None = None) -> dict[str, Any]:
    """What the planner predicts for the resolved run on this machine (or `target`): GPU and host peaks
    (the memory model), tokens/s and MFU per GPU (the throughput model), to compare with what the path
    measures. param_groups: 1 to model an optimizer with one param group (the issue's plain runs)."""
    import dataclasses

    target = target or this_target(resolved.cluster.num_workers, resolved.cluster.use_gpu)
    plan = estimate_memory(resolved, target)
    facts = plan.facts if param_groups is None else dataclasses.replace(plan.facts,
                                                                        raytrain_optimizer=param_groups == 2)
    option = estimate(facts, plan.configured.setting)
    cfg = resolved.config
    out = {"gpu_peak_gib": option.worker_bytes / GIB if resolved.cluster.use_gpu else None,
           "host_gib": option.host_bytes_per_node / GIB, "setting": describe_setting(option),
           "fits": fits(option, plan.gpu_memory_bytes, plan.host_memory_bytes, resolved.cluster.use_gpu)}
    if resolved.cluster.use_gpu:
        p = predict(facts, option, grad_accum=resolved.deepspeed.gradient_accumulation_steps,
                    cpus_per_worker=cfg.scaling.cpus_per_worker, peak_flops=cfg.training.peak_tflops_per_gpu * 1e12)
        out.update(tokens_per_s=p.tokens_per_s * resolved.cluster.num_workers, mfu=p.mfu, step_time_s=p.step_time_s)
    return out


def run_deepspeed(args: argparse.Namespace, resolved: ResolvedRun) -> dict[str, Any]:
    """raytrain.worker's setup and step without Ray: zero.Init, deepspeed.initialize, synthetic tokens."""
    device = _device()
    _init_single_process_group(device)
    # A Ray worker's OpenMP threads (CPU Adam's) are its scaling.cpus_per_worker (Ray sets OMP_NUM_THREADS).
    torch.set_num_threads(max(1, int(resolved.config.scaling.cpus_per_worker)))
    transform = float8_linears if args.float8 else None
    # exactly the worker's setup (Liger from model.liger_kernel; the GPU cap from scaling.gpu_memory_fraction)
    engine, _, _ = build_engine(resolved, device, transform=transform)
    if args.deepspeed_overflow_scan:
        compat.restore_host_overflow_scan(engine.optimizer)
    out = _measure(args, resolved, engine, device)
    out.update(compiled=engine.is_compiled, host_overflow_scan_dropped=compat.host_overflow_scan_dropped(engine.optimizer))
    return out


def float8_linears(model):
    """torchao's float8 training (dynamic tensorwise scaling) for every nn.Linear but lm_head (whose
    weight Liger's fused loss reads directly). Float8Linear.from_float keeps the same weight Parameter,
    so ZeRO-3's partitioned parameter and its hooks carry over (issue 14 SPEC section 4)."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "lm_head")


class _TorchEngine:
    """Plain PyTorch behind the interface train_step drives (a DeepSpeed engine's): forward, backward, step."""

    def __init__(self, model, optimizer, scheduler, grad_accum: int, dtype, clip: float, device):
        self.model, self.optimizer, self.scheduler, self.grad_accum = model, optimizer, scheduler, grad_accum
        self.dtype, self.clip, self.device, self._micro = dtype, clip, device, 0

    def __call__(self, **inputs):
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.model(**inputs)

    def backward(self, loss) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.grad_accum:
            return
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def run_torch(args: argparse.Namespace, resolved: ResolvedRun) -> dict[str, Any]:
    """Plain PyTorch: fp32 weights on one device, autocast to the DeepSpeed dict's precision, fused AdamW."""
    facts = resolved.deepspeed
    if facts.offload_optimizer != "none":
        raise ValueError("the torch path has no optimizer offload: drop it from --paths with --offload")
    cfg = resolved.config
    device = _device()
    _init_single_process_group(device)  # for the window's all-reduce, as in the worker
    if device.type == "cuda" and cfg.scaling.gpu_memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(cfg.scaling.gpu_memory_fraction, device)
    torch.manual_seed(cfg.training.seed)
    apply_liger(cfg.model.liger_kernel)
    model = AutoModelForCausalLM.from_config(config_from_facts(resolved.model, cfg.model), dtype=torch.float32,
                                             attn_implementation=cfg.model.attn_implementation).to(device)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = False
    model.train()
    if cfg.model.compile:
        model.compile()  # the same lever as the worker's engine.compile(), without DeepSpeed's hooks
    optimizer, scheduler = build_optimizer(model, cfg.training, facts, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[facts.precision]
    engine = _TorchEngine(model, optimizer, scheduler, facts.gradient_accumulation_steps, dtype,
                          float(resolved.ds_config.get("gradient_clipping") or 0.0), device)
    out = _measure(args, resolved, engine, device)
    out.update(num_params=sum(p.numel() for p in model.parameters()), comm_s=0.0 if device.type == "cuda" else None)
    return out


def run_raytrain(args: argparse.Namespace, resolved: ResolvedRun, overrides: list[str],
                 progress_hint) -> dict[str, Any]:
    """The product path: raytrain.fit on a local Ray cluster (or RAY_ADDRESS's), built-in corpus.

    `progress_hint(record)` tells the parent what it needs to finish this path's record from the
    worker's progress lines alone (it stops the run after the last timed window)."""
    fpt = _flops_per_token(resolved)
    progress_hint({"ds_config": resolved.ds_config, "num_params": resolved.model.num_parameters,
                   "flops_per_token": fpt})
    storage = tempfile.mkdtemp(prefix="raytrain-bench-")
    run_cfg = load_config(None, overrides + [f"checkpoint.storage_path={storage}", "checkpoint.name=bench",
                                             "checkpoint.num_to_keep=1"])
    try:
        result = raytrain.fit(run_cfg)
    finally:
        shutil.rmtree(storage, ignore_errors=True)  # the final checkpoint: GBs nobody needs here
    if result.spec.ds_config != resolved.ds_config:
        raise RuntimeError(f"raytrain resolved a different DeepSpeed dict than the other paths: {result.spec.ds_config}")
    history = [m for m in result.history if m["step"] > args.warmup_steps]
    peak = args.peak_tflops * 1e12 * args.num_gpus if resolved.cluster.use_gpu else None
    out = summarize(history, resolved.tokens_per_step, fpt, peak)
    # The worker reports torch.cuda.max_memory_allocated (rank 0); no per-phase times (see docs).
    out.update(num_params=resolved.model.num_parameters, flops_per_token=fpt,
               peak_mem_gib=max(m["memory_gib"] for m in history))
    return out


# ---------------------------------------------------------------------------------------------
# Measuring the in-process paths.


def _measure(args: argparse.Namespace, resolved: ResolvedRun, engine, device) -> dict[str, Any]:
    facts: DeepSpeedFacts = resolved.deepspeed
    cfg: RunConfig = resolved.config
    fpt = _flops_per_token(resolved)
    peak = args.peak_tflops * 1e12 if device.type == "cuda" else None
    max_steps = args.warmup_steps + args.steps
    tokens_per_step = facts.micro_batch_per_gpu * facts.gradient_accumulation_steps * cfg.data.seq_len
    meter = StepMeter(max_steps=max_steps, tokens_per_step=tokens_per_step, flops_per_token=fpt, peak_flops_total=peak)
    metrics = TrainMetrics(meter, args.window, device, start_step=0, announce=False)
    batches = synthetic_batches(resolved.model.vocab_size, facts.micro_batch_per_gpu, cfg.data.seq_len, device)
    history, marks = [], []
    for n in range(1, max_steps + 1):
        timed = device.type == "cuda" and n > args.warmup_steps
        loss, wait = train_step(engine, batches, facts.gradient_accumulation_steps, device, marks if timed else None)
        metrics.record(n, loss, wait)
        if metrics.due(n):
            window = metrics.collect(n, 0.0, None)  # one device sync per window, as in the worker
            if n > args.warmup_steps:
                history.append(window)
    out = summarize(history, tokens_per_step, fpt, peak)
    out.update(_breakdown(marks, args.steps), num_params=resolved.model.num_parameters, flops_per_token=fpt,
               **_memory(device))
    if not args.no_profile:
        out.update(profile_step(lambda: train_step(engine, batches, facts.gradient_accumulation_steps, device), device))
    return out


def _breakdown(marks: list[list], steps: int) -> dict[str, float]:
    """Seconds per optimizer step in forward, backward and the optimizer step (CUDA events)."""
    if not marks:
        return {}
    torch.cuda.synchronize()
    phase = lambda i: sum(m[i].elapsed_time(m[i + 1]) for m in marks) / 1e3 / steps  # noqa: E731
    return {"forward_s": phase(0), "backward_s": phase(1), "optimizer_s": phase(2)}


def profile_step(run_one_step, device) -> dict[str, Any]:
    """One profiled optimizer step: GPU time of communication (NCCL) kernels, and which attention
    kernels ran (SDPA picks flash, memory-efficient or cuDNN at run time); empty on CPU."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_one_step()
        torch.cuda.synchronize()
    comm_us, attention = 0.0, {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        key = evt.key.lower()
        if "nccl" in key:
            comm_us += us
        elif any(k in key for k in ("flash", "fmha", "attention", "cudnn")):
            attention[evt.key[:120]] = round(us / 1e3, 2)  # ms in this step
    return {"comm_s": comm_us / 1e6, "attention_kernels_ms": attention}


def summarize(history: list[dict[str, Any]], tokens_per_step: int, flops_per_token: float,
              peak_flops: float | None) -> dict[str, Any]:
    """Windows after warmup -> tokens/s (total tokens / total time), MFU, data wait, step time."""
    step_time = sum(m["step_time_s"] for m in history) / len(history)
    tokens_per_s = tokens_per_step / step_time
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak_flops if peak_flops else None,
        "step_time_s": step_time,
        "data_wait_frac": sum(m["data_wait_frac"] for m in history) / len(history),
        "loss": history[-1]["loss"],
    }


def synthetic_batches(vocab_size: int, micro_batch: int, seq_len: int, device, num_distinct: int = 4):
    """Endless micro-batches of random token ids, made once on the device (no data wait by design)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab_size, (num_distinct, micro_batch, seq_len), generator=g).to(device)
    i = 0
    while True:
        yield {"input_ids": data[i % num_distinct]}
        i += 1


def _flops_per_token(resolved: ResolvedRun) -> float:
    m = resolved.model
    return flops_per_token(m.active_parameters, m.num_hidden_layers, m.hidden_size, resolved.config.data.seq_len)


def _memory(device) -> dict[str, float | None]:
    if device.type != "cuda":
        return {"peak_mem_gib": None, "peak_reserved_gib": None}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def _device():
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _init_single_process_group(device) -> None:
    """torch.distributed with world size 1 (DeepSpeed's ZeRO-3 and zero.Init read the group). Each
    path runs in its own child process, so the rendezvous variables set here end with it."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1, **kwargs)
