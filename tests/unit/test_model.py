"""raytrain.model on the driver: the one line that says where the weights come from, a
pretrained run refused before any worker starts when there are no weights to load, when its weight
files are missing, damaged or of another shape, or when model.config would change their shapes,
models that are not decoder-only causal LMs refused, the tokenizer's one-line errors naming the
setting it came from, and the token ids a model built from a config takes from the tokenizer it
trains with."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import (BambaConfig, BertConfig, BertGenerationConfig, BloomConfig, FalconH1Config, Gemma2Config,
                          Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, LlamaConfig, LlamaForCausalLM,
                          NemotronHConfig, RoFormerConfig, T5Config, ViTConfig)

import raytrain
from raytrain.config import ConfigError, ModelConfig, RunConfig
from raytrain.model import (BUILTIN_LLAMA, byte_tokenizer, causal_lm_class, causal_lm_class_name, config_from_facts,
                            flops_per_token, load_generation_config, load_model_config, load_tokenizer, model_source,
                            token_id_warning_held, token_ids_outside_vocab)
from raytrain.planning.resolve import advice, resolve_run, shape_from_config
from raytrain.run_spec import ClusterShape
from tests.helpers import forget_said_warnings, transformers_log

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=320)


def test_the_model_line_says_weights_or_random_init_and_the_key_that_loads_weights():
    assert model_source(ModelConfig(name_or_path="/m", pretrained=True)) == "weights from /m (model.pretrained=true)"
    assert model_source(ModelConfig(name_or_path="/m")) == (
        "random init from /m's config (model.pretrained=true loads its weights)")
    assert model_source(ModelConfig()).startswith("random init of the built-in tiny Llama")
    # a checkpoint the workers restore replaces whatever the model was built with
    assert model_source(ModelConfig(name_or_path="/m", pretrained=True), "/runs/a/checkpoint_3") == (
        "weights from checkpoint /runs/a/checkpoint_3 (the model built from /m's config, no weights read)")
    assert model_source(ModelConfig(), "/runs/a/checkpoint_3") == (
        "weights from checkpoint /runs/a/checkpoint_3 (the model built from the built-in tiny Llama's config, no "
        "weights read)")
    # was "the built-in tiny Llama" also for configs/llama-70b-ib.yaml's 70B, built from model.config
    shaped = ModelConfig(config={"hidden_size": 8192, "num_hidden_layers": 80})
    assert model_source(shaped) == ("random init of the built-in Llama with model.config's overrides "
                                    "(model.name_or_path=DIR trains your own)")
    assert model_source(shaped, "/c") == ("weights from checkpoint /c (the model built from the built-in Llama's "
                                          "config with model.config's overrides, no weights read)")


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


@pytest.mark.parametrize("model_type", ["qwen2", "gpt2", "gpt_neox", "gemma"])
def test_a_model_directory_without_tokenizer_files_is_refused_not_read_as_an_empty_tokenizer(tmp_path, model_type):
    """transformers 5 builds these families' tokenizers from a config.json alone, with special tokens only: every
    text encoded to nothing (Gemma's to <unk>) and a run would have trained on EOS tokens alone."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"^model.name_or_path=.*model': its tokenizer has no vocabulary \(\d tokens?, "
                                          r"all special: .*\): no tokenizer files \(tokenizer.json, .*; set "
                                          r"model.tokenizer to a directory or hub id that holds them$"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "model")))
    with pytest.raises(ConfigError, match="^model.tokenizer=.* has no vocabulary .*; give a directory or hub id"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "model")))


def _slow_tokenizer(path):
    from transformers import ByT5Tokenizer

    ByT5Tokenizer().save_pretrained(path)  # a Python tokenizer: AutoTokenizer loads it as it is (is_fast false)


def _tokenizer_without_eos(path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2},
                                                                        unk_token="<unk>"))).save_pretrained(path)


_SLOW = " has a slow tokenizer: raytrain needs a fast (Rust) tokenizer"
_NO_EOS = ": its tokenizer has no eos_token: documents are separated by EOS; "


@pytest.mark.parametrize("save, key, said", [
    (_slow_tokenizer, "tokenizer", _SLOW),
    (_slow_tokenizer, "name_or_path", _SLOW + "; set model.tokenizer to one"),
    (_tokenizer_without_eos, "tokenizer", _NO_EOS + "use a tokenizer with one"),
    (_tokenizer_without_eos, "name_or_path", _NO_EOS + "set model.tokenizer to a tokenizer with one"),
], ids=["slow", "slow-model", "no-eos", "no-eos-model"])
def test_a_slow_tokenizer_or_one_without_an_eos_is_refused_in_one_line_naming_its_key(tmp_path, save, key, said):
    """The data pipeline encodes with a fast tokenizer and packing separates documents with its EOS: either would
    fail in every tokenize task. The fix names model.tokenizer where the tokenizer came from model.name_or_path."""
    save(tmp_path / "tok")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(ModelConfig(**{key: str(tmp_path / "tok")}))
    assert str(e.value) == f"model.{key}={str(tmp_path / 'tok')!r}{said}"


def _saved(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def _pretrained(tmp_path, **config):
    LlamaForCausalLM(LlamaConfig(**{**TINY, **config})).save_pretrained(tmp_path / "llama")
    byte_tokenizer().save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


def test_pretrained_weights_are_loaded_as_saved_or_the_override_is_refused(tmp_path):
    path = _pretrained(tmp_path)

    def load(**config):
        return load_model_config(ModelConfig(name_or_path=path, pretrained=True, config=config))

    # each would pass on the driver, then every worker fails in from_pretrained (a size mismatch) or
    # quietly randomly initialises what the checkpoint does not hold (a new layer, an untied lm_head)
    with pytest.raises(ConfigError, match=r"^model.config.num_hidden_layers=2 changes the pretrained weights of "
                                          r".*llama \(adds model.layers.1.self_attn.q_proj.weight and 8 more, randomly "
                                          r"initialised\), which model.pretrained=true loads as saved: remove "
                                          r"model.config.num_hidden_layers, or drop model.pretrained"):
        load(num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"^model.config.vocab_size=384 .*\(model.embed_tokens.weight \[320, 16\] "
                                          r"-> \[384, 16\]\)"):
        load(attention_dropout=0.1, vocab_size=384)  # the one that changes a shape is named
    with pytest.raises(ConfigError, match=r"^model.config.tie_word_embeddings=True .*\(drops lm_head.weight\)"):
        load(tie_word_embeddings=True)
    assert load(attention_dropout=0.1, max_position_embeddings=4096).max_position_embeddings == 4096  # no weight
    path = _pretrained(tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"^model.config.tie_word_embeddings=False .*\(adds lm_head.weight, randomly "
                                          r"initialised\)"):
        load(tie_word_embeddings=False)
    path = _pretrained(tmp_path / "two", num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"^model.config.num_hidden_layers=1 .*\(drops "
                                          r"model.layers.1.self_attn.q_proj.weight and 8 more\)"):
        load(num_hidden_layers=1)
    # random init builds whatever the config says
    assert load_model_config(ModelConfig(name_or_path=path, config={"num_hidden_layers": 2})).num_hidden_layers == 2


def test_a_tokenizer_bigger_than_a_pretrained_vocabulary_is_not_told_to_grow_it(tmp_path):
    path = _pretrained(tmp_path)
    big = byte_tokenizer()
    big.add_tokens([f"<extra_{i}>" for i in range(80)])
    big.save_pretrained(tmp_path / "big")
    model = ModelConfig(name_or_path=path, pretrained=True, tokenizer=str(tmp_path / "big"))
    cfg = RunConfig(model=model)
    with pytest.raises(ConfigError, match=r"^the tokenizer has 337 tokens but the pretrained embedding table of "
                                          r".*llama has 320: use the model's own tokenizer \(unset model.tokenizer\) "
                                          r"or one of at most 320 tokens$"):
        resolve_run(cfg, shape_from_config(cfg))


@pytest.mark.parametrize("config, what", [
    (BertConfig(**TINY), r"\(BertConfig\) is an encoder \(is_decoder=false: each token attends to the tokens after it"),
    # no masked-LM class, but its attention follows is_decoder (the meta-device build's is_causal says so)
    (BertGenerationConfig(**TINY), r"\(BertGenerationConfig\) is an encoder \(is_decoder=false"),
    # a masked-LM family whose attention modules carry no is_causal flag: refused by its family
    (RoFormerConfig(**TINY), r"\(RoFormerConfig\) is an encoder \(is_decoder=false"),
    (ViTConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
     r"\(ViTConfig\) has no causal LM class \(AutoModelForCausalLM\)"),
    (T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=320),
     r"\(T5Config\) is an encoder-decoder model"),
])
def test_models_that_are_not_decoder_only_causal_lms_are_refused(tmp_path, config, what):
    config.save_pretrained(tmp_path)
    # BERT's causal LM class would train, seeing the tokens it predicts; trust_remote_code lets through only a
    # config whose auto_map names a causal LM class of its own
    for pretrained, remote in ((False, False), (True, False), (False, True)):
        if pretrained:
            (tmp_path / "model.safetensors").write_bytes(b"")  # refused before any weight is read
        with pytest.raises(ConfigError, match=f"^model.name_or_path=.* {what}.*: raytrain trains decoder-only causal "
                                              f"LMs"):
            load_model_config(ModelConfig(name_or_path=str(tmp_path), pretrained=pretrained, trust_remote_code=remote))


@pytest.mark.parametrize("file, before, after, said", [
    ("mdl.py", "", "\ndef broken(:\n    pass\n", "its own code fails (SyntaxError: invalid syntax, mdl.py line 9): fix "
                                               "that code"),
    ("cfg.py", "", "\ndef broken(:\n    pass\n", "its own code fails (SyntaxError: invalid syntax, cfg.py line 7): fix "
                                               "that code"),
    ("mdl.py", "", "\n    def __init__(self, config):\n        super().__init__(config)\n        undefined_name\n",
     "its own code fails (NameError: name 'undefined_name' is not defined, mdl.py line 11): fix that code"),
    ("cfg.py", "x = undefined_thing\n", "", "its own code fails (NameError: name 'undefined_thing' is not defined, "
                                            "cfg.py line 1): fix"),
    ("cfg.py", "import not_a_package_xyz\n", "", "cannot load its config (ImportError: This modeling file requires "
                                                 "the following packages that were not found in your environment: "
                                                 "not_a_package_xyz. Run `pip install not_a_package_xyz`): install "
                                                 "what it names on the driver and every node"),
], ids=["model-syntax", "config-syntax", "model-name", "config-name", "config-import"])
def test_a_fault_in_the_models_own_code_names_its_file_and_line(tmp_path, file, before, after, said):
    """A model's own code (trust_remote_code) that does not parse or run was blamed on config.json ("correct the
    value in config.json"), and its configuration code's faults were a traceback on the driver."""
    from tests.helpers import code_model

    # a directory name of its own: transformers caches the code it imports by it (transformers_modules.NAME)
    path = code_model(tmp_path / f"m-{os.urandom(4).hex()}", TINY)
    source = Path(path, file)
    source.write_text(before + source.read_text() + after)
    with pytest.raises(ConfigError) as e, transformers_log() as log:
        load_model_config(ModelConfig(name_or_path=path, trust_remote_code=True))
    assert log == []  # transformers' "Encountered exception while importing ..." had printed above the line
    assert str(e.value).startswith(f"model.name_or_path={path!r}: ")
    assert said in str(e.value)
    assert "config.json" not in str(e.value)


