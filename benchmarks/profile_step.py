"""Where one optimizer step's GPU time goes at the shipped 1.1B setting, and bf16 levers (issue 14).

    python benchmarks/profile_step.py --variant shipped --shapes --out /tmp/prof   # one variant per process
    python benchmarks/profile_step.py --variant fused+flash --out /tmp/prof
    python benchmarks/profile_step.py --report /tmp/prof                            # results.md from results.jsonl
    python benchmarks/profile_step.py --check-fused                                 # fused == unfused (tiny model, CPU)

The model, DeepSpeed dict and step are the benchmark's plain-DeepSpeed path (raytrain.tools.bench's
arguments, raytrain.worker.engine.build_engine, bench_paths._measure: zero.Init, Liger "all",
deepspeed.initialize, synthetic tokens on the GPU, one process, NCCL world of 1). After the warmup and
timed steps (tokens/s, MFU = tokens/s x (6N + 12 L H S) / peak), ONE more optimizer step (all its
micro-batches) runs under torch.profiler with CUDA activity only, and its GPU kernels are summed by
category, with the GPU's busy time (union of kernel/memcpy/memset intervals) against the step's wall time.

A variant is a "+"-joined set of features ("shipped" alone: none, transformers' Llama layers with Liger's
kernels, model.fused_layers=false):
  expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set here, before CUDA starts)
  fused       q/k/v as one Linear and gate/up as one Linear (this benchmark's own patch of transformers'
              Llama classes: renamed parameters), RoPE applied in place on the fused q/k columns with Liger's
              RoPE kernel, Liger's fused gate-up SiLU-mul kernel; Liger RMSNorm and fused linear
              cross-entropy as shipped
  layers      raytrain's model.fused_layers=true (raytrain/worker/fused.py: the same fusions over the
              unrenamed parameters, concatenated per forward, plus the fused residual add + RMSNorm)
  noaddnorm   with layers: the residual add and RMSNorm as two kernels again (what the add+norm fusion is worth)
  norm1       with layers: RMSNorm backward kernels at Liger's one program per SM (what raytrain's 4 are worth)
  noaddmm     with layers: down_proj, then the residual add as its own kernel (what the GEMM epilogue is worth)
  flash / cudnn / efficient   SDPA restricted to that backend (torch.nn.attention.sdpa_kernel)
--shapes: afterwards one micro-batch (forward + backward) under the profiler with CPU activity,
record_shapes and with_flops: achieved TFLOP/s per GEMM shape (aten::mm/addmm/bmm), a separate JSON line.
Everything after "--" goes to raytrain.tools.bench's parser (e.g. -- --set deepspeed.zero_optimization.stage=2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from typing import Any

from raytrain.worker import fused as fused_layers

FEATURES = ("expandable", "fused", "layers", "noaddnorm", "norm1", "noaddmm", "flash", "cudnn", "efficient")
RESULT_PREFIX = "PROFILE_STEP_RESULT "
# The shipped setting of benchmarks/gpu_x1.sh (its Z and GAS4 arrays, mfu62's 1b-base).
SHIPPED_BENCH_ARGS = [
    "--paths", "deepspeed", "--micro-batch", "24", "--grad-accum", "4", "--steps", "4", "--warmup-steps", "2",
    "--window", "2", "--liger", "all", "--no-profile",
    "--set", "deepspeed.zero_optimization.reduce_bucket_size=500000000",
    "--set", "deepspeed.zero_optimization.stage3_prefetch_bucket_size=200000000",
    "--set", "deepspeed.zero_optimization.stage3_param_persistence_threshold=10000000",
    "--set", "scaling.cpus_per_worker=14"]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", help="shipped, or features joined by +: " + ", ".join(FEATURES))
    p.add_argument("--out", default="profile_out", help="results.jsonl (appended) and logs go here")
    p.add_argument("--shapes", action="store_true", help="also one micro-batch with record_shapes (GEMM TFLOP/s)")
    p.add_argument("--top", type=int, default=25, help="kernels listed by total time")
    p.add_argument("--report", metavar="DIR", help="write DIR/results.md from DIR/results.jsonl and print it")
    p.add_argument("--check-fused", action="store_true",
                   help="fused projections give the unfused model's loss and gradients (tiny config; GPU if present)")
    opts = p.parse_args(argv)
    if not (opts.variant or opts.report or opts.check_fused):
        p.error("one of --variant, --report, --check-fused")
    return opts, extra


def features_of(variant: str) -> set[str]:
    feats = {f for f in variant.split("+") if f and f != "shipped"}
    unknown = feats - set(FEATURES)
    if unknown:
        raise SystemExit(f"unknown feature(s) {sorted(unknown)}; choose from {FEATURES}")
    if feats & {"noaddnorm", "norm1", "noaddmm"} and "layers" not in feats:
        raise SystemExit("noaddnorm, norm1 and noaddmm modify layers: e.g. layers+norm1")
    if {"layers", "fused"} <= feats:
        raise SystemExit("layers and fused are two ways to the same fusion: one of them")
    if len(feats & {"flash", "cudnn", "efficient"}) > 1:
        raise SystemExit("at most one SDPA backend")
    return feats


# ---------------------------------------------------------------------------------------------
# Fused projections: this benchmark's own patch of transformers' Llama attention and MLP.

_ORIGINAL: dict[str, Any] = {}
_FUSED_PATHS: dict[str, str] = fused_layers.PATHS  # which implementation each fused piece used (reported)
# "inplace": Liger's RoPE kernel on the fused buffer; "copy": Liger's liger_rotary_pos_emb on q/k views
# (it copies them). "fused": Liger's fused gate-up SiLU-mul; "halves": LigerSiLUMulFunction on the halves.
MODES = {"rope": "inplace", "silu_mul": "fused"}


def _fused_qkv_function():
    from raytrain.worker.fused import QKVRope  # the product's (model.fused_layers): RoPE in place on q|k|v

    return QKVRope


def _fused_classes(ml):
    import torch
    from torch import nn

    FusedQKVRope = _fused_qkv_function()
    base_attention = _ORIGINAL["LlamaAttention"]

    class FusedLlamaAttention(base_attention):  # a subclass: transformers' isinstance checks still hold
        def __init__(self, config, layer_idx: int):
            nn.Module.__init__(self)
            self.config, self.layer_idx = config, layer_idx
            self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.n_q, self.n_kv = config.num_attention_heads, config.num_key_value_heads
            self.num_key_value_groups = self.n_q // self.n_kv
            self.scaling = self.head_dim ** -0.5
            self.attention_dropout = config.attention_dropout
            self.is_causal = True
            bias = config.attention_bias
            self.qkv_proj = nn.Linear(config.hidden_size, (self.n_q + 2 * self.n_kv) * self.head_dim, bias=bias)
            self.o_proj = nn.Linear(self.n_q * self.head_dim, config.hidden_size, bias=bias)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                    cache=None, **kwargs):
            if past_key_values is not None or cache is not None:
                raise NotImplementedError("fused projections: training only (no KV cache)")
            input_shape = hidden_states.shape[:-1]
            cos, sin = position_embeddings
            if MODES["rope"] == "inplace":
                q, k, v = FusedQKVRope.apply(self.qkv_proj(hidden_states), cos, sin, self.n_q, self.n_kv, self.head_dim)
            else:
                d = self.head_dim
                q, k, v = (t.view(*input_shape, -1, d).transpose(1, 2) for t in self.qkv_proj(hidden_states).split(
                    [self.n_q * d, self.n_kv * d, self.n_kv * d], dim=-1))
                q, k = ml.apply_rotary_pos_emb(q, k, cos, sin)  # Liger's where apply_liger("all") ran
                _FUSED_PATHS["rope"] = f"{ml.apply_rotary_pos_emb.__module__}.apply_rotary_pos_emb on q/k views"
            return fused_layers.attend_and_project(self, q, k, v, attention_mask, input_shape, **kwargs)

    class FusedLlamaMLP(nn.Module):
        def __init__(self, config, intermediate_size=None):
            super().__init__()
            self.hidden_size = config.hidden_size
            self.intermediate_size = intermediate_size or config.intermediate_size
            if config.hidden_act not in ("silu", "swish"):
                raise ValueError(f"fused gate/up: activation {config.hidden_act} not supported")
            bias = getattr(config, "mlp_bias", False)
            self.gate_up_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=bias)
            self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

        def forward(self, x):
            y = self.gate_up_proj(x)
            if y.is_cuda:
                try:
                    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
                except ImportError:
                    LigerFusedGateUpSiLUMulFunction = None
                if MODES["silu_mul"] != "fused":
                    LigerFusedGateUpSiLUMulFunction = None
                if LigerFusedGateUpSiLUMulFunction is not None:
                    _FUSED_PATHS["silu_mul"] = "liger LigerFusedGateUpSiLUMulFunction (no copies)"
                    shape = y.shape
                    c = LigerFusedGateUpSiLUMulFunction.apply(y.view(-1, shape[-1]), False)
                    return self.down_proj(c.view(*shape[:-1], self.intermediate_size))
                from liger_kernel.ops.swiglu import LigerSiLUMulFunction

                _FUSED_PATHS["silu_mul"] = "liger LigerSiLUMulFunction on the two halves (contiguous copies)"
                gate, up = y.chunk(2, dim=-1)
                return self.down_proj(LigerSiLUMulFunction.apply(gate, up))
            _FUSED_PATHS.setdefault("silu_mul", "torch silu(gate) * up (CPU)")
            gate, up = y.chunk(2, dim=-1)
            return self.down_proj(torch.nn.functional.silu(gate) * up)

    return FusedLlamaAttention, FusedLlamaMLP


def patch_fused() -> None:
    """Swap the fused classes into transformers' Llama module (after apply_liger, which sets LlamaMLP)."""
    from transformers.models.llama import modeling_llama as ml

    if "LlamaAttention" not in _ORIGINAL:
        _ORIGINAL["LlamaAttention"] = ml.LlamaAttention
        _ORIGINAL["classes"] = _fused_classes(ml)
    _ORIGINAL["LlamaMLP"] = ml.LlamaMLP  # transformers' or Liger's, whatever apply_liger left
    ml.LlamaAttention, ml.LlamaMLP = _ORIGINAL["classes"]


