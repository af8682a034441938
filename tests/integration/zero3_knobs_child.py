"""One rank of `test_zero3_knobs.py`: raytrain's worker building blocks under real DeepSpeed ZeRO-3,
without Ray, in a gloo process group on CPU.

`python zero3_knobs_child.py OUT_DIR VARIANT [VARIANT ...]`, with MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE and LOCAL_RANK set (the test starts one process per rank). Each variant is a list of
KEY=VALUE overrides, exactly what a user types after `python -m raytrain.main`; it goes through
raytrain.config.load_config and raytrain.deepspeed_config.resolve_deepspeed, then build_model (under
zero.Init), build_optimizer, deepspeed.initialize and a few train_step calls on synthetic tokens.
The variant's own engine then reports what DeepSpeed made of the config; rank 0 writes one JSON
object per variant to OUT_DIR/VARIANT.json ({"ok": ...}, or {"skipped": reason} where DeepSpeed's CPU
accelerator lacks what the variant needs) and the test asserts on it. Start at VARIANTS.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Small enough that a ZeRO-3 step takes well under a second on one core.
BASE = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data.seq_len=32",
        "training.micro_batch_size_per_gpu=2", "training.max_steps=3", "training.warmup_steps=1",
        "training.learning_rate=0.01"]
ZERO = "deepspeed.zero_optimization"


def run_variant(name: str, out_dir: str) -> dict[str, Any]:
    import deepspeed

    from raytrain.config import load_config
    from raytrain.deepspeed_config import DeepSpeedFacts, resolve_deepspeed
    from raytrain.model import build_model, load_model_config
    from raytrain.worker.engine import build_optimizer, train_step

    variant = VARIANTS[name]
    work_dir = os.path.join(out_dir, name)
    os.makedirs(work_dir, exist_ok=True)
    cfg = load_config(None, BASE + [o.replace("WORK_DIR", work_dir) for o in variant.overrides])
    hf_config = load_model_config(cfg.model)
    world_size = torch.distributed.get_world_size()
    ds = resolve_deepspeed(cfg.deepspeed, cfg.training, world_size=world_size, use_gpu=variant.resolve_for_gpu,
                           hidden_size=hf_config.hidden_size)
    device = torch.device("cpu")
    torch.manual_seed(cfg.training.seed)
    model = build_model(cfg.model, hf_config, ds)
    optimizer, scheduler = build_optimizer(model, cfg.training, DeepSpeedFacts.of(ds), device)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds, dist_init_required=False)
    obs: dict[str, Any] = {"ds_config": ds}
    probe = Probe(engine)
    before = full_weights(engine)
    batches = synthetic_batches(ds["train_micro_batch_size_per_gpu"], cfg.data.seq_len)
    losses, lrs, grad_norms = [], [], []
    for _ in range(cfg.training.max_steps):
        loss, _ = train_step(engine, batches, ds["gradient_accumulation_steps"], device)
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0] if scheduler is not None else engine.get_lr()[0])
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
        probe.end_step()
    after = full_weights(engine)
    obs.update(losses=losses, lrs=lrs, grad_norms=grad_norms, stepped_grad_norms=probe.norms,
               loss_scales=probe.loss_scales, num_params=len(before),
               unchanged_params=[n for n in before if torch.equal(before[n], after[n])],
               zero_stage=engine.zero_optimization_stage(), overlap_comm=engine.zero_overlap_comm(),
               zero_quantized_weights=engine.zero_quantized_weights(),
               zero_quantized_gradients=engine.zero_quantized_gradients(),
               contiguous_gradients=engine.zero_contiguous_gradients(),
               basic_optimizer=type(engine.optimizer.optimizer).__name__,
               zero_optimizer=type(engine.optimizer).__name__,
               scheduler=type(scheduler).__name__ if scheduler is not None else None,
               param_dtype=str(next(engine.module.parameters()).ds_tensor.dtype))
    if variant.observe is not None:
        obs.update(variant.observe(engine, cfg, work_dir))
    engine.destroy()
    return obs


class Probe:
    """Records, per optimizer step, the global norm of the gradients the torch optimizer is handed
    (after DeepSpeed's unscaling and clipping) and the loss scale."""

    def __init__(self, engine):
        self.engine = engine
        self.norms: list[float] = []
        self.loss_scales: list[float] = []
        self._sq = torch.zeros((), dtype=torch.float64)
        # ZeRO-3 calls the torch optimizer once per sub-group with that group's fp32 partition.
        engine.optimizer.optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._sq += p.grad.double().pow(2).sum()

    def end_step(self):
        sq = self._sq.clone()
        torch.distributed.all_reduce(sq)  # each rank holds a disjoint partition
        self.norms.append(math.sqrt(sq.item()))
        self._sq.zero_()
        self.loss_scales.append(float(self.engine.optimizer.loss_scale))


def full_weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in params.items()}


