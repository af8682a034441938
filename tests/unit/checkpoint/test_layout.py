"""The run directory and a checkpoint's files (raytrain.checkpoint.layout), on local storage."""

import json

import pytest

from raytrain.checkpoint import layout
from raytrain.config import ConfigError


def test_names_of_a_run_and_its_checkpoints():
    assert layout.run_uri("s3://bucket/runs/", "r1") == "s3://bucket/runs/r1"
    assert layout.tag_for(80) == "step_00000080" and layout.checkpoint_dir_name(80) == "checkpoint_step_00000080"


def test_only_a_directory_deepspeed_can_load_counts_as_a_checkpoint_naming_the_key(tmp_path):
    def refused(why):
        with pytest.raises(ConfigError, match=rf"checkpoint.resume_from=.* (is not a raytrain checkpoint \()?{why}"):
            layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")

    refused("no raytrain.json")
    (tmp_path / "raytrain.json").write_text(json.dumps({"step": 1, "spec": {"model": {}, "config": {"data": {}}}}))
    (tmp_path / "latest_universal").write_text("step_00000001_universal")  # a universal copy (reshard): not one
    (tmp_path / "step_00000001_universal").mkdir()
    refused("it has raytrain.json but no DeepSpeed 'latest' file")
    (tmp_path / "latest").write_text("step_00000001")
    refused("its DeepSpeed 'latest' file names tag 'step_00000001', which is not in it")
    (tmp_path / "step_00000001").mkdir()
    refused("is incomplete: raytrain.json says 1 worker wrote it, and its DeepSpeed tag step_00000001/ has no "
            "zero_pp_rank_0_mp_rank_00_model_states.pt and 1 more")  # a save cut short: DeepSpeed could not load it
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tmp_path / "step_00000001" / name).write_bytes(b"")
    layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")
    layout.check_is_checkpoint(f"file://{tmp_path}/", "checkpoint.resume_from")


def test_a_run_without_ray_trains_bookkeeping_has_no_latest_checkpoint(tmp_path):
    assert layout.latest_checkpoint(str(tmp_path / "never-started")) is None
    (tmp_path / "started" / "tensorboard").mkdir(parents=True)  # made before the first checkpoint
    assert layout.latest_checkpoint(str(tmp_path / "started")) is None


@pytest.mark.parametrize("meta, lacks", [
    ({}, "step (an integer), spec.model, spec.config.data"),
    ({"step": "4", "spec": {"model": {}, "config": {"data": {}}}}, "step (an integer)"),
    ({"step": 4, "spec": {"config": {"data": None}}}, "spec.model, spec.config.data"),
    ({"step": 4, "spec": []}, "spec.model, spec.config.data"),
])
def test_a_raytrain_json_without_what_the_driver_reads_is_one_line_naming_the_keys(tmp_path, meta, lacks):
    # was: check_resume's KeyError 'spec' traceback (and the export's), exit 1
    (tmp_path / "raytrain.json").write_text(json.dumps(meta))
    (tmp_path / "latest").write_text("step_00000004")
    (tmp_path / "step_00000004").mkdir()
    with pytest.raises(ConfigError) as e:
        layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")
    assert str(e.value) == (f"{tmp_path}/raytrain.json lacks {lacks}, which raytrain writes into every checkpoint's "
                            f"record (the file was edited, or written by another program): choose another checkpoint "
                            f"(an earlier checkpoint_step_* of the run), or for a run's own latest checkpoint pass "
                            f"--fresh to start over")
