"""Config loading: precedence, typing, and one-line errors for every kind of mistake."""

import dataclasses
import functools
import json
import pathlib
import re

from typing import Annotated, Literal

import pytest
from pydantic import Field

from raytrain.config import ConfigError, RunConfig, check_config, load_config, read_json_file
from raytrain.config_fields import Float, Int, describe

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_build_a_complete_tree():
    cfg = load_config()
    assert cfg.data.seq_len == 128
    assert cfg.deepspeed["zero_optimization"]["stage"] == 3
    assert RunConfig.from_dict(cfg.to_dict()) == cfg  # what workers rebuild is what the driver had


def test_the_defaults_are_the_documented_ones():
    """What a run gets from no config at all, against where each default is stated."""
    cfg = load_config()
    expected = {
        # configs/default-cpu.yaml: "The embedded default, written out" (test_configs.py ties the two together)
        "model.gradient_checkpointing": False, "data.tokenize_batch_size": 256, "data.num_builtin_documents": 4000,
        "training.max_steps": 80, "training.min_lr_ratio": 0.1, "training.weight_decay": 0.1,
        "training.gradient_clipping": 1.0, "training.seed": 1234, "training.log_every_n_steps": 5,
        "scaling.cpus_per_worker": 1.0, "checkpoint.every_n_steps": 0, "checkpoint.num_to_keep": 2,
        "checkpoint.max_failures": 3,
        # README: "data.progress_every_s seconds (default 30; 0: off)", "tracking.tensorboard (default true)";
        # docs/benchmarks.md: "data.prefetch_batches (default 4)", model.compile "is off by default"
        "data.progress_every_s": 30.0, "tracking.tensorboard": True, "data.prefetch_batches": 4, "model.compile": False,
        # the two values README's elastic example writes out
        "scaling.replacement_timeout_s": 120.0, "scaling.resize_interval_s": 300.0,
        # opt-ins that README and the docstrings turn on with =true: loading weights, running the hub's code
        # (only for repos you trust), FP8 (rounds more than bf16), a hash per row, a second local copy, a
        # preflight before training; NCCL's environment is derived per node unless turned off
        "model.pretrained": False, "model.trust_remote_code": False, "model.fp8": False, "data.sample_log": False,
        "checkpoint.upload_async": False, "network.preflight": False, "network.auto_configure": True,
        # "0: no shuffle" and "0: only after the last one" in their docstrings
        "data.shuffle_buffer_size": 0, "data.eval_every_n_steps": 0,
        # the docstring: "Dense bf16 peak of one GPU, for MFU (989 for H100/H200 SXM)"; the betas are the Llama
        # pretraining recipe's, eps torch's AdamW default; eval_max_batches is stated nowhere else (pinned: a
        # change is a decision)
        "training.peak_tflops_per_gpu": 989.0, "training.adam_betas": [0.9, 0.95], "training.adam_epsilon": 1e-8,
        "data.eval_max_batches": 8}
    assert {key: functools.reduce(getattr, key.split("."), cfg) for key in expected} == expected
    # default-cpu.yaml's deepspeed section: contiguous gradient buckets, no DeepSpeed timers (they add syncs),
    # DeepSpeed's own progress print every 10^9 steps, never ("raytrain prints its own progress line")
    assert cfg.deepspeed["zero_optimization"]["contiguous_gradients"] is True
    assert (cfg.deepspeed["wall_clock_breakdown"], cfg.deepspeed["steps_per_print"]) == (False, 1_000_000_000)


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


def test_a_missing_relative_path_names_the_directory_it_was_looked_for_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config("nope.yaml")
    assert str(e.value) == (f"config file nope.yaml does not exist (relative to the current directory {tmp_path}): "
                            f"check the path")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "nope.yaml"))
    assert str(e.value) == f"config file {tmp_path / 'nope.yaml'} does not exist: check the path"


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
    cfg = load_config(None, ["deepspeed.gradient_clipping=0.5"])  # a top-level key: the same
    assert cfg.deepspeed == {**load_config().deepspeed, "gradient_clipping": 0.5}
    cfg = load_config(None, ['deepspeed.zero_optimization={"stage": 2}'])  # a section of it given whole
    assert cfg.deepspeed["zero_optimization"] == {"stage": 2} and cfg.deepspeed["train_batch_size"] == "auto"


def test_a_network_env_name_outside_nccls_families_gets_a_suggestion_only_where_one_is_close():
    for name, suggestion in [("FOO", ""), ("NCLL_DEBUG", "; did you mean NCCL_DEBUG?")]:  # a typo of NCCL's name
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"network.env.{name}=1"])
        assert str(e.value) == (f"network.env.{name}: only NCCL_*, GLOO_*, FI_* variables belong here; set others "
                                f"through Ray's runtime_env{suggestion}")
    with pytest.raises(ConfigError, match=r"^network.env.NCCL_IB_HCAA: NCCL reads no such variable \(it would be "
                                          r"ignored\); did you mean NCCL_IB_HCA\? \(raytrain knows NCCL's variables"):
        load_config(None, ["network.env.NCCL_IB_HCAA=mlx5_0"])
    # an NCCL_ name close to none that NCCL reads is let through: a newer NCCL's (the workers' lines note it)
    assert load_config(None, ["network.env.NCCL_SOMETHING_NEW=1"]).network.env == {"NCCL_SOMETHING_NEW": "1"}


def test_an_override_inside_a_value_is_refused():
    with pytest.raises(ConfigError, match=r"^override training.max_steps.x: training.max_steps is a value, not a "
                                          r"section$"):
        load_config(None, ["training.max_steps=5", "training.max_steps.x=1"])


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