def unpatch_fused() -> None:
    from transformers.models.llama import modeling_llama as ml

    ml.LlamaAttention, ml.LlamaMLP = _ORIGINAL["LlamaAttention"], _ORIGINAL["LlamaMLP"]


def fused_state_dict(unfused_state: dict) -> dict:
    """The unfused model's weights in the fused layout (q|k|v and gate|up concatenated on the output dim)."""
    import torch

    out = {}
    for key, value in unfused_state.items():
        if ".self_attn.q_proj." in key:
            kind = key.rsplit(".", 1)[1]
            stem = key.split(".self_attn.q_proj.")[0]
            parts = [unfused_state[f"{stem}.self_attn.{n}_proj.{kind}"] for n in "qkv"]
            out[f"{stem}.self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        elif ".mlp.gate_proj." in key:
            kind = key.rsplit(".", 1)[1]
            stem = key.split(".mlp.gate_proj.")[0]
            out[f"{stem}.mlp.gate_up_proj.{kind}"] = torch.cat(
                [unfused_state[f"{stem}.mlp.gate_proj.{kind}"], unfused_state[f"{stem}.mlp.up_proj.{kind}"]], dim=0)
        elif any(f".{n}_proj." in key for n in ("k", "v", "up")) and (".self_attn." in key or ".mlp." in key):
            continue
        else:
            out[key] = value
    return out


def check_fused(device_name: str | None = None) -> dict[str, Any]:
    """Tiny Llama, unfused vs fused with the same (concatenated) weights: loss and gradients, fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain.worker.kernels import apply_liger

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    mode = "all" if device.type == "cuda" else "loss"  # Liger's Triton kernels need a GPU
    apply_liger(mode)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    unfused = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device).train()
    patch_fused()
    try:
        fused = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device).train()
    finally:
        unpatch_fused()
    missing, unexpected = fused.load_state_dict(fused_state_dict(unfused.state_dict()), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"fused state dict: missing {missing}, unexpected {unexpected}")
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    losses, grads = [], []
    for model in (unfused, fused):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad for k, p in model.named_parameters()})
    regrouped = fused_state_dict(grads[0])
    worst = max(((grads[1][k] - g).abs().max().item() / max(g.abs().max().item(), 1e-12), k)
                for k, g in regrouped.items())
    result = {"device": device.type, "liger": mode, "loss_unfused": losses[0], "loss_fused": losses[1],
              "loss_abs_diff": abs(losses[0] - losses[1]), "grad_max_rel_diff": worst[0], "grad_worst_param": worst[1],
              "fused_paths": dict(_FUSED_PATHS), "attention_class": type(fused.model.layers[0].self_attn).__name__,
              "mlp_class": type(fused.model.layers[0].mlp).__name__,
              "unfused_mlp_class": type(unfused.model.layers[0].mlp).__name__}
    result["ok"] = result["loss_abs_diff"] < 1e-4 and result["grad_max_rel_diff"] < 1e-3
    return result


def check_fused_layers(device_name: str | None = None) -> dict[str, Any]:
    """Tiny Llama (Liger "all" on a GPU), transformers' layers vs raytrain's fused_layers on a deep copy
    (the same parameters): loss and every gradient, fp32."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain.worker.kernels import apply_liger

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    mode = "all" if device.type == "cuda" else "loss"
    apply_liger(mode)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device).train()
    fused = copy.deepcopy(plain)
    swapped = fused_layers.fuse_llama_layers(fused)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    losses, grads = [], []
    for model in (plain, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad for k, p in model.named_parameters()})
    worst = max(((grads[1][k] - g).abs().max().item() / max(g.abs().max().item(), 1e-12), k)
                for k, g in grads[0].items())
    result = {"device": device.type, "liger": mode, "swapped": swapped, "loss_plain": losses[0],
              "loss_fused": losses[1], "loss_abs_diff": abs(losses[0] - losses[1]), "grad_max_rel_diff": worst[0],
              "grad_worst_param": worst[1], "fused_paths": dict(fused_layers.PATHS)}
    result["ok"] = result["loss_abs_diff"] < 1e-4 and result["grad_max_rel_diff"] < 1e-3
    return result


