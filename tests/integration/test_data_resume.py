"""Exact data resume on another world size (issues 5, 15), compared row by row, with real Ray Train
workers and real Ray Data shards: 2 workers read part of an epoch, 3 workers resume at that position,
and each data shard's rows, read by either run, are exactly that shard's rows in order: none skipped,
none read twice, and the epoch ends where a 2-worker run's ends (the tail, fewer rows than one step
takes from a shard, does not depend on the world size).

A restart at the same world size: the reader's own test (tests/integration/test_ingest.py: shuffled,
resumed mid-epoch and before an epoch boundary, reading ahead) and the fault-tolerance file's real
restarts (shuffled, losses bit-exact). This file had a same-world-size test of its own, three runs
of Ray Train; in a suite whose time is the number of runs, those two cover it.
"""

import hashlib
import json

import pytest

pytestmark = pytest.mark.integration

SHARDS = 6  # divisible by 1, 2 and 3 workers
STEP_ROWS = 3  # rows per shard per step: a global batch of 18 (train_batch_size / num_shards)
MICRO = 3  # 3 micro-batches per step on 2 workers (3 shards each), 2 on 3 workers (2 shards: no equal split)


def dataset(num_shards):
    """The packed training dataset the reads share: the built-in corpus and tokenizer, 64-token rows."""
    from raytrain.config import DataConfig, ModelConfig
    from raytrain.data.pipeline import build_datasets
    from raytrain.data.sources import inspect_sources
    from raytrain.model import load_model_config

    data = DataConfig(num_builtin_documents=24, seq_len=64, num_shards=num_shards)
    return build_datasets(data, ModelConfig(), 3, inspect_sources(data), load_model_config(ModelConfig()).vocab_size)["train"]


def read(tmp_path, tag, *, workers, num_shards, micro, step_rows, steps, position=(0, 0), prefetch=0):
    """Each rank reads `steps` steps (None: to the end of the epoch it starts in), with `prefetch`
    micro-batches read ahead in MicroBatches' background thread; returns per rank: [(epoch, rows)
    after each step], and per shard id the row digests it read."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.data.ingest import ShardedIngest

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

    TorchTrainer(read_batches,
                 train_loop_config={"micro": micro, "step_rows": step_rows, "steps": steps, "position": list(position),
                                    "prefetch": prefetch, "out": str(tmp_path), "tag": tag},
                 # fractional CPUs: up to 3 workers and Ray Data share the test cluster's 4
                 scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
                 run_config=ray.train.RunConfig(storage_path=str(tmp_path / "runs"), name=tag),
                 datasets={"train": dataset(num_shards)},
                 dataset_config=ShardedIngest(num_shards)).fit()
    return [json.load(open(tmp_path / f"{tag}-rank{r}.json")) for r in range(workers)]


def test_resume_on_another_world_size_skips_and_repeats_nothing(ray_cluster, tmp_path):
    # Each shard's length: streaming_split(equal=True) gives every shard count // SHARDS rows (counted
    # on the driver, not by a run of its own: a run costs the suite ~30 CPU-seconds).
    per_shard = dataset(SHARDS).count() // SHARDS
    assert per_shard % STEP_ROWS, per_shard  # with a tail to drop

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
    assert sorted(first) == sorted(second) == [str(i) for i in range(SHARDS)]
    for sid, rows in whole.items():
        # the 2-worker run read its shards' whole epoch but the tail
        assert len(rows) == per_shard - per_shard % STEP_ROWS, f"shard {sid}: {len(rows)} rows of {per_shard} read"
        # and the 3 workers read on where it stood, to the same end
        assert first[sid] + second[sid] == rows, f"shard {sid}: rows skipped, repeated or out of order, or the " \
                                                 f"epoch ends elsewhere on 3 workers"
