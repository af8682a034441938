"""The checks a run passes before Ray (raytrain.driver.checks), shared by --dry-run and real runs:
paths without creating anything, the config resolved before ray.init, the memory verdict; and the
driver's check that a local storage path is shared by the nodes (raytrain.driver.cluster), whose
decision is tested here without Ray (one machine, where it passes, runs in the integration tests)."""

import json
import os

import pytest

from raytrain import hardware
from raytrain.config import ConfigError, load_config
from raytrain.data.sources import inspect_sources
from raytrain.driver.checks import check_writable_dir, dry_run_target, resolve_before_ray
from raytrain.driver.cluster import check_storage_shared, probe_node, sees_file, storage_marker
from raytrain.main import main


def test_a_storage_path_is_checked_without_being_created(tmp_path):
    check_writable_dir(str(tmp_path), "checkpoint.storage_path")
    check_writable_dir(str(tmp_path / "a" / "b"), "checkpoint.storage_path")
    assert list(tmp_path.iterdir()) == []  # nothing created
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint.storage_path=.*f: it is a file"):
        check_writable_dir(str(tmp_path / "f"), "checkpoint.storage_path")
    with pytest.raises(ConfigError, match=r"checkpoint.storage_path=.*f/runs: .*f, on its path, is a file"):
        check_writable_dir(str(tmp_path / "f" / "runs"), "checkpoint.storage_path")
    check_writable_dir("s3://bucket/runs", "checkpoint.storage_path")  # a URI: checked by the run's first write


def test_the_config_is_resolved_before_ray_unless_only_the_cluster_knows_the_shape(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, ["training.max_steps=3"])
    resolved = resolve_before_ray(cfg, inspect_sources(cfg.data))
    assert resolved is not None and resolved.cluster.num_workers == 2  # a local cluster: this machine's shape
    joining = load_config(None, ["cluster.address=10.0.0.1:6379"])
    assert resolve_before_ray(joining, inspect_sources(joining.data)) is None  # its GPUs are the cluster's to tell
    stated = load_config(None, ["cluster.address=10.0.0.1:6379", "scaling.num_workers=16", "scaling.use_gpu=true"])
    assert resolve_before_ray(stated, inspect_sources(stated.data)).cluster.num_workers == 16


def test_a_dry_run_prints_the_planners_verdict_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "runs"
    rc = main(["--dry-run", f"checkpoint.storage_path={storage}", "--host-memory-gib", "64", "scaling.num_workers=2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["cluster"]["num_workers"] == 2  # stdout stays the JSON
    assert err.startswith("raytrain: memory: fits: this run needs ") and "the nodes have 64.0 GiB RAM" in err
    assert list(tmp_path.iterdir()) == []
    if not hardware.gpus(use_torch=False):  # a GPU run planned on a machine without GPUs, no sizes stated
        assert main(["--dry-run", f"checkpoint.storage_path={storage}", "scaling.use_gpu=true",
                     "scaling.num_workers=8"]) == 0
        assert "raytrain: memory: not checked: this machine has no GPU" in capsys.readouterr().err


def test_a_local_storage_path_some_node_cannot_see_is_refused_naming_the_nodes(tmp_path):
    storage = tmp_path / "runs"  # not there yet: the marker goes where the run will create it
    with storage_marker(str(storage)) as marker:
        assert marker is not None and os.path.dirname(marker) == str(tmp_path) and not storage.exists()
        assert probe_node(False, marker)[1] is True  # the probe's answer on a node that shares the path
        assert sees_file(str(tmp_path / "elsewhere" / os.path.basename(marker)), retry_after_s=0) is False
    assert os.listdir(tmp_path) == []  # the marker is removed, no directory created
    with storage_marker("s3://bucket/runs") as marker:
        assert marker is None  # object storage is every node's
    assert probe_node(False, None)[1] is None  # not asked: one machine
    check_storage_shared(str(storage), {"10.0.0.1": True, "10.0.0.2": None})  # None: did not answer, not judged
    with pytest.raises(ConfigError) as e:
        check_storage_shared("/home/u/raytrain_runs", {"10.0.0.1": True, "10.0.0.3": False, "10.0.0.2": False})
    assert str(e.value) == (
        "checkpoint.storage_path=/home/u/raytrain_runs is not shared: node(s) 10.0.0.2, 10.0.0.3 cannot see it "
        "(a directory on the head's disk): set checkpoint.storage_path to s3://..., gs://..., or a filesystem "
        "mounted at the same path on every node")


def test_gpus_per_node_plans_a_gpu_target():
    cfg, shape, target = dry_run_target(load_config(None, ["scaling.num_workers=16"]), gpu_memory_gib=None,
                                        host_memory_gib=None, gpus_per_node=8)
    assert cfg.scaling.use_gpu is True and shape.use_gpu and shape.gpus_per_node == 8 and target.gpus_per_node == 8
    with pytest.raises(ConfigError, match="--gpus-per-node plans a GPU cluster but scaling.use_gpu=false"):
        dry_run_target(load_config(None, ["scaling.use_gpu=false"]), gpu_memory_gib=None, host_memory_gib=None,
                       gpus_per_node=8)
