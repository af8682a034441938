"""The throughput model: predicted step time and tokens/s of a `Setting`, to rank the planner's candidates.

    t_step = GA * t_micro(mb) + T_STEP_FIXED + t_optimizer
    t_micro = F * mb * S * c_ckpt / (peak * eta(x) * k_liger * k_fused)     F = 6N + 12 L H S (flops per token)
      eta(x): the GPU's efficiency on forward + backward, a function of x = mb * S * H^2 / (24 * 2048 * 2048^2)
              (host work per layer, ZeRO-3's hooks and launches, is fixed; GPU work per layer grows as
              tokens x H^2): piecewise linear through ETA_POINTS, flat from x = 1
      c_ckpt = (8N + 16 L H S) / (6N + 12 L H S) with activation checkpointing (forward recomputed), else 1
    t_optimizer, no optimizer offload: the fused AdamW pass over HBM, (3 mw + 2 st + 2) N / HBM_ADAM_BYTES_PER_S
    with optimizer offload (DeepSpeed 0.19.8 keeps every micro-batch's gradients in pinned host memory,
    whatever the ratio: 2N bytes D2H at the first micro-batch, 4N round trip at each further one):
      K_VISIBLE * (2N + 4N (GA - 1)) / PCIE_BYTES_PER_S
      + N_host * CPU_ADAM_S_PER_PARAM(threads, states)        boundary copies, CPU Adam, cast, H2D
      + N_gpu * (3 mw + 2 st + mw) / HBM_ADAM_BYTES_PER_S     torch's AdamW on the GPU sub-groups
      + N * FP16_OVERFLOW_SCAN_S_PER_PARAM (fp16 only)        isinf/isnan over the pinned host buffer
    parameter offload: every forward and backward pass copies the parameters H2D: 2N (3N with
    checkpointing) bytes per micro-batch at PCIE_BYTES_PER_S, not overlapped (an upper bound).

Each constant names the measurement it comes from (raytrain.planning.calibration: row ids). Calibrated on
one H200 at world size 1: communication across GPUs is not modelled, and another GPU is assumed to
keep the H200's eta at its own `training.peak_tflops_per_gpu`. Use it to rank settings of one run,
not as a promise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain.planning.estimate import Estimate, MemoryFacts

# eta at the calibration points (x, eta, row of raytrain.planning.calibration): forward + backward time
# per micro-batch = the row's step time minus its optimizer step (below), GA micro-batches per step.
# Linear between the points, flat above x = 1 (rows 1b-mb24-liger-zero and 1b-mb32-liger-zero, 73,122
# vs 73,074 tok/s, show the plateau), proportional to x below the first (host-bound: a micro-batch
# takes as long whatever its tokens, as the 8.1B row's micro-batch of 1 does).
ETA_POINTS = ((1 / 6, 0.184, "8.1b-mb1-ckpt"), (1 / 3, 0.391, "7b-mb2-ga8-ckpt"), (2 / 3, 0.491, "1b-mb16-liger"),
              (1.0, 0.588, "1b-mb24-ga4"))
X_REF_TOKENS_H2 = 24 * 2048 * 2048**2  # 1.1B (hidden 2048) at micro-batch 24 x 2048 tokens: x = 1
# Liger's kernels change the kernels, not the shape of the curve: row 1b-mb24-loss-zero over
# 1b-mb24-liger-zero (54,532 / 73,122) for "loss"; row 1b-mb16 over 1b-mb16-liger (50,654 / 58,411)
# for "none" (measured at micro-batch 16, applied everywhere).
LIGER_FACTOR = {"all": 1.0, "loss": 0.746, "none": 0.867}
# model.fused_layers (raytrain/worker/fused.py) on the same kernels: rows 1b-ga4-layers-1202 over
# 1b-ga4-layers-off-1202 (79,555 / 77,167, one call; measured at 1.1B, mb 24, applied everywhere).
FUSED_LAYERS_FACTOR = 1.031
# The optimizer step without offload, T_STEP_FIXED + (3 mw + 2 st + 2) N / HBM_ADAM_BYTES_PER_S (norms,
# flatten and cast, the fused AdamW pass, the copy back): rows 1b-mb24-liger-zero (opt 0.041 s at
# 1.10B) and 8.1b-mb1-ckpt (opt 0.204 s at 8.11B), 30 bytes per parameter with fp32 states.
T_STEP_FIXED = 0.0154
HBM_ADAM_BYTES_PER_S = 1.29e12
# Pinned host <-> GPU copies, one direction (PCIe Gen5 x16; an assumption folded into K_VISIBLE).
PCIE_BYTES_PER_S = 50e9
# The offload terms, fitted jointly on rows 1b-mb24-ga4 (no offload), 1b-mb24-ga4-offload (all 1.10B
# parameters' states on the host) and 1b-mb24-ga4-ratio0.5 and 1b-mb24-ga4-ratio0.25 (88.6M on the
# host, the same split): the visible fraction of the per-micro-batch gradient round trip (2N + 4N (GA - 1) bytes) ...
K_VISIBLE = 0.248
# ... and the CPU-side cost per host parameter and step (boundary D2H, DeepSpeed's CPU Adam, cast,
# H2D) with fp32 states on 14 OpenMP threads.
CPU_ADAM_S_PER_PARAM_14_THREADS = 0.929e-9
# Thread scaling of that cost: rows 1b-mb24x4-offload-raytrain-14cpu / -1cpu (raytrain's path, 14 vs 1
# CPUs per worker: 1.18 s vs 4.75 s of CPU-side work per step) give a factor 4.04 = 14^0.529.
CPU_ADAM_THREAD_EXPONENT = 0.529
# bf16 master weights and moments move half the bytes; CPU Adam measured -30% on a 2-core VM
# (issue 14 research, cpu_microbench.py): x 0.6 assumed. NOT YET MEASURED ON THE H200
# (benchmarks/gpu_x1.sh part plan13b measures it).
CPU_ADAM_BF16_FACTOR = 0.6
# fp16 only: the overflow check scans the pinned host gradient buffer on the CPU every step
# (stage3.py:2811-2816, 3009-3030). From issue 14's seed-config comparison (fp16 41k vs bf16 50.7k
# tok/s, same offload, GA 4, 1.1B): 0.92 s per step for 1.1B. NOT SEPARATED FROM OTHER CAUSES
# (benchmarks/gpu_x1.sh part fp16 measures it).
FP16_OVERFLOW_SCAN_S_PER_PARAM = 0.84e-9


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B), as raytrain.worker.metrics.flops_per_token."""
    return 6 * num_params + 12 * num_layers * hidden * seq_len