def test_the_own_code_file_named_is_the_one_that_failed_not_the_first_that_does_not_parse(tmp_path):
    from tests.helpers import code_model

    path = code_model(tmp_path / f"m-{os.urandom(4).hex()}", TINY)
    Path(path, "a_script.py").write_text("def old(:\n")  # beside the model's code, never loaded by it
    Path(path, "mdl.py").write_text(Path(path, "mdl.py").read_text() + "\nx = (\n")
    with pytest.raises(ConfigError, match=r"its own code fails \(SyntaxError: .*, mdl.py line 9\)"):
        load_model_config(ModelConfig(name_or_path=path, trust_remote_code=True))


def test_a_package_transformers_own_code_needs_is_one_line_without_blaming_the_models_code(tmp_path, monkeypatch):
    """Not the model's own code (no trust_remote_code): a missing optional package, one line naming the class."""
    import transformers

    path = _pretrained(tmp_path)

    def needs_a_package(*args, **kwargs):
        raise ImportError("LlamaForCausalLM requires the not_installed_xyz library")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", needs_a_package)
    with pytest.raises(ConfigError) as e:
        load_model_config(ModelConfig(name_or_path=path))
    assert str(e.value) == (f"model.name_or_path={path!r}: LlamaForCausalLM cannot be built (ImportError: "
                            f"LlamaForCausalLM requires the not_installed_xyz library): install what it names on the "
                            f"driver and every node")


