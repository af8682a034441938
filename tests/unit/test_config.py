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
    with pytest.raises(ConfigError, match=r"training.max_steps must be an integer >= 1, got str 'ten'"):
        load_config(None, ["training.max_steps=ten"])
    with pytest.raises(ConfigError, match=r"scaling.use_gpu must be true or false"):
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


def test_yaml_12_floats_in_files_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  learning_rate: 5E-4\n  adam_epsilon: 1e-8\n  max_steps: 20\n")
    cfg = load_config(str(path), ["training.weight_decay=1e-2"])
    assert (cfg.training.learning_rate, cfg.training.adam_epsilon, cfg.training.weight_decay) == (5e-4, 1e-8, 0.01)
    assert cfg.training.max_steps == 20 and isinstance(cfg.training.max_steps, int)  # integers stay integers
    assert load_config(None, ["training.learning_rate=1e-3"]).training.learning_rate == 1e-3
    assert load_config(None, ["checkpoint.name=1e3run"]).checkpoint.name == "1e3run"  # not a number: a string
    import yaml

    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}  # PyYAML's own loader is left as it was


def test_yaml_duplicate_keys_at_any_depth_name_the_file_line_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  max_steps: 5\nscaling:\n  num_workers: 2\n  num_workers: 4\n")
    with pytest.raises(ConfigError, match=r"run.yaml line 5: key scaling.num_workers is given twice \(first at line 4\)"):
        load_config(str(path))
    path.write_text("deepspeed:\n  zero_optimization: {stage: 3}\n  zero_optimization: {stage: 2}\n")
    with pytest.raises(ConfigError, match=r"line 3: key deepspeed.zero_optimization is given twice"):
        load_config(str(path))


def test_unreadable_config_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .* is a directory"):
        load_config(str(tmp_path))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"# r\xe9sum\xe9\ntraining: {}\n")
    with pytest.raises(ConfigError, match=r"latin.yaml is not UTF-8 text \(byte 0xe9 at line 1\): save it as UTF-8"):
        load_config(str(latin))
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbftraining:\n  max_steps: 3\n")  # editors' UTF-8 byte order mark is fine
    assert load_config(str(bom)).training.max_steps == 3


def test_every_section_refuses_bad_values_when_built_directly():
    from raytrain.config import CheckpointConfig, ClusterConfig, TrainingConfig

    with pytest.raises(ConfigError, match=r"^training.warmup_steps must be an integer >= 0, got -1$"):
        TrainingConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match=r"checkpoint.max_failures must be an integer >= 0, got -1"):
        CheckpointConfig(max_failures=-1)
    with pytest.raises(ConfigError, match=r"unknown key cluster.adress; did you mean cluster.address\?"):
        ClusterConfig(adress="x:1")
    assert ClusterConfig(address="10.0.0.1:6379").address == "10.0.0.1:6379"
    assert ClusterConfig(address="ray://head:10001").address == "ray://head:10001"
    assert ClusterConfig(address="[::1]:6379").address == "[::1]:6379"


def test_workers_rebuild_the_config_from_plain_data():
    cfg = load_config(None, ["training.max_steps=7", "network.env.NCCL_DEBUG=INFO", "data.path=[a, b]"])
    data = json.loads(json.dumps(cfg.to_dict()))  # as Ray ships it
    again = RunConfig.from_dict(data)
    assert again == cfg and again.data.path == ["a", "b"] and again.network.env == {"NCCL_DEBUG": "INFO"}
    with pytest.raises(ConfigError, match="training.max_steps must be an integer >= 1, got str '7'"):
        RunConfig.from_dict({**data, "training": {**data["training"], "max_steps": "7"}})
