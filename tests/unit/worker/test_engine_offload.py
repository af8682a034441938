"""raytrain's worker engine with partial optimizer offload and bf16 optimizer states, on real DeepSpeed
ZeRO-3 (gloo, CPU accelerator, world size 1): DeepSpeed's CPU Adam built with fp32_optimizer_states=False,
states in bf16, the GPU side's AdamW following the LR schedule (raytrain.compat's workaround), and the
sub-groups and their split exactly as raytrain.planning.zero_layout computes them.

Each variant runs in its own process (DeepSpeed keeps process-wide state). The first run builds
DeepSpeed's CPU Adam op (~1 min, cached in TORCH_EXTENSIONS_DIR afterwards).
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from raytrain.config import load_config
from raytrain.model import load_model_config, param_stats
from raytrain.planning import zero_layout

CHILD = pathlib.Path(__file__).with_name("offload_child.py")
REPO = pathlib.Path(__file__).resolve().parents[3]
TINY = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data.seq_len=32",
        "training.micro_batch_size_per_gpu=2", "training.gradient_accumulation_steps=2", "training.max_steps=4",
        "training.warmup_steps=10", "training.learning_rate=0.05", "training.precision=bf16",
        "scaling.num_workers=1", "scaling.use_gpu=false"]
BF16_STATES = ["deepspeed.bf16.bf16_master_weights_and_grads=true", "deepspeed.bf16.bf16_optimizer_states=true"]
SUB_GROUP_SIZE = 20_000
PARTIAL = TINY + BF16_STATES + [
    'deepspeed.zero_optimization.offload_optimizer={"device": "cpu", "pin_memory": true, "ratio": 0.5}',
    f"deepspeed.zero_optimization.sub_group_size={SUB_GROUP_SIZE}"]


# fp16 from a loss scale of 2^24 with the whole optimizer on the host (the seed JSON's precision and
# offload): the first steps overflow and are skipped, then the scale grows back after 2 good steps.
# A GPU run's resolution (fp16 needs one), executed on this CPU where DeepSpeed's CPU accelerator has fp16
# (oneDNN with AVX512-FP16 or AMX; elsewhere it skips). 24 steps: near the scale where the gradients
# overflow (2^18-2^19 on a Sapphire Rapids core) steps still overflow now and then; 8 did not always hold
# two good steps in a row.
FP16_OFFLOAD = [o for o in TINY if not o.startswith(("training.precision", "scaling.use_gpu"))] + [
    "training.precision=fp16", "scaling.use_gpu=true", "deepspeed.bf16.enabled=false", "training.max_steps=24",
    'deepspeed.fp16={"enabled": "auto", "loss_scale": 0, "initial_scale_power": 24, "loss_scale_window": 2, '
    '"hysteresis": 1, "min_loss_scale": 1}',
    'deepspeed.zero_optimization.offload_optimizer={"device": "cpu", "pin_memory": true}']


def run_child(tmp_path, name, overrides, *flags):
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, str(CHILD), str(out), *flags, *overrides], cwd=REPO, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    return run_child(tmp_path_factory.mktemp("offload"), "partial", PARTIAL)


def test_bf16_states_use_cpu_adam_without_fp32_states_and_stay_bf16(partial):
    assert partial["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert partial["cpu_optimizer"] == "DeepSpeedCPUAdam"
    assert partial["fp32_optimizer_states"] is False  # else deepspeed.initialize asserts (base_optimizer.py)
    assert partial["master_dtype"] == "torch.bfloat16"
    stepped = [s for s in partial["states"] if s["moments"]]
    assert stepped and all(s["moments"] == ["torch.bfloat16"] and s["master"] == "torch.bfloat16" for s in stepped)
    losses = partial["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_sub_groups_are_the_planners(partial):
    cfg = load_config(None, PARTIAL)
    stats = param_stats(load_model_config(cfg.model))
    groups = zero_layout.param_groups(stats.param_numels, stats.param_ndims, raytrain_optimizer=True)
    expected = zero_layout.sub_groups(groups, world_size=1, sub_group_size=SUB_GROUP_SIZE)
    assert partial["sub_group_numels"] == expected and len(expected) > 3 and sum(expected) == stats.num_params
    # DeepSpeed maps every sub-group (on the CPU accelerator its "GPU" is named cpu too, so the split
    # itself is checked against DeepSpeed's expression in test_zero_layout.py)
    assert sorted(map(int, partial["subgroup_to_device"])) == list(range(len(expected)))


def test_the_gpu_side_optimizer_follows_the_lr_schedule(partial):
    assert partial["has_backup_optimizer"] is True  # ratio < 1 builds DeepSpeed's GPU-side AdamW
    assert partial["backup_groups_are_the_cpu_groups"] == [True, True]  # group 0 was a copy (the bug)
    assert partial["backup_lrs"] == partial["cpu_lrs"]
    lrs = [step[0] for step in partial["cpu_lrs"]]
    assert lrs == sorted(lrs) and lrs[-1] > lrs[0]  # warmup: the LR moved, and group 0 on the GPU side with it
    # a resume replaces the CPU optimizer's group dicts (torch's load_state_dict): shared again after it
    assert partial["shared_after_load"] == [False, False] and partial["shared_after_reattach"] == [True, True]


def test_bf16_states_without_offload_run_with_torch_adamw(tmp_path):
    """DeepSpeed 0.19.8 accepts bf16 master weights and states without offload (its offload validator
    is not called then): raytrain's torch AdamW steps bf16 masters, the moments come out bf16."""
    r = run_child(tmp_path, "gpu_side", TINY + BF16_STATES)
    assert r["cpu_optimizer"] == "AdamW" and r["master_dtype"] == "torch.bfloat16" and not r["has_backup_optimizer"]
    assert all(s["moments"] == ["torch.bfloat16"] for s in r["states"] if s["moments"])
    assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_fp16_with_offload_skips_the_same_steps_without_deepspeeds_host_scan(tmp_path):
    """raytrain.compat.skip_host_overflow_scan: with fp16 and the optimizer on the host, DeepSpeed's inf/nan
    scan of the host gradient buffer is dropped (0.98 s a step at 1.1B on an H200's host) and the
    gradient-norm check of the same step() finds the overflows instead: the same steps skipped, the same
    loss scales, the same losses as with DeepSpeed's scan put back, bit for bit."""
    dropped = run_child(tmp_path, "fp16_offload", FP16_OFFLOAD)
    kept = run_child(tmp_path, "fp16_offload_scan", FP16_OFFLOAD, "--deepspeed-overflow-scan")
    assert dropped["cpu_optimizer"] == "DeepSpeedCPUAdam" and dropped["host_overflow_scan_dropped"] is True
    scales = dropped["loss_scales"]
    assert scales[0] == 2 ** 23 and dropped["skipped_steps"] >= 1, scales  # step 1 overflowed: skipped, halved
    assert any(b > a for a, b in zip(scales, scales[1:])), scales  # then good steps: it grows again
    assert all(math.isfinite(x) for x in dropped["losses"]) and dropped["losses"][-1] < dropped["losses"][0]
    assert (dropped["loss_scales"], dropped["skipped_steps"], dropped["losses"]) == \
        (kept["loss_scales"], kept["skipped_steps"], kept["losses"])


def test_bf16_keeps_deepspeeds_overflow_path(partial):
    assert partial["host_overflow_scan_dropped"] is False  # bf16 has no loss scale and no scan to drop