def test_a_file_a_missing_directory_remote_code_and_an_unreachable_hub_id_name_their_fix(tmp_path, monkeypatch):
    from raytrain import model

    path = _pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"^model.name_or_path={path}/config.json is a file; give its directory "
                                          f"\\(model.name_or_path={path}\\)$"):
        load_model_config(ModelConfig(name_or_path=f"{path}/config.json"))
    with pytest.raises(ConfigError, match=f"^model.tokenizer={path}/tokenizer.json is a file; give its directory"):
        load_tokenizer(ModelConfig(tokenizer=f"{path}/tokenizer.json"))
    with pytest.raises(ConfigError, match=f"there is no directory {tmp_path}/nothing: check the path$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "nothing")))
    with pytest.raises(ConfigError, match=f"^model.tokenizer='{tmp_path}/nothing': cannot load its tokenizer "
                                          f"\\(.*\\); there is no directory {tmp_path}/nothing: check the path$"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "nothing")))  # the same fix, naming its own key
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"^model.name_or_path='{tmp_path}/empty': cannot load its config \\(.*\\); "
                                          f"give a directory written by save_pretrained \\(with config.json\\), or a "
                                          f"hub id$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "empty")))
    (tmp_path / "code").mkdir()  # a model whose config names its own code
    (tmp_path / "code" / "cfg.py").write_text("from transformers import LlamaConfig\n"
                                              "class MyConfig(LlamaConfig):\n    model_type = 'mine'\n")
    (tmp_path / "code" / "modeling.py").write_text("from transformers import LlamaForCausalLM\nfrom .cfg import "
                                                   "MyConfig\nclass MyLM(LlamaForCausalLM):\n"
                                                   "    config_class = MyConfig\n")
    (tmp_path / "code" / "config.json").write_text(json.dumps(
        {**TINY, "model_type": "mine", "auto_map": {"AutoConfig": "cfg.MyConfig", "AutoModelForCausalLM":
                                                    "modeling.MyLM"}}))
    with pytest.raises(ConfigError, match=r"cannot load its config \(.*custom code.*\); .*: set "
                                          r"model.trust_remote_code=true to run it \(only for code you trust\)$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "code")))
    # trusted, its causal LM class is its own (no class of transformers' for its config)
    trusted = ModelConfig(name_or_path=str(tmp_path / "code"), trust_remote_code=True)
    assert load_model_config(trusted).vocab_size == 320
    assert causal_lm_class(load_model_config(trusted), trust_remote_code=True).__name__ == "MyLM"
    # and each worker rebuilds the driver's config with that code's class; a config without auto_map (the built-in
    # model's) with transformers' own, trust_remote_code or not
    tokenizer = str(_saved(tmp_path))
    for own, config_class in ((ModelConfig(name_or_path=str(tmp_path / "code"), trust_remote_code=True,
                                           tokenizer=tokenizer), "MyConfig"),
                              (ModelConfig(trust_remote_code=True), "LlamaConfig")):
        cfg = RunConfig(model=own)
        rebuilt = config_from_facts(resolve_run(cfg, shape_from_config(cfg)).model, own)
        assert (type(rebuilt).__name__, rebuilt.vocab_size) == (config_class, 320)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1: no request made
    with pytest.raises(ConfigError, match=r"^model.name_or_path='raytrain-test/absent': cannot load its config .*; no "
                                          r"local directory 'raytrain-test/absent', so it is a Hugging Face hub id "
                                          r"\(HF_HUB_OFFLINE=1 is set: only the local hub cache is read\): check the "
                                          r"name and the network, or download it first \(hf download "
                                          r"raytrain-test/absent --local-dir DIR\) and set model.name_or_path=DIR$"):
        load_model_config(ModelConfig(name_or_path="raytrain-test/absent"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the fix without the offline note
    for spec in ("raytrain-test/absent", "absent"):  # ORG/NAME or NAME: a hub id
        assert model._load_fix(spec, OSError("404"), "model.tokenizer") == (
            f"no local directory {spec!r}, so it is a Hugging Face hub id: check the name and the network, or "
            f"download it first (hf download {spec} --local-dir DIR) and set model.tokenizer=DIR")
    for spec in ("raytrain-test/absent/sub", "./absent", "~/absent"):  # a path, not there
        assert model._load_fix(spec, OSError("404"), "model.tokenizer") == (
            f"there is no directory {spec}: check the path")
    # transformers' refusal of remote code, in either wording, names the setting whatever the spec
    for said in ("Please pass the argument `trust_remote_code=True` to allow custom code to be run.",
                 "The repository for x contains custom code which must be executed", "set trust_remote_code=True"):
        assert model._load_fix("./absent", ValueError(said), "model.name_or_path").startswith(
            "its config names its own Python code (auto_map): set model.trust_remote_code=true to run it")
    # a hub the driver cannot reach is said at once (the whole line: test_an_unreachable_hub_is_one_line_...),
    # and a local directory named like a hub id is read from disk, never asked of the hub
    monkeypatch.setattr(model, "hub_unreachable", lambda repo_id, repo_type="model": "http://127.0.0.1:9: refused")
    with pytest.raises(ConfigError, match=r"^model.name_or_path='raytrain-test/absent': cannot load its config: no "
                                          r"local directory 'raytrain-test/absent', so it is a Hugging Face hub id, "
                                          r"but the hub cannot be reached \(http://127.0.0.1:9: refused\)"):
        load_model_config(ModelConfig(name_or_path="raytrain-test/absent"))
    monkeypatch.chdir(tmp_path / "llama" / "..")
    assert load_model_config(ModelConfig(name_or_path="llama")).vocab_size == 320


def test_a_model_built_from_a_config_takes_the_token_ids_of_the_tokenizer_it_trains_with(tmp_path):
    def resolved(model):
        cfg = RunConfig(model=model)
        return resolve_run(cfg, shape_from_config(cfg))

    # LlamaConfig's defaults are eos 2, bos 1: packing ends documents with the byte tokenizer's EOS 256,
    # and generate() would stop on byte 2
    built_in = resolved(ModelConfig()).model.hf_config
    assert (built_in["eos_token_id"], built_in["bos_token_id"]) == (256, None)
    assert built_in["pad_token_id"] is None  # Llama's padding_idx: that embedding row would never learn
    LlamaConfig(**TINY).save_pretrained(tmp_path / "config")
    own = resolved(ModelConfig(name_or_path=str(tmp_path / "config"), tokenizer=str(_saved(tmp_path)),
                               config={"bos_token_id": 7})).model.hf_config
    assert (own["eos_token_id"], own["bos_token_id"]) == (256, 7)  # model.config wins
    # pretrained: the ids are the model's, learnt with its own tokenizer; a different EOS is said
    path = _pretrained(tmp_path)
    run = resolved(ModelConfig(name_or_path=path, pretrained=True))
    assert run.model.hf_config["eos_token_id"] == 2
    assert [n for n in advice(run) if "EOS" in n] == [
        f"the tokenizer's EOS is token 256, which packing ends every document with, but {path}'s config.json has "
        f"eos_token_id=2: generate() with the exported model stops on the config's; use the model's own tokenizer, "
        f"or set model.config.eos_token_id=256"]
    assert not [n for n in advice(resolved(ModelConfig(name_or_path=path, pretrained=True,
                                                      config={"eos_token_id": 256}))) if "EOS" in n]


@pytest.mark.parametrize("after, said", [
    ({"a": (2, 4), "b": (4,)}, "a [2, 3] -> [2, 4]"),
    ({"a": (2, 3), "b": (3,)}, "b [4] -> [3]"),
    ({"a": (2, 3), "b": (4,), "c": (1,)}, "adds c, randomly initialised"),
    ({"a": (2, 3), "b": (4,), "c": (1,), "d": (1,)}, "adds c and 1 more, randomly initialised"),
    ({"a": (2, 3)}, "drops b"),
    ({}, "drops a and 1 more"),
], ids=["shape", "second-shape", "adds-one", "adds-two", "drops-one", "drops-two"])
def test_the_weight_change_an_override_makes_is_its_first_difference(after, said):
    """What model.pretrained's refusal says an override does to the checkpoint's weights ({name: shape})."""
    from raytrain.model import _shape_change

    assert _shape_change({"a": (2, 3), "b": (4,)}, after) == said


def test_a_pretrained_model_is_built_in_training_mode(tmp_path):
    """from_pretrained returns eval mode; a fine-tune must train (dropout, checkpointing's recompute and Liger's
    fused loss all run only when module.training is true)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain.model import build_model

    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=300)).save_pretrained(tmp_path)
    import warnings

    cfg = ModelConfig(name_or_path=str(tmp_path), pretrained=True, gradient_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(cfg, LlamaConfig.from_pretrained(tmp_path), {"zero_optimization": {"stage": 0}})
    assert model.training and all(m.training for m in model.modules())
    assert model.is_activation_checkpointing
    assert model.model._gradient_checkpointing_func.keywords == {"use_reentrant": False}  # non-reentrant
    # transformers 5.25's deprecated name printed two lines per rank in every checkpointed run
    assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
    assert model.config.use_cache is False  # no KV cache in training: it only costs memory
    # model.gradient_checkpointing=false (the default): no recompute, and a model built from its config trains too
    model = build_model(ModelConfig(name_or_path=str(tmp_path)), LlamaConfig.from_pretrained(tmp_path),
                        {"zero_optimization": {"stage": 0}})
    assert model.training and not model.is_activation_checkpointing


def test_a_pretrained_build_reads_the_saved_weights_unless_a_checkpoint_replaces_them(tmp_path):
    """build_model(from_checkpoint=True) builds from the config alone (the checkpoint's restore replaces every
    weight: no read of the model's own); the attention backend is the one asked for, "auto" left to transformers."""
    import torch

    from raytrain.model import build_model

    saved = LlamaForCausalLM(LlamaConfig(**TINY))
    saved.save_pretrained(tmp_path)
    stage0 = {"zero_optimization": {"stage": 0}}

    def build(**model):
        return build_model(ModelConfig(name_or_path=str(tmp_path), **model), LlamaConfig.from_pretrained(tmp_path),
                           stage0)

    def loaded(model):
        return torch.equal(model.lm_head.weight, saved.lm_head.weight)

    assert loaded(build(pretrained=True)) and not loaded(build())
    assert not loaded(build_model(ModelConfig(name_or_path=str(tmp_path), pretrained=True),
                                  LlamaConfig.from_pretrained(tmp_path), stage0, from_checkpoint=True))
    assert build(attn_implementation="eager").config._attn_implementation == "eager"
    assert build().config._attn_implementation == "sdpa"  # transformers' default for a class that has it


def test_the_parameter_facts_are_those_of_the_model_the_config_builds():
    """param_stats, from a meta-device build: what the planner sizes ZeRO-3's gathers and sub-groups by."""
    from raytrain.model import param_stats

    for config in (LlamaConfig(**TINY), LlamaConfig(**TINY, tie_word_embeddings=True)):
        params = list(LlamaForCausalLM(config).parameters())  # a tied lm_head is the embedding: counted once
        stats = param_stats(config)
        assert stats.param_numels == tuple(p.numel() for p in params) and stats.num_params == sum(stats.param_numels)
        assert stats.param_ndims == tuple(p.dim() for p in params)
        assert stats.largest_layer_params == 320 * 16  # the embedding (or the untied lm_head), the biggest module


def _resolve(tmp_path, config, shape=None, **model):
    """resolve_run for a model saved from `config` (random init), with the byte tokenizer."""
    config.save_pretrained(tmp_path / "model")
    cfg = RunConfig(model=ModelConfig(name_or_path=str(tmp_path / "model"), tokenizer=str(_saved(tmp_path)), **model))
    return resolve_run(cfg, shape or shape_from_config(cfg)), cfg


def test_gpt_neox_is_a_decoder_though_its_config_says_is_decoder_false(tmp_path):
    """Pythia's config carries is_decoder=false (GPTNeoXConfig's default) and its attention is causal
    whatever the flag says: it trains; BERT-like encoders with the flag stay refused (above)."""
    config = GPTNeoXConfig(**TINY)
    assert config.is_decoder is False
    run, _ = _resolve(tmp_path, config)
    assert run.model.model_type == "gpt_neox"


@pytest.mark.parametrize("config", [
    BambaConfig(**TINY, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1),
    FalconH1Config(**TINY, num_key_value_heads=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                   mamba_n_groups=1, mamba_chunk_size=16),
    NemotronHConfig(**TINY, num_key_value_heads=1),
], ids=lambda c: c.model_type)
def test_mamba2_hybrids_with_an_infinite_time_step_limit_reach_the_workers_config(tmp_path, config):
    """time_step_limit is (0, inf): the facts carry it as transformers' JSON tag {"__float__": "Infinity"},
    which the workers' config (and the driver's memory plan) rebuilt as a list holding a dict: a traceback."""
    run, cfg = _resolve(tmp_path, config)
    rebuilt = config_from_facts(run.model, cfg.model)
    assert list(rebuilt.time_step_limit) == [0.0, float("inf")]


@pytest.mark.parametrize("config, attn, what", [
    # (Gemma2's default num_key_value_heads, 4, over TINY's 2 query heads fails every worker's forward: refused)
    (Gemma2Config(**TINY, head_dim=8, num_key_value_heads=2), "sdpa",
     "'sdpa': Gemma2ForCausalLM does not support it (it supports eager, flash_attention_2, flash_attention_3, "
     "flash_attention_4, flex_attention): set model.attn_implementation=eager"),
    (BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=320), "flex_attention",
     "'flex_attention': BloomForCausalLM does not support it (it supports eager): set model.attn_implementation=eager"),
    (LlamaConfig(**TINY), "flash_attention_2", "flash_attention_2 runs on GPUs only, and this run's workers have "
                                               "none: set model.attn_implementation=sdpa"),
], ids=["gemma2-sdpa", "bloom-flex", "llama-flash-on-cpu"])
def test_an_attention_backend_the_model_class_cannot_run_is_refused_on_the_driver(tmp_path, config, attn, what):
    """Each would pass the driver and fail every worker in from_config (transformers checks the class's
    _supports_* flags there)."""
    with pytest.raises(ConfigError, match=f"^model.attn_implementation={re.escape(what)}$"):
        _resolve(tmp_path, config, attn_implementation=attn)


@pytest.mark.parametrize("config, chosen", [(Gemma2Config(**TINY, head_dim=8, num_key_value_heads=2), "eager"),
                                            (LlamaConfig(**TINY), "sdpa")], ids=["gemma2", "llama"])
def test_the_default_attention_is_sdpa_where_the_class_has_it_else_eager(tmp_path, config, chosen):
    """model.attn_implementation's default "auto", made concrete in the run's config (what the planner and the
    workers read), as transformers' own default picks: a Gemma2 run with no attention setting trains."""
    assert ModelConfig().attn_implementation == "auto"
    run, _ = _resolve(tmp_path, config)
    assert run.config.model.attn_implementation == chosen


def test_flash_attention_needs_its_package_or_kernels_where_the_run_starts(tmp_path, monkeypatch):
    import importlib.util

    from raytrain import model

    gpus = ClusterShape(num_workers=1, use_gpu=True, gpus_per_node=1)
    installed = any(importlib.util.find_spec(p) for p in ("flash_attn", "kernels"))
    assert (model.flash_attention_missing(2) is None) == installed  # transformers' own package facts
    monkeypatch.setattr(model, "flash_attention_missing", lambda version: f"the flash-attn package (v{version})")
    with pytest.raises(ConfigError, match=r"^model.attn_implementation=flash_attention_2 needs the flash-attn package "
                                          r"\(v2\), which is not installed here: install it on the cluster's nodes, or "
                                          r"set model.attn_implementation=sdpa$"):
        _resolve(tmp_path, LlamaConfig(**TINY), gpus, attn_implementation="flash_attention_2")
    # A driver on no node of the workers (a CPU head node, a laptop): the GPU nodes' image may have it; noted
    elsewhere = ClusterShape(num_workers=1, use_gpu=True, gpus_per_node=1, driver_on_worker_node=False)
    run, _ = _resolve(tmp_path, LlamaConfig(**TINY), elsewhere, attn_implementation="flash_attention_2")
    assert [n for n in advice(run) if "flash" in n] == [
        "model.attn_implementation=flash_attention_2 needs the flash-attn package (v2), which this driver's node "
        "lacks; the workers run on other nodes, not checked from here: it must be installed on the GPU nodes, or "
        "the run stops as its workers start"]


def test_a_hub_kernel_and_flex_attention_pass_the_attention_check_where_they_can_run():
    """model.attn_implementation=org/repo is a hub kernel transformers fetches at build: not in its list of names,
    and not refused for it. flex_attention is refused only with a torch that lacks it (this one has it)."""
    from transformers.utils import is_torch_flex_attn_available

    from raytrain.planning.resolve import _check_attention

    def check(name):
        return _check_attention(RunConfig(model=ModelConfig(attn_implementation=name)), LlamaConfig(**TINY),
                                ClusterShape(num_workers=1, use_gpu=False))

    assert check("kernels-community/flash-attn") is None
    with pytest.raises(ConfigError, match="^model.attn_implementation='kernels-community' is not an attention"):
        check("kernels-community")
    assert is_torch_flex_attn_available()
    assert check("flex_attention") is None


@pytest.mark.parametrize("hf_config, name, key", [
    (LlamaConfig(**TINY, attention_dropout=0.1), "flash_attention_4", "attention_dropout"),
    (GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=320), "flash_attention_3", "attn_pdrop"),  # 0.1 default
    (LlamaConfig(**TINY, attention_dropout=0.1), "flex_attention", "attention_dropout"),
], ids=["llama-fa4", "gpt2-fa3", "llama-flex"])
def test_an_attention_dropout_the_backend_cannot_apply_is_refused_naming_the_key(hf_config, name, key):
    """FlashAttention-3 and -4 take no dropout: transformers passes them none and warns once, so the run trained
    without the dropout its config asks for; flex_attention raises in every worker's forward. Without the dropout,
    or with a backend that applies it (FlashAttention-2, SDPA), the check passes."""
    from raytrain.planning.resolve import _check_attention

    gpus_elsewhere = ClusterShape(num_workers=1, use_gpu=True, gpus_per_node=1, driver_on_worker_node=False)

    def check(attn, config):
        return _check_attention(RunConfig(model=ModelConfig(attn_implementation=attn)), config, gpus_elsewhere)

    effect = ("fails in every worker's first forward" if name == "flex_attention" else
              "would train without it (transformers passes its kernels no dropout)")
    with pytest.raises(ConfigError, match=re.escape(
            f"model.attn_implementation={name} has no attention dropout, and the model's config has {key}=0.1: the "
            f"run {effect}; set model.config.{key}=0.0 to train without it, or model.attn_implementation=sdpa to "
            f"keep it")):
        check(name, hf_config)
    assert check("flash_attention_2", hf_config) is None and check("sdpa", hf_config) is None
    hf_config = type(hf_config).from_dict({**hf_config.to_dict(), key: 0.0})
    assert check(name, hf_config) is None


@pytest.mark.parametrize("precision, deepspeed", [
    ("fp32", None),
    (None, {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}),  # no bf16/fp16 section on
], ids=["training.precision", "deepspeed-json"])
def test_flash_attention_in_fp32_is_refused_once_the_precision_is_resolved(tmp_path, precision, deepspeed):
    """FlashAttention's kernels assert fp16 or bf16 inputs: in fp32 every worker's first forward failed. The precision
    is the resolved one, so a JSON that turns neither section on counts as fp32; the fix named (bf16) passes."""
    LlamaConfig(**TINY).save_pretrained(tmp_path / "model")
    gpus_elsewhere = ClusterShape(num_workers=1, use_gpu=True, gpus_per_node=1, driver_on_worker_node=False)

    def resolve(attn, **training):
        cfg = RunConfig.from_dict({
            "model": {"name_or_path": str(tmp_path / "model"), "tokenizer": str(_saved(tmp_path)),
                      "attn_implementation": attn},
            "training": {"micro_batch_size_per_gpu": 1, **training},
            **({"deepspeed": deepspeed} if deepspeed else {})})
        return resolve_run(cfg, gpus_elsewhere)

    fp32 = {"precision": precision} if precision else {}
    with pytest.raises(ConfigError, match=re.escape(
            "model.attn_implementation=flash_attention_4 runs in bf16 or fp16 only, and this run trains in fp32 "
            "(training.precision, or the DeepSpeed config's bf16/fp16 sections): set training.precision=bf16, or "
            "model.attn_implementation=sdpa")):
        resolve("flash_attention_4", **fp32)
    assert resolve("sdpa", **fp32).deepspeed.precision == "fp32"
    assert resolve("flash_attention_4", precision="bf16").deepspeed.precision == "bf16"  # the fix named


def test_flex_attention_with_an_attention_dropout_fails_in_the_forward_as_the_refusal_says():
    """The premise of the flex_attention refusal above, on this transformers: a training-mode forward raises."""
    import torch

    model = LlamaForCausalLM._from_config(LlamaConfig(**TINY, attention_dropout=0.1),
                                          attn_implementation="flex_attention").train()
    with pytest.raises(ValueError, match="`flex_attention` does not support `dropout`"):
        model(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("model, model_type, use_gpu, refused", [
    (dict(compile=True, liger_kernel="loss"), "llama", True,
     "model.compile=true does not work with model.liger_kernel=loss (torch.compile fails on Liger's kernels)"),
    (dict(compile=True), "llama", True, None),
    (dict(liger_kernel="loss"), "llama", False, None),  # the loss kernel runs on CPU
    (dict(liger_kernel="all"), "llama", True, None),
    (dict(liger_kernel="all"), "llama", False, "model.liger_kernel=all needs GPUs (triton kernels): use loss or none "
                                               "on CPU"),
    (dict(liger_kernel="loss"), "gpt2", True, "model.liger_kernel=loss patches Llama models only, and this model is "
                                              "gpt2: set model.liger_kernel=none"),
    (dict(fused_layers=True), "llama", False, None),
    (dict(fused_layers=True, compile=True), "llama", True, "model.fused_layers=true with model.compile=true: not "
                                                           "measured together"),
], ids=["compile-liger", "compile", "liger-loss-cpu", "liger-all-gpu", "liger-all-cpu", "liger-gpt2", "fused",
        "fused-compile"])
def test_model_options_that_cannot_run_together_are_refused_and_the_others_pass(model, model_type, use_gpu, refused):
    """raytrain.planning.resolve._check_model_options on the driver: each refusal would fail every worker (or be
    slower for nothing) after the cluster started."""
    from raytrain.planning.resolve import _check_model_options

    hf_config = LlamaConfig(**TINY) if model_type == "llama" else GPT2Config(n_embd=16, n_layer=1, n_head=2)
    cfg = RunConfig(model=ModelConfig(attn_implementation="eager", **model))
    shape = ClusterShape(num_workers=1, use_gpu=use_gpu, gpus_per_node=1 if use_gpu else None)
    if refused is None:
        assert _check_model_options(cfg, hf_config, shape) is None
    else:
        with pytest.raises(ConfigError, match=f"^{re.escape(refused)}"):
            _check_model_options(cfg, hf_config, shape)


def test_a_worker_without_flash_attention_stops_the_run_in_one_line_naming_its_node(tmp_path, monkeypatch):
    """The driver lets a run through when it runs on no node of the workers (above); a worker whose node lacks the
    package then stops the run as a bad record does (one line naming the node, the key, the package and the fix;
    exit 2, no retry: a restart meets it again), before it builds anything. A direct build_model raises the line."""
    import socket

    from raytrain import model
    from raytrain.data.bad_records import SetupMistake, stop_run

    cfg = ModelConfig(attn_implementation="flash_attention_2")
    monkeypatch.setattr(model, "flash_attention_missing", lambda version: None)
    assert model.node_lacks(cfg) is None and model.node_lacks(ModelConfig()) is None
    monkeypatch.setattr(model, "flash_attention_missing", lambda version: f"the flash-attn package (v{version})")
    assert model.node_lacks(ModelConfig(attn_implementation="sdpa")) is None
    line = (f"node {socket.gethostname()}: model.attn_implementation=flash_attention_2 needs the flash-attn package "
            f"(v2), which is not installed there: install it on the GPU nodes, or set model.attn_implementation=sdpa")
    with pytest.raises(SetupMistake) as e:  # what the worker's loop does with it, outside a run (no counter)
        stop_run(SetupMistake(f"node {socket.gethostname()}", *model.node_lacks(cfg)), None)
    assert str(e.value) == line
    with pytest.raises(ImportError) as e:
        model.build_model(cfg, LlamaConfig(**TINY), {"zero_optimization": {"stage": 0}})
    assert str(e.value) == line


def test_overrides_are_checked_by_the_config_class_and_the_model_as_a_worker_builds_them(tmp_path):
    """model.config on a model directory: the class's validators ran only for the built-in model (each
    worker rebuilt the config and raised); values the model's constructor refuses raised there too."""
    LlamaConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).save_pretrained(tmp_path)

    def load(**config):
        return load_model_config(ModelConfig(name_or_path=str(tmp_path), config=config))

    with pytest.raises(ConfigError, match=r"^model.config.num_attention_heads=5: the model's config refuses it "
                                          r"\(ValueError: The hidden size \(16\) is not a multiple of the number of "
                                          r"attention heads \(5\).\)$"):
        load(attention_dropout=0.1, num_attention_heads=5)  # the key that fails is named
    with pytest.raises(ConfigError, match=r"^model.config.intermediate_size=-3: the model cannot be built with it "
                                          r"\(RuntimeError: .*negative dimension -3"):
        load(intermediate_size=-3)
    with pytest.raises(ConfigError, match=r"^model.config.pad_token_id=320 is outside the model's vocabulary "
                                          r"\(vocab_size=320\): use ids from 0 to 319, or null$"):
        load(pad_token_id=320)  # transformers only warns; the embedding's padding_idx asserts in every worker
    with pytest.raises(ConfigError, match=r"^model.config.eos_token_id=\[2, 400\] is outside the model's vocabulary"):
        load(eos_token_id=[2, 400])  # a list of ids: each is checked
    with pytest.raises(ConfigError, match=re.escape(
            "model.config.rope_theta: LlamaConfig has no such field; it is part of model.config.rope_parameters (now "
            '{"rope_theta": 500000.0, "rope_type": "default"}): give that with your rope_theta')):
        load(rope_theta=1e6)  # transformers 5 keeps it in rope_parameters: given beside them it was ignored
    with pytest.raises(ConfigError, match=r"^model.config.hidden_act='gelu_fast2' is not an activation transformers "
                                          r"knows: did you mean gelu_fast\?"):
        load(hidden_act="gelu_fast2")
    with pytest.raises(ConfigError, match=r"^model.config.rope_scaling: rope_type='yarnn' is not a RoPE type "
                                          r"transformers knows: did you mean yarn\?"):
        load(rope_scaling={"rope_type": "yarnn", "factor": 2.0})
    # nothing close: the known names alone
    with pytest.raises(ConfigError, match=r"^model.config.hidden_act='zzzz' is not an activation transformers "
                                          r"knows: \(known: .*\bsilu\b"):
        load(hidden_act="zzzz")
    with pytest.raises(ConfigError, match=r"^model.config.rope_scaling: rope_type='zzzz' is not a RoPE type "
                                          r"transformers knows: \(known: .*\blinear\b"):
        load(rope_scaling={"rope_type": "zzzz", "factor": 2.0})
    assert load(pad_token_id=0).pad_token_id == 0
    assert load(rope_scaling=None).rope_parameters["rope_theta"] == 500000.0  # null: no RoPE type to check
    # null where it would change the model without a word: rope_parameters=null resets the theta to the class's
    with pytest.raises(ConfigError, match=re.escape(
            'model.config.rope_parameters=null resets the model\'s rope_theta to the class default (now '
            '{"rope_theta": 500000.0, "rope_type": "default"}, then {"rope_theta": 10000.0, "rope_type": "default"}): '
            'to train without scaling at the model\'s own theta set model.config.rope_parameters={"rope_type": '
            '"default", "rope_theta": 500000.0}')):
        load(rope_parameters=None)
    # a good rope_scaling keeps the model's rope_theta (set as an attribute it became None: a TypeError in
    # every worker's rotary embedding), and the run config's own dict is left as written
    scaling = {"rope_type": "linear", "factor": 2.0}
    assert load(rope_scaling=scaling).rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    assert scaling == {"rope_type": "linear", "factor": 2.0}
    # a model without RoPE, and an override given by the name its attribute_map aliases (GPT-2's n_head)
    GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=320, n_positions=64).save_pretrained(tmp_path / "gpt2")
    gpt2 = load_model_config(ModelConfig(name_or_path=str(tmp_path / "gpt2"),
                                         config={"resid_pdrop": 0.0, "num_attention_heads": 4}))
    assert (gpt2.n_head, gpt2.resid_pdrop) == (4, 0.0)
    with pytest.raises(ConfigError, match=r"^model.config.num_attention_head: GPT2Config has no such field; did you "
                                          r"mean model.config.num_attention_heads\?$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "gpt2"), config={"num_attention_head": 4}))


def test_a_null_rope_scaling_that_would_be_ignored_is_refused_with_the_dict_that_means_it(tmp_path):
    """transformers 5 keeps RoPE's theta and scaling in rope_parameters: model.config.rope_scaling=null (the
    transformers 4 way to drop a scaling) left a linear or YaRN scaling in place without a word, and
    rope_parameters=null reset the theta. The fix named is the dict that drops the scaling and keeps each theta,
    and it builds; a null that changes nothing (Gemma 3's per-layer defaults) passes."""
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    LlamaConfig(**TINY, rope_parameters=scaled).save_pretrained(tmp_path / "llama")
    fix = '{"rope_type": "default", "rope_theta": 500000.0}'

    def load(path, **config):
        return load_model_config(ModelConfig(name_or_path=str(path), config=config))

    with pytest.raises(ConfigError, match=re.escape(
            "model.config.rope_scaling=null leaves the model's RoPE scaling as it is: this transformers keeps it in "
            'rope_parameters (now {"factor": 2.0, "rope_theta": 500000.0, "rope_type": "linear"}); to train without it '
            f"set model.config.rope_parameters={fix}")) as e:
        load(tmp_path / "llama", rope_scaling=None)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=re.escape(f"set model.config.rope_parameters={fix}")):
        load(tmp_path / "llama", rope_parameters=None)
    assert load(tmp_path / "llama", rope_parameters=json.loads(fix)).rope_parameters == json.loads(fix)
    # both given: the dict says what is meant, and the null beside it is the old name's
    both = load(tmp_path / "llama", rope_parameters=json.loads(fix), rope_scaling=None)
    assert both.rope_parameters == json.loads(fix)
    # nested per layer type: the fix keeps each layer type's theta
    gemma = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    Gemma3TextConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32, head_dim=8,
                     num_hidden_layers=2, vocab_size=320, rope_parameters=gemma).save_pretrained(tmp_path / "gemma")
    with pytest.raises(ConfigError) as e:
        load(tmp_path / "gemma", rope_scaling=None)
    nested_fix = json.loads(str(e.value).rsplit("model.config.rope_parameters=", 1)[1])
    assert nested_fix == {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert load(tmp_path / "gemma", rope_parameters=nested_fix).rope_parameters == nested_fix
    # Gemma 3's class defaults are these thetas: rope_parameters=null drops the scaling and changes no theta
    assert load(tmp_path / "gemma", rope_parameters=None).rope_parameters == nested_fix


def test_the_planner_and_the_workers_count_a_tokens_flops_with_one_function():
    """The planner's tokens/s (raytrain.planning.throughput) and the workers' MFU (raytrain.worker.loop) both read
    raytrain.model.flops_per_token: a second copy could drift, and MFU would no longer be what the planner ranked."""
    # The 1.10B row (benchmarks/results/2026-12-01-h200): 6 x 1,100,048,384 + 12 x 22 x 2048 x 2048.
    assert flops_per_token(1_100_048_384, 22, 2048, 2048) == 7_707_586_560
    package = Path(raytrain.__file__).parent
    defined = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                     if "def flops_per_token(" in p.read_text())
    assert defined == ["model.py"]


