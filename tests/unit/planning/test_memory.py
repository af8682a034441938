"""raytrain.planning.memory / estimate / activations: hand-computed model-state and activation bytes, fit
refusals, the command line."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from raytrain.config import ConfigError, load_config
from raytrain.hardware import Target
from raytrain.model import load_model_config, param_stats
from raytrain.planning.activations import activation_bytes, decoder_dims, moe_dims
from raytrain.planning.memory import (GIB, check_fits, estimate_memory, fits, gib, have_text, need_text, verdict,
                                      workers_per_node)
from raytrain.planning.table import format_plan
from raytrain.planning.resolve import resolve_run
from raytrain.run_spec import ClusterShape

LLAMA2_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
ZERO3 = {"stage": 3, "reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 10_000_000,
         "stage3_param_persistence_threshold": 40960}


@pytest.fixture(scope="module")
def llama7b_stats():
    return param_stats(load_model_config(load_config(None, [f"model.config={json.dumps(LLAMA2_7B)}"]).model))


def plan_7b(stats, *, world=8, zero=None, overrides=(), gpu_gib=None, host_gib=None, use_gpu=True, batch=None):
    """`batch`: the DeepSpeed JSON's batch keys instead of "auto" micro-batch and accumulation, with
    training.micro_batch_size_per_gpu=1."""
    ds = {**(batch or {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}),
          "bf16": {"enabled": True}, "zero_optimization": {**ZERO3, **(zero or {})}}
    micro = [] if batch else ["training.micro_batch_size_per_gpu=1"]
    cfg = load_config(None, [f"model.config={json.dumps(LLAMA2_7B)}", f"deepspeed={json.dumps(ds)}",
                             "data.seq_len=2048", *micro, *overrides])
    resolved = resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=use_gpu, gpus_per_node=min(world, 8)))
    return estimate_memory(resolved, Target(gpu_gib and int(gpu_gib * GIB), host_gib and int(host_gib * GIB)),
                           stats=stats, written=cfg)


def test_param_stats_count_llama2_7b(llama7b_stats):
    assert llama7b_stats.num_params == 6_738_415_616  # Llama-2-7B
    assert llama7b_stats.largest_layer_params == 32000 * 4096  # embed_tokens / lm_head (untied)


def test_7b_on_8_gpus_model_states_by_hand(llama7b_stats):
    plan = plan_7b(llama7b_stats)
    n = 6_738_415_616 // 8  # divides exactly: 842,301,952 parameters per rank
    persistent = 2 * (2 * 32 + 1) * 4096  # bf16 RMSNorm weights (65 of 4096 <= threshold 40960), kept whole
    bucket = 2 * 50_000_000  # bf16 reduce bucket
    # no offload: bf16 params 2 + bf16 grads 2 + fp32 master 4 + Adam m, v 8 = 16 bytes per parameter on the GPU
    assert plan.model_states["none"] == (16 * n + persistent + bucket, 0)
    assert plan.model_states["none"][0] / GIB == pytest.approx(12.65, abs=0.01)
    # optimizer offload: bf16 params stay; in host RAM bf16 grads 2 (pinned: 1.68 GB -> a 2 GiB block) + master 4
    # + Adam 8 + fp32 grads 4, pinned per sub-group: the decayed weights' 842.3M (3.37 GB -> 4 GiB) and the
    # norms' 33,280 (133 KB -> 256 KiB). DeepSpeed pins by default (pin_memory absent = true).
    assert plan.model_states["optimizer"] == (2 * n + persistent + bucket, 2**31 + 12 * n + 2**32 + 2**18)
    # parameters too: only the persistent ones stay on the GPU; the rest are pinned on the host
    resident, host = plan.model_states["param+optimizer"]
    assert resident == persistent + bucket and host > plan.model_states["optimizer"][1] + 2 * n
    by_option = {(o.offload, o.gradient_checkpointing): o for o in plan.options}
    none = by_option[("none", False)]
    items = dict(none.breakdown)
    assert items["gathered layer + prefetch"] == 2 * (32000 * 4096 + 10_000_000)
    assert items["full gradients of a layer"] == 2 * 32000 * 4096
    sub_group = n - (2 * 32 + 1) * 4096 // 8  # the decayed weights' sub-group (< sub_group_size 1e9)
    assert items["step: gradients of one sub-group, master dtype"] == 4 * sub_group
    assert items["step: flatten / Adam temporaries"] == 2 * sub_group  # the bf16 flatten before the cast
    assert none.worker_bytes == 16 * n + persistent + bucket + max(
        items["gathered layer + prefetch"] + items["full gradients of a layer"] + plan.activations[False],
        6 * sub_group)
    assert by_option[("optimizer", False)].host_bytes_per_node == 8 * (plan.model_states["optimizer"][1] + 4 * GIB)


def test_7b_agrees_with_deepspeeds_own_estimator(llama7b_stats):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    # DeepSpeed's shortcut for no offload: 18 bytes/param + 4 x largest layer per GPU. Ours is itemised
    # (16 bytes/param + DeepSpeed's default buckets + the gathered layer) and must land near it.
    plan = plan_7b(llama7b_stats, zero={"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000})
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        llama7b_stats.num_params, llama7b_stats.largest_layer_params, num_gpus_per_node=8,
        cpu_offload=False, cpu_offload_params=False)
    ours = plan.configured.worker_bytes - plan.activations[False]
    assert ours == pytest.approx(ds_gpu, rel=0.1)


def test_activation_formula_by_hand():
    cfg = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, vocab_size=100)
    # per token and layer in bf16: norms 2 x (4*64 + 2*64 + 2*64) = 1024; attention 2*(64 + 2*32) + 2*2*64 + 4*4
    # = 528; MLP 4*2*128 = 1024 -> 2576. Model: 2 layers + final norm 512 + logits 12*100 = 6864; 2 x 16 tokens.
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=False) == 32 * 6864
    # checkpointing: each layer keeps its input (2*64) and one layer is recomputed: 2*128 + 2576 + 512 + 1200
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=True) == 32 * 4544
    # eager attention adds the fp32 probabilities and their bf16 cast: heads x seq_len x (4 + 2) per token and layer
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=False, attn_implementation="eager") == 32 * (
        6864 + 2 * 4 * 16 * 6)
    # Liger: no logits; RMSNorm keeps its input and output (2*2*64), the MLP gate, up, product (3*2*128)
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=False, liger_kernel="loss") == 32 * (6864 - 1200)
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=False, liger_kernel="all") == 32 * (
        2 * (2 * 256 + 528 + 768) + 256)
    # GPU SDPA: o_proj reads a view of the attention output, one copy fewer (2 bytes x 64 per token and layer)
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=False, sdpa_out_copies=1) == 32 * (6864 - 2 * 2 * 64)
    # FP8 GEMMs keep 1-byte inputs: both norms' outputs and down_proj's input shrink by e - 1 bytes a value, o_proj
    # adds a 1-byte copy of SDPA's output: (2 - 1) * (2*64 + 128) - 64 = 192 less a layer
    assert activation_bytes(cfg, 2, 16, 2, checkpointing=False, fp8=True) == 32 * (6864 - 2 * 192)
    # in fp32 eager attention keeps the fp32 probabilities alone (no cast): heads x seq_len x 4 a token and layer
    assert (activation_bytes(cfg, 2, 16, 4, checkpointing=False, attn_implementation="eager")
            - activation_bytes(cfg, 2, 16, 4, checkpointing=False)) == 32 * 2 * 4 * 16 * 4


def test_moe_and_gpt2_activation_formulas_by_hand():
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    moe = SimpleNamespace(**base, num_key_value_heads=2, head_dim=16, intermediate_size=128, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                          decoder_sparse_step=2)
    # layer 1 is sparse: 2 experts x (2*(2*64 + 4*32) + 40 index bytes) + the router's fp32 softmax 4*4 = 1120; the
    # gated shared expert 4*2*64 + (2*64 + 2) = 642; in place of the dense MLP's 1024: 2576 - 1024 + 1762 = 3314
    assert activation_bytes(moe, 2, 16, 2, checkpointing=False) == 32 * (2576 + 3314 + 512 + 1200)
    # checkpointing recomputes the larger (sparse) layer
    assert activation_bytes(moe, 2, 16, 2, checkpointing=True) == 32 * (2 * 128 + 3314 + 512 + 1200)
    # one small expert a token, no shared one: 2*(2*64 + 4*8) + 40 + 16 = 376, a sparse layer of 1928 < 2576
    small = SimpleNamespace(**{**vars(moe), "num_experts_per_tok": 1, "moe_intermediate_size": 8,
                               "shared_expert_intermediate_size": None})
    assert activation_bytes(small, 2, 16, 2, checkpointing=True) == 32 * (2 * 128 + 2576 + 512 + 1200)
    every_layer = SimpleNamespace(**{**vars(small), "decoder_sparse_step": 1})
    assert activation_bytes(every_layer, 2, 16, 2, checkpointing=True) == 32 * (2 * 128 + 1928 + 512 + 1200)
    # Qwen3's per-head q and k norms keep (4 + e)(q + kv) a token and layer
    qwen3 = SimpleNamespace(**{**vars(moe), "model_type": "qwen3", "num_experts": None})
    assert activation_bytes(qwen3, 2, 16, 2, checkpointing=False) == 32 * (6864 + 2 * 6 * (64 + 32))
    # GPT-2: LayerNorms keep input, output and the fp32 mean and rstd (2*2*64 + 8 = 264 each), q, k, v are 64 wide
    # (2*192 + 2*2*64 + 4*4 = 656) and gelu_new keeps 4 values of the 4h MLP besides c_proj's input (5*2*256)
    gpt2 = SimpleNamespace(**base, model_type="gpt2", activation_function="gelu_new")
    assert activation_bytes(gpt2, 2, 16, 2, checkpointing=False) == 32 * (2 * (2 * 264 + 656 + 2560) + 264 + 1200)
    # attn_pdrop in fp32 on a CPU: SDPA's math path keeps fp32 q, k, v (3*4*64) and three score matrices
    # (3*4*4*16), o_proj's input (4*64) and, v being a view, the whole fused output less the 4*q counted:
    # 4*192 - 4*64; the LayerNorms 2*4*64 + 8 = 520, the MLP 5*4*256
    cpu = SimpleNamespace(**vars(gpt2), attn_pdrop=0.1)
    attention = 3 * 4 * 64 + 3 * 4 * 4 * 16 + 4 * 64 + (4 * 192 - 4 * 64)
    assert activation_bytes(cpu, 2, 16, 4, checkpointing=False, on_gpu=False) == 32 * (
        2 * (2 * 520 + attention + 5 * 4 * 256) + 520 + 1200)


def test_config_defaults_where_a_family_leaves_a_width_out():
    """No head count: 64-wide heads, at least one; no head_dim: hidden / heads; no MLP width: 4 x hidden; no
    key/value heads: as many as query heads."""
    assert decoder_dims(SimpleNamespace(hidden_size=256, num_hidden_layers=2)) == (256, 2, 4, 256, 256, 1024)
    assert decoder_dims(SimpleNamespace(hidden_size=32, num_hidden_layers=1)) == (32, 1, 1, 32, 32, 128)
    assert decoder_dims(SimpleNamespace(hidden_size=126, num_hidden_layers=1)).heads == 1
    # a mixture of experts without intermediate_size: each expert is 4 x hidden wide
    assert moe_dims(SimpleNamespace(hidden_size=64, num_hidden_layers=4, num_local_experts=8)) == (
        8, 1, 256, 0, False, 4)
    assert moe_dims(SimpleNamespace(hidden_size=64, num_hidden_layers=4, num_local_experts=1)) is None  # one: dense
    assert moe_dims(SimpleNamespace(hidden_size=64, num_hidden_layers=4, num_local_experts=2)).experts == 2
    # Qwen's decoder_sparse_step: layers 3 and 6 of 6 are sparse, and mlp_only_layers makes the first (index 2) dense
    qwen = SimpleNamespace(hidden_size=64, num_hidden_layers=6, num_experts=4, decoder_sparse_step=3,
                           mlp_only_layers=[2])
    assert moe_dims(qwen).sparse_layers == 1
    # DeepSeek's spelling: n_shared_experts of the routed experts' width, dense below first_k_dense_replace
    deepseek = SimpleNamespace(hidden_size=64, num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1)
    assert moe_dims(deepseek) == (8, 2, 32, 64, False, 3)


def test_refusal_names_optimizer_offload_when_that_fits(llama7b_stats):
    # 7B on one 80 GB GPU: ~100 GiB of model states; offloading the optimizer leaves ~13 GiB of bf16 params.
    plan = plan_7b(llama7b_stats, world=1, overrides=["model.gradient_checkpointing=true"], gpu_gib=80, host_gib=256)
    with pytest.raises(ConfigError) as e:
        check_fits(plan)
    msg = str(e.value)
    assert "zero_optimization.offload_optimizer.device=cpu" in msg and "offload_param" not in msg
    # the checkpointing the run has is kept: the need named is the offload's with it (14.7 GiB), not without (25.3)
    with_ckpt = next(o for o in plan.options if o.offload == "optimizer" and o.gradient_checkpointing)
    assert f"offload_optimizer.device=cpu: {need_text(True, 1, with_ckpt)} (python" in msg
    assert "GiB per GPU" in msg and "host RAM per node" in msg and "\n" not in msg
    assert msg.startswith("this run needs ")


def test_refusal_prefers_checkpointing_when_activations_are_the_problem(llama7b_stats):
    plan = plan_7b(llama7b_stats, overrides=["training.micro_batch_size_per_gpu=8"], gpu_gib=80, host_gib=512)
    with pytest.raises(ConfigError, match=r"with model\.gradient_checkpointing=true: \d+\.\d GiB per GPU"):
        check_fits(plan)


@pytest.mark.parametrize("overrides, batch, lever", [
    (["training.micro_batch_size_per_gpu=64"], None, "lower training.micro_batch_size_per_gpu=64"),
    ([], {"train_micro_batch_size_per_gpu": 64}, "lower deepspeed.train_micro_batch_size_per_gpu=64"),
    # derived from the batch: 512 / (1 x 8 workers); a smaller micro-batch is more accumulation
    ([], {"train_batch_size": 512, "gradient_accumulation_steps": 1},
     "raise deepspeed.gradient_accumulation_steps (the micro-batch is deepspeed.train_batch_size=512 / "
     "(accumulation x 8 workers)) or lower deepspeed.train_batch_size"),
    (["training.gradient_accumulation_steps=1"], {"train_batch_size": 512},
     "raise training.gradient_accumulation_steps (the micro-batch is"),
])
def test_refusal_when_nothing_fits_names_the_micro_batch_by_the_key_the_user_set_it_with(
        llama7b_stats, overrides, batch, lever):
    # It said "lower deepspeed.train_micro_batch_size_per_gpu=64" whatever set it: written beside
    # training.micro_batch_size_per_gpu=64 as told, that is refused ("contradicts ... set it in one place").
    plan = plan_7b(llama7b_stats, overrides=overrides, batch=batch, gpu_gib=80, host_gib=512)
    assert plan.micro_batch_per_gpu == 64
    with pytest.raises(ConfigError) as e:
        check_fits(plan)
    assert re.search(r"no offload or checkpointing setting makes it fit: activations take \d+\.\d GiB of it at "
                     r"micro-batch 64, linear in the micro-batch: " + re.escape(lever), str(e.value)), str(e.value)
    assert str(e.value).endswith(", or lower data.seq_len, or add GPUs with scaling.num_workers (model states shrink "
                                 "with the world size)"), str(e.value)


def test_a_run_that_fits_or_an_unknown_target_passes(llama7b_stats):
    plan = plan_7b(llama7b_stats, gpu_gib=141, host_gib=2000)
    check_fits(plan)
    check_fits(plan_7b(llama7b_stats, world=1))  # nothing known: nothing refused


def test_pinned_offload_buffers_round_up_to_powers_of_two(llama7b_stats):
    plan = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "cpu", "pin_memory": True}})
    items = dict(plan.configured.breakdown)
    n = 6_738_415_616 // 8
    # 1.68 GB of bf16 gradients in a 2 GiB pinned block
    assert items["gradient accumulation buffer, all parameters (pinned)"] == 2**31 > 2 * n
    # one sub-group per param group (each < sub_group_size 1e9): the weights' 3.37 GB and the norms' 133 KB
    assert items["gradient buffers, CPU sub-groups (pinned each)"] == 2**32 + 2**18
    assert plan.configured.offload == "optimizer"
    unpinned = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "cpu", "pin_memory": False}})
    assert dict(unpinned.configured.breakdown)["gradient accumulation buffer, all parameters (pinned)"] == 2 * n


def test_hpz_adds_a_secondary_parameter_copy(llama7b_stats):
    plan = plan_7b(llama7b_stats, world=32, zero={"zero_hpz_partition_size": 8})
    assert dict(plan.configured.breakdown)["hpZ secondary parameter copy"] == 2 * 6_738_415_616 // 8


def test_cpu_runs_plan_against_host_ram():
    cfg = load_config(None)
    resolved = resolve_run(cfg, ClusterShape(num_workers=2, use_gpu=False))
    plan = estimate_memory(resolved, Target(host_memory_bytes=8 * GIB))
    assert plan.precision == "fp32" and plan.workers_per_node == 2
    # live tensors + glibc's heap retention (measured, docs/plan-accuracy.md) + 1 GiB of process per worker
    assert plan.configured.host_bytes_per_node == 2 * (int(plan.configured.worker_bytes * 1.3) + 1 * GIB)
    check_fits(plan)
    with pytest.raises(ConfigError, match=r"host RAM per node \(2 workers x"):
        check_fits(estimate_memory(resolved, Target(host_memory_bytes=GIB)))
    assert "no offload" in format_plan(plan) and "offload optimizer" not in format_plan(plan)


def test_options_are_the_offloads_deepspeed_makes_at_each_stage_and_the_configured_one(llama7b_stats):
    def rows(plan):
        return [(o.offload, o.gradient_checkpointing) for o in plan.options]

    each = [False, True]  # every offload without, then with gradient checkpointing
    assert rows(plan_7b(llama7b_stats, zero={"stage": 0})) == [("none", c) for c in each]
    # optimizer offload from stage 1, parameter offload only at stage 3
    assert rows(plan_7b(llama7b_stats, zero={"stage": 1})) == [(o, c) for o in ("none", "optimizer") for c in each]
    assert rows(plan_7b(llama7b_stats)) == [(o, c) for o in ("none", "optimizer", "param+optimizer") for c in each]
    # an optimizer offload written at stage 0 still gets its row (the configured one); DeepSpeed ignores it there
    # (no ZeRO optimizer), so the row needs what no offload needs
    plan = plan_7b(llama7b_stats, zero={"stage": 0, "offload_optimizer": {"device": "cpu"}})
    assert rows(plan) == [(o, c) for o in ("none", "optimizer") for c in each]
    assert plan.configured.offload == "optimizer" and not plan.configured.gradient_checkpointing
    assert plan.configured.worker_bytes == plan.options[0].worker_bytes


def test_option_settings_are_the_overrides_that_select_it(llama7b_stats):
    opt, param = "deepspeed.zero_optimization.offload_optimizer.", "deepspeed.zero_optimization.offload_param."
    by_option = {(o.offload, o.gradient_checkpointing): o.settings for o in plan_7b(
        llama7b_stats, zero={"offload_optimizer": {"device": "cpu", "ratio": 0.25}}).options}
    assert by_option["none", False] == [] and by_option["none", True] == ["model.gradient_checkpointing=true"]
    # the configured ratio goes with every optimizer offload; parameter offload after it
    assert by_option["optimizer", False] == [f"{opt}device=cpu", f"{opt}ratio=0.25"]
    assert by_option["param+optimizer", True] == [f"{opt}device=cpu", f"{opt}ratio=0.25", f"{param}device=cpu",
                                                  "model.gradient_checkpointing=true"]
    # ratio 1.0 (DeepSpeed's default: the whole optimizer) is not written
    whole = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "cpu", "ratio": 1.0}}).configured
    assert whole.settings == [f"{opt}device=cpu"]


def test_workers_per_node_are_the_targets_else_the_clusters_else_assumed():
    def per_node(target, **cluster):
        return workers_per_node(target, ClusterShape(**cluster))

    # the target's node size wins over the cluster's, and a node holds at most the world
    assert per_node(Target(gpus_per_node=4), num_workers=16, use_gpu=True, gpus_per_node=8) == (4, False)
    assert per_node(Target(), num_workers=16, use_gpu=True, gpus_per_node=2) == (2, False)
    assert per_node(Target(gpus_per_node=8), num_workers=2, use_gpu=True) == (2, False)
    # unknown: full nodes of 8 GPUs, or every CPU worker on one node
    assert per_node(Target(), num_workers=16, use_gpu=True) == (8, True)
    assert per_node(Target(), num_workers=3, use_gpu=True) == (3, True)
    assert per_node(Target(), num_workers=12, use_gpu=False) == (12, True)


def test_num_nodes_rounds_up(llama7b_stats):
    plan = plan_7b(llama7b_stats, world=12)  # 8 GPUs a node: one full node and one of 4
    assert (plan.workers_per_node, plan.num_nodes) == (8, 2)


def test_fits_at_exactly_the_usable_memory_and_not_a_byte_more(llama7b_stats):
    # 10 GiB less the 10% reserve: 9 GiB usable, of the GPU and of the node
    option = replace(plan_7b(llama7b_stats).configured, worker_bytes=9 * GIB, host_bytes_per_node=9 * GIB)
    assert fits(option, 10 * GIB, 10 * GIB, use_gpu=True) is True
    assert fits(replace(option, worker_bytes=9 * GIB + 1), 10 * GIB, 10 * GIB, use_gpu=True) is False
    assert fits(replace(option, host_bytes_per_node=9 * GIB + 1), 10 * GIB, 10 * GIB, use_gpu=True) is False
    # a CPU run has no GPU limit; an unknown limit is not checked
    assert fits(replace(option, worker_bytes=9 * GIB + 1), 10 * GIB, 10 * GIB, use_gpu=False) is True
    assert fits(replace(option, worker_bytes=10**15, host_bytes_per_node=10**15), None, None, use_gpu=True) is True


def test_refusal_tries_checkpointing_then_optimizer_offload_before_parameter_offload(llama7b_stats):
    # 7B on one GPU, micro-batch 2, 32 GiB (28.8 usable): parameter offload without checkpointing (25.1 GiB) fits,
    # but optimizer offload with checkpointing (16.4) is tried first: CPU Adam costs less than moving every layer
    plan = plan_7b(llama7b_stats, world=1, overrides=["training.micro_batch_size_per_gpu=2"], gpu_gib=32,
                   host_gib=2000)
    by_option = {(o.offload, o.gradient_checkpointing): o for o in plan.options}
    assert by_option["param+optimizer", False].worker_bytes < 28.8 * GIB < by_option["optimizer", False].worker_bytes
    with pytest.raises(ConfigError) as e:
        check_fits(plan)
    suggested = need_text(True, 1, by_option["optimizer", True])
    assert (" with deepspeed.zero_optimization.offload_optimizer.device=cpu model.gradient_checkpointing=true: "
            f"{suggested} ") in str(e.value)
    # configured with optimizer offload (8 GPUs, micro-batch 8, 80 GiB): checkpointing with the offload kept, never
    # the settings it has turned off (no offload with checkpointing would fit too, at 26.4 GiB)
    plan = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "cpu"}}, gpu_gib=80, host_gib=2000,
                   overrides=["training.micro_batch_size_per_gpu=8"])
    by_option = {(o.offload, o.gradient_checkpointing): o for o in plan.options}
    assert by_option["none", True].worker_bytes < 72 * GIB < plan.configured.worker_bytes
    with pytest.raises(ConfigError) as e:
        check_fits(plan)
    assert f"; with model.gradient_checkpointing=true: {need_text(True, 8, by_option['optimizer', True])} " in str(
        e.value)


OFFLOADED = {"offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("zero, host_gib, usable, nearest, turned_off", [
    # 7B on 8 x 80 GiB, 100 GiB of host RAM (90 usable): the optimizer offloaded needs 155.3 GiB a node; without
    # the offload 25.3 GiB per GPU (72 usable) and 33.7 GiB a node
    (OFFLOADED, 100, 90, "none", "offload_optimizer"),
    # both offloaded (187.8 GiB a node) on 190 GiB (171 usable): the nearest setting that fits is the optimizer
    # alone (155.3 GiB; no offload would fit too)
    ({**OFFLOADED, "offload_param": {"device": "cpu"}}, 190, 171, "optimizer", "offload_param"),
])
def test_a_host_bound_offload_is_told_the_setting_with_less_offload_that_fits(
        llama7b_stats, zero, host_gib, usable, nearest, turned_off):
    """Offload frees GPU memory but costs host RAM; where the host is the limit, the refusal names the setting
    with less offload that fits (it said that nothing fits, found by session 52's mutation run)."""
    plan = plan_7b(llama7b_stats, zero=zero, gpu_gib=80, host_gib=host_gib)
    option = next(o for o in plan.options if o.offload == nearest and not o.gradient_checkpointing)
    assert plan.configured.host_bytes_per_node > usable * GIB > option.host_bytes_per_node
    with pytest.raises(ConfigError) as e:
        check_fits(plan)
    assert (f"; with deepspeed.zero_optimization.{turned_off}.device=none: {need_text(True, 8, option)} "
            in str(e.value)), str(e.value)


def test_on_cpu_the_refusal_names_only_checkpointing_and_then_gpus(llama7b_stats):
    # 8 CPU workers: 276.6 GiB a node without checkpointing, 237.4 with; offload does nothing on a CPU, so its rows
    # (the same bytes) are never suggested
    plan = plan_7b(llama7b_stats, use_gpu=False, host_gib=290)  # 261 usable
    with pytest.raises(ConfigError, match=r"; with model\.gradient_checkpointing=true: \d+\.\d GiB host RAM") as e:
        check_fits(plan)
    assert "offload" not in str(e.value)
    with pytest.raises(ConfigError, match=r"no offload or checkpointing setting makes it fit: .* or train on GPUs "
                                          r"\(scaling\.use_gpu=true\)$"):
        check_fits(plan_7b(llama7b_stats, use_gpu=False, host_gib=200))


def test_verdict_names_what_was_checked_and_what_is_unknown(llama7b_stats):
    def need(plan):
        return need_text(plan.use_gpu, plan.workers_per_node, plan.configured)

    # usable: 141 GiB x 0.9 = 126.9 of a GPU, 2000 GiB x 0.9 = 1800 of a node
    gpus, nodes = "the GPUs have 141.0 GiB, 126.9 GiB usable", "the nodes have 2000.0 GiB RAM, 1800.0 GiB usable"
    plan = plan_7b(llama7b_stats, gpu_gib=141, host_gib=2000)
    assert verdict(plan) == f"memory: fits: this run needs {need(plan)} ({gpus}; {nodes})"
    plan = plan_7b(llama7b_stats, gpu_gib=141)
    assert verdict(plan) == f"memory: fits: this run needs {need(plan)} ({gpus}; host RAM unknown, not checked)"
    plan = plan_7b(llama7b_stats, host_gib=2000)
    assert verdict(plan) == f"memory: fits: this run needs {need(plan)} ({nodes}; GPU memory unknown, not checked)"
    plan = plan_7b(llama7b_stats)
    assert verdict(plan) == ("memory: not checked, the target's GPU memory and host RAM unknown; this run needs "
                             f"{need(plan)}")
    # on CPUs the GPU memory is not a limit, known or not
    plan = plan_7b(llama7b_stats, use_gpu=False, gpu_gib=141, host_gib=2000)
    assert verdict(plan) == f"memory: fits: this run needs {need(plan)} ({nodes})"
    assert have_text(False, 141 * GIB, None) == ""


def test_gib_switches_to_mib_below_one_gib():
    sizes = [GIB, 1.5 * GIB, GIB - 2**20, 512 * 2**20]
    assert [gib(n) for n in sizes] == ["1.0 GiB", "1.5 GiB", "1023 MiB", "512 MiB"]


def cells(line):
    """A table line's cells: its columns are two or more spaces apart."""
    return re.split(r" {2,}", line.strip())


def test_the_table_of_a_gpu_plan_with_a_ratio_and_a_capped_gpu(llama7b_stats):
    plan = plan_7b(llama7b_stats, world=1, zero={"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, gpu_gib=80,
                   host_gib=512, overrides=["scaling.gpu_memory_fraction=0.95"])
    lines = format_plan(plan).splitlines()
    # 80 GiB x 0.95 = 76 GiB planned, 68.4 usable; 512 x 0.9 = 460.8 GiB of host RAM usable
    assert lines[:6] == [
        "model       Llama, 6,738,415,616 parameters (largest layer 131,072,000), bf16, ZeRO-3, fp32 master weights "
        "and Adam moments",
        "cluster     1 GPU workers = 1 node(s) x 1",
        "batch       train_batch_size 1 = micro-batch 1 x gradient_accumulation_steps 1 x world size 1; seq_len 2048 "
        "(2,048 tokens per step)",
        "target      76.0 GiB per GPU, scaling.gpu_memory_fraction=0.95 (68.4 GiB usable), 512.0 GiB host RAM per node "
        "(460.8 GiB usable)",
        "",
        "model states per GPU (ZeRO-3 over 1)   on GPU      in host RAM per node"]
    states = plan.model_states
    assert [cells(line) for line in lines[6:9]] == [
        [label, gib(states[offload][0]), gib(states[offload][1])] for label, offload in (
            ("no offload", "none"), ("offload optimizer to cpu", "optimizer"),
            ("offload param+optimizer to cpu", "param+optimizer"))]
    assert lines[9] == "activations per GPU (micro-batch 1 x seq_len 2048)"
    assert [cells(line) for line in lines[10:12]] == [["no checkpointing", gib(plan.activations[False])],
                                                      ["gradient checkpointing", gib(plan.activations[True])]]
    assert lines[12] == ""
    assert lines[13] == ("peak (states + working set + activations)       per GPU     host per node  fits   (ratio: "
                         "the offloaded fraction of sub-groups; in brackets, the parameters whose states are on the "
                         "host)")
    # the decayed weights cut at 1e9 elements (closing after the parameter that crosses it) make 7 sub-groups, the
    # norms an 8th; ratio 0.5 keeps int(0.5 x 8) = 4 on the GPU and puts the last 4 on the host: two of 1,011,875,840,
    # the last layers' and lm_head's 671,088,640 and the norms' 266,240: 2.70B parameters
    ratio = "offload optimizer, ratio 0.50 (2.70B)"
    labels = ["no offload", "no offload, checkpointing", ratio, f"{ratio}, checkpointing", "offload param+optimizer",
              "offload param+optimizer, checkpointing"]
    fit = ["yes" if o.worker_bytes <= 68.4 * GIB and o.host_bytes_per_node <= 460.8 * GIB else "no"
           for o in plan.options]
    assert "yes" in fit and "no" in fit  # parameter offload with checkpointing alone fits the capped GPU
    assert [cells(line) for line in lines[14:]] == [
        [label, gib(o.worker_bytes), gib(o.host_bytes_per_node), f] + (["<- configured"] if o.configured else [])
        for label, o, f in zip(labels, plan.options, fit)]


def test_the_table_of_a_cpu_plan_without_a_target(llama7b_stats):
    plan = plan_7b(llama7b_stats, use_gpu=False)
    lines = format_plan(plan).splitlines()
    assert lines[1] == "cluster     8 CPU workers = 1 node(s) x 8"
    assert lines[3] == "target      host RAM unknown (pass --host-memory-gib)"
    # on CPUs only the rows without offload (offload does nothing there), the states all in host RAM
    assert [lines[5], cells(lines[6]), lines[7]] == ["model states per worker (ZeRO-3 over 8)   in host RAM",
                                                     ["no offload", gib(sum(plan.model_states["none"]))],
                                                     "activations per worker (micro-batch 1 x seq_len 2048)"]
    assert lines[11] == "peak (states + working set + activations)       per worker  host per node  fits"
    # nothing known, nothing judged
    none, ckpt = plan.options[:2]
    assert [cells(line) for line in lines[12:]] == [
        ["no offload", gib(none.worker_bytes), gib(none.host_bytes_per_node), "?", "<- configured"],
        ["no offload, checkpointing", gib(ckpt.worker_bytes), gib(ckpt.host_bytes_per_node), "?"]]


def test_the_table_names_the_offload_devices_an_assumed_node_size_and_judges_the_known_limit(llama7b_stats):
    # 16 GPUs, 8 a node; parameters to the CPU and the optimizer to NVMe; only the host RAM known (1800 GiB usable)
    plan = plan_7b(llama7b_stats, world=16, host_gib=2000, zero={
        "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}})
    lines = format_plan(plan).splitlines()
    assert lines[1] == "cluster     16 GPU workers = 2 node(s) x 8"
    assert lines[3] == ("target      GPU memory unknown (pass --gpu-memory-gib), 2000.0 GiB host RAM per node "
                        "(1800.0 GiB usable)")
    # the host column of the model states is per node: 8 workers' host-side states
    assert [cells(line) for line in lines[6:9]] == [
        [label, gib(plan.model_states[offload][0]), gib(8 * plan.model_states[offload][1])] for label, offload in (
            ("no offload", "none"), ("offload optimizer to nvme", "optimizer"),
            ("offload param+optimizer to cpu (param), nvme (optimizer)", "param+optimizer"))]
    assert lines[13].endswith("host per node  fits")  # no ratio below 1: no ratio note
    fit = ["yes" if o.host_bytes_per_node <= 1800 * GIB else "no" for o in plan.options]
    assert [cells(line)[0] for line in lines[14:]] == [
        "no offload", "no offload, checkpointing", "offload optimizer", "offload optimizer, checkpointing",
        "offload param+optimizer", "offload param+optimizer, checkpointing"]
    assert [cells(line)[3] for line in lines[14:]] == fit == ["yes"] * 6
    # a node size assumed (none given): said where it makes more than one node
    assumed = format_plan(replace(plan, workers_per_node_assumed=True)).splitlines()[1]
    assert assumed == "cluster     16 GPU workers = 2 node(s) x 8 (assumed: pass --gpus-per-node)"
    one_node = replace(plan_7b(llama7b_stats), workers_per_node_assumed=True)
    assert format_plan(one_node).splitlines()[1] == "cluster     8 GPU workers = 1 node(s) x 8"


@pytest.mark.parametrize("overrides, states", [
    ([], "fp32 master weights and Adam moments"),
    (["deepspeed.bf16.bf16_master_weights_and_grads=true"], "bf16 master weights, fp32 Adam moments"),
    (["deepspeed.bf16.bf16_master_weights_and_grads=true", "deepspeed.bf16.bf16_optimizer_states=true"],
     "bf16 master weights and optimizer states")])
def test_the_table_names_the_dtype_of_the_optimizer_states(llama7b_stats, overrides, states):
    plan = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "cpu"}}, overrides=overrides)
    assert format_plan(plan).splitlines()[0].endswith(f", bf16, ZeRO-3, {states}")


def run_plan(*args):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # the flags describe the target; no Ray cluster is consulted
    return subprocess.run([sys.executable, "-m", "raytrain.tools.plan", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_prints_the_table_for_a_cluster_that_does_not_exist():
    p = run_plan("--gpu-memory-gib", "80", "--host-memory-gib", "512", "--gpus-per-node", "8",
                 "scaling.num_workers=8", f"model.config={json.dumps(LLAMA2_7B)}", "data.seq_len=2048",
                 "training.micro_batch_size_per_gpu=1")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "6,738,415,616 parameters" in out and "train_batch_size 8 = micro-batch 1 x" in out
    assert "80.0 GiB per GPU" in out and "512.0 GiB host RAM per node" in out
    for row in ("no offload", "offload optimizer to cpu", "offload param+optimizer to cpu", "no checkpointing",
                "gradient checkpointing", "<- configured"):
        assert row in out
    assert out.count(" yes ") + out.count(" no ") >= 6


def test_cli_exit_codes_for_too_big_and_for_config_errors():
    too_big = run_plan("--gpu-memory-gib", "24", "--host-memory-gib", "64", "--gpus-per-node", "1",
                       "scaling.num_workers=1", f"model.config={json.dumps(LLAMA2_7B)}")
    assert too_big.returncode == 1 and "offload" in too_big.stdout
    assert too_big.stderr.startswith("raytrain: does not fit: this run needs") and len(too_big.stderr.splitlines()) == 1
    bad = run_plan("--gpu-memory-gib", "80", "training.max_step=3")
    assert bad.returncode == 2 and "did you mean training.max_steps" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_prints_the_data_sources_notes_once_the_plan_fits(tmp_path):
    """The notes are the sources' (Sources.notes), printed by each caller; this one printed none."""
    (tmp_path / "a.txt").write_text("a document")
    (tmp_path / "c.dat").write_text("left out")
    p = run_plan("--gpu-memory-gib", "80", "--host-memory-gib", "512", "--gpus-per-node", "1", "scaling.num_workers=1",
                 f"data.path={tmp_path}")
    assert p.returncode == 0, p.stderr
    assert f"raytrain: note: data.path: reading 1 file of {tmp_path}; left out 1 with other extensions" in p.stderr


def test_nvme_offload_holds_swap_buffers_in_host_ram_not_the_states(llama7b_stats):
    n = 6_738_415_616 // 8
    cpu = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "cpu"}})
    nvme = plan_7b(llama7b_stats, zero={"offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
                                        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                                                          "max_in_cpu": 0}})
    # on the GPU nothing changes; in host RAM the master weights, moments and fp32 gradients (16 bytes per
    # parameter) are on the drive: the bf16 accumulation buffer stays, plus 4 swap buffers of the largest
    # sub-group (842.3M fp32 each: 13.5 GB, one 16 GiB pinned block); at init, a pageable fp32 copy of that
    # sub-group on its way to the drive
    assert [o.worker_bytes for o in nvme.options] == [o.worker_bytes for o in cpu.options]
    assert cpu.model_states["optimizer"][1] == 2**31 + 12 * n + 2**32 + 2**18
    assert nvme.model_states["optimizer"][1] == 2**31 + 2**34 + 4 * 842_268_672
    # parameters on NVMe with max_in_cpu 0: only the 5 x 1e8 bf16 swap buffers (1 GB -> a 1 GiB block)
    assert nvme.model_states["param+optimizer"][1] == nvme.model_states["optimizer"][1] + 2**30
    assert "offload optimizer to nvme" in format_plan(nvme) and "offload param+optimizer to nvme " in format_plan(nvme)


