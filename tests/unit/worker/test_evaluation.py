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
        # both ranks past their last collective before either tears gloo down: once under a loaded .ci/run, a
        # rank that destroyed the group while the other's last allreduce was in flight aborted ("terminate called
        # without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_uneven_ranks_run_the_same_batches_and_average_over_all_ranks(tmp_path):
    mp.start_processes(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = reference_loss(tiny_model(), [batches(0, 3)[:1], batches(1, 1)])
    assert results[0] == results[1]
    assert results[0]["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert results[0]["eval_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_single_rank_runs_at_most_max_batches_and_restores_train_mode(one_rank):
    model = tiny_model().train()
    out = evaluate(model, batches(7, 4), torch.device("cpu"), max_batches=3)
    assert model.training
    expected = reference_loss(tiny_model(), [batches(7, 4)[:3]])
    assert out["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert out["eval_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    # No row at all is the user's data, not a fault: a BadRecord (one line, exit 2, never retried).
    with pytest.raises(BadRecord, match="^the eval data yields not one row of data.seq_len tokens: add eval data "
                                        r".*a text file is one document unless data.text_document=line\)"):
        evaluate(model, [], torch.device("cpu"), max_batches=3)


@pytest.mark.parametrize("rows, tokens", [(1, 8), (2, 5)])
def test_a_short_last_batch_is_evaluated_and_weighed_by_its_tokens(one_rank, rows, tokens):
    """The eval shard's last micro-batch may be short (eval_batches no longer drops it: a small eval
    set evaluated nothing): the mean is over predicted tokens, so its one row weighs one row, and a
    row of 5 tokens (4 predicted) weighs 4/7 of a row of 8."""
    model = tiny_model()
    full, short = batches(3, 1)[0], {"input_ids": batches(4, 1)[0]["input_ids"][:rows, :tokens]}
    out = evaluate(model, [full, short], torch.device("cpu"), max_batches=5)
    all_rows = [full["input_ids"][0:1], full["input_ids"][1:2], *short["input_ids"].split(1)]
    with torch.no_grad():
        per_row = [(model(input_ids=r, labels=r).loss.item(), r.shape[1] - 1) for r in all_rows]
    assert out["eval_loss"] == pytest.approx(sum(loss * n for loss, n in per_row) / sum(n for _, n in per_row),
                                             rel=1e-5)


def test_the_check_before_the_first_step_refuses_eval_data_without_a_row(one_rank):
    model = tiny_model()
    Evaluator(model, lambda: iter(batches(5, 1)), torch.device("cpu"), 0, 2).check()  # a row: nothing said
    with pytest.raises(BadRecord, match="^the eval data yields not one row"):
        Evaluator(model, lambda: iter([]), torch.device("cpu"), 0, 2).check()


def test_a_mixture_of_experts_eval_loss_is_the_next_token_loss_without_the_router_loss(one_rank):
    """With output_router_logits, transformers adds router_aux_loss_coef x the load-balancing loss to .loss:
    trained on, but eval_loss and eval_ppl report the next-token loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    with_aux = sum(r.loss.item() for r in results) / len(results)
    assert with_aux > sum(ce) / len(ce) + 0.1  # the aux term is there to leave out
    assert out["eval_loss"] == pytest.approx(sum(ce) / len(ce), rel=1e-5)
    assert out["eval_ppl"] == pytest.approx(math.exp(sum(ce) / len(ce)), rel=1e-5)


@pytest.mark.parametrize("have, said", [
    (2, "raytrain: eval ran 2 of data.eval_max_batches=3 batches per worker (a worker's eval shard ran out)\n"),
    (3, ""), (4, "")], ids=["ran-out", "exactly", "more"])
def test_a_shard_that_runs_out_before_max_batches_is_said(one_rank, capfd, have, said):
    out = evaluate(tiny_model(), batches(7, have), torch.device("cpu"), max_batches=3)
    assert out["eval_loss"] == pytest.approx(reference_loss(tiny_model(), [batches(7, have)[:3]]), rel=1e-5)
    assert capfd.readouterr().out == said


def test_every_pass_over_the_shard_is_closed_after_its_last_batch(one_rank):
    """Closing the shard's iterator ends this rank's pass, so that Ray Data can start the next one:
    the check reads one batch, evaluation at most max_batches of more. Closed here although the
    test still holds each pass, as Ray Data's own threads may."""
    passes, closed = [], []

    def shard():
        try:
            yield from batches(7, 4)
        finally:
            closed.append(True)

    def open_pass():
        passes.append(shard())
        return passes[-1]

    evaluator = Evaluator(tiny_model(), open_pass, torch.device("cpu"), 0, 3)
    evaluator.check()
    assert closed == [True]
    out = evaluator.run()
    assert closed == [True, True] and len(passes) == 2
    assert out["eval_loss"] == pytest.approx(reference_loss(tiny_model(), [batches(7, 4)[:3]]), rel=1e-5)


def test_position_ids_of_packed_documents_reach_the_model(one_rank):
    model = tiny_model()
    with torch.no_grad():  # sharp attention, so that where a token stands changes the loss
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    batch = {**batches(3, 1)[0], "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)}
    out = evaluate(model, [batch], torch.device("cpu"), max_batches=1)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], labels=batch["input_ids"],
                       position_ids=batch["position_ids"]).loss.item()
    assert out["eval_loss"] == pytest.approx(packed, rel=1e-5)
    assert out["eval_loss"] != pytest.approx(reference_loss(model, [[batch]]), rel=1e-3)  # they count


def test_a_diverged_model_has_an_infinite_perplexity_not_an_overflow(one_rank):
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)
    out = evaluate(model, batches(7, 1), torch.device("cpu"), max_batches=1)
    assert out["eval_loss"] > 710 and out["eval_ppl"] == math.inf  # exp(710) overflows a float


@pytest.mark.parametrize("every, due", [(0, [8]), (3, [3, 6, 8]), (4, [4, 8])])
def test_evaluation_is_due_every_n_steps_and_after_the_last(every, due):
    evaluator = Evaluator(None, list, torch.device("cpu"), every, 2)
    assert [step for step in range(1, 9) if evaluator.due(step, last=step == 8)] == due