def _with_token_ids(path, **ids):
    """`path`'s config.json with `ids` written into it, as a hub config may carry them (transformers only warns)."""
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **ids}))
    return str(path)


def test_config_json_token_ids_outside_the_vocabulary_are_said_once_in_a_note_not_warned(tmp_path):
    """transformers warns "Model config: eos_token_id must be `None` or an integer within the vocabulary ..." in
    every process that loads such a config: the driver, each worker, each Ray Data tokenize task (its tokenizer
    read DIR's config.json). The driver says once, in a note, what each id does to the run."""
    from transformers import AutoConfig

    _pretrained(tmp_path, vocab_size=333)  # a vocabulary of its own: transformers warns once per message
    path = _with_token_ids(tmp_path / "llama", eos_token_id=4321, bos_token_id=4322, pad_token_id=-1)

    def notes(**config):
        cfg = RunConfig(model=ModelConfig(name_or_path=path, pretrained=True, config=config))
        return [n for n in advice(resolve_run(cfg, shape_from_config(cfg))) if "vocabulary" in n or "EOS" in n]

    with transformers_log() as log:
        said = notes()
    assert not [m for m in log if "must be `None` or an integer within the vocabulary" in m], log
    assert said == [
        f"{path} has token ids in its config.json outside the model's vocabulary (0 to 332), which transformers only "
        f"warns about: bos_token_id=4322: packing starts documents with no BOS (the tokenizer adds none); "
        f"eos_token_id=4321: packing ends every document with the tokenizer's EOS (token 256), so the data is not affected, but "
        f"generate() with the exported model stops only at this id, which it never produces; pad_token_id=-1: "
        f"LlamaForCausalLM makes it its embedding's padding row, row 332 (no token of the tokenizer), which gets no "
        f"gradient; the exported config.json keeps them: set model.config.bos_token_id=null "
        f"model.config.eos_token_id=256 model.config.pad_token_id=null"]
    assert notes(bos_token_id=None, eos_token_id=256, pad_token_id=None) == []  # the fix the note names
    said = notes(bos_token_id=None)[0]  # two left outside, as the overrides' config has them
    assert said.startswith(f"{path} has token ids with model.config's overrides outside the model's vocabulary (0 to "
                           f"332), which transformers only warns about: eos_token_id=4321: "), said
    assert said.endswith("keeps them: set model.config.eos_token_id=256 model.config.pad_token_id=null"), said
    with transformers_log() as log:  # a load outside raytrain's hold still warns: the message is transformers'
        AutoConfig.from_pretrained(_with_token_ids(tmp_path / "llama", eos_token_id=4323))
    assert [m for m in log if "eos_token_id must be `None` or an integer within the vocabulary" in m], log


