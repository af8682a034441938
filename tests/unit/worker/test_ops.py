"""Which DeepSpeed ops a resolved config makes the worker build (raytrain.worker.ops.required_ops)."""

import pytest

from raytrain.deepspeed_config import DeepSpeedFacts
from raytrain.worker.ops import arch_list_deepspeed_can_parse, fix_cuda_arch_list, required_ops

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}


def ops_for(ds_config):
    return required_ops(DeepSpeedFacts.of({**BATCH, **ds_config}))


def zero(**kw):
    return {"zero_optimization": {"stage": 3, **kw}}


@pytest.mark.parametrize("ds_config, ops", [
    (zero(), []),  # raytrain's torch AdamW: nothing to compile
    (zero(offload_optimizer={"device": "cpu"}), ["CPUAdamBuilder"]),
    (zero(offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}, offload_param={"device": "nvme"}),
     ["CPUAdamBuilder", "AsyncIOBuilder"]),
    (zero(offload_param={"device": "cpu"}), []),
    ({**zero(), "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, ["FusedAdamBuilder"]),
    ({**zero(), "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, []),
    ({**zero(offload_optimizer={"device": "cpu"}), "optimizer": {"type": "Adagrad"}}, ["CPUAdagradBuilder"]),
    ({**zero(), "optimizer": {"type": "Lamb"}}, ["FusedLambBuilder"]),
    ({**zero(), "optimizer": {"type": "SGD"}}, []),
])
def test_required_ops(ds_config, ops):
    assert ops_for(ds_config) == ops


def test_native_pinning_needs_its_op(monkeypatch):
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    assert ops_for(zero()) == ["PinMemoryBuilder"]


def deepspeed_parses(arch_list, monkeypatch):
    """DeepSpeed's own CUDA op builder reads TORCH_CUDA_ARCH_LIST (JIT mode; runs without a GPU)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    builder.compute_capability_args()  # raises ValueError on what it cannot parse


@pytest.mark.parametrize("value, fixed", [
    ("9.0a", "9.0"),
    ("8.0 9.0a 10.0f+PTX", "8.0;9.0;10.0+PTX"),
    ("9.0;9.0a", "9.0"),
    ("8.0;9.0+PTX", None),
    ("9.0", None),
])
def test_arch_list_suffixes_are_dropped(value, fixed, monkeypatch):
    assert arch_list_deepspeed_can_parse(value) == fixed
    if fixed is not None:
        with pytest.raises(ValueError):
            deepspeed_parses(value, monkeypatch)  # DeepSpeed 0.19.8 on the raw value
    deepspeed_parses(fixed or value, monkeypatch)  # and on the fixed one


def test_fix_cuda_arch_list_says_what_it_changed(monkeypatch):
    lines = []
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    fix_cuda_arch_list(lines.append)
    import os

    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert len(lines) == 1 and "'9.0a' -> '9.0'" in lines[0]
    fix_cuda_arch_list(lines.append)  # nothing left to change: silent
    assert len(lines) == 1