def synthetic_batches(micro_batch: int, seq_len: int):
    """Endless random byte-token batches, different on each rank (as data-parallel shards are)."""
    g = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    while True:
        yield {"input_ids": torch.randint(0, 257, (micro_batch, seq_len), generator=g)}


# ---------------------------------------------------------------------------------------------
# What each variant reports besides the common numbers (rank 0's view; JSON-able).


def observe_knobs(engine, cfg, work_dir):
    opt = engine.optimizer
    coordinator = opt.parameter_offload.get_param_coordinator()
    persistent = {n: bool(p.ds_persist) for n, p in engine.module.named_parameters()}
    numels = {n: p.ds_numel for n, p in engine.module.named_parameters()}
    return {"reduce_bucket_size": engine.zero_reduce_bucket_size(), "optimizer_reduce_bucket_size": opt.reduce_bucket_size,
            "optimizer_contiguous_gradients": opt.contiguous_gradients,
            "prefetch_bucket_size": engine.zero_prefetch_bucket_size(),
            "param_persistence_threshold": engine.zero_param_persistence_threshold(),
            "max_live_parameters": engine.zero_max_live_parameters(),
            "max_reuse_distance": engine.zero_max_reuse_distance(),
            "coordinator_max_live": coordinator._PartitionedParameterCoordinator__max_n_available_params,
            "coordinator_max_reuse": coordinator._PartitionedParameterCoordinator__max_reuse_dist_in_numel,
            "coordinator_prefetch_bucket": coordinator._PartitionedParameterCoordinator__prefetch_bucket_sz,
            "persistent": persistent, "numels": numels}


def observe_checkpointing(engine, cfg, work_dir):
    # Checkpointing re-runs each decoder layer's forward inside backward, so the layer's MLP runs
    # twice per micro-step. (Counted by wrapping forward: the recompute does not fire module hooks.)
    mlp = engine.module.model.layers[0].mlp
    calls = []

    def counting_forward(*args, _forward=mlp.forward, **kwargs):
        calls.append(1)
        return _forward(*args, **kwargs)

    mlp.forward = counting_forward
    input_ids = torch.randint(0, 257, (2, cfg.data.seq_len))
    engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
    del mlp.forward
    engine.optimizer.zero_grad()  # drop this probe's gradients: no optimizer step follows
    return {"is_gradient_checkpointing": engine.module.is_activation_checkpointing, "training": engine.module.training,
            "mlp_calls_per_micro_step": len(calls)}


def observe_bf16_save(engine, cfg, work_dir):
    from transformers import AutoModelForCausalLM

    from raytrain.model import load_model_config

    saved = engine.save_16bit_model(work_dir, "model.bin")
    torch.distributed.barrier()
    state = torch.load(os.path.join(work_dir, "model.bin"), map_location="cpu", weights_only=True)
    hf_config = load_model_config(cfg.model)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    expected = {n: list(p.shape) for n, p in reference.named_parameters()}
    return {"bf16_enabled": engine.bfloat16_enabled(), "saved": bool(saved),
            "saved_shapes": {n: list(t.shape) for n, t in state.items()}, "expected_shapes": expected,
            "saved_dtypes": sorted({str(t.dtype) for t in state.values()}),
            "fp32_master_dtype": str(engine.optimizer.fp32_partitioned_groups_flat[0].dtype),
            "gather_16bit_on_save": engine.zero_gather_16bit_weights_on_model_save()}


def observe_fp16(engine, cfg, work_dir):
    scaler = engine.optimizer.loss_scaler
    return {"fp16_enabled": engine.fp16_enabled(), "dynamic_loss_scale": bool(engine.optimizer.dynamic_loss_scale),
            "initial_loss_scale": 2.0 ** cfg.deepspeed["fp16"]["initial_scale_power"],
            "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
            "scale_window": getattr(scaler, "scale_window", None)}


def observe_lr(engine, cfg, work_dir):
    from raytrain.worker.engine import warmup_cosine

    factor = warmup_cosine(cfg.training)
    groups = engine.optimizer.optimizer.param_groups
    return {"expected_lrs": [cfg.training.learning_rate * factor(k) for k in range(1, cfg.training.max_steps + 1)],
            "weight_decays": sorted({g["weight_decay"] for g in groups})}