def test_a_config_json_the_model_cannot_be_built_from_is_one_line_naming_it(tmp_path):
    """A value of config.json itself that the model's constructor refuses was a traceback from the driver's planner
    (exit 1), then from every worker: only model.config's overrides were checked."""
    LlamaConfig(**{**TINY, "intermediate_size": -3}).save_pretrained(tmp_path)
    line = (rf"^model.name_or_path='{re.escape(str(tmp_path))}': LlamaForCausalLM cannot be built from its "
            r"config.json \(RuntimeError: .*negative dimension -3.*\): correct the value in config.json, or override "
            r"it with model.config.KEY=VALUE$")
    for config in ({}, {"attention_dropout": 0.1}):  # an override that is not the cause is not named
        with pytest.raises(ConfigError, match=line):
            load_model_config(ModelConfig(name_or_path=str(tmp_path), config=config))
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path), config={"intermediate_size": 32}))  # the fix


def test_a_pad_token_id_outside_the_vocabulary_is_an_error_or_a_frozen_row_not_a_traceback(tmp_path):
    # 500 past a table of 320: torch's "Padding_idx must be within num_embeddings" on the driver's meta build,
    # a traceback (and in every worker's build)
    LlamaConfig(**TINY, pad_token_id=500, eos_token_id=600).save_pretrained(tmp_path / "past")
    # only the id the build fails on is named (Llama's eos_token_id past the table builds)
    with pytest.raises(ConfigError, match=r"^.*/past has pad_token_id=500 in its config.json, outside the model's "
                                          r"vocabulary \(vocab_size=320\): LlamaForCausalLM cannot be built with it "
                                          r"\(AssertionError: Padding_idx must be within num_embeddings\); set "
                                          r"model.config.pad_token_id=null \(or an id from 0 to 319\)$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "past")))
    # an override that puts it outside is named as one
    with pytest.raises(ConfigError, match=r"^.*/past has pad_token_id=500 with model.config's overrides, outside "
                                          r"the model's vocabulary \(vocab_size=400\)"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "past"), config={"vocab_size": 400}))
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path / "past"), config={"pad_token_id": None}))
    # an id outside that builds (Llama's eos_token_id) beside an override the model cannot be built with: the
    # override is named, not the id
    LlamaConfig(**TINY, eos_token_id=600).save_pretrained(tmp_path / "eos")
    with pytest.raises(ConfigError, match=r"^model.config.intermediate_size=-3: the model cannot be built with it"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "eos"), config={"intermediate_size": -3}))
    # both mistakes at once, config.json's id that fails its build and an override that fails too: the file's id
    # is named first (the build check alone would name only config.json)
    with pytest.raises(ConfigError, match=r"^.*/past has pad_token_id=500 in its config.json, outside the model's "
                                          r"vocabulary \(vocab_size=320\): .*; set model.config.pad_token_id=null"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "past"), config={"intermediate_size": -3}))
    with pytest.raises(ConfigError, match=r"^model.config.intermediate_size=-3: the model cannot be built with it"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "past"),
                                      config={"intermediate_size": -3, "pad_token_id": None}))  # the fix named
    with pytest.raises(ConfigError, match=r"^model.config.intermediate_size=-3: the model cannot be built with it"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "past"),  # a table the id fits, or a traceback
                                      config={"vocab_size": 1000, "intermediate_size": -3}))
    # -1 builds: torch counts it from the end, and the last row, here the byte tokenizer's EOS, gets no gradient.
    # A model built from a config takes the tokenizer's EOS and BOS: the config's 4400 is not said.
    LlamaConfig(**{**TINY, "vocab_size": 257}, pad_token_id=-1, eos_token_id=4400).save_pretrained(tmp_path / "neg")
    byte_tokenizer().save_pretrained(tmp_path / "neg")
    cfg = RunConfig(model=ModelConfig(name_or_path=str(tmp_path / "neg")))
    run = resolve_run(cfg, shape_from_config(cfg))
    assert run.model.hf_config["eos_token_id"] == 256
    assert [n for n in advice(run) if "vocabulary" in n] == [
        f"{tmp_path / 'neg'} has a token id in its config.json outside the model's vocabulary (0 to 256), which "
        f"transformers only warns about: pad_token_id=-1: LlamaForCausalLM makes it its embedding's padding row, "
        f"row 256 (token 256 ('<|endoftext|>') of the tokenizer), which gets no gradient, and generate() with the "
        f"exported model fails on a batch once one of its rows ends before the others (the rows that ended are "
        f"filled with this id: index out of range); the exported config.json keeps it: set "
        f"model.config.pad_token_id=null"]


@pytest.mark.parametrize("values, vocab, outside", [
    ({"pad_token_id": 5, "eos_token_id": 320, "bos_token_id": -1, "vocab_size": 999}, 320,
     {"eos_token_id": 320, "bos_token_id": -1}),
    ({"eos_token_id": [2, 400], "bos_token_id": [0, 319], "pad_token_id": None}, 320, {"eos_token_id": [2, 400]}),
    ({"pad_token_id": True, "sep_token_id": "7", "decoder_start_token_id": 0}, 1, {}),  # no ids, or within
    ({"pad_token_id": 500}, None, {}),  # a config without a vocabulary size: nothing to compare with
], ids=["ids", "id-lists", "not-ids", "no-vocab-size"])
def test_the_token_ids_outside_the_vocabulary_are_the_integer_ids_past_either_end(values, vocab, outside):
    assert token_ids_outside_vocab(values, vocab) == outside


def test_the_hold_is_only_transformers_token_id_warning_and_only_inside_the_block():
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.configuration_utils")
    with transformers_log() as log:
        with token_id_warning_held():
            logger.warning("Model config: pad_token_id must be `None` or an integer within the vocabulary (between 0 "
                           "and 9), got 77. This may result in unexpected behavior.")
            logger.warning("another warning")
        logger.warning("Model config: pad_token_id must be `None` or an integer within the vocabulary (between 0 "
                       "and 9), got 78. This may result in unexpected behavior.")
    assert log == ["another warning", "Model config: pad_token_id must be `None` or an integer within the vocabulary "
                                      "(between 0 and 9), got 78. This may result in unexpected behavior."]


_PAD_FLAG = "The following generation flags are not valid and may be ignored: ['pad_token_id']."


def test_the_generation_configs_pad_warning_is_held_only_when_pad_token_id_is_its_only_flag():
    """transformers' GenerationConfig warns in one line that lists every flag at fault: the list that is only
    pad_token_id is what raytrain's note says; one with another flag says something more, and is not held."""
    from transformers import GenerationConfig

    forget_said_warnings()
    with transformers_log() as log:
        with token_id_warning_held():
            GenerationConfig(pad_token_id=-1)
            GenerationConfig(pad_token_id=-1, do_sample=False, temperature=0.5)
        forget_said_warnings()
        GenerationConfig(pad_token_id=-1)
    assert [m.split(".")[0] for m in log] == [
        "The following generation flags are not valid and may be ignored: ['pad_token_id', 'temperature']",
        "The following generation flags are not valid and may be ignored: ['pad_token_id']"]