def test_yaml_11_integers_are_not_rewritten_into_other_numbers(tmp_path):
    # YAML 1.1 (PyYAML's default) read 022 as octal 18 and 1:1 as base-60 61: NCCL got "18" and "61", and
    # checkpoint.name=0755 was refused as "got 493", none of which the user wrote
    env = ["network.env.NCCL_IB_TIMEOUT=022", "network.env.NCCL_IB_SL=1:1", "network.env.NCCL_BUFFSIZE=0x400000",
           "network.env.NCCL_IB_RETRY_CNT=7", "network.env.NCCL_NET_GDR_LEVEL=1e-3"]
    assert load_config(None, env).network.env == {"NCCL_IB_TIMEOUT": "022", "NCCL_IB_SL": "1:1",
                                                  "NCCL_BUFFSIZE": "0x400000", "NCCL_IB_RETRY_CNT": "7",
                                                  "NCCL_NET_GDR_LEVEL": "1e-3"}  # as typed: env vars are strings
    path = tmp_path / "run.yaml"
    path.write_text("network:\n  env: {NCCL_IB_TIMEOUT: 022, NCCL_IB_SL: 1:1}\ncheckpoint:\n  name: 0755\n"
                    "training:\n  max_steps: 0x10\n  seed: 0o17\n")
    cfg = load_config(str(path))
    assert cfg.network.env == {"NCCL_IB_TIMEOUT": "022", "NCCL_IB_SL": "1:1"} and cfg.checkpoint.name == "0755"
    assert (cfg.training.max_steps, cfg.training.seed) == (16, 15)  # YAML 1.2's hex and octal
    assert load_config(None, ["network={env: {NCCL_IB_TIMEOUT: 022}}"]).network.env == {"NCCL_IB_TIMEOUT": "022"}
    assert load_config(None, ["checkpoint.name=1_0"]).checkpoint.name == "1_0"
    for value, was in (("022", "18"), ("1_000", "1000"), ("1:1", "61")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"training.max_steps={value}"])
        octal = "; octal is written 0o22" if value == "022" else ""
        assert str(e.value) == (f"training.max_steps must be an integer >= 1, got str '{value}': not a number in "
                                f"YAML 1.2, which raytrain reads (YAML 1.1 made it {was}): write it without the "
                                f"leading 0, '_' or ':'{octal}")
    assert load_config(None, ["scaling.use_gpu=yes"]).scaling.use_gpu is True  # YAML 1.1's booleans stay


def test_a_quoted_number_is_named_as_one_not_as_yaml_11s_reading():
    # README: `training.max_steps="10"` is an error. It was explained as YAML 1.1's reading ("not a number in
    # YAML 1.2 ... YAML 1.1 made it 10: write it without the leading 0"), which is true of neither.
    for key, value, kind in (("training.max_steps", "10", "an integer >= 1"), ("training.learning_rate", "1e-3",
                                                                               "a number > 0")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f'{key}="{value}"'])
        assert str(e.value) == (f"{key} must be {kind}, got str '{value}': a number in quotes is a string: write "
                                f"{value} without the quotes")


def test_yaml_duplicate_keys_at_any_depth_name_the_file_line_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  max_steps: 5\nscaling:\n  num_workers: 2\n  num_workers: 4\n")
    with pytest.raises(ConfigError, match=r"run.yaml line 5: key scaling.num_workers is given twice \(first at line 4\)"):
        load_config(str(path))
    path.write_text("deepspeed:\n  zero_optimization: {stage: 3}\n  zero_optimization: {stage: 2}\n")
    with pytest.raises(ConfigError, match=r"line 3: key deepspeed.zero_optimization is given twice"):
        load_config(str(path))


def test_duplicate_keys_inside_lists_are_named_and_merge_keys_are_not_duplicates():
    from raytrain.config_files import parse_yaml

    with pytest.raises(ConfigError, match=r"^config file f line 2: key a\[0\].b is given twice \(first at line 2\)"):
        parse_yaml("a:\n  - {b: 1, b: 2}\n", "config file f")
    merged = parse_yaml("a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  <<: *b\n  x: 3\n", "config file f")
    assert merged["c"] == {"x": 3, "y": 2}  # YAML's merge key "<<", twice, and a merged key set again: no error
    with pytest.raises(ConfigError, match=r"^config file f is not valid YAML \(found unhashable key at line 1"):
        parse_yaml("? [a, b]\n: 1\n", "config file f")  # a list as a key: YAML's error, not a crash
    with pytest.raises(ConfigError) as e:  # the reader's error has no line mark: its message alone
        parse_yaml("a: \x07\n", "config file f")
    assert str(e.value) == ("config file f is not valid YAML (unacceptable character #x0007: special characters are "
                            "not allowed): fix the syntax there")


def test_a_library_errors_first_line_or_its_class_is_what_a_one_line_error_quotes():
    from raytrain.config_files import first_line

    assert (first_line(ValueError(" bad header\n  at byte 9")), first_line(EOFError())) == ("bad header", "EOFError")


def test_overrides_keep_network_env_values_and_what_is_not_yaml_as_typed():
    from raytrain.config_files import parse_override, parse_yaml, yaml_11_number

    assert parse_override("network={env: {A: 0x10, B: 1e-3}}") == ("network", {"env": {"A": "0x10", "B": "1e-3"}})
    assert parse_yaml("network:\n  env:\n    A: 0x10\n", "f") == {"network": {"env": {"A": "0x10"}}}
    assert parse_override("network.env.A=true") == ("network.env.A", True)  # a boolean: the field refuses it
    assert parse_override("model.config.hidden_size=64") == ("model.config.hidden_size", 64)  # 3 parts, not env
    assert parse_override("checkpoint.name=") == ("checkpoint.name", "")
    assert parse_override("network=5") == ("network", 5)  # the field refuses it, naming the section
    assert parse_override("checkpoint.name=a: b: c") == ("checkpoint.name", "a: b: c")  # not YAML: as written
    assert parse_override('tracking.tags=[a, "b #2"]') == ("tracking.tags", ["a", "b #2"])  # '#' quoted: no comment
    assert (yaml_11_number("022"), yaml_11_number("2024-06-01")) == (18, None)  # a date is no number


