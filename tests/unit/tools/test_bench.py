"""raytrain.tools.bench on CPU: the plain-DeepSpeed path (one process, gloo, ZeRO-3) with a tiny Llama, run
through the command line as a user runs it; the fused-loss lm_head under ZeRO-3 gives the same loss."""

import json
import math
import os
import subprocess
import sys

import pytest

from raytrain.hardware import ALLOCATOR_VARS
from raytrain.tools import bench, bench_paths

TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
        "--intermediate-size", "128", "--vocab-size", "320", "--seq-len", "64", "--micro-batch", "2",
        "--grad-accum", "2", "--steps", "2", "--warmup-steps", "2", "--window", "2"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    p = subprocess.run([sys.executable, "-m", "raytrain.tools.bench", "--paths", "deepspeed", "--out", str(out), *TINY],
                       capture_output=True, text=True, timeout=600)
    return p, out


def test_deepspeed_path_runs_zero3_and_writes_json_and_markdown(cli_run):
    p, out = cli_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [record] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["status"] == "ok", record
    assert record["ds_config"]["zero_optimization"]["stage"] == 3
    assert (record["ds_config"]["train_micro_batch_size_per_gpu"], record["ds_config"]["gradient_accumulation_steps"]) == (2, 2)
    assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0
    assert 0 <= record["data_wait_frac"] < 1
    assert record["mfu"] is None  # no MFU on CPU
    assert 4 < record["loss"] < 7  # ~ln(320) = 5.77 at init
    assert record["num_params"] == 115_008
    assert record["command"].startswith("python -m raytrain.tools.bench --paths deepspeed")
    # each path's child runs under the GPU workers' allocator default (raytrain.hardware.allocator_env)
    users = {k: os.environ[k] for k in ALLOCATOR_VARS if k in os.environ}
    assert record["alloc_conf"] == (users or {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert record["host_overflow_scan_dropped"] is False  # fp32 here: no loss scale, DeepSpeed's path untouched
    assert record["settings"]["deepspeed_overflow_scan"] is False
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("| variant | path | status") and "| deepspeed | ok |" in table[2]


def test_fused_loss_head_under_zero3_matches_transformers_loss(cli_run, monkeypatch):
    """The lm_head that computes the loss itself (Liger's kernel on GPU, torch ops on CPU) must get its
    weight gathered by ZeRO-3 and its gradient back: after 4 optimizer steps the loss is the same."""
    from transformers.models.llama import modeling_llama

    p, out = cli_run
    expected = json.loads((out / "results.jsonl").read_text().splitlines()[0])["loss"]
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    # The rendezvous variables the one-process group sets are this test's only (restored afterwards),
    # so no later test in this process inherits them.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # records the value to restore (usually: absent) ...
        monkeypatch.delenv(name)  # ... then leaves it to _init_single_process_group
    args = bench.parse_args([*TINY, "--liger", "loss", "--no-profile"])
    resolved = bench_paths.resolve(bench.overrides_for(args, use_gpu=False), args.num_gpus, use_gpu=False)
    import torch

    try:
        result = bench_paths.run_deepspeed(args, resolved)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert math.isclose(result["loss"], expected, rel_tol=1e-4), (result["loss"], expected)


def test_compiled_model_under_zero3_matches_eager_loss(cli_run, tmp_path):
    """model.compile: engine.compile() (inductor) through ZeRO-3's hooks trains to the same loss.
    (Its own process: DeepSpeed keeps process-group state that a second initialize in one process trips on.)"""
    p, out = cli_run
    [eager] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    c = subprocess.run([sys.executable, "-m", "raytrain.tools.bench", "--paths", "deepspeed", "--out", str(tmp_path),
                        "--no-profile", *TINY, "--set", "model.compile=true"], capture_output=True, text=True,
                       timeout=600)
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    [compiled] = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert compiled["settings"]["overrides"] == ["model.compile=true"]
    assert (compiled["compiled"], eager["compiled"]) == (True, False)
    assert math.isclose(compiled["loss"], eager["loss"], rel_tol=1e-3), (compiled["loss"], eager["loss"])


def test_window_must_divide_steps():
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "6", "--window", "4"])


def test_unknown_path_is_rejected():
    with pytest.raises(SystemExit):
        bench.parse_args(["--paths", "deepspeed,fsdp"])


def test_offload_and_overrides_reach_the_resolved_deepspeed_dict():
    args = bench.parse_args(["--offload", "--micro-batch", "16", "--grad-accum", "4",
                             "--set", "deepspeed.zero_optimization.reduce_bucket_size=500000000"])
    resolved = bench_paths.resolve(bench.overrides_for(args, use_gpu=True), args.num_gpus, use_gpu=True)
    ds = resolved.ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 16, 4)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["reduce_bucket_size"] == 500_000_000
    assert zero["stage3_param_persistence_threshold"] == 10 * 2048  # the rest stays raytrain's default
    assert ds["bf16"] == {"enabled": True}
    assert resolved.config.data.seq_len == 2048


