"""The export's own steps (raytrain.checkpoint.export), and the Hugging Face directory it writes for
models the end-to-end tests do not train: a tied-embedding model saved in bf16, a mixture of experts and a
model with its own code (trust_remote_code). Each is trained one step by a real ZeRO-3 engine (the worker's
build_engine, gloo, one CPU rank, no Ray), exported after its source directory is deleted, and
loaded with from_pretrained. A real export of a trained run, byte for byte against DeepSpeed's
converter, is in tests/integration/test_train_e2e.py."""

import json
import os
import shutil
import stat
import sys

import pyarrow.fs
import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from raytrain.checkpoint.export import (_materialise, _one_name_per_tensor, _without_deepspeed_chatter, export,
                                        saved_layout, write_config, write_tokenizer, write_weights)
from raytrain.config import ConfigError
from raytrain.console import Meter
from raytrain.model import byte_tokenizer
from raytrain.run_spec import RunSpec
from tests.helpers import S3Server, code_model, forget_said_warnings, init_gloo, transformers_log
from tests.unit.driver.test_resume import resolved

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=320, max_position_embeddings=64)


def test_export_materialises_tensor_by_tensor_with_progress_lines(capsys):
    meter = Meter(total=5000, every_s=0.0)
    out = _materialise({"embed": torch.ones(1000), "norm": torch.zeros(250)}, ["embed", "norm"], meter,
                       "shard 1 of 1")
    assert out["embed"].sum() == 1000 and meter.done == 5000
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("raytrain.export")]
    assert len(lines) == 1 and lines[0].startswith("raytrain.export: [1/3] 4.00 kB of 5.00 kB (80%), ")
    assert lines[0].endswith(", shard 1 of 1") and "B/s, ETA " in lines[0]


def test_a_tied_tensor_is_written_once_under_the_name_deepspeed_stored():
    # zero_to_fp32 puts the stored name first and appends the tied ones (its shared_params) after
    embed, norm = torch.ones(4), torch.zeros(2)
    kept = _one_name_per_tensor({"model.embed_tokens.weight": embed, "model.norm.weight": norm,
                                 "lm_head.weight": embed})
    assert list(kept) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_deepspeeds_chatter_is_dropped_and_anything_else_it_prints_still_shows(capsys):
    with _without_deepspeed_chatter():
        print("Processing zero checkpoint 'ckpt/global_step1'")
        print("Detected checkpoint of type zero stage 3, world_size: 2")
        print("Reconstructed Trainable fp32 state dict with 12 params 6464 elements")
        print("Gathering sharded weights: 100%|##########| 12/12 [00:00<00:00]\r", file=sys.stderr)
        print("UserWarning: an unexpected warning", file=sys.stderr)
        print("Found buffers: ['rotary_emb.inv_freq']")
    assert capsys.readouterr() == ("Found buffers: ['rotary_emb.inv_freq']\n", "UserWarning: an unexpected warning\n")


def _spec(tmp_path, *overrides) -> RunSpec:
    """The spec a checkpoint of a run of `overrides` records in its raytrain.json (nothing trained)."""
    return RunSpec.place(resolved("data.seq_len=16", *overrides), run_name="run", storage_path=str(tmp_path),
                         resume_from=None)