def test_a_run_config_of_only_a_checkpoint_section_is_a_run_config(tmp_path):
    # "checkpoint" is also a DeepSpeed key: a run config that set only its storage was refused as a DeepSpeed config
    (tmp_path / "run.yaml").write_text("checkpoint:\n  storage_path: /scratch/runs\n  name: run1\n")
    assert load_config(str(tmp_path / "run.yaml")).checkpoint.name == "run1"
    (tmp_path / "ds.json").write_text('{"checkpoint": {"tag_validation": "Warn", "load_universal": false}}')
    with pytest.raises(ConfigError, match=r"is a DeepSpeed config \(checkpoint\), not a run config: pass it as"):
        load_config(str(tmp_path / "ds.json"))  # DeepSpeed's own checkpoint keys: still DeepSpeed's


def test_a_deepspeed_json_and_a_run_config_given_in_each_others_place_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped pair: configs/seed-8gpu.yaml names configs/seed-ds.json
    # JSON is YAML: the DeepSpeed file was read as a run config whose first key was unknown
    with pytest.raises(ConfigError) as e:
        load_config("configs/seed-ds.json")
    assert str(e.value) == ("config file configs/seed-ds.json is a DeepSpeed config (train_batch_size, "
                            "gradient_accumulation_steps, zero_optimization), not a run config: pass it as "
                            "deepspeed=configs/seed-ds.json (and a run config, if any, with --config)")
    with pytest.raises(ConfigError) as e:  # was: "is not valid JSON (Expecting value at line 1, column 1): fix it there"
        read_json_file("configs/seed-8gpu.yaml", "deepspeed")  # what the run reads deepspeed=FILE with
    assert str(e.value) == ("deepspeed: configs/seed-8gpu.yaml is a run config (sections checkpoint, data, deepspeed, "
                            "model, scaling, training), not DeepSpeed's JSON: pass it with --config "
                            "configs/seed-8gpu.yaml")
    ds_yaml = tmp_path / "ds.yaml"  # DeepSpeed's settings, in YAML: not a run config, and not JSON either
    ds_yaml.write_text("zero_optimization:\n  stage: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"deepspeed={ds_yaml}", "deepspeed.zero_optimization.stage=2"])  # reads the file
    assert str(e.value) == (f"deepspeed: {ds_yaml} is YAML, and deepspeed= takes DeepSpeed's JSON config: write it as "
                            f"JSON, or put its settings under deepspeed: in a run config (--config)")
    ds_yaml.write_text("checkpoint:\n  tag_validation: Warn\n")  # DeepSpeed's own key only: YAML, not a run config
    with pytest.raises(ConfigError, match=r"^deepspeed: .*ds.yaml is YAML, and deepspeed= takes"):
        read_json_file(str(ds_yaml), "deepspeed")
    cut = tmp_path / "cut.json"  # neither JSON nor YAML: the JSON error
    cut.write_text('{"a": 1')
    with pytest.raises(ConfigError) as e:
        read_json_file(str(cut), "deepspeed")
    assert str(e.value) == (f"deepspeed: {cut} is not valid JSON (Expecting ',' delimiter at line 1, column 8): "
                            f"fix it there")
    run = tmp_path / "run.yaml"  # a run config with a deepspeed section (and DeepSpeed's own checkpoint key) is one
    run.write_text("checkpoint: {name: r}\ndeepspeed: {train_batch_size: 8}\n")
    assert load_config(str(run)).deepspeed == {"train_batch_size": 8}


def test_the_loaders_list_of_sections_is_the_run_configs():
    from raytrain.config_files import RUN_CONFIG_SECTIONS

    assert RUN_CONFIG_SECTIONS == {f.name for f in dataclasses.fields(RunConfig)}


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
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set yet\n")  # no document at all: the defaults, not "got NoneType"
    assert load_config(str(empty)) == load_config()
    empty.write_text("training max_steps 5\n")  # one string, not sections
    with pytest.raises(ConfigError, match=r"^config file .*empty.yaml must be a mapping of sections \(model, data, "
                                          r"training, ...\), got str$"):
        load_config(str(empty))


def test_every_section_refuses_bad_values_when_built_directly():
    from raytrain.config import CheckpointConfig, ClusterConfig, ScalingConfig, TrainingConfig

    with pytest.raises(ConfigError, match=r"^training.warmup_steps must be an integer >= 0, got -1$"):
        TrainingConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match=r"checkpoint.max_failures must be an integer >= 0, got -1"):
        CheckpointConfig(max_failures=-1)
    with pytest.raises(ConfigError, match=r"unknown key cluster.adress; did you mean cluster.address\?"):
        ClusterConfig(adress="x:1")
    assert ClusterConfig(address="10.0.0.1:6379").address == "10.0.0.1:6379"
    assert ClusterConfig(address="ray://head:10001").address == "ray://head:10001"
    assert ClusterConfig(address="[::1]:6379").address == "[::1]:6379"
    for address in ("auto", "local", "head:1", "head:65535"):  # ray.init's own words, and the ends of the port range
        assert ClusterConfig(address=address).address == address
    assert ScalingConfig(num_workers=[1, 1]).num_workers == [1, 1]  # an elastic range may hold one size


