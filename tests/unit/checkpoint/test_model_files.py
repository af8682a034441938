"""The run's own copy of the model's files (raytrain.checkpoint.model_files) and the export's checks
that use it; a real export after the originals are deleted is in tests/integration/test_user_path.py."""

import json
import os

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaConfig

from raytrain.checkpoint.export import check_out_dir
from raytrain.checkpoint.model_files import local_model_files, write_model_files
from raytrain.config import ConfigError, ModelConfig, RunConfig
from raytrain.model import byte_tokenizer, load_model_config
from raytrain.planning.resolve import resolve_run, shape_from_config
from tests.helpers import code_model


TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=320)


def facts(model: ModelConfig):
    cfg = RunConfig(model=model)
    return resolve_run(cfg, shape_from_config(cfg)).model


def test_the_run_keeps_the_resolved_config_the_tokenizer_and_the_generation_config(tmp_path):
    source = tmp_path / "model"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=320).save_pretrained(source)
    GenerationConfig(max_new_tokens=7, eos_token_id=2, bos_token_id=1).save_pretrained(source)
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    model = ModelConfig(name_or_path=str(source), tokenizer=str(tmp_path / "tok"), config={"num_hidden_layers": 2})
    run = tmp_path / "runs" / "r"
    write_model_files(str(run), model, facts(model))
    with local_model_files(str(run)) as copy:
        assert copy == str(run / "model")
        assert AutoConfig.from_pretrained(copy).num_hidden_layers == 2  # overrides applied, as trained
        assert GenerationConfig.from_pretrained(copy).max_new_tokens == 7
        # random init learns the byte tokenizer's EOS (256), not LlamaConfig's default 2 that both files had:
        # generate() reads the generation config
        assert AutoConfig.from_pretrained(copy).eos_token_id == 256
        assert GenerationConfig.from_pretrained(copy).eos_token_id == 256
        assert AutoTokenizer.from_pretrained(copy)("ab")["input_ids"] == byte_tokenizer()("ab")["input_ids"]
    with local_model_files(str(tmp_path / "runs" / "older")) as copy:
        assert copy is None  # a run from before: the export falls back to the original tokenizer


def test_the_runs_generation_config_keeps_a_pad_token_id_of_minus_one_and_takes_the_runs_token_ids(tmp_path):
    """A hub Llama's pair of files (config.json and the generation_config.json save_pretrained derived from it, both
    with pad_token_id=-1), trained from random init: the run's copy takes the tokenizer's EOS, which transformers'
    GenerationConfig.save_pretrained refused ("Fix these issues to save the configuration": a traceback before any
    worker started). The model's pad_token_id stays as written; model.config's token ids go in (generate() reads
    this file, not config.json)."""

    from transformers import LlamaForCausalLM

    source = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=257, pad_token_id=-1)).save_pretrained(source)
    (source / "model.safetensors").unlink()  # a config to train from random init, as a hub id's would be
    byte_tokenizer().save_pretrained(source)
    for name, config in (("r", {}), ("fixed", {"pad_token_id": None})):
        model = ModelConfig(name_or_path=str(source), config=config)
        write_model_files(str(tmp_path / name), model, facts(model))
    kept = json.loads((tmp_path / "r" / "model" / "generation_config.json").read_text())
    assert kept["pad_token_id"] == -1 and kept["eos_token_id"] == 256 and "bos_token_id" not in kept
    assert {k: v for k, v in kept.items() if k not in ("eos_token_id", "bos_token_id")} == {
        k: v for k, v in json.loads((source / "generation_config.json").read_text()).items()
        if k not in ("eos_token_id", "bos_token_id")}  # every other value as the model's file has it
    assert GenerationConfig.from_pretrained(tmp_path / "fixed" / "model").pad_token_id is None