def test_a_hub_configs_pad_token_id_of_minus_one_is_said_once_by_the_driver_not_by_every_build(tmp_path):
    """A Llama config.json with pad_token_id=-1 (and the generation_config.json save_pretrained derives from it):
    transformers warns "The following generation flags are not valid and may be ignored: ['pad_token_id']" as
    every model is built (PreTrainedModel's constructor derives its generation config from the config) and as the
    generation config is read: on the driver, once per worker, in the export. The driver's note says what it
    does instead: a frozen embedding row, and batched generate() with the export fails."""
    from transformers import GenerationConfig

    from raytrain.checkpoint.model_files import write_model_files
    from raytrain.model import build_model

    path = _pretrained(tmp_path, vocab_size=334, pad_token_id=-1)  # a vocabulary of its own (see forget_said_...)
    assert GenerationConfig.from_pretrained(path).pad_token_id == -1  # as save_pretrained derived it
    cfg = RunConfig(model=ModelConfig(name_or_path=path, pretrained=True))
    forget_said_warnings()
    with transformers_log() as driver:
        run = resolve_run(cfg, shape_from_config(cfg))
        said = [n for n in advice(run) if "vocabulary" in n]
        write_model_files(str(tmp_path / "run"), cfg.model, run.model)
    forget_said_warnings()  # a worker is a new process
    with transformers_log() as worker:
        build_model(cfg.model, config_from_facts(run.model, cfg.model), {"zero_optimization": {"stage": 0}})
    assert driver == [] and worker == []
    assert said == [
        f"{path} has a token id in its config.json outside the model's vocabulary (0 to 333), which transformers "
        f"only warns about: pad_token_id=-1: LlamaForCausalLM makes it its embedding's padding row, row 333 (no token "
        f"of the tokenizer), which gets no gradient, and generate() with the exported model fails on a batch once "
        f"one of its rows ends before the others (the rows that ended are filled with this id: index out of range); "
        f"the exported config.json keeps it: set model.config.pad_token_id=null"]
    # the run's copy keeps the model's value (the export writes it), and a build outside raytrain still warns
    assert GenerationConfig.from_pretrained(tmp_path / "run" / "model").pad_token_id == -1
    forget_said_warnings()
    with transformers_log() as log:
        LlamaForCausalLM(config_from_facts(run.model, cfg.model))
    assert [m for m in log if m.startswith(_PAD_FLAG)], log


def test_what_the_note_says_a_pad_token_id_of_minus_one_does_to_generate_is_what_it_does():
    """The note's claim, on transformers' own generate(): a batch whose first row ends (its EOS) before the
    second gets the pad id as the first row's next token, and the embedding cannot look up -1."""
    import torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 64}, pad_token_id=-1, bos_token_id=None,
                                         eos_token_id=None)).eval()
    prompts = torch.tensor([[5, 6, 7], [9, 10, 11]])
    first = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=1)[:, -1]
    assert first[0] != first[1]  # the seed's model: the two rows' first tokens differ
    model.generation_config.eos_token_id = int(first[0])  # the first row ends after one token, the second goes on
    with pytest.raises(IndexError, match="index out of range"):
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3)
    model.generation_config.pad_token_id = None  # the fix the note names: generate() pads with EOS
    assert model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3).shape == (2, 6)


def test_a_generation_config_json_pad_token_id_outside_the_vocabulary_has_its_own_note(tmp_path):
    """config.json's pad_token_id within the vocabulary (or none), generation_config.json's -1: generate() reads
    the generation config's. The fix that note names goes into the run's generation config, config.json as it was."""
    from transformers import GenerationConfig

    from raytrain.checkpoint.model_files import write_model_files

    path = _pretrained(tmp_path, vocab_size=335)
    # as a hub repo may carry it (GenerationConfig.save_pretrained refuses to write a new one with -1)
    (tmp_path / "llama" / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": -1}))

    def notes(**config):
        cfg = RunConfig(model=ModelConfig(name_or_path=path, pretrained=True, config=config))
        run = resolve_run(cfg, shape_from_config(cfg))
        write_model_files(str(tmp_path / "runs" / str(len(config))), cfg.model, run.model)
        return [n for n in advice(run) if "vocabulary" in n]

    assert notes() == [
        f"{path}'s generation_config.json has pad_token_id=-1, outside the model's vocabulary (0 to 334): generate() "
        f"with the exported model fails on a batch once one of its rows ends before the others (the rows that ended "
        f"are filled with this id: index out of range); the export keeps it: set model.config.pad_token_id=null (the "
        f"run's generation config takes model.config's token ids)"]
    assert GenerationConfig.from_pretrained(tmp_path / "runs" / "0" / "model").pad_token_id == -1
    assert notes(pad_token_id=None) == []
    assert GenerationConfig.from_pretrained(tmp_path / "runs" / "1" / "model").pad_token_id is None
    # the fix names config.json's pad_token_id where it is within the vocabulary, null where it is outside too
    for pad, fix in [(5, "5"), (-1, "null")]:
        path = _pretrained(tmp_path / str(pad), vocab_size=335, pad_token_id=pad)
        (tmp_path / str(pad) / "llama" / "generation_config.json").write_text(json.dumps({"pad_token_id": -2}))
        cfg = RunConfig(model=ModelConfig(name_or_path=path, pretrained=True))
        assert [n for n in advice(resolve_run(cfg, shape_from_config(cfg))) if "vocabulary" in n][-1] == (
            f"{path}'s generation_config.json has pad_token_id=-2, outside the model's vocabulary (0 to 334): "
            f"generate() with the exported model fails on a batch once one of its rows ends before the others (the "
            f"rows that ended are filled with this id: index out of range); the export keeps it: set "
            f"model.config.pad_token_id={fix} (the run's generation config takes model.config's token ids)")


def test_the_generation_config_is_the_model_directorys_file_or_none(tmp_path):
    """generate()'s token ids come from generation_config.json where the model has one; the built-in model and a
    directory without the file have none (the run's copy then derives one from config.json)."""
    assert load_generation_config(ModelConfig()) is None
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert load_generation_config(ModelConfig(name_or_path=str(tmp_path))) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "max_new_tokens": 9}))
    generation = load_generation_config(ModelConfig(name_or_path=str(tmp_path)))
    assert (generation.eos_token_id, generation.max_new_tokens) == (7, 9)


def test_the_built_in_models_vocabulary_holds_the_byte_tokenizer_padded_to_a_multiple_of_64():
    """A table that every byte token and the EOS index into, padded to a multiple of 64 rows, and key/value heads
    that divide the query heads (the kv-head check is not run on it without overrides)."""
    vocab = BUILTIN_LLAMA["vocab_size"]
    assert vocab % 64 == 0 and len(byte_tokenizer()) <= vocab < len(byte_tokenizer()) + 64
    assert BUILTIN_LLAMA["num_attention_heads"] % BUILTIN_LLAMA["num_key_value_heads"] == 0
    assert load_model_config(ModelConfig()).vocab_size == vocab