def test_a_model_directory_of_another_family_keeps_its_own_config(tmp_path):
    """--model-dir: only the shape flags given reach model.config (GPT-2 has no num_key_value_heads, which the
    Llama defaults would set and raytrain would refuse); without it the Llama 1.1B's shape is filled in."""
    from transformers import AutoConfig

    from raytrain.model import byte_tokenizer

    AutoConfig.for_model("gpt2", n_positions=256, resid_pdrop=0.1).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    args = bench.parse_args(["--model-dir", str(tmp_path), "--hidden-size", "128", "--num-layers", "2",
                             "--num-heads", "4", "--seq-len", "128"])
    assert bench.model_overrides(args) == {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    resolved = bench_paths.resolve(bench.overrides_for(args, use_gpu=False), args.num_gpus, use_gpu=False)
    facts = resolved.model
    assert (facts.model_type, facts.hidden_size, facts.num_hidden_layers) == ("gpt2", 128, 2)
    assert facts.hf_config["resid_pdrop"] == 0.1  # the directory's own value, not a Llama default
    assert bench.default_label(args) == f"mb8 {tmp_path.name}"
    llama = bench.model_overrides(bench.parse_args(["--num-layers", "4"]))
    assert llama == {**bench.LLAMA_1B, "num_hidden_layers": 4, "max_position_embeddings": 2048}


def test_markdown_table_marks_failures():
    rows = bench.markdown_table([{"label": "x", "path": "torch", "status": "oom", "error": "CUDA out of memory",
                                  "settings": {"micro_batch": 32, "grad_accum": 1}}])
    assert "| x | torch | oom: CUDA out of memory |" in rows


def test_raytrain_record_from_worker_progress_lines():
    """The raytrain path is read from rank 0's progress lines, with the parser of their one definition
    (raytrain.console.parse_progress), exactly as bench.run_path does."""
    args = bench.parse_args(["--micro-batch", "16"])
    lines = ["(RayTrainWorker pid=3240) step 4/12  loss 6.5635  lr 5.00e-04  grad_norm 9.896  tok/s 13,468  "
             "mfu 10.5%  data_wait 50.1%  mem 87.21GiB  eta 0:00:19",
             "step 8/12  loss 5.3363  lr 9.00e-04  grad_norm 6.242  tok/s 50,000  mfu 40.1%  data_wait 0.2%  "
             "mem 87.21GiB  eta 0:00:03",
             "step 12/12  loss 2.4145  lr 1.00e-04  grad_norm 3.537  tok/s 40,000  mfu 39.8%  data_wait 0.0%  "
             "mem 87.30GiB  eta 0:00:00"]
    windows = {}
    for line in lines:
        bench.add_window(windows, line)
    r = bench._from_progress({"flops_per_token": 7.71e9, "num_params": 1_100_048_384,
                              "ds_config": {"train_batch_size": 16}}, windows, args)
    # windows after the 4 warmup steps; tokens/s = tokens / total time (harmonic mean of the windows)
    assert r["tokens_per_s"] == pytest.approx(2 / (1 / 50_000 + 1 / 40_000))
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 7.71e9 / 989e12)
    assert r["data_wait_frac"] == pytest.approx(0.001) and r["peak_mem_gib"] == 87.30


def test_deepspeed_path_records_peaks_and_the_planners_prediction(cli_run):
    """Every record carries what the planner predicted for its setting and the host's used memory
    sampled while the path ran (docs/plan-accuracy.md compares them with the measured peaks)."""
    p, out = cli_run
    [record] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["predicted"]["host_gib"] > 0 and record["predicted"]["gpu_peak_gib"] is None  # CPU run
    assert record["predicted"]["setting"] == "no offload" and record["predicted"]["fits"] is True
    assert record["host_sample_s"] == 2.0 and record["host_used_peak_gib"] >= record["host_used_start_gib"] > 0
    assert record["plan"] == []  # nothing was "auto"
    assert "| 2 x 2 |" in (out / "results.md").read_text()  # the batch that ran, from the resolved dict


def test_auto_micro_batch_and_offload_the_gpu_cap_reach_every_path():
    args = bench.parse_args(["--micro-batch", "auto", "--offload", "auto", "--gpu-memory-fraction", "0.171",
                             "--grad-accum", "4"])
    overrides = bench.overrides_for(args, use_gpu=True)
    assert "training.micro_batch_size_per_gpu=auto" in overrides and "scaling.gpu_memory_fraction=0.171" in overrides
    ds = json.loads(next(o for o in overrides if o.startswith("deepspeed=")).removeprefix("deepspeed="))
    assert ds["zero_optimization"]["offload_optimizer"] == "auto" and ds["zero_optimization"]["sub_group_size"] == "auto"
    assert bench.default_label(args) == "mbauto gas4 offload-auto gpu-fraction0.171"
    with pytest.raises(SystemExit):
        bench.parse_args(["--gpu-memory-fraction", "1.5"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--micro-batch", "many"])


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus (see python -m raytrain.tools.bench --help)"),
    (["--steps", "6", "--window", "4"], "--window=4 must divide --steps=6 and --warmup-steps=4"),
])
def test_a_bad_flag_is_one_error_line_and_exit_2(argv, needle, capsys):
    # was argparse's usage block, then `python -m raytrain.tools.bench: error: ...`, unlike every other command
    assert bench.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()] and err.startswith("raytrain: error: ") and needle in err, err
