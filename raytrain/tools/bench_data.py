"""Data pipeline throughput: tokens/s of build_dataset on a local Ray cluster, per CPU core.

    python -m raytrain.tools.bench_data [--mib 8] [--seq-len 2048] [--num-cpus N]

Writes a generated corpus (Zipf-distributed made-up words, documents of a few hundred to a few
thousand words) as parquet, trains an 8k byte-level BPE tokenizer on it with `tokenizers` (about 5
bytes per token, like English), pre-tokenizes it, then times three pipelines end to end through Ray Data
(read -> tokenize -> pack, consumed on the driver):

- tokenize+pack with the built-in byte tokenizer (1 token per byte),
- tokenize+pack with the BPE tokenizer, loaded through AutoTokenizer like any Hugging Face one,
- pre-tokenized parquet (input_ids; no tokenizer work).

Each pipeline runs twice and the second (warm: Ray workers started, tokenizer loaded) is
reported. Tokens are the packed tokens that come out. "Per core" is tokens per CPU-second of the
driver and every process of the local Ray cluster (raylet, GCS, workers: all the pipeline's cost),
which stays meaningful on a shared machine where wall time mostly measures the neighbours; wall
tokens/s and the load average are printed next to it. A one-process, one-thread run of
`tokenize_and_pack` with no Ray shows what the tokenizer and packing cost alone. Record results in
docs/benchmarks.md.
"""

from __future__ import annotations

import math
import os
import platform
import random
import sys
import tempfile
import time

import numpy as np

from raytrain.config import DataConfig, ModelConfig
from raytrain.console import ArgumentParser
from raytrain.data.ingest import MicroBatches, ShardGroup
from raytrain.data.packing import tokenize_and_pack
from raytrain.data.pipeline import build_datasets
from raytrain.data.sources import inspect_sources
from raytrain.model import BYTE_EOS, load_model_config, load_tokenizer