def test_zero_1_and_2_partition_only_what_their_stage_partitions(llama7b_stats):
    # 8 GPUs. ZeRO-2: the bf16 parameters whole on every GPU, gradients and optimizer states partitioned, a layer's
    # full gradients while it runs, no gathered layer; each param group is one flat group whatever sub_group_size
    # says (a ZeRO-3 key), so the step casts the decayed weights' whole partition at once
    N, n = 6_738_415_616, 6_738_415_616 // 8
    two = dict(plan_7b(llama7b_stats, zero={"stage": 2, "sub_group_size": 100_000_000}).configured.breakdown)
    assert two["parameters"] == 2 * N and two["gradient partition"] == 2 * n and two["Adam moments"] == 8 * n
    assert two["full gradients of a layer"] == 2 * 32000 * 4096 and "gathered layer + prefetch" not in two
    assert two["step: gradients of one sub-group, master dtype"] == 4 * 842_268_672
    # ZeRO-1: the gradients whole too, and no layer's gradients on top of them
    one = dict(plan_7b(llama7b_stats, zero={"stage": 1}).configured.breakdown)
    assert one["parameters"] == one["gradient partition"] == 2 * N and one["Adam moments"] == 8 * n
    assert "full gradients of a layer" not in one and "gathered layer + prefetch" not in one
    # optimizer offload works from stage 1: the states leave the GPU
    offloaded = plan_7b(llama7b_stats, zero={"stage": 1, "offload_optimizer": {"device": "cpu"}}).configured
    assert offloaded.offload == "optimizer" and "Adam moments" not in dict(offloaded.breakdown)
    assert offloaded.params_on_host == n and offloaded.host_state_bytes > 12 * n


