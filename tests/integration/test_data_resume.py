"""Exact data resume, compared batch by batch: after skipping k micro-batches (what a restart from
step k does), each rank's next batches are exactly those of an uninterrupted run, mid-epoch and
across epoch boundaries, with the seeded local shuffle on, and with whole epochs skipped by
arithmetic once the epoch length is known. Real Ray Train workers, real Ray Data shards."""

import hashlib
import json

import pytest

pytestmark = pytest.mark.integration

N = 20  # micro-batches per rank to compare; the shard holds ~6 per epoch, so N spans 3+ epochs


def run(tmp_path, skip, bpe):
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.config import DataConfig, ModelConfig
    from raytrain.data import build_dataset, ingest_config

    # Nested, so Ray pickles it by value: workers cannot import this test module by name.
    def read_batches(config):
        import ray.train
        import torch

        from raytrain.worker import MicroBatches

        batches = MicroBatches(ray.train.get_dataset_shard("train"), 4, torch.device("cpu"), seed=11,
                               shuffle_buffer_size=16, skip=config["skip"], batches_per_epoch=config["bpe"])
        digests = [hashlib.sha1(next(batches)["input_ids"].numpy().tobytes()).hexdigest()
                   for _ in range(N - config["skip"])]
        rank = ray.train.get_context().get_world_rank()
        with open(f"{config['out']}/rank{rank}-skip{config['skip']}-bpe{config['bpe']}.json", "w") as f:
            json.dump({"digests": digests, "batches_per_epoch": batches.batches_per_epoch}, f)

    data = DataConfig(num_builtin_documents=8, seq_len=64)  # ~16 rows per rank: 4 batches per epoch
    TorchTrainer(read_batches, train_loop_config={"skip": skip, "bpe": bpe, "out": str(tmp_path)},
                 scaling_config=ray.train.ScalingConfig(num_workers=2),
                 run_config=ray.train.RunConfig(storage_path=str(tmp_path / "runs"), name=f"resume-{skip}-{bpe}"),
                 datasets={"train": build_dataset(data, ModelConfig(), seed=3)},
                 dataset_config=ingest_config()).fit()
    return [json.load(open(tmp_path / f"rank{r}-skip{skip}-bpe{bpe}.json")) for r in range(2)]


def test_resumed_batches_equal_uninterrupted_ones(ray_cluster, tmp_path):
    full = run(tmp_path, skip=0, bpe=None)
    bpe = full[0]["batches_per_epoch"]
    assert bpe and full[1]["batches_per_epoch"] == bpe and N > 3 * bpe  # equal shards, several epochs
    assert full[0]["digests"] != full[1]["digests"]  # ranks read different data
    assert full[0]["digests"][:bpe] != full[0]["digests"][bpe:2 * bpe]  # the shuffle differs per epoch

    mid_epoch = bpe + 2  # a restart in the middle of the second epoch, epoch length not yet known
    resumed = run(tmp_path, skip=mid_epoch, bpe=None)
    for rank in range(2):
        assert resumed[rank]["digests"] == full[rank]["digests"][mid_epoch:]

    later = 3 * bpe - 1  # whole epochs skipped by arithmetic, then one batch before a boundary
    skipped = run(tmp_path, skip=later, bpe=bpe)
    for rank in range(2):
        assert skipped[rank]["digests"] == full[rank]["digests"][later:]
