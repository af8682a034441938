"""DeepSpeed resolution: "auto", batch arithmetic, contradictions, precision vs hardware.
(What DeepSpeed's own models and raytrain's rules refuse in the resolved dict: planning/test_deepspeed_check.py.)"""

import dataclasses

import pytest

from raytrain.config import ConfigError, TrainingConfig
from raytrain.deepspeed_config import DeepSpeedFacts, resolve_deepspeed

SEED = {"train_batch_size": 512, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "fp16": {"enabled": True}}


def resolve(ds, world_size=8, use_gpu=True, hidden=2048, **training):
    return resolve_deepspeed(ds, TrainingConfig(**training), world_size=world_size, use_gpu=use_gpu,
                             hidden_size=hidden, gpus_per_node=8)


def test_seed_config_with_8_workers_gives_micro_batch_16():
    ds = resolve(SEED)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (512, 16, 4)
    # the user's keys exactly as written (offload, overlap, ...), nothing "auto" to fill in the seed's
    # zero_optimization but ZeRO++ hpZ, which raytrain adds only as "auto" to its own default
    assert ds["zero_optimization"] == SEED["zero_optimization"]
    assert SEED["train_batch_size"] == 512 and "train_micro_batch_size_per_gpu" not in SEED  # input untouched


def test_world_size_that_does_not_divide_names_the_three_numbers():
    with pytest.raises(ConfigError) as e:
        resolve(SEED, world_size=6)
    msg = str(e.value)
    assert "train_batch_size=512" in msg and "gradient_accumulation_steps=4" in msg and "world size 6" in msg
    assert "scaling.num_workers" in msg


def test_explicit_triple_that_disagrees():
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    with pytest.raises(ConfigError, match=r"train_batch_size=64 != .* = 32"):
        resolve(ds, world_size=8)


def test_auto_values_are_filled_from_training_and_model():
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"}}
    out = resolve(ds, world_size=4, hidden=1024, micro_batch_size_per_gpu=2, gradient_accumulation_steps=3,
                  learning_rate=0.02, gradient_clipping=0.5)
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (24, 2, 3)
    assert out["gradient_clipping"] == 0.5
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False  # GPU default: bf16
    assert out["optimizer"]["params"] == {"lr": 0.02, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert out["zero_optimization"]["reduce_bucket_size"] == 1024 * 1024
    assert "auto" not in repr(out)
    zero = resolve({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                          "stage3_param_persistence_threshold": "auto"}}, hidden=1000)
    assert zero["zero_optimization"] == {"stage": 3, "stage3_prefetch_bucket_size": 900_000,  # Hugging Face's formulas
                                         "stage3_param_persistence_threshold": 10_000}


def test_scheduler_auto_values_come_from_training():
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                                            "warmup_max_lr": "auto", "warmup_min_lr": "auto"}}}
    out = resolve(ds, warmup_steps=7, max_steps=90, learning_rate=0.02)
    assert out["scheduler"]["params"] == {"warmup_num_steps": 7, "total_num_steps": 90, "warmup_max_lr": 0.02,
                                          "warmup_min_lr": 0.0}


@pytest.mark.parametrize("ds, where", [
    ({"steps_per_print": "auto"}, "steps_per_print"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, "auto"]}}}, "optimizer.params.betas[1]"),
])
def test_an_auto_raytrain_cannot_fill_is_named_where_it_is(ds, where):
    with pytest.raises(ConfigError) as e:
        resolve(ds)
    assert str(e.value).startswith(f'deepspeed.{where} is "auto" but raytrain has no value for it: write the value')


def test_concrete_values_are_never_rewritten():
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 2.0,
          "zero_optimization": {"stage": 3, "reduce_bucket_size": 12345}}
    out = resolve(ds, world_size=2, gradient_clipping=1.0)
    assert out["gradient_clipping"] == 2.0 and out["zero_optimization"]["reduce_bucket_size"] == 12345
    assert out["train_batch_size"] == 6


