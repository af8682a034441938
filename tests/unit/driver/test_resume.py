"""Which checkpoint a run resumes, decided on the driver before any worker (raytrain.driver.run:
`resume_checkpoint`, `check_resume`, `_place`; raytrain.checkpoint.layout for Ray Train's record):
the continue command of a run started with --resume-from, --fresh, a record naming a deleted
checkpoint, and --dry-run reporting what a real run would refuse; then the checkpoint each worker
loads (raytrain.checkpoint.shards.resume_point). Runs with real training, resumed for real:
tests/integration/test_fault_tolerance.py."""

import asyncio
import json
import os
import shlex

import pytest

from raytrain.checkpoint import layout
from raytrain.config import ConfigError, load_config
from raytrain.driver.run import _place, unfinished_runs
from raytrain.driver.watch import continue_command
from raytrain.main import main
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.run_spec import RunSpec

TWO = ["scaling.num_workers=2", "training.max_steps=40"]


def resolved(*overrides):
    cfg = load_config(None, list(overrides))
    return resolve_run(cfg, shape_from_config(cfg))


SHARDS = [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
"""What DeepSpeed 0.19.8's ZeRO-3 save_checkpoint writes into the tag directory for 2 ranks in fp32
(a trained run's, as tests/integration/test_train_e2e.py lists them)."""


def checkpoint(path, step, *overrides, resume_from=None, shards=None):
    """A checkpoint directory as a run of `overrides` on 2 workers leaves it: raytrain.json with the
    run's spec, DeepSpeed's `latest` and its tag directory with every rank's shard files (`shards`, by default
    those its ZeRO stage writes), empty (nothing here loads them; the driver only checks they are there)."""
    spec = RunSpec.place(resolved(*TWO, *overrides), run_name=os.path.basename(os.path.dirname(path)),
                         storage_path=os.path.dirname(os.path.dirname(path)), resume_from=resume_from)
    meta = {"step": step, "world_size": 2, "metrics": {}, "history": [], "spec": spec.to_dict()}
    os.makedirs(os.path.join(path, layout.tag_for(step)))
    for name in layout.missing_shards(os.path.join(path, layout.tag_for(step)), meta) if shards is None else shards:
        open(os.path.join(path, layout.tag_for(step), name), "w").close()
    with open(os.path.join(path, layout.METADATA), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(path, "latest"), "w") as f:
        f.write(layout.tag_for(step))
    return str(path)


def run_with_checkpoints(storage, name, steps, *overrides, resume_from=None):
    """STORAGE/NAME with checkpoints at `steps` and Ray Train's own record of them, written by Ray
    Train's CheckpointManager (the controller's class, private, ray 2.60) rather than by a training
    run (~30 s each on 2 cores); it notifies waiters, so it runs inside an event loop."""
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    async def register():
        manager = CheckpointManager(CheckpointConfig(num_to_keep=5),
                                    StorageContext(storage_path=str(storage), experiment_dir_name=name))
        for step in steps:
            path = checkpoint(os.path.join(storage, name, layout.checkpoint_dir_name(step)), step, *overrides,
                              resume_from=resume_from)
            manager.register_checkpoint(_TrainingReport(checkpoint=Checkpoint(path), metrics={"step": step},
                                                        validation=False))

    asyncio.run(register())
    return os.path.join(storage, name)


def place(storage, *overrides, fresh=False):
    spec, _, _ = _place(resolved(*TWO, f"checkpoint.storage_path={storage}", *overrides), fresh)
    return spec


def test_a_run_started_from_a_checkpoint_continues_from_it_with_the_printed_command(tmp_path, capsys):
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000004", 4)
    argv = ["--resume-from", source, f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=ft", *TWO]
    first = place(tmp_path / "runs", "checkpoint.name=ft", f"checkpoint.resume_from={source}")
    # Ctrl-C before the run's first checkpoint: the printed command must start from the same checkpoint
    command = shlex.split(continue_command(argv, "ft", first.resume_from))
    assert command[3:] == [f"checkpoint.storage_path={tmp_path / 'runs'}", *TWO, "--resume-from", source,
                           "checkpoint.name=ft"]
    assert place(tmp_path / "runs", "checkpoint.name=ft", f"checkpoint.resume_from={source}").resume_from == source
    # once the run has checkpoints of its own, the same command continues from its latest
    run_with_checkpoints(tmp_path / "runs", "ft", [8], resume_from=source)
    capsys.readouterr()
    place(tmp_path / "runs", "checkpoint.name=ft", f"checkpoint.resume_from={source}")
    assert f"continuing from its latest checkpoint (step 8, started from {source})" in capsys.readouterr().out
    # another checkpoint for the same run is a mistake: the run would ignore it
    other = checkpoint(tmp_path / "other" / "checkpoint_step_00000004", 4)
    with pytest.raises(ConfigError, match=rf"checkpoint.resume_from={other} is set but run 'ft' already exists in "
                                          rf".*\(started from {source}\).*choose a new checkpoint.name"):
        place(tmp_path / "runs", "checkpoint.name=ft", f"checkpoint.resume_from={other}")


def test_a_worker_loads_ray_trains_latest_checkpoint_else_resume_from_as_written_or_through_a_universal_copy(
        tmp_path):
    from ray.train import Checkpoint  # a plain class: no Ray cluster is started

    from raytrain.checkpoint.reshard import universal_uri
    from raytrain.checkpoint.shards import resume_point

    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000004", 4, *TWO)
    latest = checkpoint(tmp_path / "runs" / "r" / "checkpoint_step_00000008", 8, *TWO)
    spec = RunSpec.place(resolved(*TWO), run_name="r", storage_path=str(tmp_path / "runs"), resume_from=source)
    fresh = RunSpec.place(resolved(*TWO), run_name="r", storage_path=str(tmp_path / "runs"), resume_from=None)
    assert resume_point(fresh, None, 2) is None  # nothing to continue from: a fresh start
    point = resume_point(spec, None, 2)  # the run's first group: --resume-from, loaded as written by 2 workers
    assert (point.checkpoint.path, point.step, point.written_by, point.universal) == (source, 4, 2, None)
    for run in (spec, fresh):  # a restart: Ray Train's latest checkpoint wins
        point = resume_point(run, Checkpoint(latest), 3)
        assert (point.checkpoint.path, point.step, point.written_by) == (latest, 8, 2)
        # written by 2 workers, loaded by 3: through its universal copy in this run's directory
        assert point.universal == universal_uri(spec.run_uri, latest, layout.read_metadata(Checkpoint(latest)))
        assert point.universal.startswith(f"{tmp_path / 'runs' / 'r'}/")


@pytest.mark.usefixtures("no_ray_driver")
def test_a_relative_resume_from_is_made_absolute_on_the_driver(tmp_path, monkeypatch, capsys):
    checkpoint(tmp_path / "old" / "checkpoint_step_00000004", 4)
    monkeypatch.chdir(tmp_path)
    relative = "old/checkpoint_step_00000004"  # pyarrow refuses it (ArrowInvalid, once Ray Train reads it)
    rc = main(["--dry-run", "--host-memory-gib", "64", "--resume-from", relative,
               f"checkpoint.storage_path={tmp_path / 'runs'}", *TWO])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["config"]["checkpoint"]["resume_from"] == str(tmp_path / relative)
    assert place(tmp_path / "runs", "checkpoint.name=rel", f"checkpoint.resume_from={tmp_path / relative}")
    from raytrain.driver.run import _local_paths  # what fit() and dry_run() start with

    cfg = _local_paths(load_config(None, ["checkpoint.export_dir=~/out", "checkpoint.storage_path=s3://b/runs"]))
    assert cfg.checkpoint.export_dir == os.path.expanduser("~/out") and cfg.checkpoint.storage_path == "s3://b/runs"


def test_fresh_with_a_resume_from_inside_the_run_it_sets_aside_is_refused_before_moving_it(tmp_path):
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4, 8])
    inside = os.path.join(run, "checkpoint_step_00000004")
    with pytest.raises(ConfigError, match=r"--fresh sets run 'r1' aside, and checkpoint.resume_from=.*"
                                          r"checkpoint_step_00000004 is inside it: drop --fresh"):
        place(tmp_path / "runs", "checkpoint.name=r1", f"checkpoint.resume_from={inside}", fresh=True)
    assert sorted(os.listdir(tmp_path / "runs")) == ["r1"]  # nothing moved


