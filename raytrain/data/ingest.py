"""How packed training rows reach the workers, and the data position that makes resume exact.

Driver side, `ShardedIngest` (Ray Train's DataConfig): Ray Data splits the training dataset into
`data.num_shards` streams with `streaming_split(num_shards, equal=True)`, each holding the same
number of rows per epoch, and hands worker r the shards r, r + W, r + 2W, ... (W workers). It runs
again at every worker group start (a restart, or an elastic resize): fresh streams, dealt to the
new ranks.

Worker side, `MicroBatches`: every optimizer step takes `step_rows` = train_batch_size / num_shards
rows from each of the worker's shards (the same number at every world size), concatenates them
in shard order and cuts them into the step's micro-batches. All shards advance in step, so the
position is one pair, (epoch, rows taken from each shard in that epoch), the same on every rank
and independent of the world size; an epoch ends at a step boundary, when a shard has fewer than
`step_rows` rows left (that tail is dropped). What a shard holds depends only on the block order
and num_shards (Ray Data keeps the order, and the split ignores locality), and the shuffle below
is seeded per shard, so:

- a restart (same world size) continues every shard exactly where it stopped;
- a restart on a different number of workers (num_shards divisible by both) reassigns whole shards
  to workers and continues each at the same row: every step reads the same rows as it would at
  any other world size (only their grouping into micro-batches differs), none skipped, none twice.

(Cutting epochs per micro-batch instead, as raytrain did before, made the dropped tail
rows % (micro-batch / shards per worker), which depends on the world size: 2 -> 3 workers then read
other rows from the first epoch boundary on.)

Cost: resuming re-reads (and re-tokenizes) each shard's consumed prefix of the current epoch,
because a Ray Data stream cannot seek; earlier epochs are not re-read.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import ray.data
import ray.train

from raytrain import compat
from raytrain.data.progress import skipped


class ShardGroup(compat.SplitCoordinatorOwner):
    """The data shards of one worker: what `ray.train.get_dataset_shard("train")` returns.

    Posing as a StreamSplitDataIterator so that Ray Train shuts the (one, shared) split coordinator
    down with the worker group (see compat); read it with MicroBatches.
    """

    def __init__(self, shards: list, shard_ids: list[int]):
        super().__init__(compat.split_coordinator(shards[0]))
        self.shards, self.shard_ids = shards, shard_ids


class ShardedIngest(ray.train.DataConfig):
    """Ray Train's DataConfig with order preserved and the training set split into fixed shards."""

    def __init__(self, num_shards: int | None):
        # Ray Train's default_ingest_options() with preserve_order: built here because that function
        # passes the deprecated exclude_resources on and so warns in every run (ray 2.60.0).
        current = ray.data.DataContext.get_current().execution_options
        options = ray.data.ExecutionOptions(resource_limits=current.resource_limits,
                                            verbose_progress=current.verbose_progress,
                                            preserve_order=True)  # costs some pipelining slack; buys reproducible batches
        # Locality-aware splitting hands blocks to whichever shard sits near them, which differs
        # from run to run; without it a shard's rows are a pure function of the block order.
        # Cost: some blocks cross nodes once.
        super().__init__(execution_options=options, enable_shard_locality=False)
        self.num_shards = num_shards

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        # The eval set (evaluated from its start each time) keeps Ray Train's own split.
        output = super().configure({k: v for k, v in datasets.items() if k != "train"}, world_size,
                                   worker_handles, worker_node_ids, **kwargs)
        if "train" in datasets:
            num_shards = self.num_shards or world_size
            assert num_shards % world_size == 0, (num_shards, world_size)  # checked on the driver
            if datasets["train"].name is None:
                datasets["train"].set_name("train")  # as Ray Train names it (dashboard, logs)
            ds = datasets["train"].copy(datasets["train"])
            ds.context.execution_options = self._resolve_execution_options("train")
            shards = ds.streaming_split(num_shards, equal=True, locality_hints=None)
            for rank in range(world_size):
                ids = list(range(rank, num_shards, world_size))
                output[rank]["train"] = ShardGroup([shards[i] for i in ids], ids)
        return output


