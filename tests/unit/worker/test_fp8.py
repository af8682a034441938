"""raytrain/worker/fp8.py: the fused layers' projections as FP8 GEMMs (the benchmark's --fp8-gemms). On CPU
torch's own _scaled_mm runs the same code (the casts eager, not compiled), so the operand layouts the
GPU kernel requires and the scales are checked here against the same quantized operands multiplied in
fp32; the GPU run is docs/benchmarks.md's ("FP8 GEMMs")."""

import copy

import pytest
import torch

from raytrain.worker import fp8
from raytrain.worker.fused import fuse_llama_layers
from tests.unit.worker.test_fused import raytrain_functions, tiny_llama


def _dequantized(t, dtype):
    q, _, inverse = fp8._cast_eager(t.detach().reshape(-1, t.shape[-1]), dtype, False)
    return q.float() * inverse


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-weights", "frozen-weights"])
def test_forward_and_both_gradients_are_the_quantized_operands_products(frozen):
    """frozen: weights without gradients (the input still gets its own)."""
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    w1, w2 = (torch.randn(n, 64, dtype=torch.bfloat16, requires_grad=not frozen) for n in (48, 16))
    y = fp8.linear(x, w1, w2)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = torch.cat([w1, w2])
    g = dy.reshape(-1, y.shape[-1])
    want = {"y": _dequantized(x, fp8.E4M3) @ _dequantized(w, fp8.E4M3).t(),
            "dx": _dequantized(g, fp8.E5M2) @ _dequantized(w, fp8.E4M3),
            "dw": _dequantized(g, fp8.E5M2).t() @ _dequantized(x, fp8.E4M3)}
    got = {"y": y.reshape(-1, 64), "dx": x.grad.reshape(-1, 64)}
    if frozen:
        assert w1.grad is None and w2.grad is None
        del want["dw"]
    else:
        got["dw"] = torch.cat([w1.grad, w2.grad])
        assert w1.grad.dtype == torch.bfloat16
    for name in want:  # equal up to the bf16 rounding of the output (2**-8 of the largest value)
        assert (got[name].float() - want[name]).abs().max() <= want[name].abs().max() * 2 ** -7, name
    assert y.dtype == x.grad.dtype == torch.bfloat16
    assert fp8.supported(x, (w1, w2)) and not fp8.supported(x[:, :7], (w1,))  # 14 rows: not a multiple of 16


@pytest.mark.parametrize("x_shape, rows, supported", [
    ((2, 7, 64), (48, 16), False),  # 14 rows
    ((2, 16, 24), (16,), False),    # k = 24
    ((2, 16, 16), (8,), False),     # n = 8
    ((2, 16, 16), (8, 8), True),    # one GEMM over the concatenation: n = 16
], ids=["rows", "k", "n", "n-of-the-concatenation"])
def test_shapes_scaled_mm_cannot_take_stay_in_the_activations_dtype(x_shape, rows, supported):
    """Every GEMM dimension a multiple of 16, or F.linear in x's dtype (exactly)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*x_shape, generator=g)
    weights = [torch.randn(n, x_shape[-1], generator=g) for n in rows]
    assert fp8.supported(x, weights) is supported
    y = fp8.linear(x, *weights)
    assert torch.equal(y, torch.nn.functional.linear(x, torch.cat(weights))) is not supported


def test_cpu_can_run_fp8_gemms():
    assert fp8.unsupported_here(torch.device("cpu")) is None


def test_a_fused_model_on_fp8_gemms_trains_like_the_bf16_one():
    """The loss within 2% and every gradient pointing the same way (cosine > 0.98) as transformers' layers:
    what tensorwise FP8 changes is rounding, not the model."""
    plain = tiny_llama()
    fast = copy.deepcopy(plain)
    fuse_llama_layers(fast)
    assert fp8.enable(fast) == 2
    assert type(fast.model.layers[0].self_attn.o_proj).__name__ == "Fp8LinearModule"
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses, functions = [], []
    for model in (plain, fast):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        functions.append(raytrain_functions(loss))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    assert functions[1] == {"Fp8LinearBackward": 8, "QKVRopeBackward": 2}  # per layer q|k|v, o, gate|up, down
    for (name, p), (_, q) in zip(plain.named_parameters(), fast.named_parameters()):
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.98, (name, cos.item())


@pytest.mark.parametrize("overrides, why", [
    (["model.fused_layers=false"], "model.fused_layers=False"),
    ([], "model.fused_layers=auto, which is on only for a Llama model with model.liger_kernel=all "
         "(this run: llama, liger_kernel=none)"),
])
def test_fp8_without_fused_layers_is_refused_on_the_driver(overrides, why):
    from raytrain.config import ConfigError, load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape

    cfg = load_config(None, ["model.fp8=true", "scaling.use_gpu=false", *overrides])
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg, ClusterShape(num_workers=1, use_gpu=False))
    assert str(e.value) == (f"model.fp8=true runs the fused decoder layers' projections in FP8, and this run has "
                            f"none ({why}): set model.fused_layers=true (Llama models), or model.fp8=false")
