"""The embedded default, end to end: `python -m raytrain.main` on a real local Ray cluster, real
DeepSpeed ZeRO-3 on CPU (gloo), the built-in tiny Llama and Ray Data, with the fabric preflight first
(network.preflight=true) and metrics to TensorBoard and an MLflow file store. The loss must fall, the
data progress lines must add up, the tracking backends and the run's summary must hold the run's
numbers, the sharded checkpoint must load into a plain transformers model and export to the files
DeepSpeed's own converter writes."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from raytrain.console import parse_progress

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_run(ray_cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("runs")
    mlruns = tmp_path_factory.mktemp("mlruns")
    # MLflow 3 keeps its file store behind this switch: the local store that needs no server. Set
    # for the driver only (the cluster has not got it, tests/conftest.py): rank 0 logs to MLflow
    # because the driver passes it on (raytrain.driver.tracking.tracking_env).
    env = {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1",
           "MLFLOW_ALLOW_FILE_STORE": "true"}
    p = subprocess.run([sys.executable, "-m", "raytrain.main", f"checkpoint.storage_path={storage}",
                        "checkpoint.name=default", "data.progress_every_s=1", "network.preflight=true",
                        f"tracking.mlflow_tracking_uri=file://{mlruns}", "tracking.mlflow_experiment=e2e"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    meta = json.loads((storage / "default" / "checkpoint_step_00000080" / "raytrain.json").read_text())
    return p, storage, meta, mlruns


def test_default_run_reports_every_window_and_prints_its_progress(default_run):
    p, _, meta, _ = default_run
    assert [m["step"] for m in meta["history"]] == list(range(5, 81, 5))  # every 5 steps, the embedded default
    # rank 0's progress lines reach the terminal (the parser of their one definition reads them)
    printed = [m for m in map(parse_progress, (p.stdout + p.stderr).splitlines()) if m]
    assert printed and {m["step"] for m in printed} <= set(range(5, 81, 5)) and printed[-1]["max_steps"] == 80


def test_loss_falls(default_run):
    losses = {m["step"]: m["loss"] for m in default_run[2]["history"]}
    assert losses[80] < 0.5 * losses[5], losses  # ln(257)=5.55 at init; the corpus is learnable


def test_preflight_ran_first_and_passed(default_run):
    out = default_run[0].stdout
    assert "preflight: PASS (1 node(s), 2 rank(s), gloo)" in out
    assert out.index("preflight: PASS") < out.index("raytrain: done at step 80")


def test_tracking_backends_and_the_summary_hold_the_runs_numbers(default_run, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local file store, as the run used
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, storage, meta, mlruns = default_run
    losses = [m["loss"] for m in meta["history"]]
    events = EventAccumulator(str(storage / "default" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(5, 81, 5))
    client = mlflow.tracking.MlflowClient(tracking_uri=f"file://{mlruns}")
    [run] = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert [x.value for x in client.get_metric_history(run.info.run_id, "train/loss")] == pytest.approx(losses)
    summary = (storage / "default" / "summary.md").read_text()
    assert "| final step | 80 |" in summary and f"| final loss | {losses[-1]:.4f} |" in summary
    assert (storage / "default" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


DATA = re.compile(r"raytrain: data: pass (\d+): (\S+) documents of 4.00k documents \((\d+)%\), "
                  r"(?:\S+ documents/s, )?ETA \S+; tokenized (\S+) documents, (\S+) tokens")


def test_data_progress_lines_count_the_builtin_corpus(default_run):
    p = default_run[0]
    lines = [line for line in p.stdout.splitlines() if line.startswith("raytrain: data: pass ")]
    # The run's end says what packing dropped: each tokenize batch's tail shorter than seq_len.
    tails = [line for line in p.stdout.splitlines() if line.startswith("raytrain: data: ") and line not in lines]
    assert len(tails) == 1 and re.fullmatch(r"raytrain: data: [\d,]+ tokens \(\d+\.\d% of [\d,]+ tokenized\) dropped "
                                            r"at the end of tokenize batches, .*", tails[0]), tails
    parsed = [DATA.fullmatch(line) for line in lines]
    assert parsed and all(parsed), lines
    for m in parsed:
        # Every document of the built-in corpus is tokenized (no empties, no eval split): the count
        # since the start is the earlier passes plus this one's (to the line's 3 digits).
        since_start = (int(m.group(1)) - 1) * 4000 + _count(m.group(2))
        assert abs(_count(m.group(4)) - since_start) <= 0.01 * since_start, m.group(0)
    percents = [(int(m.group(1)), int(m.group(3))) for m in parsed]
    assert percents == sorted(percents) and 0 < percents[-1][1], lines  # tokenization only moves forward


def _count(text: str) -> float:
    """A count as progress lines print it: 999, 1.23k, 4.56M."""
    return float(text[:-1]) * {"k": 1e3, "M": 1e6}[text[-1]] if text[-1] in "kM" else float(text)


def test_export_prints_progress_and_writes_deepspeeds_files_byte_for_byte(default_run, tmp_path):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict, \
        get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    p = default_run[0]
    ckpt = re.search(r"^raytrain: checkpoint (/\S+)$", p.stdout, re.M).group(1)
    out, reference = tmp_path / "hf", tmp_path / "deepspeed"
    # 1 MB shards: the 3.3 MB model becomes 4 shards and an index, as a large model would
    export = subprocess.run([sys.executable, "-m", "raytrain.tools.export", ckpt, str(out), "--max-shard-size", "1MB"],
                            capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    lines = re.findall(r"^raytrain\.export: \[1/3\] ([\d.]+ MB) of ([\d.]+ MB) \((\d+)%\), [\d.]+ [kMG]?B/s, "
                       r"ETA \S+, shard (\d) of 4$", export.stdout, re.M)
    assert lines and lines[-1] == ("3.28 MB", "3.28 MB", "100", "4"), export.stdout

    convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(reference), max_shard_size="1MB", safe_serialization=True)
    written = sorted(f.name for f in reference.iterdir())
    assert written == ["model-0000%d-of-00004.safetensors" % i for i in range(1, 5)] + ["model.safetensors.index.json"]
    for name in written:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name

    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt).items())


def test_checkpoint_has_every_rank_shard_and_loads_into_transformers(default_run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from raytrain.config import ModelConfig
    from raytrain.data.builtin import builtin_corpus
    from raytrain.model import load_model_config, load_tokenizer

    p, storage = default_run[0], default_run[1]
    ckpt = re.search(r"^raytrain: checkpoint (/\S+)$", p.stdout, re.M).group(1)
    assert ckpt.startswith(str(storage)) and os.path.isdir(ckpt)
    meta = json.load(open(os.path.join(ckpt, "raytrain.json")))
    assert meta["step"] == 80 and meta["spec"]["config"]["deepspeed"]["zero_optimization"]["stage"] == 3
    shards = sorted(os.listdir(os.path.join(ckpt, "step_00000080")))
    assert [s for s in shards if "optim_states" in s] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    hf_config = load_model_config(ModelConfig())
    trained = AutoModelForCausalLM.from_config(hf_config)
    missing, unexpected = trained.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(hf_config)

    tok = load_tokenizer(ModelConfig())
    ids = torch.tensor([tok(builtin_corpus(1, seed=99)[0], add_special_tokens=False)["input_ids"][:128]])
    with torch.no_grad():
        trained_loss = trained(input_ids=ids, labels=ids).loss.item()
        fresh_loss = fresh(input_ids=ids, labels=ids).loss.item()
    assert trained_loss < fresh_loss - 2.0, (trained_loss, fresh_loss)