class MicroBatches:
    """Endless micro-batches ({"input_ids"[, "position_ids"]} tensors on `device`) from a ShardGroup.

    Each optimizer step reads `step_rows` rows from every shard (train_batch_size / num_shards,
    the same at every world size) and hands them out as micro-batches of `micro_batch` rows, in
    shard order. `position` is (epoch, rows per shard) to start at: what `position()` returned
    when the checkpoint was taken, always at a step boundary. An epoch ends for all ranks at once
    (every shard holds the same rows), at a step boundary; each shard's tail of fewer than
    `step_rows` rows is dropped, so every rank yields the same number of steps and none waits
    forever in a collective.

    With `prefetch` > 0 a background thread assembles that many micro-batches ahead (the host
    side: shard reads, shuffle, concatenation, pinning); the training thread only copies to the
    device. `position()` is the position after the last micro-batch handed out, never after what
    was prefetched; in the middle of a step it is that of the step's start (a step is resumed
    whole), so a checkpoint resumes exactly.

    `digests`: also keep an 8-byte digest of every row handed out (computed on the reading side),
    for `pop_digests` (the data audit of raytrain.worker.samples).

    `counter`: the run's counter actor (raytrain.data.progress), told when the data holds not one
    step: the user's mistake, which stops the run with one line and no retry (a bad record).
    """

    def __init__(self, group: ShardGroup, micro_batch: int, step_rows: int, device, seed: int,
                 shuffle_buffer_size: int, position: tuple[int, int] = (0, 0), prefetch: int = 0,
                 digests: bool = False, counter: str | None = None):
        rows_per_step = step_rows * len(group.shards)
        if rows_per_step % micro_batch:
            raise ValueError(f"a step of {step_rows} rows from each of {len(group.shards)} shards ({rows_per_step}) "
                             f"is not a whole number of micro-batches of {micro_batch}")
        # torch is imported here, in the worker, not at the module's top: Ray Train's dataset manager
        # (an actor of its own, started with every worker group) imports this module to unpickle
        # ShardedIngest, and torch would cost it ~1.6 CPU-seconds each time (tests/unit/test_layering.py).
        import torch

        self._torch = torch
        self.group, self.device, self.seed, self.shuffle_rows = group, device, seed, shuffle_buffer_size
        self.micro_batch, self.step_rows, self._digests = micro_batch, step_rows, digests
        self._counter = counter
        self.epoch, self.rows = position  # of the next micro-batch handed out
        self._read_epoch, self._read_rows = position  # after the step being read
        self._step: dict[str, np.ndarray] | None = None  # the step being cut into micro-batches
        self._step_offset = 0
        self._handed: list[str] = []
        self._readers: list[_ShardReader] | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if prefetch:
            self._queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._prefetch, name="raytrain-prefetch", daemon=True)
            self._thread.start()

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "rows": self.rows}

    def pop_digests(self) -> list[str]:
        """Digests of the rows handed out since the last call, in order (needs digests=True)."""
        out, self._handed = self._handed, []
        return out

    def close(self) -> None:
        """Stop reading: end the prefetch thread and let go of the shard streams while Ray is up.

        Streams left open are closed by the garbage collector, at interpreter exit, when Ray is
        down: Ray Data's end-of-iteration call then starts Ray again (measured: a process that
        hung connecting to a cluster long gone).
        """
        self._stop.set()
        if self._thread is not None:
            # It stops within 0.5 s unless blocked in a read, e.g. at Ray Data's epoch barrier
            # waiting for ranks that already stopped: then its streams are left as they are.
            self._thread.join(timeout=2)
            if self._thread.is_alive():
                return
        for reader in self._readers or []:
            reader.abandon()
        self._readers = None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        if self._queue is None:
            host, position, digests = self._read()
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._queue.put(item)  # every later call raises it too
                raise item
            host, position, digests = item
        self.epoch, self.rows = position
        if digests is not None:
            self._handed.extend(digests)
        # Only the device copy happens here (pinned on GPU: it does not block the host). Any other
        # torch call would release the GIL, and getting it back from the prefetch thread costs up
        # to Python's 5 ms switch interval (a cast to long here: 0.2-7 ms per call; docs/benchmarks.md).
        return {k: t.to(self.device, non_blocking=True) for k, t in host.items()}

    def _prefetch(self) -> None:
        if self.device.type == "cuda":
            # A new thread's current device is GPU 0: pinning from there would open a CUDA context
            # (~500 MB) on GPU 0 in every worker process.
            self._torch.cuda.set_device(self.device)
        try:
            while not self._stop.is_set():
                self._hand_over(self._read())
        except BaseException as e:  # handed to the training thread, raised from its next call
            self._hand_over(e)

    def _hand_over(self, item) -> None:
        # The queue is full while the training thread is busy: wait for room, or for close().
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                pass

    def _read(self) -> tuple[dict[str, Any], tuple[int, int], list[str] | None]:
        """The next micro-batch as host tensors, the position after it, and its rows' digests."""
        if self._step is None:
            self._step, self._step_offset = self._read_step(), 0
        part = {k: v[self._step_offset:self._step_offset + self.micro_batch] for k, v in self._step.items()}
        self._step_offset += self.micro_batch
        last = self._step_offset >= len(next(iter(self._step.values())))
        if last:
            self._step = None
        digests = [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in part["input_ids"]] \
            if self._digests else None
        host = {}
        for key, value in part.items():
            t = self._torch.from_numpy(value)
            host[key] = t.pin_memory() if self.device.type == "cuda" else t
        # mid-step: the step's start (a checkpoint is only ever taken at a step boundary)
        rows = self._read_rows if last else self._read_rows - self.step_rows
        return host, (self._read_epoch, rows), digests

    def _read_step(self) -> dict[str, np.ndarray]:
        """The next step's rows: step_rows from each shard, concatenated in shard order (int64)."""
        while True:
            if self._readers is None:
                self._readers = self._start_epoch()
            parts = [reader.take(self.step_rows) for reader in self._readers]
            if any(p is None for p in parts):
                if self._read_rows == 0:
                    if self._read_epoch == 0:  # the run's very start: the data holds not one step
                        self._no_step()
                    # Past epoch 0 the run has had steps, and every epoch holds the same rows per shard (an
                    # equal split): an epoch without one is a stream cut short, not the data. Seen in an elastic
                    # grow: the stopping group's prefetch thread read on into the next epoch while Ray Train tore
                    # its streams down, and its "no step" (a user's mistake: exit 2) ended the whole run. A
                    # worker failure instead, retried from the checkpoint; moot in a group being stopped.
                    raise RuntimeError(f"the training data's shard streams ended before one step of epoch "
                                       f"{self._read_epoch}, though earlier epochs of this run held steps: the "
                                       f"streams were cut short (their worker group stopping?)")
                # Each shard's tail of fewer than step_rows rows is not trained on this epoch: told to
                # the counter, as the tokenizer's tails are (the same rows every epoch without shuffle).
                # Keyed by shard and epoch, which the counter keeps once: a group resumed from a checkpoint
                # in this epoch reads to its end again, and the group it replaces (same run, same counter)
                # may have passed that end and told it already. Per shard, not per rank: a resume at another
                # world size deals the shards to other ranks. Cost: one fire-and-forget call per shard.
                for sid, reader, p in zip(self.group.shard_ids, self._readers, parts):
                    tail = reader.available() + (0 if p is None else len(next(iter(p.values()))))
                    skipped(self._counter, f"shard {sid} of epoch {self._read_epoch}", epoch_tail_rows=tail)
                for reader in self._readers:
                    reader.close()
                self._readers, self._read_epoch, self._read_rows = None, self._read_epoch + 1, 0
                continue
            self._read_rows += self.step_rows
            return {key: np.concatenate([p[key] for p in parts]).astype(np.int64, copy=False) for key in parts[0]}

    def _no_step(self) -> None:
        """Not one step in an epoch: the same at every restart, so a bad record (one line, exit 2)."""
        from raytrain.data.bad_records import BadRecord, stop_run

        # The same line from every rank: the counter keeps one (raytrain.data.progress.Counter).
        record = BadRecord(None, f"the training data yields no step of {self.step_rows} rows of data.seq_len "
                                 f"tokens per shard (epoch {self._read_epoch})",
                           "lower data.seq_len or raise data.tokenize_batch_size (each tokenize batch's tail "
                           "shorter than data.seq_len is dropped), add data, or lower train_batch_size or "
                           "data.num_shards")
        # The counter stops the run; this thread waits for it (no traceback). First, a while for the kill
        # that a group being stopped gets: its streams can end as if the data held no step.
        stop_run(record, self._counter, empty_stream=True)

    def _start_epoch(self) -> list[_ShardReader]:
        # Each shard's first read waits at Ray Data's epoch barrier until every shard of every
        # rank has started the epoch: this rank's shards must start together, not one by one.
        readers = [_ShardReader(it, (self.seed, self._read_epoch, sid), self.shuffle_rows, skip=self._read_rows)
                   for it, sid in zip(self.group.shards, self.group.shard_ids)]
        if len(readers) > 1:
            with ThreadPoolExecutor(len(readers)) as pool:
                list(pool.map(_ShardReader.prime, readers))
        return readers


