"""Config loading: precedence, typing, and one-line errors for every kind of mistake."""

import json

import pytest

from raytrain.config import ConfigError, RunConfig, load_config


def test_defaults_build_a_complete_tree():
    cfg = load_config()
    assert cfg.data.seq_len == 128
    assert cfg.deepspeed["zero_optimization"]["stage"] == 3
    assert RunConfig.from_dict(cfg.to_dict()) == cfg  # what workers rebuild is what the driver had


def test_command_line_beats_file_beats_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  max_steps: 7\n  learning_rate: 0.01\nscaling:\n  num_workers: 4\n")
    cfg = load_config(str(path), ["training.max_steps=20", "scaling.use_gpu=true"])
    assert cfg.training.max_steps == 20  # command line
    assert cfg.training.learning_rate == 0.01  # file
    assert cfg.scaling.num_workers == 4 and cfg.scaling.use_gpu is True
    assert cfg.training.warmup_steps == 10  # default


def test_unknown_key_lists_valid_keys_and_suggests_closest():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["training.max_step=3"])
    msg = str(e.value)
    assert "training.max_step" in msg and "did you mean training.max_steps" in msg and "warmup_steps" in msg
    assert "\n" not in msg


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown key trainin; did you mean training"):
        load_config(None, ["trainin.max_steps=3"])


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"training.max_steps must be an integer, got str 'ten'"):
        load_config(None, ["training.max_steps=ten"])
    with pytest.raises(ConfigError, match=r"scaling.use_gpu must be true/false"):
        load_config(None, ["scaling.use_gpu=3"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML .* line"):
        load_config(str(bad))
    bad_json = tmp_path / "ds.json"
    bad_json.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match=r"deepspeed: .*ds.json is not valid JSON .* line 1"):
        load_config(None, [f"deepspeed={bad_json}", "deepspeed.gradient_clipping=1.0"])


def test_deepspeed_override_applies_inside_a_json_file(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 512, "zero_optimization": {"stage": 3}}))
    cfg = load_config(None, [f"deepspeed={ds}", "deepspeed.zero_optimization.overlap_comm=false"])
    assert cfg.deepspeed == {"train_batch_size": 512, "zero_optimization": {"stage": 3, "overlap_comm": False}}
    assert json.loads(ds.read_text()) == {"train_batch_size": 512, "zero_optimization": {"stage": 3}}  # file untouched


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        load_config(None, ["training.max_steps"])


def test_deepspeed_key_override_edits_the_default_config():
    cfg = load_config(None, ["deepspeed.zero_optimization.overlap_comm=false"])
    assert cfg.deepspeed["zero_optimization"]["stage"] == 3  # the rest of the default stays
    assert cfg.deepspeed["zero_optimization"]["overlap_comm"] is False
    assert load_config().deepspeed["zero_optimization"]["overlap_comm"] is True  # default not mutated
