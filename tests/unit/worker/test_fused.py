"""model.fused_layers (raytrain/worker/fused.py): one GEMM for q/k/v and for gate/up over the unrenamed
weights, the residual adds fused into the RMSNorm and the down projection. The same model as transformers'
layers: the same loss and gradients, the same parameter names, on real DeepSpeed ZeRO-3 with the weights
partitioned over 2 ranks (gloo, CPU). The GPU kernels (Liger's) are checked against transformers' layers on
an H200 by benchmarks/profile_step.py (`check_fused_layers`, run before every `layers` variant).
"""

import collections
import copy
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from raytrain.config import ConfigError, ModelConfig, load_config
from raytrain.model import fused_layers_enabled
from raytrain.planning.resolve import resolve_run
from raytrain.run_spec import ClusterShape
from raytrain.worker.fused import CatLinear, fuse_llama_layers, rope_inplace

CHILD = pathlib.Path(__file__).with_name("fused_child.py")
REPO = pathlib.Path(__file__).resolve().parents[3]
TINY = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data.seq_len=32",
        "training.micro_batch_size_per_gpu=2", "training.gradient_accumulation_steps=2", "training.max_steps=3",
        "training.learning_rate=0.01", "training.precision=fp32", "scaling.num_workers=2", "scaling.use_gpu=false",
        # 0: every weight is partitioned and gathered by the hooks (the default keeps small ones whole)
        "deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]


def tiny_llama(**overrides):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False, **overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()