def test_a_pretrained_models_generation_config_keeps_its_own_token_ids_and_values(tmp_path):
    """Trained from its weights, the model keeps the EOS ids it stops at (a list, as Llama 3's) and any value
    model.config changes that is not a token id (use_cache is the model's, not generate()'s)."""
    from transformers import LlamaForCausalLM

    source = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(**TINY, eos_token_id=2, bos_token_id=1)).save_pretrained(source)
    GenerationConfig(eos_token_id=[2, 7], bos_token_id=1).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    model = ModelConfig(name_or_path=str(source), pretrained=True, config={"use_cache": False})
    write_model_files(str(tmp_path / "r"), model, facts(model))
    kept = json.loads((tmp_path / "r" / "model" / "generation_config.json").read_text())
    assert kept == json.loads((source / "generation_config.json").read_text())
    assert kept["eos_token_id"] == [2, 7] and "use_cache" not in kept


def test_a_model_with_its_own_code_keeps_that_code_in_the_runs_copy_only_when_trusted(tmp_path):
    source = code_model(tmp_path / "mine", TINY, tokenizer_classes=True)
    model = ModelConfig(name_or_path=source, trust_remote_code=True)
    write_model_files(str(tmp_path / "r"), model, facts(model))
    with local_model_files(str(tmp_path / "r")) as copy:
        assert {"cfg.py", "mdl.py"} <= set(os.listdir(copy))  # the export imports the model's class from here
        assert type(AutoConfig.from_pretrained(copy, trust_remote_code=True)).__name__ == "MyConfig"
    # a model transformers has a class of its own for, code not trusted: its code is neither run nor kept
    source = code_model(tmp_path / "llama", TINY, model_type="llama", tokenizer_classes=True)
    model = ModelConfig(name_or_path=source)
    write_model_files(str(tmp_path / "r2"), model, facts(model))
    assert not [f for f in os.listdir(tmp_path / "r2" / "model") if f.endswith(".py")]


def test_the_built_in_model_has_no_generation_config_to_keep(tmp_path):
    write_model_files(str(tmp_path / "r"), ModelConfig(), facts(ModelConfig()))
    files = os.listdir(tmp_path / "r" / "model")
    assert {"config.json", "tokenizer.json"} <= set(files) and "generation_config.json" not in files
    assert load_model_config(ModelConfig()).hidden_size == AutoConfig.from_pretrained(tmp_path / "r" / "model").hidden_size


def test_an_out_dir_that_is_not_empty_or_is_a_file_is_refused(tmp_path):
    check_out_dir(str(tmp_path / "new"))
    (tmp_path / "empty").mkdir()
    check_out_dir(str(tmp_path / "empty"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="checkpoint.export_dir .*full exists and is not empty"):
        check_out_dir(str(tmp_path / "full"), "checkpoint.export_dir")
    with pytest.raises(ConfigError, match="is a file"):
        check_out_dir(str(tmp_path / "full" / "x"))


def test_an_out_dir_uri_is_checked_on_its_own_filesystem(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    check_out_dir(f"file://{tmp_path}/new")
    with pytest.raises(ConfigError, match=r"OUT_DIR file://.*full exists and is not empty"):
        check_out_dir(f"file://{tmp_path}/full")
    with pytest.raises(ConfigError, match=r"checkpoint.export_dir nofs://b/out: cannot read it \(.*\): check the path"):
        check_out_dir("nofs://b/out", "checkpoint.export_dir")


def test_a_cloud_out_dir_gets_every_file_of_the_local_export(tmp_path):
    import pyarrow.fs

    from raytrain.checkpoint.export import upload

    (tmp_path / "out").mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "w"), ("tokenizer.json", "t")):
        (tmp_path / "out" / name).write_text(text)
    fs, path = pyarrow.fs.FileSystem.from_uri("mock:///bucket/models/m1")  # Arrow's in-memory filesystem
    upload(str(tmp_path / "out"), fs, path)
    files = {i.base_name: i.size for i in fs.get_file_info(pyarrow.fs.FileSelector(path))}
    assert files == {"config.json": 2, "model.safetensors": 1, "tokenizer.json": 1}


