"""The resolved DeepSpeed dict checked by DeepSpeed's own config models (for the run's world size),
by the keys DeepSpeed actually reads, and by raytrain's own rules: each mistake is one line naming
deepspeed.<dotted.key>, and a config DeepSpeed accepts stays accepted."""

import json
import logging
import sys

import pytest

from raytrain import compat
from raytrain.config import ConfigError
from raytrain.planning.deepspeed_check import check_deepspeed

BATCH = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


def check(extra, world_size=4, seq_len=128, use_gpu=True):
    ds = {**BATCH, "zero_optimization": {"stage": 3}, **extra}
    check_deepspeed(ds, world_size=world_size, seq_len=seq_len, use_gpu=use_gpu)
    return ds


def zero(**keys):
    return {"zero_optimization": {"stage": 3, **keys}}


@pytest.mark.parametrize("extra", [
    {},
    zero(reduce_bucket_size=5e8, stage3_prefetch_bucket_size=5e7),  # floats in JSON: DeepSpeed takes them
    zero(offload_optimizer={"device": "cpu", "pin_memory": True}, offload_param={"device": "cpu"}),
    {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": False},
    {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False}},
    {"tensorboard": {"enabled": False, "job_name": "2024"}},  # a numeric-looking string where DeepSpeed wants one
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
    {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},  # an alias
    {"aio": {"block_size": 262144, "intra_op_parallelism": 1, "use_gds": True}},  # GDS: the GPU workers' to check
    # the optimizer's params against the one class DeepSpeed builds: torch's AdamW, CPU Adam, FusedAdam
    {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "foreach": False, "fused": False}}},
    {"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": True, "bias_correction": True}},
     **zero(offload_optimizer={"device": "cpu"})},
    {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": True, "set_grad_none": True}}},
    # Adam with adam_w_mode=false and torch_adam: torch's Adam, which has decoupled_weight_decay (AdamW has not)
    {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False,
                                              "decoupled_weight_decay": True}}},
    {"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}},  # ZeRO-tested
    {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True},  # opted in
    {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 0}},  # no ZeRO: no list
    {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}},
    {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}},  # not in ZeRO's list: DeepSpeed adds it when it checks
    {"gradient_clipping": 0},  # no clipping, as DeepSpeed reads it
    {"tensor_parallel": {"autotp_size": 1}},  # AutoTP off (DeepSpeed builds its TP groups only above 1)
    {"sequence_parallel_size": 1, "data_parallel_size": 4},  # the world as DeepSpeed's (data, sequence) mesh
    {"sequence_parallel_size": 1},  # no sequence parallelism: DeepSpeed's data-parallel world is the whole world
    {"checkpoint": {"load_universal": False, "tag_validation": "FAIL"}},  # DeepSpeed's checkpoint keys, raytrain's off
    {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {}},  # no stage: 0, no list
    # a scheduler's other arguments: a string, and -1 for a fresh start
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear",
                                                  "last_batch_iteration": -1}}},
    {"scheduler": {"type": "StepLR", "params": {"step_size": 10}}, "zero_optimization": {},
     "bf16": {"enabled": False}},  # no ZeRO (no stage: 0), fp32: DeepSpeed builds it on torch's optimizer
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0}}},  # 0 is no decay, not negative
    {"optimizer": {"type": "Adagrad", "params": {"lr": 0.01, "lr_decay": 0.1}}},  # torch's Adagrad without offload
    # offloaded Lion is DeepSpeedCPULion, which takes fp32_optimizer_states (FusedLion does not)
    {"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "fp32_optimizer_states": True}},
     **zero(offload_optimizer={"device": "cpu"})},
    {"optimizer": {"type": "AdamW", "params": {"betas": [0.0, 0.999]}}},  # beta1=0 (no momentum): [0, 1) takes it
])
def test_what_deepspeed_accepts_passes(extra):
    before = repr(extra)
    check(extra)
    assert repr(extra) == before  # checking never edits the dict