def raytrain_functions(loss):
    """How many times each of raytrain's autograd Functions (fused.py, fp8.py) is in loss's graph."""
    count, seen, todo = collections.Counter(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in ("CatLinearBackward", "QKVRopeBackward", "Fp8LinearBackward"):
            count[type(node).__name__] += 1
        todo += [f for f, _ in node.next_functions]
    return dict(count)


@pytest.mark.parametrize("per_document", [False, True], ids=["positions", "per-document-positions"])
def test_same_loss_gradients_and_names_as_transformers_layers(per_document):
    """per_document: positions restart inside each row (data.position_ids=per_document), so RoPE's cos/sin
    differ per row of the batch."""
    plain = tiny_llama()
    fused = copy.deepcopy(plain)
    assert fuse_llama_layers(fused) == {"fused": 2, "skipped": {}}
    assert type(fused.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"
    shapes = lambda model: [(k, v.shape) for k, v in model.state_dict().items()]  # noqa: E731
    assert shapes(fused) == shapes(plain)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1) if per_document else None
    if per_document:
        positions[1] = torch.cat([torch.arange(25), torch.arange(7)])
    losses, functions = [], []
    for model in (plain, fused):
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
        losses.append(loss.item())
        functions.append(raytrain_functions(loss))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    # per layer: q|k|v one GEMM and gate|up one GEMM (down_proj's, with the residual, is an addmm), RoPE on q|k
    assert functions == [{}, {"CatLinearBackward": 4, "QKVRopeBackward": 2}]
    for (name, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        assert q.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_attention_dropout_as_in_transformers_layers(training):
    """config.attention_dropout applies in training (the same random mask for the same seed), not in eval."""
    plain = tiny_llama(attention_dropout=0.5).train(training)
    fused = copy.deepcopy(plain)
    fuse_llama_layers(fused)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, fused):
        torch.manual_seed(5)
        losses.append(model(input_ids=ids, labels=ids).loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


@pytest.mark.parametrize("layout", ["batch-seq", "batch-seq-1", "seq", "batch-1-seq"])
def test_rope_in_place_is_transformers_rotation_for_each_cos_layout(layout):
    """cos/sin as (batch, seq, d) (one row per sequence; also seq 1), (seq, d) or (batch, 1, seq, d): the q and k
    columns of the fused buffer rotated as transformers' apply_rotary_pos_emb does, v untouched; backward=True
    is the inverse rotation."""
    b, s, n_q, n_kv, d = 2, 1 if layout == "batch-seq-1" else 5, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(1 if layout in ("seq", "batch-1-seq") else b, s, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    buf = torch.randn(b, s, (n_q + 2 * n_kv) * d, generator=g)
    heads = buf.view(b, s, -1, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(heads[:, :n_q], heads[:, n_q:n_q + n_kv], cos, sin)
    given = {"seq": (cos[0], sin[0]), "batch-1-seq": (cos[:, None], sin[:, None])}.get(layout, (cos, sin))
    got = buf.clone()
    rope_inplace(got, *given, n_q, n_kv, d, backward=False)
    got_heads = got.view(b, s, -1, d).transpose(1, 2)
    assert torch.allclose(got_heads[:, :n_q], want_q, atol=1e-6)
    assert torch.allclose(got_heads[:, n_q:n_q + n_kv], want_k, atol=1e-6)
    assert torch.equal(got_heads[:, n_q + n_kv:], heads[:, n_q + n_kv:])
    rope_inplace(got, *given, n_q, n_kv, d, backward=True)
    assert torch.allclose(got, buf, atol=1e-6)


@pytest.mark.parametrize("x_grad, w_grad", [(True, True), (True, False), (False, True)],
                         ids=["both", "frozen-weights", "frozen-input"])
def test_cat_linear_gradients_are_f_linear_of_the_concatenated_weights(x_grad, w_grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g).requires_grad_(x_grad)
    weights = [torch.randn(n, 8, generator=g).requires_grad_(w_grad) for n in (4, 2, 2)]
    dy = torch.randn(2, 3, 8, generator=g)
    CatLinear.apply(x, *weights).backward(dy)
    got = [x.grad, *(w.grad for w in weights)]
    for t in (x, *weights):
        t.grad = None
    torch.nn.functional.linear(x, torch.cat(weights)).backward(dy)
    for a, b in zip(got, [x.grad, *(w.grad for w in weights)]):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6))


def test_generation_with_a_kv_cache_takes_transformers_forward():
    plain = tiny_llama().eval()
    fused = copy.deepcopy(plain)
    fuse_llama_layers(fused)
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(plain.generate(prompt, **kw), fused.generate(prompt, **kw))


def test_autocast_takes_transformers_forward():
    """Under autocast (DeepSpeed's torch_autocast) the residual stream is fp32 and the projections bf16:
    the fused layer steps aside rather than round the stream."""
    plain = tiny_llama()
    fused = copy.deepcopy(plain)
    fuse_llama_layers(fused)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [model(input_ids=ids, labels=ids).loss.item() for model in (plain, fused)]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("overrides, norm, why", [
    (dict(attention_bias=True), None, "q_proj has a bias"),
    (dict(mlp_bias=True), None, "gate_proj has a bias"),
    (dict(hidden_act="gelu"), None, "the MLP's activation is not SiLU"),
    ({}, "post_attention_layernorm", "post_attention_layernorm is not Llama's RMSNorm"),
], ids=["attention-bias", "mlp-bias", "gelu", "norm-without-weight"])
def test_layers_that_cannot_be_fused_keep_transformers_forward(overrides, norm, why):
    """norm: that norm of every layer replaced by an RMSNorm without a weight."""
    model = tiny_llama(**overrides)
    for layer in model.model.layers if norm else ():
        setattr(layer, norm, torch.nn.RMSNorm(64, elementwise_affine=False))
    result = fuse_llama_layers(model)
    assert result == {"fused": 0, "skipped": {0: why, 1: why}}
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_layers_with_swish_are_fused():
    """swish is SiLU."""
    assert fuse_llama_layers(tiny_llama(hidden_act="swish")) == {"fused": 2, "skipped": {}}


def test_zero3_over_two_ranks_trains_the_same_as_transformers_layers(tmp_path):
    """Also with checkpointing: the fused layer's forward runs again in the backward (hooks and gathers again)."""
    out = tmp_path / "fused.json"
    p = subprocess.run([sys.executable, str(CHILD), str(out), *TINY], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "error" not in r, r["error"]
    plain, fused = r["plain"], r["fused"]
    assert (plain["layer_class"], fused["layer_class"]) == ("LlamaDecoderLayer", "FusedLlamaDecoderLayer")
    assert fused["attention_class"] == "FusedLlamaAttention"
    assert fused["partition_numel"] * 2 == fused["full_numel"]  # each rank holds half: the hooks gather the rest
    assert fused["params"] == plain["params"]  # checkpoints, export and resharding see the same names
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert r["fused-checkpointing"]["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert r["fused-checkpointing"]["layer_class"] == "FusedLlamaDecoderLayer"
    assert (plain["checkpointing"], r["fused-checkpointing"]["checkpointing"]) == (False, True)
    assert plain["losses"][-1] < plain["losses"][0]  # 3 optimizer steps on two repeated batches: it learns
    # model.fp8: the projections as FP8 GEMMs (torch's CPU _scaled_mm here), gathered and recomputed under ZeRO-3;
    # rounding changes the losses a little, not the model (raytrain/worker/fp8.py; tests/unit/worker/test_fp8.py)
    fp8 = r["fp8-checkpointing"]
    assert (fp8["layer_class"], fp8["o_proj_class"], fp8["checkpointing"]) == ("FusedLlamaDecoderLayer",
                                                                               "Fp8LinearModule", True)
    assert fp8["losses"] == pytest.approx(plain["losses"], rel=0.03) and fp8["losses"] != plain["losses"]
    assert fp8["losses"][-1] < fp8["losses"][0]
    assert r["paths"] == {"norm": "the norm module's forward", "rope": "torch ops",
                          "add_norm": "add, then the norm module's forward", "silu_mul": "torch silu(gate) * up"}


def test_fused_layers_is_refused_for_a_model_that_is_not_llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64}))
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "model.fused_layers=true", "data.seq_len=32",
                             "scaling.use_gpu=false"])
    with pytest.raises(ConfigError, match="model.fused_layers=true fuses Llama decoder layers only, and this "
                                          "model is gpt2: set model.fused_layers=false"):
        resolve_run(cfg, ClusterShape(num_workers=1, use_gpu=False))


@pytest.mark.parametrize("setting, liger, compile_, model_type, on", [
    ("auto", "all", False, "llama", True),    # Liger's GPU kernels on a Llama model: where it was measured
    ("auto", "loss", False, "llama", False),
    ("auto", "none", False, "llama", False),  # CPU runs (Liger "all" needs a GPU)
    ("auto", "all", True, "llama", False),    # not with torch.compile
    ("auto", "all", False, "mistral", False),
    (True, "none", False, "llama", True),     # explicit values win
    (False, "all", False, "llama", False),
])
def test_auto_is_on_for_llama_with_liger_all_and_explicit_values_win(setting, liger, compile_, model_type, on):
    cfg = ModelConfig(fused_layers=setting, liger_kernel=liger, compile=compile_)
    hf_config = LlamaConfig() if model_type == "llama" else type("Config", (), {"model_type": model_type})()
    assert fused_layers_enabled(cfg, hf_config) is on
