"""Resume on a different number of workers: DeepSpeed's universal checkpoint conversion (driver side).

A ZeRO-3 checkpoint holds one model/optimizer partition per rank, so it loads only on the world
size that wrote it. When a run resumes on another number of workers (2 -> 3, 8 GPUs -> 16), the
driver converts the checkpoint it will resume from with DeepSpeed's `ds_to_universal` (one file
per parameter: fp32 weights and both Adam moments, whole) and stores the result next to the run:

    <storage>/<run>/universal/checkpoint_step_00000080/
        step_00000080_universal/   DeepSpeed's universal tag (what `load_universal` reads)
        latest_universal
        raytrain.json              copied last: marks the conversion complete

The workers load it with DeepSpeed's `checkpoint.load_universal` (raytrain.checkpoint.shards.resume_point),
which re-partitions every tensor for the new world. The data position needs no conversion: it is
per data shard (raytrain.data.ingest), and data.num_shards must be divisible by both world sizes.

Cost: the conversion reads the whole checkpoint and writes about as much again (fp32 weights +
moments), on the driver's machine, once per (checkpoint, new world size); a second resume from
the same checkpoint reuses it. Needs local disk for one copy (a cloud checkpoint is downloaded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pyarrow.fs
import ray.train

from raytrain.checkpoint.layout import METADATA, UNIVERSAL_DIR, exists, filesystem, latest_checkpoint, read_metadata, tag_for
from raytrain.config import ConfigError
from raytrain.console import say
from raytrain.run_spec import UniversalCopy


def written_by(meta: dict) -> tuple[int, int]:
    """(world size, data shards) of the run that wrote a checkpoint (its raytrain.json)."""
    spec = meta["spec"]
    world = spec["cluster"]["num_workers"]
    return world, spec["config"]["data"].get("num_shards") or world


def prepare(run_uri: str, resume_from: str | None, num_workers: int, num_shards: int | None) -> UniversalCopy | None:
    """The universal copy the workers need, or None when the run starts fresh or resumes on the
    world size that wrote its checkpoint. What Ray Train will hand the workers decides: the run's
    latest reported checkpoint, else `resume_from`."""
    checkpoint = latest_checkpoint(run_uri) or (ray.train.Checkpoint(resume_from) if resume_from else None)
    if checkpoint is None:
        return None
    meta = read_metadata(checkpoint)
    old_world, old_shards = written_by(meta)
    if old_world == num_workers:
        return None
    uri = checkpoint.path
    new_shards = num_shards or num_workers
    if old_shards != new_shards:
        where = f"data.num_shards={meta['spec']['config']['data'].get('num_shards')}"
        raise ConfigError(f"checkpoint {uri} was written by {old_world} workers with {where} ({old_shards} data "
                          f"shards), and this run has {num_workers} workers and {new_shards} shards: resuming on "
                          f"another number of workers needs the same data.num_shards, divisible by both "
                          f"(start runs with e.g. data.num_shards=48 to allow it), else resume on {old_world} workers")
    target = f"{run_uri}/{UNIVERSAL_DIR}/{os.path.basename(uri.rstrip('/'))}"
    if not exists(f"{target}/{METADATA}"):
        _convert(checkpoint, target, meta["step"])
    say(f"raytrain: resuming step {meta['step']} on {num_workers} workers (written by {old_world}): "
        f"DeepSpeed universal checkpoint {target}")
    return UniversalCopy(step=meta["step"], path=target, from_world=old_world)


def _convert(checkpoint, target: str, step: int) -> None:
    start = time.perf_counter()
    tag = tag_for(step)
    with checkpoint.as_directory() as src, tempfile.TemporaryDirectory(prefix="raytrain-universal-") as tmp:
        say(f"raytrain: converting {checkpoint.path} to DeepSpeed's universal checkpoint (once per checkpoint)")
        out = os.path.join(tmp, f"{tag}_universal")
        # A subprocess: the conversion's worker pools and memory end with it.
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                               "--input_folder", os.path.join(src, tag), "--output_folder", out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {checkpoint.path}:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        fs, path = filesystem(target)
        fs.create_dir(path, recursive=True)
        pyarrow.fs.copy_files(tmp, path, destination_filesystem=fs)
        # last: a conversion cut short has no raytrain.json and is redone next time
        pyarrow.fs.copy_files(os.path.join(src, METADATA), f"{path}/{METADATA}", destination_filesystem=fs)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(tmp) for f in files)
    say(f"raytrain: universal checkpoint written: {size / 2**30:.3f} GiB in {time.perf_counter() - start:.1f} s")