def test_each_range_takes_its_ends_and_refuses_just_past_them():
    # the lowest (or highest) value each declared range allows, with its meaning in config.py's docstrings: 0 is
    # "read on the training thread", "never", "shrink at once"; a min_lr_ratio of 1 keeps the peak; one path in a list
    ends = {"data.tokenize_batch_size": 1, "data.tokenize_concurrency": 1, "data.num_shards": 1,
            "data.prefetch_batches": 0, "data.num_builtin_documents": 1, "data.eval_max_batches": 1,
            "data.progress_every_s": 0.0, "data.path": ["a.txt"], "data.eval_path": ["b.txt"],
            "training.micro_batch_size_per_gpu": 1, "training.gradient_accumulation_steps": 1,
            "training.min_lr_ratio": 1.0, "training.adam_betas": [0.0, 0.999], "training.seed": 0,
            "training.log_every_n_steps": 1, "training.peak_tflops_per_gpu": 0.5, "scaling.num_workers": 1,
            "scaling.replacement_timeout_s": 0.0, "scaling.resize_interval_s": 0.0, "scaling.gpu_memory_fraction": 1.0,
            "checkpoint.num_to_keep": 1, "cluster.num_cpus": 1}
    cfg = load_config(None, values=ends)
    assert {key: functools.reduce(getattr, key.split("."), cfg) for key in ends} == ends
    for key, value, message in [
            ("data.tokenize_batch_size", 0, "an integer >= 1"), ("data.num_builtin_documents", 0, "an integer >= 1"),
            ("data.prefetch_batches", -1, "an integer >= 0"), ("data.progress_every_s", -1.0, "a number >= 0"),
            ("data.eval_fraction", 1.0, "a number in [0, 1)"),  # 1 would hold out every document
            ("training.min_lr_ratio", 1.5, "a number in [0, 1]"), ("training.seed", -1, "an integer >= 0"),
            ("training.adam_betas", [0.9], "a list of 2 numbers in [0, 1)"),
            ("training.adam_betas", [0.9, 0.95, 0.99], "a list of 2 numbers in [0, 1)"),
            ("training.peak_tflops_per_gpu", 0.0, "a number > 0"),
            ("scaling.gpu_memory_fraction", 0.0, "a number in (0, 1] or null"),
            ("scaling.gpu_memory_fraction", 1.5, "a number in (0, 1] or null"),
            ("checkpoint.num_to_keep", 0, "an integer >= 1")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, values={key: value})
        assert str(e.value).startswith(f"{key} must be {message}, got ") and str(e.value).endswith(repr(value)), \
            str(e.value)
    with pytest.raises(ConfigError, match=r"^training.adam_betas\[0\] must be a number in \[0, 1\), got 1.0$"):
        load_config(None, values={"training.adam_betas": [1.0, 0.95]})


def test_workers_rebuild_the_config_from_plain_data():
    cfg = load_config(None, ["training.max_steps=7", "network.env.NCCL_DEBUG=INFO", "data.path=[a, b]"])
    data = json.loads(json.dumps(cfg.to_dict()))  # as Ray ships it
    again = RunConfig.from_dict(data)
    assert again == cfg and again.data.path == ["a", "b"] and again.network.env == {"NCCL_DEBUG": "INFO"}
    with pytest.raises(ConfigError, match="training.max_steps must be an integer >= 1, got str '7'"):
        RunConfig.from_dict({**data, "training": {**data["training"], "max_steps": "7"}})
    with pytest.raises(ConfigError, match=r"^data.eval_path and data.eval_fraction are both set: "):
        RunConfig.from_dict({**data, "data": {**data["data"], "eval_fraction": 0.1, "eval_path": "held_out.txt"}})
    with pytest.raises(ConfigError, match=r"^the run config must be a mapping of sections, got list$"):
        RunConfig.from_dict([data])  # unchecked, pydantic's error names no field and one_line raised IndexError


@pytest.mark.parametrize("key", ["model.name_or_path", "model.tokenizer", "data.path", "data.eval_path", "data.hf_split",
                                 "scaling.accelerator_type", "checkpoint.resume_from", "checkpoint.export_dir",
                                 "tracking.mlflow_tracking_uri", "deepspeed"])
def test_an_empty_path_uri_or_name_is_refused(key):
    # "" as a path is the current directory: data.path="" trained on whatever lay there
    with pytest.raises(ConfigError, match=rf"^{key} must be .*a string \(not empty\).*, got str ''$"):
        load_config(None, [f'{key}=""'])


def test_values_are_taken_as_written_not_as_yaml():
    for path in ("ck #2", "yes", "2024-06-01", "null"):  # as YAML: cut at '#', true, a date, None
        assert load_config(None, values={"checkpoint.resume_from": path}).checkpoint.resume_from == path


def test_a_key_given_twice_on_the_command_line_is_refused():
    for overrides in (["training.max_steps=20", "training.max_steps=30"],
                      ['training={"max_steps": 3}', "training.max_steps=5"],  # inside a section given whole
                      ['deepspeed={"gradient_clipping": 1.0}', "deepspeed.gradient_clipping=0.5"]):
        with pytest.raises(ConfigError, match=r"is given twice on the command line \(.* and .*\); .*: keep one$"):
            load_config(None, overrides, command_line=True)
    with pytest.raises(ConfigError, match=r"checkpoint.resume_from is given twice"):
        load_config(None, ["checkpoint.resume_from=a"], values={"checkpoint.resume_from": "b"}, command_line=True)
    # lists composed in code (a benchmark's base plus its --set) refine: the later one wins
    assert load_config(None, ["training.max_steps=20", "training.max_steps=30"]).training.max_steps == 30


def test_with_overrides_and_with_deepspeed_make_new_configs():
    cfg = load_config(None, ["training.max_steps=7"])
    again = cfg.with_overrides(["scaling.use_gpu=true", "training.max_steps=9", "training.max_steps=11"])
    # a list composed in code (raytrain.driver.checks adds scaling.use_gpu=true): the later value wins
    assert (again.scaling.use_gpu, again.training.max_steps, again.training.warmup_steps) == (True, 11, 10)
    assert (cfg.scaling.use_gpu, cfg.training.max_steps) == (None, 7)  # "this one is unchanged"
    resolved = cfg.with_deepspeed({"train_batch_size": 8})  # what raytrain.planning.resolve hands on
    assert resolved.deepspeed == {"train_batch_size": 8} and resolved.training == cfg.training


