"""The worker's reader on real Ray Data splits (raytrain.data.ingest), without training: the data
position is that of the last batch handed out (never of what was prefetched; the step's start in the
middle of a step), a reader started at a position continues exactly there, and an epoch ends for
every shard at once at a step boundary, dropping each shard's partial tail, whatever the micro-batch,
and a shuffled reader resumed at a position reads on exactly as the uninterrupted one did, across
epochs. The same reader inside real Ray Train workers: test_fault_tolerance.py (restarts at the same
world size and a resume on another, shuffled and read ahead, each step's rows compared through the
data audit, data.sample_log) and test_elastic.py (resizes)."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration


def splits(n_shards, rows=40):
    import ray.data

    ds = ray.data.from_items([{"input_ids": np.full(4, i, dtype=np.int32)} for i in range(rows)],
                             override_num_blocks=8)
    ds.context.execution_options.preserve_order = True
    return ds.streaming_split(n_shards, equal=True)


def reader(n_shards, position=(0, 0), prefetch=0, micro=4, step_rows=2, digests=False, shuffle=0, counter=None):
    from raytrain.data.ingest import MicroBatches, ShardGroup

    shards = splits(n_shards)
    return MicroBatches(ShardGroup(shards, list(range(n_shards))), micro, step_rows, torch.device("cpu"), seed=5,
                        shuffle_buffer_size=shuffle, position=position, prefetch=prefetch, digests=digests,
                        counter=counter)


def first_ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_position_is_of_the_last_batch_handed_out_even_with_prefetch(ray_cluster):
    batches = reader(2, prefetch=3)
    seen = [first_ids(next(batches)) for _ in range(2)]
    assert batches.position() == {"epoch": 0, "rows": 4}  # 2 rows per shard per micro-batch, 2 batches
    batches.close()
    assert all(len(ids) == 4 for ids in seen)


def test_a_reader_started_at_a_position_continues_exactly_there(ray_cluster):
    full = reader(2)
    expected = [first_ids(next(full)) for _ in range(5)]
    full.close()
    resumed = reader(2, position=(0, 6))  # after 3 micro-batches of 2 rows from each of the 2 shards
    assert [first_ids(next(resumed)) for _ in range(2)] == expected[3:]
    resumed.close()


def test_a_shuffled_reader_resumed_anywhere_reads_on_as_the_uninterrupted_one_across_epochs(ray_cluster):
    # What a restart at the same world size does (its new worker group builds the same reader at the
    # checkpoint's position), in one process: shuffle on, the resumed readers reading ahead.
    def read(batches, n):
        out, positions = [], []
        for _ in range(n):
            out.append(first_ids(next(batches)))
            positions.append(batches.position())
        batches.close()
        return out, positions

    # 20 rows per shard, 2 per step (one micro-batch of 4 from the 2 shards): 10 steps an epoch
    full, positions = read(reader(2, shuffle=8), 25)
    plain, _ = read(reader(2), 10)
    epochs = [p["epoch"] for p in positions]
    assert epochs.index(1) == 10 and epochs[-1] == 2, positions
    assert full[:10] != plain and sorted(sum(full[:10], [])) == sorted(sum(plain, []))  # shuffled, same rows
    assert full[10:20] != full[:10] and sorted(sum(full[10:20], [])) == sorted(sum(plain, []))  # anew per epoch
    for k in (13, 9):  # mid-epoch 1; one step before an epoch boundary, which the resumed reader crosses
        position = positions[k - 1]
        resumed, _ = read(reader(2, position=(position["epoch"], position["rows"]), prefetch=3, shuffle=8), 25 - k)
        assert resumed == full[k:], k


def test_an_epoch_ends_for_every_shard_at_once(ray_cluster):
    import ray

    from raytrain.data.progress import Counter

    # the run's counter is told the rows left out, for the end-of-run data line
    counter = ray.remote(num_cpus=0)(Counter).options(name="test-ingest-epoch-tail").remote()
    batches = reader(2, micro=6, step_rows=3, counter="test-ingest-epoch-tail")  # 20 rows per shard, 3 per step:
    for _ in range(6):                                                           # 6 steps, 2 rows dropped per shard
        next(batches)
    assert batches.position() == {"epoch": 0, "rows": 18}
    next(batches)
    assert batches.position() == {"epoch": 1, "rows": 3}
    batches.close()
    summary = ray.get(counter.summary.remote())  # after the reader's own calls: one caller's calls run in order
    assert summary.skipped == {"epoch_tail_rows": (4, "shard 0 of epoch 0")}  # 2 a shard, each kept once
    assert summary.skipped_line().startswith("raytrain: data: 4 rows of data.seq_len tokens left out at the ends of "
                                             "epochs, each shard's tail shorter than one step's rows")
    ray.kill(counter)


def test_a_step_is_cut_into_micro_batches_and_its_tail_does_not_depend_on_them(ray_cluster):
    # 6 rows per step (3 from each of 2 shards): one micro-batch of 6 (GA 1) or two of 3 (GA 2), a
    # micro-batch that a reader taking the same rows from each shard per micro-batch could not split.
    # Both read the same rows in the same order and end the epoch at the same step.
    whole, cut = reader(2, micro=6, step_rows=3), reader(2, micro=3, step_rows=3, digests=True)
    rows_whole, rows_cut, positions = [], [], []
    for _ in range(7):
        rows_whole += first_ids(next(whole))
        for _ in range(2):
            rows_cut += first_ids(next(cut))
            positions.append(cut.position()["rows"])
    assert rows_cut == rows_whole and whole.position() == cut.position() == {"epoch": 1, "rows": 3}
    # in the middle of a step the position is the step's start: a checkpoint there resumes the step whole
    assert positions[:4] == [0, 3, 3, 6]
    assert len(cut.pop_digests()) == 42 and cut.pop_digests() == []
    whole.close()
    cut.close()


def test_a_step_that_is_not_whole_micro_batches_is_refused(ray_cluster):
    with pytest.raises(ValueError, match="3 shards \\(3\\) is not a whole number of micro-batches of 4"):
        reader(3, micro=4, step_rows=1)


def test_data_without_one_step_is_a_one_line_error_naming_seq_len(ray_cluster):
    """The same at every restart: a user's mistake (a bad record, exit 2), not a retried RuntimeError."""
    from raytrain.config import ConfigError

    batches = reader(2, micro=4, step_rows=40)  # 20 rows per shard
    with pytest.raises(ConfigError, match="yields no step of 40 rows of data.seq_len tokens per shard \\(epoch 0\\): "
                                          "lower data.seq_len"):
        next(batches)
    batches.close()
    # A run that had steps (resumed past the start) finding an epoch without one: its streams were cut short
    # (seen: an elastic grow stopped a group whose prefetch thread had read on into the next epoch, and its "no
    # step", exit 2, ended the whole run), not the data: every epoch holds the same rows per shard.
    for position in ((1, 0), (0, 40)):
        cut = reader(2, micro=4, step_rows=40, position=position)
        with pytest.raises(RuntimeError, match=f"ended before one step of epoch {position[0] + (position[1] > 0)}, "
                                               f"though earlier epochs of this run held steps: the streams were cut"):
            next(cut)
        cut.close()
