"""raytrain.worker.engine.model_inputs: data.position_ids=per_document under flash attention goes to the model as one
row, the shape for which transformers runs flash attention's varlen kernel (attention within each document); with
several rows it attended across documents. Flash attention needs a GPU, so the one-row form is checked here under
SDPA, which keeps documents apart at any shape (its 4D mask): one row and the rows give the same loss and gradients,
so the one row trains the same tokens on the same targets; and under a CPU stand-in for flash attention's varlen
kernel that reads only the documents' bounds the one row carries. On a GPU: benchmarks/gpu_x1.sh fa4doc."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raytrain.worker.engine import model_inputs, varlen_attention
from tests.helpers import attention_within


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    # as raytrain.model.build_model leaves it: with a KV cache transformers builds no document mask (plain causal)
    model.config.use_cache = False
    return model


def batch_of_documents():
    ids = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    # each row starts a document at position 0 (raytrain.data.packing), documents restart inside rows
    positions = torch.stack([torch.cat([torch.arange(12), torch.arange(20)]), torch.arange(32),
                             torch.cat([torch.arange(5), torch.arange(20), torch.arange(7)])])
    return {"input_ids": ids, "position_ids": positions}


def loss_and_grads(model, inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_one_row_trains_the_same_tokens_on_the_same_targets_as_the_rows():
    model, batch = tiny_llama(), batch_of_documents()
    one_row = model_inputs(batch, one_row=True)
    bounds = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert {k: tuple(v.shape) for k, v in one_row.items() if k not in bounds} == {
        "input_ids": (1, 96), "labels": (1, 96), "position_ids": (1, 96)}
    assert one_row["labels"][0, [0, 32, 64]].tolist() == [-100] * 3  # each row's first token: no target
    # the documents' bounds as flash attention's varlen arguments (SDPA, here, takes and ignores them)
    cu = [0, 12, 32, 64, 69, 89, 96]
    assert one_row["cu_seq_lens_q"].dtype == torch.int32 and one_row["cu_seq_lens_q"].tolist() == cu
    assert one_row["cu_seq_lens_k"] is one_row["cu_seq_lens_q"]
    assert one_row["max_length_q"] == one_row["max_length_k"] == 32 and type(one_row["max_length_q"]) is int
    rows = model_inputs(batch, one_row=False)
    assert rows["input_ids"] is batch["input_ids"] and rows["position_ids"] is batch["position_ids"]
    loss, grads = loss_and_grads(model, one_row)
    expected_loss, expected_grads = loss_and_grads(model, rows)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6), name
    # and each document attends to itself alone: the logits of each document run as a sequence of its own
    with torch.no_grad():
        logits = model(**{k: v for k, v in one_row.items() if k != "labels"}).logits.reshape(3, 32, -1)
        for row, positions in enumerate(batch["position_ids"].tolist()):
            starts = [i for i, p in enumerate(positions) if p == 0] + [32]
            for start, end in zip(starts, starts[1:]):
                alone = model(input_ids=batch["input_ids"][row:row + 1, start:end]).logits[0]
                assert torch.allclose(logits[row, start:end], alone, atol=1e-5), (row, start)
    # without the -100s each row's last token would learn the next row's first token: another loss
    naive = {**one_row, "labels": batch["input_ids"].reshape(1, -1)}
    assert loss_and_grads(model, naive)[0] != pytest.approx(expected_loss, rel=1e-5)


SEEN: list[int] = []  # documents per call of the stand-in below, one entry per layer


def varlen_flash_on_cpu(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What flash attention's varlen kernel computes, from the varlen arguments alone: causal attention within each
    document of the one row, ignoring any mask (query: batch 1, heads, tokens, head_dim, as transformers gives)."""
    cu = kwargs["cu_seq_lens_q"].tolist()
    assert query.shape[0] == 1 and cu[-1] == query.shape[2] and kwargs["max_length_q"] == max(
        b - a for a, b in zip(cu, cu[1:]))
    SEEN.append(len(cu) - 1)
    return attention_within(query, key, value, cu, scaling)


@pytest.mark.parametrize("fused", [False, True])
def test_the_bounds_reach_flash_attention_in_every_layer_and_train_as_the_rows(fused):
    """An attention that reads only the varlen arguments (a CPU stand-in for flash attention's kernel; not named
    "flash", which transformers would look for as a kernel) given the one row trains the rows' tokens on their
    targets, documents apart, through transformers' layers and raytrain's fused ones: the bounds reach the
    attention of every layer."""
    from transformers import AttentionInterface

    AttentionInterface.register("varlen_cpu_reference", varlen_flash_on_cpu)
    model, batch = tiny_llama(), batch_of_documents()
    expected_loss, expected_grads = loss_and_grads(model, model_inputs(batch, one_row=False))  # SDPA's mask
    model.set_attn_implementation("varlen_cpu_reference")
    if fused:
        from raytrain.worker.fused import fuse_llama_layers

        fuse_llama_layers(model)
        assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"
    SEEN.clear()
    loss, grads = loss_and_grads(model, model_inputs(batch, one_row=True))
    assert SEEN == [6, 6]  # both layers, the six documents of the three rows
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6), name


def test_rows_without_positions_or_of_one_row_are_given_as_they_are():
    batch = batch_of_documents()
    packed = model_inputs({"input_ids": batch["input_ids"]}, one_row=True)  # data.position_ids=packed
    assert packed.keys() == {"input_ids", "labels"} and packed["labels"] is batch["input_ids"]
    single = {k: v[:1] for k, v in batch.items()}
    assert model_inputs(single, one_row=True)["labels"] is single["input_ids"]  # already one row: no -100


def test_every_row_starts_a_document_in_the_one_row_even_where_its_positions_do_not():
    # raytrain's packing starts each row at position 0; a row that began inside a document (positions 4..7 after
    # 0..3) would otherwise join the row before it, which in the rows' form it cannot see
    ids = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 0, 1, 2, 3]])}
    one_row = model_inputs(batch, one_row=True)
    assert one_row["cu_seq_lens_q"].tolist() == [0, 3, 8, 12, 16]
    assert one_row["max_length_q"] == 5


def test_varlen_attention_is_flash_attention_by_any_name():
    def named(name):
        return varlen_attention(SimpleNamespace(config=SimpleNamespace(_attn_implementation=name)))

    assert [named(n) for n in ("flash_attention_2", "flash_attention_4", "kernels-community/flash-attn3")] == [True] * 3
    assert [named(n) for n in ("sdpa", "eager", "flex_attention", None)] == [False] * 4
    assert varlen_attention(tiny_llama()) is False  # a real model's config, as train_step reads it
