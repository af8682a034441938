"""The run's counter: tokenization progress, skipped documents, bad records, the step reached.

Start at `DataProgress`, which the driver builds before the datasets and enters around
`trainer.fit()`. Its pieces:
- `Counter`, a named Ray actor (no CPU), one per run, that adds up what the tasks report.
- the Ray Data tasks report to it fire-and-forget (`report`, `FileReads`): `read_documents` the
  bytes of each file and the documents they held, `tokenize_and_pack` its rows, documents and
  tokens once per batch. With no counter (a dataset built outside `fit`, unit tests) they do nothing.
- a driver thread reads it every `data.progress_every_s` and prints one line, which reaches the
  terminal and `ray job logs`:
  `raytrain: data: pass 1: 1.97 GB of 4.80 GB (41%), 12.5 MB/s, ETA 4m12s; tokenized 1.23M documents, 310M tokens`
- what the data policies skip (`skipped`: empty documents, invalid UTF-8 decoded as U+FFFD) and
  the bad records that stop the run (`bad_record`, raytrain.data.bad_records), from the training
  and the evaluation data, and the step the run reached (rank 0 reports it): the driver prints
  them once, when the run ends (`RunSummary`). The counter also holds the Ray Train
  controller of the run, so that the first bad record stops it at once (raytrain.compat).

What "of" counts: input bytes for text/JSON files and save_to_disk directories (file sizes from the
listing), rows for parquet (from the footers, summed by the thread so the start never waits), the
documents of the built-in corpus; a hub dataset streams with no known size (counts and rate only).
Bytes are those of the documents tokenized so far, not merely read: Ray Data reads ahead of the
tokenizer (as far as its buffers allow), so the read bytes are scaled by the share of the documents
read that has been tokenized. The data is read once per epoch and a resumed run re-reads its
epoch's prefix, so the line names the pass over the data (counted since this driver started) and
the percent within it.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from raytrain.config import DataConfig
from raytrain.console import format_count, say, status

COUNTS = ("documents", "tokens", "rows", "bytes", "rows_read")
"""Tokenized documents (non-empty, on the training side of an eval split), their tokens (EOS
included), rows given to the tokenizer (and a parquet file's empty rows, which its reader skips);
input bytes read, and the rows the file readers made of them."""
REPORT_EVERY_S = 1.0
"""A task sends a long file's bytes at most this often (and when the file ends): actor calls stay few."""


SKIPS = {"empty": "empty documents skipped (null, \"\", a missing key, an empty file or id list)",
         "invalid_utf8": "documents with invalid UTF-8 decoded with U+FFFD replacement characters "
                         "(data.invalid_utf8=error stops on them instead)",
         "lone_surrogate": "documents with lone UTF-16 surrogates (JSON \\ud800-\\udfff escapes) read as U+FFFD "
                           "(data.invalid_utf8=error stops on them instead)",
         "tail_tokens": "tokens{share} dropped at the end of tokenize batches, each tail shorter than "
                        "data.seq_len, counted at every read of the data (a larger data.tokenize_batch_size drops "
                        "fewer)",
         "epoch_tail_rows": "rows of data.seq_len tokens left out at the ends of epochs, each shard's tail shorter "
                            "than one step's rows (train_batch_size / shards; data.shuffle_buffer_size varies which "
                            "rows)"}
"""What the data policies skip or change, by the name the tasks report them under. "packed_tokens",
also reported, is no skip: all the tokens packing was given, the share `tail_tokens` is of."""


@dataclass
class RunSummary:
    """What the counter holds at the end of a run (`Counter.summary`)."""

    bad_record: Any = None
    """The first bad record (raytrain.data.bad_records.BadRecord) with `more` set, or None."""
    skipped: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    """SKIPS key -> (count, where the first one was)."""
    step: int | None = None
    """The last step the workers reported to Ray Train in this session (None: none yet)."""

    def skipped_line(self) -> str | None:
        """`raytrain: data: 12 empty documents skipped (...), the first in FILE; ...`, or None."""
        counts = dict(self.skipped)
        packed = counts.pop("packed_tokens", (0, None))[0]
        share = f" ({counts.get('tail_tokens', (0,))[0] / packed:.1%} of {packed:,} tokenized)" if packed else ""
        parts = [f"{n:,} {SKIPS[kind]}".replace("{share}", share) + (f", the first in {where}" if where else "")
                 for kind, (n, where) in sorted(counts.items()) if n]
        return "raytrain: data: " + "; ".join(parts) if parts else None


class Counter:
    """The run's counters (the actor's body): tasks `add`, `skipped` and report bad records, the
    controller `watch_run`s, rank 0 tells the step `reached`; the driver reads `counts` and `summary`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._counts = dict.fromkeys(COUNTS, 0)
        self._first: float | None = None
        self._skipped: dict[str, tuple[int, str | None]] = {}
        self._skipped_files: dict[str, dict[str, int]] = {}
        self._bad = None
        self._more_bad = 0
        self._step: int | None = None
        self._controller = None

    def add(self, **counts: int) -> None:
        if self._first is None:
            self._first = self._clock()
        for key, n in counts.items():
            self._counts[key] += n

    def counts(self) -> dict[str, float]:
        """The totals, and elapsed_s since the first report (timed here, so node clocks don't matter)."""
        return {**self._counts, "elapsed_s": 0.0 if self._first is None else self._clock() - self._first}

    def skipped(self, where: str | None = None, **counts: int) -> None:
        """`counts` of one file (`where`: its count, the same at every read of the file, is kept once:
        the data is read at every epoch, every evaluation and by the eval check, and with
        data.eval_fraction by both pipelines), of one shard's epoch (its tail: a resumed epoch is read again),
        or of one batch (None: added up)."""
        for kind, n in counts.items():
            if where is not None:
                files = self._skipped_files.setdefault(kind, {})
                n, files[where] = n - files.get(where, 0), max(n, files.get(where, 0))
                if n <= 0:
                    continue
            total, first = self._skipped.get(kind, (0, None))
            self._skipped[kind] = (total + n, first or where)

    def bad_record(self, record) -> None:
        """A task found a bad record: the first one stops the run (the others are counted)."""
        if self._bad is not None:
            self._more_bad += not record.same(self._bad)
            return
        self._bad = record
        if self._controller is not None:
            from raytrain import compat

            compat.abort_train_run(self._controller)

    def more_bad_records(self, n: int) -> None:
        self._more_bad += n

    def watch_run(self, controller) -> None:
        """Ray Train's controller of this run (raytrain.compat): stopped by the first bad record."""
        self._controller = controller
        if self._bad is not None:  # found before the controller said where it is
            from raytrain import compat

            compat.abort_train_run(controller)

    def controller(self):
        return self._controller

    def stopped(self) -> bool:
        """Whether a bad record has stopped the run."""
        return self._bad is not None

    def reached(self, step: int) -> None:
        self._step = step

    def summary(self) -> RunSummary:
        bad = self._bad.with_more(self._more_bad) if self._bad is not None else None
        return RunSummary(bad_record=bad, skipped=dict(self._skipped), step=self._step)


def report(progress: str | None, **counts: int) -> None:
    """Add `counts` to the counter actor named `progress`; nothing when there is none."""
    actor = _counter(progress) if progress else None
    if actor is not None:
        actor.add.remote(**counts)  # fire-and-forget: a reader never waits on the counter


def skipped(counter: str | None, where: str | None = None, **counts: int) -> None:
    """Count documents a data policy skipped or changed (SKIPS keys), fire-and-forget."""
    actor = _counter(counter) if counter else None
    if actor is not None and any(counts.values()):
        actor.skipped.remote(where, **{k: n for k, n in counts.items() if n})


def bad_record(counter: str, record) -> None:
    """Report a task's first bad record, and wait until the counter has it (it stops the run)."""
    import ray

    actor = _counter(counter)
    if actor is None:  # the run is gone already
        raise record
    ray.get(actor.bad_record.remote(record))


def reached(counter: str, step: int) -> None:
    """Rank 0 reached `step` (fire-and-forget)."""
    actor = _counter(counter)
    if actor is not None:
        actor.reached.remote(step)


def more_bad_records(counter: str, n: int) -> None:
    actor = _counter(counter)
    if actor is not None:
        actor.more_bad_records.remote(n)


@functools.lru_cache(maxsize=16)
def _counter(name: str):
    """The counter actor, looked up once per worker process (Ray reuses them for many tasks)."""
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:  # not running: the dataset is read outside `fit`
        return None


class FileReads:
    """Bytes of one input file read so far and the documents made of them, reported together at
    most every REPORT_EVERY_S and when the file ends."""

    def __init__(self, progress: str | None, clock: Callable[[], float] = time.monotonic):
        self._progress, self._clock = progress, clock
        self._position = self._reported = 0
        self._rows = self._reported_rows = 0
        self._last = clock()

    def at(self, position: int) -> None:
        """The read reached byte `position` of the file (a read again after an error that may pass starts at 0
        again: raytrain.data.readers._with_retries; the furthest position is kept, so nothing goes backwards)."""
        self._position = max(self._position, position)
        if self._clock() - self._last >= REPORT_EVERY_S:
            self._send()

    def count(self, documents: Iterator[Any]) -> Iterator[Any]:
        """`documents`, the file's rows, passed through and counted."""
        if not self._progress:
            yield from documents
            return
        for document in documents:
            self._rows += 1
            yield document

    def counting(self, stream):
        """`stream` with every read counted: for an uncompressed stream, whose bytes are the file's."""
        return _CountedStream(stream, self) if self._progress else stream

    def close(self, size: Callable[[], int] | None = None) -> None:
        """The file ended. `size()`: the file's size, where the counted reads fall short of it (a
        compressed file, whose reads are not counted; an Arrow stream's end marker)."""
        if self._progress and size is not None:
            try:
                self._position = size()
            except OSError:  # a storage's blip at the very end: the file was read, its counted bytes stand
                pass
        self._send()

    def _send(self) -> None:
        if self._position > self._reported or self._rows > self._reported_rows:
            report(self._progress, bytes=self._position - self._reported, rows_read=self._rows - self._reported_rows)
            self._reported, self._reported_rows = self._position, self._rows
        self._last = self._clock()


class _CountedStream:
    def __init__(self, stream, reads: FileReads):
        self._stream, self._reads, self._position = stream, reads, 0

    def read(self, *nbytes):
        data = self._stream.read(*nbytes)
        self._position += len(data)
        self._reads.at(self._position)
        return data


def progress_line(now: dict[str, float], before: dict[str, float] | None, unit: str,
                  total: float | None) -> str:
    """One line from two readings of the counter (`before`: the previous one, for the rate)."""
    done = tokenized(now, unit)
    window = now["elapsed_s"] - (before["elapsed_s"] if before else 0.0)
    # The rate over the last interval, not since the start: a resumed run re-reads its epoch's
    # prefix much faster than training consumes data, which would make the ETA far too short.
    rate = (done - (tokenized(before, unit) if before else 0.0)) / window if window > 0 else None
    if total is None:
        where = status(done, None, rate, unit)
    else:
        pass_ = max(1, math.ceil(done / total))  # exactly at the end of a pass: that pass, 100%
        where = f"pass {pass_}: {status(done - (pass_ - 1) * total, total, rate, unit)}"
    return (f"raytrain: data: {where}; tokenized {format_count(now['documents'])} documents, "
            f"{format_count(now['tokens'])} tokens")


def tokenized(counts: dict[str, float], unit: str) -> float:
    """How much of the input is tokenized, in `unit`: rows, or the bytes read scaled by the share
    of the rows read that the tokenizer has had (a file's reports come at most once a second, so
    the tokenizer can be briefly ahead of them)."""
    if unit != "B":
        return counts["rows"]
    return counts["bytes"] * min(1.0, counts["rows"] / counts["rows_read"]) if counts["rows_read"] else 0.0


def input_total(source: Any, num_builtin_documents: int) -> tuple[str, float | None]:
    """(unit, size of one pass) of a raytrain.data.Source; None when unknown (a hub dataset)."""
    if source.format == "builtin":
        return "documents", float(num_builtin_documents)
    if source.hub_id is not None:
        return "documents", None
    if source.format in ("parquet", "tokenized"):
        import pyarrow.parquet as pq

        # One footer read per file: seconds for thousands of remote files, hence in the thread.
        return "rows", float(sum(pq.ParquetFile(source.filesystem.open_input_file(f)).metadata.num_rows
                                 for f in source.files))
    return "B", float(sum(info.size for info in source.filesystem.get_file_info(source.files)))


class DataProgress:
    """The run's counter, on the driver: `track` the training data's source in `build_datasets` (the
    progress lines), `name` for every task's skips and bad records; `with progress: trainer.fit()`
    starts the counter actor (and, with data.progress_every_s, the printing thread) and ends both.

    Evaluation data is not counted in the progress lines: it is re-read at every evaluation and
    would show up as passes over the training data (its skips and bad records are counted).
    """

    def __init__(self, data: DataConfig, run_name: str):
        self.every_s = data.progress_every_s
        self._num_builtin_documents = data.num_builtin_documents
        # Unique per fit: Ray Data worker processes outlive a run and cache the actor by name.
        self.name = f"raytrain-data-{run_name}-{uuid.uuid4().hex[:8]}"
        self._source = None
        self._actor = self._thread = None
        self._stop = threading.Event()

    def track(self, source: Any) -> str | None:
        """Count reads of `source`; returns the counter's name for the tasks (None: progress off)."""
        self._source = source
        return self.name if self.every_s else None

    def __enter__(self) -> DataProgress:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the driver's node, never a worker node: it holds the run's bookkeeping (the counts, the
        # first bad record, the step reached, the controller's handle for Ctrl-C), and a worker node
        # may go (seen in the elastic test: the counter died with a killed node, and Ctrl-C after it
        # ended in ActorDiedError). Where the driver's node dies, the run ends anyway.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._actor = ray.remote(num_cpus=0)(Counter).options(name=self.name, scheduling_strategy=here).remote()
        if self.every_s and self._source is not None:
            self._thread = threading.Thread(target=self._watch, name="raytrain-data-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        import ray

        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
        if self._actor is not None:
            ray.kill(self._actor)
            self._actor = None

    @property
    def actor(self):
        """The counter actor (inside the `with` block)."""
        return self._actor

    def summary(self, timeout_s: float = 60) -> RunSummary:
        """What the counter holds now (Counter.summary); only inside the `with` block."""
        import ray

        return ray.get(self._actor.summary.remote(), timeout=timeout_s)

    def stopped_by_bad_record(self, timeout_s: float = 60) -> bool:
        """Whether a bad record has stopped the run (Counter.stopped); only inside the `with` block."""
        import ray

        return ray.get(self._actor.stopped.remote(), timeout=timeout_s)

    def counts(self, timeout_s: float = 60) -> dict[str, float]:
        """The counter's totals now (Counter.counts); only inside the `with` block."""
        import ray

        return ray.get(self._actor.counts.remote(), timeout=timeout_s)

    def _watch(self) -> None:
        import ray

        try:
            unit, total = input_total(self._source, self._num_builtin_documents)
        except Exception as e:  # a listing or footer that cannot be read: still show counts and rate
            say(f"raytrain: data: the size of the training data is unknown ({e}): no percent or ETA", err=True)
            unit, total = ("B" if self._source.format in ("text", "json", "csv", "hf") else "rows"), None
        before = None
        while not self._stop.wait(self.every_s):
            try:
                now = self.counts()
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue  # the run is ending, or the head is busy: the next reading will tell
            if not now["rows"] or (before is not None and all(now[k] == before[k] for k in COUNTS)):
                continue  # nothing tokenized yet, or since the last line (the data is buffered ahead)
            say(progress_line(now, before, unit, total))
            before = now
