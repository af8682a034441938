"""What `python -m raytrain.tools.export` refuses before it writes anything (raytrain.checkpoint.export,
layout.check_is_checkpoint): a checkpoint missing a rank's shards, a URI pyarrow cannot open, and a
failed merge leaves no directory behind. The export of real checkpoints: test_export.py."""

import json
import os

import pytest

from raytrain.checkpoint.export import export
from raytrain.tools.export import main
from tests.unit.driver.test_resume import SHARDS, checkpoint, run_with_checkpoints


def test_an_incomplete_checkpoint_is_refused_in_one_line_before_out_dirs_parent_is_made(tmp_path, capsys):
    half = checkpoint(tmp_path / "runs" / "r1" / "checkpoint_step_00000008", 8, shards=SHARDS[1:])
    out = tmp_path / "new" / "hf"
    assert main([half, str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrain: error: the checkpoint={half} is incomplete: ") and (
        "has no zero_pp_rank_0_mp_rank_00_model_states.pt (a save cut short" in err[0]), err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("uri", ["az://container/runs/r1/checkpoint_step_00000008",
                                 "s3a://bucket/runs/r1/checkpoint_step_00000008"])
def test_a_uri_pyarrow_cannot_open_is_one_line(uri, tmp_path, capsys):
    assert main([uri, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrain: error: the checkpoint={uri}: cannot read it (") and (
        err[0].endswith("): check the path or URI and its credentials")), err


def test_a_failed_merge_removes_the_directories_it_made(tmp_path):
    # every shard file is there but empty (a disk that filled up): DeepSpeed's reader fails mid-export
    broken = checkpoint(tmp_path / "runs" / "r1" / "checkpoint_step_00000008", 8)
    (tmp_path / "kept").mkdir()
    with pytest.raises(Exception):  # DeepSpeed's own error, from torch.load of an empty file
        export(broken, str(tmp_path / "kept" / "new" / "deeper" / "hf"))
    assert os.listdir(tmp_path / "kept") == []  # new/deeper/ and the .tmp- directory gone; kept/ was there


EDITED = ", which raytrain writes into every checkpoint's record (the file was edited, or written by another program)"


@pytest.mark.parametrize("edit, says", [
    (lambda spec: spec.pop("cluster"), " lacks spec.cluster" + EDITED),
    (lambda spec: spec["cluster"].update(gpus=8),
     " holds a spec raytrain cannot read (ClusterShape.__init__() got an unexpected keyword argument 'gpus')" + EDITED),
    (lambda spec: spec["world_sizes"].append({"world_size": 4, "ds_config": {}}),
     " lacks 'deepspeed' inside its spec" + EDITED),
    # a key that is no field of the spec's top level (was named "spec.world_size")
    (lambda spec: spec["world_sizes"].append({"ds_config": {}, "deepspeed": {}}),
     " lacks 'world_size' inside its spec" + EDITED),
    (lambda spec: spec["config"]["training"].update(max_steps="many"),
     ": its run config is not one raytrain reads (training.max_steps must be an integer >= 1, got str 'many')"),
])
def test_a_record_whose_spec_the_export_cannot_rebuild_is_one_line_naming_the_file(tmp_path, capsys, edit, says):
    # was: a KeyError (or TypeError) traceback from RunSpec.from_dict, exit 1
    ck = checkpoint(tmp_path / "runs" / "r1" / "checkpoint_step_00000008", 8)
    record = os.path.join(ck, "raytrain.json")
    with open(record) as f:
        meta = json.load(f)
    edit(meta["spec"])
    with open(record, "w") as f:
        json.dump(meta, f)
    assert main([ck, str(tmp_path / "new" / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"raytrain: error: {record}{says}: choose another checkpoint (an earlier checkpoint_step_* of the "
                   f"run)"]
    assert not (tmp_path / "new").exists()


def test_a_runs_directory_given_for_a_checkpoint_names_its_latest_checkpoint(tmp_path, capsys):
    # the commonest wrong path: it said "not a raytrain checkpoint (no raytrain.json in it)" and nothing more
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4, 8])
    assert main([run, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"raytrain: error: the checkpoint={run} is not a raytrain checkpoint (no raytrain.json in it): it "
                   f"is a run's directory: give one of its checkpoints, the latest being {run}/checkpoint_step_00000008"]
    assert main([str(tmp_path), str(tmp_path / "hf")]) == 2  # not a run either: the plain advice
    assert capsys.readouterr().err.strip().endswith("(no raytrain.json in it): give a checkpoint_step_* directory of "
                                                    "a run")