def eta(hidden: int, micro_batch: int, seq_len: int) -> float:
    """The GPU's efficiency on forward + backward at this micro-batch (model FLOPs / peak / time)."""
    x = micro_batch * seq_len * hidden**2 / X_REF_TOKENS_H2
    points = [(0.0, 0.0)] + [(px, pe) for px, pe, _ in ETA_POINTS]
    if x >= points[-1][0]:
        return points[-1][1]
    (x0, e0), (x1, e1) = next((a, b) for a, b in zip(points, points[1:]) if x < b[0])
    return e0 + (e1 - e0) * (x - x0) / (x1 - x0)


def cpu_adam_s_per_param(threads: float, bf16_states: bool) -> float:
    t = min(max(threads, 1.0), 16.0)
    per_param = CPU_ADAM_S_PER_PARAM_14_THREADS * (14 / t) ** CPU_ADAM_THREAD_EXPONENT
    return per_param * (CPU_ADAM_BF16_FACTOR if bf16_states else 1.0)


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    tokens_per_s: float
    """Per worker."""
    mfu: float
    compute_s: float
    """GA x forward + backward."""
    optimizer_s: float
    """Everything else per step: the optimizer, and the host traffic of offload."""


def predict(f: MemoryFacts, e: Estimate, *, grad_accum: int, cpus_per_worker: float,
            peak_flops: float = 989e12) -> Prediction:
    """Predicted step time, tokens/s and MFU of one worker for an Estimate (its Setting) of a run."""
    s, cfg = e.setting, f.hf_config
    n = f.stats.num_params
    fpt = flops_per_token(n, cfg.num_hidden_layers, cfg.hidden_size, f.seq_len)
    tokens = s.micro_batch * f.seq_len
    ckpt = 1.0
    if s.gradient_checkpointing:
        attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * f.seq_len
        ckpt = (8 * n + attention * 4 / 3) / fpt
    efficiency = eta(cfg.hidden_size, s.micro_batch, f.seq_len) * LIGER_FACTOR.get(f.liger_kernel, 1.0)
    if f.fused_layers:
        efficiency *= FUSED_LAYERS_FACTOR
    t_micro = fpt * tokens * ckpt / (peak_flops * efficiency)
    if s.offload_param:
        t_micro += (3 if s.gradient_checkpointing else 2) * f.pb * n / PCIE_BYTES_PER_S
    mw, st = f.mw, f.st
    n_rank = math.ceil(n / f.world_size)  # the partition whose gradients and states this rank handles
    if s.offload_optimizer and f.use_gpu:
        t_opt = (K_VISIBLE * f.pb * n_rank * (1 + 2 * (grad_accum - 1)) / PCIE_BYTES_PER_S
                 + e.params_on_host * cpu_adam_s_per_param(cpus_per_worker, f.bf16_states)
                 + e.params_on_gpu * (3 * mw + 2 * st + mw) / HBM_ADAM_BYTES_PER_S)
        if f.precision == "fp16":
            t_opt += n_rank * FP16_OVERFLOW_SCAN_S_PER_PARAM
    else:
        t_opt = n_rank * (3 * mw + 2 * st + 2) / HBM_ADAM_BYTES_PER_S
    step = grad_accum * t_micro + T_STEP_FIXED + t_opt
    tokens_per_s = grad_accum * tokens / step
    return Prediction(step_time_s=step, tokens_per_s=tokens_per_s, mfu=tokens_per_s * fpt / peak_flops,
                      compute_s=grad_accum * t_micro, optimizer_s=T_STEP_FIXED + t_opt)