def test_on_one_gpu_zero_3_keeps_no_gathered_or_persistent_copies_and_without_contiguous_gradients_no_bucket(
        llama7b_stats):
    one_gpu = dict(plan_7b(llama7b_stats, world=1).configured.breakdown)
    assert "gathered layer + prefetch" not in one_gpu and "persistent small parameters" not in one_gpu
    assert one_gpu["reduce bucket"] == 2 * 50_000_000
    plain, unbucketed = plan_7b(llama7b_stats), plan_7b(llama7b_stats, zero={"contiguous_gradients": False})
    assert "reduce bucket" not in dict(unbucketed.configured.breakdown)
    assert [o.worker_bytes for o in plain.options] == [o.worker_bytes + 2 * 50_000_000 for o in unbucketed.options]


def test_gpu_sub_groups_stage_through_pinned_blocks_of_the_sizes_the_host_side_lacks(llama7b_stats):
    # ratio 0.1 over 1e8 sub-groups: only the norms' 33,280 on the host; the GPU sub-groups' fp32 gradient buffers
    # pass through pinned blocks of two more sizes, 512 MiB (the ~1e8 ones) and 128 MiB (33.3M), kept cached
    item = "pinned staging of GPU sub-groups' gradient buffers (cached)"
    section = {"device": "cpu", "ratio": 0.1}
    pinned = plan_7b(llama7b_stats, zero={"sub_group_size": 100_000_000, "offload_optimizer": section})
    assert dict(pinned.configured.breakdown)[item] == 2**29 + 2**27
    # ratio 0.5: the host side's own pinned buffers come in the GPU side's sizes already, so no more are cached
    half = plan_7b(llama7b_stats, zero={"sub_group_size": 100_000_000, "offload_optimizer": {**section, "ratio": 0.5}})
    assert dict(half.configured.breakdown)[item] == 0
    # torch's AdamW steps the largest GPU sub-group's temporaries, not the smallest's
    assert dict(pinned.configured.breakdown)["step: AdamW temporaries, largest GPU sub-group"] == 4 * 101_187_584
    unpinned = plan_7b(llama7b_stats, zero={"sub_group_size": 100_000_000,
                                            "offload_optimizer": {**section, "pin_memory": False}})
    assert dict(unpinned.configured.breakdown)[item] == 0