def test_a_section_given_whole_is_applied_before_its_dotted_keys(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 512, "zero_optimization": {"stage": 3}}))
    for overrides in ([f"deepspeed={ds}", "deepspeed.zero_optimization.stage=2"],
                      ["deepspeed.zero_optimization.stage=2", f"deepspeed={ds}"]):  # was silently lost
        cfg = load_config(None, overrides, command_line=True)
        assert cfg.deepspeed == {"train_batch_size": 512, "zero_optimization": {"stage": 2}}


def test_a_dotted_override_under_either_zero_name_replaces_the_value_under_the_other(tmp_path):
    # the default writes stage3_prefetch_bucket_size: "auto"; the field's own name beside it was refused
    z = load_config(None, ["deepspeed.zero_optimization.prefetch_bucket_size=1000"]).deepspeed["zero_optimization"]
    assert z["prefetch_bucket_size"] == 1000 and "stage3_prefetch_bucket_size" not in z
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "max_live_parameters": 5}}))
    z = load_config(None, [f"deepspeed={ds}", "deepspeed.zero_optimization.stage3_max_live_parameters=7"],
                    command_line=True).deepspeed["zero_optimization"]
    assert z == {"stage": 3, "stage3_max_live_parameters": 7}
    assert json.loads(ds.read_text())["zero_optimization"]["max_live_parameters"] == 5  # the file is not touched
    for overrides in (["deepspeed.zero_optimization.prefetch_bucket_size=1",
                       "deepspeed.zero_optimization.stage3_prefetch_bucket_size=2"],
                      ['deepspeed={"zero_optimization": {"stage3_max_reuse_distance": 1}}',
                       "deepspeed.zero_optimization.max_reuse_distance=2"]):
        with pytest.raises(ConfigError, match=r"^.+ and \S+ are one setting under two names on the command line "
                                              r"\(DeepSpeed reads either\); .*: keep one$"):
            load_config(None, overrides, command_line=True)


def test_the_zero_names_with_two_spellings_are_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from raytrain.config import ZERO_ALIASED

    assert {n: f.alias for n, f in DeepSpeedZeroConfig.model_fields.items() if f.alias and f.alias != n} == \
        {f: f"stage3_{f}" for f in ZERO_ALIASED}


OWN_OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}


@pytest.mark.parametrize("training, match", [
    (["training.learning_rate=3e-4"], r"^training.learning_rate=0.0003 contradicts deepspeed.optimizer.params.lr=0.0001 "
                                      r"\(in .*ds.json\): set it in one place \(or make the DeepSpeed value \"auto\"\)$"),
    (["training.weight_decay=0.1"], "training.weight_decay=0.1 contradicts deepspeed.optimizer.params.weight_decay=0.0"),
    (["training.gradient_clipping=0.5"], "training.gradient_clipping=0.5 contradicts deepspeed.gradient_clipping=1.0"),
    (["training.adam_betas=[0.9, 0.99]"], r"training.adam_betas=\[0.9, 0.99\] would be ignored: deepspeed.optimizer "
                                          r"\(AdamW\) has no params.betas, .*write \"betas\": \"auto\" there"),
    (["training.warmup_steps=5"], "training.warmup_steps=5 would be ignored: the DeepSpeed config has its own optimizer "
                                  "and no scheduler"),
])
def test_a_training_value_the_deepspeed_json_would_override_or_ignore_is_refused(training, match, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(OWN_OPTIMIZER))
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"deepspeed={ds}", *training])
    run = tmp_path / "run.yaml"  # written in the file: the same
    run.write_text("training:\n  " + training[0].removeprefix("training.").replace("=", ": ") + "\n")
    with pytest.raises(ConfigError, match=match):
        load_config(str(run), [f"deepspeed={ds}"])


ONE_CYCLE = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-4, "cycle_first_step_size": 50}}


@pytest.mark.parametrize("training", ["training.warmup_steps=20", "training.learning_rate=3e-4"])
def test_a_scheduler_that_sets_its_own_learning_rate_names_its_own_params(training, tmp_path):
    """OneCycle takes no warmup_num_steps: the usual advice (write it as "auto") would be refused next."""
    ds = {**OWN_OPTIMIZER, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": ONE_CYCLE}
    with pytest.raises(ConfigError, match=r"would be ignored: deepspeed.scheduler \(OneCycle\) sets the learning rate "
                                          r"itself, from its own cycle_min_lr / cycle_max_lr and cycle_first_step_size"):
        load_config(None, [f"deepspeed={json.dumps(ds)}", training])
    load_config(None, [f"deepspeed={json.dumps(ds)}", "training.max_steps=20"])  # the loop's length: used


def test_the_schedulers_that_set_their_own_learning_rate_take_no_warmup():
    import inspect

    from deepspeed.runtime import lr_schedules

    from raytrain.config import _SETS_ITS_OWN_LR

    for name in lr_schedules.VALID_LR_SCHEDULES:
        takes = set(inspect.signature(getattr(lr_schedules, name).__init__).parameters)
        assert ("warmup_num_steps" not in takes) == (name in _SETS_ITS_OWN_LR), name


WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}


def test_a_learning_rate_a_schedulers_own_default_peak_would_replace_is_refused():
    """WarmupDecayLR without warmup_max_lr warms up to 0.001 whatever the optimizer's lr: a written
    training.learning_rate=3e-4 never took effect."""
    ds = {"zero_optimization": {"stage": 3}, "scheduler": WARMUP_DECAY}
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"deepspeed={json.dumps(ds)}", "training.learning_rate=3e-4"])
    assert str(e.value) == ('training.learning_rate=0.0003 would be ignored: deepspeed.scheduler (WarmupDecayLR) has '
                            'no params.warmup_max_lr, so DeepSpeed would warm up to its own default, 0.001: write '
                            '"warmup_max_lr": "auto" there, or remove training.learning_rate')
    load_config(None, [f"deepspeed={json.dumps(ds)}"])  # the default learning_rate is that same 0.001
    auto = {**ds, "scheduler": {**WARMUP_DECAY, "params": {**WARMUP_DECAY["params"], "warmup_max_lr": "auto"}}}
    load_config(None, [f"deepspeed={json.dumps(auto)}", "training.learning_rate=3e-4"])
    warmup = {**ds, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}  # peaks at the lr
    load_config(None, [f"deepspeed={json.dumps(warmup)}", "training.learning_rate=3e-4"])