@pytest.mark.parametrize("trust", [False, True])
def test_the_config_is_the_runs_for_fp32_weights_and_generation(tmp_path, monkeypatch, trust):
    # trusted or not, a model without code of its own needs no copy of it: a run from before raytrain kept one
    spec = _spec(tmp_path, f"model.trust_remote_code={str(trust).lower()}")
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)  # the user's project, where the export runs: none of its code is the model's
    write_config(spec, None, str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["use_cache"] is True and config["hidden_size"] == spec.model.hf_config["hidden_size"]
    assert os.listdir(tmp_path / "out") == ["config.json"]


def test_a_model_with_its_own_code_needs_the_runs_copy_of_that_code(tmp_path):
    source = code_model(tmp_path / "mine", TINY)
    spec = _spec(tmp_path, f"model.name_or_path={source}", "model.trust_remote_code=true")
    (tmp_path / "nocode").mkdir()
    for model_dir, where in ((None, "model/ next to the checkpoint"), (str(tmp_path / "nocode"), tmp_path / "nocode")):
        with pytest.raises(ConfigError) as e:
            write_config(spec, model_dir, str(tmp_path / "out"))
        assert str(e.value) == (f"the run's copy of the model's code ({where}) is missing: the config class of a "
                                f"model with its own code is imported from there; put the run's model/ directory "
                                f"next to the checkpoint")
    write_config(spec, source, str(tmp_path / "out"))
    assert {"cfg.py", "mdl.py"} <= set(os.listdir(tmp_path / "out"))  # from_pretrained imports both
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["MyModel"]


@pytest.mark.parametrize("saved_eos, eos", [("no file", None), (None, 256), (7, 7)])
def test_the_generation_config_is_the_runs_copy_with_the_runs_eos_where_it_has_none(tmp_path, saved_eos, eos):
    # generate() stops on the generation config's EOS only; the run's config.json has the byte tokenizer's (256)
    spec = _spec(tmp_path)
    model_dir = tmp_path / "run" / "model"
    byte_tokenizer().save_pretrained(model_dir)
    if saved_eos != "no file":
        GenerationConfig(eos_token_id=saved_eos, max_new_tokens=5).save_pretrained(model_dir)
    write_tokenizer(spec, str(model_dir), str(tmp_path / "out"))
    out = tmp_path / "out"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").exists() == (eos is not None)
    if eos is not None:
        generation = json.loads((out / "generation_config.json").read_text())
        assert generation["eos_token_id"] == eos and generation["max_new_tokens"] == 5


def test_a_run_without_its_own_copy_takes_the_tokenizer_it_started_with_else_says_what_to_put_back(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    spec = _spec(tmp_path, f"model.tokenizer={tmp_path / 'tok'}")
    model_dir = str(tmp_path / "run" / "model")  # a run from before raytrain kept its own copy: absent
    write_tokenizer(spec, model_dir, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["tokenizer.json", "tokenizer_config.json"]
    data = spec.to_dict()
    data["config"]["model"]["tokenizer"] = str(tmp_path / "gone")  # deleted since the run started
    with pytest.raises(ConfigError) as e:
        write_tokenizer(RunSpec.from_dict(data), model_dir, str(tmp_path / "out2"))
    message = str(e.value)
    assert message.startswith(f"the run's copy of the tokenizer ({model_dir}) is missing, and the tokenizer the run "
                              f"started with cannot be loaded either (model.tokenizer=")
    assert f"there is no directory {tmp_path / 'gone'}" in message and "\n" not in message
    assert message.endswith("); put the run's model/ directory next to the checkpoint")


def test_only_a_model_whose_checkpoints_hold_another_layout_is_converted(tmp_path, capsys):
    assert saved_layout(_spec(tmp_path)) is None  # Llama: its checkpoints' layout
    # a model with its own code: transformers converts none, and the directory it came from may be gone
    source = code_model(tmp_path / "mine", TINY)
    spec = _spec(tmp_path, f"model.name_or_path={source}", "model.trust_remote_code=true")
    shutil.rmtree(source)
    assert saved_layout(spec) is None
    # HRM's checkpoints hold gate|up (and gate|q|k|v) as one matrix: written back, tensors of two shards may merge
    hrm = tmp_path / "hrm"
    AutoConfig.for_model("hrm_text", **TINY, head_dim=8, num_layers_per_stack=1).save_pretrained(hrm)
    byte_tokenizer().save_pretrained(hrm)
    spec = _spec(tmp_path, f"model.name_or_path={hrm}")
    capsys.readouterr()
    assert saved_layout(spec) is None
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("raytrain.export: note: the weights are written as transformers 5 "
                                                 "keeps them (HrmTextForCausalLM's conversion"), said


@pytest.mark.parametrize("trust", [False, True])
def test_a_mixture_of_experts_is_converted_to_what_save_pretrained_writes(tmp_path, trust):
    # trust_remote_code on a model without code of its own (no auto_map) trains transformers' own class: its
    # conversion applies (was: the fused layout, which transformers 4.57 loaded with random experts)
    source = tmp_path / "mixtral"
    config = AutoConfig.for_model("mixtral", **TINY, num_local_experts=4, num_experts_per_tok=2)
    config.save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    reference = AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    convert = saved_layout(_spec(tmp_path, f"model.name_or_path={source}",
                                 f"model.trust_remote_code={str(trust).lower()}"))
    converted = convert({name: p.detach() for name, p in reference.named_parameters()})
    assert converted.keys() == saved.keys()
    for name, tensor in saved.items():
        assert converted[name].is_contiguous() and torch.equal(converted[name], tensor), name


def _train_one_step(rank, out_dir, overrides):
    """One rank: resolve the run, write its model files, build the engine, one step, a checkpoint."""
    init_gloo(rank, 1, f"{out_dir}/rendezvous")
    import deepspeed

    from raytrain.checkpoint.layout import METADATA, tag_for
    from raytrain.checkpoint.model_files import write_model_files
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape, RunSpec
    from raytrain.worker.engine import build_engine, train_step

    cfg = load_config(None, overrides + ["data.seq_len=16", "training.micro_batch_size_per_gpu=2",
                                         "deepspeed.train_batch_size=2", "training.learning_rate=0.01",
                                         f"checkpoint.storage_path={out_dir}"])
    spec = RunSpec.place(resolve_run(cfg, ClusterShape(num_workers=1, use_gpu=False)), run_name="run",
                         storage_path=out_dir, resume_from=None)
    write_model_files(spec.run_uri, cfg.model, spec.model)
    engine, _, _ = build_engine(spec, torch.device("cpu"))
    rows = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    train_step(engine, iter([{"input_ids": rows}]), 1, torch.device("cpu"))
    ckpt = f"{spec.run_uri}/checkpoint_{tag_for(1)}"
    engine.save_checkpoint(ckpt, tag=tag_for(1))
    with open(os.path.join(ckpt, METADATA), "w") as f:
        json.dump({"step": 1, "world_size": 1, "metrics": {}, "history": [], "spec": spec.to_dict()}, f, default=str)
    trained = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            trained[name] = p.detach().clone().float()
    torch.save(trained, f"{out_dir}/trained.pt")


def _exported(tmp_path, source, overrides, trust_remote_code=False, log=None):
    """Train one step from `source`, delete `source`, export: (loaded model, trained weights, out dir).
    `log`: a list that gets what transformers logged during the export, as in a process of its own."""
    mp.start_processes(_train_one_step, args=(str(tmp_path), overrides), nprocs=1, join=True, start_method="spawn")
    shutil.rmtree(source)  # the export reads the run's own copy, not the directory the run started from
    out = tmp_path / "out"
    forget_said_warnings()  # python -m raytrain.tools.export: a process of its own
    with transformers_log() as said:
        assert export(str(tmp_path / "run" / "checkpoint_step_00000001"), str(out)) == str(out)
    if log is not None:
        log.extend(said)
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto", trust_remote_code=trust_remote_code)
    return model, torch.load(tmp_path / "trained.pt"), out


def _assert_is_the_trained_model(model, trained):
    loaded = dict(model.named_parameters())
    assert loaded.keys() == trained.keys()
    for name, weight in trained.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], weight), name


def test_a_tied_bf16_model_exports_as_save_pretrained_writes_it(tmp_path):
    # Llama-3.2-1B, small Qwen2.5, Gemma and GPT-2 tie the head to the embedding: safetensors refused the
    # two names for one tensor. The source's bf16 must not stay in config.json: the weights are fp32.
    # Its config has no EOS (so neither has the generation config save_pretrained derives from it): the
    # run sets one (raytrain.planning.resolve.advice names the key), which generate() must see.
    # And pad_token_id=-1, as many hub Llama configs carry it: the export writes it as the run had it (the run's
    # driver said what it does), without transformers' warnings about it (GenerationConfig.save_pretrained
    # refused to write the generation config with the EOS set: "Fix these issues to save the configuration").
    source = tmp_path / "llama"
    config = LlamaConfig(**TINY, tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=-1)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    log = []
    model, trained, out = _exported(tmp_path, source, [f"model.name_or_path={source}", "model.pretrained=true",
                                                       "model.config.eos_token_id=256"], log=log)
    assert log == []  # neither "pad_token_id must be `None` or an integer ..." nor "... generation flags ..."
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == -1
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == -1
    _assert_is_the_trained_model(model, trained)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again by from_pretrained
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()  # as save_pretrained
    assert not (out / "model.safetensors.index.json").exists()  # one file: no index, as save_pretrained writes it
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == 256 and model.generation_config.eos_token_id == 256
    # as os.makedirs and save_pretrained make it (755 under umask 022), not mkdtemp's 0700: a serving user reads it
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    # and every file as open() makes it (644), the weights too (safetensors' save_file makes them 0600)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {
        f.name: 0o666 & ~umask for f in out.iterdir()}


