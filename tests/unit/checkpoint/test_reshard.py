"""When the driver converts a checkpoint for another world size (raytrain.checkpoint.reshard.prepare),
decided from the checkpoint's raytrain.json. The conversion itself (DeepSpeed's ds_to_universal on
real shards, loaded re-partitioned by 3 workers) runs in tests/integration/test_fault_tolerance.py."""

import json

import pytest

from raytrain.checkpoint import reshard
from raytrain.config import ConfigError


def checkpoint(tmp_path, world, num_shards):
    path = tmp_path / "old" / "checkpoint_step_00000004"
    path.mkdir(parents=True)
    spec = {"cluster": {"num_workers": world}, "config": {"data": {"num_shards": num_shards}}}
    (path / "raytrain.json").write_text(json.dumps({"step": 4, "spec": spec}))
    return str(path)


def test_written_by_reads_world_size_and_shards():
    assert reshard.written_by({"spec": {"cluster": {"num_workers": 2}, "config": {"data": {"num_shards": None}}}}) == (2, 2)
    assert reshard.written_by({"spec": {"cluster": {"num_workers": 2}, "config": {"data": {"num_shards": 6}}}}) == (2, 6)


def test_nothing_to_convert_for_a_fresh_run_or_the_same_world(tmp_path):
    assert reshard.prepare(str(tmp_path / "new"), None, num_workers=3, num_shards=None) is None
    same = checkpoint(tmp_path, world=2, num_shards=6)
    assert reshard.prepare(str(tmp_path / "new"), same, num_workers=2, num_shards=6) is None


def test_another_world_without_shards_for_it_is_refused_before_converting(tmp_path):
    old = checkpoint(tmp_path, world=2, num_shards=None)
    with pytest.raises(ConfigError, match=r"written by 2 workers with data.num_shards=None \(2 data shards\).*3 workers"):
        reshard.prepare(str(tmp_path / "new"), old, num_workers=3, num_shards=None)
    assert not (tmp_path / "new").exists()  # nothing was written
