"""What decides a universal conversion (raytrain.checkpoint.reshard): the world size that wrote a
checkpoint, where its universal copy lives, and the driver's refusal of a checkpoint whose data
shards this run cannot continue. The conversion itself, on real shards loaded by 3 ranks:
test_universal.py; inside a real elastic run: tests/integration/test_elastic.py."""

import json

import pytest
from ray.train import Checkpoint

from raytrain.checkpoint import reshard
from raytrain.config import ConfigError, load_config
from raytrain.driver.run import check_resume
from raytrain.planning.resolve import resolve_run, shape_from_config


def checkpoint(tmp_path, world, num_shards, group_size=None):
    path = tmp_path / "old" / "checkpoint_step_00000004"
    path.mkdir(parents=True)
    spec = {"cluster": {"num_workers": world}, "config": {"data": {"num_shards": num_shards}}}
    meta = {"step": 4, "spec": spec} | ({"world_size": group_size} if group_size else {})
    (path / "raytrain.json").write_text(json.dumps(meta))
    return str(path)


def test_written_by_reads_the_groups_world_size_and_the_shards():
    spec = {"cluster": {"num_workers": 3}, "config": {"data": {"num_shards": None}}}
    assert reshard.written_by({"spec": spec}) == (3, 3)  # a checkpoint from before elastic runs
    spec = {"cluster": {"num_workers": 3, "min_workers": 2}, "config": {"data": {"num_shards": 6}}}
    assert reshard.written_by({"world_size": 2, "spec": spec}) == (2, 6)  # an elastic run's group of 2


def test_the_universal_copy_lives_in_the_run_named_after_the_checkpoint():
    assert reshard.universal_uri("/s/run", "/s/other/checkpoint_step_00000006/") == \
        "/s/run/universal/checkpoint_step_00000006"
    assert reshard.universal_uri("s3://b/run/", "s3://b/run/checkpoint_step_00000012") == \
        "s3://b/run/universal/checkpoint_step_00000012"


def resolved(*overrides):
    cfg = load_config(None, list(overrides))
    return resolve_run(cfg, shape_from_config(cfg))


def test_another_world_size_with_the_same_shards_is_left_to_the_workers(tmp_path, capsys):
    old = Checkpoint(checkpoint(tmp_path, world=2, num_shards=6))
    check_resume(old, resolved("scaling.num_workers=3", "data.num_shards=6", "training.micro_batch_size_per_gpu=2"))
    assert "resuming step 4 on 3 workers (written by 2): the workers convert it" in capsys.readouterr().out
    check_resume(old, resolved("scaling.num_workers=2", "data.num_shards=6", "training.micro_batch_size_per_gpu=3"))
    assert capsys.readouterr().out == ""  # same size: loaded as written


def test_another_world_without_shards_for_it_is_refused_on_the_driver(tmp_path):
    old = Checkpoint(checkpoint(tmp_path, world=2, num_shards=None))
    with pytest.raises(ConfigError, match=r"written by 2 workers with data.num_shards=None \(2 data shards\).*3 workers"):
        check_resume(old, resolved("scaling.num_workers=3"))
    elastic = Checkpoint(checkpoint(tmp_path / "e", world=3, num_shards=6, group_size=2))
    with pytest.raises(ConfigError, match=r"written by 2 workers with data.num_shards=6 \(6 data shards\).*12 shards"):
        check_resume(elastic, resolved("scaling.num_workers=[2, 4]", "data.num_shards=12",
                                       "training.micro_batch_size_per_gpu=1", "deepspeed.train_batch_size=12"))