def observe_ds_optimizer(engine, cfg, work_dir):
    sched = engine.lr_scheduler
    return {"optimizer_lr": engine.optimizer.optimizer.param_groups[0]["lr"],
            "scheduler_total_num_steps": sched.total_num_steps, "scheduler_warmup_num_steps": sched.warmup_num_steps,
            "scheduler_cos_min_ratio": sched.cos_min_ratio, "org_lrs": [float(x) for x in sched.org_lrs],
            "betas": list(engine.optimizer.optimizer.param_groups[0]["betas"]),
            "weight_decay": engine.optimizer.optimizer.param_groups[0]["weight_decay"]}


def observe_offload(engine, cfg, work_dir):
    opt = engine.optimizer
    files = []
    for root, _, names in os.walk(work_dir):
        files += [os.path.relpath(os.path.join(root, n), work_dir) for n in names]
    return {"offload_optimizer": opt.offload_optimizer, "offload_optimizer_pin_memory": opt.offload_optimizer_pin_memory,
            "offload_param": opt.offload_param, "offload_param_pin_memory": opt.offload_param_pin_memory,
            "swap_optimizer": opt.swap_optimizer, "params_in_nvme": opt.params_in_nvme_and_cpu,
            "ds_tensor_devices": sorted({str(p.ds_tensor.device) for p in engine.module.parameters()}),
            "fp32_partition_devices": sorted({str(t.device) for t in opt.fp32_partitioned_groups_flat}),
            "swap_file_bytes": {f: os.path.getsize(os.path.join(work_dir, f)) for f in files if f.endswith(".swp")}}


def observe_hpz(engine, cfg, work_dir):
    from deepspeed.utils import groups

    group = groups._get_zero_param_intra_parallel_group()
    # After a step every trainable parameter keeps a secondary partition over its hpZ group.
    secondary = [p for p in engine.module.parameters() if getattr(p, "ds_secondary_tensor", None) is not None]
    return {"hpz_partition_size": engine.zero_hpz_partition_size(),
            "hpz_group_size": torch.distributed.get_world_size(group) if group is not None else None,
            "num_params_with_secondary": len(secondary), "num_params": len(list(engine.module.parameters()))}


@dataclass
class Variant:
    overrides: list[str]
    """KEY=VALUE overrides after BASE (WORK_DIR: this variant's scratch directory)."""
    observe: Callable[[Any, Any, str], dict[str, Any]] | None = None
    needs: str | None = None
    """A capability from `capabilities()` the variant cannot run without."""
    resolve_for_gpu: bool = False
    """Resolve as raytrain does for a GPU run (fp16, which raytrain refuses on CPU)."""