@pytest.mark.parametrize("extra, message", [
    # unknown keys at every level, with DeepSpeed's own closest key
    ({"zero_optimisation": {"stage": 2}}, "deepspeed.zero_optimisation is not a key DeepSpeed reads .*did you mean "
                                          "deepspeed.zero_optimization"),
    ({"steps_per_prnt": 10}, "did you mean deepspeed.steps_per_print\\? \\(see DeepSpeed's config documentation for "
                             "the keys under deepspeed\\)$"),
    (zero(overlap_com=True), "deepspeed.zero_optimization.overlap_com .*did you mean deepspeed.zero_optimization.overlap_comm"),
    (zero(offload_optimizer={"device": "cpu", "pin_memry": True}), "offload_optimizer.pin_memry .*pin_memory"),
    ({"activation_checkpointing": {"partition_activationz": True}}, "activation_checkpointing.partition_activationz "
                                                                    ".*partition_activations"),
    # nothing close enough to guess: the few keys there, without a guess
    ({"activation_checkpointing": {"verbose": True}}, "^deepspeed.activation_checkpointing.verbose is not a key "
                                                      "DeepSpeed reads \\(it would be ignored\\) \\(valid keys there: "
                                                      "contiguous_memory_optimization, cpu_checkpointing, "),
    ({"fp16": {"enabled": False, "loss_scal": 0}}, "deepspeed.fp16.loss_scal .*deepspeed.fp16.loss_scale"),
    ({"tensorboard": {"enabled": False, "job_nme": "x"}}, "deepspeed.tensorboard.job_nme .*job_name"),
    # a section under its short name (DeepSpeed's alias "tp" for tensor_parallel.tensor_parallel): its own keys
    ({"tensor_parallel": {"tp": {"tp_sizee": 2}}},
     r"^deepspeed\.tensor_parallel\.tp\.tp_sizee is not a key DeepSpeed reads \(it would be ignored\); did you mean "
     r"deepspeed\.tensor_parallel\.tp\.tp_size\? \(valid keys there: mpu, tp_grain_size, tp_group, tp_size\)$"),
    # not a mapping where DeepSpeed reads a section
    ({"bf16": True}, "deepspeed.bf16 must be a mapping"),
    (zero(offload_optimizer="cpu"), "deepspeed.zero_optimization.offload_optimizer must be a mapping"),
    ({"optimizer": "AdamW"}, '^deepspeed.optimizer must be a mapping \\(a JSON object\\), got str "AdamW"$'),
    # strings where DeepSpeed reads numbers or booleans
    (zero(zero_hpz_partition_size="2"), 'zero_hpz_partition_size is the string "2", but DeepSpeed reads a number '
                                        'there: write 2 without quotes'),
    (zero(stage="3"), 'deepspeed.zero_optimization.stage is the string "3"'),
    ({"gradient_clipping": "1.0"}, 'deepspeed.gradient_clipping is the string "1.0", but DeepSpeed reads a number '
                                   'there: write 1.0 without quotes'),
    ({"fp16": {"enabled": "yes"}}, 'deepspeed.fp16.enabled is the string "yes", but DeepSpeed reads a boolean there: '
                                   'write true'),
    ({"activation_checkpointing": {"partition_activations": "false"}}, "write false without quotes"),
    # a string spelling neither: what to write instead
    ({"gradient_clipping": "max"}, '^deepspeed.gradient_clipping is the string "max", but DeepSpeed reads a number '
                                   'there: write a number \\(without quotes\\)$'),
    ({"wall_clock_breakdown": "maybe"}, '^deepspeed.wall_clock_breakdown is the string "maybe", but DeepSpeed reads a '
                                        'boolean there: write true or false \\(without quotes\\)$'),
    # DeepSpeed turns DataStates checkpointing on for anything but false (it reads the key twice, first with a get
    # whose default is False): the string "false" would turn it on
    ({"datastates_ckpt": "false"}, '^deepspeed.datastates_ckpt is the string "false", but DeepSpeed reads a boolean '
                                   'there: write false without quotes$'),
    ({"wall_clock_breakdown": "no"}, 'deepspeed.wall_clock_breakdown is the string "no", but DeepSpeed reads a boolean '
                                     'there: write false without quotes'),
    # DeepSpeed's choices and ranges
    (zero(offload_param={"device": "gpu"}), "deepspeed.zero_optimization.offload_param.device must be 'none', 'cpu' "
                                            "or 'nvme' \\(DeepSpeed's rule\\), got str \"gpu\""),
    (zero(reduce_bucket_size=-5), "deepspeed.zero_optimization.reduce_bucket_size must be greater than 0"),
    (zero(stage3_prefetch_bucket_size=-1), "zero_optimization.stage3_prefetch_bucket_size must be greater than or equal"),
    (zero(offload_optimizer={"device": "cpu", "ratio": 2}), "offload_optimizer.ratio must be less than or equal to 1"),
    (zero(stage=4), "^deepspeed.zero_optimization.stage must be 0, 1, 2 or 3 \\(DeepSpeed's rule\\), got int 4$"),
    # a value of the wrong type: pydantic's "Input should be a valid boolean", a single choice
    (zero(overlap_comm=[1]), "^deepspeed.zero_optimization.overlap_comm must be a valid boolean \\(DeepSpeed's "
                             "rule\\), got list \\[1\\]$"),
    # a message of DeepSpeed's own validator, which names the field itself: the key said once
    ({"fp16": {"enabled": True, "loss_scale": -1}},
     r"^deepspeed\.fp16\.loss_scale must be >= 0 \(0 enables dynamic loss scaling\) "
     r"\(DeepSpeed's rule\), got int -1$"),
    # a validator across several keys of a section: the section is named
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     r"^deepspeed\.zero_optimization: Partial offloading only supported for ZeRO Stage 3\. \(DeepSpeed's rule\): "
     r"fix the values there$"),
    ({"nebula": {"enabled": True}}, "deepspeed.nebula: DeepSpeed refuses it \\(Nebula checkpointing has been removed"),
    # DeepSpeed's own assert across keys: the last key it read, with its value
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     r"^deepspeed\.bf16\.enabled=true: DeepSpeed refuses it \(bfloat16 and fp16 modes cannot be simultaneously "
     r"enabled\): fix it there$"),
    # what DeepSpeed hands to a constructor, against its signature
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betaz": [0.9, 0.9]}}},
     "deepspeed.optimizer.params.betaz is not a parameter of AdamW.*did you mean deepspeed.optimizer.params.betas"),
    ({"optimizer": {"type": "AdamWW", "params": {}}}, "deepspeed.optimizer.type='AdamWW' is neither .*did you mean AdamW"),
    ({"scheduler": {"type": "CosineAnnealingLr", "params": {}}}, "^deepspeed.scheduler.type='CosineAnnealingLr' is "
                                                                "neither DeepSpeed's nor torch's; did you mean "
                                                                "CosineAnnealingLR\\? "),
    ({"optimizer": {"type": "Zzzqq", "params": {}}}, "^deepspeed.optimizer.type='Zzzqq' is neither DeepSpeed's nor "
                                                     "torch's \\(DeepSpeed would fail inside the workers\\)$"),
    ({"optimizer": {"type": "Adagrad", "params": {"lr": 0.01, "lr_decay": 0.1}},
      **zero(offload_optimizer={"device": "cpu"})},
     "^deepspeed.optimizer.params.lr_decay is not a parameter of Adagrad, which DeepSpeed builds as "
     "DeepSpeedCPUAdagrad "),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "fp32_optimizer_states": True}}},
     "^deepspeed.optimizer.params.fp32_optimizer_states is not a parameter of Lion, which DeepSpeed builds as "
     "FusedLion here "),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "set_grad_none": True}},
      **zero(offload_optimizer={"device": "cpu"})},
     "^deepspeed.optimizer.params.set_grad_none is not a parameter of Lion, which DeepSpeed builds as DeepSpeedCPULion "
     "here "),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, "scheduler.params.warmup_num_step .*"
                                                                             "warmup_num_steps"),
    ({"optimizer": {"type": "AdamW", "params": {"fused": False}}}, "deepspeed.optimizer.params.fused is not a parameter "
                                                                   "of AdamW, which DeepSpeed builds as FusedAdam here"),
    ({"optimizer": {"type": "AdamW", "params": {"foreach": True}}}, "params.foreach is not a parameter"),
    # Adam with torch_adam is torch's AdamW (DeepSpeed's adam_w_mode defaults to true); AdamW stays AdamW
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "decoupled_weight_decay": True}}},
     "^deepspeed.optimizer.params.decoupled_weight_decay is not a parameter of Adam, which DeepSpeed builds as AdamW "
     "here "),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "adam_w_mode": False,
                                                "decoupled_weight_decay": True}}},
     "^deepspeed.optimizer.params.decoupled_weight_decay is not a parameter of AdamW "),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}, "zero_optimization": {"stage": 0}},
     "^deepspeed.optimizer.params.momentun is not a parameter of SGD \\(its constructor would refuse it in the "
     "workers\\); did you mean deepspeed.optimizer.params.momentum\\?"),
    ({"optimizer": {"type": "AdamW", "params": {"adamw_mode": True}}, **zero(offload_optimizer={"device": "cpu"})},
     "params.adamw_mode is not a parameter of AdamW, which DeepSpeed builds as DeepSpeedCPUAdam"),  # passed by it
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm is not an optimizer parameter: "
                                                                         "clip with deepspeed.gradient_clipping"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "deepspeed.scheduler.params.total_num_steps is missing: WarmupDecayLR needs it .*or \"auto\""),
    ({"scheduler": {"type": "StepLR", "params": {}}, "zero_optimization": {}},  # raytrain fills no step_size
     "^deepspeed.scheduler.params.step_size is missing: StepLR needs it \\(its constructor would refuse to start in "
     "the workers\\): write a value there$"),
    # ZeRO asserts its optimizer is one it was tested with
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type='SGD' is not an optimizer ZeRO \\(stage 3\\) "
                                                            "supports.*zero_allow_untested_optimizer=true"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}, "optimizer.type='Lamb' is not an optimizer ZeRO"),
    ({"optimizer": {"type": "RMSprop", "params": {}}}, "optimizer.type='RMSprop' is not an optimizer ZeRO"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}},
     "optimizer.type='SGD' is not an optimizer ZeRO \\(stage 1\\) supports"),
    ({"optimizer": {"type": "MuAdam", "params": {}}}, "optimizer.type='MuAdam' is not an optimizer ZeRO"),  # mup's
    # torch's schedulers under DeepSpeed's optimizer wrapper
    ({"scheduler": {"type": "StepLR", "params": {"step_size": 10}}, "zero_optimization": {"stage": 1}},
     "^deepspeed.scheduler.type='StepLR' is torch's, which DeepSpeed builds on its own optimizer wrapper under ZeRO "
     "stage 1 and torch refuses"),
    ({"scheduler": {"type": "StepLR", "params": {"step_size": 10}}, "zero_optimization": {"stage": 0},
      "bf16": {"enabled": True}}, "^deepspeed.scheduler.type='StepLR' is torch's, which DeepSpeed builds on its own "
                                  "optimizer wrapper under bf16/fp16 and torch refuses"),
    # raytrain's own rules
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs stage 3"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "offload_param needs stage 3 \\(stage is 0\\)"),
    (zero(offload_optimizer={"device": "nvme"}), "nvme_path is missing"),
    (zero(offload_param={"device": "nvme"}), "^deepspeed.zero_optimization.offload_param.device is nvme but "
                                             "nvme_path is missing: set zero_optimization.offload_param.nvme_path"),
    (zero(zero_hpz_partition_size=3), "zero_hpz_partition_size=3 does not divide world size 4"),
    # DeepSpeed divides the world size by it: its batch assertion failed in every worker, retried by Ray Train
    ({"sequence_parallel_size": 2}, "^deepspeed.sequence_parallel_size=2: raytrain does not run DeepSpeed's sequence "
                                    "parallelism .* world size 4 / 2 data-parallel ranks"),
    # a (1, 1) mesh for a world of 4 leaves 3 workers out of DeepSpeed's mesh; alone, silently ignored
    ({"sequence_parallel_size": 1, "data_parallel_size": 1}, "^deepspeed.data_parallel_size=1 is not this run's "
                                                             "world size 4: raytrain's data-parallel ranks are its "
                                                             "workers .*: remove data_parallel_size$"),
    ({"data_parallel_size": 8}, "^deepspeed.data_parallel_size=8 is not this run's world size 4"),
    # each worker's own shard under AutoTP: "Data inconsistency within the TP group" in every worker at step 1
    ({"tensor_parallel": {"autotp_size": 2}}, "^deepspeed.tensor_parallel.autotp_size=2: raytrain does not run "
                                              "DeepSpeed's AutoTP"),
    # passed, then every continue (or restart after a worker failure) failed: "latest_universal does not exist"
    ({"checkpoint": {"load_universal": True}}, "^deepspeed.checkpoint.load_universal=true is raytrain's to set"),
    (zero(stage=True), "^deepspeed.zero_optimization.stage is true, but it is a stage number: write 3 "),
    (zero(stage=False), "^deepspeed.zero_optimization.stage is false, but it is a stage number: write 3 "),
    ({"gradient_clipping": -1.0}, "^deepspeed.gradient_clipping=-1.0 is negative, which DeepSpeed reads as no "
                                  "clipping: write the maximum gradient norm"),
    # params reach their constructors as written: torch refuses a beta of 1 ("Invalid beta parameter"), and a
    # boolean is a number to Python ("lr": true trained at 1.0, warmup_num_steps true warmed up over DeepSpeed's
    # minimum of 2 steps, each without a word)
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}},
     r"^deepspeed\.optimizer\.params\.betas\[1\]=1\.0 is outside \[0, 1\): Adam's and Lion's betas are decay rates"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": True}}},
     r"^deepspeed\.optimizer\.params\.lr=true is a boolean, but its constructor reads a number there \(it would take "
     r"true as 1\): write a number$"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [False, 0.95]}}},
     r"^deepspeed\.optimizer\.params\.betas\[0\]=false is a boolean, but its constructor reads a number there"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": True}}},
     r"^deepspeed\.scheduler\.params\.warmup_num_steps=true is a boolean, but its constructor reads a number there"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "3e-4"}}},
     r'^deepspeed\.optimizer\.params\.lr is the string "3e-4", but DeepSpeed reads a number there: write 3e-4 without '
     r'quotes$'),
    ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}},
     r"^deepspeed\.optimizer\.params\.eps=-1e-08 is negative: write a value >= 0$"),
    # two decay rates or nothing: one number (or one rate) failed in every worker (was: passed)
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}},
     r"^deepspeed\.optimizer\.params\.betas=0\.9 must be a list of two decay rates \(for example \[0\.9, 0\.95\]\)$"),
    ({"optimizer": {"type": "Lion", "params": {"betas": [0.9]}}},
     r"^deepspeed\.optimizer\.params\.betas=\[0\.9\] must be a list of two decay rates"),
])
def test_mistakes_are_one_line_naming_the_key(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        check(extra)
    assert "\n" not in str(e.value) and str(e.value).startswith("deepspeed.")


def test_the_batch_is_asserted_with_the_runs_world_size():
    check({}, world_size=4)  # 16 = 2 x 2 x 4
    with pytest.raises(ConfigError, match="deepspeed.*16 != 2 \\* 2 \\* 2"):
        check({}, world_size=2)


def test_a_micro_batch_beyond_int32_tokens_is_refused():
    big = {"train_batch_size": 4 * 10**12, "train_micro_batch_size_per_gpu": 10**12, "gradient_accumulation_steps": 1}
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=1000000000000 x data.seq_len=128 .*lower"):
        check(big, world_size=4)
    check({"train_batch_size": 4 * 2**24, "train_micro_batch_size_per_gpu": 2**24, "gradient_accumulation_steps": 1},
          world_size=4, seq_len=64)  # 2^30 tokens: allowed


@pytest.mark.parametrize("micro, seq_len, allowed", [
    (1, 2**31 - 1, True),  # exactly int32's largest index
    (2, 2**30 - 1, True),
    (2, 2**30, False),
    (2**30, 2, False),
])
def test_the_micro_batchs_token_count_is_bounded_at_int32(micro, seq_len, allowed):
    batch = {"train_batch_size": 4 * micro, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1}
    if allowed:
        check(batch, world_size=4, seq_len=seq_len)
        return
    with pytest.raises(ConfigError, match=f"^deepspeed.train_micro_batch_size_per_gpu={micro} x data.seq_len={seq_len} "
                                          f"= 2,147,483,648 tokens per micro-batch, more than 2,147,483,647 "):
        check(batch, world_size=4, seq_len=seq_len)


@pytest.mark.parametrize("hpz, world_size, allowed", [(2, 4, True), (1, 3, True), (2, 3, False), (4, 2, False)])
def test_the_hpz_partition_must_divide_the_world_size(hpz, world_size, allowed):
    extra = {"train_batch_size": 4 * world_size, **zero(zero_hpz_partition_size=hpz)}
    if allowed:
        check(extra, world_size=world_size)
        return
    with pytest.raises(ConfigError, match=f"^deepspeed.zero_optimization.zero_hpz_partition_size={hpz} does not divide "
                                          f"world size {world_size}: "):
        check(extra, world_size=world_size)


def test_a_quoted_number_is_named_where_deepspeed_wants_the_number():
    """A numeric-looking string where DeepSpeed wants a string (a job name) stays; the quoted number after it is
    the one refused."""
    ds = {**BATCH, "tensorboard": {"enabled": False, "job_name": "2024"},
          "zero_optimization": {"stage": 3, "zero_hpz_partition_size": "2"}}
    with pytest.raises(ConfigError) as e:
        check_deepspeed(ds, world_size=4, seq_len=128, use_gpu=True)
    assert str(e.value) == ('deepspeed.zero_optimization.zero_hpz_partition_size is the string "2", but DeepSpeed '
                            'reads a number there: write 2 without quotes')


# ---------------------------------------------------------------------------------------------
# DeepSpeed's old offload spellings: DeepSpeed still honours them, raytrain's planner, its memory
# facts and its optimizer choice read offload_optimizer / offload_param only.

Z = "deepspeed.zero_optimization"


@pytest.mark.parametrize("key, message", [
    ("cpu_offload", f'{Z}.cpu_offload is DeepSpeed\'s old spelling, which raytrain does not read (its plan and '
                    f'optimizer would assume no offload): write "offload_optimizer": {{"device": "cpu"}} in '
                    f'zero_optimization instead, or remove it for no offload'),
    ("cpu_offload_param", f'{Z}.cpu_offload_param is DeepSpeed\'s old spelling, which raytrain does not read (its plan '
                          f'and optimizer would assume no offload): write "offload_param": {{"device": "cpu"}} in '
                          f'zero_optimization instead, or remove it for no offload'),
    ("cpu_offload_use_pin_memory", f'{Z}.cpu_offload_use_pin_memory is DeepSpeed\'s old spelling, which neither '
                                   f'DeepSpeed nor raytrain reads: write "pin_memory": true inside offload_optimizer '
                                   f'(and offload_param) instead, or remove it (pinned is the default)'),
])
def test_deepspeeds_old_offload_spellings_are_refused_naming_the_new_one(key, message):
    for stage, value in ((3, True), (2, True), (3, False)):
        with pytest.raises(ConfigError) as e:
            check({"zero_optimization": {"stage": stage, key: value}})
        assert str(e.value) == message


def test_what_deepspeed_logs_while_it_parses_goes_to_stderr(capsys):
    """A deprecated key DeepSpeed still maps (and raytrain need not read) passes with DeepSpeed's warning,
    which its logger writes to stdout: under --dry-run, into the JSON."""
    compat.import_deepspeed_quietly()
    handler = next(h for h in logging.getLogger("DeepSpeed").handlers if type(h) is logging.StreamHandler)
    # the command line's: the process's stdout (not setStream: it would flush a capture closed since the import)
    before, handler.stream = handler.stream, sys.stdout
    try:
        check(zero(stage3_gather_fp16_weights_on_model_save=True))
    finally:
        handler.stream = before
    out, err = capsys.readouterr()
    assert out == ""
    assert "Config parameter stage3_gather_fp16_weights_on_model_save is deprecated" in err


# ---------------------------------------------------------------------------------------------
# steps_per_print: DeepSpeed prints when (step + 1) % steps_per_print == 0, after every step.


@pytest.mark.parametrize("value", [1, 10, 1e9, None])  # 1e9 is a float in JSON; null: DeepSpeed never prints
def test_steps_per_print_positive_or_null_passes(value):
    check({"steps_per_print": value})


@pytest.mark.parametrize("value, shown", [(0, "0"), (-5, "-5"), (False, "false"), (2.5, "2.5"), ("auto", '"auto"')])
def test_steps_per_print_that_is_not_a_positive_integer_is_refused(value, shown):
    with pytest.raises(ConfigError) as e:
        check({"steps_per_print": value})
    assert str(e.value) == (f"deepspeed.steps_per_print={shown} must be a positive integer (DeepSpeed takes each "
                            f"step's number modulo it, and 0 is a ZeroDivisionError in every worker at step 1): write "
                            f"a number of steps >= 1, or leave it out (raytrain's default, 1000000000, keeps "
                            f"DeepSpeed's own progress line quiet)")


def test_steps_per_print_as_a_string_is_refused_as_one():
    with pytest.raises(ConfigError) as e:
        check({"steps_per_print": "10"})
    assert str(e.value) == ('deepspeed.steps_per_print is the string "10", but DeepSpeed reads a number there: '
                            'write 10 without quotes')


# ---------------------------------------------------------------------------------------------
# ZeRO++ quantization: DeepSpeed's CPU accelerator has no quantizer kernels.


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients",
                                 "zero_quantized_nontrainable_weights"])