class _ShardReader:
    """One shard's rows for one epoch: seeded window shuffle, the first `skip` rows dropped.

    The shuffle permutes consecutive windows of at least `shuffle_rows` rows (whole blocks), each
    with its own seed (training seed, epoch, shard, window index): the order is the same in every
    run, and the same whichever worker reads the shard.
    """

    def __init__(self, shard, seed: tuple[int, int, int], shuffle_rows: int, skip: int):
        self._shard, self._seed, self._shuffle_rows, self._skip = shard, seed, shuffle_rows, skip
        self._chunks: Iterator[dict[str, np.ndarray]] | None = None
        self._buf: dict[str, np.ndarray] | None = None
        self._offset = 0

    def prime(self) -> None:
        """Start the epoch (Ray Data's barrier) and apply the skip."""
        self._chunks = self._windows()
        self._fill(1)  # the first read crosses the barrier, even with nothing to skip
        skip = self._skip
        while skip and self.available():  # chunk by chunk: a long prefix never sits in memory
            step = min(skip, self.available())
            self._offset, skip = self._offset + step, skip - step
            self._fill(1)

    def take(self, n: int) -> dict[str, np.ndarray] | None:
        """The next n rows, or None at the end of the epoch (fewer than n rows left)."""
        if self._chunks is None:
            self.prime()
        self._fill(n)
        if self.available() < n:
            return None
        out = {k: v[self._offset:self._offset + n] for k, v in self._buf.items()}
        self._offset += n
        return out

    def close(self) -> None:
        """Read the shard to its end, so its stream finishes the epoch and the next one can start."""
        if self._chunks is not None:
            for _ in self._chunks:
                pass

    def abandon(self) -> None:
        """Close the stream now, wherever it stands (the end of reading, not of an epoch)."""
        if self._chunks is not None:
            self._chunks.close()
            self._chunks = None

    def available(self) -> int:
        """Rows read and not yet taken: at the end of an epoch, the shard's tail."""
        return 0 if self._buf is None else len(next(iter(self._buf.values()))) - self._offset

    def _fill(self, n: int) -> None:
        while self.available() < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                return
            rest = {k: v[self._offset:] for k, v in (self._buf or {}).items()}
            self._buf = {k: np.concatenate([rest[k], v]) if rest else v for k, v in chunk.items()}
            self._offset = 0

    def _blocks(self) -> Iterator[dict[str, np.ndarray]]:
        # Whole blocks (batch_size=None): their boundaries are part of the deterministic order.
        yield from self._shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)

    def _windows(self) -> Iterator[dict[str, np.ndarray]]:
        if not self._shuffle_rows:
            yield from self._blocks()
            return
        window: list[dict[str, np.ndarray]] = []
        rows = index = 0
        for block in self._blocks():
            window.append(block)
            rows += len(next(iter(block.values())))
            if rows >= self._shuffle_rows:
                yield self._shuffled(window, index)
                window, rows, index = [], 0, index + 1
        if window:
            yield self._shuffled(window, index)

    def _shuffled(self, window: list[dict[str, np.ndarray]], index: int) -> dict[str, np.ndarray]:
        joined = {k: np.concatenate([b[k] for b in window]) for k in window[0]}
        order = np.random.default_rng([*self._seed, index]).permutation(len(next(iter(joined.values()))))
        return {k: v[order] for k, v in joined.items()}
