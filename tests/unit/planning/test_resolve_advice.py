"""The notes raytrain.planning.resolve.advice prints before a run (settings that run, but not as the user
may expect): here a pretrained model whose config has no EOS at all, an optimizer offloaded to
few CPU threads, and a DeepSpeed monitor whose package the driver lacks (refused where its packages
are the workers')."""

import dataclasses
import sys

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from raytrain.config import ConfigError, ModelConfig, RunConfig, load_config
from raytrain.model import byte_tokenizer
from raytrain.planning.resolve import advice, resolve_run, shape_from_config

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=320, max_position_embeddings=128)


def test_a_pretrained_model_without_an_eos_token_id_gets_the_eos_note(tmp_path):
    # Qwen2-style config.json with eos_token_id: null: the export had no EOS, so generate() never stopped; the note
    # was skipped because there was nothing to compare the tokenizer's EOS with
    path = str(tmp_path / "model")
    LlamaForCausalLM(LlamaConfig(**TINY, eos_token_id=None, bos_token_id=None)).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)

    def eos_notes(**config):
        cfg = RunConfig(model=ModelConfig(name_or_path=path, pretrained=True, config=config))
        return [n for n in advice(resolve_run(cfg, shape_from_config(cfg))) if "EOS" in n]

    assert eos_notes() == [
        f"the tokenizer's EOS is token 256, which packing ends every document with, but {path}'s config.json has no "
        f"eos_token_id: generate() with the exported model never stops at the end of a text; set "
        f"model.config.eos_token_id=256"]
    assert eos_notes(eos_token_id=256) == []  # the way out the note names


def test_a_seq_len_past_a_pretrained_models_positions_is_told_to_shrink_not_to_grow_the_positions(tmp_path):
    # GPT-2's positions are weights: the old fix (set model.config.max_position_embeddings) led to a second refusal,
    # "changes the pretrained weights"; a model built from its config may still take the override
    from transformers import GPT2Config, GPT2LMHeadModel

    path = str(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64, vocab_size=320)).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)

    def refusal(*overrides):
        cfg = load_config(None, [f"model.name_or_path={path}", "data.seq_len=128", *overrides])
        with pytest.raises(ConfigError) as e:
            resolve_run(cfg, shape_from_config(cfg))
        return str(e.value)

    assert refusal("model.pretrained=true") == (
        f"data.seq_len=128 exceeds the model's max_position_embeddings=64: lower data.seq_len to at most 64, the "
        f"length {path} was trained for (model.config.max_position_embeddings can raise it only where positions are "
        f"computed, as RoPE's are, not learned weights)")
    assert refusal().endswith(": lower data.seq_len or set model.config.max_position_embeddings")
    grown = load_config(None, [f"model.name_or_path={path}", "data.seq_len=128",
                                "model.config.max_position_embeddings=128"])
    assert resolve_run(grown, shape_from_config(grown)).config.data.seq_len == 128  # random init: the way out


def test_an_optimizer_offloaded_to_fewer_than_4_cpus_per_worker_gets_the_cpu_adam_note():
    def notes(*overrides):
        cfg = load_config(None, list(overrides))
        return advice(resolve_run(cfg, shape_from_config(cfg)))

    offload = "deepspeed.zero_optimization.offload_optimizer.device=cpu"
    assert notes(offload, "scaling.cpus_per_worker=3.5") == [
        "deepspeed.zero_optimization.offload_optimizer runs DeepSpeed's CPU Adam on the worker's "
        "scaling.cpus_per_worker=3.5 CPU threads: at 1.1B on one H200 that halved tokens/s (1 CPU: 26k, 14 CPUs: 51k; "
        "docs/benchmarks.md); raise scaling.cpus_per_worker"]
    assert notes(offload, "scaling.cpus_per_worker=4") == []
    assert notes("scaling.cpus_per_worker=1") == []  # no offload: the optimizer steps on the GPU


def test_a_deepspeed_monitor_without_its_package_is_refused_where_the_driver_runs_on_a_workers_node(monkeypatch):
    # DeepSpeed's WandbMonitor imports wandb in rank 0's deepspeed.initialize: the run passed the driver, then rank 0
    # failed with ModuleNotFoundError, a traceback retried as a worker failure
    monkeypatch.setitem(sys.modules, "wandb", None)  # cannot be imported here, installed or not
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # the test extra installs it; raytrain's install does not
    board = load_config(None, ['deepspeed={"zero_optimization": {"stage": 3}, "tensorboard": {"enabled": true}}'])
    with pytest.raises(ConfigError, match=r"^deepspeed.tensorboard.enabled=true needs the tensorboard package"):
        resolve_run(board, shape_from_config(board))
    cfg = load_config(None, ['deepspeed={"zero_optimization": {"stage": 3}, "wandb": {"enabled": true}}'])
    with pytest.raises(ConfigError, match=r"^deepspeed.wandb.enabled=true needs the wandb package, which is not "
                                          r"installed here: install it on the cluster's nodes \(pip install wandb\)"):
        resolve_run(cfg, shape_from_config(cfg))
    # a driver on no node of the workers (a laptop, a CPU head node): its packages are not theirs, so a note
    elsewhere = dataclasses.replace(shape_from_config(cfg), driver_on_worker_node=False)
    assert [n for n in advice(resolve_run(cfg, elsewhere)) if "wandb" in n] == [
        "deepspeed.wandb.enabled=true needs the wandb package, which this driver's node lacks; the workers run on "
        "other nodes, not checked from here: it must be installed there, or rank 0 fails in deepspeed.initialize"]
    off = load_config(None, ['deepspeed={"zero_optimization": {"stage": 3}, "wandb": {"enabled": false}}'])
    assert [n for n in advice(resolve_run(off, shape_from_config(off))) if "wandb" in n] == []


def test_per_document_positions_under_sdpa_on_gpus_get_the_masked_attention_note():
    # transformers masks per-document attention with a 4D mask, and SDPA with a mask ran the 1.1B's attention 2.8x as
    # long on an H100 (out of memory at the micro-batch that fits packed rows); flash attention's varlen kernels did not
    from raytrain.hardware import Target
    from raytrain.run_spec import ClusterShape

    def notes(*overrides, use_gpu=True):
        cfg = load_config(None, list(overrides))
        shape = ClusterShape(num_workers=1, use_gpu=use_gpu, gpus_per_node=1 if use_gpu else None)
        return [n for n in advice(resolve_run(cfg, shape, target=Target(80 * 2**30, 125 * 2**30, 1)))
                if "data.position_ids" in n]

    (note,) = notes("data.position_ids=per_document")
    assert note.startswith("data.position_ids=per_document with model.attn_implementation=sdpa: transformers keeps "
                           "attention within each document with a 4D mask")
    assert note.endswith("set model.attn_implementation to one") and "flash_attention_2 or flash_attention_4" in note
    assert "varlen kernels, without a mask" in note
    assert notes("data.position_ids=per_document", "model.attn_implementation=eager") == []  # masked either way
    assert notes("data.position_ids=packed") == []
    assert notes("data.position_ids=per_document", use_gpu=False) == []  # the measured costs are a GPU's
