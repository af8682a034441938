"""raytrain.network.backend: the TorchConfig raytrain hands Ray Train, and the per-worker hook that
applies each node's NCCL/Gloo environment before the process group exists."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist

from raytrain import compat
from raytrain.config import NETWORK_ENV_PREFIXES, ConfigError, NetworkConfig
from raytrain.network import backend
from raytrain.network.backend import RaytrainTorchConfig, apply_nccl_env, applied_env, torch_config


def test_torch_config_carries_the_validated_network_env():
    cfg = torch_config(NetworkConfig(env={"NCCL_IB_QPS_PER_CONNECTION": 4}), backend="nccl", timeout_s=60)
    assert isinstance(cfg, RaytrainTorchConfig)
    assert (cfg.backend, cfg.timeout_s, cfg.network.env) == ("nccl", 60, {"NCCL_IB_QPS_PER_CONNECTION": "4"})
    with pytest.raises(ConfigError, match=r"network.env.NCLL_DEBUG: only NCCL_\*, GLOO_\*, FI_\* variables"):
        NetworkConfig(env={"NCLL_DEBUG": "INFO"})
    # libfabric's variables are aws-ofi-nccl's settings on EFA.
    assert NetworkConfig(env={"FI_EFA_USE_HUGE_PAGE": 0}).env == {"FI_EFA_USE_HUGE_PAGE": "0"}
    with pytest.raises(ConfigError, match="network.env.NCCL_IB_DISABLE"):
        NetworkConfig(env={"NCCL_IB_DISABLE": True})


def test_torch_config_hands_ray_train_the_backend_that_applies_the_network():
    cfg = torch_config(NetworkConfig(env={"NCCL_DEBUG": "INFO"}, auto_configure=False), backend="gloo")
    assert issubclass(cfg.backend_cls, compat.TorchBackend) and cfg.backend_cls is not compat.TorchBackend
    d = cfg.to_dict()
    assert (d["backend"], d["timeout_s"]) == ("gloo", 1800)  # the driver's process-group timeout: 30 minutes
    assert (d["network_env"], d["network_auto_configure"]) == ({"NCCL_DEBUG": "INFO"}, False)


def test_applied_env_outside_a_worker_reads_the_environment(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "TRACE")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("RDMAV_FORK_SAFE", "1")
    env = applied_env()
    assert env["NCCL_DEBUG"] == "TRACE" and env["GLOO_SOCKET_IFNAME"] == "eth9" and env["FI_PROVIDER"] == "efa"
    assert "RDMAV_FORK_SAFE" not in env and all(k.startswith(NETWORK_ENV_PREFIXES) for k in env)


def test_apply_refuses_to_run_after_the_process_group_exists(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="after the torch process group was created"):
            apply_nccl_env(forced={"NCCL_DEBUG": "INFO"}, auto_configure=True)
        assert "NCCL_DEBUG" not in os.environ or os.environ["NCCL_DEBUG"] != "INFO"
    finally:
        dist.destroy_process_group()


def test_apply_sets_the_plan_prints_it_and_keeps_what_it_set(monkeypatch, capfd):
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.setattr(backend, "_applied", None)
    plan = apply_nccl_env(forced={"NCCL_DEBUG": "INFO"}, auto_configure=False)
    assert plan.env == {"NCCL_DEBUG": "INFO"} and os.environ["NCCL_DEBUG"] == "INFO"
    # Outside a Ray Train worker there is no local rank: the node's plan is printed all the same.
    out = capfd.readouterr().out
    assert "NCCL_DEBUG=INFO" in out.splitlines()[0] and "NCCL_DEBUG=INFO forced by network.env" in out
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # changed later: the process group was made with INFO
    assert applied_env()["NCCL_DEBUG"] == "INFO"


def test_outside_a_ray_train_worker_the_group_may_span_nodes():
    assert backend._spans_nodes() is True and backend._local_rank() is None
