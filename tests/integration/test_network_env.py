"""raytrain's NCCL/Gloo environment reaches real Ray Train V2 workers before their process group exists.

Run: /work/venv/bin/python -m pytest tests/integration/test_network_env.py -x -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.constants import is_v2_enabled

from raytrain.config import NetworkConfig
from raytrain.network.backend import torch_config
from raytrain.network.nccl_env import compute_nccl_env

pytestmark = pytest.mark.integration

FORCED = {"NCCL_IB_HCA": "=mlx5_test:1", "NCCL_DEBUG": "raytrain-test"}


def test_workers_get_computed_and_forced_env_before_process_group(ray_cluster, tmp_path):
    assert is_v2_enabled()  # Ray 2.60's default trainer, whose BackendSetupCallback calls on_start

    # Nested, so Ray pickles it by value: workers cannot import this test module by name.
    def record_env(config: dict) -> None:
        import torch
        import torch.distributed as dist

        from raytrain.config import NETWORK_ENV_PREFIXES
        from raytrain.network.backend import _spans_nodes, applied_env

        ctx = ray.train.get_context()
        total = torch.ones(1)
        dist.all_reduce(total)  # the gloo group built after apply_nccl_env actually works
        record = {
            "applied": applied_env(),
            "now": {k: v for k, v in os.environ.items() if k.startswith(NETWORK_ENV_PREFIXES)},
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "all_reduce": total.item(),
            "spans_nodes": _spans_nodes(),  # what apply_nccl_env told compute_nccl_env (EFA's NCCL_NET)
        }
        Path(config["out_dir"], f"rank{ctx.get_world_rank()}.json").write_text(json.dumps(record))

    trainer = TorchTrainer(
        record_env,
        train_loop_config={"out_dir": str(tmp_path)},
        torch_config=torch_config(NetworkConfig(env=dict(FORCED)), backend="gloo", timeout_s=60),
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "runs"), name="network-env"),
    )
    trainer.fit()

    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Same machine as the workers, so the driver computes the same plan for this node.
    expected = compute_nccl_env(ray.util.get_node_ip_address(), forced=FORCED).env
    assert expected["NCCL_IB_HCA"] == "=mlx5_test:1"
    for record in records:
        assert (record["backend"], record["world_size"], record["all_reduce"]) == ("gloo", 2, 2.0)
        assert record["spans_nodes"] is False  # 2 workers, 1 node
        # applied_env() is the snapshot taken by apply_nccl_env, which refuses to run once a
        # process group exists: these values were in os.environ when init_process_group ran.
        for key, value in expected.items():
            assert record["applied"].get(key) == value, key
        assert record["now"] == record["applied"]
