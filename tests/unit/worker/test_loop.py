"""The worker loop without Ray (raytrain.worker.loop.Trainer): two gloo ranks, a real DeepSpeed ZeRO-3
engine built by the worker's own build_engine from a RunSpec, a transformers Llama, real checkpoints
and evaluation on the engine. Only `report` (the loop's one call into Ray Train) is this test's:
it merges the ranks' checkpoint files into one directory, as Ray Train does.

The components decide when they are due: windows at every log step, at every checkpoint and at the
end; a resume from the step-3 checkpoint continues with bit-identical losses (CPU, fp32), each rank
reading only its own shards from storage Ray treats as remote. The same
ranks check raytrain.model.build_model under ZeRO-3 against transformers without DeepSpeed."""

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import init_gloo, remote_local_filesystem

MAX_STEPS = 6
OVERRIDES = ["training.max_steps=6", "training.log_every_n_steps=2", "checkpoint.every_n_steps=3",
             "training.micro_batch_size_per_gpu=2", "training.gradient_accumulation_steps=2", "data.seq_len=32",
             "data.eval_fraction=0.5", "data.eval_max_batches=4", "training.warmup_steps=2"]


class Batches:
    """The loop's data: fixed micro-batches per rank, with the position MicroBatches reports."""

    def __init__(self, rank: int, start: int = 0):
        g = torch.Generator().manual_seed(100 + rank)
        self._data = torch.randint(0, 257, (64, 2, 32), generator=g)
        self._next = start

    def __next__(self):
        batch = {"input_ids": self._data[self._next % 64]}
        self._next += 1
        return batch

    def position(self):
        return {"epoch": 0, "rows": self._next}


def _rank_main(rank, world, out_dir, resume_step):
    init_gloo(rank, world, f"{out_dir}/rendezvous-{resume_step}")
    from ray.train import Checkpoint  # a plain class: no Ray cluster is started

    from raytrain.checkpoint.shards import Checkpointer, Rank, ResumePoint, restore
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape, RunSpec
    from raytrain.worker.engine import build_engine
    from raytrain.worker.evaluation import Evaluator
    from raytrain.worker.loop import Trainer
    from raytrain.worker.metrics import StepMeter, TrainMetrics
    from raytrain.worker.tracking import Tracker

    cfg = load_config(None, OVERRIDES + [f"checkpoint.storage_path={out_dir}/runs"])
    spec = RunSpec.place(resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=False)), run_name="loop",
                         storage_path=f"{out_dir}/runs", resume_from=None)
    device = torch.device("cpu")
    engine, scheduler, _ = build_engine(spec, device)
    initial = None if resume_step else _weight_stats(engine.module)  # before training changes them
    storage = f"{out_dir}/storage"
    start, history, data_state = 0, [], {}
    opened = []
    if resume_step:  # from storage Ray treats as remote (s3://, gs://, abfs://): each rank reads only its own part
        remote = remote_local_filesystem(opened)
        resume = ResumePoint(Checkpoint(f"{storage}/checkpoint_step_{resume_step:08d}", filesystem=remote),
                             step=resume_step, written_by=world)
        start, history, data_state = restore(engine, resume, seed=cfg.training.seed, rank=rank)
    reports = []

    def report(metrics, checkpoint, step):
        if checkpoint is not None:  # every rank's files into one directory, as Ray Train merges them
            shutil.copytree(checkpoint, f"{storage}/checkpoint_step_{step:08d}", dirs_exist_ok=True)
            shutil.rmtree(checkpoint)
        reports.append({"step": step, "checkpoint": checkpoint is not None, "metrics": metrics})

    eval_batches = [{"input_ids": torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(7 + i))}
                    for i in range(3 if rank == 0 else 1)]  # uneven: every rank must stop after 1
    meter = StepMeter(max_steps=MAX_STEPS, tokens_per_step=spec.tokens_per_step, flops_per_token=1.0,
                      peak_flops_total=None)
    trainer = Trainer(engine=engine, scheduler=scheduler, batches=Batches(rank, data_state.get("rows", 0)),
                      grad_accum=spec.deepspeed.gradient_accumulation_steps, device=device,
                      metrics=TrainMetrics(meter, 2, device, start, announce=False),
                      checkpointer=Checkpointer(engine, spec, spec.to_dict(), Rank(world=rank, world_size=world)),
                      evaluator=Evaluator(engine, lambda: iter(eval_batches), device, 0, 4),
                      tracker=Tracker(cfg.tracking, spec.storage_path, spec.run_name, {}, active=False),
                      report=report, start_step=start, max_steps=MAX_STEPS, history=history, is_rank0=rank == 0)
    trainer.train()
    builds = {} if resume_step else _model_builds(spec, initial, out_dir)  # after training: they draw random numbers
    with open(f"{out_dir}/{'resumed' if resume_step else 'full'}-rank{rank}.json", "w") as f:
        json.dump({"reports": reports, "history": history, "builds": builds, "opened": opened}, f)
    dist.destroy_process_group()