def _llama_style_tokenizer():
    """A Llama-style tokenizer, built in code (as tests/unit/data/test_packing.py's): <s> (1) before every text."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, **{ch: 4 + i for i, ch in enumerate("abcdefghij")}}
    return LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=True)


def test_a_documents_start_ids_are_what_the_tokenizer_puts_before_a_text():
    """Packing puts them before every document: the BOS of a Llama-style tokenizer, nothing for the byte one."""
    from raytrain.model import document_start_ids

    assert document_start_ids(_llama_style_tokenizer()) == (1,)
    assert document_start_ids(byte_tokenizer()) == ()


@pytest.mark.parametrize("build, said", [
    (lambda: (LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=500, eos_token_id=2)), _llama_style_tokenizer()),
     "bos_token_id=500: packing starts every document with the tokenizer's BOS (token 1), not this id; the exported "
     "config.json keeps it: set model.config.bos_token_id=1"),
    (lambda: (LlamaForCausalLM(LlamaConfig(**TINY, pad_token_id=5, sep_token_id=500, eos_token_id=[2, 256])), None),
     "sep_token_id=500: raytrain does not use it; "),  # and no EOS note: the tokenizer's 256 is one of the list
    (lambda: (LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 258}, pad_token_id=-1, eos_token_id=256)), None),
     "pad_token_id=-1: LlamaForCausalLM makes it its embedding's padding row, row 257 (no token of the tokenizer), "),
    (lambda: (GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=320, n_positions=128,
                                         pad_token_id=400, eos_token_id=256, bos_token_id=256)), None),
     "pad_token_id=400: raytrain does not use it, and generate() "),
], ids=["bos-of-the-tokenizer", "sep-and-an-eos-list", "padding-row-past-the-tokenizer",
        "gpt2-without-a-padding-row"])
def test_what_a_token_id_outside_the_vocabulary_does_is_said_for_its_key_and_model(tmp_path, build, said):
    model, tokenizer = build()  # tokenizer None: the byte tokenizer
    model.save_pretrained(tmp_path / "m")
    (tokenizer or byte_tokenizer()).save_pretrained(tmp_path / "m")
    cfg = RunConfig(model=ModelConfig(name_or_path=str(tmp_path / "m"), pretrained=True))
    notes = advice(resolve_run(cfg, shape_from_config(cfg)))
    assert len(notes) == 1 and "has a token id in its config.json outside the model's vocabulary" in notes[0], notes
    assert said in notes[0], notes


_DROP = "give the directory save_pretrained wrote (copy or download {} again), or drop model.pretrained to train " \
        "from random init"


def test_a_pretrained_directorys_weight_files_are_read_on_the_driver_not_first_in_every_worker(tmp_path):
    """Each passed the driver and failed every worker's from_pretrained: a shard the index names missing
    (FileNotFoundError), a damaged safetensors file (SafetensorError), weights of another config (a size
    mismatch). The driver reads the safetensors headers only (names and shapes), never a tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    def refused(path):
        with pytest.raises(ConfigError) as e:
            load_model_config(ModelConfig(name_or_path=str(path), pretrained=True))
        return str(e.value)

    sharded = tmp_path / "sharded"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(sharded, max_shard_size="10KB")  # 4 shards
    assert load_model_config(ModelConfig(name_or_path=str(sharded), pretrained=True)).vocab_size == 320  # all there
    (sharded / "model-00002-of-00004.safetensors").unlink()
    assert refused(sharded) == (f"model.pretrained=true but {sharded}/model.safetensors.index.json names shards that "
                                f"are not in {sharded}: model-00002-of-00004.safetensors (1 of 4 files): "
                                f"{_DROP.format(sharded)}")
    (sharded / "model-00004-of-00004.safetensors").unlink()
    assert refused(sharded).startswith(f"model.pretrained=true but {sharded}/model.safetensors.index.json names "
                                       f"shards that are not in {sharded}: model-00002-of-00004.safetensors and 1 "
                                       f"more (2 of 4 files): ")
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')  # a copy cut short
    assert refused(sharded).startswith(f"model.pretrained=true but {sharded}/model.safetensors.index.json is not an "
                                       f"index of weight files (a JSON object whose weight_map names a shard per "
                                       f"weight; JSONDecodeError: ")

    damaged = Path(_pretrained(tmp_path))
    config = json.loads((damaged / "config.json").read_text())  # config.json may name the file from_pretrained reads
    (damaged / "config.json").write_text(json.dumps({**config, "transformers_weights": "other.safetensors"}))
    assert refused(damaged) == (f"model.pretrained=true but {damaged} has no other.safetensors (its config.json's "
                                f"transformers_weights): {_DROP.format(damaged)}")
    (damaged / "config.json").write_text(json.dumps(config))
    whole = (damaged / "model.safetensors").read_bytes()
    for content, reason in ((b"garbage" * 10, "header too large"),
                            (whole[: len(whole) // 2], "incomplete metadata, file not fully covered")):
        (damaged / "model.safetensors").write_bytes(content)
        assert refused(damaged) == (f"model.pretrained=true but {damaged}/model.safetensors is not a readable "
                                    f"safetensors file (SafetensorError: Error while deserializing header: {reason}; "
                                    f"damaged, cut short or not a weight file): {_DROP.format(damaged)}")

    other = tmp_path / "other"  # weights of intermediate_size=24 beside a config.json that says 32
    LlamaForCausalLM(LlamaConfig(**{**TINY, "intermediate_size": 24})).save_pretrained(other)
    LlamaConfig(**TINY).save_pretrained(other)
    assert refused(other) == (f"model.pretrained=true but {other}/model.safetensors holds "
                              f"model.layers.0.mlp.gate_proj.weight as [24, 16], where the model {other}/config.json "
                              f"describes has [32, 16] (and 2 more weights differ): give the config.json the weights "
                              f"were saved with, or drop model.pretrained to train from random init")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(other)  # one weight of another shape
    weights = load_file(other / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 16)}, other / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=re.escape(
            f"model.pretrained=true but {other}/model.safetensors holds model.layers.0.self_attn.q_proj.weight as "
            f"[8, 16], where the model {other}/config.json with model.config's overrides describes has [16, 16]: give "
            f"the config.json")):
        load_model_config(ModelConfig(name_or_path=str(other), pretrained=True, config={"attention_dropout": 0.1}))
    save_file({**weights, "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 16),
               "model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 16)}, other / "model.safetensors",
              metadata={"format": "pt"})
    assert refused(other).startswith(f"model.pretrained=true but {other}/model.safetensors holds "
                                     f"model.layers.0.self_attn.q_proj.weight as [8, 16], where the model "
                                     f"{other}/config.json describes has [16, 16] (and 1 more weights differ): ")


def test_weights_a_pretrained_checkpoint_lacks_are_refused_not_randomly_initialised(tmp_path):
    from safetensors.torch import load_file, save_file

    path = Path(_pretrained(tmp_path))
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=re.escape(
            f"model.pretrained=true but the weights in {path} have no lm_head.weight of the 12 the model "
            f"{path}/config.json describes has (from_pretrained would initialise them randomly): give the weights "
            f"saved with this config.json, or drop model.pretrained to train from random init")):
        load_model_config(ModelConfig(name_or_path=str(path), pretrained=True))
    save_file({k: v for k, v in weights.items() if k not in ("lm_head.weight", "model.norm.weight")},
              path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=re.escape("have no model.norm.weight and 1 more of the 12 the model")):
        load_model_config(ModelConfig(name_or_path=str(path), pretrained=True))


def test_checkpoints_from_pretrained_reads_as_they_are_pass(tmp_path):
    """Names as from_pretrained matches them: saved from the base model (no "model." prefix), a tied lm_head
    left out, tensors the model has no weight for (old checkpoints' rotary inv_freq, GPT-2's attn.bias), MoE
    experts saved one by one (converted on load), sharded pickled weights."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    def loads(path) -> bool:
        return load_model_config(ModelConfig(name_or_path=str(path), pretrained=True)) is not None

    tied = LlamaConfig(**TINY, tie_word_embeddings=True)
    LlamaForCausalLM(tied).model.save_pretrained(tmp_path / "base")  # LlamaModel: embed_tokens.weight, layers.0...
    tied.save_pretrained(tmp_path / "base")
    weights = load_file(tmp_path / "base" / "model.safetensors")
    assert "embed_tokens.weight" in weights and "lm_head.weight" not in weights
    weights["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, tmp_path / "base" / "model.safetensors", metadata={"format": "pt"})
    assert loads(tmp_path / "base")
    weights["lm_head.weight"] = weights.pop("embed_tokens.weight")  # a tied weight saved by its other name
    save_file(weights, tmp_path / "base" / "model.safetensors", metadata={"format": "pt"})
    assert loads(tmp_path / "base")

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=320, n_positions=64))
    gpt2.config.save_pretrained(tmp_path / "gpt2")  # the hub's gpt2 layout: no "transformer.", attn.bias buffers
    hub_layout = {k.removeprefix("transformer."): v.contiguous() for k, v in gpt2.transformer.state_dict().items()}
    save_file({**hub_layout, "h.0.attn.bias": torch.ones(1, 1, 64, 64)}, tmp_path / "gpt2" / "model.safetensors",
              metadata={"format": "pt"})
    assert loads(tmp_path / "gpt2")

    mixtral = AutoConfig.for_model("mixtral", **TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(mixtral).save_pretrained(tmp_path / "mixtral")
    assert loads(tmp_path / "mixtral")

    quantized = tmp_path / "quantized"  # packed weights of their own shapes: not compared
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}))
    weights = load_file(quantized / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(128, 1, dtype=torch.uint8)
    save_file(weights, quantized / "model.safetensors", metadata={"format": "pt"})
    assert loads(quantized)

    pickled = tmp_path / "pickled"  # the pickle format, sharded as transformers 4 wrote it (5 writes safetensors only)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.config.save_pretrained(pickled)
    weights = model.state_dict()
    shards = {"pytorch_model-00001-of-00002.bin": [k for k in weights if "layers" in k],
              "pytorch_model-00002-of-00002.bin": [k for k in weights if "layers" not in k]}
    for shard, names in shards.items():
        torch.save({k: weights[k] for k in names}, pickled / shard)
    (pickled / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, names in shards.items() for k in names}}))
    assert loads(pickled)


def test_pickled_weights_of_other_names_or_shapes_are_refused_on_the_driver(tmp_path):
    """A pytorch_model.bin was only looked for: one saved from a DDP-wrapped model ("module." names) trained from
    random init with a MISSING table in the workers' logs, exit 0; one of another vocabulary failed from_pretrained
    in every worker, retried checkpoint.max_failures times. Its names and shapes come from the pickle alone."""
    import torch

    def refused(path):
        with pytest.raises(ConfigError) as e:
            load_model_config(ModelConfig(name_or_path=str(path), pretrained=True))
        return str(e.value)

    model = LlamaForCausalLM(LlamaConfig(**TINY))
    path = tmp_path / "ddp"
    model.config.save_pretrained(path)
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, path / "pytorch_model.bin")
    assert refused(path) == (f"model.pretrained=true but the weights in {path} have no model.embed_tokens.weight and "
                             f"11 more of the 12 the model {path}/config.json describes has (from_pretrained would "
                             f"initialise them randomly): give the weights saved with this config.json, or drop "
                             f"model.pretrained to train from random init")
    torch.save(LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 256})).state_dict(), path / "pytorch_model.bin")
    assert refused(path) == (f"model.pretrained=true but {path}/pytorch_model.bin holds model.embed_tokens.weight as "
                             f"[256, 16], where the model {path}/config.json describes has [320, 16] (and 1 more "
                             f"weights differ): give the config.json the weights were saved with, or drop "
                             f"model.pretrained to train from random init")
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    assert load_model_config(ModelConfig(name_or_path=str(path), pretrained=True)).vocab_size == 320
    (path / "pytorch_model.bin").write_bytes(b"")  # a download cut short: from_pretrained's EOFError in every worker
    assert refused(path) == (f"model.pretrained=true but {path}/pytorch_model.bin is not a readable PyTorch state "
                             f"dict (EOFError; damaged, cut short or not a weight file): {_DROP.format(path)}")


def test_the_class_name_written_as_architectures_is_the_remote_codes_only_when_it_is_trusted():
    config = LlamaConfig(**TINY, auto_map={"AutoConfig": "org/repo--cfg.MyConfig",
                                           "AutoModelForCausalLM": "org/repo--modeling.MyForCausalLM"})
    assert causal_lm_class_name(config, trust_remote_code=True) == "MyForCausalLM"
    assert causal_lm_class_name(config) == causal_lm_class_name(LlamaConfig(**TINY), True) == "LlamaForCausalLM"
    assert causal_lm_class(config) is causal_lm_class(LlamaConfig(**TINY), True) is LlamaForCausalLM


def test_key_value_heads_that_do_not_divide_the_query_heads_are_refused_where_the_forward_would_fail(tmp_path):
    """4 query heads over 3 key/value heads: the config class takes it and the model builds, then every worker's
    first forward fails. Only attention that repeats each key/value head num_attention_heads //
    num_key_value_heads times (Llama's, and most families') is refused: JetMoE's runs with it."""
    import torch
    from transformers import AutoModelForCausalLM, JetMoeConfig, Phi3Config

    def forward(config):
        AutoModelForCausalLM.from_config(config)(torch.tensor([[1, 2, 3]]))

    with pytest.raises(ConfigError, match="^" + re.escape(
            "model.config.num_key_value_heads=3: num_attention_heads=4 is not a multiple of num_key_value_heads=3, "
            "and LlamaAttention shares each key/value head among num_attention_heads // num_key_value_heads = 1 "
            "query heads, 3 of 4 (every worker's first forward fails on the size mismatch); set "
            "model.config.num_key_value_heads to a divisor of num_attention_heads=4: 1, 2 or 4")):
        load_model_config(ModelConfig(config={"attention_dropout": 0.0, "num_key_value_heads": 3}))  # built-in
    uneven = LlamaConfig(**{**TINY, "hidden_size": 32, "num_attention_heads": 4}, num_key_value_heads=3)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(4\) must match the size of tensor b \(3\)"):
        forward(uneven)  # what each worker's first step raised
    uneven.save_pretrained(tmp_path / "json")
    with pytest.raises(ConfigError, match=re.escape(
            f"{tmp_path / 'json'}'s config.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3, "
            f"and LlamaAttention shares each") + ".*; set model.config.num_key_value_heads to a divisor of "
            "num_attention_heads=4: 1, 2 or 4$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "json")))
    LlamaConfig(**{**TINY, "hidden_size": 32, "num_attention_heads": 4}, num_key_value_heads=4).save_pretrained(
        tmp_path / "even")
    with pytest.raises(ConfigError, match=r"^model.config.num_attention_heads=2: num_attention_heads=2 is not a "
                                          r"multiple of num_key_value_heads=4, .* = 0 query heads, 0 of 2 .*; set "
                                          r"model.config.num_attention_heads to a multiple of num_key_value_heads=4$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "even"), config={"num_attention_heads": 2}))
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path / "even"), config={"num_key_value_heads": 2}))
    for heads, divisors in ((1, "1"), (2, "1 or 2")):
        with pytest.raises(ConfigError, match=f"; set model.config.num_key_value_heads to a divisor of "
                                              f"num_attention_heads={heads}: {divisors}$"):
            load_model_config(ModelConfig(config={"num_attention_heads": heads, "num_key_value_heads": 4}))
    (tmp_path / "json" / "model.safetensors").write_bytes(b"")  # refused before any weight is read
    with pytest.raises(ConfigError, match=re.escape(  # the weights were saved with some other count: not guessed
            "; correct num_key_value_heads in its config.json (a divisor of 4: 1, 2 or 4; the one the weights were "
            "saved with)") + "$"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "json"), pretrained=True))

    def phi3(kv):  # a fused qkv_proj (Phi-3): its key heads are the rows after the query heads', half of the rest
        return Phi3Config(**{**TINY, "hidden_size": 32, "num_attention_heads": 4}, num_key_value_heads=kv,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)

    with pytest.raises(RuntimeError, match=r"The size of tensor a \(4\) must match the size of tensor b \(3\)"):
        forward(phi3(3))
    phi3(4).save_pretrained(tmp_path / "phi3")
    with pytest.raises(ConfigError, match=r"^model.config.num_key_value_heads=3: .*, and Phi3Attention shares each "):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "phi3"), config={"num_key_value_heads": 3}))
    jetmoe = JetMoeConfig(**{**TINY, "hidden_size": 32, "num_attention_heads": 4}, num_key_value_heads=3)
    forward(jetmoe)  # runs: its query heads are num_key_value_heads x num_experts_per_tok
    jetmoe.save_pretrained(tmp_path / "jetmoe")
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path / "jetmoe"))).num_key_value_heads == 3


