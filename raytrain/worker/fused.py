"""Fused Llama decoder layers (`model.fused_layers`): q/k/v as one GEMM, gate/up as one GEMM, the
residual adds fused into the RMSNorm and into down_proj's GEMM, without renaming a parameter.

Why: at the shipped 1.1B setting on an H200 the step is the model's own compute, and much of its
non-GEMM time is memory-bound work on activation-sized tensors: the residual adds, autograd summing the
input gradients of q, k, v (and gate, up), which all read the same normed hidden state, and Liger's
RMSNorm backward, which runs one program per SM and is latency-bound at ~1/3 of the bandwidth
(docs/benchmarks.md, "Where the shipped 1.1B step's GPU time goes" and "fused decoder layers").
Measured: +3.1% tokens/s at 1.1B (62.0% against 60.1% MFU in one call), 0.1 GiB more GPU peak.

How, without changing what users and checkpoints see: the modules keep transformers' q_proj, k_proj,
v_proj, gate_proj, up_proj, down_proj and both norms with their weights; only `forward` changes (the
instances' classes are swapped for subclasses, as the fused loss head does in kernels.py). The forward
concatenates the weights (a copy of ~10 MB and ~46 MB per layer at 1.1B, made again in the backward
instead of being kept), so pretrained loading, the HF export, checkpoints and resharding are untouched.
Under ZeRO-3 the attention module and the decoder layer gather their children's weights
(`deepspeed.zero.register_external_parameter`): the children's forwards, whose hooks would, never run.
Layers with biases or another norm, a KV cache (generation) and torch.autocast take transformers' own
forward.

GPU: Liger's kernels where liger-kernel is installed (RoPE in place on the fused q/k columns, SiLU-mul
on the gate|up buffer, RMSNorm and fused add+RMSNorm, their backward launched with more programs).
CPU, or without Liger: the same math with torch ops (the path the CPU tests run under real ZeRO-3).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

_CLASSES: dict[str, type] = {}
PATHS: dict[str, str] = {}  # which implementation each fused piece used, for the benchmark's record


class CatLinear(torch.autograd.Function):
    """x @ cat(weights).T: one GEMM for projections that read the same input. The backward makes one
    input gradient and one weight gradient, returned per weight as row slices (contiguous views)."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)  # the parameters themselves: the concatenation is not kept
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ torch.cat(weights)).view(*dy.shape[:-1], x.shape[-1])
        dw = dy2.t() @ x.reshape(-1, x.shape[-1])
        return (dx, *dw.split([w.shape[0] for w in weights]))


@functools.cache
def _liger_rope_kernel():
    """Liger's RoPE Triton kernel, if its argument list is the one this code passes (liger-kernel 0.8.5)."""
    try:
        from liger_kernel.ops.rope import _triton_rope
    except ImportError:
        return None
    names = list(getattr(_triton_rope, "arg_names", []))
    want = ["q_ptr", "q_row_stride", "k_ptr", "k_row_stride", "cos", "cos_row_stride", "sin", "sin_row_stride",
            "sl", "bs", "cos_bs", "n_qh", "n_kh", "hd", "pad_n_qh", "pad_n_kh", "pad_hd", "pad_rd", "rd"]
    return _triton_rope if names[:len(want)] == want else None


def rope_inplace(buf, cos, sin, n_q: int, n_kv: int, head_dim: int, backward: bool) -> None:
    """Rotate the q and k columns of buf (batch, seq, (n_q + 2 n_kv) * head_dim), contiguous, in place
    (backward: the inverse rotation, for gradients). Liger's kernel on GPU, torch ops otherwise."""
    b, s, _ = buf.shape
    if cos.ndim == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    kernel = _liger_rope_kernel() if buf.is_cuda else None
    if kernel is not None:
        import triton

        cos, sin = cos.contiguous(), sin.contiguous()
        heads = buf.view(b, s, n_q + 2 * n_kv, head_dim)
        rd = min(cos.shape[-1], head_dim)
        pad_q, pad_k = triton.next_power_of_2(n_q), triton.next_power_of_2(n_kv)
        kernel[(b * s,)](heads, buf.stride(1), heads[:, :, n_q:], buf.stride(1), cos, cos.stride(-2), sin,
                         sin.stride(-2), s, b, cos.shape[0], n_q, n_kv, head_dim, pad_q, pad_k,
                         triton.next_power_of_2(head_dim), triton.next_power_of_2(rd), rd,
                         BLOCK_SIZE=max(pad_q, pad_k), BACKWARD_PASS=backward)
        PATHS["rope"] = "liger _triton_rope in place on the fused q/k columns"
        return
    x = buf.view(b, s, n_q + 2 * n_kv, head_dim)[:, :, :n_q + n_kv]  # q heads then k heads, adjacent
    c, sn = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    half = head_dim // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # transformers' rotate_half
    x.copy_(x * c - rot * sn if backward else x * c + rot * sn)
    PATHS.setdefault("rope", "torch ops")