VARIANTS: dict[str, Variant] = {
    # DeepSpeed's defaults are overlap_comm/contiguous_gradients true and buckets of 10^7..10^9
    # elements: every value here differs, so seeing it in the engine proves it got there.
    "knobs": Variant([f"{ZERO}.overlap_comm=false", f"{ZERO}.contiguous_gradients=false",
                      f"{ZERO}.reduce_bucket_size=5000", f"{ZERO}.stage3_prefetch_bucket_size=4000",
                      f"{ZERO}.stage3_param_persistence_threshold=100", f"{ZERO}.stage3_max_live_parameters=20000",
                      f"{ZERO}.stage3_max_reuse_distance=10000", "training.gradient_accumulation_steps=2"],
                     observe_knobs),
    "clipping": Variant(["training.gradient_clipping=0.01"]),
    # The contrast for clipping and checkpointing: no clipping, no recompute, default ZeRO knobs.
    "plain": Variant(["training.gradient_clipping=0.0"], observe_checkpointing),
    "checkpointing": Variant(["model.gradient_checkpointing=true"], observe_checkpointing),
    "bf16_save16": Variant(["training.precision=bf16", f"{ZERO}.stage3_gather_16bit_weights_on_model_save=true"],
                           observe_bf16_save),
    # fp16 from a loss scale of 2^24: the first steps overflow, are skipped and halve the scale;
    # after loss_scale_window good steps it doubles again. 24 steps: near the scale where this model's
    # gradients overflow (2^18-2^19 on a Sapphire Rapids core) steps still overflow now and then, so 8 steps
    # did not always hold two good ones in a row; 24 held 4 growths (~1 s more).
    "fp16": Variant(["training.precision=fp16", "deepspeed.bf16.enabled=false",
                     'deepspeed.fp16={"enabled": "auto", "loss_scale": 0, "initial_scale_power": 24, '
                     '"loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1}', "training.max_steps=24"],
                    observe_fp16, needs="fp16", resolve_for_gpu=True),
    "lr_schedule": Variant(["training.max_steps=6", "training.warmup_steps=2", "training.min_lr_ratio=0.1"],
                           observe_lr),
    # DeepSpeed builds optimizer and scheduler from the JSON; torch_adam avoids FusedAdam's JIT build.
    "ds_optimizer": Variant(['deepspeed.optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", '
                             '"eps": "auto", "weight_decay": "auto", "torch_adam": true}}',
                             'deepspeed.scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", '
                             '"warmup_num_steps": "auto", "warmup_type": "linear", "cos_min_ratio": 0.1}}',
                             "training.max_steps=6", "training.warmup_steps=2"], observe_ds_optimizer),
    "offload_param_cpu": Variant([ZERO + '.offload_param={"device": "cpu", "pin_memory": true}'], observe_offload),
    "offload_optimizer_cpu": Variant([ZERO + '.offload_optimizer={"device": "cpu", "pin_memory": true}'],
                                     observe_offload),
    # DeepSpeed swaps only tensors of at least 1 MiB: a vocabulary of 8320 makes the embedding and
    # lm_head partitions 1.06 MiB per rank. Buffers sized for that (the default is 10^8 elements x 5).
    "offload_nvme": Variant(["model.config.vocab_size=8320",
                             ZERO + '.offload_optimizer={"device": "nvme", "nvme_path": "WORK_DIR", '
                             '"pin_memory": true, "buffer_count": 4}',
                             ZERO + '.offload_param={"device": "nvme", "nvme_path": "WORK_DIR", "pin_memory": true, '
                             '"buffer_count": 5, "buffer_size": 300000}',
                             'deepspeed.aio={"block_size": 262144, "queue_depth": 8, "single_submit": false, '
                             '"overlap_events": true, "intra_op_parallelism": 1}'], observe_offload, needs="async_io"),
    "quantized_weights": Variant([f"{ZERO}.zero_quantized_weights=true"], needs="quantizer"),
    "quantized_gradients": Variant([f"{ZERO}.zero_quantized_gradients=true"], needs="quantizer"),
    # Last: hpZ creates DeepSpeed's process-global parameter group, which cannot be created twice.
    "hpz": Variant([f"{ZERO}.zero_hpz_partition_size=2"], observe_hpz),
}


def capabilities() -> dict[str, str | None]:
    """None for what DeepSpeed's accelerator here can do, else the reason it cannot."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    aio = acc.create_op_builder("AsyncIOBuilder")
    quantizer = acc.create_op_builder("QuantizerBuilder")
    return {
        "fp16": None if acc.is_fp16_supported() else
        f"DeepSpeed's {acc.device_name()} accelerator has no fp16 here (needs oneDNN fp16: AVX512-FP16 or AMX)",
        "async_io": None if aio is not None and aio.is_compatible(verbose=False) else
        "DeepSpeed's async_io op cannot build: install libaio-dev (apt-get install libaio-dev)",
        "quantizer": None if quantizer is not None and type(quantizer).__name__ != "NotImplementedBuilder" else
        f"DeepSpeed's {acc.device_name()} accelerator has no QuantizerBuilder (ZeRO++ quantization kernels are CUDA/ROCm only)",
    }


def main() -> int:
    out_dir, names = sys.argv[1], sys.argv[2:]
    from raytrain.worker.engine import import_deepspeed

    deepspeed = import_deepspeed(torch.device("cpu"))
    # A rank that fails alone leaves the other in a collective: time out instead of hanging.
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank = torch.distributed.get_rank()
    missing = capabilities()
    failed = False
    for name in names:
        # A variant that hangs prints every thread's stack and ends the process, so the log
        # shows where (the other rank then fails its next collective after the gloo timeout).
        faulthandler.dump_traceback_later(300, exit=True)
        reason = missing.get(VARIANTS[name].needs) if VARIANTS[name].needs else None
        if reason:
            result = {"skipped": reason}
        else:
            # Both ranks run the same code, so a failure is normally raised on both and the next
            # variant (its own engine) can still run.
            try:
                result = {"ok": True, **run_variant(name, out_dir)}
            except Exception:
                result = {"ok": False, "error": traceback.format_exc()}
                print(f"rank {rank} variant {name} failed:\n{result['error']}", file=sys.stderr, flush=True)
                failed = True
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
