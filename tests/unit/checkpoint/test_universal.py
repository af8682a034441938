"""A ZeRO-3 checkpoint written by 2 ranks, converted by raytrain.checkpoint.reshard (DeepSpeed's
ds_to_universal in a child process) and loaded by 3 ranks through raytrain.checkpoint.shards.restore:
real DeepSpeed engines from the worker's own build_engine, gloo, a transformers Llama, no Ray.

- Every parameter group keeps its own settings: DeepSpeed's universal load gives every group group
  0's (stage3.py:3684-3691), so without raytrain's fix the no-decay group (biases, norms) decays.
- Every sub-group counts its own Adam steps: DeepSpeed's load hands them one shared step tensor,
  which torch's Adam increments once per sub-group (without the fix the no-decay group's step 2
  bias-corrects as step 3, and the loss of step 3 is 1e-5 off).
- The steps on 3 ranks, from the converted checkpoint, have the losses of the same steps on the 2
  ranks that wrote it (same global batch, summed in another order: fp32 rounding only), the same
  learning rate, and the history and data position of the checkpoint."""

import json
import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import init_gloo

# a global batch of 12 rows: micro-batches of 2, accumulation 3 on 2 ranks, 2 on 3 ranks
OVERRIDES = ["training.max_steps=4", "training.micro_batch_size_per_gpu=2", "deepspeed.train_batch_size=12",
             "data.seq_len=32", "training.warmup_steps=1", "training.learning_rate=0.01"]
GLOBAL = torch.randint(0, 257, (3, 12, 32), generator=torch.Generator().manual_seed(3))  # steps 1 to 3


