"""The DeepSpeed engine of one worker: the model under zero.Init, the optimizer, the schedule, one step.

Start at `build_engine` (called once per worker process by raytrain.worker.loop, and by the
benchmark's plain-DeepSpeed path, so both measure the same setup). `train_step` is one optimizer
step over the gradient-accumulation micro-batches.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, Iterator

import torch

from raytrain import compat
from raytrain.config import TrainingConfig
from raytrain.console import emit
from raytrain.deepspeed_config import DeepSpeedFacts
from raytrain.model import build_model, config_from_facts, fused_layers_enabled
from raytrain.run_spec import ResolvedRun
from raytrain.worker.kernels import apply_liger
from raytrain.worker.ops import ensure_built, fix_cuda_arch_list, required_ops


def build_engine(spec: ResolvedRun, device: torch.device, ds_config: dict[str, Any] | None = None,
                 transform=None, from_checkpoint: bool = False):
    """(engine, scheduler, transformers config): DeepSpeed on the process group that already exists
    (Ray Train's), the model created under zero.Init, optimizer and LR schedule.

    `ds_config`: the dict to initialise with when it differs from the spec's (a universal-checkpoint
    load adds `checkpoint.load_universal`); default the spec's resolved one. `transform`: model ->
    model between zero.Init and deepspeed.initialize (the benchmark's float8 conversion).
    `from_checkpoint`: a checkpoint is restored into the engine next, so model.pretrained's weights
    are not read (raytrain.model.build_model).
    """
    deepspeed = import_deepspeed(device)
    ds_config = spec.ds_config if ds_config is None else ds_config
    cfg = spec.config
    if device.type == "cuda":
        fix_cuda_arch_list(log=emit)
        if cfg.scaling.gpu_memory_fraction is not None:
            # The cap the driver planned against: torch's caching allocator refuses to grow past it.
            torch.cuda.set_per_process_memory_fraction(cfg.scaling.gpu_memory_fraction, device)
    ensure_built(required_ops(spec.deepspeed), log=emit)
    # torch.distributed is already initialised by Ray Train: DeepSpeed's comm wraps that process
    # group (it must exist before zero.Init, which reads the world size from it).
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    torch.manual_seed(cfg.training.seed)  # same init on every rank before zero.Init partitions it
    apply_liger(cfg.model.liger_kernel)  # patches the model classes: before they are built
    hf_config = config_from_facts(spec.model, cfg.model)
    model = build_model(cfg.model, hf_config, ds_config, from_checkpoint=from_checkpoint)
    if fused_layers_enabled(cfg.model, hf_config):
        from raytrain.worker.fused import fuse_llama_layers

        fused = fuse_llama_layers(model)
        if torch.distributed.get_rank() == 0:
            skipped = fused["skipped"]
            why = f"; {len(skipped)} keep transformers' forward ({next(iter(skipped.values()))})" if skipped else ""
            emit(f"raytrain: model.fused_layers={cfg.model.fused_layers}: {fused['fused']} decoder layers fused "
                 f"(q/k/v and gate/up one GEMM each, residual adds fused){why}")
        if cfg.model.fp8:
            from raytrain.worker import fp8

            n, note = fp8.enable(model), fp8.unsupported_here(device)
            if torch.distributed.get_rank() == 0:
                emit(f"raytrain: model.fp8=true: the projections of {n} decoder layers run as FP8 GEMMs "
                     f"(one scale per tensor; attention, norms and lm_head as before)" if note is None else
                     f"raytrain: note: model.fp8=true, but {note}: the projections run in bf16")
    if transform is not None:
        model = transform(model)
    optimizer, scheduler = build_optimizer(model, cfg.training, spec.deepspeed, device)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config, dist_init_required=False)
    if compat.share_backup_optimizer_param_groups(engine.optimizer) and torch.distributed.get_rank() == 0:
        emit("raytrain: note: offload_optimizer.ratio < 1: the GPU side's AdamW now follows the LR schedule "
             "(a DeepSpeed 0.19.8 bug left its first param group at the initial LR; raytrain.compat)")
    compat.skip_host_overflow_scan(engine.optimizer)  # fp16 + offload: ~1 s a step less at 1.1B, same skips
    if cfg.model.compile:
        # Through the engine, not torch.compile(model): DeepSpeed keeps its ZeRO-3 hooks out of the
        # graphs (or, with compile.deepcompile, replaces them with its own compiled schedule).
        engine.compile()
    return engine, scheduler, hf_config


def after_checkpoint_load(engine) -> None:
    """Call after engine.load_checkpoint. torch's Optimizer.load_state_dict replaces the CPU optimizer's
    param-group dicts, so with `offload_optimizer.ratio < 1` the GPU side's AdamW would again miss the
    LR schedule (raytrain.compat.share_backup_optimizer_param_groups): share them again. DeepSpeed 0.19.8
    also never saves that AdamW's state (stage3.py's state_dict holds the CPU optimizer's only): the Adam
    moments of the parameters kept on the GPU restart from zero at every resume. Said once, on rank 0. Then
    the learning rate of the resumed step is this run's schedule's (`resume_schedule`)."""
    if compat.share_backup_optimizer_param_groups(engine.optimizer) and torch.distributed.get_rank() == 0:
        emit("raytrain: note: resumed with offload_optimizer.ratio < 1: DeepSpeed 0.19.8 does not checkpoint the "
             "Adam moments of the parameters it keeps on the GPU; they restart from zero (upstream limitation)")
    resume_schedule(engine.lr_scheduler)


def resume_schedule(scheduler) -> None:
    """Each param group's learning rate as raytrain's warmup + cosine schedule gives it at the checkpoint's step.

    The loaded optimizer state brings the rate the checkpoint's own schedule had set for the next step, and
    LambdaLR's state keeps no schedule (its lambdas are this run's): with training.max_steps, warmup_steps or
    min_lr_ratio changed since, the first resumed step trained at the old schedule's rate (1e-5 where the driver's
    note said 3.25e-5) and only the steps after it followed the new one. With nothing changed this is the product
    LambdaLR.step computed before the save: bit-identical. A DeepSpeed JSON's own scheduler keeps its state."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                      strict=True):
        group["lr"] = base_lr * factor(scheduler.last_epoch)


