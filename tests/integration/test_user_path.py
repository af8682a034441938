"""The user's path, end to end with real components: a model directory written by save_pretrained
(trained a little first, so that its weights are recognisable), a BPE tokenizer trained with
`tokenizers`, JSON lines in a non-default column, `model.pretrained=true` under ZeRO-3, the micro-batch
left to the planner ("auto": chosen on the driver with the same code as `--dry-run`, said once before
the workers start, trained with), export after the original model and tokenizer are deleted, then
`from_pretrained` + `generate`. And the user's mistake found while training: a line that is not JSON
stops the run with one line, exit 2, never a retried worker failure."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from raytrain.config import load_config
from raytrain.driver.run import dry_run

pytestmark = pytest.mark.integration

DOC = "the quick brown fox jumps over the lazy dog while the small cat sleeps in the warm sun"
EOS = "<|endoftext|>"


def train_tokenizer(path):
    """A byte-level BPE tokenizer trained with `tokenizers`, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [DOC, "a fox and a dog", "cats sleep in the sun", "the brown dog jumps"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(path)
    return fast


def save_model(path, tok, row):
    """A tiny Llama fitted to `row` for a few steps (its loss on it is far below a random init's),
    saved by save_pretrained; returns its loss on `row` as transformers computes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=384, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = model(input_ids=row, labels=row).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    reloaded = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return reloaded(input_ids=row, labels=row).loss.item()


def run(env, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", "raytrain.main", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def user_run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    tok = train_tokenizer(root / "tokenizer")
    ids = tok(DOC, add_special_tokens=False)["input_ids"]
    # Every document packs into exactly one block (its tokens + EOS = seq_len): every row of every
    # micro-batch is the same, so the first step's loss is the loaded model's loss on that row.
    row = torch.tensor([ids + [tok.eos_token_id]])
    reference_loss = save_model(root / "model", tok, row)
    data = root / "data"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (data / name).write_text("".join(json.dumps({"id": i, "body": DOC}) + "\n" for i in range(64)))
    with open(data / "a.jsonl", "a") as f:  # skipped by the empty-document policy, reported once
        f.write(json.dumps({"id": 64, "body": ""}) + "\n" + json.dumps({"id": 65}) + "\n")
    storage = root / "runs"
    # The run's name was a directory of the user's already, with a model/ of its own: set aside, not lost
    (storage / "user" / "model").mkdir(parents=True)
    (storage / "user" / "model" / "NOTES.md").write_text("mine")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    # The micro-batch left to the planner, within a global batch of 8 rows (micro-batch x accumulation
    # x 2 workers); --dry-run's answer, in-process (no Ray involved), is what the run must choose.
    args = [f"model.name_or_path={root / 'model'}", "model.pretrained=true", f"model.tokenizer={root / 'tokenizer'}",
            f"data.path={data}", "data.text_column=body", f"data.seq_len={row.shape[1]}", "data.progress_every_s=0",
            "training.max_steps=4", "training.log_every_n_steps=1", "training.micro_batch_size_per_gpu=auto",
            "deepspeed.train_batch_size=8", f"checkpoint.storage_path={storage}", "checkpoint.name=user"]
    resolved, notes = dry_run(load_config(None, args))
    p = run(env, *args)
    checkpoint = storage / "user" / "checkpoint_step_00000004"
    # The run's files must be all the export needs: the originals go.
    shutil.rmtree(root / "model")
    shutil.rmtree(root / "tokenizer")
    out = root / "exported"
    export = subprocess.run([sys.executable, "-m", "raytrain.tools.export", str(checkpoint), str(out)],
                            capture_output=True, text=True, timeout=600)
    return {"p": p, "root": root, "row": row, "reference_loss": reference_loss, "checkpoint": checkpoint,
            "export": export, "out": out, "env": env, "data": data,
            "micro": resolved.deepspeed.micro_batch_per_gpu, "notes": notes}


def test_pretrained_run_says_once_where_the_weights_come_from(user_run):
    p = user_run["p"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("raytrain: model:")]
    assert lines == [f"raytrain: model: weights from {user_run['root'] / 'model'} (model.pretrained=true)"]


def test_auto_micro_batch_is_chosen_on_the_driver_and_trained_with(user_run):
    p, micro = user_run["p"], user_run["micro"]
    # on CPU the planner takes the largest micro-batch that fits host RAM: here the global batch bounds it
    assert micro == 4  # the largest of 1, 2, 4 (each with its accumulation to 8 rows): all fit
    assert user_run["notes"][0].startswith(f"plan: chose micro-batch {micro}, ")
    plan = [line for line in p.stdout.splitlines() if line.startswith("raytrain: plan: ")]
    assert len(plan) == 1 and plan[0].startswith(f"raytrain: plan: chose micro-batch {micro}, "), plan
    # said before anything a worker prints
    assert p.stdout.index(plan[0]) < (p.stdout + p.stderr).index("step 1/4"), p.stdout[-3000:]
    spec = json.loads((user_run["checkpoint"] / "raytrain.json").read_text())["spec"]
    assert spec["deepspeed"]["micro_batch_per_gpu"] == micro and spec["plan"] == [plan[0][len("raytrain: plan: "):]]


def test_skipped_documents_are_reported_once_for_the_run(user_run):
    lines = [line for line in user_run["p"].stdout.splitlines() if line.startswith("raytrain: data: ")]
    assert lines == [f"raytrain: data: 2 empty documents skipped (null, \"\", a missing key, an empty file or id list), "
                     f"the first in {user_run['data'] / 'a.jsonl'}"]


def test_first_step_loss_is_transformers_loss_of_the_loaded_weights(user_run):
    import math

    history = json.loads((user_run["checkpoint"] / "raytrain.json").read_text())["history"]
    assert history[0]["step"] == 1
    # the fitted model is far from a random init's ln(vocab): a run from random weights fails here
    assert user_run["reference_loss"] < 0.5 * math.log(384), user_run["reference_loss"]
    assert history[0]["loss"] == pytest.approx(user_run["reference_loss"], rel=1e-3)


def test_the_run_directory_holds_the_models_config_tokenizer_and_generation_config(user_run):
    files = set(os.listdir(user_run["checkpoint"].parent / "model"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files)  # the checkpoints hold the weights


def test_a_model_directory_the_run_found_is_set_aside_and_said_once(user_run):
    run = user_run["checkpoint"].parent
    [aside] = run.glob("model.replaced-*")
    assert (aside / "NOTES.md").read_text() == "mine"
    lines = [line for line in user_run["p"].stdout.splitlines() if "held files other than" in line]
    assert len(lines) == 1 and lines[0].startswith(
        f"raytrain: note: {run}/model held files other than this run's model files (NOTES.md, config.json, "), lines
    assert lines[0].endswith(f": moved to {aside}; the run writes its own there (the export reads them)"), lines


def test_export_after_the_originals_are_gone_loads_and_generates(user_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export, out = user_run["export"], user_run["out"]
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    assert export.stdout.splitlines()[-1].startswith(f"raytrain.export: wrote {out} in ")
    # raytrain's lines only: DeepSpeed's tqdm bars, prints and accelerator warning are gone
    assert all(line.startswith("raytrain.export: ") for line in (export.stdout + export.stderr).splitlines()), \
        export.stdout + export.stderr
    assert not [f for f in os.listdir(out.parent) if ".tmp-" in f]  # the temporary directory was renamed
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok(DOC, add_special_tokens=False)["input_ids"]
    prompt = torch.tensor([ids[:4]])
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    # the model was fitted to DOC and trained on it: greedy decoding continues it
    assert generated[0, 4:].tolist() == ids[4:12], tok.decode(generated[0])


def test_export_refuses_an_out_dir_that_is_not_empty(user_run, capsys):
    from raytrain.tools import export

    before = sorted(os.listdir(user_run["out"]))
    assert export.main([str(user_run["checkpoint"]), str(user_run["out"])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"raytrain: error: OUT_DIR {user_run['out']} exists and is not empty: give a new directory "
                   f"(the export never overwrites one)"]
    assert sorted(os.listdir(user_run["out"])) == before


def test_a_line_that_is_not_json_stops_the_run_with_one_line_and_exit_2(user_run, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(user_run["data"], data)
    lines = (data / "b.jsonl").read_text().splitlines(keepends=True)
    lines[9] = '{"id": 9, "body": "cut\n'  # line 10
    lines[20] = "not json at all\n"  # line 21
    (data / "b.jsonl").write_text("".join(lines))
    env = {**user_run["env"], "RAY_DEDUP_LOGS": "0", "MLFLOW_ALLOW_FILE_STORE": "true"}  # every worker's line as is
    mlruns = tmp_path / "mlruns"
    p = run(env, f"data.path={data}", "data.text_column=body", "data.seq_len=16", "training.max_steps=200",
            "checkpoint.max_failures=3", f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=bad",
            f"tracking.mlflow_tracking_uri=file://{mlruns}", "tracking.mlflow_experiment=bad")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-4000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert errors == [f"raytrain: error: {data / 'b.jsonl'} line 10: not valid JSON (Unterminated string starting "
                      f"at column 19) (and 1 more bad record): fix or remove it"], out[-4000:]
    assert len(re.findall(r"starting at step 0", out)) == 1, out[-4000:]  # one attempt, no restart
    assert not re.search(r"Traceback|Retry|worker failure|Error in training function", out), out[-4000:]
    # the stop killed rank 0 before it could end its MLflow run, which stayed RUNNING: the driver ends it
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local file store, as the run used
    client = mlflow.MlflowClient(tracking_uri=f"file://{mlruns}")
    runs = client.search_runs([client.get_experiment_by_name("bad").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"], out[-4000:]


def test_a_full_storage_stops_the_run_with_one_line_and_exit_2_not_a_retried_failure(user_run, tmp_path):
    # The storage is full where the save of step 2 writes rank 0's raytrain.json: Ray Train's upload (pyarrow)
    # meets ENOSPC as on a full disk. Retried, every attempt would retrain to step 2 and fail there again.
    storage = tmp_path / "runs"
    (storage / "full" / "checkpoint_step_00000002").mkdir(parents=True)
    os.symlink("/dev/full", storage / "full" / "checkpoint_step_00000002" / "raytrain.json")
    env = {**user_run["env"], "RAY_DEDUP_LOGS": "0"}
    p = run(env, f"data.path={user_run['data']}", "data.text_column=body", "data.seq_len=16", "training.max_steps=4",
            "checkpoint.every_n_steps=2", "checkpoint.max_failures=3", f"checkpoint.storage_path={storage}",
            "checkpoint.name=full")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-4000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and re.fullmatch(
        rf"raytrain: error: checkpoint.storage_path={storage}: no space left for the checkpoint of step 2 "
        rf"\(0\.\d+ GiB; checkpoint.num_to_keep=2 are kept, and a new one is written before the oldest is deleted\): "
        rf"free space there, and delete {storage}/full/checkpoint_step_00000002 \(a save that never completed\); "
        rf"then the same command with checkpoint.name=full continues from the run's latest checkpoint",
        errors[0]), errors
    assert len(re.findall(r"starting at step 0", out)) == 1, out[-4000:]  # one attempt, no restart
    assert not re.search(r"Traceback|Retry|worker failure|Error in training function", out), out[-4000:]


def test_a_counter_slow_to_answer_the_drivers_poll_is_not_a_crash(ray_cluster):
    """Under load the driver's poll of the data counter can time out (seen on a 2-core CI machine: a
    GetTimeoutError traceback instead of the run's one-line bad-record error). The poll treats no answer as
    "not stopped yet"; a real Ray counter asked with no time to answer shows it."""
    from raytrain.config import DataConfig
    from raytrain.data.progress import DataProgress
    from raytrain.driver.watch import stopped_by_bad_record

    with DataProgress(DataConfig(), "slow-poll") as progress:
        assert stopped_by_bad_record(progress, timeout_s=0) is False  # no time: GetTimeoutError inside
        assert stopped_by_bad_record(progress) is False  # answered: no bad record