def test_a_record_naming_a_deleted_checkpoint_is_one_line_and_fresh_sets_the_run_aside(tmp_path):
    run_with_checkpoints(tmp_path / "runs", "r1", [4, 8])
    run_with_checkpoints(tmp_path / "runs", "raytrain-20260101-000000", [4, 8])
    for name in ("r1", "raytrain-20260101-000000"):  # a user deleted a bad latest checkpoint by hand
        for path, _, files in os.walk(tmp_path / "runs" / name / "checkpoint_step_00000008", topdown=False):
            for f in files:
                os.remove(os.path.join(path, f))
            os.rmdir(path)
    with pytest.raises(layout.BrokenRun) as e:
        place(tmp_path / "runs", "checkpoint.name=r1")
    # the checkpoint to go on from, named (was: "resume one of its remaining checkpoints with --resume-from")
    run = tmp_path / "runs" / "r1"
    assert str(e.value) == (f"run 'r1' in {tmp_path / 'runs'}: Ray Train's record of its checkpoints names one that "
                            f"was deleted from storage, so the run cannot continue under its name: continue from its "
                            f"latest complete checkpoint under a new name (--resume-from {run}/checkpoint_step_00000004 "
                            f"checkpoint.name=NEW_NAME), or pass --fresh to start over (the old run is kept under "
                            f"another name)")
    # another run's broken record is no reason to refuse this one, nor to offer it as continuable
    new = resolved(*TWO, f"checkpoint.storage_path={tmp_path / 'runs'}")
    assert unfinished_runs(str(tmp_path / "runs"), new, "raytrain-20990101-000000") == []
    place(tmp_path / "runs", "checkpoint.name=r1", fresh=True)
    assert not (tmp_path / "runs" / "r1").exists()
    assert any(p.startswith("r1.replaced-") for p in os.listdir(tmp_path / "runs"))


def test_a_runs_directory_given_as_a_checkpoint_is_refused_naming_its_latest_checkpoint(tmp_path):
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4, 8])
    with pytest.raises(ConfigError) as e:
        layout.check_is_checkpoint(run + "/", "checkpoint.resume_from")
    assert str(e.value) == (f"checkpoint.resume_from={run}/ is not a raytrain checkpoint (no raytrain.json in it): "
                            f"it is a run's directory: give one of its checkpoints, the latest being "
                            f"{run}/checkpoint_step_00000008")


def test_a_stopped_run_is_offered_to_continue_unless_another_driver_is_training_it(tmp_path):
    import time

    from raytrain.driver import live

    storage = str(tmp_path / "runs")
    run_with_checkpoints(storage, "raytrain-20260101-000000", [4], f"checkpoint.storage_path={storage}")
    new = resolved(*TWO, f"checkpoint.storage_path={storage}")
    assert unfinished_runs(storage, new, "raytrain-20990101-000000") == [("raytrain-20260101-000000", 4)]
    live._write(storage, "raytrain-20260101-000000", live.Driver(token="t", host="gpu-node-7", pid=1, started="x",
                                                                  beat=time.time()))
    assert unfinished_runs(storage, new, "raytrain-20990101-000000") == []  # it is training in another terminal


@pytest.mark.usefixtures("no_ray_driver")
@pytest.mark.parametrize("mode", ["--dry-run", "real run"])
def test_a_checkpoint_the_run_cannot_resume_is_refused_before_ray_by_a_dry_run_too(mode, tmp_path, capsys):
    import ray

    other_model = checkpoint(tmp_path / "a" / "checkpoint_step_00000004", 4, "model.config={num_hidden_layers: 5}")
    at_max = checkpoint(tmp_path / "b" / "checkpoint_step_00000040", 40)
    dry = ["--dry-run", "--host-memory-gib", "64"] if mode == "--dry-run" else []
    storage = tmp_path / "runs"
    for source, needle in ((other_model, "holds another model (num_hidden_layers=5, num_parameters="),
                           (at_max, "is at step 40 >= training.max_steps=40: nothing to train")):
        rc = main([*dry, "--resume-from", source, f"checkpoint.storage_path={storage}", *TWO])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("raytrain: error: ") and needle in err[0], err
    assert not storage.exists() and not ray.is_initialized()


def dry(capsys, *argv):
    """`python -m raytrain.main --dry-run ARGV` in-process: (exit code, stderr lines)."""
    rc = main(["--dry-run", "--host-memory-gib", "64", *argv])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.usefixtures("no_ray_driver")
def test_a_checkpoint_missing_a_ranks_shard_is_refused_before_ray_naming_the_file(tmp_path, capsys):
    # raytrain.json says 2 workers, the tag directory lacks shards: a save cut short (or files deleted).
    # DeepSpeed's load failed in every worker, and Ray Train retried it max_failures times.
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    half = checkpoint(tmp_path / "a" / "checkpoint_step_00000008", 8, shards=SHARDS[:3])
    rc, err = dry(capsys, "--resume-from", half, storage, *TWO)
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (f"raytrain: error: checkpoint.resume_from={half} is incomplete: raytrain.json says 2 workers "
                      f"wrote it, and its DeepSpeed tag step_00000008/ has no zero_pp_rank_1_mp_rank_00_optim_states.pt "
                      f"(a save cut short, or files deleted): choose an earlier checkpoint_step_* directory of the run")
    empty = checkpoint(tmp_path / "b" / "checkpoint_step_00000008", 8, shards=[])
    rc, err = dry(capsys, "--resume-from", empty, storage, *TWO)
    assert rc == 2 and "has no zero_pp_rank_0_mp_rank_00_model_states.pt and 3 more of its shard files" in err[0]
    # bf16 mode names the optimizer files bf16_zero_pp_rank_*: complete too
    bf16 = checkpoint(tmp_path / "c" / "checkpoint_step_00000008", 8,
                      shards=[n if "model" in n else "bf16_" + n for n in SHARDS])
    assert dry(capsys, "--resume-from", bf16, storage, *TWO)[0] == 0
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_ray_driver")
def test_a_truncated_raytrain_json_is_one_line_naming_the_file(tmp_path, capsys):
    bad = checkpoint(tmp_path / "a" / "checkpoint_step_00000004", 4)
    text = (tmp_path / "a" / "checkpoint_step_00000004" / "raytrain.json").read_text()
    (tmp_path / "a" / "checkpoint_step_00000004" / "raytrain.json").write_text(text[: len(text) // 2])
    rc, err = dry(capsys, "--resume-from", bad, f"checkpoint.storage_path={tmp_path / 'runs'}", *TWO)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"raytrain: error: {bad}/raytrain.json is not valid JSON (") and "choose another" in err[0]
    # the run's own latest checkpoint, found through Ray Train's record, says the same
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4])
    (tmp_path / "runs" / "r1" / "checkpoint_step_00000004" / "raytrain.json").write_text("{\"step\": 4, ")
    with pytest.raises(ConfigError, match=rf"^{run}/checkpoint_step_00000004/raytrain.json is not valid JSON .*"
                                          r"pass --fresh to start over$"):
        place(tmp_path / "runs", "checkpoint.name=r1")