def varlen_attention(model) -> bool:
    """Whether the model attends with flash attention (flash_attention_2/3/4, or a hub kernel of it), whose varlen
    kernels keep attention within the documents that data.position_ids=per_document marks, given one row."""
    return "flash" in str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def model_inputs(batch: dict[str, Any], one_row: bool) -> dict[str, Any]:
    """The model's keyword arguments for one micro-batch (labels: the input ids; the model shifts them).

    With position_ids (data.position_ids=per_document) and `one_row` (varlen_attention), the micro-batch goes as
    one row of micro-batch x seq_len tokens. transformers 5 runs flash attention's varlen kernel, which keeps
    attention within each document (found from where the positions restart), only for a batch of one row
    (modeling_flash_attention_utils._is_packed_sequence); with more rows it attended across documents, only RoPE's
    positions restarting. Each row's first token gets label -100: in one row it would be the previous row's last
    token's target, and in its own row it is no target either, so the loss is the mean over the same tokens.
    SDPA and eager attention keep documents apart at any shape, with a 4D mask that one row would make quadratic
    in the micro-batch: they keep the rows.

    The one row also carries the documents' bounds as flash attention's varlen arguments (cu_seq_lens_q/k,
    max_length_q/k: what transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives). Without
    them transformers finds the bounds again from the positions in every layer, with two device syncs there
    (`_is_packed_sequence`, then `nonzero`), which keep the host from running ahead of the GPU, and gives the
    longest document as a device tensor, which FlashAttention-4 cannot read on the host: its scheduler then sizes
    the kernel for a document as long as the whole row (flash_attn/cute/interface.py, "Tensor hints cannot drive
    host selection"). With them: the syncs once per micro-batch (here, back to back) and the real bound, an int.
    """
    input_ids, positions = batch["input_ids"], batch.get("position_ids")
    if positions is None:
        return {"input_ids": input_ids, "labels": input_ids}
    if not one_row or input_ids.shape[0] == 1:
        return {"input_ids": input_ids, "labels": input_ids, "position_ids": positions}
    labels = input_ids.clone()
    labels[:, 0] = -100
    flat = positions.reshape(1, -1)
    return {"input_ids": input_ids.reshape(1, -1), "labels": labels.reshape(1, -1), "position_ids": flat,
            **document_bounds(flat, input_ids.shape[1])}


def document_bounds(positions: torch.Tensor, row_len: int) -> dict[str, Any]:
    """Flash attention's varlen arguments for one row of rows of `row_len` tokens whose positions restart at 0 with
    each document: cumulative lengths (int32, on the positions' device) and the longest document (an int). Every
    row starts a segment too: raytrain.data.packing starts each row at position 0, and a row that began inside a
    document (other positions) must still not attend to the row before it, as it does not in the rows' form."""
    flat = positions.reshape(-1)
    row_starts = torch.arange(flat.numel(), device=flat.device) % row_len == 0
    starts = ((flat == 0) | row_starts).nonzero().view(-1)
    total = torch.tensor([positions.numel()], device=positions.device)
    cu_seq_lens = torch.cat([starts, total]).to(torch.int32)
    longest = int(cu_seq_lens.diff().max())
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
            "max_length_k": longest}


