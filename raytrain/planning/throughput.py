"""The throughput model: predicted step time and tokens/s of a `Setting`, to rank the planner's candidates.

    t_step = GA * t_micro(mb) + T_STEP_FIXED + t_optimizer
    t_micro = (t_gpu^P + t_host^P)^(1/P)          the larger of the two, blended where they are close
    t_gpu = F * mb * S * c_ckpt / (peak * eta(x) * k_liger * k_fused)     F = 6N + 12 L H S (model.flops_per_token)
      N: the parameters a token runs (raytrain.planning.activations.active_parameters: a mixture of experts'
         routed experts count num_experts_per_tok times, not num_experts)
      x (1 - g + g / FP8_GEMM_SPEEDUP) with model.fp8, g the projections' share of the flops
      eta(x): the GPU's efficiency on forward + backward, ETA_PLATEAU from x = 1 down to ETA_PLATEAU * (1 -
              ETA_SLOPE) at x = 0, x = mb * S * H^2 / (24 * 2048 * 2048^2) (smaller GEMMs)
      c_ckpt = 1 + RECOMPUTE_COST * (2 N_layers + 4 L H S) / F with activation checkpointing (the decoder
              layers' forward runs again; embedding, LM head and loss do not), else 1
      with data.position_ids=per_document under SDPA (`document_mask`): + (MASKED_ATTENTION_COST - 1) x the
      attention's flops (12 L H S per token, 16 with checkpointing) at the same efficiency
    t_host = L * HOST_S_PER_LAYER[fused] * (HOST_CKPT_FACTOR[fused] with checkpointing): the host's work per
      decoder layer and micro-batch (ZeRO-3's fetch and release hooks, autograd, launches), measured the same
      at hidden 2048 and 4096; it bounds small micro-batches (1.1B at micro-batch 4, 7.24B at 1)
    t_optimizer, no optimizer offload: the fused AdamW pass over HBM, (3 mw + 2 st + 2) N / HBM_ADAM_BYTES_PER_S
    with optimizer offload (DeepSpeed 0.19.8 keeps every micro-batch's gradients in pinned host memory,
    whatever the ratio: 2N bytes D2H at the first micro-batch, 4N round trip at each further one):
      K_VISIBLE * (2N + 4N (GA - 1)) / PCIE_BYTES_PER_S
      + N_host * CPU_ADAM_S_PER_PARAM(threads, states)        boundary copies, CPU Adam, cast, H2D
      + N_gpu * (3 mw + 2 st + mw) / HBM_ADAM_BYTES_PER_S     torch's AdamW on the GPU sub-groups
    (fp16 costs the same: DeepSpeed's host-side inf/nan scan, 0.98 s a step at 1.1B, is dropped by
    raytrain.compat.skip_host_overflow_scan; rows 1b-mb24x4-offload-1202g / -fp16-offload-1202g)
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

from raytrain.model import flops_per_token
from raytrain.planning.activations import active_parameters, decoder_dims, moe_dims
from raytrain.planning.estimate import Estimate, MemoryFacts

# The GPU's efficiency at x >= 1: row 1b-mb24-ga4 (forward + backward time per micro-batch = the row's step time
# minus its optimizer step, below; flat above x = 1: rows 1b-mb24-liger-zero and 1b-mb32-liger-zero, 73,122 vs
# 73,074 tok/s). Below x = 1 it falls linearly, by ETA_SLOPE at x = 0: rows 1b-mb12-1202b, 1b-mb16-1202b and
# 1b-mb18-cap70-1202b against 1b-mb24-1202b (one machine; 95.4%, 97.1%, 98.0% of its tokens/s).
ETA_PLATEAU = 0.588
ETA_SLOPE = 0.04
X_REF_TOKENS_H2 = 24 * 2048 * 2048**2  # 1.1B (hidden 2048) at micro-batch 24 x 2048 tokens: x = 1
# Host seconds per decoder layer and micro-batch, keyed by model.fused_layers (the fused layers run fewer
# modules, so fewer ZeRO-3 hooks: 1.1B at micro-batch 4 runs its forward in 87 ms fused against 183 ms): fused,
# rows 1b-mb4-1202b (9.5 ms) and 7b-mb1-1202c (9.7 ms); transformers' layers, row 1b-mb4-unfused-1202c (14.9 ms).
# Hosts differ: session 50's machine did it in 4.3 ms (row 1b-mb4-1205), 5.7 (7b-mb1-1205) and 6.4 (1b-mb4-unfused-1205)
# with the same code. The slower hosts' value is kept, so a small micro-batch's prediction is a floor; with the faster
# value no pick moved (1.1B uncapped and at 70, 24, 22 and 20 GiB, the 13B config: docs/benchmarks.md).
HOST_S_PER_LAYER = {True: 0.0096, False: 0.0149}
# ... times this with activation checkpointing (each layer's forward runs again): fused, rows 7b-mb1-ckpt-1202c
# over 7b-mb1-1202c (1.30, one machine) and 1b-mb4-ckpt-1202c over 1b-mb4-1202b (1.07, two machines);
# transformers' layers, rows 7b-mb2-ga8-ckpt and 8.1b-mb1-ckpt (20.6 and 21.8 ms per layer: 1.38, 1.46).
HOST_CKPT_FACTOR = {True: 1.18, False: 1.42}
# How sharply the micro-batch's time turns from host-bound to GPU-bound: row 1b-mb8-1202b, where the two are
# equal (0.21 s each), took 0.227 s.
HOST_GPU_BLEND_P = 8
# Checkpointing's recompute (the decoder layers' forward: 2 N_layers + 4 L H S flops per token) costs this
# much GPU time per flop against the forward + backward average (a forward runs its GEMMs and attention faster
# than a backward): rows 1b-mb24-ckpt-1202b over 1b-mb24-1202b (one machine: the step 24.3% longer, for
# 29.9% more flops). Held out: rows 7b-mb14-ga2-ckpt and 13b-mb17-ratio0.17-ckpt.
RECOMPUTE_COST = 0.81
# Liger's kernels change the GPU's kernels, not the host's work: row 1b-mb24-loss-zero over 1b-mb24-liger-zero
# (54,532 / 73,122) for "loss"; row 1b-mb16 over 1b-mb16-liger (50,654 / 58,411) for "none" (measured at
# micro-batch 16, where the host's term adds 1.4% to the Liger row's time: 0.85 reproduces the ratio).
LIGER_FACTOR = {"all": 1.0, "loss": 0.746, "none": 0.85}
# model.fused_layers (raytrain/worker/fused.py) on the same kernels: rows 1b-ga4-layers-1202 over
# 1b-ga4-layers-off-1202 (79,555 / 77,167, one call; measured at 1.1B, mb 24, applied everywhere).
FUSED_LAYERS_FACTOR = 1.031
# model.fp8 (raytrain/worker/fp8.py): the projections' share g of the GPU time (taken as their share of the
# flops, recompute included) runs this much faster, casts included: t_gpu x (1 - g + g / FP8_GEMM_SPEEDUP).
# Fitted on rows 1b-mb24-fp8-1204 / 1b-mb24-bf16-1204 (1.209x, g 0.75) and 7b-mb15-ckpt-fp8-1204 /
# 7b-mb15-ckpt-bf16-1204 (1.357x, g 0.87), one call; 1.38 reproduces the two ratios within +4.0% and -2.8%.
FP8_GEMM_SPEEDUP = 1.38
# data.position_ids=per_document under SDPA: transformers gives SDPA a 4D mask that keeps attention within each
# document, and with a mask SDPA leaves cuDNN's causal kernel for its memory-efficient one, which computes every
# score of the 2048 x 2048 block (not half of them) with K and V repeated to every head. Attention then takes this
# many times the time its flops (the causal count of F) take at the step's efficiency: row 1b-mb12-docmask-1207h
# (2.8 reproduces it; row 1b-mb8-docmask-1207h, partly host-bound, +3%). Flash attention's varlen kernels
# (flash_attention_2/4) take the positions without a mask (one row a micro-batch: raytrain.worker.engine.model_inputs).
MASKED_ATTENTION_COST = 2.8
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


def recompute_flops_per_token(hf_config, num_params: int, seq_len: int) -> float:
    """The decoder layers' forward, which activation checkpointing runs again: 2 flops per parameter outside the
    embedding, the LM head (unless tied) and the final norm, plus the attention's forward. `num_params`: those
    a token runs (`active_parameters`)."""
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    embedding = getattr(hf_config, "vocab_size", 0) * hidden
    untied_head = 0 if getattr(hf_config, "tie_word_embeddings", False) else embedding
    return 2 * max(num_params - embedding - untied_head - hidden, 0) + 4 * layers * hidden * seq_len


def projection_flops_per_token(hf_config) -> float:
    """Forward + backward flops per token of the decoder layers' projections (q, k, v, o, gate, up, down): a
    sparse layer's MLP is as wide as the experts a token runs plus the shared expert."""
    h, layers, _, q, kv, inter = decoder_dims(hf_config)
    moe = moe_dims(hf_config)
    mlp_widths = layers * inter
    if moe:
        mlp_widths += moe.sparse_layers * (moe.per_token * moe.intermediate + moe.shared - inter)
    return 6 * (layers * (h * (q + 2 * kv) + q * h) + 3 * h * mlp_widths)


