"""The per-worker training loop (runs inside each Ray Train worker process).

Start at `train_loop_per_worker`. It receives the resolved run as a plain dict (never module
globals), rebuilds the typed config, then: device -> DeepSpeed comm on Ray's process group ->
model under zero.Init -> deepspeed.initialize -> restore -> loop(train step, metrics, checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Any, Iterator

from raytrain.config import RunConfig, TrainingConfig
from raytrain.deepspeed_config import batch_sizes, offload_device


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    cfg = RunConfig.from_dict(payload["run"])
    ds_config: dict[str, Any] = cfg.deepspeed  # resolved on the driver: no "auto" left
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    device = ray.train.torch.get_device()  # the device Ray assigned, not a guess from LOCAL_RANK
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from raytrain import checkpoint
    from raytrain.evaluation import eval_batches, evaluate
    from raytrain.ingest import MicroBatches
    from raytrain.metrics import StepMeter, emit, flops_per_token, format_line
    from raytrain.tracking import Tracker

    _quiet_ray_report_log()
    resume = checkpoint.resume_point(payload, ctx.get_world_size())
    if resume is not None and resume.universal:
        # written by another number of workers: DeepSpeed re-partitions its universal form (raytrain.reshard)
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    engine, scheduler, hf_config = build_engine(cfg, ds_config, device)
    start_step, history, data_state = checkpoint.restore(engine, resume, seed=cfg.training.seed, rank=rank)
    train_batch, micro_batch, grad_accum = batch_sizes(ds_config)
    seq_len = cfg.data.seq_len
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    meter = StepMeter(
        max_steps=cfg.training.max_steps, tokens_per_step=train_batch * seq_len,
        flops_per_token=flops_per_token(num_params, hf_config.num_hidden_layers, hf_config.hidden_size, seq_len),
        peak_flops_total=cfg.training.peak_tflops_per_gpu * 1e12 * ctx.get_world_size() if device.type == "cuda" else None)
    tracker = Tracker(cfg.tracking, cfg.checkpoint.storage_path, cfg.checkpoint.name, payload["run"], active=rank == 0)
    if rank == 0:
        emit(f"raytrain: {num_params:,} parameters, world size {ctx.get_world_size()}, "
             f"batch {train_batch} = {micro_batch} x {grad_accum} x {ctx.get_world_size()}, seq_len {seq_len}, "
             f"device {device.type}, starting at step {start_step}")
        emit("raytrain: DeepSpeed config (resolved; saved in every checkpoint's raytrain.json): "
             + json.dumps(ds_config, sort_keys=True))

    batches = MicroBatches(ray.train.get_dataset_shard("train"), micro_batch, device, seed=cfg.training.seed,
                           shuffle_buffer_size=cfg.data.shuffle_buffer_size,
                           position=(data_state["epoch"], data_state["rows"]) if start_step else (0, 0),
                           prefetch=cfg.data.prefetch_batches)
    # Ray Train raises KeyError for a dataset it was not given: the driver says whether there is one.
    eval_shard = ray.train.get_dataset_shard("eval") if payload.get("has_eval") else None
    every_eval = cfg.data.eval_every_n_steps
    pending_losses: list[torch.Tensor] = []
    # `history` holds every logged window (restored with the checkpoint, saved with each one).
    every_log, every_ckpt, max_steps = cfg.training.log_every_n_steps, cfg.checkpoint.every_n_steps, cfg.training.max_steps
    for step in range(start_step + 1, max_steps + 1):
        loss, data_wait = train_step(engine, batches, grad_accum, device)
        pending_losses.append(loss)
        meter.step(data_wait)
        if step == start_step + 1 and start_step > 0 and rank == 0:
            import psutil

            # from this worker process's start to its first step after a restore: what a restart costs
            emit(f"raytrain: resumed from step {start_step}; first step done "
                 f"{time.time() - psutil.Process().create_time():.1f} s after the worker process started")

        save_now = step == max_steps or (every_ckpt and step % every_ckpt == 0)
        eval_now = eval_shard is not None and (step == max_steps or (every_eval and step % every_eval == 0))
        if not (save_now or eval_now or step % every_log == 0):
            continue
        # One device sync and one small all-reduce per logging window, not per step.
        window = torch.stack(pending_losses).mean()
        torch.distributed.all_reduce(window, op=torch.distributed.ReduceOp.AVG)
        pending_losses.clear()
        grad_norm = engine.get_global_grad_norm()
        metrics = meter.collect(step, window.item(), scheduler.get_last_lr()[0] if scheduler else engine.get_lr()[0],
                                None if grad_norm is None else float(grad_norm), device)
        # the slowest rank's data wait is what the step waits for
        wait = torch.tensor([metrics["data_wait_frac"]], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(wait, op=torch.distributed.ReduceOp.MAX)
        metrics["data_wait_frac"] = wait.item()
        if eval_now:  # every rank, same step, same batch count (see raytrain.evaluation)
            metrics.update(evaluate(engine, eval_batches(eval_shard, micro_batch, device), device,
                                    cfg.data.eval_max_batches))
        history.append(metrics)
        if rank == 0:
            emit(format_line(metrics, max_steps))
        if save_now:
            checkpoint.save(engine, step, metrics, history, payload["run"], upload_async=cfg.checkpoint.upload_async,
                            data_state=batches.position())  # adds checkpoint_* to metrics
        else:
            ray.train.report(metrics)
        tracker.log(metrics, step)
    batches.close()
    tracker.close()


def build_engine(cfg: RunConfig, ds_config: dict[str, Any], device):
    """DeepSpeed on Ray's process group, the model created under zero.Init, optimizer and schedule."""
    import torch

    from raytrain.kernels import apply_liger
    from raytrain.metrics import emit
    from raytrain.model import build_model, load_model_config
    from raytrain.ops import ensure_built, fix_cuda_arch_list, required_ops

    deepspeed = _import_deepspeed(device)
    if device.type == "cuda":
        fix_cuda_arch_list(log=emit)
    ensure_built(required_ops(ds_config), log=emit)
    # torch.distributed is already initialised by Ray Train: DeepSpeed's comm wraps that process
    # group (it must exist before zero.Init, which reads the world size from it).
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    torch.manual_seed(cfg.training.seed)  # same init on every rank before zero.Init partitions it
    apply_liger(cfg.model.liger_kernel)  # patches the model classes: before they are built
    hf_config = load_model_config(cfg.model)
    model = build_model(cfg.model, hf_config, ds_config)
    optimizer, scheduler = build_optimizer(model, cfg.training, ds_config, device)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config, dist_init_required=False)
    if cfg.model.compile:
        # Through the engine, not torch.compile(model): DeepSpeed keeps its ZeRO-3 hooks out of the
        # graphs (or, with compile.deepcompile, replaces them with its own compiled schedule).
        engine.compile()
    return engine, scheduler, hf_config


