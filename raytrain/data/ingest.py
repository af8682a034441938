"""How packed training rows reach the workers, and the data position that makes resume exact.

Driver side, `ShardedIngest` (Ray Train's DataConfig): Ray Data splits the training dataset into
`data.num_shards` streams with `streaming_split(num_shards, equal=True)`, each holding the same
number of rows per epoch, and hands worker r the shards r, r + W, r + 2W, ... (W workers).

Worker side, `MicroBatches`: every micro-batch takes micro_batch / s rows from each of the worker's
s shards, so all shards advance in step. The position is then one pair, (epoch, rows taken from
each shard in that epoch), the same on every rank and independent of the world size. What a shard
holds depends only on the block order and num_shards (Ray Data keeps the order, and the split
ignores locality), and the shuffle below is seeded per shard, so:

- a restart (same world size) continues every shard exactly where it stopped;
- a restart on a different number of workers (num_shards divisible by both) reassigns whole shards
  to workers and continues each at the same row: no row is skipped or read twice.

Cost: resuming re-reads (and re-tokenizes) each shard's consumed prefix of the current epoch,
because a Ray Data stream cannot seek; earlier epochs are not re-read.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import ray.train
import torch

from raytrain import compat


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
        options = ray.train.DataConfig.default_ingest_options()
        options.preserve_order = True  # costs some pipelining slack; buys reproducible batches
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

    `position` is (epoch, rows per shard) to start at: what `position()` returned when the
    checkpoint was taken. An epoch ends for all ranks at once (every shard holds the same rows);
    each shard's tail of fewer than micro_batch / s rows is dropped (drop_last), so every rank
    yields the same number of micro-batches and none waits forever in a collective.

    With `prefetch` > 0 a background thread assembles that many micro-batches ahead (the host
    side: shard reads, shuffle, concatenation, pinning); the training thread only copies to the
    device. `position()` stays the position after the last micro-batch handed out, never after
    what was prefetched, so a checkpoint resumes exactly.
    """

    def __init__(self, group: ShardGroup, micro_batch: int, device, seed: int, shuffle_buffer_size: int,
                 position: tuple[int, int] = (0, 0), prefetch: int = 0):
        if micro_batch % len(group.shards):
            raise ValueError(f"micro-batch {micro_batch} is not divisible by the {len(group.shards)} shards")
        self.group, self.device, self.seed, self.shuffle_rows = group, device, seed, shuffle_buffer_size
        self.rows_per_shard = micro_batch // len(group.shards)
        self.epoch, self.rows = position  # of the next micro-batch handed out
        self._read_epoch, self._read_rows = position  # of the next micro-batch read
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
            host, position = self._read()
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._queue.put(item)  # every later call raises it too
                raise item
            host, position = item
        self.epoch, self.rows = position
        # Only the device copy happens here (pinned on GPU: it does not block the host). Any other
        # torch call would release the GIL, and getting it back from the prefetch thread costs up
        # to Python's 5 ms switch interval (a cast to long here: 0.2-7 ms per call; docs/benchmarks.md).
        return {k: t.to(self.device, non_blocking=True) for k, t in host.items()}

    def _prefetch(self) -> None:
        if self.device.type == "cuda":
            # A new thread's current device is GPU 0: pinning from there would open a CUDA context
            # (~500 MB) on GPU 0 in every worker process.
            torch.cuda.set_device(self.device)
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

    def _read(self) -> tuple[dict[str, Any], tuple[int, int]]:
        """The next micro-batch as host tensors, and the position after it."""
        while True:
            if self._readers is None:
                self._readers = self._start_epoch()
            parts = [reader.take(self.rows_per_shard) for reader in self._readers]
            if any(p is None for p in parts):
                if self._read_rows == 0:
                    raise RuntimeError(f"the training data yields no micro-batch of {self.rows_per_shard} rows per "
                                       f"shard (epoch {self._read_epoch}): add data, or lower data.seq_len or the "
                                       f"micro-batch size")
                for reader in self._readers:
                    reader.close()
                self._readers, self._read_epoch, self._read_rows = None, self._read_epoch + 1, 0
                continue
            self._read_rows += self.rows_per_shard
            host = {}
            for key in parts[0]:
                t = torch.from_numpy(np.concatenate([p[key] for p in parts]).astype(np.int64, copy=False))
                host[key] = t.pin_memory() if self.device.type == "cuda" else t
            return host, (self._read_epoch, self._read_rows)

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
        while skip and self._available():  # chunk by chunk: a long prefix never sits in memory
            step = min(skip, self._available())
            self._offset, skip = self._offset + step, skip - step
            self._fill(1)

    def take(self, n: int) -> dict[str, np.ndarray] | None:
        """The next n rows, or None at the end of the epoch (fewer than n rows left)."""
        if self._chunks is None:
            self.prime()
        self._fill(n)
        if self._available() < n:
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

    def _available(self) -> int:
        return 0 if self._buf is None else len(next(iter(self._buf.values()))) - self._offset

    def _fill(self, n: int) -> None:
        while self._available() < n:
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