def test_the_schedulers_with_a_default_peak_of_their_own_are_known():
    import inspect

    from deepspeed.runtime import lr_schedules

    from raytrain.config import OWN_DEFAULT_PEAK_LR, TrainingConfig

    for name in lr_schedules.VALID_LR_SCHEDULES:
        peak = inspect.signature(getattr(lr_schedules, name).__init__).parameters.get("warmup_max_lr")
        assert (peak.default if peak is not None else None) == OWN_DEFAULT_PEAK_LR.get(name), name
    # why a default learning_rate is not refused under them: it is the peak they warm up to
    assert set(OWN_DEFAULT_PEAK_LR.values()) == {TrainingConfig().learning_rate}


@pytest.mark.parametrize("optimizer, training, message", [
    ("Lion", "training.adam_epsilon=1e-6", "training.adam_epsilon=1e-06 would be ignored: deepspeed.optimizer (Lion) "
                                           "takes no eps: remove training.adam_epsilon"),
    ("Adagrad", "training.adam_betas=[0.9, 0.99]", "training.adam_betas=[0.9, 0.99] would be ignored: "
                                                   "deepspeed.optimizer (Adagrad) takes no betas: remove "
                                                   "training.adam_betas"),
    # a parameter the optimizer does take: the usual advice
    ("Lion", "training.adam_betas=[0.9, 0.99]", 'training.adam_betas=[0.9, 0.99] would be ignored: deepspeed.optimizer '
                                                '(Lion) has no params.betas, so DeepSpeed would use its own default: '
                                                'write "betas": "auto" there, or remove training.adam_betas'),
])
def test_a_training_value_the_json_optimizer_takes_no_parameter_for_is_refused_with_remove(optimizer, training,
                                                                                           message):
    """Advice to write "eps": "auto" under Lion was refused next: eps is not a parameter of FusedLion."""
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": optimizer, "params": {"lr": "auto"}}}
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"deepspeed={json.dumps(ds)}", training])
    assert str(e.value) == message


def test_the_optimizers_that_take_no_betas_or_eps_are_known():
    import inspect

    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.engine import DeepSpeedEngine

    from raytrain.config import _TAKES_NO

    # what engine._configure_basic_optimizer (0.19.8) builds for each name, with and without an offloaded
    # optimizer; mup's MuAdam/MuAdamW/MuSGD pass their keyword arguments to torch's Adam/AdamW/SGD, and
    # Muon passes betas and eps on to its Adam half
    built = {"adam": [FusedAdam, DeepSpeedCPUAdam, torch.optim.Adam],
             "adamw": [FusedAdam, DeepSpeedCPUAdam, torch.optim.AdamW],
             "adagrad": [torch.optim.Adagrad, DeepSpeedCPUAdagrad], "lamb": [FusedLamb],
             "lion": [FusedLion, DeepSpeedCPULion], "muadam": [torch.optim.Adam], "muadamw": [torch.optim.AdamW],
             "musgd": [torch.optim.SGD]}
    takes = {name: [set(inspect.signature(c.__init__).parameters) for c in classes] for name, classes in built.items()}
    takes["muon"] = [set(DeepSpeedEngine._ADAM_HALF_KEYS)]
    assert set(takes) == set(ds_config.DEEPSPEED_OPTIMIZERS)
    for name, signatures in takes.items():
        for parameters in signatures:
            assert {"betas", "eps"} - parameters == _TAKES_NO.get(name, set()), name


def test_training_values_the_deepspeed_json_agrees_with_or_leaves_auto_pass(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(OWN_OPTIMIZER))
    # defaults never contradict: the user's JSON with its own lr works unchanged
    assert load_config(None, [f"deepspeed={ds}"]).training.learning_rate == 1e-3
    load_config(None, [f"deepspeed={ds}", "training.learning_rate=1e-4", "training.gradient_clipping=1.0"])
    auto = {**OWN_OPTIMIZER, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    load_config(None, [f"deepspeed={json.dumps(auto)}", "training.learning_rate=3e-4", "training.weight_decay=0.01",
                       "training.warmup_steps=5", "training.max_steps=20"])
    # a section that is no mapping is not read here: raytrain.deepspeed_config names it
    malformed = {**OWN_OPTIMIZER, "optimizer": "AdamW", "scheduler": "WarmupLR"}
    cfg = load_config(None, [f"deepspeed={json.dumps(malformed)}", "training.learning_rate=3e-4",
                             "training.warmup_steps=5"])
    from raytrain.deepspeed_config import resolve_deepspeed

    with pytest.raises(ConfigError, match=r"^deepspeed.optimizer must be a mapping"):
        resolve_deepspeed(cfg.deepspeed, cfg.training, world_size=1, use_gpu=False, hidden_size=64)


def test_a_min_lr_ratio_under_the_jsons_own_scheduler_is_refused():
    ds = {**OWN_OPTIMIZER, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"deepspeed={json.dumps(ds)}", "training.min_lr_ratio=0.2"])
    assert str(e.value) == ("training.min_lr_ratio=0.2 would be ignored: deepspeed.scheduler (WarmupLR) replaces "
                            "raytrain's warmup + cosine schedule: set the DeepSpeed scheduler's own minimum there, or "
                            "remove training.min_lr_ratio")