@pytest.mark.usefixtures("no_ray_driver")
def test_a_raytrain_json_without_the_runs_spec_is_one_line_naming_what_it_lacks(tmp_path, capsys):
    # `{}` with every shard there: check_resume's meta["spec"] was a KeyError traceback, exit 1
    source = checkpoint(tmp_path / "a" / "checkpoint_step_00000004", 4)
    (tmp_path / "a" / "checkpoint_step_00000004" / "raytrain.json").write_text("{}")
    lacks = (f"{source}/raytrain.json lacks step (an integer), spec.model, spec.config.data, which raytrain writes "
             f"into every checkpoint's record (the file was edited, or written by another program): choose another "
             f"checkpoint (an earlier checkpoint_step_* of the run), or for a run's own latest checkpoint pass --fresh "
             f"to start over")
    rc, err = dry(capsys, "--resume-from", source, f"checkpoint.storage_path={tmp_path / 'runs'}", *TWO)
    assert (rc, err) == (2, [f"raytrain: error: {lacks}"])
    from raytrain.tools.export import main as export_main

    assert export_main([source, str(tmp_path / "hf")]) == 2  # the export reads the same record
    assert capsys.readouterr().err.strip().splitlines() == [f"raytrain: error: {lacks}"]
    # the run's own latest checkpoint, found through Ray Train's record, says the same
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4])
    (tmp_path / "runs" / "r1" / "checkpoint_step_00000004" / "raytrain.json").write_text('{"step": 4}')
    with pytest.raises(ConfigError, match=rf"^{run}/checkpoint_step_00000004/raytrain.json lacks spec.model, "
                                          r"spec.config.data, .* pass --fresh to start over$"):
        place(tmp_path / "runs", "checkpoint.name=r1")


@pytest.mark.usefixtures("no_ray_driver")
def test_resuming_with_other_data_settings_notes_what_differs(tmp_path, capsys):
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000008", 8)
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO)
    assert rc == 0 and not [line for line in err if "data settings" in line], err  # the same data: nothing to say
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO, "data.seq_len=64", "training.seed=7",
                  "data.shuffle_buffer_size=100", "data.prefetch_batches=2")  # prefetch: speed only, not named
    notes = [line for line in err if "data settings" in line]
    assert rc == 0 and len(notes) == 1, err
    assert notes[0].startswith(f"raytrain: note: checkpoint {source} was written with other data settings "
                               f"(data.seq_len=128 -> 64, data.shuffle_buffer_size=0 -> 100, training.seed=1234 -> 7): "
                               f"its data position (the epoch and the rows read from each data shard by step 8) is "
                               f"applied to this run's data as it is")
    assert "set them back" not in notes[0]  # another run's checkpoint: its settings are not this run's to restore
    # continuing the run itself with other data: the same note, and setting them back is the fix
    run_with_checkpoints(tmp_path / "runs", "r1", [4])
    (tmp_path / "other.txt").write_text("another corpus\n")
    capsys.readouterr()
    place(tmp_path / "runs", "checkpoint.name=r1", "data.path=" + str(tmp_path / "other.txt"))
    out = capsys.readouterr().out
    assert "(data.path=None -> " in out and "other.txt): its data position" in out and "set them back" in out
    # a done run reads no data: nothing to say about its position
    run_with_checkpoints(tmp_path / "runs", "done", [40])
    capsys.readouterr()
    place(tmp_path / "runs", "checkpoint.name=done", "data.path=" + str(tmp_path / "other.txt"))
    assert "data settings" not in capsys.readouterr().out


@pytest.mark.usefixtures("no_ray_driver")
def test_resuming_with_a_longer_schedule_notes_the_learning_rate_it_jumps_to(tmp_path, capsys):
    # max_steps 20 -> 40 to train further: the cosine is recomputed over 40 steps, so the rate went from the
    # decayed 1e-4 back up to 7.75e-4 at step 21 without a word
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000020", 20, "training.max_steps=20")
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO)
    notes = [line for line in err if "schedule changed" in line]
    assert rc == 0 and notes == [
        "raytrain: note: the learning rate schedule changed since the checkpoint (training.max_steps 20 -> 40): the "
        "warmup + cosine schedule is recomputed for the new settings, so step 21 trains at a learning rate of "
        "0.000775 where the checkpoint's schedule stood at 0.0001, with no warmup in between"], err
    source = checkpoint(tmp_path / "old2" / "checkpoint_step_00000008", 8, "training.max_steps=20")
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO)  # still warming up: the same rate at step 9
    assert rc == 0 and not [line for line in err if "schedule changed" in line], err


@pytest.mark.usefixtures("no_ray_driver")
def test_another_shard_count_names_what_changed(tmp_path, capsys):
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000008", 8)  # 2 workers, one shard each
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    # the same 2 workers: it said "resuming on another number of workers needs the same data.num_shards"
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO, "data.num_shards=4")
    assert rc == 2 and err == [
        f"raytrain: error: checkpoint {source} was written with 2 data shards and this run has 4 (data.num_shards=4) "
        f"on as many workers: its data position is the rows read from each of its shards, which another count "
        f"cannot place: drop data.num_shards (the checkpoint's run had one shard per worker)"], err
    rc, err = dry(capsys, "--resume-from", source, storage, "scaling.num_workers=4", "training.max_steps=40")
    assert rc == 2 and "this run has 4 workers and 4 shards: resuming on another number of workers needs the same " \
                       "data.num_shards" in err[0], err


def test_resuming_rows_cut_with_other_document_start_ids_notes_it(tmp_path, capsys):
    """The same data settings, rows cut another way: a checkpoint of a tokenizer that put a BOS before each
    document (or of raytrain before 2026-12-04, which put none, against a BOS-adding tokenizer now)."""
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000008", 8)
    meta_path = os.path.join(source, layout.METADATA)
    meta = json.load(open(meta_path))
    assert meta["spec"]["model"]["document_start_ids"] == []  # the byte tokenizer adds no BOS
    meta["spec"]["model"]["document_start_ids"] = [1]
    json.dump(meta, open(meta_path, "w"))
    rc, err = dry(capsys, "--resume-from", source, f"checkpoint.storage_path={tmp_path / 'runs'}", *TWO)
    notes = [line for line in err if "data settings" in line]
    assert rc == 0 and len(notes) == 1 and "(ids before each document [1] -> []): its data position" in notes[0], err


