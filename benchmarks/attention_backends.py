"""Attention forward + backward at the shipped 1.1B step's shape, per backend: time and GPU energy per call.

Why energy: the shipped step runs at the GPU's power cap (docs/benchmarks.md, "runs at the GPU's power
cap"), so a kernel shortens the step only by the joules it saves, not by its speed alone. The NVML
energy counter is read through ctypes (no pynvml on the GPU machine).

Backends: cuDNN SDPA (what the shipped step runs, with GQA through enable_gqa, and with K/V repeated as
transformers does without it), torch's flash SDPA, and FlashAttention-4 (flash_attn.cute, CuTe DSL
kernels with SM90 forward and backward) when it imports.

    python benchmarks/attention_backends.py [--batch 24] [--seq 2048] [--seconds 5] > attn.jsonl
"""
import argparse
import ctypes
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class Energy:
    """The GPU's total energy counter (millijoules since the driver loaded)."""

    def __init__(self, index=0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0
        self.handle = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) == 0

    def joules(self):
        value = ctypes.c_ulonglong()
        assert self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)) == 0
        return value.value / 1000.0


def measure(step, energy, seconds):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    calls = max(5, int(seconds / max(time.perf_counter() - start, 1e-4)))
    torch.cuda.synchronize()
    e0, t0 = energy.joules(), time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), energy.joules()
    return {"calls": calls, "ms": (t1 - t0) / calls * 1e3, "joules": (e1 - e0) / calls,
            "watts": (e1 - e0) / (t1 - t0)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    b, s, h, hk, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    dev, dt = "cuda", torch.bfloat16
    # (B, S, H, D) as the projections produce them; SDPA takes the (B, H, S, D) view, as transformers does.
    q = torch.randn(b, s, h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, s, hk, d, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn(b, s, h, d, device=dev, dtype=dt)
    # Causal attention's matmul FLOPs, forward (QK^T and PV, half the square) + backward (2.5x forward).
    flops = 3.5 * 4 * b * s * s * h * d / 2
    energy = Energy(torch.cuda.current_device())

    def sdpa(backend, gqa):
        def run():
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            if not gqa:
                kt, vt = (x.repeat_interleave(h // hk, dim=1) for x in (kt, vt))
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
            out.transpose(1, 2).backward(grad)
            return out.transpose(1, 2)
        return run

    variants = {"cudnn_gqa": sdpa(SDPBackend.CUDNN_ATTENTION, True),
                "cudnn_repeat_kv": sdpa(SDPBackend.CUDNN_ATTENTION, False),
                "flash_sdpa_gqa": sdpa(SDPBackend.FLASH_ATTENTION, True)}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4():
            out = flash_attn_func(q, k, v, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)
            return out
        variants["fa4"] = fa4
    except Exception as err:  # noqa: BLE001 - the line says why the variant is missing
        print(json.dumps({"variant": "fa4", "error": f"{type(err).__name__}: {err}"[:2000]}), flush=True)

    reference = None
    for name, step in variants.items():
        try:
            compile_start = time.perf_counter()
            for x in (q, k, v):
                x.grad = None
            out = step()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - compile_start
            got = (out.detach().float(), *(x.grad.float() for x in (q, k, v)))
            if reference is None:
                reference = got
            err = max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(got, reference))
            row = measure(step, energy, args.seconds)
        except Exception as error:  # noqa: BLE001 - one variant's failure must not hide the others
            print(json.dumps({"variant": name, "error": f"{type(error).__name__}: {error}"[:2000]}), flush=True)
            continue
        row.update(variant=name, first_call_s=round(first_s, 1), max_rel_err_vs_first=err,
                   tflops=flops / row["ms"] * 1e-9, shape=[b, s, h, hk, d], gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