def test_fp32_takes_4_bytes_a_parameter_and_gradient_and_casts_nothing_at_the_step():
    # training on CPU is fp32: 2 workers each hold half the built-in model's parameters and gradients, 4 bytes each
    resolved = resolve_run(load_config(None), ClusterShape(num_workers=2, use_gpu=False))
    plan = estimate_memory(resolved, Target(host_memory_bytes=8 * GIB))
    items, half = dict(plan.configured.breakdown), -(-plan.num_params // 2)
    assert plan.precision == "fp32" and items["parameter partition"] == items["gradient partition"] == 4 * half
    # no flatten-and-cast (the model dtype is the master's); torch's per-tensor AdamW on CPU: the moments' size
    largest = max(plan.facts.sub_groups(plan.configured.setting.sub_group_size))
    assert items["step: flatten / Adam temporaries"] == 8 * largest
    on_gpus = resolve_run(load_config(None, ["training.precision=fp32"]),
                          ClusterShape(num_workers=2, use_gpu=True, gpus_per_node=2))
    assert dict(estimate_memory(on_gpus).configured.breakdown)["step: flatten / Adam temporaries"] == 0
    # without ZeRO (stage 0) fp32 parameters are their own master weights: DeepSpeed keeps no copy of them
    bare = resolve_run(load_config(None, ["training.precision=fp32", 'deepspeed={"zero_optimization": {"stage": 0}}']),
                       ClusterShape(num_workers=2, use_gpu=True, gpus_per_node=2))
    items = dict(estimate_memory(bare).configured.breakdown)
    assert items["fp32 master weights"] == 0 and items["Adam moments"] == 8 * plan.num_params


def test_parameter_offload_pins_one_block_per_parameter_and_nvme_keeps_up_to_max_in_cpu_in_ram(llama7b_stats):
    # per rank of 8, bf16: q, k, v, o 4 MiB each (exact powers of two), gate, up, down 11.3 MB -> 16 MiB, the
    # embedding and the head 32.8 MB -> 32 MiB: 32 x 64 MiB + 64 MiB, cached from zero.Init; unpinned: none
    item = "per-parameter pinned blocks from zero.Init (cached)"
    cpu = plan_7b(llama7b_stats, zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})
    assert dict(cpu.configured.breakdown)[item] == 2112 * 2**20
    # ... and the flat partitions, one block per param group: the weights' 1.68 GB -> 2 GiB, the norms' 66,560 B
    assert dict(cpu.configured.breakdown)["parameter partitions (pinned, one block per param group)"] == 2**31 + 2**17
    unpinned = plan_7b(llama7b_stats, zero={"offload_param": {"device": "cpu", "pin_memory": False},
                                            "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    assert dict(unpinned.configured.breakdown)[item] == 0
    # NVMe: the first 5e8 elements of the flat groups stay in host RAM (the weights' 842.3M partition cut there,
    # the norms' left on the drive), 1 GB pinned in a 1 GiB block; unpinned, the optimizer's 4 swap buffers are
    # exactly 4 x the largest fp32 sub-group, and the init transient its pageable copy
    nvme = {"device": "nvme", "nvme_path": "/local_nvme"}
    items = dict(plan_7b(llama7b_stats, zero={"offload_param": {**nvme, "max_in_cpu": 500_000_000},
                                              "offload_optimizer": nvme}).configured.breakdown)
    assert items["parameter partitions kept in host RAM (offload_param.max_in_cpu, pinned)"] == 2**30
    # with DeepSpeed's max_in_cpu (1e9) both partitions stay in RAM: 2 GiB and 128 KiB blocks
    items = dict(plan_7b(llama7b_stats, zero={"offload_param": nvme, "offload_optimizer": nvme}).configured.breakdown)
    assert items["parameter partitions kept in host RAM (offload_param.max_in_cpu, pinned)"] == 2**31 + 2**17
    items = dict(plan_7b(llama7b_stats, zero={"offload_optimizer": {**nvme, "pin_memory": False}}).configured.breakdown)
    assert items["NVMe swap buffers, optimizer (buffer_count x largest sub-group, pinned)"] == 4 * 4 * 842_268_672
    assert items["init: pageable copies before pinning (transient)"] == 4 * 842_268_672
    # the parameters' swap buffers, unpinned: DeepSpeed's buffer_count 5 x buffer_size 1e8 bf16 elements
    items = dict(plan_7b(llama7b_stats, zero={"offload_param": {**nvme, "max_in_cpu": 0, "pin_memory": False},
                                              "offload_optimizer": {**nvme, "pin_memory": False}}).configured.breakdown)
    assert items["NVMe swap buffers, parameters (buffer_count x buffer_size, pinned)"] == 2 * 5 * 100_000_000


def test_zero_0_keeps_parameters_gradients_and_optimizer_states_whole_and_is_the_default_of_a_zero_section(
        llama7b_stats):
    from raytrain.planning.estimate import memory_facts

    N = 6_738_415_616
    zero = dict(plan_7b(llama7b_stats, zero={"stage": 0}).configured.breakdown)
    assert zero["parameters"] == zero["gradient partition"] == 2 * N and "full gradients of a layer" not in zero
    # ... and the optimizer too (no ZeRO: DeepSpeed's FP16_Optimizer for bf16, whole on every rank, as the driver's
    # stage-0 note says): the master weights and moments of all N parameters on each of the 8 GPUs, not N / 8
    assert zero["fp32 master weights"] == 4 * N and zero["Adam moments"] == 8 * N
    cfg = load_config(None, [f"model.config={json.dumps(LLAMA2_7B)}"])
    facts = memory_facts({"zero_optimization": {"reduce_bucket_size": 1000}}, cfg, use_gpu=True, world_size=8,
                         workers_per_node=8, stats=llama7b_stats, hf_config=load_model_config(cfg.model))
    assert facts.stage == 0  # DeepSpeed's default


def test_the_boundaries_of_hpz_persistence_and_gathering(llama7b_stats):
    # hpZ 2 of 32 GPUs: a secondary copy of half the parameters; hpZ as large as the world: no secondary partition
    assert dict(plan_7b(llama7b_stats, world=32, zero={"zero_hpz_partition_size": 2}).configured.breakdown)[
        "hpZ secondary parameter copy"] == 2 * 6_738_415_616 // 2
    assert "hpZ secondary parameter copy" not in dict(
        plan_7b(llama7b_stats, world=8, zero={"zero_hpz_partition_size": 8}).configured.breakdown)
    # two GPUs already gather layers and keep the small parameters whole
    two = dict(plan_7b(llama7b_stats, world=2).configured.breakdown)
    assert two["persistent small parameters"] == 2 * 65 * 4096 and "gathered layer + prefetch" in two
    # a parameter exactly at stage3_param_persistence_threshold persists (DeepSpeed: numel <= threshold)
    at = dict(plan_7b(llama7b_stats, zero={"stage3_param_persistence_threshold": 4096}).configured.breakdown)
    assert at["persistent small parameters"] == 2 * 65 * 4096