def test_fresh_sees_a_resume_from_inside_the_run_through_a_symlinked_storage_path(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")  # e.g. /shared -> /mnt/nfs/shared
    run_with_checkpoints(tmp_path / "real" / "runs", "r1", [4, 8])
    inside = tmp_path / "real" / "runs" / "r1" / "checkpoint_step_00000004"
    for spelling in (inside, tmp_path / "link" / "runs" / "r1" / ".." / "r1" / "checkpoint_step_00000004"):
        with pytest.raises(ConfigError, match=r"--fresh sets run 'r1' aside, and checkpoint.resume_from=.* is inside"):
            place(tmp_path / "link" / "runs", "checkpoint.name=r1", f"checkpoint.resume_from={spelling}", fresh=True)
    assert os.listdir(tmp_path / "real" / "runs") == ["r1"] and inside.is_dir()  # nothing moved


def test_fresh_sets_aside_a_run_directory_stopped_before_its_first_checkpoint(tmp_path, capsys):
    # an attempt stopped before its first checkpoint left its TensorBoard events and sample digests
    (tmp_path / "runs" / "r1" / "tensorboard").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "tensorboard" / "events.out.tfevents.1.host").write_text("old attempt")
    place(tmp_path / "runs", "checkpoint.name=r1", fresh=True)
    aside = [p for p in os.listdir(tmp_path / "runs") if p.startswith("r1.replaced-")]
    assert len(aside) == 1 and os.listdir(tmp_path / "runs" / aside[0] / "tensorboard")
    assert f"--fresh: moved the existing run 'r1' to {tmp_path / 'runs' / aside[0]}" in capsys.readouterr().out
    # an empty directory holds nothing to mix with: left where it is
    (tmp_path / "runs" / "r2").mkdir()
    place(tmp_path / "runs", "checkpoint.name=r2", fresh=True)
    assert (tmp_path / "runs" / "r2").is_dir() and not [p for p in os.listdir(tmp_path / "runs") if p.startswith("r2.")]


@pytest.mark.usefixtures("no_ray_driver")
def test_resuming_with_other_optimizer_settings_is_refused_naming_both_values(tmp_path, capsys):
    # DeepSpeed's load restores every param group's lr, betas, eps and weight_decay, and raytrain's LambdaLR
    # its base_lrs (measured on DeepSpeed 0.19.8, ZeRO-3, CPU): a new training.learning_rate trained at the
    # checkpoint's, silently. Refused on the driver, before Ray, naming both values.
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000008", 8)
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO, "training.learning_rate=3e-4",
                  "training.adam_betas=[0.9, 0.99]")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"raytrain: error: checkpoint {source} was written with other optimizer settings "
                             f"(training.adam_betas=[0.9, 0.95] -> [0.9, 0.99], training.learning_rate=0.001 -> "
                             f"0.0003), and resuming it keeps its own"), err
    # a new run from the same checkpoint restores the same: not offered (nor --fresh, for another run's checkpoint)
    assert "--fresh" not in err[0] and "export it (python -m raytrain.tools.export)" in err[0]
    # what a resumed run does take from this run's config: the schedule's shape, and a DeepSpeed scheduler's lr
    assert dry(capsys, "--resume-from", source, storage, *TWO, "training.warmup_steps=3",
               "training.min_lr_ratio=0.5")[0] == 0
    scheduler = ('deepspeed.scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto", '
                 '"warmup_max_lr": "auto"}}')
    assert dry(capsys, "--resume-from", source, storage, *TWO, scheduler, "training.learning_rate=3e-4")[0] == 0
    # the DeepSpeed JSON's optimizer: named as the user wrote it, training's (filled into "auto") or the JSON's own
    adamw = ('deepspeed.optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", '
             '"weight_decay": %s, "torch_adam": true}}')
    source = checkpoint(tmp_path / "json" / "checkpoint_step_00000008", 8, adamw % 0.1)
    rc, err = dry(capsys, "--resume-from", source, storage, *TWO, adamw % 0.01, "training.learning_rate=3e-4")
    assert rc == 2 and ("(deepspeed.optimizer.params.weight_decay=0.1 -> 0.01, training.learning_rate=0.001 -> "
                        "0.0003)") in err[0], err
    # the run's own checkpoint: --fresh is a way out too
    run_with_checkpoints(tmp_path / "runs", "r1", [4])
    with pytest.raises(ConfigError, match=r"r1/checkpoint_step_00000004 was written with other optimizer settings "
                                          r"\(training.weight_decay=0.1 -> 0.0\).*pass --fresh to start over"):
        place(tmp_path / "runs", "checkpoint.name=r1", "training.weight_decay=0.0")
    # a run already done trains nothing: the command says so
    run_with_checkpoints(tmp_path / "runs", "done", [40])
    capsys.readouterr()
    place(tmp_path / "runs", "checkpoint.name=done", "training.learning_rate=3e-4")
    assert "run 'done' in " in capsys.readouterr().out


def test_reading_a_runs_record_prints_no_ray_train_snapshot_line(tmp_path, caplog):
    import logging

    from raytrain import compat

    run = run_with_checkpoints(tmp_path / "runs", "r1", [4])
    caplog.clear()
    assert layout.read_metadata(layout.latest_checkpoint(run))["step"] == 4  # what continuing a run reads, 3 times
    # Ray Train's 3-line INFO, on the console each time (Ray's own handler, which caplog's sits beside)
    assert not [r for r in caplog.records if "snapshot was found" in r.getMessage()]
    assert logging.getLogger(compat.CHECKPOINT_MANAGER_LOGGER).filters == []  # dropped for the call only


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_ctrl_c_during_the_final_export_says_the_run_is_done_and_how_to_export_it(signal_name, tmp_path, monkeypatch):
    from raytrain.driver import run as driver_run
    from raytrain.driver.run import _wrap_up, finished_checkpoint
    from raytrain.driver.watch import ExportInterrupted, Terminated

    run = run_with_checkpoints(tmp_path / "runs", "r1", [40])  # TWO: training.max_steps=40
    record = tmp_path / "runs" / "r1" / "checkpoint_step_00000040" / "raytrain.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "metrics": {"step": 40, "loss": 1.5},
                                  "history": [{"step": 40, "loss": 1.5}]}))
    out = tmp_path / "hf"
    spec = place(tmp_path / "runs", "checkpoint.name=r1", f"checkpoint.export_dir={out}")

    def interrupted(*args, **kwargs):  # Ctrl-C (or SIGTERM: signals_stop_the_run) in the middle of the export's minutes
        raise Terminated if signal_name == "SIGTERM" else KeyboardInterrupt

    monkeypatch.setattr(driver_run, "export", interrupted)
    with pytest.raises(ExportInterrupted) as e:
        _wrap_up(finished_checkpoint(spec.run_uri, 40), spec, spec.config)
    by = " by SIGTERM" if signal_name == "SIGTERM" else ""
    assert e.value.exit_code == (143 if by else 130)
    assert str(e.value) == (f"interrupted{by} while exporting to {out} (nothing left there); the run is done at step "
                            f"40, checkpoint {run}/checkpoint_step_00000040; to export it: python -m "
                            f"raytrain.tools.export {run}/checkpoint_step_00000040 {out}")  # was "... before training"


