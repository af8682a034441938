"""The worker's reader (raytrain.data.ingest.MicroBatches) without Ray: the steps and micro-batches it cuts, the
data position it reports (the step's start in the middle of a step), a reader started at a position reading on
exactly as the uninterrupted one, the seeded window shuffle, the epoch's end, prefetch and close.

A shard here is a plain iterable of numpy blocks (`Shard`), read where the reader's one Ray Data call,
`iter_batches(batch_size=None)` in `_ShardReader._blocks`, would give them: everything past that line takes any
iterable of blocks. That line, the driver's split (`ShardedIngest.configure`) and the reader on real Ray Data
splits and inside Ray Train workers: tests/integration/test_ingest.py and test_fault_tolerance.py."""

import hashlib
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from raytrain.config import ConfigError
from raytrain.data import ingest, progress


class Shard:
    """One shard's rows, the same blocks every epoch: row i of shard `sid` has id 1000 * sid + i. Records each
    read (an epoch): blocks yielded, read to the end or closed, and the thread that read it."""

    def __init__(self, sid, sizes, barrier=None, gate=None):
        ids = np.arange(sum(sizes)) + 1000 * sid
        self.sid, self.barrier, self.gate = sid, barrier, gate  # gate: (block index, Event) the read waits for
        self.blocks = [{"input_ids": np.stack([b, -b], axis=1).astype(np.int32),
                        "position_ids": np.tile(np.arange(2, dtype=np.int32), (len(b), 1))}
                       for b in np.split(ids, np.cumsum(sizes)[:-1])]
        self.reads = []

    def __iter__(self):
        read = {"blocks": 0, "finished": False, "closed": False, "thread": threading.current_thread()}
        self.reads.append(read)
        try:
            if self.barrier is not None:  # as Ray Data's epoch barrier: the first read waits for every shard's
                self.barrier.wait()
            for k, block in enumerate(self.blocks):
                if self.gate is not None and self.gate[0] == k:
                    self.gate[1].wait()
                read["blocks"] += 1
                yield block
            read["finished"] = True
        except GeneratorExit:
            read["closed"] = True
            raise


@pytest.fixture(autouse=True)
def plain_shards(monkeypatch):
    """A shard's blocks come from iterating it: the one line that calls Ray Data's iter_batches."""
    monkeypatch.setattr(ingest._ShardReader, "_blocks", lambda self: iter(self._shard))


@pytest.fixture
def told(monkeypatch):
    """What the reader tells the run's counter, collected here instead."""
    out = []
    monkeypatch.setattr(ingest, "skipped", lambda counter, where=None, **counts: out.append((counter, where, counts)))
    return out


def micro_batches(shards, micro, step_rows, shuffle=0, **kwargs):
    group = SimpleNamespace(shards=shards, shard_ids=[s.sid for s in shards])  # all it reads of a ShardGroup
    return ingest.MicroBatches(group, micro, step_rows, torch.device("cpu"), seed=7, shuffle_buffer_size=shuffle,
                               **kwargs)


def handed_out(batches, n):
    """The next n micro-batches: each one's row ids, and the position after it as (epoch, rows)."""
    return [(b["input_ids"][:, 0].tolist(), tuple(batches.position().values())) for b in itertools.islice(batches, n)]