def test_falcons_fused_layout_refuses_key_value_heads_that_do_not_divide_the_query_heads(tmp_path):
    """Falcon's new_decoder_architecture views its fused query_key_value as (num_kv_heads, -1, head_dim): 4 query
    heads over 3 failed in every worker's reshape. Its older layouts take any count, and run."""
    import torch
    from transformers import AutoModelForCausalLM, FalconConfig

    def falcon(**kw):
        return FalconConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=300, **kw)

    with pytest.raises(RuntimeError, match=r"shape '\[1, 3, 3, -1, 16\]' is invalid"):  # what each worker raised
        model = AutoModelForCausalLM.from_config(falcon(new_decoder_architecture=True, num_kv_heads=3))
        model(torch.tensor([[1, 2, 3]]))
    falcon(new_decoder_architecture=True, num_kv_heads=2).save_pretrained(tmp_path / "falcon")
    with pytest.raises(ConfigError, match=re.escape(
            "model.config.num_kv_heads=3: num_attention_heads=4 is not a multiple of num_kv_heads=3, and Falcon's "
            "fused query_key_value (new_decoder_architecture=true) holds each key/value head with its "
            "num_attention_heads / num_kv_heads query heads (every worker's first forward fails in its reshape); set "
            "model.config.num_kv_heads to a divisor of num_attention_heads=4: 1, 2 or 4")):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "falcon"), config={"num_kv_heads": 3}))
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path / "falcon"))).num_kv_heads == 2
    old = falcon(new_decoder_architecture=False, multi_query=False, num_kv_heads=3)
    AutoModelForCausalLM.from_config(old)(torch.tensor([[1, 2, 3]]))  # runs: one key/value per query head
    old.save_pretrained(tmp_path / "old")
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path / "old"))).num_kv_heads == 3


@pytest.mark.parametrize("key, value, precision", [
    ("dtype", "bfloat16", "bf16"), ("torch_dtype", "torch.float16", "fp16"), ("dtype", "float32", "fp32"),
    ("torch_dtype", "int8", "bf16, fp16 or fp32"),
])
def test_a_dtype_given_as_a_config_field_points_to_training_precision(key, value, precision):
    """The DeepSpeed config holds the precision: model.config.dtype would be ignored under ZeRO-3, or build the
    model in it behind DeepSpeed's back below it. Refused, naming the training.precision that does what it asks."""
    with pytest.raises(ConfigError) as e:
        load_model_config(ModelConfig(config={key: value}))
    assert str(e.value) == (f"model.config.{key}={value!r} does not set the training precision, which the DeepSpeed "
                            f"config holds: remove it and set training.precision={precision} (or the DeepSpeed JSON's "
                            f"bf16/fp16 sections)")


def test_the_attention_backend_given_as_a_config_field_points_to_model_attn_implementation():
    """model.config.attn_implementation was "no such field" with no fix; model.config._attn_implementation was
    taken and never used (each worker's build is given model.attn_implementation, which replaces it)."""
    for key in ("attn_implementation", "_attn_implementation"):
        with pytest.raises(ConfigError, match=re.escape(
                f"model.config.{key}='eager' does not choose the attention backend, model.attn_implementation "
                f"does: remove it and set model.attn_implementation=eager")):
            load_model_config(ModelConfig(config={key: "eager"}))
    # a key with no close match lists the config's own fields, the fix
    with pytest.raises(ConfigError, match=r"^model.config.foo: LlamaConfig has no such field; its fields: "
                                          r"attention_bias, attention_dropout, bos_token_id, .*, vocab_size$"):
        load_model_config(ModelConfig(config={"foo": 1}))


def test_an_unreachable_hub_is_one_line_in_seconds_not_a_minute_of_retry_lines(tmp_path):
    """With no network a hub id's load printed huggingface_hub's retry lines ("'[Errno -2] Name or service not
    known' thrown while requesting HEAD ...", "Retrying in 1s [Retry 1/5].": 12 to 23 of them) over 25 to 52 s
    before raytrain's line. Here the hub is a closed local port (HF_ENDPOINT, read at import: a process of its own)
    and the hub cache an empty directory: each load is refused in one line at once, and nothing else is said."""
    code = textwrap.dedent("""
        from raytrain.config import ConfigError, DataConfig, ModelConfig
        from raytrain.data.sources import inspect_source
        from raytrain.model import load_model_config, load_tokenizer

        for load in (lambda: load_model_config(ModelConfig(name_or_path="raytrain-test/absent")),
                     lambda: load_tokenizer(ModelConfig(tokenizer="raytrain-test/absent")),
                     lambda: inspect_source(DataConfig(format="hf"), "raytrain-test/absent")):
            try:
                load()
            except ConfigError as e:
                print(e)
    """)
    offline = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in offline}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub"))
    # the timeout only bounds a hang; the message below is hub_unreachable's, said before any retried request
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    retries = [line for line in done.stderr.splitlines() if "Retrying in" in line or "thrown while" in line]
    assert not retries, done.stderr
    why = "http://127.0.0.1:9: [Errno 111] Connection refused"
    fix = ("check the network (or HF_ENDPOINT, HF_HUB_CACHE), or download it where there is one (hf download "
           "raytrain-test/absent")
    assert done.stdout.splitlines() == [
        f"{key}='raytrain-test/absent': cannot {what}: no local directory 'raytrain-test/absent', so it is a Hugging "
        f"Face hub id, but the hub cannot be reached ({why}) and the local hub cache ({tmp_path / 'hub'}) has no copy "
        f"of it: {fix}{download}" for key, what, download in (
            ("model.name_or_path", "load its config", " --local-dir DIR) and set model.name_or_path=DIR"),
            ("model.tokenizer", "load its tokenizer", " --local-dir DIR) and set model.tokenizer=DIR"),
            ("data.path", "open the hub dataset", " --repo-type dataset --local-dir DIR) and set data.path to its "
                                                  "data files in DIR"))], done.stderr


def test_a_hub_id_the_hub_cannot_be_reached_for_is_refused_in_one_line_before_any_load(tmp_path, monkeypatch):
    """hub_unreachable in this process: the hub a closed local port (huggingface_hub's endpoint constants), its
    cache an empty directory. Only a hub id with nothing of it in the cache is asked, and only when not offline;
    the refusal names the key, the endpoint's answer and the fix for a model, a tokenizer or a dataset."""
    import huggingface_hub.constants as hub

    from raytrain.model import hub_unreachable, unreachable_fix

    endpoint = "http://127.0.0.1:9"
    monkeypatch.setattr(hub, "HUGGINGFACE_CO_URL_TEMPLATE", hub.HUGGINGFACE_CO_URL_TEMPLATE.replace(hub.ENDPOINT,
                                                                                                    endpoint))
    monkeypatch.setattr(hub, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    why = f"{endpoint}: [Errno 111] Connection refused"
    assert hub_unreachable("raytrain-test/absent") == hub_unreachable("absent", repo_type="dataset") == why
    # a path is not a hub id (the load says there is no such directory); a repo in the cache may be read from it
    assert hub_unreachable("./raytrain-test/absent") is hub_unreachable("/raytrain-test/absent") is None
    (tmp_path / "hub" / "models--raytrain-test--cached").mkdir(parents=True)
    assert hub_unreachable("raytrain-test/cached") is None
    assert hub_unreachable("raytrain-test/cached", repo_type="dataset") == why  # a model's copy is not the dataset
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1: the cache alone is read, nothing asked
    assert hub_unreachable("raytrain-test/absent") is None
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    # a local directory named like a hub id is read from disk, the hub never asked
    byte_tokenizer().save_pretrained(tmp_path / "raytrain-test" / "local")
    monkeypatch.chdir(tmp_path)
    assert load_tokenizer(ModelConfig(tokenizer="raytrain-test/local")).eos_token_id == 256

    def line(key, spec, what):
        return f"{key}={spec!r}: cannot {what}: {unreachable_fix(spec, why, key)}"

    with pytest.raises(ConfigError) as e:
        load_model_config(ModelConfig(name_or_path="raytrain-test/absent"))
    assert str(e.value) == line("model.name_or_path", "raytrain-test/absent", "load its config")
    for cfg, key in ((ModelConfig(tokenizer="raytrain-test/absent"), "model.tokenizer"),
                     (ModelConfig(name_or_path="raytrain-test/absent"), "model.name_or_path")):
        with pytest.raises(ConfigError) as e:
            load_tokenizer(cfg)
        assert str(e.value) == line(key, "raytrain-test/absent", "load its tokenizer")
    fix = (f"no local directory 'org/x', so it is a Hugging Face hub id, but the hub cannot be reached ({why}) and the "
           f"local hub cache ({tmp_path / 'hub'}) has no copy of it: check the network (or HF_ENDPOINT, HF_HUB_CACHE), "
           f"or download it where there is one (hf download org/x")
    assert unreachable_fix("org/x", why, "model.name_or_path") == (
        f"{fix} --local-dir DIR) and set model.name_or_path=DIR")
    assert unreachable_fix("org/x", why, "data.path", "dataset") == (
        f"{fix} --repo-type dataset --local-dir DIR) and set data.path to its data files in DIR")


def test_the_hub_hold_is_only_huggingface_hubs_retry_lines_and_only_inside_the_block():
    import logging

    from raytrain.model import hub_retries_held

    logger = logging.getLogger("huggingface_hub.utils._http")
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    keep = Keep()
    logger.addHandler(keep)
    try:
        with hub_retries_held():
            logger.warning("'[Errno 111] Connection refused' thrown while requesting HEAD http://127.0.0.1:9/x")
            logger.warning("Retrying in 1s [Retry 1/5].")
            logger.warning("another warning")
        logger.warning("Retrying in 2s [Retry 2/5].")
    finally:
        logger.removeHandler(keep)
    assert said == ["another warning", "Retrying in 2s [Retry 2/5]."]
