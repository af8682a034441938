"""FP8 GEMMs for the fused Llama decoder layers (`model.fp8`).

Why: issue 14 asks for FP8 matmuls measured beside the shipped bf16 step, and that step is power-bound on
an H200 (docs/benchmarks.md, "runs at the GPU's power cap"): an FP8 GEMM does the same work in about half
the tensor-core energy. torchao's Float8Linear, eager (its casts as separate kernels), made 25% MFU against
58% (docs/benchmarks.md, mfu62); torchao expects torch.compile over the model, which fails with Liger under
ZeRO-3 (#8). Here only the casts are compiled: each is a pure function of one tensor (amax, scale, cast,
and the transposed copy the backward's GEMMs need), with no ZeRO-3 hook or Liger kernel in the graph, and
the GEMMs are torch._scaled_mm called eagerly on the tensors ZeRO-3 has gathered.

The recipe is torchao's "tensorwise" one: one dynamic scale per tensor and GEMM; e4m3 for activations and
weights, e5m2 for output gradients; fast accumulation in the forward GEMM only. The forward saves the fp8
copy of its input (transposed, as the weight-gradient GEMM reads it) instead of the bf16 input: half the
bytes. What it costs: per GEMM input one read for the amax, one for the cast and two fp8 writes, and the
same for each output gradient in the backward.

Every projection of a fused layer (q|k|v, o, gate|up, down) runs in FP8; lm_head stays in Liger's fused
loss (bf16). Shapes that torch._scaled_mm cannot take (a dimension not a multiple of 16) keep bf16.

Measured on one H200 against the same bf16 step in one call (docs/benchmarks.md, "FP8 GEMMs"): 1.1B at
micro-batch 24 x 4, 93,267 tokens/s against 77,167 (+20.9%) and 7.5 GiB less GPU memory; 7.24B at 15 x 2
with checkpointing, +35.7%. With the casts eager instead of compiled: 50,036 (-35%). The compile (about a
dozen small graphs) happens in the first step, ~9 s.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}


def _cast_eager(t: torch.Tensor, dtype: torch.dtype, transposed: bool):
    """(fp8 of 2-D t, its transpose contiguous if `transposed` else None, the dequantizing scale)."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = _MAX[dtype] / amax
    q = (t.float() * scale).clamp(-_MAX[dtype], _MAX[dtype]).to(dtype)
    return q, (q.t().contiguous() if transposed else None), scale.reciprocal()


@functools.cache
def _cast_compiled():
    # One graph per (shape, dtype, transposed): ~12 per model (4 GEMM inputs, 4 gradients, 4 weights);
    # torch's default recompile limit of 8 per function would leave the rest eager.
    import torch._dynamo.config as dynamo_config

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, key):
            setattr(dynamo_config, key, max(getattr(dynamo_config, key), 64))
    return torch.compile(_cast_eager, dynamic=False)


# RAYTRAIN_FP8_COMPILE=0: eager casts, to measure what compiling gives (gpu_x1.sh fp8). Read once: cast runs
# several times per GEMM.
_COMPILE_CASTS = os.environ.get("RAYTRAIN_FP8_COMPILE", "1") != "0"


def cast(t: torch.Tensor, dtype: torch.dtype, transposed: bool):
    """_cast_eager, compiled on a GPU unless RAYTRAIN_FP8_COMPILE=0."""
    compiled = t.is_cuda and _COMPILE_CASTS
    return (_cast_compiled() if compiled else _cast_eager)(t, dtype, transposed)


@functools.cache
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def unsupported_here(device: torch.device) -> str | None:
    """Why this worker's device cannot run FP8 GEMMs (None: it can). CPU can (torch's CPU _scaled_mm:
    the tests' path, not a fast one)."""
    if device.type == "cuda" and not _fp8_tensor_cores(device.index or 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"this GPU (compute capability {major}.{minor}) has no FP8 tensor cores (8.9+)"
    return None


def supported(x: torch.Tensor, weights) -> bool:
    """torch._scaled_mm's constraints: every GEMM dimension a multiple of 16, and FP8 tensor cores on a GPU."""
    if x.is_cuda and not _fp8_tensor_cores(x.device.index or 0):
        return False
    rows = x.numel() // x.shape[-1]
    return all(d % 16 == 0 for d in (rows, x.shape[-1], sum(w.shape[0] for w in weights)))


class Fp8Linear(torch.autograd.Function):
    """x @ cat(weights).T with FP8 operands (tensorwise scales), in the activations' dtype. Backward:
    dx = dy @ W and dW = dy.T @ x, both FP8; dW returned per weight as row slices."""

    @staticmethod
    def forward(ctx, x, *weights):
        w = torch.cat(weights) if len(weights) > 1 else weights[0]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xqt, xs = cast(x2, E4M3, True)
        wq, _, ws = cast(w, E4M3, False)
        # _scaled_mm takes A row-major and B column-major: W (n, k) row-major is W.T column-major
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(xqt, xs, *weights)  # the parameters themselves, as CatLinear
        ctx.x_dtype = x.dtype
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xqt, xs, *weights = ctx.saved_tensors
        w = torch.cat(weights) if len(weights) > 1 else weights[0]
        dy2 = dy.reshape(-1, dy.shape[-1])
        gq, gqt, gs = cast(dy2, E5M2, True)
        dx = None
        if ctx.needs_input_grad[0]:
            _, wqt, ws = cast(w, E4M3, True)  # W.T row-major (k, n): B = W column-major (n, k)
            dx = torch._scaled_mm(gq, wqt.t(), scale_a=gs, scale_b=ws, out_dtype=ctx.x_dtype)
            dx = dx.view(*dy.shape[:-1], w.shape[1])
        # dW (n, k) = dy.T (n, m) row-major @ x (m, k) column-major, i.e. the saved x.T row-major
        dw = torch._scaled_mm(gqt, xqt.t(), scale_a=gs, scale_b=xs, out_dtype=w.dtype)
        return (dx, *dw.split([p.shape[0] for p in weights]))


def linear(x, *weights):
    """x @ cat(weights).T in FP8 where supported, else in x's dtype."""
    if supported(x, weights):
        return Fp8Linear.apply(x, *weights)
    return F.linear(x, torch.cat(weights) if len(weights) > 1 else weights[0])


class Fp8LinearModule(torch.nn.Linear):
    """nn.Linear (no bias) whose forward is `linear` (the instance's class is swapped in place: same
    parameter, and ZeRO-3's hooks on the module gather it as before)."""

    def forward(self, x):
        return linear(x, self.weight)


def enable(model) -> int:
    """Put every fused decoder layer of `model` (raytrain.worker.fused) on FP8 GEMMs; returns how many."""
    n = 0
    for module in model.modules():
        if getattr(type(module), "FUSED_LAYER", False):
            module.fp8 = True
            module.self_attn.fp8 = True
            o_proj = module.self_attn.o_proj
            if o_proj.bias is None and type(o_proj) is torch.nn.Linear:
                o_proj.__class__ = Fp8LinearModule
            n += 1
    return n