def train_step(engine, batches: Iterator[dict[str, Any]], grad_accum: int, device: torch.device,
               marks: list | None = None):
    """One optimizer step over grad_accum micro-batches; returns (mean loss tensor, data wait s).

    `marks` (the benchmark's step breakdown, GPU only): a list that receives, per micro-batch, the
    CUDA events before forward, backward, step and after it.
    """
    data_wait = 0.0
    step_loss = torch.zeros((), device=device)
    one_row = varlen_attention(getattr(engine, "module", engine))
    for _ in range(grad_accum):
        t = time.perf_counter()
        batch = next(batches)
        data_wait += time.perf_counter() - t
        events = _record(marks)
        # position_ids only when data.position_ids=per_document (positions restart at each document)
        loss = engine(**model_inputs(batch, one_row)).loss
        _record(marks, events)
        engine.backward(loss)
        _record(marks, events)
        engine.step()  # DeepSpeed only updates at the accumulation boundary
        _record(marks, events)
        step_loss += loss.detach()  # stays on the device: no sync here
    return step_loss / grad_accum, data_wait


def _record(marks: list | None, events: list | None = None) -> list | None:
    if marks is None:
        return None
    if events is None:
        events = []
        marks.append(events)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    events.append(event)
    return events


def build_optimizer(model, training: TrainingConfig, facts: DeepSpeedFacts, device: torch.device):
    """AdamW and warmup+cosine, unless the DeepSpeed config brings its own optimizer/scheduler."""
    optimizer = scheduler = None
    if facts.optimizer_type is None:
        decay, no_decay = [], []
        for p in model.parameters():
            # Under ZeRO-3 p.shape is the (empty) local partition; ds_shape is the real one.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": training.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kwargs = dict(lr=training.learning_rate, betas=tuple(training.adam_betas), eps=training.adam_epsilon)
        if facts.offload_optimizer != "none":
            # Offloaded optimizer states live in host memory: DeepSpeed's vectorised CPU Adam is
            # the only optimizer it accepts there (JIT-compiled once, ~50 s, cached in TORCH_EXTENSIONS_DIR).
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            # bf16.bf16_optimizer_states: DeepSpeed asserts that the CPU Adam keeps its moments in the
            # parameters' (bf16) dtype, which only this constructor flag does (it builds its own CPU Adam
            # that way for a JSON optimizer; raytrain builds this one).
            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True,
                                         fp32_optimizer_states=not facts.bf16_optimizer_states, **kwargs)
        else:
            # torch's fused AdamW on GPU: no JIT build (DeepSpeed's FusedAdam compiles for minutes).
            optimizer = torch.optim.AdamW(groups, fused=device.type == "cuda", **kwargs)
    if not facts.has_scheduler and optimizer is not None:
        # (A DeepSpeed JSON with its own optimizer and no scheduler keeps its constant LR, as written.)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(training))
    return optimizer, scheduler


def warmup_cosine(training: TrainingConfig):
    """LR multiplier: linear warmup to 1, then cosine decay to min_lr_ratio at max_steps.

    Not transformers' get_cosine_with_min_lr_schedule_with_warmup: that one starts at 0, so its
    first optimizer step does nothing; this one starts at 1/warmup_steps (as torchtitan's does).
    """
    def factor(step: int) -> float:
        if step < training.warmup_steps:
            return (step + 1) / training.warmup_steps
        progress = min(1.0, (step - training.warmup_steps) / max(1, training.max_steps - training.warmup_steps))
        return training.min_lr_ratio + (1 - training.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for this worker's device, without its CPU shared-memory comm op.

    On CPU DeepSpeed would JIT-compile a shared-memory all-reduce (~35 s per process start); gloo is
    enough for CPU runs, which exist for development and tests, not speed.
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed's CPU accelerator counts local devices by running `numactl --hardware` unless
        # LOCAL_SIZE is set (its own launcher sets it; Ray Train does not): ZeRO-3 asks at every
        # gradient reduce-scatter, so each bucket forked the worker. Ray's LOCAL_WORLD_SIZE is the fact.
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # DeepSpeed's ZeRO-3 calls torch's all_gather_into_tensor and reduce_scatter_tensor, which
    # torch 2.13 deprecates: one warning per call would bury the progress lines.
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*",
                            category=FutureWarning)
    # Rank 0's torch warns at a barrier (DeepSpeed's, in the engine build and in each checkpoint save) that the
    # process group has no bound device ("barrier(): using the device under current context", two lines a time,
    # measured on the H200's logs): Ray Train creates the group without device_id. The device under current
    # context is the one Ray Train assigned this worker (raytrain.worker.loop sets it before anything runs), the
    # warning's worry (a default device 0) does not apply. Binding one (init_process_group's device_id) is Ray
    # Train's call, and would change how NCCL initialises its communicators.
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                            category=UserWarning)
    deepspeed = compat.import_deepspeed_without_mlflow()

    if device.type == "cpu":
        compat.disable_deepspeed_op("deepspeed_shm_comm")
    return deepspeed