@pytest.mark.usefixtures("no_ray_driver")
def test_the_same_command_on_a_done_run_with_an_export_dir_says_it_is_done(tmp_path, capsys):
    from raytrain.driver.run import _wrap_up, finished_checkpoint

    run = run_with_checkpoints(tmp_path / "runs", "r1", [40])  # TWO: training.max_steps=40
    meta = json.loads((tmp_path / "runs" / "r1" / "checkpoint_step_00000040" / "raytrain.json").read_text())
    meta.update(metrics={"step": 40, "loss": 1.5}, history=[{"step": 40, "loss": 1.5}])
    (tmp_path / "runs" / "r1" / "checkpoint_step_00000040" / "raytrain.json").write_text(json.dumps(meta))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the export the first run of the command wrote
    argv = [f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=r1", f"checkpoint.export_dir={out}"]
    rc, err = dry(capsys, *argv, *TWO)
    assert rc == 0, err  # was: exit 2, "checkpoint.export_dir ... exists and is not empty"
    rc, err = dry(capsys, *argv, "scaling.num_workers=2", "training.max_steps=80")  # steps to train: refused, early
    assert rc == 2 and "checkpoint.export_dir " in err[0] and "exists and is not empty" in err[0], err
    # what fit() does then: the run's summary, and a note instead of the export (nothing overwritten)
    spec = place(tmp_path / "runs", "checkpoint.name=r1", f"checkpoint.export_dir={out}")
    assert "is already done at step 40" in capsys.readouterr().out
    result = _wrap_up(finished_checkpoint(spec.run_uri, 40), spec, spec.config, done_before=True)
    assert result.metrics["step"] == 40 and os.listdir(out) == ["config.json"]
    assert capsys.readouterr().out.strip() == (
        f"raytrain: note: checkpoint.export_dir {out} exists and is not empty (the export of an earlier run of this "
        f"command, or other files): not exported again, nothing overwritten; to export the checkpoint elsewhere: "
        f"python -m raytrain.tools.export {run}/checkpoint_step_00000040 OUT_DIR")


@pytest.mark.usefixtures("no_ray_driver")
def test_resuming_with_settings_deepspeed_cannot_load_the_checkpoint_with_is_refused_before_ray(tmp_path, capsys):
    # Another ZeRO stage (check_ckpt_list's bare AssertionError), bf16 <-> fp32 (bf16_zero_pp_rank_* files) and an
    # optimizer newly offloaded (CPU Adam's KeyError 'bias_correction') passed every check and then failed every
    # worker attempt at the load, max_failures times, exit 1. Measured on DeepSpeed 0.19.8 (raytrain.driver.run).
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    offload = 'deepspeed.zero_optimization.offload_optimizer={"device": "cpu"}'
    stage3 = checkpoint(tmp_path / "s3" / "checkpoint_step_00000008", 8)
    for overrides, named in ((["deepspeed.zero_optimization.stage=2"], "deepspeed.zero_optimization.stage=3 -> 2"),
                             (["training.precision=bf16"], "training.precision=fp32 -> bf16"),
                             ([offload], "deepspeed.zero_optimization.offload_optimizer.device=none -> cpu")):
        rc, err = dry(capsys, "--resume-from", stage3, storage, *TWO, *overrides)
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"raytrain: error: checkpoint {stage3} was written with other DeepSpeed settings "
                                 f"({named}), and DeepSpeed cannot load it with this run's"), err
        assert "export it (python -m raytrain.tools.export)" in err[0] and "--fresh" not in err[0]
    # what loads (measured): the optimizer's offload dropped, or another ratio
    offloaded = checkpoint(tmp_path / "off" / "checkpoint_step_00000008", 8, offload)
    assert dry(capsys, "--resume-from", offloaded, storage, *TWO)[0] == 0
    ratio = 'deepspeed.zero_optimization.offload_optimizer={"device": "cpu", "ratio": 0.5}'
    assert dry(capsys, "--resume-from", offloaded, storage, *TWO, ratio)[0] == 0
    # the run's own checkpoint (a continue): --fresh is a way out too; a done run trains nothing, so it is not asked
    run_with_checkpoints(tmp_path / "runs", "r1", [4], "deepspeed.zero_optimization.stage=2")
    with pytest.raises(ConfigError, match=r"r1/checkpoint_step_00000004 was written with other DeepSpeed settings "
                                          r"\(deepspeed.zero_optimization.stage=2 -> 3\).*pass --fresh to start over"):
        place(tmp_path / "runs", "checkpoint.name=r1")
    run_with_checkpoints(tmp_path / "runs", "done", [40], "training.precision=bf16")
    place(tmp_path / "runs", "checkpoint.name=done")


@pytest.mark.usefixtures("no_ray_driver")
def test_the_model_line_of_a_resumed_run_names_the_checkpoint_its_weights_come_from(tmp_path, capsys):
    from raytrain.config import ModelConfig
    from raytrain.driver.run import _place
    from raytrain.model import model_source

    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000004", 4)
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    # the workers restore it into a model built from the config (no weight read): not model.name_or_path's weights
    assert _place(resolved(*TWO, storage, f"checkpoint.resume_from={source}"), False)[2] == source
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4])
    assert _place(resolved(*TWO, storage, "checkpoint.name=r1"), False)[2] == f"{run}/checkpoint_step_00000004"
    assert _place(resolved(*TWO, storage, "checkpoint.name=r2"), False)[2] is None  # a new run
    pretrained = ModelConfig(name_or_path="/m", pretrained=True)
    assert model_source(pretrained, source) == (f"weights from checkpoint {source} (the model built from /m's config, "
                                                f"no weights read)")
    assert model_source(pretrained) == "weights from /m (model.pretrained=true)"


@pytest.mark.usefixtures("no_ray_driver")
def test_continuing_a_run_whose_model_directory_is_gone_names_the_runs_copy(tmp_path, capsys):
    storage = tmp_path / "runs"
    (storage / "r1" / "model").mkdir(parents=True)  # what write_model_files left (its contents are not read)
    gone = tmp_path / "moved-away"
    rc, err = dry(capsys, f"checkpoint.storage_path={storage}", "checkpoint.name=r1", f"model.name_or_path={gone}",
                  *TWO)
    assert rc == 2 and err == [
        f"raytrain: error: model.name_or_path={gone} does not exist (moved or deleted?), and run 'r1' continues from "
        f"its checkpoint: its weights come from there, but every session reads the model's config and tokenizer from "
        f"model.name_or_path ({storage}/r1/model holds the run's copy for the export, not a model to train from): put "
        f"the directory back, or set model.name_or_path to where it is now"], err
    # a new run (another name, or --fresh) is the model's own check: transformers cannot load its config
    for argv in (["checkpoint.name=r2"], ["checkpoint.name=r1", "--fresh"]):
        rc, err = dry(capsys, f"checkpoint.storage_path={storage}", f"model.name_or_path={gone}", *TWO, *argv)
        assert rc == 2 and "cannot load its config" in err[0], err