@pytest.mark.parametrize("override, message", [
    ("checkpoint.name=2024-06-01", 'checkpoint.name must be a string or null, got date 2024-06-01: YAML reads an unquoted '
                                   '2024-06-01 as a date; quote it ("2024-06-01")'),
    ("training.learning_rate=1e400", "training.learning_rate must be a number > 0, got inf (a number too large for a "
                                     "float)"),
    ("model.config={1: 2}", "model.config has the key 1: its keys must be strings (field names)"),
    ("run.yaml", "override 'run.yaml' is not KEY=VALUE: a run config file comes after --config: --config run.yaml"),
    ("training=null", "training must be a mapping, got null: YAML reads a section with nothing under it (all "
                      "commented out) as null; write training: {} or delete it"),
])
def test_messages_say_what_yaml_made_of_the_value(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("override, message", [
    ("scaling.num_workers=[1, 2, 3]", "scaling.num_workers=[1, 2, 3] is neither a number of workers nor [min, max] (an "
                                      "elastic range): write for example 4 or [2, 4]"),
    ("checkpoint.name=runs/a", "checkpoint.name='runs/a' is not one directory name: write a name without '/'"),
    ("checkpoint.name=..", "checkpoint.name='..' is not one directory name"),
    ("training.max_steps=true", "training.max_steps must be an integer >= 1, got true"),  # not 1: strict
    ("checkpoint.name=.", "checkpoint.name='.' is not one directory name"),  # the storage path itself
    ("checkpoint.name=a\\b", "checkpoint.name='a\\\\b' is not one directory name"),  # a folder on Windows storage
    ('checkpoint.name=" "', "checkpoint.name=' ' is not one directory name"),
    ("scaling.num_workers=[2]", "scaling.num_workers=[2] is neither a number of workers nor [min, max]"),
    ("scaling.num_workers=[0, 2]", "scaling.num_workers=[0, 2] has the minimum 0: an elastic range needs at least 1 "
                                   "worker, for example [1, 2]"),
    # the suggested fix is itself accepted: "write [0, 1]" was refused next for its minimum
    ("scaling.num_workers=[1, 0]", "scaling.num_workers=[1, 0] has the minimum 1 above the maximum 0: write [1, 1]"),
    ("cluster.address=head:0", "cluster.address='head:0' is not a Ray address: write HOST:PORT"),
    ("cluster.address=head:65536", "cluster.address='head:65536' is not a Ray address"),  # ports end at 65535
    ('cluster.address="head:"', "cluster.address='head:' is not a Ray address"),  # quoted: YAML's head: is a mapping
    ("cluster.address=https://head:8265", "cluster.address='https://head:8265' is the dashboard's address"),
    # a RAY_ADDRESS read from a file keeps its newline; ray.init then failed deep in the connection
    ('cluster.address="head:6379\\n"', "cluster.address='head:6379\\n' is not a Ray address"),
])
def test_a_value_its_type_alone_does_not_refuse_is_named_with_the_fix(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override, message", [
    ("data.format=xml", "data.format must be auto, text, json, csv, parquet, hf or tokenized, got str 'xml'"),
    ("model.config=[1]", "model.config must be a mapping, got list [1]"),
    ("training.max_steps=null", "training.max_steps must be an integer >= 1, got null"),
    # Int | Float reads as "a number", not "an integer or a number"
    ("network.env.NCCL_IB_DISABLE=true", "network.env.NCCL_IB_DISABLE must be a string or a number, got true"),
    ("data.path=5", "data.path must be a string (not empty) or a list of strings (not empty) or null, got 5"),
    # no key close to it: the valid keys alone, no guess. (The right key in another section, training.seq_len ->
    # data.seq_len, is test_bad_input's: here it would fail mutate.py's re-run, which empties config_fields.SECTIONS)
    ("training.zzz=1", "unknown key training.zzz (valid keys under training: max_steps, micro_batch_size_per_gpu, "),
    # the name of a section, under another: no "did you mean .model?" from the run config's own fields
    ("training.model=x", "unknown key training.model (valid keys under training: "),
])
def test_a_wrong_type_is_described_in_the_declarations_words(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message), str(e.value)


def test_the_words_for_types_no_field_declares_today():
    # what a new field's error would say: a one-choice Literal, an optional number
    assert describe(Literal["x"]) == "x"
    assert describe(Float | None) == "a number or null"
    assert describe(Int | Float | None) == "a number or null"


def test_a_range_with_only_an_upper_end_is_described_by_it():
    # no field declares one today: the words a new `Field(le=...)` field's error would use
    assert describe(Annotated[Int, Field(le=8)]) == "an integer <= 8"
    assert describe(Annotated[Float, Field(lt=1)]) == "a number < 1"


def test_a_hash_in_an_override_value_is_part_of_the_value():
    # YAML reads " #2" as a comment: `checkpoint.name=run #2` continued the run named "run"
    cfg = load_config(None, ["checkpoint.name=run #2", "data.path=/data/set #1/a.jsonl", 'model.tokenizer="tok #3"'])
    assert (cfg.checkpoint.name, cfg.data.path, cfg.model.tokenizer) == ("run #2", "/data/set #1/a.jsonl", "tok #3")
    with pytest.raises(ConfigError, match=r"^training.max_steps must be an integer >= 1, got str '20 # steps'"):
        load_config(None, ["training.max_steps=20 # steps"])  # what the '#' was for is the user's to say


def test_a_config_edited_in_code_is_checked_again_with_the_command_lines_line():
    import raytrain
    from raytrain.config import check_config

    loaded = load_config(None, ["training.max_steps=30", "training.learning_rate=2e-3"])
    assert check_config(loaded) == loaded  # what load_config made passes again, unchanged
    for section, key, value, message in [
            ("training", "learning_rate", -1.0, "training.learning_rate must be a number > 0, got -1.0"),
            ("data", "seq_len", 0, "data.seq_len must be an integer >= 1, got 0"),
            ("checkpoint", "storage_path", "", "checkpoint.storage_path must be a string (not empty), got str ''"),
            ("training", "max_steps", 30.0, "training.max_steps must be an integer >= 1, got 30.0")]:  # was retried
        edited = load_config()
        setattr(getattr(edited, section), key, value)
        with pytest.raises(ConfigError) as e:
            check_config(edited)
        assert str(e.value).startswith(message), str(e.value)
    # a training value set in code that the DeepSpeed JSON overrides: refused, as written on the command line
    edited = load_config(None, ['deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, '
                                '"zero_optimization": {"stage": 3}}'])
    edited.training.learning_rate = 3e-4
    with pytest.raises(ConfigError, match=r"^training.learning_rate=0.0003 contradicts deepspeed.optimizer.params.lr"):
        check_config(edited)
    edited = load_config()
    edited.data.seq_len = 0
    with pytest.raises(ConfigError, match=r"^data.seq_len must be an integer >= 1, got 0"):  # before anything starts
        raytrain.fit(edited)


