"""Exact data resume, compared row by row, with real Ray Train workers and real Ray Data shards.

- Same world size: after a restart at a checkpointed position, each rank's next steps are exactly
  those of an uninterrupted run, mid-epoch and across epoch boundaries, shuffle on.
- Another world size (issues 5, 15): 2 workers read part of an epoch, 3 workers resume at that
  position, and each data shard's rows, read by either run, are exactly that shard's rows in order:
  none skipped, none read twice, and the epoch ends where a 2-worker run's ends (the tail, fewer
  rows than one step takes from a shard, does not depend on the world size).
"""

import hashlib
import json

import pytest

pytestmark = pytest.mark.integration

SHARDS = 6  # divisible by 1, 2 and 3 workers
STEP_ROWS = 3  # rows per shard per step: a global batch of 18 (train_batch_size / num_shards)
MICRO = 3  # 3 micro-batches per step on 2 workers (3 shards each), 2 on 3 workers (2 shards: no equal split)


def read(tmp_path, tag, *, workers, num_shards, micro, step_rows, steps, position=(0, 0), prefetch=0):
    """Each rank reads `steps` steps (None: to the end of the epoch it starts in), with `prefetch`
    micro-batches read ahead in MicroBatches' background thread; returns per rank: [(epoch, rows)
    after each step], and per shard id the row digests it read."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.config import DataConfig, ModelConfig
    from raytrain.data.ingest import ShardedIngest
    from raytrain.data.pipeline import build_datasets
    from raytrain.data.sources import inspect_sources
    from raytrain.model import load_model_config

    # Nested, so Ray pickles it by value: workers cannot import this test module by name.
    def read_batches(config):
        import numpy as np
        import ray.train
        import torch

        from raytrain.data.ingest import MicroBatches

        group = ray.train.get_dataset_shard("train")
        batches = MicroBatches(group, config["micro"], config["step_rows"], torch.device("cpu"), seed=11,
                               shuffle_buffer_size=8, position=tuple(config["position"]), prefetch=config["prefetch"])
        per_step = config["step_rows"] * len(group.shard_ids) // config["micro"]
        positions, rows = [], {sid: [] for sid in group.shard_ids}
        start_epoch = batches.epoch
        while config["steps"] is None or len(positions) < config["steps"]:
            step = np.concatenate([next(batches)["input_ids"].numpy() for _ in range(per_step)])
            if config["steps"] is None and batches.epoch != start_epoch:
                break  # this step already belongs to the next epoch
            for i, sid in enumerate(group.shard_ids):  # a step holds each shard's rows in turn
                part = step[i * config["step_rows"]:(i + 1) * config["step_rows"]]
                rows[sid] += [hashlib.sha1(r.tobytes()).hexdigest() for r in part]
            positions.append(batches.position())
        batches.close()
        rank = ray.train.get_context().get_world_rank()
        with open(f"{config['out']}/{config['tag']}-rank{rank}.json", "w") as f:
            json.dump({"positions": positions, "rows": rows}, f)

    data = DataConfig(num_builtin_documents=24, seq_len=64, num_shards=num_shards)
    TorchTrainer(read_batches,
                 train_loop_config={"micro": micro, "step_rows": step_rows, "steps": steps, "position": list(position),
                                    "prefetch": prefetch, "out": str(tmp_path), "tag": tag},
                 # fractional CPUs: up to 3 workers and Ray Data share the test cluster's 4
                 scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
                 run_config=ray.train.RunConfig(storage_path=str(tmp_path / "runs"), name=tag),
                 datasets=build_datasets(data, ModelConfig(), 3, inspect_sources(data),
                                         load_model_config(ModelConfig()).vocab_size),
                 dataset_config=ShardedIngest(num_shards)).fit()
    return [json.load(open(tmp_path / f"{tag}-rank{r}.json")) for r in range(workers)]


def test_resumed_batches_equal_uninterrupted_ones(ray_cluster, tmp_path):
    # The uninterrupted run reads on the training thread, the resumed ones prefetch: same batches.
    full = read(tmp_path, "full", workers=2, num_shards=None, micro=8, step_rows=8, steps=20)
    epochs = [p["epoch"] for p in full[0]["positions"]]
    assert epochs[-1] >= 2, epochs  # several epochs
    assert full[0]["positions"] == full[1]["positions"]  # every rank at the same position
    first_end = epochs.index(1)  # the first batch of epoch 1
    assert full[0]["rows"] != full[1]["rows"]  # ranks read different data

    def tail(result, k):
        """Row digests each rank read after its k-th batch."""
        per_rank = []
        for r in result:
            (sid, rows), = r["rows"].items()
            per_rank.append(rows[k * 8:])
        return per_rank

    # The shuffle differs per epoch: epoch 1 is not epoch 0 again.
    (sid, rows0), = full[0]["rows"].items()
    assert rows0[:first_end * 8] != rows0[first_end * 8:2 * first_end * 8]
    for k in (first_end + 2, 2 * first_end - 1):  # mid-epoch 1; one batch before the next boundary
        position = full[0]["positions"][k - 1]
        resumed = read(tmp_path, f"at{k}", workers=2, num_shards=None, micro=8, step_rows=8, steps=20 - k, position=(
            position["epoch"], position["rows"]), prefetch=3)
        assert [list(r["rows"].values())[0] for r in resumed] == tail(full, k)


def test_resume_on_another_world_size_skips_and_repeats_nothing(ray_cluster, tmp_path):
    # Ground truth: one worker reads every shard, one row of each per step (no tail dropped).
    truth = read(tmp_path, "truth", workers=1, num_shards=SHARDS, micro=SHARDS, step_rows=1, steps=None)[0]["rows"]
    lengths = {len(rows) for rows in truth.values()}
    assert len(lengths) == 1 and lengths.pop() % STEP_ROWS, truth  # equal shards, with a tail to drop

    # A 2-worker run reads the whole epoch, prefetching 3 micro-batches ahead: the position after its
    # second step is still that of the 2 steps handed out. 3 workers resume at that position.
    two = read(tmp_path, "two", workers=2, num_shards=SHARDS, micro=MICRO, step_rows=STEP_ROWS, steps=None, prefetch=3)
    position = two[0]["positions"][1]
    assert position == {"epoch": 0, "rows": 6} and two[1]["positions"][1] == position
    after = read(tmp_path, "three", workers=3, num_shards=SHARDS, micro=MICRO, step_rows=STEP_ROWS, steps=None,
                 position=(position["epoch"], position["rows"]))

    whole = {sid: rows for r in two for sid, rows in r["rows"].items()}
    first = {sid: rows[:2 * STEP_ROWS] for sid, rows in whole.items()}  # what the 2 workers read before the resume
    second = {sid: rows for r in after for sid, rows in r["rows"].items()}
    assert sorted(first) == sorted(second) == sorted(truth) == [str(i) for i in range(SHARDS)]
    for sid, rows in truth.items():
        read_rows = first[sid] + second[sid]
        assert read_rows == rows[:len(read_rows)], f"shard {sid}: rows skipped, repeated or out of order"
        assert len(rows) - len(read_rows) < STEP_ROWS, f"shard {sid}: more than the tail left unread"
        assert read_rows == whole[sid], f"shard {sid}: the epoch ends elsewhere on 2 workers"