def test_every_step_takes_step_rows_from_each_shard_in_shard_order_and_an_epoch_ends_at_a_step(told):
    # 7 rows per shard in blocks of 2, 1 and 4; 3 rows from each of 2 shards a step, in micro-batches of 2
    shards = [Shard(0, [2, 1, 4]), Shard(1, [2, 1, 4])]
    batches = micro_batches(shards, micro=2, step_rows=3, counter="run")
    assert batches.position() == {"epoch": 0, "rows": 0}
    first = next(batches)
    assert {k: (t.dtype, t.tolist()) for k, t in first.items()} == {
        "input_ids": (torch.int64, [[0, 0], [1, -1]]), "position_ids": (torch.int64, [[0, 1], [0, 1]])}
    assert batches.position() == {"epoch": 0, "rows": 0}  # in the middle of a step: the step's start
    assert handed_out(batches, 8) == [([2, 1000], (0, 0)), ([1001, 1002], (0, 3)),
                                      ([3, 4], (0, 3)), ([5, 1003], (0, 3)), ([1004, 1005], (0, 6)),
                                      ([0, 1], (1, 0)), ([2, 1000], (1, 0)), ([1001, 1002], (1, 3))]
    # row 6 of each shard, left out of epoch 0: told per shard and epoch, which the counter keeps once
    assert told == [("run", "shard 0 of epoch 0", {"epoch_tail_rows": 1}),
                    ("run", "shard 1 of epoch 0", {"epoch_tail_rows": 1})]
    # each shard is read once an epoch, to its end (a resumed epoch alone re-reads a prefix)
    assert [[r["finished"] for r in s.reads] for s in shards] == [[True, False]] * 2
    # a shard that holds whole steps ends its epoch with its last row and leaves none out
    told.clear()
    batches = micro_batches([Shard(3, [2, 4])], micro=3, step_rows=3, counter="run")
    assert handed_out(batches, 3) == [([3000, 3001, 3002], (0, 3)), ([3003, 3004, 3005], (0, 6)),
                                      ([3000, 3001, 3002], (1, 3))]
    assert told == [("run", "shard 3 of epoch 0", {"epoch_tail_rows": 0})]


@pytest.mark.parametrize("shuffle", [0, 3])
def test_a_reader_started_at_any_step_boundary_reads_on_as_the_uninterrupted_one(shuffle):
    def shards():  # 10 rows each: 3 steps of 3 rows an epoch, 1 row left out
        return [Shard(sid, [2, 1, 4, 3]) for sid in (0, 1)]

    full = handed_out(micro_batches(shards(), micro=3, step_rows=3, shuffle=shuffle), 18)  # 3 epochs, 2 per step
    assert [p for _, p in full] == [(e, r) for e in range(3) for r in (0, 3, 3, 6, 6, 9)]
    for k in range(1, 9):
        position = full[2 * k - 1][1]
        for prefetch in (0, 2):
            resumed = micro_batches(shards(), micro=3, step_rows=3, shuffle=shuffle, position=position,
                                    prefetch=prefetch)
            assert handed_out(resumed, 18 - 2 * k) == full[2 * k:], (position, prefetch)
            resumed.close()


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4), (4, 1)], ids=lambda s: f"{s[0]}-to-{s[1]}-workers")
def test_each_epochs_left_out_rows_count_once_across_a_resume_at_any_world_size(monkeypatch, sizes):
    """A group that read past the epoch's end (and told the counter its tail) and failed, resumed from a
    checkpoint inside that epoch (its last step, or earlier), reads to the epoch's end again: the run's one
    counter (a restart in the same `fit`) must keep that epoch's tail once. Also a group that failed before
    the epoch's end (not told): the resumed one tells it. The same with the shards dealt to more or fewer
    workers at the resume, and with the failed group's prefetch reading ahead: past the epoch's end before a
    checkpoint at its last step is even taken."""

    def group(world_size, position, prefetch):
        """Each rank's reader: rank r reads shards r, r + W, ... of 4, with 11 rows each (5 steps of 2
        rows an epoch, 1 row left out), in micro-batches of 2."""
        return [micro_batches([Shard(sid, [2, 1, 4, 3, 1]) for sid in range(rank, 4, world_size)], micro=2,
                              step_rows=2, position=position, prefetch=prefetch, counter="run")
                for rank in range(world_size)]

    def read_steps(ranks, n):
        for batches in ranks:
            list(itertools.islice(batches, n * len(batches.group.shards)))  # a step: one micro-batch per shard
        return {tuple(batches.position().values()) for batches in ranks}

    def close(ranks):  # together, as the ranks do: each waits up to 0.5 s for its prefetch thread
        with ThreadPoolExecutor(len(ranks)) as pool:
            list(pool.map(ingest.MicroBatches.close, ranks))

    before, after = sizes
    # checkpoints at epoch 0's last step and in its middle; the failure at step 7 (in epoch 1, read ahead to
    # step 10 at most: never past epoch 1's end) or at the checkpoint itself
    for checkpoint, failure, prefetch in itertools.product((5, 3), ("step 7", "checkpoint"), (0, 2)):
        counter = progress.Counter()  # the counter actor's body: what the reader tells it, handed to it here
        monkeypatch.setattr(ingest, "skipped", lambda name, where=None, **counts: counter.skipped(where, **counts))
        ranks = group(before, (0, 0), prefetch)
        position = read_steps(ranks, checkpoint).pop()
        assert position == (0, 2 * checkpoint)
        read_steps(ranks, 7 - checkpoint if failure == "step 7" else 0)
        close(ranks)
        ranks = group(after, position, 0)  # a resumed reader with prefetch: the test above
        assert read_steps(ranks, 11 - checkpoint) == {(2, 2)}  # 11 steps in all: epochs 0 and 1 ended
        close(ranks)
        # epochs 0 and 1 each left out 1 row of each of the 4 shards
        assert counter.summary().skipped["epoch_tail_rows"][0] == 8, (checkpoint, failure, prefetch)