def test_nothing_stated_gives_the_fallback_micro_batch_and_an_empty_zero_section():
    for ds in ({}, {"zero_optimization": None}):
        out = resolve(ds, world_size=2)
        assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) \
            == (16, 8, 1)
        assert out["zero_optimization"] == {}  # there for every reader of the resolved dict (no ZeRO: stage 0)
        assert DeepSpeedFacts.of(out).zero_stage == 0


def test_a_consistent_triple_is_kept_as_written():
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    out = resolve(ds, world_size=8)
    assert {k: out[k] for k in ds} == ds


def test_train_batch_size_alone_is_divided_by_the_world_size_with_no_accumulation():
    out = resolve({"train_batch_size": 32}, world_size=2)
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (16, 1)
    with pytest.raises(ConfigError) as e:
        resolve({"train_batch_size": 15}, world_size=2)
    assert str(e.value) == ("deepspeed.train_batch_size=15 is not divisible by gradient_accumulation_steps=1 x world "
                            "size 2: choose a train_batch_size that is a multiple of 2, or a number of workers "
                            "(scaling.num_workers) that divides 15")


def test_gradient_clipping_absent_or_auto_comes_from_training():
    assert resolve({}, world_size=2, gradient_clipping=0.5)["gradient_clipping"] == 0.5
    assert resolve({"gradient_clipping": "auto"}, world_size=2, gradient_clipping=0.25)["gradient_clipping"] == 0.25
    assert resolve({"gradient_clipping": 0.0}, world_size=2, gradient_clipping=0.5)["gradient_clipping"] == 0.0
    assert resolve(SEED)["gradient_clipping"] == 1.0  # the seed JSON has none: training's default


def test_sections_raytrain_reads_must_be_mappings():
    with pytest.raises(ConfigError, match=r'deepspeed.bf16 must be a mapping .*got bool true'):
        resolve({"bf16": True})
    with pytest.raises(ConfigError, match=r"deepspeed.zero_optimization must be a mapping"):
        resolve({"zero_optimization": 3})
    with pytest.raises(ConfigError, match=r"deepspeed.optimizer.params must be a mapping"):
        resolve({"optimizer": {"type": "AdamW", "params": [1]}})


def test_training_value_contradicting_deepspeed_value():
    with pytest.raises(ConfigError, match="training.micro_batch_size_per_gpu=4 contradicts deepspeed.train_micro_batch_size_per_gpu=2"):
        resolve({"train_micro_batch_size_per_gpu": 2}, micro_batch_size_per_gpu=4)


@pytest.mark.parametrize("ds, match", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, "zero_optimization.sub_group_size is \"auto\""),
    ({"train_batch_size": -4}, "positive integer"),
])
def test_contradictions_are_rejected(ds, match):
    with pytest.raises(ConfigError, match=match):
        resolve(ds)


def test_fp16_on_cpu_is_rejected_with_the_fix():
    with pytest.raises(ConfigError, match=r"fp16.enabled=true needs GPUs.*scaling.use_gpu=true"):
        resolve(SEED, use_gpu=False)
    with pytest.raises(ConfigError, match=r"^training.precision=fp16 needs GPUs, and this run is on CPU"):
        resolve({}, use_gpu=False, precision="fp16")  # the fp16 section raytrain adds for training.precision


def test_deepspeed_json_path_is_read(tmp_path):
    import json

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SEED))
    assert resolve(str(path))["train_micro_batch_size_per_gpu"] == 16
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("ws,gpn,gpu,want", [(16, 8, True, 8), (8, 8, True, 1), (12, 8, True, 4),
                                             (16, None, True, 1), (4, 2, False, 1)])
def test_hpz_auto_is_gpus_per_node_across_nodes(ws, gpn, gpu, want):
    out = resolve_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": "auto"}}, TrainingConfig(),
                            world_size=ws, use_gpu=gpu, hidden_size=64, gpus_per_node=gpn)
    assert out["zero_optimization"]["zero_hpz_partition_size"] == want