def test_a_misspelt_attribute_set_in_code_is_the_command_lines_unknown_key():
    """Sections are plain dataclasses: `cfg.training.max_step = 20` added an attribute that to_dict() drops, and
    fit() ran the old max_steps without a word. Now the same line as `training.max_step=20` on the command line."""
    import raytrain
    from raytrain.config import check_config

    for path, dotted in [(("training",), "training.max_step"), ((), "trainig"), (("cluster",), "cluster.num_cpu")]:
        with pytest.raises(ConfigError) as typed:
            load_config(None, [f"{dotted}=20"])
        edited = load_config()
        setattr(functools.reduce(getattr, path, edited), dotted.rpartition(".")[2], 20)
        with pytest.raises(ConfigError) as e:
            check_config(edited)
        assert str(e.value) == str(typed.value) and "; did you mean " in str(e.value), str(e.value)
    assert str(typed.value).startswith("unknown key cluster.num_cpu; did you mean cluster.num_cpus? (valid keys")
    edited = load_config()
    edited.training.max_step = 20
    with pytest.raises(ConfigError, match=r"^unknown key training.max_step; did you mean training.max_steps\? "):
        raytrain.fit(edited)  # refused before anything starts
    # the free-form mappings take any key, as before
    edited = load_config(None, ["model.config={\"hidden_size\": 64}"])
    edited.model.config["my_own_key"] = 1
    edited.deepspeed["my_own_key"] = 1
    edited.network.env["NCCL_DEBUG"] = "INFO"
    checked = check_config(edited)
    assert checked.model.config["my_own_key"] == checked.deepspeed["my_own_key"] == 1 and checked == edited


def ray_train_run_config():
    from ray.train import RunConfig as RayRunConfig  # ~0.4 s here, the first import

    return RayRunConfig(name="run")


def test_wrong_argument_kinds_in_the_python_api_are_a_type_error_naming_the_argument(tmp_path):
    import raytrain

    for call, message in [
            (lambda: raytrain.load_config({"training": {}}), "raytrain.load_config: path must be the path of a YAML "
                                                             "file (str or os.PathLike) or None, got dict"),
            (lambda: raytrain.load_config(["training.max_steps=5"]), "got list: overrides go second"),
            (lambda: raytrain.load_config(None, "training.max_steps=5"),
             "overrides must be a list of KEY=VALUE strings, got the string 'training.max_steps=5': write "
             "['training.max_steps=5']"),
            (lambda: raytrain.load_config(None, [("training.max_steps", 5)]), "overrides must be KEY=VALUE strings, "
                                                                              "got tuple"),
            (lambda: raytrain.load_config(None, values=["data.path=/d"]), "values must be a dict of dotted keys"),
            (lambda: raytrain.fit({"training": {}}), "raytrain.fit: config must be a raytrain.RunConfig (from "
                                                     "raytrain.load_config), got dict; for a mapping of sections: "
                                                     "raytrain.RunConfig.from_dict(mapping)"),
            (lambda: raytrain.fit("run.yaml"), "got str; for a YAML file: raytrain.load_config(path)"),
            (lambda: raytrain.fit(ray_train_run_config()),  # Ray Train's own, as a Ray user would pass it
             "RunConfig; raytrain's comes from raytrain.load_config (Ray's name, storage_path, failure and "
             "checkpoint settings are its checkpoint section)"),
            (lambda: raytrain.fit(load_config(), fresh="yes"), "raytrain.fit: fresh must be True or False, got str")]:
        with pytest.raises(TypeError) as e:
            call()
        assert message in str(e.value), str(e.value)
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  max_steps: 7\n")
    assert raytrain.load_config(path).training.max_steps == 7  # a pathlib.Path is a path


def test_a_path_with_an_environment_variable_is_refused_not_made_a_directory_of_that_name(tmp_path):
    # YAML keeps $SCRATCH as written and raytrain expands only ~: the run wrote into ./${SCRATCH}/runs
    (tmp_path / "run.yaml").write_text("checkpoint:\n  storage_path: ${SCRATCH}/runs\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "run.yaml"))
    assert str(e.value) == (
        "checkpoint.storage_path=${SCRATCH}/runs holds ${SCRATCH}, an environment variable, which raytrain does not "
        "expand (a YAML file keeps it as written): write the path itself, or give checkpoint.storage_path on the "
        "command line unquoted, where the shell expands it")
    for override, held in (("data.path=[a.jsonl, $DATA/b.jsonl]", "$DATA"),
                           ("checkpoint.export_dir=$HOME/out", "$HOME"), ("deepspeed=$CONFIGS/ds.json", "$CONFIGS")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(override.split('=')[0])}=.* holds \{held}, "):
            load_config(None, [override])
    cfg = load_config(None, ["checkpoint.storage_path=/scratch/$5/runs", "data.path=price$.jsonl"])  # no variable
    assert cfg.checkpoint.storage_path == "/scratch/$5/runs"
    edited = load_config(None)
    edited.checkpoint.export_dir = "${OUT}/model"  # built in code: check_config, as fit() and dry_run run it
    with pytest.raises(ConfigError, match=r"^checkpoint.export_dir=\$\{OUT\}/model holds \$\{OUT\}"):
        check_config(edited)