def test_the_shuffle_permutes_windows_of_whole_blocks_seeded_by_seed_epoch_shard_and_window():
    """The order a position counts rows in: the same in every run and on every worker (a resumed run, maybe of
    another world size or raytrain version, must read on in it), a function of the blocks and these numbers."""
    # windows of at least 3 rows: blocks [2, 1] (rows 0-2), [1, 1, 1] (3-5), [4] (6-9), and the last, [2] (10-11)
    batches = micro_batches([Shard(5, [2, 1, 1, 1, 1, 4, 2])], micro=2, step_rows=2, shuffle=3)
    read = [handed_out(batches, 6) for _ in range(2)]  # 2 epochs of 6 steps
    expected = []
    for epoch in (0, 1):
        rows = []
        for window, ids in enumerate([[0, 1, 2], [3, 4, 5], [6, 7, 8, 9], [10, 11]]):
            rows += [5000 + ids[i] for i in np.random.default_rng([7, epoch, 5, window]).permutation(len(ids))]
        expected.append(rows)
    assert [sum((ids for ids, _ in epoch), []) for epoch in read] == expected
    assert expected[0] != expected[1] and sorted(expected[0]) == sorted(expected[1])  # anew every epoch


def test_a_workers_shards_start_every_epoch_together():
    """Ray Data starts a split's epoch once every shard has asked for rows: shards started one after the other
    would wait for each other forever."""
    barrier = threading.Barrier(2, timeout=3)
    batches = micro_batches([Shard(sid, [3, 3], barrier=barrier) for sid in (0, 1)], micro=3, step_rows=3)
    assert [p for _, p in handed_out(batches, 6)] == [(0, 0), (0, 3), (0, 3), (0, 6), (1, 0), (1, 3)]
    batches.close()


def test_without_prefetch_a_step_reads_no_block_beyond_its_rows():
    """The read-ahead is prefetch's, counted in micro-batches; a skipped prefix is read block by block."""
    for position, blocks in (((0, 0), 1), ((0, 4), 5)):
        shard = Shard(0, [1] * 8)
        batches = micro_batches([shard], micro=1, step_rows=1, position=position)
        assert handed_out(batches, 1) == [([position[1]], (0, position[1] + 1))]
        assert shard.reads[-1]["blocks"] == blocks, position


def test_rows_are_read_on_the_callers_thread_or_with_prefetch_on_a_daemon_thread_that_close_ends():
    shard = Shard(0, [4] * 4)
    batches = micro_batches([shard], micro=2, step_rows=2)  # the defaults: position (0, 0), no prefetch, no digests
    batches.close()  # before any read
    assert shard.reads == [] and batches.position() == {"epoch": 0, "rows": 0}
    batches = micro_batches([shard], micro=2, step_rows=2)
    assert handed_out(batches, 1) == [([0, 1], (0, 2))]
    assert shard.reads[-1]["thread"] is threading.current_thread() and batches.pop_digests() == []
    batches.close()  # the stream is closed now, not by the garbage collector when Ray may be down
    assert shard.reads[-1]["closed"]
    shard = Shard(0, [4] * 4)
    batches = micro_batches([shard], micro=2, step_rows=2, prefetch=1)
    assert handed_out(batches, 2) == [([0, 1], (0, 2)), ([2, 3], (0, 4))]
    thread = shard.reads[-1]["thread"]
    assert thread.name == "raytrain-prefetch" and thread.daemon  # it never holds the process at its exit
    batches.close()
    assert not thread.is_alive() and shard.reads[-1]["closed"] and not shard.reads[-1]["finished"]


