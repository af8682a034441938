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

    with pytest.raises(ConfigError) as e:
        layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")
    assert str(e.value) == (f"checkpoint.resume_from={tmp_path} is not a raytrain checkpoint (no raytrain.json in it): "
                            f"give a checkpoint_step_* directory of a run")  # (a run's directory names its latest)
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face model directory: an export, a hub download
    with pytest.raises(ConfigError) as e:
        layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")
    assert str(e.value) == (f"checkpoint.resume_from={tmp_path} is not a raytrain checkpoint (no raytrain.json in it): "
                            f"it is a Hugging Face model directory (config.json): to train from its weights, set "
                            f"model.name_or_path={tmp_path} model.pretrained=true instead")
    with pytest.raises(ConfigError, match=r"\(no raytrain.json in it\): it is a Hugging Face model directory "
                                          r"\(config.json\) already$"):
        layout.check_is_checkpoint(str(tmp_path), "the checkpoint")  # the export tool's
    (tmp_path / "config.json").unlink()
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


def test_a_local_path_is_made_absolute_and_a_uri_keeps_its_filesystem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = layout.filesystem("runs/r1")  # a relative path: pyarrow's from_uri refuses it
    assert fs.type_name == "local" and path == str(tmp_path / "runs" / "r1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert layout.filesystem("~/runs")[1] == str(tmp_path / "home" / "runs")
    fs, path = layout.filesystem(f"file://{tmp_path}/runs")
    assert fs.type_name == "local" and path == f"{tmp_path}/runs"


def test_s3s_single_request_copy_limit_is_5_gib():
    # S3 CopyObject copies up to 5 GiB in one request: a larger limit fails Arrow's move of such an object
    assert layout.S3_COPY_LIMIT_BYTES == 5 * 2**30


@pytest.mark.parametrize("stage, wanted", [
    (3, ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    (2, ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),  # ZeRO 1-2: one model file, written by rank 0
    (1, ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    (0, ["mp_rank_00_model_states.pt"]),  # no ZeRO: no optimizer partitions
])
def test_the_shard_files_deepspeed_loads_follow_the_zero_stage_and_world_size(tmp_path, stage, wanted):
    meta = {"world_size": 2, "spec": {"deepspeed": {"zero_stage": stage}}}
    assert layout.missing_shards(str(tmp_path), meta) == wanted
    for name in wanted:  # bf16 and DeepSpeed's older optimizer spelling count too
        spelled = {"zero_pp_rank_0_mp_rank_00_optim_states.pt": "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                   "zero_pp_rank_1_mp_rank_00_optim_states.pt": "zero_pp_rank_1_mp_rank_00optim_states.pt"}
        (tmp_path / spelled.get(name, name)).write_bytes(b"")
    assert layout.missing_shards(str(tmp_path), meta) == []


def test_a_raytrain_json_holding_no_object_is_one_line(tmp_path):
    (tmp_path / "raytrain.json").write_text("[4]")
    (tmp_path / "latest").write_text("step_00000004")
    (tmp_path / "step_00000004").mkdir()
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/raytrain.json holds list, not raytrain's record of a "):
        layout.check_is_checkpoint(str(tmp_path), "checkpoint.resume_from")


def test_storage_that_cannot_be_reached_is_one_line_naming_the_key_and_the_fix(tmp_path):
    layout.check_reachable(str(tmp_path / "not-yet"), "checkpoint.storage_path")  # absent is fine: made later
    with pytest.raises(ConfigError, match=r"^checkpoint.storage_path=nosuch://b/runs: cannot reach it \(.+\): "
                                          r"check the URI, the driver's credentials for it, and this machine's "
                                          r"network$"):
        layout.check_reachable("nosuch://b/runs", "checkpoint.storage_path")
    with pytest.raises(ConfigError, match=r"^checkpoint.storage_path=nosuch://b/runs \(run 'r1'\): cannot reach it"):
        layout.latest_checkpoint("nosuch://b/runs/r1")
    with pytest.raises(ConfigError, match=r"^checkpoint.resume_from=nosuch://b/c: cannot read it \(.+\): check the "
                                          r"path or URI and its credentials$"):
        layout.check_is_checkpoint("nosuch://b/c", "checkpoint.resume_from")
    said = layout.unreachable("checkpoint.storage_path=gs://b/r", "gs://b/r", OSError("x" * 400 + "\nsecond line"))
    assert str(said) == (f"checkpoint.storage_path=gs://b/r: cannot reach it ({'x' * 300}...): check the URI, the "
                         f"driver's Google credentials (GOOGLE_APPLICATION_CREDENTIALS or workload identity), and this "
                         f"machine's network")
    assert "AWS_ACCESS_KEY_ID" in str(layout.unreachable("k=S3://b", "S3://b", OSError("x" * 300)))
    assert "(" + "x" * 300 + ")" in str(layout.unreachable("k=S3://b", "S3://b", OSError("x" * 300)))
    assert "(" + "x" * 300 + "...)" in str(layout.unreachable("k=S3://b", "S3://b", OSError("x" * 301)))
    assert "AZURE_CLIENT_ID" in str(layout.unreachable("k=abfss://c@a/r", "abfss://c@a/r", OSError()))


def test_a_checkpoints_shown_uri_has_the_scheme_ray_drops():
    # Ray's Checkpoint.path drops the scheme; messages name the checkpoint as the user would paste it
    import fsspec
    import pyarrow.fs
    from ray.train import Checkpoint  # a plain class: no Ray cluster is started

    def shown(fs, path="bucket/runs/r/checkpoint_step_00000004/"):
        return layout.shown_uri(Checkpoint(path, filesystem=fs))

    assert shown(pyarrow.fs.LocalFileSystem(), "/runs/r/c") == "/runs/r/c"
    assert shown(pyarrow.fs.S3FileSystem(region="us-east-1")) == "s3://bucket/runs/r/checkpoint_step_00000004"
    assert shown(pyarrow.fs.GcsFileSystem(anonymous=True)) == "gs://bucket/runs/r/checkpoint_step_00000004"
    # fsspec's filesystems behind pyarrow (adlfs' abfs, a test's local one): the first protocol
    assert shown(pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fsspec.filesystem("file"))), "/runs/c") == "/runs/c"
    assert shown(pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fsspec.filesystem("memory")))) == \
        "memory://bucket/runs/r/checkpoint_step_00000004"