def _rank_main(rank, world, out_dir, phase):
    init_gloo(rank, world, f"{out_dir}/rendezvous-{phase}")
    from ray.train import Checkpoint  # a plain class: no Ray cluster is started

    from raytrain import compat
    from raytrain.checkpoint.shards import Checkpointer, Rank, ResumePoint, restore
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape, RunSpec
    from raytrain.worker.engine import build_engine, train_step

    cfg = load_config(None, OVERRIDES + [f"checkpoint.storage_path={out_dir}"])
    spec = RunSpec.place(resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=False)), run_name="run",
                         storage_path=out_dir, resume_from=None)
    grad_accum = spec.deepspeed.gradient_accumulation_steps
    ckpt = f"{out_dir}/run/checkpoint_step_00000001"
    universal = f"{out_dir}/run/universal/checkpoint_step_00000001" if phase == "universal" else None
    ds_config = spec.ds_config
    if universal:
        ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
    engine, scheduler, _ = build_engine(spec, torch.device("cpu"), ds_config)

    def step(n):
        rows = GLOBAL[n - 1].chunk(world)[rank]  # this rank's share of the global batch, in micro-batches
        loss, _ = train_step(engine, iter({"input_ids": m} for m in rows.split(2)), grad_accum, torch.device("cpu"))
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss.item()

    out = {}
    if phase == "save":  # step 1, its checkpoint, then step 2 as the reference
        step(1)
        local = Checkpointer(engine, spec, spec.to_dict(), Rank(world=rank, world_size=world)).save(
            1, {"step": 1}, [{"step": 1}], {"epoch": 0, "rows": 6})
        shutil.copytree(local, ckpt, dirs_exist_ok=True)  # every rank's files into one directory, as Ray Train does
        shutil.rmtree(local)
    else:  # step 2 from the universal copy
        resume = ResumePoint(Checkpoint(ckpt), step=1, written_by=2, universal=universal)
        out = dict(zip(("start", "history", "data"), restore(engine, resume, seed=cfg.training.seed, rank=rank)))
    optimizer = compat.zero_basic_optimizer(engine)
    out.update(weight_decay=[g["weight_decay"] for g in optimizer.param_groups], lr=scheduler.get_last_lr()[0],
               losses=[step(2), step(3)],  # step 3 after the first update from the loaded state
               adam_steps=sorted(float(state["step"]) for state in optimizer.state.values()))
    with open(f"{out_dir}/{phase}-rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _spawn(world, out_dir, phase):
    mp.start_processes(_rank_main, args=(world, str(out_dir), phase), nprocs=world, join=True,
                       start_method="spawn")
    return json.loads((out_dir / f"{phase}-rank0.json").read_text())


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from ray.train import Checkpoint

    from raytrain.checkpoint import reshard

    out = tmp_path_factory.mktemp("universal")
    # a dead group of 3 left its rank 2's shards of step 1 (uploaded, never registered): the save removes them
    dead = out / "run" / "checkpoint_step_00000001" / "step_00000001"
    dead.mkdir(parents=True)
    for kind in ("model", "optim"):
        torch.save({"a dead group's": kind}, dead / f"zero_pp_rank_2_mp_rank_00_{kind}_states.pt")
    plain = _spawn(2, out, "save")
    left = sorted(p.name for p in dead.iterdir() if "rank_2" in p.name)
    target = str(out / "run" / "universal" / "checkpoint_step_00000001")
    assert not os.path.exists(os.path.dirname(target))  # the run's first conversion makes universal/ itself
    with reshard.Conversion(Checkpoint(str(out / "run" / "checkpoint_step_00000001")), 1, target) as conversion:
        conversion.start()
        gib, converting, total = conversion.finish()
    assert 0 < converting <= total
    stale = out / "run" / "universal" / "checkpoint_step_00000000"
    stale.mkdir()  # an older copy: removed once the new one is complete
    reshard.prune(str(out / "run"), keep=target)
    return {"plain": plain, "universal": _spawn(3, out, "universal"), "gib": gib, "dir": out, "left": left}


def test_a_save_replaces_what_a_dead_group_left_of_its_step(loaded):
    # Ray Train uploads into the directory as it stands: the conversion (and the export) read every shard file
    assert loaded["left"] == []


def test_every_param_group_keeps_its_settings_after_a_universal_load(loaded):
    assert loaded["plain"]["weight_decay"] == [0.1, 0.0]
    assert loaded["universal"]["weight_decay"] == [0.1, 0.0]  # DeepSpeed alone gives [0.1, 0.1]


def test_every_sub_group_counts_its_own_adam_steps(loaded):
    assert loaded["plain"]["adam_steps"] == [3.0, 3.0]
    assert loaded["universal"]["adam_steps"] == [3.0, 3.0]  # DeepSpeed alone gives one shared counter: [5.0, 5.0]


def test_the_converted_checkpoint_continues_the_run_on_three_ranks(loaded):
    plain, universal = loaded["plain"], loaded["universal"]
    assert (universal["start"], universal["history"], universal["data"]) == (1, [{"step": 1}], {"epoch": 0, "rows": 6})
    # the reference went on from step 1 without a reload (a same-size reload is bit-exact: test_loop.py)
    assert universal["lr"] == plain["lr"]
    assert universal["losses"] == pytest.approx(plain["losses"], rel=1e-6)  # reduction order only


def test_the_copy_is_complete_and_the_only_one(loaded):
    from raytrain.checkpoint import reshard

    universal = loaded["dir"] / "run" / "universal"
    assert reshard.is_complete(str(universal / "checkpoint_step_00000001")) and loaded["gib"] > 0
    assert sorted(p.name for p in universal.iterdir()) == ["checkpoint_step_00000001"]
    # the GiB reported are the converter's output as stored (the marker aside)
    written = sum(f.stat().st_size for f in (universal / "checkpoint_step_00000001").rglob("*")
                  if f.is_file() and f.name != "raytrain.json")
    assert loaded["gib"] == pytest.approx(written / 2**30)
    assert (universal / "checkpoint_step_00000001" / "step_00000001_universal").is_dir()


def test_a_failed_conversion_raises_with_the_converters_output_and_stores_nothing(tmp_path):
    from ray.train import Checkpoint

    from raytrain.checkpoint import reshard

    (tmp_path / "ckpt").mkdir()  # a checkpoint without its shards (step_00000001/)
    (tmp_path / "ckpt" / "raytrain.json").write_text("{}")
    target = tmp_path / "run" / "universal" / "c"
    with reshard.Conversion(Checkpoint(str(tmp_path / "ckpt")), 1, str(target)) as conversion:
        conversion.start()
        with pytest.raises(RuntimeError, match=rf"(?s)ds_to_universal failed on {tmp_path}/ckpt:\n.*step_00000001") \
                as e:
            conversion.finish()
        with open(os.path.join(conversion._tmp, "convert.log")) as log:
            assert str(e.value).endswith(":\n" + log.read()[-4000:])  # the whole log, or its end if long
    assert not target.exists() and not reshard.is_complete(str(target))


def test_leaving_a_conversion_early_kills_the_converter_and_removes_its_scratch(tmp_path):
    from ray.train import Checkpoint

    from raytrain.checkpoint import reshard

    (tmp_path / "ckpt").mkdir()
    with reshard.Conversion(Checkpoint(str(tmp_path / "ckpt")), 1, str(tmp_path / "copy")) as conversion:
        conversion.start()  # still importing DeepSpeed when the group is shut down
    assert conversion._proc.poll() == -signal.SIGKILL
    assert not os.path.exists(conversion._tmp)
    with reshard.Conversion(Checkpoint(str(tmp_path / "ckpt")), 1, str(tmp_path / "copy")):
        pass  # never started (rank 0 gone before it began): nothing to kill, no error


def test_a_checkpoint_and_out_dir_given_as_uris_export_where_they_say(loaded, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from raytrain.checkpoint.export import export

    monkeypatch.chdir(tmp_path)
    checkpoint = f"file://{loaded['dir']}/run/checkpoint_step_00000001"
    assert export(checkpoint, f"file://{tmp_path}/models/m1") == str(tmp_path / "models" / "m1")
    assert os.listdir(tmp_path) == ["models"]  # not a directory named "file:" in the working directory
    weights = load_file(tmp_path / "models" / "m1" / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and (tmp_path / "models" / "m1" / "config.json").is_file()