def test_a_relative_or_home_model_directory_reaches_the_workers_absolute(tmp_path, monkeypatch):
    """The workers and tokenizing tasks read model.name_or_path and model.tokenizer from other working
    directories, and transformers does not expand ~: a directory here is made absolute on the driver,
    a hub id is left as it is."""
    from raytrain.driver.run import _local_paths

    (tmp_path / "model").mkdir()
    (tmp_path / "home" / "tok").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = _local_paths(load_config(None, ["model.name_or_path=model", "model.tokenizer=~/tok"]))
    assert (cfg.model.name_or_path, cfg.model.tokenizer) == (str(tmp_path / "model"), str(tmp_path / "home" / "tok"))
    hub = _local_paths(load_config(None, ["model.name_or_path=org/name", "model.tokenizer=gpt2"]))
    assert (hub.model.name_or_path, hub.model.tokenizer) == ("org/name", "gpt2")
    # rank 0 opens a local MLflow store from Ray's working directory too
    tracked = _local_paths(load_config(None, ["tracking.mlflow_tracking_uri=mlruns"]))
    assert tracked.tracking.mlflow_tracking_uri == str(tmp_path / "mlruns")


@pytest.mark.usefixtures("no_ray_driver")
def test_a_dry_run_says_what_a_real_run_would_do_with_the_runs_storage(tmp_path, capsys):
    # Before, a dry run checked the checkpoint a real run would resume but did not say whether that run
    # would continue, be done, start over (--fresh) or start new: the user learnt it only by running.
    runs = tmp_path / "runs"
    storage = f"checkpoint.storage_path={runs}"

    def would(*argv, steps=40):
        rc, err = dry(capsys, storage, "scaling.num_workers=2", f"training.max_steps={steps}", *argv)
        lines = [line for line in err if line.startswith("raytrain: note: a real run now ")]
        assert rc == 0 and len(lines) == 1, err
        return lines[0].removeprefix("raytrain: note: a real run now ")

    assert would("checkpoint.name=r1") == (f"starts a new run 'r1' in {runs}: random init of the built-in tiny Llama "
                                           f"(model.name_or_path=DIR trains your own)")
    assert would().startswith(f"starts a new run in {runs}, named raytrain-<date>-<time> (checkpoint.name names it)")
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000004", 4)
    assert would("checkpoint.name=ft", f"checkpoint.resume_from={source}") == (
        f"starts a new run 'ft' in {runs} from checkpoint.resume_from={source} (step 4: its weights, optimizer state "
        f"and data position)")
    run_with_checkpoints(runs, "r1", [8, 12])
    assert would("checkpoint.name=r1") == (f"finds run 'r1' exists in {runs}: continuing from its latest checkpoint "
                                           f"(step 12) (pass --fresh to start over; the old run is kept under another "
                                           f"name)")
    assert would("checkpoint.name=r1", steps=12).startswith(
        f"finds run 'r1' in {runs} is already done at step 12 (training.max_steps=12): nothing to train")
    assert would("checkpoint.name=r1", "--fresh") == (
        f"moves the existing run 'r1' to {runs}/r1.replaced-<date>-<time> (--fresh; nothing is deleted) and starts "
        f"it over: random init of the built-in tiny Llama (model.name_or_path=DIR trains your own)")
    assert would("checkpoint.name=r1", "--fresh", f"checkpoint.resume_from={source}").endswith(
        f"and starts it over from checkpoint.resume_from={source} (step 4: its weights, optimizer state and data "
        f"position)")
    assert sorted(os.listdir(runs)) == ["r1"]  # the dry run moved nothing
    # a real run prints the same continuing line, once placed
    place(runs, "checkpoint.name=r1")
    assert (f"raytrain: run 'r1' exists in {runs}: continuing from its latest checkpoint (step 12) (pass --fresh"
            in capsys.readouterr().out)


BATCH = ["data.num_shards=6", "training.micro_batch_size_per_gpu=2", "deepspeed.train_batch_size=12"]
"""6 shards and a global batch of 12: a checkpoint of 2 workers that 2, 3 or [2, 3] workers can resume (3:
tests/unit/checkpoint/test_reshard.py)."""


@pytest.mark.parametrize("workers, notes", [
    ("2", []),
    ("[2, 3]", ["resuming step 8 (written by 2 workers); a worker group of another size converts it to DeepSpeed's "
                "universal checkpoint first"]),
])
def test_resuming_on_the_same_workers_says_nothing_and_on_an_elastic_range_notes_the_conversion(
        workers, notes, tmp_path):
    from ray.train import Checkpoint

    from raytrain.driver.run import check_resume

    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000008", 8, *BATCH)
    run = resolved(f"scaling.num_workers={workers}", "training.max_steps=40", *BATCH,
                   f"checkpoint.resume_from={source}")
    assert check_resume(Checkpoint(source), run, own_run=False) == notes


ELASTIC_BATCH = ["data.num_shards=2", "training.micro_batch_size_per_gpu=2"]


@pytest.mark.parametrize("then, now, noted", [
    # an elastic run (its batch, 4, kept at every size) continued on a fixed 1 worker: "auto" derived 2 x 1 x 1 = 2
    (["scaling.num_workers=[1, 2]", *ELASTIC_BATCH], ["scaling.num_workers=1", *ELASTIC_BATCH], "4, and this run's is "
     "2 (micro-batch 2 x gradient accumulation 1 x 1 workers): from step 9 each step trains on 2 rows, at the same "
     "learning rates; to keep the checkpoint's batch, set deepspeed.train_batch_size=4"),
    # a fixed run continued on a range: derived at its maximum
    (["scaling.num_workers=2", *ELASTIC_BATCH], ["scaling.num_workers=[1, 2]", "data.num_shards=2",
                                                 "training.micro_batch_size_per_gpu=4"],
     "4, and this run's is 8 (micro-batch 4 x gradient accumulation 1 x the range's maximum 2 workers)"),
    # the batch written: kept
    (["scaling.num_workers=[1, 2]", *ELASTIC_BATCH], ["scaling.num_workers=1", *ELASTIC_BATCH,
                                                      "deepspeed.train_batch_size=4"], None),
])
def test_resuming_with_another_global_batch_notes_both(then, now, noted, tmp_path):
    """An "auto" train_batch_size follows the world size: continuing an elastic run, which kept its batch at
    every size, as a fixed-size one (or the other way) changed the rows of every step without a word."""
    from raytrain.driver.run import check_resume

    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    run = run_with_checkpoints(tmp_path / "runs", "r1", [8], storage, *then)
    now = resolved("training.max_steps=40", storage, "checkpoint.name=r1", *now)
    notes = [n for n in check_resume(layout.latest_checkpoint(run), now, own_run=True) if "train_batch_size" in n]
    if noted is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith("note: the checkpoint was trained with train_batch_size ") \
            and noted in notes[0], notes


SCHEDULER = 'deepspeed.scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}}'