def test_an_upload_cut_short_leaves_no_config_json_for_from_pretrained_to_start_from(tmp_path):
    import pyarrow.fs

    from raytrain.checkpoint.export import upload

    (tmp_path / "out").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "out" / name).write_text("{}")
    (tmp_path / "bucket" / "m1" / "model.safetensors").mkdir(parents=True)  # the weights' upload fails
    with pytest.raises(OSError):
        upload(str(tmp_path / "out"), pyarrow.fs.LocalFileSystem(), str(tmp_path / "bucket" / "m1"))
    assert "config.json" not in os.listdir(tmp_path / "bucket" / "m1")  # an object store has no rename


def test_the_files_an_earlier_session_wrote_are_left_as_they_are(tmp_path):
    run = tmp_path / "r"
    assert write_model_files(str(run), ModelConfig(), facts(ModelConfig())) is None
    before = {f: (run / "model" / f).stat().st_mtime_ns for f in os.listdir(run / "model")}
    # the run continued: the same files again (their bytes do not depend on when they are written)
    assert write_model_files(str(run), ModelConfig(), facts(ModelConfig())) is None
    assert {f: (run / "model" / f).stat().st_mtime_ns for f in os.listdir(run / "model")} == before
    assert not [p for p in os.listdir(run) if p.startswith("model.replaced-")]


def test_other_files_in_the_runs_model_directory_are_set_aside_whole_and_said(tmp_path):
    run = tmp_path / "r"
    (run / "model" / "sub").mkdir(parents=True)  # the user's own directory before it became a run
    (run / "model" / "config.json").write_text('{"mine": 1}')
    (run / "model" / "sub" / "weights.bin").write_bytes(b"w" * 100)
    note = write_model_files(str(run), ModelConfig(), facts(ModelConfig()))
    [aside] = [p for p in os.listdir(run) if p.startswith("model.replaced-")]
    assert note == (f"{run}/model held files other than this run's model files (config.json, sub/weights.bin, "
                    f"tokenizer.json and 1 more): moved to {run}/{aside}; the run writes its own there (the export "
                    f"reads them)")
    assert (run / aside / "config.json").read_text() == '{"mine": 1}'  # nothing lost
    assert (run / aside / "sub" / "weights.bin").read_bytes() == b"w" * 100
    assert AutoConfig.from_pretrained(run / "model").hidden_size == load_model_config(ModelConfig()).hidden_size
    # one file edited between sessions (a tokenizer changed by hand) is enough, and is named
    (run / "model" / "tokenizer_config.json").write_text("{}")
    import time

    time.sleep(1.1)  # a second set-aside gets a name of its own (the suffix is to the second)
    note = write_model_files(str(run), ModelConfig(), facts(ModelConfig()))
    assert "(tokenizer_config.json): moved to" in note
    assert len([p for p in os.listdir(run) if p.startswith("model.replaced-")]) == 2


def test_up_to_three_differing_files_are_all_named(tmp_path):
    (tmp_path / "r" / "model").mkdir(parents=True)
    (tmp_path / "r" / "model" / "config.json").write_text('{"mine": 1}')
    note = write_model_files(str(tmp_path / "r"), ModelConfig(), facts(ModelConfig()))
    assert f"{tmp_path}/r/model held files other than this run's model files (config.json, tokenizer.json, " \
           f"tokenizer_config.json): moved to" in note


def test_a_file_named_model_in_the_run_is_set_aside_too(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "model").write_text("notes")
    note = write_model_files(str(tmp_path / "r"), ModelConfig(), facts(ModelConfig()))
    [aside] = [p for p in os.listdir(tmp_path / "r") if p.startswith("model.replaced-")]
    assert "(model): moved to" in note and (tmp_path / "r" / aside).read_text() == "notes"
    assert (tmp_path / "r" / "model" / "config.json").is_file()
