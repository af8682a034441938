"""What decides a universal conversion (raytrain.checkpoint.reshard): the world size that wrote a
checkpoint, where its universal copy lives, and the driver's refusal of a checkpoint whose data
shards this run cannot continue. The conversion itself, on real shards loaded by 3 ranks:
test_universal.py; inside a real elastic run: tests/integration/test_elastic.py."""

import dataclasses
import json
import re

import pytest
from ray.train import Checkpoint

from raytrain.checkpoint import reshard
from raytrain.config import ConfigError, load_config
from raytrain.driver.run import check_resume
from raytrain.planning.resolve import resolve_run, shape_from_config


def checkpoint(tmp_path, world, num_shards, group_size=None, model=None):
    path = tmp_path / "old" / "checkpoint_step_00000004"
    path.mkdir(parents=True)
    model = model or dataclasses.asdict(resolved().model)  # the default model's facts, as a run records them
    spec = {"cluster": {"num_workers": world}, "config": {"data": {"num_shards": num_shards}}, "model": model}
    meta = {"step": 4, "spec": spec} | ({"world_size": group_size} if group_size else {})
    (path / "raytrain.json").write_text(json.dumps(meta))
    return str(path)


def test_written_by_reads_the_groups_world_size_and_the_shards():
    spec = {"cluster": {"num_workers": 3}, "config": {"data": {"num_shards": None}}}
    assert reshard.written_by({"spec": spec}) == (3, 3)  # a checkpoint from before elastic runs
    spec = {"cluster": {"num_workers": 3, "min_workers": 2}, "config": {"data": {"num_shards": 6}}}
    assert reshard.written_by({"world_size": 2, "spec": spec}) == (2, 6)  # an elastic run's group of 2


def test_the_universal_copy_lives_in_the_run_keyed_by_the_checkpoints_path_and_contents():
    meta = {"step": 6, "history": [{"step": 6, "step_time_s": 0.5}]}
    copy = reshard.universal_uri("/s/run", "/s/other/checkpoint_step_00000006/", meta)
    assert copy.startswith("/s/run/universal/checkpoint_step_00000006-")
    assert reshard.universal_uri("/s/run/", "/s/other/checkpoint_step_00000006", dict(meta)) == copy  # every rank alike
    # another run's checkpoint of the same step, or this one rewritten in place: another copy, never this one
    assert reshard.universal_uri("/s/run", "/s/third/checkpoint_step_00000006", meta) != copy
    assert reshard.universal_uri("/s/run", "/s/other/checkpoint_step_00000006", {**meta, "history": []}) != copy
    assert reshard.universal_uri("s3://b/run/", "b/run/checkpoint_step_00000012", meta).startswith(
        "s3://b/run/universal/checkpoint_step_00000012-")
    # the digest's length is part of the key: another would miss the copies earlier sessions of the run left
    assert re.fullmatch(r"/s/run/universal/checkpoint_step_00000006-[0-9a-f]{12}", copy)


def test_a_conversion_is_done_once_its_raytrain_json_is_stored_and_the_workers_wait_for_nothing_more(tmp_path):
    copy = tmp_path / "universal" / "checkpoint_step_00000006-0123456789ab"
    (copy / "step_00000006_universal").mkdir(parents=True)
    assert not reshard.is_complete(str(copy))  # a conversion cut short: redone by the next group
    (copy / "raytrain.json").write_text("{}")
    assert reshard.is_complete(str(copy))
    reshard.wait_until_complete(str(copy), poll_s=0.01)  # returns at once (a mistaken loop hangs to the timeout)


