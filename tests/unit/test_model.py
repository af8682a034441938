"""raytrain.model on the driver: the one line that says where the weights come from, a
pretrained run refused before any worker starts when there are no weights to load, and the
tokenizer's one-line errors naming the setting it came from."""

import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from raytrain.config import ConfigError, ModelConfig
from raytrain.model import byte_tokenizer, load_model_config, load_tokenizer, model_source


def test_the_model_line_says_weights_or_random_init_and_the_key_that_loads_weights():
    assert model_source(ModelConfig(name_or_path="/m", pretrained=True)) == "weights from /m (model.pretrained=true)"
    assert model_source(ModelConfig(name_or_path="/m")) == (
        "random init from /m's config (model.pretrained=true loads its weights)")
    assert model_source(ModelConfig()).startswith("random init of the built-in tiny Llama")


def test_pretrained_needs_a_model_and_weights_in_its_directory(tmp_path):
    with pytest.raises(ConfigError, match="model.pretrained=true loads the weights of model.name_or_path, which is not set"):
        load_model_config(ModelConfig(pretrained=True))
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=64)
    config.save_pretrained(tmp_path)  # a config alone: random init works, weights do not
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path))).hidden_size == 16
    with pytest.raises(ConfigError, match=f"model.pretrained=true but {tmp_path} holds no weights .*drop "
                                          f"model.pretrained to train from random init"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path), pretrained=True))
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path), pretrained=True)).hidden_size == 16


def test_tokenizer_errors_name_the_key_that_was_set(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a model, no tokenizer
    with pytest.raises(ConfigError, match="^model.name_or_path=.*model': cannot load its tokenizer .*; set "
                                          "model.tokenizer to a directory or hub id that holds one$"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "model")))
    with pytest.raises(ConfigError, match="^model.tokenizer=.*model': cannot load its tokenizer .*; give a local "
                                          "directory or hub id$"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "model")))
    assert load_tokenizer(ModelConfig(tokenizer=str(_saved(tmp_path)))).eos_token_id is not None


def _saved(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"