class QKVRope(torch.autograd.Function):
    """qkv (batch, seq, (n_q + 2 n_kv) d) -> q, k (rotated in place), v as (batch, heads, seq, d) views.
    Backward: one cat of dq, dk, dv, then the inverse rotation in place on its q/k columns."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q, n_kv, head_dim):
        qkv = qkv.contiguous()
        # In place on the projection's fresh output, which nothing else holds (CatLinear keeps its
        # inputs, not its output): no copy of the (batch, seq, heads * d) buffer.
        rope_inplace(qkv, cos, sin, n_q, n_kv, head_dim, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.dims = (n_q, n_kv, head_dim)
        b, s, _ = qkv.shape
        heads = qkv.view(b, s, n_q + 2 * n_kv, head_dim)
        return (heads[:, :, :n_q].transpose(1, 2), heads[:, :, n_q:n_q + n_kv].transpose(1, 2),
                heads[:, :, n_q + n_kv:].transpose(1, 2))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        n_q, n_kv, head_dim = ctx.dims
        ref = next(t for t in (dq, dk, dv) if t is not None)
        b, s = ref.shape[0], ref.shape[2]
        parts = [t.transpose(1, 2) if t is not None else ref.new_zeros(b, s, n, head_dim)
                 for t, n in ((dq, n_q), (dk, n_kv), (dv, n_kv))]
        g = torch.cat(parts, dim=2).view(b, s, -1)  # (b, s, heads * d), contiguous: one copy
        rope_inplace(g, cos, sin, n_q, n_kv, head_dim, backward=True)
        return g, None, None, None, None, None


@functools.cache
def _liger_gate_up_silu_mul():
    try:
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except ImportError:
        return None
    return LigerFusedGateUpSiLUMulFunction


def _silu_mul_fused(y):
    """silu(gate) * up for y = gate|up on the last dim."""
    function = _liger_gate_up_silu_mul() if y.is_cuda else None
    if function is not None:
        PATHS["silu_mul"] = "liger LigerFusedGateUpSiLUMulFunction on the gate|up buffer"
        shape = y.shape
        return function.apply(y.view(-1, shape[-1]), False).view(*shape[:-1], -1)
    PATHS.setdefault("silu_mul", "torch silu(gate) * up")
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


# Liger's RMSNorm backward kernels walk the rows in one program per SM (132 on an H200, 8 warps each):
# at 49,152 rows x 2,048 that is latency-bound, ~3x under the memory bandwidth (0.45-0.63 ms a call
# against ~0.17 for the bytes moved). raytrain launches the same kernels with this many programs per SM
# (more warps in flight); each program writes one fp32 row of partial weight gradients (4 x 132 x
# hidden x 4 B: 4.3 MB at 1.1B), summed afterwards as Liger does.
NORM_BWD_PROGRAMS_PER_SM = 4
_NORM_KERNEL_ARGS = {
    "_rms_norm_backward_kernel": ["dY_ptr", "dY_row_stride", "dX_ptr", "dX_row_stride", "X_ptr", "X_row_stride",
                                  "X_dtype", "W_ptr", "W_row_stride", "RSTD_ptr", "RSTD_row_stride", "dW_ptr",
                                  "dW_row_stride", "n_rows", "n_cols", "offset", "rows_per_program", "casting_mode",
                                  "elementwise_affine", "BLOCK_SIZE", "COMPUTE_DW"],
    "_fused_add_rms_norm_backward_kernel": ["dY_ptr", "dY_row_stride", "dS_out_ptr", "dS_out_row_stride", "dX_ptr",
                                            "dX_row_stride", "X_ptr", "X_row_stride", "X_dtype", "W_ptr",
                                            "W_row_stride", "RSTD_ptr", "RSTD_row_stride", "dW_ptr", "dW_row_stride",
                                            "n_rows", "n_cols", "offset", "rows_per_program", "casting_mode",
                                            "BLOCK_SIZE", "has_dS_out", "COMPUTE_DW"]}


@functools.cache
def _liger_norm() -> dict[str, Any]:
    """Liger's RMSNorm and fused add+RMSNorm forward functions and backward kernels, if liger-kernel is
    installed and the kernels take the arguments this module passes (liger-kernel 0.8.5); else {}."""
    try:
        from liger_kernel.ops import fused_add_rms_norm as fa
        from liger_kernel.ops import rms_norm as rn
        from liger_kernel.ops.utils import torch_to_triton_dtype
    except ImportError:
        return {}
    kernels = {"_rms_norm_backward_kernel": rn._rms_norm_backward_kernel,
               "_fused_add_rms_norm_backward_kernel": fa._fused_add_rms_norm_backward_kernel}
    if not all(list(getattr(k, "arg_names", []))[:len(_NORM_KERNEL_ARGS[n])] == _NORM_KERNEL_ARGS[n]
               for n, k in kernels.items()):
        return {}
    return dict(rms_forward=rn.rms_norm_forward, add_forward=fa.fused_add_rms_norm_forward,
                dtype=torch_to_triton_dtype, **kernels)


def _norm_backward(lib, dY, dS_out, X, W, RSTD, block: int, warps: int, casting_mode: int, stages=None):
    """dX (and dW) of RMSNorm (dS_out None: dX written over dY, as LigerRMSNorm does) or of the fused
    add+RMSNorm (dX = the sum's gradient, also the residual's), on Liger's kernels with more programs."""
    shape = dY.shape
    n_cols = shape[-1]
    dY = dY.contiguous().view(-1, n_cols)
    n_rows = dY.shape[0]
    sms = torch.cuda.get_device_properties(dY.device).multi_processor_count
    per = -(-n_rows // min(n_rows, sms * NORM_BWD_PROGRAMS_PER_SM))
    programs = -(-n_rows // per)
    dW = torch.empty((programs, n_cols), dtype=torch.float32, device=W.device)
    with torch.cuda.device(dY.device):
        if dS_out is None:
            dX = dY
            lib["_rms_norm_backward_kernel"][(programs,)](
                dY, dY.stride(0), dX, dX.stride(0), X, X.stride(0), lib["dtype"][X.dtype], W, W.stride(0), RSTD,
                RSTD.stride(0), dW, dW.stride(0), n_rows, n_cols, 0.0, per, casting_mode, elementwise_affine=True,
                BLOCK_SIZE=block, COMPUTE_DW=True, num_warps=warps)
        else:
            dS_out = dS_out.contiguous().view(-1, n_cols)
            dX = torch.empty_like(dY)
            lib["_fused_add_rms_norm_backward_kernel"][(programs,)](
                dY, dY.stride(0), dS_out, dS_out.stride(0), dX, dX.stride(0), X, X.stride(0), lib["dtype"][X.dtype],
                W, W.stride(0), RSTD, RSTD.stride(0), dW, dW.stride(0), n_rows, n_cols, 0.0, per, casting_mode,
                BLOCK_SIZE=block, has_dS_out=True, COMPUTE_DW=True, num_warps=warps, num_stages=stages)
    return dX.view(*shape), dW.sum(dim=0).to(W.dtype)


class RMSNorm(torch.autograd.Function):
    """Liger's RMSNorm ("llama" casting) forward; the backward on its kernel with more programs."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        lib = _liger_norm()
        y, x2, rstd, block, warps, mode = lib["rms_forward"](x.contiguous(), weight, eps, 0.0, "llama", None)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.meta = (block, warps, mode)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _norm_backward(_liger_norm(), dy, None, x, weight, rstd, *ctx.meta)
        return dx, dw, None


class AddRMSNorm(torch.autograd.Function):
    """Liger's fused residual add + RMSNorm forward -> (normed, sum); the backward on its kernel with
    more programs. The sum's gradient is both inputs' gradient."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        lib = _liger_norm()
        y, s, rstd, block, warps, stages, mode = lib["add_forward"](x.contiguous(), residual.contiguous(), weight,
                                                                    eps, 0.0, "llama")
        ctx.save_for_backward(s.view(-1, s.shape[-1]), weight, rstd)
        ctx.meta = (block, warps, mode, stages)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = _norm_backward(_liger_norm(), dy, ds, s, weight, rstd, *ctx.meta)
        return dx, dx, dw, None


def _rms_norm(norm, x):
    """norm(x) for the layer's RMSNorm module: Liger's kernels with the faster backward on a GPU, else the
    module's own forward (transformers' LlamaRMSNorm, or LigerRMSNorm)."""
    if x.is_cuda and _liger_norm():
        PATHS["norm"] = f"liger rms_norm_forward, backward kernel at {NORM_BWD_PROGRAMS_PER_SM} programs per SM"
        return RMSNorm.apply(x, norm.weight, _eps(norm))
    PATHS.setdefault("norm", "the norm module's forward")
    return norm(x)


def _add_rms_norm(norm, x, residual):
    """(norm(x + residual), x + residual), as transformers' layer computes them (the sum in the
    activations' dtype): one Liger kernel each way on a GPU, else the add and the module's forward."""
    if x.is_cuda and _liger_norm():
        PATHS["add_norm"] = (f"liger fused_add_rms_norm_forward, backward kernel at {NORM_BWD_PROGRAMS_PER_SM} "
                             f"programs per SM")
        return AddRMSNorm.apply(x, residual, norm.weight, _eps(norm))
    PATHS.setdefault("add_norm", "add, then the norm module's forward")
    s = residual + x
    return _rms_norm(norm, s), s


def _classes():
    if _CLASSES:
        return _CLASSES
    from transformers.models.llama import modeling_llama as ml

    base_attention, base_layer = ml.LlamaAttention, ml.LlamaDecoderLayer

    class FusedLlamaAttention(base_attention):
        """LlamaAttention whose q/k/v projections run as one GEMM (same parameters)."""

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            if _unfused(hidden_states, kwargs):
                return super().forward(hidden_states, position_embeddings=position_embeddings,
                                       attention_mask=attention_mask, **kwargs)
            kwargs.pop("cache", None)
            kwargs.pop("past_key_values", None)
            input_shape = hidden_states.shape[:-1]
            n_q, n_kv = self.config.num_attention_heads, self.config.num_key_value_heads
            qkv = _gemm(self)(hidden_states, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
            cos, sin = position_embeddings
            q, k, v = QKVRope.apply(qkv, cos, sin, n_q, n_kv, self.head_dim)
            return attend_and_project(self, q, k, v, attention_mask, input_shape, **kwargs)

    class FusedLlamaDecoderLayer(base_layer):
        """LlamaDecoderLayer with the attention's residual add fused into post_attention_layernorm, and
        gate/up as one GEMM feeding the SiLU-mul (same parameters)."""

        FUSED_LAYER = True  # what raytrain.worker.fp8.enable looks for (it does not import this module)

        def forward(self, hidden_states, *args, **kwargs):
            if args or _unfused(hidden_states, kwargs):
                return super().forward(hidden_states, *args, **kwargs)
            residual = hidden_states
            hidden_states = _rms_norm(self.input_layernorm, hidden_states)
            attn, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states, residual = _add_rms_norm(self.post_attention_layernorm, attn, residual)
            mlp = self.mlp
            y = _gemm(self)(hidden_states, mlp.gate_proj.weight, mlp.up_proj.weight)
            if getattr(self, "fp8", False):
                return _gemm(self)(_silu_mul_fused(y), mlp.down_proj.weight) + residual
            return _down_add(_silu_mul_fused(y), mlp.down_proj.weight, residual)

    _CLASSES.update(attention=FusedLlamaAttention, layer=FusedLlamaDecoderLayer)
    return _CLASSES


def _gemm(module):
    """x @ cat(weights).T: FP8 where raytrain.worker.fp8.enable marked the module (model.fp8), else one
    GEMM in the activations' dtype."""
    if getattr(module, "fp8", False):
        from raytrain.worker import fp8

        return fp8.linear
    return CatLinear.apply


def _down_add(x, weight, residual):
    """residual + x @ weight.T as one GEMM whose epilogue adds the residual (cuBLAS beta = 1): no separate
    add kernel over the activations. The sum is rounded once (fp32 accumulator + residual) where the
    unfused layer rounds the projection and then the sum: equal within bf16 rounding, not bit-identical."""
    out = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(residual.shape)


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def _unfused(hidden_states, kwargs) -> bool:
    """Take transformers' forward: with a KV cache (generation), or under torch.autocast (a DeepSpeed
    JSON's torch_autocast), where the residual stream stays fp32 while the projections run in bf16 and
    the fused kernels, written for one dtype, would round it."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return True
    return torch.is_autocast_enabled(hidden_states.device.type)


def attend_and_project(attn, q, k, v, attention_mask, input_shape, **kwargs):
    """The rest of transformers' LlamaAttention.forward after q, k, v: the configured attention
    implementation, then o_proj. Returns (output, attention weights)."""
    from transformers.models.llama import modeling_llama as ml

    functions = ml.ALL_ATTENTION_FUNCTIONS
    impl = attn.config._attn_implementation
    attention = (functions.get_interface(impl, ml.eager_attention_forward) if hasattr(functions, "get_interface")
                 else ml.eager_attention_forward if impl == "eager" else functions[impl])
    dropout = attn.attention_dropout if attn.training else 0.0
    out, weights = attention(attn, q, k, v, attention_mask, dropout=dropout, scaling=attn.scaling, **kwargs)
    return attn.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def fusable(layer) -> str | None:
    """Why this decoder layer cannot be fused (None: it can)."""
    attn, mlp = layer.self_attn, layer.mlp
    for name, mod in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj),
                      ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj), ("down_proj", mlp.down_proj)):
        if getattr(mod, "bias", None) is not None:
            return f"{name} has a bias"
    if getattr(layer.self_attn.config, "hidden_act", "silu") not in ("silu", "swish"):
        return "the MLP's activation is not SiLU"
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name)
        if getattr(norm, "weight", None) is None or getattr(norm, "offset", 0.0) or \
                getattr(norm, "casting_mode", "llama") != "llama":
            return f"{name} is not Llama's RMSNorm"
    return None


def fuse_llama_layers(model) -> dict[str, Any]:
    """Swap every Llama decoder layer of `model` (built, under zero.Init or not) to the fused forward,
    in place; returns {"fused": n, "skipped": {index: why}}. Call before deepspeed.initialize."""
    classes = _classes()
    from transformers.models.llama import modeling_llama as ml

    fused, skipped = 0, {}
    layers = [m for m in model.modules() if isinstance(m, ml.LlamaDecoderLayer)]
    for i, layer in enumerate(layers):
        why = fusable(layer)
        if why:
            skipped[i] = why
            continue
        attn, mlp = layer.self_attn, layer.mlp
        attn.__class__ = classes["attention"]
        layer.__class__ = classes["layer"]
        _external(attn, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
        _external(layer, (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
        fused += 1
    return {"fused": fused, "skipped": skipped}


def _external(module, params) -> None:
    """Under ZeRO-3 (parameters carry ds_id), `module`'s hooks gather and release `params` (used in
    its forward without their own modules' forwards running). DeepSpeed would also register them itself
    on first access (its ZeROOrderedDict getter), gathering each synchronously at that moment; declared
    up front they are fetched with the module from the first step on. No-op for an ordinary model."""
    if not any(hasattr(p, "ds_id") for p in params):
        return
    import deepspeed

    for p in params:
        deepspeed.zero.register_external_parameter(module, p)