def _two_kernel_add_norm(norm, x, residual):
    """noaddnorm: the residual add, then Liger's RMSNorm (on a GPU), as transformers' layer runs them."""
    s = residual + x
    if s.is_cuda:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        fused_layers.PATHS["add_norm"] = "add, then liger LigerRMSNormFunction (two kernels)"
        return LigerRMSNormFunction.apply(s, norm.weight, fused_layers._eps(norm), 0.0, "llama", False), s
    return norm(s), s


# ---------------------------------------------------------------------------------------------
# The profiled step, summed by category.

ATTENTION = ("sdpa", "flash", "fmha", "attention", "cudnn")
ATTENTION_BWD = ("bprop", "bwd", "backward", "cutlassb", "dot_do_o", "convert_dq")
GEMM = ("gemm", "nvjet", "cutlass", "cublas", "xmma", "sm90_", "sm80_", "ampere_", "wgmma", "splitk", "gemv")
ELEMENTWISE = ("elementwise", "reduce", "catarray", "copy", "fill", "index", "embedding", "scatter", "gather",
               "softmax", "norm", "arange", "where", "unrolled", "vectorized", "sum", "cumsum", "sort", "cast")
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def liger_kernel_names() -> set[str]:
    """The @triton.jit function names in liger_kernel's sources (a Triton kernel is profiled by that name)."""
    try:
        import liger_kernel
    except ImportError:
        return set()
    names = set()
    root = os.path.dirname(liger_kernel.__file__)
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f), errors="replace") as fh:
                    names.update(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def\s+(\w+)", fh.read()))
    return names


def category(name: str, liger: set[str]) -> str:
    n = name.lower()
    if "nccl" in n:
        return "NCCL"
    if n.startswith(("memcpy", "memset")):
        return "memcpy/memset"
    if any(s in n for s in ATTENTION):
        return "attention bwd" if any(s in n for s in ATTENTION_BWD) else "attention fwd"
    if any(s in n for s in GEMM):
        return "GEMM"
    if name in liger:
        return f"liger:{name}"
    if IDENT.match(name):
        return f"triton:{name}"
    if "multi_tensor_apply" in n or "adam" in n:
        return "optimizer (multi-tensor)"
    if any(s in n for s in ELEMENTWISE):
        return "elementwise/reduction"
    return "other"


def device_events(prof, cuda: bool = True) -> list[tuple[str, int, int, int]]:
    """(name, start ns, end ns, stream) of every GPU activity (kernels, memcpy, memset) in the trace
    (cuda False: the CPU ops instead, nested ones too: only for a dry run of this code on CPU)."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if cuda else DeviceType.CPU
    out = []
    try:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == want:
                out.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id()))
    except AttributeError:  # another torch: the FunctionEvents (microseconds)
        for e in prof.events():
            if e.device_type == want:
                out.append((e.name, int(e.time_range.start * 1e3), int(e.time_range.end * 1e3), e.thread))
    return out


def analyze(events, wall_s: float, flops: dict[str, float], liger: set[str], top: int) -> dict[str, Any]:
    wall_ms = wall_s * 1e3
    per_cat: dict[str, float] = {}
    per_kernel: dict[str, list] = {}
    per_stream: dict[int, float] = {}
    for name, start, end, stream in events:
        ms = (end - start) / 1e6
        cat = category(name, liger)
        per_cat[cat] = per_cat.get(cat, 0.0) + ms
        k = per_kernel.setdefault(name, [0, 0.0, cat])
        k[0] += 1
        k[1] += ms
        per_stream[stream] = per_stream.get(stream, 0.0) + ms
    # busy = union of the intervals; gaps between them are idle GPU time
    busy_ns, gaps, cur_s, cur_e = 0, [], None, None
    for _, s, e, _ in sorted(events, key=lambda t: t[1]):
        if cur_e is None:
            cur_s, cur_e = s, e
        elif s > cur_e:
            busy_ns += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy_ns += cur_e - cur_s
    span_ms = (max(e for _, _, e, _ in events) - min(s for _, s, _, _ in events)) / 1e6 if events else 0.0
    kernel_sum = sum(per_cat.values())
    busy_ms = busy_ns / 1e6
    gap_ms = [g / 1e6 for g in gaps]
    grouped: dict[str, float] = {}
    for cat, ms in per_cat.items():
        key = "Liger/triton" if cat.startswith(("liger:", "triton:")) else cat
        grouped[key] = grouped.get(key, 0.0) + ms
    res: dict[str, Any] = {
        "wall_ms": wall_ms, "gpu_span_ms": span_ms, "kernel_sum_ms": kernel_sum, "busy_ms": busy_ms,
        "idle_frac_of_wall": 1 - busy_ms / wall_ms if wall_ms else None,
        "overlap_ms": kernel_sum - busy_ms, "num_gpu_events": len(events),
        "gaps": {"count": len(gap_ms), "sum_ms": sum(gap_ms),
                 "over_1ms_ms": sum(g for g in gap_ms if g > 1), "over_1ms_count": sum(g > 1 for g in gap_ms),
                 "from_0.1_to_1ms_ms": sum(g for g in gap_ms if 0.1 < g <= 1),
                 "under_0.1ms_ms": sum(g for g in gap_ms if g <= 0.1), "largest_ms": sorted(gap_ms)[-5:][::-1],
                 "outside_span_ms": wall_ms - span_ms},
        "categories_ms": dict(sorted(grouped.items(), key=lambda kv: -kv[1])),
        "categories_pct_of_wall": {k: 100 * v / wall_ms for k, v in sorted(grouped.items(), key=lambda kv: -kv[1])},
        "liger_triton_ms": {k: v for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])
                            if k.startswith(("liger:", "triton:"))},
        "streams_ms": {str(k): v for k, v in sorted(per_stream.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "category": c, "count": cnt, "ms": ms, "pct_of_wall": 100 * ms / wall_ms}
                        for n, (cnt, ms, c) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
    }
    gemm_ms = grouped.get("GEMM", 0.0)
    if gemm_ms:
        res["gemm_tflops_from_6N"] = flops["gemm"] / (gemm_ms / 1e3) / 1e12
    for cat, key in (("attention fwd", "attention_fwd"), ("attention bwd", "attention_bwd")):
        if grouped.get(cat):
            res[f"{key}_tflops_causal"] = flops[key] / (grouped[cat] / 1e3) / 1e12
    res["model_flops_step"] = flops["model"]
    res["mfu_of_profiled_step"] = flops["model"] / wall_s / flops["peak"] if flops["peak"] else None
    return res


def step_flops(resolved, peak: float) -> dict[str, float]:
    """Per optimizer step: the MFU numerator, the Linear layers' 6 x weights x tokens, causal attention."""
    from raytrain.tools.bench_paths import _flops_per_token

    cfg = resolved.config
    m = resolved.model
    hf = m.hf_config
    h, layers, s = m.hidden_size, m.num_hidden_layers, cfg.data.seq_len
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    hd = hf.get("head_dim") or h // heads
    inter, vocab = hf["intermediate_size"], hf["vocab_size"]
    tokens = resolved.deepspeed.micro_batch_per_gpu * resolved.deepspeed.gradient_accumulation_steps * s
    linear_weights = layers * (h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * inter) + vocab * h  # + lm_head
    return {"tokens": tokens, "linear_weights": linear_weights, "gemm": 6 * linear_weights * tokens,
            "attention_fwd": 2 * layers * heads * hd * s * tokens, "attention_bwd": 4 * layers * heads * hd * s * tokens,
            "model": _flops_per_token(resolved) * tokens, "peak": peak}


def gemm_shapes(run_micro_batch, top: int) -> dict[str, Any]:
    """One micro-batch under the profiler with CPU activity and shapes: GEMM ops by input shapes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
        run_micro_batch()
        if cuda:
            torch.cuda.synchronize()
    rows, total_flops, total_us, no_flops_us = [], 0.0, 0.0, 0.0
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key not in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"):
            continue
        us = getattr(evt, "self_device_time_total", None) if cuda else evt.cpu_time_total
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        fl = float(evt.flops or 0)
        if fl:
            total_flops += fl
            total_us += us
        else:
            no_flops_us += us
        rows.append({"op": evt.key, "shapes": str(evt.input_shapes)[:160], "count": evt.count, "ms": us / 1e3,
                     "tflops": fl / (us * 1e-6) / 1e12 if us else None, "gflop": fl / 1e9})
    rows.sort(key=lambda r: -r["ms"])
    return {"gemm_ops_ms": total_us / 1e3, "gemm_ops_tflops": total_flops / (total_us * 1e-6) / 1e12 if total_us else None,
            "gemm_ops_tflop": total_flops / 1e12, "gemm_ops_without_flops_ms": no_flops_us / 1e3, "shapes": rows[:top],
            "analysis_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# One variant.


def _checked_fused() -> dict[str, Any]:
    """check_fused with the no-copy paths; if they fail, again with Liger's copying functions."""
    try:
        result = check_fused()
    except Exception as e:  # noqa: BLE001 - reported, then the fallback is checked
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[-400:]}
    print("fused check:", json.dumps(result), flush=True)
    if result["ok"]:
        return result
    MODES.update(rope="copy", silu_mul="halves")
    _FUSED_PATHS.clear()
    fallback = check_fused()
    print("fused check, copying paths:", json.dumps(fallback), flush=True)
    return {**fallback, "no_copy_paths_check": result}