@pytest.mark.parametrize("then, now, step, noted", [
    (["training.max_steps=20"], [], 20, True),  # raytrain's warmup + cosine both times, trained further: the rate jumps
    (["training.max_steps=60"], ["training.max_steps=30"], 40, False),  # the run is done: it trains nothing
    (["training.max_steps=20", SCHEDULER], [SCHEDULER], 20, False),  # DeepSpeed's scheduler: its own settings, state
    (["training.max_steps=20", SCHEDULER], [], 20, False),
    (["training.max_steps=20"], [SCHEDULER], 20, False),
])
def test_a_schedule_change_is_noted_only_for_raytrains_schedule_on_a_run_that_trains(then, now, step, noted, tmp_path):
    from raytrain.driver.run import check_resume

    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    run = run_with_checkpoints(tmp_path / "runs", "r1", [step], storage, *then)
    notes = check_resume(layout.latest_checkpoint(run), resolved(*TWO, storage, "checkpoint.name=r1", *now),
                         own_run=True)
    assert notes == (["note: the learning rate schedule changed since the checkpoint (training.max_steps 20 -> 40): "
                      "the warmup + cosine schedule is recomputed for the new settings, so step 21 trains at a "
                      "learning rate of 0.000775 where the checkpoint's schedule stood at 0.0001, with no warmup in "
                      "between"] if noted else [])


def test_a_checkpoint_that_does_not_record_whether_it_had_a_deepspeed_scheduler_gets_no_schedule_note(tmp_path):
    from ray.train import Checkpoint

    from raytrain.driver.run import _schedule_change

    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000020", 20, "training.max_steps=20")
    meta = layout.read_metadata(Checkpoint(source))
    assert len(_schedule_change(meta, resolved(*TWO))) == 1  # recorded: raytrain's schedule, stretched to 40 steps
    del meta["spec"]["deepspeed"]["has_scheduler"]  # an older raytrain's record: its rate at step 20 is unknown
    assert _schedule_change(meta, resolved(*TWO)) == []


def recorded_config(*overrides, **edits):
    """A run config as raytrain.json holds it, with `edits` ("section.key": value) written into it."""
    config = json.loads(json.dumps(load_config(None, list(overrides)).to_dict()))
    for key, value in edits.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


@pytest.mark.parametrize("then, now, changes", [
    ({}, {}, []),
    ({"data.num_builtin_documents": 4000}, {"data.num_builtin_documents": 100},
     ["data.num_builtin_documents=4000 -> 100"]),  # the built-in corpus: its size decides its rows
    ({"data.path": "/d.txt", "data.num_builtin_documents": 4000},
     {"data.path": "/d.txt", "data.num_builtin_documents": 100}, []),  # unused with a data path
    ({}, {"data.path": "/e.txt", "data.num_builtin_documents": 100}, ["data.path=None -> /e.txt"]),
    ({}, {"model.tokenizer": "/tok"}, ["tokenizer None -> /tok"]),
    ({"model.name_or_path": "/m"}, {"model.name_or_path": "/m", "model.tokenizer": "/m"}, []),  # the model's own
    ({"model.tokenizer": "/tok"}, {"model.name_or_path": "/tok"}, []),
])
def test_the_data_settings_that_place_the_rows_are_compared(then, now, changes):
    from raytrain.driver.run import _data_changes

    assert _data_changes(recorded_config(**then), recorded_config(**now)) == changes


def test_a_setting_the_checkpoint_does_not_record_is_not_compared():
    from raytrain.driver.run import _data_changes

    older = recorded_config()  # an older raytrain's raytrain.json: no model.tokenizer, no data.hf_split
    del older["model"]["tokenizer"], older["data"]["hf_split"]
    assert _data_changes(older, recorded_config(**{"model.tokenizer": "/tok", "data.hf_split": "test"})) == []


def test_a_checkpoint_in_cloud_storage_is_named_with_its_scheme(tmp_path):
    # Ray's Checkpoint.path of s3://bucket/runs/r1/... is bucket/runs/r1/...: printed as it is, it reads as a local
    # path. (An anonymous S3 filesystem object: nothing is read from it.)
    import pyarrow.fs
    from ray.train import Checkpoint

    from raytrain.driver.run import _shown

    s3 = pyarrow.fs.S3FileSystem(anonymous=True, region="us-east-1")
    latest = Checkpoint("bucket/runs/r1/checkpoint_step_00000004", filesystem=s3)
    cfg = load_config(None, ["checkpoint.storage_path=s3://bucket/runs", "checkpoint.name=r1"])
    assert _shown(latest, cfg, own_run=True) == "s3://bucket/runs/r1/checkpoint_step_00000004"
    source = "s3://bucket/old/checkpoint_step_00000004"  # resume_from: as the user wrote it
    given = load_config(None, ["checkpoint.storage_path=s3://bucket/runs", "checkpoint.name=r1",
                               f"checkpoint.resume_from={source}"])
    assert _shown(Checkpoint("bucket/old/checkpoint_step_00000004", filesystem=s3), given, own_run=False) == source


def test_the_run_storage_is_created_where_local_and_left_to_the_store_where_a_uri(tmp_path, monkeypatch):
    from raytrain.driver.run import _storage_path

    monkeypatch.chdir(tmp_path)
    assert _storage_path("a/runs") == str(tmp_path / "a" / "runs") and (tmp_path / "a" / "runs").is_dir()
    assert _storage_path("s3://bucket/runs") == "s3://bucket/runs" and os.listdir(tmp_path) == ["a"]
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"^checkpoint.storage_path=file/runs: cannot create it \(Not a directory\); "
                                          r"choose a writable directory or a cloud URI$"):
        _storage_path("file/runs")


def test_only_stopped_runs_with_generated_names_and_these_settings_are_offered_to_continue(tmp_path):
    storage = str(tmp_path / "runs")
    same = f"checkpoint.storage_path={storage}"
    run_with_checkpoints(storage, "raytrain-20260101-000001", [4], same)
    run_with_checkpoints(storage, "raytrain-20260101-000002", [4], same, "training.learning_rate=3e-4")
    run_with_checkpoints(storage, "raytrain-20260101-000003", [40], same)  # done: training.max_steps=40
    run_with_checkpoints(storage, "mine", [4], same)  # a chosen name: its own command continues it
    new = resolved(*TWO, same, "checkpoint.name=ignored")  # what names a run is not a setting
    assert unfinished_runs(storage, new, "raytrain-20990101-000000") == [("raytrain-20260101-000001", 4)]
    assert unfinished_runs(storage, new, "raytrain-20260101-000001") == []  # the run being started
    assert unfinished_runs(storage, new, "raytrain-20990101-000000", look_at=2) == []  # only the 2 newest are read
    os.makedirs(os.path.join(storage, "raytrain-20260102-000000", "tensorboard"))  # stopped before a checkpoint
    assert unfinished_runs(storage, new, "raytrain-20990101-000000", look_at=4) == [("raytrain-20260101-000001", 4)]
    assert unfinished_runs(str(tmp_path / "missing"), new, "raytrain-20990101-000000") == []  # nothing to list