def test_a_shard_file_cut_short_is_told_from_a_whole_one_and_a_remote_one_stops_the_run_in_the_worker(tmp_path):
    """torch.save writes a zip archive; one cut short (a save, copy or sync that stopped) has no end record, and
    torch.load fails on it in every worker at every restart. Files of another format are not judged."""
    import torch
    from ray.train import Checkpoint

    from raytrain.checkpoint import shards
    from tests.helpers import remote_local_filesystem

    tag = tmp_path / "ckpt" / "step_00000004"
    tag.mkdir(parents=True)
    for rank in (0, 1):
        torch.save({"state": torch.zeros(256)}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")  # not judged: empty
    torch.save({"x": 1}, tag / "zero_pp_rank_1_mp_rank_00_model_states.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "ckpt" / "latest").write_text("step_00000004")
    assert layout.cut_short_shards(str(tag)) == []
    cut = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 10)
    assert layout.cut_short_shards(str(tag)) == ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert layout.cut_short_shards(f"file://{tag}") == ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # on object storage the driver does not read every file: each rank checks its own download
    remote = Checkpoint(str(tmp_path / "ckpt"), filesystem=remote_local_filesystem([]))
    with shards._rank_files(remote, rank=0):
        pass  # rank 0's files are whole
    with pytest.raises(shards.SetupMistake) as e:  # no run's counter: stop_run raises the record
        with shards._rank_files(remote, rank=1):
            pass
    assert e.value.line() == (
        f"checkpoint {tmp_path / 'ckpt'}: its shard file step_00000004/zero_pp_rank_1_mp_rank_00_optim_states.pt is "
        f"cut short (a torch.save archive without its end: a save or copy that stopped; DeepSpeed cannot load it): put "
        f"the file back, or start from an earlier checkpoint_step_* directory of the run under a new name "
        f"(--resume-from PATH checkpoint.name=NEW_NAME), or pass --fresh to start over (the old run is kept under "
        f"another name)")
