"""Resume on a different number of workers (driver side).

A ZeRO-3 checkpoint holds one model/optimizer partition per rank, so it loads only on the world
size that wrote it. When a run resumes on another number of workers (2 -> 3, 8 GPUs -> 16), the
driver converts the checkpoint it will resume from with DeepSpeed's `ds_to_universal` (one file
per parameter: fp32 weights and both Adam moments, whole) and stores the result next to the run:

    <storage>/<run>/universal/checkpoint_step_00000080/
        step_00000080_universal/   DeepSpeed's universal tag (what `load_universal` reads)
        latest_universal
        raytrain.json              copied last: marks the conversion complete

The workers load it with DeepSpeed's `checkpoint.load_universal` (raytrain.checkpoint.resume_point),
which re-partitions every tensor for the new world. The data position needs no conversion: it is
per data shard (raytrain.ingest), and data.num_shards must be divisible by both world sizes.

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
from typing import Any

from raytrain.config import ConfigError, RunConfig

UNIVERSAL_DIR = "universal"


def prepare(cfg: RunConfig, storage: str, name: str, num_workers: int, micro_batch: int) -> dict[str, Any] | None:
    """The universal copy the workers need ({"step", "path", "from_world"}), or None when the run
    starts fresh or resumes on the world size that wrote its checkpoint."""
    import ray.train

    from raytrain.checkpoint import read_metadata

    uri = _resume_uri(storage, name, cfg.checkpoint.resume_from)
    if uri is None:
        return None
    meta = read_metadata(ray.train.Checkpoint(uri))
    old_run = meta["run"]
    written_by = old_run["scaling"]["num_workers"]
    if written_by == num_workers:
        return None
    old_shards = old_run["data"].get("num_shards") or written_by
    new_shards = cfg.data.num_shards or num_workers
    if old_shards != new_shards:
        where = f"data.num_shards={old_run['data'].get('num_shards')}"
        raise ConfigError(f"checkpoint {uri} was written by {written_by} workers with {where} ({old_shards} data "
                          f"shards), and this run has {num_workers} workers and {new_shards} shards: resuming on "
                          f"another number of workers needs the same data.num_shards, divisible by both "
                          f"(start runs with e.g. data.num_shards=48 to allow it), else resume on {written_by} workers")
    from raytrain.resolve import check_shards

    check_shards(new_shards, num_workers, micro_batch)
    target = f"{storage.rstrip('/')}/{name}/{UNIVERSAL_DIR}/{os.path.basename(uri.rstrip('/'))}"
    if not _exists(f"{target}/raytrain.json"):
        _convert(uri, target, meta["step"])
    print(f"raytrain: resuming step {meta['step']} on {num_workers} workers (written by {written_by}): "
          f"DeepSpeed universal checkpoint {target}", flush=True)
    return {"step": meta["step"], "path": target, "from_world": written_by}


def _resume_uri(storage: str, name: str, resume_from: str | None) -> str | None:
    """What Ray Train will hand the workers: the run's latest reported checkpoint, else resume_from."""
    import json

    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    run_dir = f"{root.rstrip('/')}/{name}"
    try:
        with fs.open_input_stream(f"{run_dir}/checkpoint_manager_snapshot.json") as f:
            snapshot = json.loads(f.read().decode())
    except FileNotFoundError:
        return resume_from
    # Ray Train's own record of the latest checkpoint (what ray.train.get_checkpoint() returns
    # after a restart); an internal file, read here only to convert the right checkpoint.
    latest = (snapshot.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    if latest is None:
        return resume_from
    return f"{storage.rstrip('/')}/{name}/{latest}"


def _exists(uri: str) -> bool:
    import pyarrow.fs

    fs, path = pyarrow.fs.FileSystem.from_uri(uri) if "://" in uri else (pyarrow.fs.LocalFileSystem(), uri)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


def _convert(uri: str, target: str, step: int) -> None:
    import pyarrow.fs
    import ray.train

    from raytrain.checkpoint import METADATA, tag_for

    start = time.perf_counter()
    tag = tag_for(step)
    with ray.train.Checkpoint(uri).as_directory() as src, tempfile.TemporaryDirectory(prefix="raytrain-universal-") as tmp:
        print(f"raytrain: converting {uri} to DeepSpeed's universal checkpoint (once per checkpoint)", flush=True)
        out = os.path.join(tmp, f"{tag}_universal")
        # A subprocess: the conversion's worker pools and memory end with it.
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                               "--input_folder", os.path.join(src, tag), "--output_folder", out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {uri}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        local_meta = os.path.join(src, METADATA)
        fs, path = pyarrow.fs.FileSystem.from_uri(target) if "://" in target else (pyarrow.fs.LocalFileSystem(), target)
        fs.create_dir(path, recursive=True)
        pyarrow.fs.copy_files(tmp, path, destination_filesystem=fs)
        # last: a conversion cut short has no raytrain.json and is redone next time
        pyarrow.fs.copy_files(local_meta, f"{path}/{METADATA}", destination_filesystem=fs)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(tmp) for f in fs_)
    print(f"raytrain: universal checkpoint written: {size / 2**30:.3f} GiB in {time.perf_counter() - start:.1f} s",
          flush=True)