def eta(hidden: int, micro_batch: int, seq_len: int) -> float:
    """The GPU's efficiency on forward + backward at this micro-batch (model FLOPs / peak / GPU time)."""
    x = micro_batch * seq_len * hidden**2 / X_REF_TOKENS_H2
    return ETA_PLATEAU * (1 - ETA_SLOPE * (1 - min(x, 1.0)))


def host_s(num_layers: int, fused_layers: bool, checkpointing: bool) -> float:
    """The host's time per micro-batch, forward + backward (the floor of a small micro-batch's time)."""
    return num_layers * HOST_S_PER_LAYER[fused_layers] * (HOST_CKPT_FACTOR[fused_layers] if checkpointing else 1.0)


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
    n = f.stats.num_params  # all of them: what the optimizer steps and offload moves
    active = active_parameters(cfg, n)  # what a token runs: the flops
    fpt = flops_per_token(active, cfg.num_hidden_layers, cfg.hidden_size, f.seq_len)
    tokens = s.micro_batch * f.seq_len
    ckpt = 1.0
    if s.gradient_checkpointing:
        ckpt = 1 + RECOMPUTE_COST * recompute_flops_per_token(cfg, active, f.seq_len) / fpt
    efficiency = eta(cfg.hidden_size, s.micro_batch, f.seq_len) * LIGER_FACTOR.get(f.liger_kernel, 1.0)
    if f.fused_layers:
        efficiency *= FUSED_LAYERS_FACTOR
    t_gpu = fpt * tokens * ckpt / (peak_flops * efficiency)
    if f.document_mask and f.use_gpu:
        attention = (16 if s.gradient_checkpointing else 12) * cfg.num_hidden_layers * cfg.hidden_size * f.seq_len
        t_gpu += (MASKED_ATTENTION_COST - 1) * attention * tokens / (peak_flops * efficiency)
    if f.fp8:
        projections = projection_flops_per_token(cfg) * (1 + (RECOMPUTE_COST / 3 if s.gradient_checkpointing else 0))
        g = min(projections / (fpt * ckpt), 1.0)
        t_gpu *= 1 - g + g / FP8_GEMM_SPEEDUP
    t_host = host_s(cfg.num_hidden_layers, f.fused_layers, s.gradient_checkpointing)
    p = HOST_GPU_BLEND_P
    t_micro = (t_gpu**p + t_host**p) ** (1 / p)
    if s.offload_param:
        t_micro += (3 if s.gradient_checkpointing else 2) * f.pb * n / PCIE_BYTES_PER_S
    mw, st = f.mw, f.st
    n_rank = math.ceil(n / f.world_size)  # the partition whose gradients and states this rank handles
    if s.offload_optimizer and f.use_gpu:
        t_opt = (K_VISIBLE * f.pb * n_rank * (1 + 2 * (grad_accum - 1)) / PCIE_BYTES_PER_S
                 + e.params_on_host * cpu_adam_s_per_param(cpus_per_worker, f.bf16_states)
                 + e.params_on_gpu * (3 * mw + 2 * st + mw) / HBM_ADAM_BYTES_PER_S)
    else:
        t_opt = n_rank * (3 * mw + 2 * st + 2) / HBM_ADAM_BYTES_PER_S
    step = grad_accum * t_micro + T_STEP_FIXED + t_opt
    tokens_per_s = grad_accum * tokens / step
    return Prediction(step_time_s=step, tokens_per_s=tokens_per_s, mfu=tokens_per_s * fpt / peak_flops,
                      compute_s=grad_accum * t_micro, optimizer_s=T_STEP_FIXED + t_opt)