def generate_corpus(num_bytes: int, seed: int = 0) -> list[str]:
    """Documents of made-up words with a Zipf word distribution (like natural text's)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng", "qu"]
    vocab = sorted({"".join(rng.choices(syllables, k=rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(30000)})
    rng.shuffle(vocab)
    weights = [1.0 / (rank + 1) for rank in range(len(vocab))]
    docs, size = [], 0
    while size < num_bytes:
        n_words = int(min(4000, max(50, rng.lognormvariate(6.0, 0.8))))
        words = rng.choices(vocab, weights, k=n_words)
        sentences, i = [], 0
        while i < n_words:
            k = rng.randint(5, 20)
            sentence = " ".join(words[i:i + k])
            sentences.append(sentence[:1].upper() + sentence[1:] + rng.choice(".....?!;,"))
            i += k
        doc = " ".join(sentences)
        docs.append(doc)
        size += len(doc)
    return docs


def train_bpe(docs: list[str], directory: str, vocab_size: int = 8192) -> str:
    """A byte-level BPE tokenizer trained on `docs`, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BYTE_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs[: max(1, len(docs) // 4)], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BYTE_EOS).save_pretrained(directory)
    return directory


def write_parquet(column: str, values: list, directory: str, num_files: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    per_file = math.ceil(len(values) / num_files)
    for i in range(num_files):
        pq.write_table(pa.table({column: values[i * per_file:(i + 1) * per_file]}),
                       os.path.join(directory, f"part-{i:03d}.parquet"))
    return directory


def time_pipeline(data, model, repeats: int = 2) -> dict[str, float]:
    """Packed tokens, wall seconds and CPU seconds (this process and every process of the local Ray
    cluster) of build_dataset consumed on the driver; the last of `repeats` passes."""
    for _ in range(repeats):
        cpu_before, start = _cpu_seconds(), time.perf_counter()
        tokens = 0
        for batch in _train_dataset(data, model).iter_batches(batch_size=256, batch_format="numpy"):
            tokens += batch["input_ids"].size
        seconds, cpu_after = time.perf_counter() - start, _cpu_seconds()
    cpu = sum(t - cpu_before.get(pid, 0.0) for pid, t in cpu_after.items())
    return {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu}


def _train_dataset(data, model):
    """The packed training dataset exactly as a run builds it (sources checked first)."""
    sources = inspect_sources(data)
    sources.say_notes()
    return build_datasets(data, model, 0, sources, load_model_config(model).vocab_size)["train"]


def _cpu_seconds() -> dict[int, float]:
    """User+system CPU seconds of this process and its descendants (the local Ray cluster's raylet,
    GCS and workers), by pid. On a shared machine this, not wall time, is what the work cost."""
    import psutil

    me = psutil.Process()
    out = {}
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:  # exited while we looked
            pass
    return out


def time_in_process(docs: list[str], model, seq_len: int, batch_size: int = 256) -> tuple[int, float]:
    """tokenize_and_pack in this process, the tokenizer limited to one thread: the cost per core."""
    load_tokenizer(model)
    start, tokens = time.process_time(), 0
    for i in range(0, len(docs), batch_size):
        batch = {"text": np.array(docs[i:i + batch_size], dtype=object)}
        tokens += tokenize_and_pack(batch, seq_len=seq_len, model=model, text_column="text",
                                    pretokenized=False).num_rows * seq_len
    return tokens, time.process_time() - start


def time_readers(data, model, micro_batch: int, step_ms: float) -> list[tuple[str, dict[str, float]]]:
    """The training worker's cost of turning a data shard into micro-batch tensors: raytrain's
    MicroBatches (fixed shards, world-size-independent position), reading on the training thread
    and prefetching (data.prefetch_batches), against Ray's iter_torch_batches (what raytrain used before; it
    prefetches two batches). Rows are materialized first so none waits on tokenization.

    Two passes each after a warm-up: back to back (the reader's throughput), then with a step of
    `step_ms` between calls, a sleep standing in for a step whose host thread waits on the GPU,
    where what counts is how long next() keeps the training thread waiting."""
    import torch

    rows = _train_dataset(data, model).materialize()

    def ray_batches(it):
        return iter(it.iter_torch_batches(batch_size=micro_batch, dtypes=torch.long, device="cpu", drop_last=True,
                                          prefetch_batches=2))

    def raytrain_batches(prefetch):
        # one shard, one micro-batch per optimizer step (step_rows: rows per shard per step)
        return lambda it: MicroBatches(ShardGroup([it], [0]), micro_batch, micro_batch, torch.device("cpu"), seed=0,
                                       shuffle_buffer_size=0, prefetch=prefetch)

    # One epoch's worth of micro-batches (all drop the last partial one); MicroBatches never ends,
    # so all stop at this count rather than at the epoch boundary (whose restart is not the reader's cost).
    n = rows.count() // micro_batch
    out = []
    prefetch = DataConfig().prefetch_batches
    for name, make in (("Ray iter_torch_batches (prefetch 2)", ray_batches),
                       ("raytrain MicroBatches, no prefetch", raytrain_batches(0)),
                       (f"raytrain MicroBatches, prefetch {prefetch} (default)", raytrain_batches(prefetch))):
        result = {"batches": n - 1}
        for attempt, step_s in ((0, 0.0), (1, 0.0), (2, step_ms / 1e3)):  # the first pass warms up
            batches = make(rows.streaming_split(1, equal=True)[0])
            start = time.perf_counter()
            assert next(batches)["input_ids"].shape[0] == micro_batch  # starts the split's execution
            first, steady, cpu, wait = time.perf_counter() - start, time.perf_counter(), time.process_time(), 0.0
            for _ in range(n - 1):
                time.sleep(step_s)
                t = time.perf_counter()
                assert next(batches)["input_ids"].shape[0] == micro_batch
                wait += time.perf_counter() - t
            if hasattr(batches, "close"):
                batches.close()
            if attempt == 1:
                result.update(seconds=time.perf_counter() - steady, cpu_seconds=time.process_time() - cpu,
                              first_s=first)
            elif attempt == 2:
                result["wait_s"] = wait
        out.append((name, result))
    return out


def main(argv: list[str] | None = None) -> int:
    # raytrain's parser: a bad flag is one `raytrain: error:` line, exit 2, as for every command (flags not abbreviated)
    parser = ArgumentParser(prog="python -m raytrain.tools.bench_data", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8, help="corpus size in MiB of text (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048, help="packed block length (default 2048)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="local cluster CPUs (default: all)")
    parser.add_argument("--micro-batch", type=int, default=24, help="micro-batch for the reader comparison (default 24)")
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="simulated step time between micro-batches for the reader's wait (default 20)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-data-") as work:
        _run(args, work)
    return 0


def _run(args, work: str) -> None:
    import ray
    import ray.data
    import tokenizers
    import transformers

    docs = generate_corpus(int(args.mib * 2**20))
    text_dir = write_parquet("text", docs, os.path.join(work, "text"), num_files=4 * args.num_cpus)
    bpe = ModelConfig(tokenizer=train_bpe(docs, os.path.join(work, "bpe")), config={"vocab_size": 8192})
    ids = [row.tolist() for row in _tokenize(docs, bpe)]
    ids_dir = write_parquet("input_ids", ids, os.path.join(work, "ids"), num_files=4 * args.num_cpus)
    n_bpe = sum(len(r) for r in ids)
    print(f"corpus: {len(docs):,} documents, {sum(map(len, docs)) / 2**20:.1f} MiB, "
          f"{n_bpe:,} BPE tokens ({sum(map(len, docs)) / n_bpe:.2f} bytes/token)", flush=True)

    # A fresh local cluster of exactly --num-cpus CPUs: never someone else's (address="local").
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    cases = [("tokenize+pack, byte tokenizer", DataConfig(path=text_dir, seq_len=args.seq_len), ModelConfig()),
             ("tokenize+pack, BPE 8k (AutoTokenizer)", DataConfig(path=text_dir, seq_len=args.seq_len), bpe),
             ("pre-tokenized parquet", DataConfig(path=ids_dir, seq_len=args.seq_len), bpe)]
    load_before = os.getloadavg()[0]
    results = []
    for name, data, model in cases:
        r = time_pipeline(data, model)
        results.append((name, r))
        print(f"  {name}: {r['tokens'] / r['cpu_seconds']:,.0f} tokens per CPU-second, "
              f"{r['tokens'] / r['seconds']:,.0f} tokens/s wall", flush=True)
    readers = time_readers(DataConfig(path=ids_dir, seq_len=args.seq_len), bpe, args.micro_batch, args.step_ms)
    ray.shutdown()

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the per-core cost of the tokenizer
    in_process = []
    for name, model in (("byte tokenizer", ModelConfig()), ("BPE 8k", bpe)):
        tokens, seconds = time_in_process(docs, model, args.seq_len)
        in_process.append((f"tokenize+pack, {name}", tokens / seconds))
    rows_ids = np.array([np.asarray(r, dtype=np.int64) for r in ids], dtype=object)
    start = time.process_time()
    tokens = sum(tokenize_and_pack({"input_ids": rows_ids[i:i + 256]}, seq_len=args.seq_len, model=bpe,
                                   text_column="text", pretokenized=True).num_rows * args.seq_len
                 for i in range(0, len(rows_ids), 256))
    in_process.append(("pack pre-tokenized", tokens / (time.process_time() - start)))
    load_after = os.getloadavg()[0]

    n = args.num_cpus
    print(f"\nraytrain.bench_data: {args.mib:g} MiB corpus, seq_len {args.seq_len}, {_cpu_model()}, {os.cpu_count()} "
          f"cores (load average {load_before:.1f} -> {load_after:.1f}); python {platform.python_version()}, "
          f"ray {ray.__version__}, tokenizers {tokenizers.__version__}, transformers {transformers.__version__}\n")
    print(f"Ray Data pipeline on a local cluster of {n} CPUs (second pass). Per core = tokens per CPU-second "
          f"of the driver and all Ray processes; wall = tokens / elapsed seconds on this (shared) machine.\n")
    print("| input | tokens | tokens/s per core (CPU time) | tokens/s wall | CPU s | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results:
        print(f"| {name} | {r['tokens']:,} | {r['tokens'] / r['cpu_seconds']:,.0f} | "
              f"{r['tokens'] / r['seconds']:,.0f} | {r['cpu_seconds']:.1f} | {r['seconds']:.1f} |")
    print(f"\nWorker-side reader, micro-batches of {args.micro_batch} x {args.seq_len} from one data shard of the "
          f"packed pre-tokenized rows (materialized: the reader's own cost), on the driver. Back to back, then "
          f"with a {args.step_ms:g} ms step (a sleep) between micro-batches:\n")
    print("| reader | first micro-batch ms | then: micro-batches | CPU ms per micro-batch | wall ms per micro-batch "
          f"| wait ms per micro-batch, {args.step_ms:g} ms step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in readers:
        print(f"| {name} | {1e3 * r['first_s']:.0f} | {r['batches']} | {1e3 * r['cpu_seconds'] / r['batches']:.2f} | "
              f"{1e3 * r['seconds'] / r['batches']:.2f} | {1e3 * r['wait_s'] / r['batches']:.2f} |")
    print("\nOne process, one thread, no Ray (tokenize_and_pack on 256-document batches, CPU time):\n")
    print("| work | tokens/s per core |")
    print("|---|---:|")
    for name, rate in in_process:
        print(f"| {name} | {rate:,.0f} |")


def _tokenize(docs: list[str], model) -> list[np.ndarray]:
    tok = load_tokenizer(model)
    return [np.asarray(x, dtype=np.int32) for x in tok(docs, add_special_tokens=False,
                                                      return_attention_mask=False)["input_ids"]]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
