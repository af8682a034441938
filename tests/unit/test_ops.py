"""Which DeepSpeed ops a resolved config makes the worker build (raytrain.ops.required_ops)."""

import pytest

from raytrain.ops import required_ops


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
    assert required_ops(ds_config) == ops


def test_native_pinning_needs_its_op(monkeypatch):
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    assert required_ops(zero()) == ["PinMemoryBuilder"]
