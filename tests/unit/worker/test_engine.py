"""raytrain.worker.engine on a resume: the learning rate each param group trains the first resumed step at, on a
real DeepSpeed ZeRO-3 engine (gloo, CPU, one rank) loading a real checkpoint. Its own process: DeepSpeed keeps
process-wide state."""

import json

import torch.multiprocessing as mp

from tests.helpers import init_gloo

TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=1",
        "model.config.num_attention_heads=2", "data.seq_len=16", "training.micro_batch_size_per_gpu=2",
        "training.warmup_steps=1", "training.learning_rate=0.01", "scaling.num_workers=1", "scaling.use_gpu=false"]


def _rank_main(rank, out_dir):
    init_gloo(rank, 1, f"{out_dir}/rendezvous")
    import torch

    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape, RunSpec
    from raytrain.worker.engine import after_checkpoint_load, build_engine, train_step, warmup_cosine

    def engine_for(max_steps):
        cfg = load_config(None, TINY + [f"training.max_steps={max_steps}", f"checkpoint.storage_path={out_dir}"])
        spec = RunSpec.place(resolve_run(cfg, ClusterShape(num_workers=1, use_gpu=False)), run_name="engine",
                             storage_path=out_dir, resume_from=None)
        engine, scheduler, _ = build_engine(spec, torch.device("cpu"))
        return engine, scheduler, cfg.training

    def lrs(engine):
        return [group["lr"] for group in engine.optimizer.param_groups]

    g = torch.Generator().manual_seed(0)
    batches = iter([{"input_ids": torch.randint(0, 257, (2, 16), generator=g)} for _ in range(8)])
    engine, _, training = engine_for(4)
    for _ in range(2):
        train_step(engine, batches, 1, torch.device("cpu"))
    engine.save_checkpoint(f"{out_dir}/ckpt", tag="step_2")
    result = {"saved": lrs(engine), "max_steps_4": warmup_cosine(training)(2)}
    for max_steps in (4, 8):  # the same schedule; training.max_steps raised to train further
        engine, scheduler, training = engine_for(max_steps)
        engine.load_checkpoint(f"{out_dir}/ckpt")
        after_checkpoint_load(engine)
        result[f"resumed_{max_steps}"] = lrs(engine)
        result[f"factor_{max_steps}"] = warmup_cosine(training)(scheduler.last_epoch)
    with open(f"{out_dir}/result.json", "w") as f:
        json.dump(result, f)


def test_the_first_resumed_step_trains_at_this_runs_schedule(tmp_path):
    """training.max_steps 4 -> 8 at step 2: the optimizer state loaded the rate the old schedule set for step 3
    (0.01 x 0.775), and step 3 trained at it; the driver's note says 0.01 x 0.955 (the new cosine's), as steps 4 on
    follow."""
    mp.start_processes(_rank_main, args=(str(tmp_path),), nprocs=1, join=True, start_method="spawn")
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["saved"]) == 2  # decayed and not-decayed parameters
    assert result["saved"] == [0.01 * result["max_steps_4"]] * 2
    assert result["resumed_4"] == result["saved"]  # bit-identical when nothing changed
    assert result["factor_8"] != result["factor_4"]
    assert result["resumed_8"] == [0.01 * result["factor_8"]] * 2
