"""Precisions and ZeRO features that only run on GPUs, executed for real with the worker's own engine.

    python benchmarks/gpu_checks.py fp16 fp16-offload bf16            # one GPU (gpu_x1.sh checks)
    python benchmarks/gpu_checks.py fp16-offload-overflow fp16-offload-overflow-dsscan  # the overflow path, both ways
    torchrun --nproc-per-node 2 benchmarks/gpu_checks.py zeropp      # two GPUs or more (gpu_x2.sh zeropp)

Each variant builds a small Llama (hidden 512, 4 layers, seq 512) with raytrain's own config
resolution and raytrain.worker.engine.build_engine on the process group (NCCL), trains 30 steps on a
few fixed batches, and asserts what the CPU tests cannot (fp16 needs AVX512-FP16 or AMX on the CPU
accelerator, ZeRO++'s quantization kernels are CUDA-only, tests/integration/test_zero3_knobs.py):
the engine's flags are on, every logged loss is finite and the loss falls (the last five steps'
mean below 85% of the first five's). One JSON line per variant on stdout ({"variant", "ok", ...});
exit 1 if any variant fails.

On one GPU, ZeRO-3 gathers nothing (DeepSpeed skips the all-gather at a partition size of 1:
deepspeed/runtime/zero/partition_parameters.py, `_no_gather_coalesced`), so ZeRO++'s quantized
weights and gradients only run with two or more ranks: `zeropp` needs world size >= 2. With one GPU
lent, GPU_CHECKS_SHARE_GPU=1 puts every rank on cuda:0 and the process group on gloo (NCCL refuses
two ranks on one device; gloo stages CUDA tensors through pinned host memory for all-gather,
all-to-all and reduce-scatter): the quantization kernels run on the GPU for real, the transport is
the host's. That is also the only single-host way to reach qgZ's quantized all-to-all: DeepSpeed
takes it only when world size / devices per node > 1 (stage3.py `__avg_scatter_grads`), which 4
ranks on 1 visible device make "4 nodes"; 2 GPUs of one host fall back to a plain reduce-scatter.

    GPU_CHECKS_SHARE_GPU=1 torchrun --nproc-per-node 4 benchmarks/gpu_checks.py zeropp zero3   # gpu_x1.sh zeropp

`zeropp` also counts what ran (real functions wrapped, not replaced): qwZ's weight quantizations
(partition_parameters.CUDAQuantizer.quantize), qgZ's quantized all-to-all reductions
(stage3.all_to_all_quant_reduce) and hpZ's secondary partitions (Init._partition_param_sec); `zero3` is the
same model without ZeRO++, for the loss comparison.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

import torch

MODEL = ["model.config.hidden_size=512", "model.config.intermediate_size=1376", "model.config.num_hidden_layers=4",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "model.config.vocab_size=32000",
         "model.config.max_position_embeddings=512", "data.seq_len=512", "training.micro_batch_size_per_gpu=8",
         "training.max_steps=30", "training.warmup_steps=3", "training.learning_rate=1.0e-3"]
ZERO = "deepspeed.zero_optimization"
VARIANTS = {
    # the seed's precision: fp16 with dynamic loss scaling (DeepSpeed's default loss_scale 0)
    "fp16": ["training.precision=fp16", 'deepspeed.fp16={"enabled": "auto", "initial_scale_power": 16}',
             "deepspeed.bf16.enabled=false"],
    # the seed's whole recipe: fp16 + optimizer offload to pinned CPU memory (DeepSpeed's CPU Adam)
    "fp16-offload": ["training.precision=fp16", 'deepspeed.fp16={"enabled": "auto", "initial_scale_power": 16}',
                     "deepspeed.bf16.enabled=false",
                     ZERO + '.offload_optimizer={"device": "cpu", "pin_memory": true}'],
    # the same from a loss scale of 2^28 that overflows at once: the first steps are skipped and the scale
    # halves (hysteresis 1), found without DeepSpeed's host-side scan (raytrain.compat.skip_host_overflow_scan);
    # -dsscan puts DeepSpeed's own check back: the same number of steps must be skipped
    "fp16-offload-overflow": ["training.precision=fp16", "deepspeed.bf16.enabled=false",
                              'deepspeed.fp16={"enabled": "auto", "initial_scale_power": 28, "hysteresis": 1}',
                              ZERO + '.offload_optimizer={"device": "cpu", "pin_memory": true}'],
    "bf16": ["training.precision=bf16"],
    # ZeRO++: hpZ (a secondary partition per node), qwZ (int8 weights in the all-gather), qgZ
    # (int4 gradients in the reduce-scatter)
    "zeropp": [f"{ZERO}.zero_hpz_partition_size=2", f"{ZERO}.zero_quantized_weights=true",
               f"{ZERO}.zero_quantized_gradients=true"],
    "zero3": [],  # the reference for zeropp's losses: plain ZeRO-3, same model, data and world size
}
VARIANTS["fp16-offload-overflow-dsscan"] = VARIANTS["fp16-offload-overflow"]
SHARE_GPU = os.environ.get("GPU_CHECKS_SHARE_GPU") == "1"


def count_calls(owner, name: str, counts: dict, key: str) -> None:
    """Wrap owner.name so each call adds 1 to counts[key]; the real function still runs."""
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return real(*args, **kwargs)

    setattr(owner, name, counted)


def flat_all_gather_for_gloo() -> None:
    """gloo's all_gather_into_tensor wants the output's chunks in the input's shape; NCCL, which
    DeepSpeed is written for, only counts elements, and qwZ gathers its (n,) quantization scales
    into a (world * n, 1) buffer ("ProcessGroupGloo::allgather: invalid tensor size at index 0
    (expected (1024, 1), got (1024))"). Flat views of the same memory are the same collective."""
    from deepspeed.comm.torch import TorchBackend

    real = TorchBackend.all_gather_into_tensor

    def flat(self, output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.is_contiguous() and input_tensor.is_contiguous():
            output_tensor, input_tensor = output_tensor.view(-1), input_tensor.view(-1)
        return real(self, output_tensor, input_tensor, group=group, async_op=async_op)

    TorchBackend.all_gather_into_tensor = flat


def run(name: str, world: int, device) -> dict:
    from raytrain import compat
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape
    from raytrain.worker.engine import build_engine, train_step

    if name == "zeropp" and world < 2:
        return {"variant": name, "ok": False, "error": "ZeRO++ quantization runs only at world size >= 2"}
    cfg = load_config(None, MODEL + VARIANTS[name])
    use_gpu = device.type == "cuda"
    resolved = resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=use_gpu, gpus_per_node=world if use_gpu else None))
    counts = {"qwz_quantize": 0, "qgz_all_to_all_reduce": 0, "hpz_secondary_partitions": 0}
    if name == "zeropp":
        import deepspeed.runtime.zero.partition_parameters as pp
        import deepspeed.runtime.zero.stage3 as stage3

        count_calls(pp.CUDAQuantizer, "quantize", counts, "qwz_quantize")
        count_calls(stage3, "all_to_all_quant_reduce", counts, "qgz_all_to_all_reduce")
        count_calls(pp.Init, "_partition_param_sec", counts, "hpz_secondary_partitions")
    engine, scheduler, _ = build_engine(resolved, device)
    if name.endswith("-dsscan"):
        compat.restore_host_overflow_scan(engine.optimizer)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 32000, (4, cfg.training.micro_batch_size_per_gpu, 512), generator=g).to(device)
    batches = iter({"input_ids": data[i % 4]} for i in range(10**9))
    losses = []
    for _ in range(cfg.training.max_steps):
        loss, _ = train_step(engine, batches, resolved.deepspeed.gradient_accumulation_steps, device)
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
        losses.append(loss.item())
    flags = {"fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
             "zero_stage": engine.zero_optimization_stage(),
             "offload_optimizer": bool(engine.zero_cpu_offload()),
             "zero_hpz_partition_size": engine.zero_hpz_partition_size(),
             "zero_quantized_weights": engine.zero_quantized_weights(),
             "zero_quantized_gradients": engine.zero_quantized_gradients(),
             "optimizer": type(engine.optimizer.optimizer).__name__,
             "skipped_steps": engine.skipped_steps,
             "host_overflow_scan_dropped": compat.host_overflow_scan_dropped(engine.optimizer),
             "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0))}
    # hpZ: parameters that keep a secondary (intra-group) partition to gather from in the backward
    secondary = sum(getattr(p, "ds_secondary_tensor", None) is not None for p in engine.module.parameters())
    expected = {"fp16": {"fp16": True}, "fp16-offload": {"fp16": True, "offload_optimizer": True},
                "fp16-offload-overflow": {"fp16": True, "offload_optimizer": True, "host_overflow_scan_dropped": True},
                "fp16-offload-overflow-dsscan": {"fp16": True, "offload_optimizer": True,
                                                 "host_overflow_scan_dropped": False},
                "bf16": {"bf16": True},
                "zeropp": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                           "zero_quantized_gradients": True},
                "zero3": {"zero_quantized_weights": False, "zero_quantized_gradients": False}}[name]
    wrong = {k: flags[k] for k, v in expected.items() if flags[k] != v}
    finite = all(math.isfinite(x) for x in losses)
    falling = sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5
    # ZeRO++'s paths ran, not only its flags: each of the three counted calls
    ran = name != "zeropp" or all(v > 0 for v in counts.values())
    if "overflow" in name:  # the overflows were found: steps skipped, the scale below its 2^28 start
        ran = flags["skipped_steps"] >= 1 and flags["loss_scale"] < 2**28
    counts["hpz_params_with_secondary_at_end"] = secondary
    ok = not wrong and finite and falling and ran and flags["zero_stage"] == 3
    return {"variant": name, "ok": ok, "world_size": world, "shared_gpu": SHARE_GPU and use_gpu,
            "backend": torch.distributed.get_backend(), "flags": flags, "wrong_flags": wrong,
            "counts": counts if name == "zeropp" else None, "paths_ran": ran,
            "finite": finite, "falling": falling, "losses": [round(x, 4) for x in losses],
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def main(names: list[str]) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"),
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if torch.cuda.is_available() and SHARE_GPU:  # every rank on the one GPU, gloo between them
        os.environ["LOCAL_RANK"] = "0"  # zero.Init sets the device from it (cuda:1 would not exist)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("gloo")
        flat_all_gather_for_gloo()
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=device)
    else:  # a smoke run of this script on a CPU (bf16 only: fp16 and ZeRO++ need the GPU)
        device = torch.device("cpu")
        torch.distributed.init_process_group("gloo")
    failed = False
    for name in names:
        try:
            result = run(name, world, device)
        except Exception:  # noqa: BLE001 - reported as the variant's result
            result = {"variant": name, "ok": False, "error": traceback.format_exc()[-2000:]}
        failed |= not result["ok"]
        if rank == 0:
            print("GPU_CHECK " + json.dumps(result), flush=True)
        elif "error" in result:  # another rank's own failure (rank 0 may only see a peer that went away)
            print(f"GPU_CHECK_RANK{rank} " + json.dumps(result), file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["fp16", "fp16-offload", "bf16"]))