def test_hpz_written_or_absent_is_kept():
    def r(z):
        return resolve_deepspeed({"zero_optimization": z}, TrainingConfig(), world_size=16, use_gpu=True,
                                 hidden_size=64, gpus_per_node=8)["zero_optimization"]
    assert r({"stage": 3, "zero_hpz_partition_size": 2})["zero_hpz_partition_size"] == 2
    assert "zero_hpz_partition_size" not in r({"stage": 3})


def test_training_batch_values_fill_keys_the_json_leaves_out():
    z3 = {"zero_optimization": {"stage": 3}}
    out = resolve(z3, world_size=2, micro_batch_size_per_gpu=4)  # not the fallback 8
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (8, 4, 1)
    assert resolve(z3, world_size=2, gradient_accumulation_steps=4)["gradient_accumulation_steps"] == 4
    out = resolve({**z3, "train_batch_size": 32}, world_size=2, micro_batch_size_per_gpu=4)
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (4, 4)
    with pytest.raises(ConfigError, match="train_batch_size=32 is not divisible by training.micro_batch_size_per_gpu=5"):
        resolve({**z3, "train_batch_size": 32}, world_size=2, micro_batch_size_per_gpu=5)


@pytest.mark.parametrize("ds, precision, use_gpu, want", [
    ({}, "bf16", True, "bf16"),  # nothing stated: the user's choice, not DeepSpeed's fp32 default
    ({}, "fp16", True, "fp16"),
    ({"fp16": {"enabled": "auto"}}, "bf16", True, "bf16"),
    ({"bf16": {"bf16_master_weights_and_grads": False}}, "bf16", True, "bf16"),  # the section's other keys kept
    ({"bf16": {"enabled": True}}, "bf16", True, "bf16"),
    ({"bf16": {"enabled": True}}, None, False, "bf16"),  # no training.precision: the JSON's word stands
    ({"bfloat16": {"enabled": True}}, None, True, "bf16"),  # DeepSpeed's old key, read alike
    ({"bfloat16": {"enabled": "auto"}}, None, True, "bf16"),
    ({"bfloat16": {"enabled": "auto"}}, None, False, "fp32"),
    # Hugging Face's stock ZeRO-3 JSON: fp16 "auto" and no bf16 section is bf16 on GPUs, not fp32
    ({"fp16": {"enabled": "auto"}}, None, True, "bf16"),
    ({"fp16": {"enabled": "auto"}}, None, False, "fp32"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": False}}, None, True, "fp32"),  # bf16 turned off: kept
    # "auto" beside a precision the JSON turns on follows it, instead of both being true
    ({"fp16": {"enabled": True}, "bf16": {"enabled": "auto"}}, None, True, "fp16"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": True}}, None, True, "bf16"),
    ({}, None, True, "fp32"),  # nothing stated, nothing "auto": the JSON's word (DeepSpeed's fp32) stands
    ({"fp16": {"enabled": True}}, "fp16", True, "fp16"),  # stated and asked alike: no contradiction
    ({"fp16": {"enabled": False}}, "bf16", True, "bf16"),  # the other precision turned off: no contradiction
])
def test_precision_from_training_or_the_json(ds, precision, use_gpu, want):
    out = resolve({"zero_optimization": {"stage": 3}, **ds}, use_gpu=use_gpu, precision=precision)
    assert DeepSpeedFacts.of(out).precision == want and "bfloat16" not in out
    assert out.get("bf16", {}).get("bf16_master_weights_and_grads", False) is False


@pytest.mark.parametrize("ds, precision, match", [
    ({"bf16": {"enabled": True}}, "fp32", "training.precision=fp32 contradicts deepspeed.bf16.enabled=true"),
    ({"fp16": {"enabled": True}}, "bf16", "training.precision=bf16 contradicts deepspeed.fp16.enabled=true"),
    ({"bf16": {"enabled": False}}, "bf16", "training.precision=bf16 contradicts deepspeed.bf16.enabled=false"),
    ({"bfloat16": {"enabled": True}}, "fp16", "training.precision=fp16 contradicts deepspeed.bf16.enabled=true"),
])
def test_precision_the_json_states_otherwise_is_refused(ds, precision, match):
    with pytest.raises(ConfigError, match=match + r': set it in one place \(remove training.precision, or make'):
        resolve(ds, precision=precision)


@pytest.mark.parametrize("ds", [{"bf16": {"enabled": "auto"}, "fp16": {"enabled": True}},  # the default JSON's bf16
                                {"fp16": {"enabled": True}}])
def test_a_precision_filled_from_training_is_no_second_precision_turned_on(ds):
    """training.precision=bf16 filled bf16's "auto", then "both true" was reported, naming neither
    training.precision nor what the user wrote (fp16.enabled=true)."""
    with pytest.raises(ConfigError) as e:
        resolve({"zero_optimization": {"stage": 3}, **ds}, precision="bf16")
    assert str(e.value) == ('training.precision=bf16 contradicts deepspeed.fp16.enabled=true: set it in one place '
                            '(remove training.precision, or make deepspeed.fp16.enabled "auto")')
    with pytest.raises(ConfigError) as e:  # both stated: that, whatever training.precision says
        resolve({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, precision="bf16")
    assert str(e.value) == "deepspeed.fp16.enabled and deepspeed.bf16.enabled are both true: enable one of them"
    # no training.precision: the fp16 the JSON states is the run's precision, bf16's "auto" follows it
    assert DeepSpeedFacts.of(resolve({"zero_optimization": {"stage": 3}, **ds})).precision == "fp16"


@pytest.mark.parametrize("tbs, world_size, training, fix", [
    # 16 is not divisible by 3: no number of workers helps, a different accumulation does
    (16, 2, {"gradient_accumulation_steps": 3}, "a multiple of 6, or a training.gradient_accumulation_steps that "
                                                "divides 8"),
    (512, 6, {"gradient_accumulation_steps": 4}, "a multiple of 24, or a number of workers (scaling.num_workers) "
                                                 "that divides 128"),
    (15, 2, {"micro_batch_size_per_gpu": 4}, "a multiple of 8"),  # neither divides 15: only train_batch_size
    (6, 2, {"micro_batch_size_per_gpu": 4}, "a multiple of 8, or a training.micro_batch_size_per_gpu that divides 3"),
])
def test_a_train_batch_size_that_does_not_divide_offers_only_fixes_that_work(tbs, world_size, training, fix):
    with pytest.raises(ConfigError) as e:
        resolve({"train_batch_size": tbs, "zero_optimization": {"stage": 3}}, world_size=world_size, **training)
    name, value = next(iter(training.items()))
    assert str(e.value) == (f"deepspeed.train_batch_size={tbs} is not divisible by training.{name}={value} x world "
                            f"size {world_size}: choose a train_batch_size that is {fix}")


def test_facts_read_from_the_resolved_dict():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "CPU"},  # read in lower case
                                "offload_param": {"device": "nvme"}},
          "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
          "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}, "scheduler": {"type": "WarmupLR"}}
    assert DeepSpeedFacts.of(ds) == DeepSpeedFacts(
        train_batch_size=32, micro_batch_per_gpu=2, gradient_accumulation_steps=2, zero_stage=3, precision="bf16",
        offload_optimizer="cpu", offload_param="nvme", optimizer_type="AdamW", torch_adam=True, has_scheduler=True,
        bf16_master_weights=True, bf16_optimizer_states=True)
    plain = DeepSpeedFacts.of({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
                               "gradient_accumulation_steps": 1, "bf16": {"enabled": True}})
    assert (plain.zero_stage, plain.offload_optimizer, plain.offload_param, plain.optimizer_type, plain.torch_adam,
            plain.has_scheduler, plain.bf16_master_weights, plain.bf16_optimizer_states) == \
        (0, "none", "none", None, False, False, False, False)  # the bf16 trade-offs are opt-in only
    with pytest.raises(dataclasses.FrozenInstanceError):  # read once on the driver, never edited afterwards
        plain.zero_stage = 3