def test_close_leaves_a_stream_blocked_in_a_read_as_it_stands():
    """As at Ray Data's epoch barrier, waiting for ranks that stopped: closing it there would raise."""
    gate = threading.Event()
    shard = Shard(0, [2] * 4, gate=(1, gate))  # the second block comes only once the gate opens
    batches = micro_batches([shard], micro=2, step_rows=2, prefetch=1)
    try:
        assert handed_out(batches, 1) == [([0, 1], (0, 2))]
        batches.close()  # waits 2 s for the prefetch thread
        assert not shard.reads[-1]["closed"]
    finally:
        gate.set()
    thread = shard.reads[-1]["thread"]
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_shard_reader_reads_its_stream_to_the_epochs_end_or_closes_it_where_it_stands():
    shard = Shard(0, [2, 2, 2])
    reader = ingest._ShardReader(shard, (7, 0, 0), 0, skip=0)
    assert reader.take(3)["input_ids"][:, 0].tolist() == [0, 1, 2] and reader.available() == 1
    reader.close()  # the epoch's end: Ray Data starts a split's next epoch once every shard has finished this one
    assert shard.reads[-1]["finished"] and not shard.reads[-1]["closed"]
    reader = ingest._ShardReader(shard, (7, 0, 0), 0, skip=0)
    reader.take(3)
    reader.abandon()  # the end of reading
    assert shard.reads[-1]["closed"] and not shard.reads[-1]["finished"]


def test_digests_are_of_the_rows_handed_out_in_order_not_of_those_read_ahead():
    batches = micro_batches([Shard(sid, [3, 4]) for sid in (0, 1)], micro=2, step_rows=3, digests=True, prefetch=2)
    handed = [next(batches)["input_ids"] for _ in range(4)]
    expected = [hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest() for b in handed for row in b]
    assert batches.pop_digests() == expected and batches.pop_digests() == []
    batches.close()


def test_data_without_one_step_stops_the_run_at_its_start_and_later_is_a_stream_cut_short():
    def shards():  # 3 rows each, and steps of 4
        return [Shard(sid, [2, 1]) for sid in (0, 1)]

    for prefetch in (0, 2):
        batches = micro_batches(shards(), micro=2, step_rows=4, prefetch=prefetch)
        for _ in range(2):  # every later call raises it too
            with pytest.raises(ConfigError, match="^the training data yields no step of 4 rows of data.seq_len "
                                                  "tokens per shard \\(epoch 0\\): lower data.seq_len"):
                next(batches)
        batches.close()
    for position in ((1, 0), (0, 3)):  # epoch 1's start; epoch 0 read to its end
        batches = micro_batches(shards(), micro=2, step_rows=4, position=position)
        with pytest.raises(RuntimeError, match="^the training data's shard streams ended before one step of epoch "
                                               "1, though earlier epochs of this run held steps"):
            next(batches)
        batches.close()


def test_a_step_that_is_not_whole_micro_batches_is_refused():
    shards = [Shard(sid, [6]) for sid in (0, 1)]
    with pytest.raises(ValueError, match="^a step of 3 rows from each of 2 shards \\(6\\) is not a whole number "
                                         "of micro-batches of 4$"):
        micro_batches(shards, micro=4, step_rows=3)
    assert handed_out(micro_batches(shards, micro=4, step_rows=2), 1) == [([0, 1, 1000, 1001], (0, 2))]


def test_the_driver_splits_the_training_set_in_order_and_without_locality():
    """What makes a shard's rows a function of the block order alone (no cluster needed to build the config)."""
    config = ingest.ShardedIngest(4)
    assert config._resolve_execution_options("train").preserve_order  # what configure gives the train split
    assert config._enable_shard_locality is False  # ray 2.60.0's DataConfig attribute
