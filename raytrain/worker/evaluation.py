"""Held-out evaluation inside the workers: mean loss and perplexity over the same batch count on every rank.

Start at `evaluate`. Under ZeRO-3 every forward pass gathers parameters with collectives, so all
ranks must run exactly the same number of forwards or the job hangs. `evaluate` therefore runs at
most `max_batches` and, before each one, agrees with the other ranks that every rank still has a
batch (one tiny all-reduce); if any rank's eval shard has run out, all stop together.

`Evaluator` is the loop's component: it decides when to evaluate (every data.eval_every_n_steps
and after the last step) over the shard Ray Train hands out for the "eval" dataset, and checks once,
before the first step, that the eval data holds a row at all: found at the first evaluation, often
after the last step and before its checkpoint, the same mistake would cost the whole run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from raytrain.console import emit
from raytrain.data.bad_records import BadRecord, stop_run
from raytrain.worker.engine import model_inputs, varlen_attention


class Evaluator:
    """When and on what to evaluate. `batches` opens one pass over this rank's eval shard."""

    def __init__(self, engine, batches: Callable[[], Iterable[dict[str, Any]]], device, every_n_steps: int,
                 max_batches: int, counter: str | None = None):
        self.engine, self.batches, self.device = engine, batches, device
        self.every, self.max_batches, self.counter = every_n_steps, max_batches, counter

    def due(self, step: int, last: bool) -> bool:
        return last or bool(self.every and step % self.every == 0)

    def check(self) -> None:
        """Every rank, before the first step: the eval data yields a batch, else one line and exit 2.
        Costs the start of one pass over the eval shard (its first blocks tokenized) per session."""
        batches = iter(self.batches())
        try:
            have = torch.tensor([0 if next(batches, None) is None else 1], dtype=torch.int32, device=self.device)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if not have.item():
            no_eval_rows(self.counter)

    def run(self) -> dict[str, float]:
        return evaluate(self.engine, self.batches(), self.device, self.max_batches, self.counter)


def no_eval_rows(counter: str | None) -> None:
    """The eval data holds not one row of data.seq_len tokens: the user's data, the same at every
    restart, so a bad record (one line, exit 2, no retry: raytrain.data.bad_records), not a failure."""
    record = BadRecord(None, "the eval data yields not one row of data.seq_len tokens",
                       "add eval data (data.eval_path, or a larger data.eval_fraction: it splits by document, and "
                       "a text file is one document unless data.text_document=line), lower data.seq_len, or remove "
                       "the eval settings")
    # The counter stops the run; this worker waits for it (no traceback). First, a while for the kill that
    # a group being stopped gets: its streams can end with no row.
    stop_run(record, counter, empty_stream=True)


def eval_batches(shard, micro_batch: int, device) -> Iterator[dict[str, Any]]:
    """One pass over this rank's eval shard: {"input_ids"(, "position_ids")} LongTensors on `device`.

    The last batch may hold fewer rows than `micro_batch`: the loss is weighed by predicted tokens
    (`evaluate`), and streaming_split(equal=True) gives every rank as many rows, so every rank runs
    as many forwards. (Dropping it made a small eval set evaluate nothing.)
    """
    for batch in shard.iter_torch_batches(batch_size=micro_batch, dtypes=torch.long, device=device,
                                          drop_last=False, prefetch_batches=2):
        yield batch


def evaluate(engine, eval_iterable: Iterable[dict[str, Any]], device, max_batches: int,
             counter: str | None = None) -> dict[str, float]:
    """{"eval_loss", "eval_ppl"}: the token-weighted mean next-token loss over all ranks, and exp of it.

    Every rank must call this at the same step. Runs at most `max_batches` batches per rank, the
    same number on every rank; no batch on some rank is the user's bad record (`no_eval_rows`).
    """
    was_training = engine.training
    engine.eval()
    one_row = varlen_attention(getattr(engine, "module", engine))
    # [sum of token losses, predicted tokens] in float64: the sum stays exact over many batches.
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    ran = 0
    batches = iter(eval_iterable)
    try:
        with torch.no_grad():
            while ran < max_batches:
                batch = next(batches, None)
                # Does every rank have a batch? One all-reduce per batch; this is also a device sync.
                have = torch.tensor([0 if batch is None else 1], dtype=torch.int32, device=device)
                dist.all_reduce(have, op=dist.ReduceOp.MIN)
                if not have.item():
                    break
                input_ids = batch["input_ids"]
                out = engine(**model_inputs(batch, one_row))
                loss = out.loss
                if getattr(out, "aux_loss", None) is not None:
                    # A mixture of experts with config.output_router_logits adds its router's load-balancing
                    # loss (x router_aux_loss_coef) to .loss: trained on, but no part of the next-token loss
                    # that eval_loss and its perplexity report.
                    model = getattr(engine, "module", engine)  # a DeepSpeed engine's model, or the model
                    loss = loss - model.config.router_aux_loss_coef * out.aux_loss
                # The model averages over the predicted tokens: all but the first of each row.
                predicted = input_ids.shape[0] * (input_ids.shape[1] - 1)
                totals[0] += loss.detach().double() * predicted
                totals[1] += predicted
                ran += 1
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # ends this rank's pass over the shard, so Ray Data can start the next one
        engine.train(was_training)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    if totals[1].item() == 0:
        no_eval_rows(counter)
    if ran < max_batches and dist.get_rank() == 0:
        emit(f"raytrain: eval ran {ran} of data.eval_max_batches={max_batches} batches per worker "
             f"(a worker's eval shard ran out)")
    mean = (totals[0] / totals[1]).item()
    return {"eval_loss": mean, "eval_ppl": math.exp(mean) if mean < 700 else math.inf}