def run_variant(opts: argparse.Namespace, extra: list[str]) -> int:
    feats = features_of(opts.variant)
    if "expandable" in feats:  # before torch initialises CUDA (this process has not imported torch yet)
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (conf, "expandable_segments:True") if x)
    os.makedirs(opts.out, exist_ok=True)
    record: dict[str, Any] = {"variant": opts.variant, "features": sorted(feats),
                              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                              "bench_args": SHIPPED_BENCH_ARGS + extra}
    t_start = time.perf_counter()
    try:
        import torch

        from raytrain.tools import bench, bench_paths
        from raytrain.worker import engine as engine_mod

        record["versions"] = bench.versions()
        record["versions"]["cudnn"] = torch.backends.cudnn.version()
        # Every variant but "layers" profiles transformers' layers (model.fused_layers is "auto", on with
        # Liger "all" since 2026-12-02): "shipped" is the step as it was before fused layers.
        layers = ["--set", f"model.fused_layers={'true' if 'layers' in feats else 'false'}"]
        record["bench_args"] = SHIPPED_BENCH_ARGS + extra + layers
        args = bench.parse_args(record["bench_args"])
        use_gpu = torch.cuda.is_available()  # CPU: a dry run of this script's code (tiny shapes via --)
        resolved = bench_paths.resolve(bench.overrides_for(args, use_gpu), args.num_gpus, use_gpu)
        if "layers" in feats:
            record["layers_check"] = check_fused_layers()  # tiny model on this GPU: fused == transformers'
            print("fused layers check:", json.dumps(record["layers_check"]), flush=True)
            if not record["layers_check"]["ok"]:
                raise RuntimeError(f"fused layers differ from transformers': {record['layers_check']}")
            fused_layers.PATHS.clear()
            if "noaddnorm" in feats:
                fused_layers._add_rms_norm = _two_kernel_add_norm
            if "norm1" in feats:
                fused_layers.NORM_BWD_PROGRAMS_PER_SM = 1
            if "noaddmm" in feats:
                fused_layers._down_add = lambda x, weight, residual: residual + x @ weight.t()
        if "fused" in feats:
            record["fused_check"] = _checked_fused()  # tiny model on this GPU: fused == unfused
            if not record["fused_check"]["ok"]:
                raise RuntimeError(f"fused projections differ from the unfused model: {record['fused_check']}")
            original_apply = engine_mod.apply_liger

            def apply_liger_then_fuse(mode):  # build_engine calls this right before it builds the model
                original_apply(mode)
                patch_fused()

            engine_mod.apply_liger = apply_liger_then_fuse
        device = bench_paths._device()
        bench_paths._init_single_process_group(device)
        torch.set_num_threads(max(1, int(resolved.config.scaling.cpus_per_worker)))
        engine, _, _ = engine_mod.build_engine(resolved, device)
        layer0 = engine.module.model.layers[0]
        record["modules"] = {"layer": type(layer0).__name__, "attention": type(layer0.self_attn).__name__,
                             "mlp": type(layer0.mlp).__name__,
                             "norm": type(layer0.input_layernorm).__name__,
                             "attn_implementation": engine.module.config._attn_implementation}
        backend = next((f for f in ("flash", "cudnn", "efficient") if f in feats), None)
        from contextlib import nullcontext

        ctx = nullcontext()
        if backend:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                                "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]])
        facts = resolved.deepspeed
        with ctx:
            t0 = time.perf_counter()
            record.update(bench_paths._measure(args, resolved, engine, device))  # warmup + timed steps
            record["measure_s"] = time.perf_counter() - t0
            batches = bench_paths.synthetic_batches(resolved.model.vocab_size, facts.micro_batch_per_gpu,
                                                    resolved.config.data.seq_len, device)
            from torch.profiler import ProfilerActivity, profile

            sync = torch.cuda.synchronize if use_gpu else (lambda: None)
            sync()
            with profile(activities=[ProfilerActivity.CUDA if use_gpu else ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                engine_mod.train_step(engine, batches, facts.gradient_accumulation_steps, device)
                sync()
                wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            flops = step_flops(resolved, args.peak_tflops * 1e12 if use_gpu else None)
            record["profile"] = analyze(device_events(prof, use_gpu), wall, flops, liger_kernel_names(), opts.top)
            record["profile"]["analysis_s"] = time.perf_counter() - t0
            record["flops"] = flops
            record["fused_paths"] = dict(_FUSED_PATHS)
            record["status"] = "ok"
            _write(opts.out, record)
            print_variant(record)
            if opts.shapes:
                def one_micro_batch():  # the last thing this process does (leaves accumulation mid-step)
                    batch = next(batches)
                    loss = engine(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
                    engine.backward(loss)

                shapes = {"variant": opts.variant, "kind": "gemm_shapes", **gemm_shapes(one_micro_batch, 20)}
                _write(opts.out, shapes)
                print_shapes(shapes)
        return 0
    except Exception as e:  # noqa: BLE001 - reported in the record; the traceback in the log
        traceback.print_exc()
        if record.get("status") == "ok":
            return 1  # the shapes step failed after the main record was written
        record.update(status="oom" if "out of memory" in str(e).lower() else "error", error=f"{type(e).__name__}: {e}"[-800:])
        _write(opts.out, record)
        return 1
    finally:
        print(f"variant {opts.variant}: {time.perf_counter() - t_start:.0f} s", flush=True)


def _write(out: str, record: dict[str, Any]) -> None:
    line = json.dumps(record, default=str)
    print(RESULT_PREFIX + line[:200] + ("..." if len(line) > 200 else ""), flush=True)
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        f.write(line + "\n")


# ---------------------------------------------------------------------------------------------
# Tables.

CATS = ("GEMM", "attention fwd", "attention bwd", "Liger/triton", "elementwise/reduction", "optimizer (multi-tensor)",
        "memcpy/memset", "NCCL", "other")


def summary_table(records: list[dict[str, Any]]) -> str:
    head = ["variant", "status", "tokens/s", "MFU", "step s", "peak GiB", "prof. step ms", "kernel sum ms", "GPU idle",
            "GEMM TFLOP/s"] + [f"{c} %" for c in CATS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in records:
        p = r.get("profile") or {}
        pct = p.get("categories_pct_of_wall", {})
        row = [r["variant"], r.get("status", "?"), _f(r.get("tokens_per_s"), "{:,.0f}"), _f(r.get("mfu"), "{:.1%}"),
               _f(r.get("step_time_s"), "{:.3f}"), _f(r.get("peak_mem_gib"), "{:.1f}"), _f(p.get("wall_ms"), "{:.0f}"),
               _f(p.get("kernel_sum_ms"), "{:.0f}"), _f(p.get("idle_frac_of_wall"), "{:.1%}"),
               _f(p.get("gemm_tflops_from_6N"), "{:.0f}")] + [_f(pct.get(c), "{:.1f}") for c in CATS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _f(v, fmt: str) -> str:
    return "" if v is None else fmt.format(v)


def variant_detail(r: dict[str, Any], top: int | None = None) -> str:
    p = r.get("profile")
    if not p:
        return f"### {r['variant']}: {r.get('status')} {r.get('error', '')}\n"
    g = p["gaps"]
    out = [f"### {r['variant']}",
           (f"timed steps: {_f(r.get('tokens_per_s'), '{:,.0f}')} tokens/s, MFU {_f(r.get('mfu'), '{:.1%}')}, step "
           f"{_f(r.get('step_time_s'), '{:.3f}')} s (fwd {_f(r.get('forward_s'), '{:.3f}')} / bwd "
           f"{_f(r.get('backward_s'), '{:.3f}')} / opt {_f(r.get('optimizer_s'), '{:.3f}')}), peak "
           f"{_f(r.get('peak_mem_gib'), '{:.1f}')} GiB allocated, {_f(r.get('peak_reserved_gib'), '{:.1f}')} GiB reserved; "
           f"modules {r.get('modules')}; fused paths {r.get('fused_paths') or '-'}"),
           (f"profiled step: wall {p['wall_ms']:.1f} ms (MFU of that step {_f(p.get('mfu_of_profiled_step'), '{:.1%}')}), "
           f"GPU span {p['gpu_span_ms']:.1f} ms, kernel sum {p['kernel_sum_ms']:.1f} ms, busy (union) {p['busy_ms']:.1f} ms, "
           f"idle {_f(p.get('idle_frac_of_wall'), '{:.1%}')} of wall; {p['num_gpu_events']} GPU events"),
           (f"idle gaps: {g['count']} gaps, {g['sum_ms']:.1f} ms; >1 ms: {g['over_1ms_count']} ({g['over_1ms_ms']:.1f} ms), "
           f"0.1-1 ms: {g['from_0.1_to_1ms_ms']:.1f} ms, <0.1 ms: {g['under_0.1ms_ms']:.1f} ms; largest "
           f"{', '.join(f'{x:.1f}' for x in g['largest_ms'])} ms; before first / after last kernel {g['outside_span_ms']:.1f} ms"),
           (f"GEMM: {_f(p.get('gemm_tflops_from_6N'), '{:.0f}')} TFLOP/s (6 x {r['flops']['linear_weights'] / 1e9:.3f}B "
           f"Linear weights x {r['flops']['tokens']:,} tokens / GEMM kernel time); attention (causal FLOPs): fwd "
           f"{_f(p.get('attention_fwd_tflops_causal'), '{:.0f}')}, bwd {_f(p.get('attention_bwd_tflops_causal'), '{:.0f}')} TFLOP/s"),
           "", "| category | ms | % of step wall |", "| --- | ---: | ---: |"]
    for c, ms in p["categories_ms"].items():
        out.append(f"| {c} | {ms:.1f} | {p['categories_pct_of_wall'][c]:.1f} |")
    out.append(f"| (idle: no GPU activity) | {p['wall_ms'] - p['busy_ms']:.1f} | {100 * (1 - p['busy_ms'] / p['wall_ms']):.1f} |")
    if p["liger_triton_ms"]:
        out += ["", "Liger/triton kernels: " + ", ".join(f"{k} {v:.1f} ms" for k, v in p["liger_triton_ms"].items())]
    out += ["", "streams (kernel ms): " + ", ".join(f"{k}: {v:.1f}" for k, v in p["streams_ms"].items())]
    kernels = p["top_kernels"][:top] if top else p["top_kernels"]
    out += ["", "| # | kernel | category | calls | ms | % |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for i, k in enumerate(kernels, 1):
        out.append(f"| {i} | `{k['name'][:110]}` | {k['category']} | {k['count']} | {k['ms']:.1f} | {k['pct_of_wall']:.1f} |")
    return "\n".join(out) + "\n"


def shapes_detail(s: dict[str, Any]) -> str:
    out = [f"### GEMM shapes, one micro-batch of {s['variant']} (CPU+CUDA profiler, with_flops)",
           (f"aten mm/addmm/bmm: {s['gemm_ops_tflop']:.1f} TFLOP in {s['gemm_ops_ms']:.1f} ms of their kernels = "
           f"{s['gemm_ops_tflops'] or 0:.0f} TFLOP/s (ops the profiler counts no FLOPs for: "
           f"{s.get('gemm_ops_without_flops_ms', 0):.1f} ms)"), "",
           "| op | input shapes | calls | ms | TFLOP/s |", "| --- | --- | ---: | ---: | ---: |"]
    for r in s["shapes"]:
        out.append(f"| {r['op']} | {r['shapes']} | {r['count']} | {r['ms']:.1f} | {_f(r['tflops'], '{:.0f}')} |")
    return "\n".join(out) + "\n"


def print_variant(r: dict[str, Any]) -> None:
    print(summary_table([r]) + "\n" + variant_detail(r), flush=True)


def print_shapes(s: dict[str, Any]) -> None:
    print(shapes_detail(s), flush=True)


def report(folder: str) -> str:
    with open(os.path.join(folder, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    main = [r for r in rows if r.get("kind") != "gemm_shapes"]
    text = ["## torch.profiler over one optimizer step (1.1B, mb 24 x GA 4, bf16, ZeRO-3, Liger all, one H200)", "",
            ("% columns: kernel time of the category / the profiled step's wall time; GPU idle: 1 - union of GPU "
            "activity / wall. tokens/s, MFU, step s: the timed steps (no profiler)."), "", summary_table(main)]
    v = next((r.get("versions") for r in main if r.get("versions")), None)
    if v:
        text.append("versions: " + ", ".join(f"{k} {v[k]}" for k in ("torch", "cuda", "cudnn", "deepspeed",
                                                                       "transformers", "liger-kernel", "triton", "gpu")
                                             if k in v) + "\n")
    for r in main:
        text.append(variant_detail(r, None if r["variant"] == "shipped" else 10))
        if r.get("fused_check"):
            text.append(f"fused check (tiny model on the GPU, fp32): {json.dumps(r['fused_check'])}\n")
    for s in rows:
        if s.get("kind") == "gemm_shapes":
            text.append(shapes_detail(s))
    md = "\n".join(text)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(md)
    return md


def main(argv: list[str] | None = None) -> int:
    opts, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    if opts.check_fused:
        result = check_fused()
        print(json.dumps(result))
        return 0 if result["ok"] else 1
    if opts.report:
        print(report(opts.report))
        return 0
    return run_variant(opts, extra)


if __name__ == "__main__":
    sys.exit(main())
