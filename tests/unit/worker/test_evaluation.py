"""`evaluate` over real gloo process groups (CPU) with a tiny transformers Llama: the loss is the
token-weighted mean over ranks, and ranks with uneven eval data still run the same number of forwards.
On a DeepSpeed ZeRO-3 engine, inside the worker loop: tests/unit/worker/test_loop.py."""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain.data.bad_records import BadRecord
from raytrain.worker.evaluation import Evaluator, evaluate
from tests.helpers import init_gloo


def tiny_model():
    """A two-layer transformers Llama, the same weights in every process (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=16))


def batches(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (2, 8), generator=g)} for _ in range(n)]


def reference_loss(model, batch_lists):
    with torch.no_grad():
        losses = [model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.item() for bl in batch_lists for b in bl]
    return sum(losses) / len(losses)  # every batch predicts the same number of tokens


def _rank_main(rank, world, out_dir):
    init_gloo(rank, world, f"{out_dir}/rendezvous")
    try:
        model = tiny_model()
        # rank 0 has 3 batches, rank 1 only 1: both must stop after 1 (ZeRO-3 would hang otherwise)
        out = evaluate(model, iter(batches(rank, 3 if rank == 0 else 1)), torch.device("cpu"), max_batches=5)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_uneven_ranks_run_the_same_batches_and_average_over_all_ranks(tmp_path):
    mp.start_processes(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = reference_loss(tiny_model(), [batches(0, 3)[:1], batches(1, 1)])
    assert results[0] == results[1]
    assert results[0]["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert results[0]["eval_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_single_rank_runs_at_most_max_batches_and_restores_train_mode(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = tiny_model().train()
        out = evaluate(model, batches(7, 4), torch.device("cpu"), max_batches=3)
        assert model.training
        assert out["eval_loss"] == pytest.approx(reference_loss(tiny_model(), [batches(7, 4)[:3]]), rel=1e-5)
        # No row at all is the user's data, not a fault: a BadRecord (one line, exit 2, never retried).
        with pytest.raises(BadRecord, match="^the eval data yields not one row of data.seq_len tokens: add eval data "
                                            r".*a text file is one document unless data.text_document=line\)"):
            evaluate(model, [], torch.device("cpu"), max_batches=3)
    finally:
        dist.destroy_process_group()


def test_a_short_last_batch_is_evaluated_and_weighed_by_its_tokens(tmp_path):
    """The eval shard's last micro-batch may be short (eval_batches no longer drops it: a small eval
    set evaluated nothing): the mean is over predicted tokens, so its one row weighs one row."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = tiny_model()
        full, short = batches(3, 1)[0], {"input_ids": batches(4, 1)[0]["input_ids"][:1]}
        out = evaluate(model, [full, short], torch.device("cpu"), max_batches=5)
        rows = [full["input_ids"][0:1], full["input_ids"][1:2], short["input_ids"]]
        with torch.no_grad():
            per_row = [model(input_ids=r, labels=r).loss.item() for r in rows]
        assert out["eval_loss"] == pytest.approx(sum(per_row) / 3, rel=1e-5)
    finally:
        dist.destroy_process_group()


def test_the_check_before_the_first_step_refuses_eval_data_without_a_row(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = tiny_model()
        Evaluator(model, lambda: iter(batches(5, 1)), torch.device("cpu"), 0, 2).check()  # a row: nothing said
        with pytest.raises(BadRecord, match="^the eval data yields not one row"):
            Evaluator(model, lambda: iter([]), torch.device("cpu"), 0, 2).check()
    finally:
        dist.destroy_process_group()


def _moe_rank_main(rank, world, out_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    init_gloo(rank, world, f"{out_dir}/rendezvous")
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.5))
        out = evaluate(model, iter(batches(0, 2)), torch.device("cpu"), max_batches=5)
        with torch.no_grad():
            results = [model(input_ids=b["input_ids"], labels=b["input_ids"]) for b in batches(0, 2)]
        # the next-token loss alone: cross-entropy of the logits, as transformers computes it without the router's
        ce = [torch.nn.functional.cross_entropy(r.logits[:, :-1].reshape(-1, 64).float(),
                                                b["input_ids"][:, 1:].reshape(-1)).item()
              for r, b in zip(results, batches(0, 2))]
        with open(f"{out_dir}/moe.json", "w") as f:
            json.dump({"eval_loss": out["eval_loss"], "ce": sum(ce) / len(ce),
                       "with_aux": sum(r.loss.item() for r in results) / len(results)}, f)
    finally:
        dist.destroy_process_group()


def test_a_mixture_of_experts_eval_loss_is_the_next_token_loss_without_the_router_loss(tmp_path):
    """With output_router_logits, transformers adds router_aux_loss_coef x the load-balancing loss to .loss:
    trained on, but eval_loss and eval_ppl report the next-token loss."""
    mp.start_processes(_moe_rank_main, args=(1, str(tmp_path)), nprocs=1, join=True, start_method="spawn")
    r = json.loads((tmp_path / "moe.json").read_text())
    assert r["with_aux"] > r["ce"] + 0.1  # the aux term is there to leave out
    assert r["eval_loss"] == pytest.approx(r["ce"], rel=1e-5)
