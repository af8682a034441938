"""The run directory and a checkpoint's files (raytrain.checkpoint.layout), on local storage."""

import json

import pytest

from raytrain.checkpoint import layout
from raytrain.config import ConfigError


def test_names_of_a_run_and_its_checkpoints():
    assert layout.run_uri("s3://bucket/runs/", "r1") == "s3://bucket/runs/r1"
    assert layout.tag_for(80) == "step_00000080" and layout.checkpoint_dir_name(80) == "checkpoint_step_00000080"


def test_a_directory_without_raytrain_json_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.resume_from=.* is not a raytrain checkpoint \(no raytrain.json"):
        layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")
    (tmp_path / "raytrain.json").write_text(json.dumps({"step": 1}))
    layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")


def test_a_run_without_ray_trains_bookkeeping_has_no_latest_checkpoint(tmp_path):
    assert layout.latest_checkpoint(str(tmp_path / "never-started")) is None
    (tmp_path / "started" / "tensorboard").mkdir(parents=True)  # made before the first checkpoint
    assert layout.latest_checkpoint(str(tmp_path / "started")) is None