def test_zero_quantization_on_a_cpu_run_is_refused(key):
    check(zero(**{key: True}), use_gpu=True)  # the GPU workers have the kernels
    check(zero(**{key: False}), use_gpu=False)
    with pytest.raises(ConfigError) as e:
        check(zero(**{key: True}), use_gpu=False)
    assert str(e.value) == (f"{Z}.{key}=true needs GPUs (DeepSpeed has no CPU kernels for ZeRO++'s quantization: "
                            f"\"This op had not been implemented on CPU backend\" in every worker), and this run is on "
                            f"CPU (scaling.use_gpu=false): set it to false, or run on GPUs with scaling.use_gpu=true")


def test_the_hybrid_engine_on_a_cpu_run_is_refused():
    # was: every worker failed in deepspeed.initialize ("This op had not been implemented on CPU backend"), retried
    check({"hybrid_engine": {"enabled": True}}, use_gpu=True)  # left to DeepSpeed on GPUs
    check({"hybrid_engine": {"enabled": False}}, use_gpu=False)
    with pytest.raises(ConfigError, match=r"^deepspeed.hybrid_engine.enabled=true needs GPUs \(DeepSpeed's hybrid "
                                          r"engine swaps in its inference kernels, which have no CPU build: .*\), and "
                                          r"this run is on CPU \(scaling.use_gpu=false\): set it to false"):
        check({"hybrid_engine": {"enabled": True}}, use_gpu=False)


# ---------------------------------------------------------------------------------------------
# DeepSpeed's two names for one ZeRO setting (a field and its stage3_ alias) given together.


@pytest.mark.parametrize("field, alias, value", [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 1000),
    ("max_live_parameters", "stage3_max_live_parameters", 1000),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
])
def test_one_setting_under_both_of_its_names_is_refused_naming_both(field, alias, value):
    shown = json.dumps(value)
    expected = (f"{Z}.{alias}={shown} and {Z}.{field}={shown} are one setting under two names (DeepSpeed reads "
                f"either): keep one")
    for order in ((alias, field), (field, alias)):
        for others in ({"stage": 3}, {}):  # (the section holding the two names alone too)
            with pytest.raises(ConfigError) as e:
                check({"zero_optimization": {**others, **{k: value for k in order}}})
            assert str(e.value) == expected
    check(zero(**{field: value}))  # either name alone: DeepSpeed reads both