def train_step(engine, batches: Iterator[dict[str, Any]], grad_accum: int, device):
    """One optimizer step over grad_accum micro-batches; returns (mean loss tensor, data wait s)."""
    import torch

    data_wait = 0.0
    step_loss = torch.zeros((), device=device)
    for _ in range(grad_accum):
        t = time.perf_counter()
        batch = next(batches)
        data_wait += time.perf_counter() - t
        # position_ids only when data.position_ids=per_document (positions restart at each document)
        loss = engine(input_ids=batch["input_ids"], labels=batch["input_ids"], position_ids=batch.get("position_ids")).loss
        engine.backward(loss)
        engine.step()  # DeepSpeed only updates at the accumulation boundary
        step_loss += loss.detach()  # stays on the device: no sync here
    return step_loss / grad_accum, data_wait


def build_optimizer(model, training: TrainingConfig, ds_config: dict[str, Any], device):
    """AdamW and warmup+cosine, unless the DeepSpeed config brings its own optimizer/scheduler."""
    import torch

    optimizer = scheduler = None
    if "optimizer" not in ds_config:
        decay, no_decay = [], []
        for p in model.parameters():
            # Under ZeRO-3 p.shape is the (empty) local partition; ds_shape is the real one.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": training.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kwargs = dict(lr=training.learning_rate, betas=tuple(training.adam_betas), eps=training.adam_epsilon)
        if offload_device(ds_config, "offload_optimizer") != "none":
            # Offloaded optimizer states live in host memory: DeepSpeed's vectorised CPU Adam is
            # the only optimizer it accepts there (JIT-compiled once, ~50 s, cached in TORCH_EXTENSIONS_DIR).
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        else:
            # torch's fused AdamW on GPU: no JIT build (DeepSpeed's FusedAdam compiles for minutes).
            optimizer = torch.optim.AdamW(groups, fused=device.type == "cuda", **kwargs)
    if "scheduler" not in ds_config and optimizer is not None:
        # (A DeepSpeed JSON with its own optimizer and no scheduler keeps its constant LR, as written.)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(training))
    return optimizer, scheduler


def warmup_cosine(training: TrainingConfig):
    """LR multiplier: linear warmup to 1, then cosine decay to min_lr_ratio at max_steps."""
    def factor(step: int) -> float:
        if step < training.warmup_steps:
            return (step + 1) / training.warmup_steps
        progress = min(1.0, (step - training.warmup_steps) / max(1, training.max_steps - training.warmup_steps))
        return training.min_lr_ratio + (1 - training.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def _quiet_ray_report_log() -> None:
    """Ray Train V2 logs each ray.train.report at INFO from every rank, the whole metrics dict and
    checkpoint in one long line: it buries raytrain's progress line. That module's only INFO message;
    its warnings still show. (Keyed by Ray's file path: if Ray moves it, the line just comes back.)"""
    import logging

    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _import_deepspeed(device):
    """Import DeepSpeed for this worker's device, without its CPU shared-memory comm op.

    On CPU DeepSpeed would JIT-compile a shared-memory all-reduce (~35 s per process start); gloo is
    enough for CPU runs, which exist for development and tests, not speed.
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's ZeRO-3 calls torch's all_gather_into_tensor and reduce_scatter_tensor, which
    # torch 2.13 deprecates: one warning per call would bury the progress lines.
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*",
                            category=FutureWarning)
    import deepspeed
    import deepspeed.ops

    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed
