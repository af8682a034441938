"""Training data on the driver: the Ray Data graph that reads a source, tokenizes and packs it.

Start at `build_datasets`, which the driver calls with the sources it checked first
(raytrain.data.sources.inspect_sources: one-line ConfigErrors naming the key). Tokenization runs as Ray Data tasks (raytrain.data.readers, raytrain.data.packing) on the
cluster's CPUs while the workers train; each worker reads its share of the packed rows through
raytrain.data.ingest. The tasks report what they read to the run's progress counter
(raytrain.data.progress), which the driver prints.

Held-out data: `data.eval_path` (read like `data.path`), or `data.eval_fraction` of `data.path`'s
documents chosen by a hash of each document's content: the same split in every run, train and
eval never share a document (identical duplicates land on the same side).
"""

from __future__ import annotations

from typing import Any

import ray.data

from raytrain.config import DataConfig, ModelConfig
from raytrain.data.builtin import builtin_corpus
from raytrain.data.packing import tokenize_and_pack
from raytrain.data.progress import DataProgress
from raytrain.data.readers import read_documents, read_parquet_rows
from raytrain.data.sources import Source, Sources


def build_datasets(data: DataConfig, model: ModelConfig, seed: int, sources: Sources, vocab_size: int,
                   progress: DataProgress | None = None) -> dict[str, Any]:
    """{"train": ...(, "eval": ...)}: packed rows of {"input_ids": int32[seq_len]} (+ "position_ids").

    `vocab_size` (the model's embedding rows) makes a token id beyond it a data error instead of a
    crash on the GPU; `progress` (the run's counter) counts what the training data's tasks read (never the eval data)
    and is told every task's skipped documents and bad records.
    """
    # Ray Data's tqdm bars redraw into every log line (and into `ray job logs`) as escape codes;
    # progress is in raytrain's own lines instead (raytrain.data.progress, and data_wait).
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False  # "Starting execution of Dataset ..." and its plan, every epoch
    split = "train" if data.eval_fraction else None
    counter = progress.name if progress is not None else None
    out = {"train": _build(data, model, seed, sources.train, split, vocab_size,
                           progress.track(sources.train) if progress is not None else None, counter)}
    if sources.eval is not None:
        out["eval"] = _build(data, model, seed, sources.eval, "eval" if data.eval_fraction else None, vocab_size,
                             None, counter)
    return out


def _build(data: DataConfig, model: ModelConfig, seed: int, source: Source, split: str | None, vocab_size: int,
           progress: str | None, counter: str | None):
    if source.format == "builtin":
        ds = ray.data.from_items([{"text": t} for t in builtin_corpus(data.num_builtin_documents, seed)])
    elif source.format in ("text", "json", "csv", "hf") and source.hub_id is None:
        # One task per file: flat_map (unlike map_batches) is not fused into the tokenizer's
        # batches, which would otherwise pull tokenize_batch_size *files* into one task.
        ds = ray.data.from_items([{"path": f} for f in source.files], override_num_blocks=len(source.files))
        ds = ds.flat_map(read_documents, fn_kwargs={
            "format": source.format, "filesystem": source.filesystem, "text_column": data.text_column,
            "text_document": data.text_document, "invalid_utf8": data.invalid_utf8, "progress": progress,
            "counter": counter})
    elif source.format in ("parquet", "tokenized"):
        # Not ray.data.read_parquet: a damaged file failed its read task with a raw OSError (retried,
        # then a worker failure); read_parquet_rows makes it a bad record naming the file. One task
        # per file, a flat_map for the reason above.
        ds = ray.data.from_items([{"path": f} for f in source.files], override_num_blocks=len(source.files))
        ds = ds.flat_map(read_parquet_rows, fn_kwargs={
            "filesystem": source.filesystem, "column": source.column,
            "pretokenized": source.format == "tokenized", "counter": counter, "progress": progress})
    else:  # a hub dataset, streamed: nothing is downloaded on the driver
        import datasets  # only for hub datasets: its import costs ~2 s

        hub = datasets.load_dataset(source.hub_id, split=source.split, streaming=True)
        ds = ray.data.from_huggingface(hub.select_columns([data.text_column]))
    fn_kwargs = {"seq_len": data.seq_len, "model": model, "text_column": source.column,
                 "pretokenized": source.format == "tokenized", "position_ids": data.position_ids,
                 "split": split, "eval_fraction": data.eval_fraction, "vocab_size": vocab_size, "progress": progress,
                 "counter": counter}
    return ds.map_batches(tokenize_and_pack, fn_kwargs=fn_kwargs, batch_size=data.tokenize_batch_size,
                          batch_format="numpy", concurrency=data.tokenize_concurrency)