def test_a_mixture_of_experts_exports_in_the_layout_save_pretrained_writes(tmp_path, capsys):
    """transformers 5 keeps Mixtral's experts as one 3-D tensor per layer (mlp.experts.gate_up_proj); its
    checkpoints, which transformers 4 and other tools read, hold a matrix per expert (block_sparse_moe.experts.N.w1):
    transformers 4.57 loaded the fused names with the experts and the router randomly initialised."""
    from transformers import AutoConfig

    source = tmp_path / "mixtral"
    config = AutoConfig.for_model("mixtral", **TINY, num_local_experts=4, num_experts_per_tok=2)
    reference = AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    with safe_open(source / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in saved  # the checkpoints' layout
    model, trained, out = _exported(tmp_path, source, [f"model.name_or_path={source}", "model.pretrained=true"])
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == saved
    _assert_is_the_trained_model(model, trained)  # transformers 5 loads it fused again, every weight as trained
    # sharded: each shard's tensors converted, and the index names the converted tensors. The run's copy of the
    # model's files given where it is (the driver's export of a cloud run: the checkpoint is downloaded alone)
    os.rename(tmp_path / "run" / "model", tmp_path / "model-copy")
    (tmp_path / "sharded").mkdir(mode=0o770)  # made by the user, group-writable on purpose: kept so
    os.chmod(tmp_path / "sharded", 0o770)  # (whatever the umask)
    export(str(tmp_path / "run" / "checkpoint_step_00000001"), str(tmp_path / "sharded"), max_shard_size="8KB",
           model_dir=str(tmp_path / "model-copy"))
    assert (tmp_path / "sharded" / "tokenizer.json").is_file()
    assert stat.S_IMODE((tmp_path / "sharded").stat().st_mode) == 0o770
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == saved and len(set(index["weight_map"].values())) > 2
    _assert_is_the_trained_model(AutoModelForCausalLM.from_pretrained(tmp_path / "sharded"), trained)
    # the progress lines (every few seconds; here every tensor) name the shard being read
    (tmp_path / "weights").mkdir()
    capsys.readouterr()
    write_weights(str(tmp_path / "run" / "checkpoint_step_00000001"), str(tmp_path / "weights"), "8KB", every_s=0.0)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("raytrain.export: [1/3] ")]
    shards = len(set(index["weight_map"].values()))
    assert said[0].endswith(f", shard 1 of {shards}"), said
    assert said[-2].endswith(f", shard {shards} of {shards}") and said[-1].endswith(f", shard {shards} of {shards}")