def test_pruning_removes_the_runs_other_universal_copies_only(tmp_path):
    run = tmp_path / "run"
    reshard.prune(str(run), keep=str(run / "universal" / "c-1"))  # a run with no universal copy yet: nothing to do
    for name in ("checkpoint_step_00000002-aaa", "checkpoint_step_00000004-bbb", "checkpoint_step_00000004-ccc"):
        (run / "universal" / name).mkdir(parents=True)
    (run / "universal" / "notes.txt").write_text("not a copy")
    (run / "checkpoint_step_00000004").mkdir()
    reshard.prune(str(run) + "/", keep=str(run / "universal" / "checkpoint_step_00000004-bbb") + "/")
    assert sorted(p.name for p in (run / "universal").iterdir()) == ["checkpoint_step_00000004-bbb", "notes.txt"]
    assert (run / "checkpoint_step_00000004").is_dir()  # the checkpoints themselves are not its business


def resolved(*overrides):
    cfg = load_config(None, list(overrides))
    return resolve_run(cfg, shape_from_config(cfg))


def test_another_world_size_with_the_same_shards_is_left_to_the_workers(tmp_path):
    old = Checkpoint(checkpoint(tmp_path, world=2, num_shards=6))
    notes = check_resume(old, resolved("scaling.num_workers=3", "data.num_shards=6",
                                       "training.micro_batch_size_per_gpu=2"))
    assert len(notes) == 1 and notes[0].startswith("resuming step 4 on 3 workers (written by 2): the workers convert it")
    # same size: loaded as written, nothing to say
    assert check_resume(old, resolved("scaling.num_workers=2", "data.num_shards=6",
                                      "training.micro_batch_size_per_gpu=3")) == []


def test_a_checkpoint_of_another_model_is_refused_naming_both_shapes(tmp_path):
    other = dataclasses.asdict(resolved("model.config={num_hidden_layers: 5, hidden_size: 64}").model)
    old = Checkpoint(checkpoint(tmp_path, world=2, num_shards=None, model=other))
    with pytest.raises(ConfigError, match=r"holds another model \(hidden_size=64, num_hidden_layers=5, "
                                          r"num_parameters=\d+, head_dim=16\) than this run's \(hidden_size=128, "):
        check_resume(old, resolved("scaling.num_workers=2"))
    heads = dataclasses.asdict(resolved("model.config={num_attention_heads: 8, head_dim: 16}").model)
    with pytest.raises(ConfigError, match=r"another model \(.*num_attention_heads=8, head_dim=16\) than this run's "
                                          r"\(.*num_attention_heads=4, head_dim=32\)"):
        check_resume(Checkpoint(checkpoint(tmp_path / "h", world=2, num_shards=None, model=heads)),
                     resolved("scaling.num_workers=2"))


def test_resuming_a_checkpoint_at_or_past_max_steps_is_refused_with_the_steps_to_set(tmp_path):
    old = Checkpoint(checkpoint(tmp_path, world=2, num_shards=None))
    with pytest.raises(ConfigError, match=r"checkpoint.resume_from=/r/c is at step 4 >= training.max_steps=4: nothing "
                                          r"to train; .* \(training.max_steps=8 trains 4 more\)"):
        check_resume(old, resolved("scaling.num_workers=2", "training.max_steps=4", "checkpoint.resume_from=/r/c"))
    check_resume(old, resolved("scaling.num_workers=2", "training.max_steps=5"))  # one step to train
    # the run's own checkpoint at max_steps is a finished run (the driver wraps it up), not a mistake
    check_resume(old, resolved("scaling.num_workers=2", "training.max_steps=4"), own_run=True)


def test_another_world_without_shards_for_it_is_refused_on_the_driver(tmp_path):
    old = Checkpoint(checkpoint(tmp_path, world=2, num_shards=None))
    with pytest.raises(ConfigError, match=r"written by 2 workers with data.num_shards=None \(2 data shards\).*3 workers"):
        check_resume(old, resolved("scaling.num_workers=3"))
    elastic = Checkpoint(checkpoint(tmp_path / "e", world=3, num_shards=6, group_size=2))
    with pytest.raises(ConfigError, match=r"written by 2 workers with data.num_shards=6 \(6 data shards\).*12 shards"):
        check_resume(elastic, resolved("scaling.num_workers=[2, 4]", "data.num_shards=12",
                                       "training.micro_batch_size_per_gpu=1", "deepspeed.train_batch_size=12"))