def test_a_refused_resume_names_the_fix_for_a_checkpoint_given_or_the_runs_own(tmp_path):
    from ray.train import Checkpoint

    from raytrain.driver.run import check_resume

    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    run = run_with_checkpoints(tmp_path / "runs", "r1", [4])
    own = layout.latest_checkpoint(run)
    with pytest.raises(ConfigError, match=r"^checkpoint .*/r1/checkpoint_step_00000004 holds another model "
                                          r"\(num_hidden_layers=4, .*\): set the model back to the run's "
                                          r"\(model.name_or_path, model.config\), or pass --fresh to start over$"):
        check_resume(own, resolved(*TWO, storage, "checkpoint.name=r1", "model.config={num_hidden_layers: 5}"),
                     own_run=True)
    other = checkpoint(tmp_path / "other" / "checkpoint_step_00000008", 8, "model.config={num_hidden_layers: 5}")
    with pytest.raises(ConfigError, match=rf"^checkpoint {other} holds another model \(num_hidden_layers=5, .*\): give "
                                          r"checkpoint.resume_from a checkpoint of this model, or set the model to the "
                                          r"checkpoint's \(model.name_or_path, model.config\)$"):
        check_resume(Checkpoint(other), resolved(*TWO, f"checkpoint.resume_from={other}"), own_run=False)
    source = checkpoint(tmp_path / "old" / "checkpoint_step_00000008", 8)
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume_from={source} is set but run 'r1' already exists in "
                                          r".* \(started without one\), and it would continue"):
        place(tmp_path / "runs", "checkpoint.name=r1", f"checkpoint.resume_from={source}")
    # 4 shards on 2 workers, resumed with one shard per worker
    sharded = checkpoint(tmp_path / "sharded" / "checkpoint_step_00000008", 8, "data.num_shards=4")
    with pytest.raises(ConfigError) as e:
        check_resume(Checkpoint(sharded), resolved(*TWO, f"checkpoint.resume_from={sharded}"), own_run=False)
    assert str(e.value) == (f"checkpoint {sharded} was written with 4 data shards and this run has 2 (one per "
                            f"worker) on as many workers: its data position is the rows read from each of its shards, "
                            f"which another count cannot place: set data.num_shards back to 4")


def test_what_fresh_sets_aside_is_a_file_or_a_directory_that_holds_anything(tmp_path):
    from raytrain.driver.run import _not_empty

    (tmp_path / "empty").mkdir()
    (tmp_path / "full" / "tensorboard").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    assert [_not_empty(str(tmp_path / p)) for p in ("empty", "full", "file", "missing")] == [False, True, True, False]
    # storage pyarrow cannot open (an unknown scheme: ArrowInvalid): False where asked to be quiet, else its error
    assert _not_empty("nosuchscheme://bucket/out", quiet=True) is False
    with pytest.raises(ValueError, match="nosuchscheme"):
        _not_empty("nosuchscheme://bucket/out")


@pytest.mark.usefixtures("no_ray_driver")
@pytest.mark.parametrize("argv", [["scaling.num_workers=3"], ["scaling.num_workers=2", "data.num_shards=4"]])
def test_a_done_run_on_another_number_of_workers_or_shards_says_it_is_done(argv, tmp_path, capsys):
    # was: refused, naming data.num_shards ("... else resume on 2 workers"), though a done run starts no worker and
    # reads no data: the same command on a cluster of another size (scaling.num_workers unset) exports it
    runs = tmp_path / "runs"
    run_with_checkpoints(runs, "r1", [40])  # 2 workers, one data shard each
    rc, err = dry(capsys, f"checkpoint.storage_path={runs}", "checkpoint.name=r1", "training.max_steps=40", *argv)
    assert rc == 0, err
    assert [line for line in err if "a real run now" in line or "resuming step" in line] == [
        f"raytrain: note: a real run now finds run 'r1' in {runs} is already done at step 40 (training.max_steps=40): "
        f"nothing to train (raise training.max_steps to train further, or pass --fresh to start over; the old run is "
        f"kept under another name)"]


@pytest.mark.usefixtures("no_ray_driver")
def test_a_done_run_whose_export_dir_cannot_be_reached_is_one_line(tmp_path, capsys):
    # was: pyarrow's traceback (exit 1): without Azure credentials its abfs:// filesystem raises a bare
    # ArrowException, which the look at a done run's export_dir let through instead of leaving it to the path checks
    runs = tmp_path / "runs"
    run_with_checkpoints(runs, "r1", [40])  # TWO: training.max_steps=40
    out = "abfs://raytrain@acct.dfs.core.windows.net/out"
    rc, err = dry(capsys, f"checkpoint.storage_path={runs}", "checkpoint.name=r1", f"checkpoint.export_dir={out}", *TWO)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"raytrain: error: checkpoint.export_dir={out}: cannot reach it ("), err


def cut_short(path):
    """`path` replaced by a real torch.save archive cut in half, as a copy or sync that stopped leaves it."""
    import torch

    torch.save({"state": torch.zeros(256)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.usefixtures("no_ray_driver")
@pytest.mark.parametrize("damage", ["deleted", "cut short"])
def test_a_runs_own_latest_checkpoint_missing_or_cutting_short_a_shard_is_one_line_naming_an_earlier_one(
        damage, tmp_path, capsys):
    # The run's own latest checkpoint was not checked at all (only --resume-from's): every worker failed at
    # DeepSpeed's load, checkpoint.max_failures + 1 times (measured: a truncated optimizer shard, 4 attempts,
    # 2 minutes, 168 lines of tracebacks, exit 1).
    storage = tmp_path / "runs"
    run = run_with_checkpoints(storage, "r1", [4, 8])
    shard = os.path.join(run, "checkpoint_step_00000008", "step_00000008", SHARDS[3])
    os.remove(shard) if damage == "deleted" else cut_short(shard)
    rc, err = dry(capsys, f"checkpoint.storage_path={storage}", "checkpoint.name=r1", *TWO)
    assert rc == 2 and len(err) == 1, err
    problem = ("is incomplete: raytrain.json says 2 workers wrote it, and its DeepSpeed tag step_00000008/ has no "
               "zero_pp_rank_1_mp_rank_00_optim_states.pt (a save cut short, or files deleted)" if damage == "deleted"
               else "is damaged: its shard file step_00000008/zero_pp_rank_1_mp_rank_00_optim_states.pt is cut short "
               "(a torch.save archive without its end: a save or copy that stopped, or a full disk; DeepSpeed cannot "
               "load it)")
    assert err[0] == (f"raytrain: error: run 'r1''s latest checkpoint {run}/checkpoint_step_00000008 {problem}: Ray "
                      f"Train continues run 'r1' from its latest checkpoint only: put the files back, or continue from "
                      f"its latest complete one under a new name (--resume-from {run}/checkpoint_step_00000004 "
                      f"checkpoint.name=NEW_NAME), or pass --fresh to start over (the old run is kept under another "
                      f"name)")
    # that earlier one is accepted as the line says, and --fresh sets the run aside
    assert dry(capsys, "--resume-from", f"{run}/checkpoint_step_00000004", f"checkpoint.storage_path={storage}",
               "checkpoint.name=r2", *TWO)[0] == 0
    assert dry(capsys, f"checkpoint.storage_path={storage}", "checkpoint.name=r1", "--fresh", *TWO)[0] == 0