def test_a_model_with_its_own_code_exports_with_that_code(tmp_path, monkeypatch):
    source = code_model(tmp_path / "mine", TINY)
    model, trained, out = _exported(tmp_path, source, [f"model.name_or_path={source}", "model.trust_remote_code=true"],
                                    trust_remote_code=True)
    assert type(model).__name__ == "MyModel" and {"cfg.py", "mdl.py"} <= set(os.listdir(out))
    _assert_is_the_trained_model(model, trained)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MyModel"] and config["eos_token_id"] == 256  # the byte tokenizer's EOS
    # from and to S3 (moto's server): the run's copy of the code is found next to the checkpoint there too, and the
    # directory written locally is uploaded whole
    server = S3Server(tmp_path)
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)  # what pyarrow's s3:// URIs read
        fs = server.filesystem()
        pyarrow.fs.copy_files(str(tmp_path / "run"), f"{server.bucket}/runs/run", destination_filesystem=fs)
        uri = f"s3://{server.bucket}/models/m1"
        assert export(f"s3://{server.bucket}/runs/run/checkpoint_step_00000001", uri) == uri
        (tmp_path / "from-s3").mkdir()
        pyarrow.fs.copy_files(f"{server.bucket}/models/m1", str(tmp_path / "from-s3"), source_filesystem=fs)
    finally:
        server.stop()
    assert {f.name: f.read_bytes() for f in (tmp_path / "from-s3").iterdir()} == {
        f.name: f.read_bytes() for f in out.iterdir()}