def _weight_stats(model):
    """{name: (mean, std)} of every parameter, gathered whole from its ZeRO-3 partitions."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: (p.float().mean().item(), p.float().std().item()) for name, p in params.items()}


def _model_builds(spec, initial, out_dir):
    """What raytrain.model.build_model makes under ZeRO-3 on these 2 ranks, against transformers'
    from_config without DeepSpeed: the engine's initial weights (`initial`), a tied bf16 model's
    RoPE buffers and tied weights, and a build for a checkpoint restore with model.pretrained=true
    naming a directory that does not exist (no weight may be read)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from raytrain.model import build_model, config_from_facts

    cfg = spec.config.model
    hf_config = config_from_facts(spec.model, cfg)
    torch.manual_seed(0)
    reference = _weight_stats(AutoModelForCausalLM.from_config(hf_config))  # no HfDeepSpeedConfig alive: plain
    bf16 = {**spec.ds_config, "bf16": {"enabled": True}}
    tied_config = config_from_facts(spec.model, cfg)
    tied_config.tie_word_embeddings = True
    tied = build_model(cfg, tied_config, bf16)
    gone = dataclasses.replace(cfg, name_or_path=f"{out_dir}/no-such-model", pretrained=True)
    restored = build_model(gone, config_from_facts(spec.model, cfg), spec.ds_config, from_checkpoint=True)
    return {"initial": initial, "reference": reference,
            "tied": {"same_tensor": tied.lm_head.weight is tied.model.embed_tokens.weight,
                     "weight_dtype": str(tied.model.embed_tokens.weight.dtype),
                     "inv_freq_dtype": str(tied.model.rotary_emb.inv_freq.dtype)},
            "restored": {"inv_freq_dtype": str(restored.model.rotary_emb.inv_freq.dtype),
                         "num_params": sum(p.ds_numel for p in restored.parameters()),
                         "expected_params": spec.model.num_parameters}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop")
    for resume_step in (0, 3):
        mp.start_processes(_rank_main, args=(2, str(out), resume_step), nprocs=2, join=True,
                           start_method="spawn")
    return {name: [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(2)]
            for name in ("full", "resumed")} | {"dir": out}


def test_components_decide_when_windows_checkpoints_and_evaluation_happen(runs):
    full = runs["full"][0]["reports"]
    # log every 2, checkpoint every 3 and at the end: windows at 2, 3, 4 and 6, checkpoints at 3 and 6
    assert [(r["step"], r["checkpoint"]) for r in full] == [(2, False), (3, True), (4, False), (6, True)]
    assert ["eval_loss" in r["metrics"] for r in full] == [False, False, False, True]  # eval_every 0: the end
    assert {"checkpoint_save_s", "checkpoint_size_gib"} <= set(full[1]["metrics"])
    # every rank reports the same reduced numbers (mean loss over ranks, slowest rank's data wait)
    # and the same window timing (the slowest rank's): ReportGate's decisions rest on it
    reduced = [[(r["metrics"]["loss"], r["metrics"]["data_wait_frac"], r["metrics"]["step_time_s"])
                for r in rank["reports"]] for rank in runs["full"]]
    assert reduced[0] == reduced[1]
    assert runs["full"][0]["history"] == [r["metrics"] for r in full]


def test_evaluation_on_the_engine_agrees_across_uneven_ranks(runs):
    last = [rank["reports"][-1]["metrics"] for rank in runs["full"]]
    assert last[0]["eval_loss"] == last[1]["eval_loss"] and 0 < last[0]["eval_loss"] < 10
    assert last[0]["eval_ppl"] == pytest.approx(torch.tensor(last[0]["eval_loss"]).exp().item(), rel=1e-6)


def test_checkpoint_holds_every_rank_shard_and_the_contract(runs):
    ckpt = runs["dir"] / "storage" / "checkpoint_step_00000003"
    meta = json.loads((ckpt / "raytrain.json").read_text())
    assert meta["step"] == 3 and meta["spec"]["run_name"] == "loop" and len(meta["history"]) == 2
    shards = sorted(p.name for p in (ckpt / "step_00000003").iterdir() if "optim_states" in p.name)
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_resume_from_a_checkpoint_continues_with_identical_losses(runs):
    full = {r["step"]: r["metrics"] for r in runs["full"][0]["reports"]}
    resumed = {r["step"]: r["metrics"] for r in runs["resumed"][0]["reports"]}
    assert sorted(resumed) == [4, 6]
    for step in (4, 6):
        assert (resumed[step]["loss"], resumed[step]["lr"]) == (full[step]["loss"], full[step]["lr"]), step
    assert [m["step"] for m in runs["resumed"][0]["history"]] == [2, 3, 4, 6]  # history restored, then extended
    # the restart is in the history itself: its first window says where it resumed from
    assert resumed[4]["resumed_from_step"] == 3 and resumed[4]["resume_s"] > 0 and "resumed_from_step" not in resumed[6]
    assert not any("resumed_from_step" in m for m in full.values())


def test_a_remote_checkpoint_is_read_by_each_rank_without_the_other_ranks_shards(runs):
    # Ray's as_directory would download every rank's shards on every node; DeepSpeed reads only its own.
    for rank, run in enumerate(runs["resumed"]):
        names = [os.path.relpath(path, runs["dir"] / "storage" / "checkpoint_step_00000003") for path in run["opened"]]
        shards = sorted(name for name in names if re.search(r"zero_pp_rank_\d+_", name))
        assert shards == [f"step_00000003/zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                          f"step_00000003/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"], names
        assert {"latest", "raytrain.json"} <= set(names), names


def test_random_init_is_the_models_own_init_under_zero3(runs):
    # A bare zero.Init around from_config left _init_weights on empty partitions: the embedding kept
    # PyTorch's std 1.0 (not initializer_range 0.02), every projection nn.Linear's default (std 0.072), and
    # a run from scratch started at loss 43 instead of ln(vocab). transformers' own ZeRO-3 path inits
    # each module gathered, on rank 0: every rank holds the same weights, distributed as without DeepSpeed.
    ranks = [rank["builds"] for rank in runs["full"]]
    assert ranks[0]["initial"] == ranks[1]["initial"]
    initial, reference = ranks[0]["initial"], ranks[0]["reference"]
    assert initial.keys() == reference.keys() and "model.embed_tokens.weight" in initial
    for name, (mean, std) in initial.items():
        ref_mean, ref_std = reference[name]
        assert std == pytest.approx(ref_std, rel=0.1, abs=1e-6) and mean == pytest.approx(ref_mean, abs=0.01), name
    assert initial["model.embed_tokens.weight"][1] == pytest.approx(0.02, rel=0.1)


def test_a_tied_bf16_build_and_a_checkpoint_restores_build_keep_rope_in_fp32(runs):
    builds = runs["full"][0]["builds"]
    # bf16: the weights in bf16, RoPE's inv_freq in fp32 (zero.Init alone made it bf16: positions off by up to
    # 1.8e-4 at head_dim 16, and the export, which recomputes it in fp32, did not match the trained model)
    assert builds["tied"] == {"same_tensor": True, "weight_dtype": "torch.bfloat16", "inv_freq_dtype": "torch.float32"}
    # model.pretrained=true and a checkpoint to restore: built from the config, its weights never read (the
    # directory does not exist; from_pretrained raised OSError)
    restored = builds["restored"]
    assert restored["inv_freq_dtype"] == "torch.float32" and restored["num_params"] == restored["expected_params"]


def test_report_gate_sends_every_checkpoint_and_a_metrics_window_once_per_controller_poll():
    from raytrain.worker.loop import ReportGate

    # windows of 0.5 s (step_time_s x the steps since the last window), the controller polling every 2 s
    gate = ReportGate(poll_s=2.0)
    windows = [(1, False), (2, False), (3, True), (4, False), (5, False), (6, False), (7, False), (8, False),
               (10, False), (12, False), (14, True), (16, False)]
    sent = [step for step, ckpt in windows if gate.due({"step_time_s": 0.5}, step, ckpt)]
    # the first window; every checkpoint; a metrics window once 2 s have passed since the last report
    assert sent == [1, 3, 7, 12, 14]
    slow = ReportGate(poll_s=2.0)  # windows longer than a poll: every one goes
    assert all(slow.due({"step_time_s": 2.5}, step, False) for step in range(1, 6))


def test_the_worker_holds_back_torchs_barrier_device_warning_and_only_it():
    """Ray Train creates the process group without device_id; torch then warns at each of DeepSpeed's barriers
    on rank 0 that it uses the current device, which the worker has set to Ray's: two lines per engine build and
    per checkpoint on a GPU, and nothing to act on."""
    import warnings

    from raytrain.worker.engine import import_deepspeed

    with warnings.catch_warnings(record=True) as seen:
        import_deepspeed(torch.device("cpu"))
        warnings.warn("barrier(): using the device under current context. You can specify `device_id` in "
                      "`init_process_group` to mute this warning.", UserWarning)
        warnings.warn("barrier(): some other warning", UserWarning)
    assert [str(w.message) for w in seen] == ["barrier(): some other warning"]


def test_a_gpu_out_of_memory_is_one_line_naming_the_settings_and_the_fix(tmp_path):
    # On an H100 an out-of-memory error in a step was retried as a worker failure until the call's limit: the same
    # settings run out at the same place after every restart. Now it stops the run like a full disk (exit 2).
    from raytrain.config import load_config
    from raytrain.data.bad_records import SetupMistake
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape, RunSpec
    from raytrain.worker.loop import gpu_memory_mistake, gpu_memory_stops_the_run

    cfg = load_config(None, ["training.micro_batch_size_per_gpu=3", f"checkpoint.storage_path={tmp_path}"])
    spec = RunSpec.place(resolve_run(cfg, ClusterShape(num_workers=1, use_gpu=False)), run_name="oom-run",
                         storage_path=str(tmp_path), resume_from=None)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 440.00 MiB. GPU 0 has a total capacity of "
                                   "79.18 GiB of which 378.12 MiB is free. Including non-PyTorch memory, ...")
    mistake = gpu_memory_mistake(spec, "in step 7", int(77.47 * 2**30), int(79.18 * 2**30), error)
    assert isinstance(mistake, SetupMistake) and mistake.where.startswith("node ")
    assert mistake.what == ("a GPU ran out of memory in step 7 (tried to allocate 440.00 MiB; 77.5 GiB allocated at the "
                            "peak of 79.2 GiB) at micro-batch 3, model.gradient_checkpointing=false")
    assert mistake.fix.startswith("lower training.micro_batch_size_per_gpu, or set model.gradient_checkpointing=true")
    assert mistake.fix.endswith("then the same command with checkpoint.name=oom-run continues from the latest "
                                "checkpoint")
    assert "\n" not in mistake.line()
    # a CPU worker's allocator raises no OutOfMemoryError of its own: one that arrives there passes through as it is
    with pytest.raises(torch.OutOfMemoryError):
        with gpu_memory_stops_the_run(spec, torch.device("cpu"), lambda: "in step 1"):
            raise error


def test_an_asynchronous_upload_into_a_full_storage_stops_the_run_instead_of_failing_its_thread(tmp_path):
    # Ray's own upload (a real StorageContext, pyarrow's copy_files) into a storage whose file is /dev/full: ENOSPC.
    # Ray's ASYNC thread turns an exception into a worker failure, which Ray Train retried; the wrapped upload calls
    # storage_full (Checkpointer.storage_full: the one-line stop) first. Other errors stay Ray's.
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.storage import StorageContext

    from raytrain.worker.loop import _stop_when_full

    local = tmp_path / "local"
    local.mkdir()
    (local / "raytrain.json").write_text("{}")
    storage = StorageContext(storage_path=str(tmp_path / "runs"), experiment_dir_name="run")
    (tmp_path / "runs" / "run" / "checkpoint_step_00000002").mkdir(parents=True)
    os.symlink("/dev/full", tmp_path / "runs" / "run" / "checkpoint_step_00000002" / "raytrain.json")
    stops = []
    upload = _stop_when_full(lambda: stops.append("stopped"), persist=storage.persist_current_checkpoint)
    with pytest.raises(OSError):
        upload(Checkpoint.from_directory(str(local)), "checkpoint_step_00000002")
    assert stops == ["stopped"]
    stored = upload(Checkpoint.from_directory(str(local)), "checkpoint_step_00000004")  # space: as Ray's own
    assert json.loads((tmp_path / "runs" / "run" / "checkpoint_step_00000004" / "raytrain.json").read_text()) == {}
    assert stored.path.endswith("run/checkpoint_step_00000004") and stops == ["stopped"]
    with pytest.raises(FileNotFoundError):  # not a full storage: raised as it was, not a stop
        upload(Checkpoint.from_directory(str(tmp_path / "gone")), "checkpoint_step_00000006")
    assert stops == ["stopped"]
