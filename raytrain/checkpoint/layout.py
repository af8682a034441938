"""Where a run lives in storage, and what a raytrain checkpoint holds (used by driver and workers).

A run is `STORAGE/NAME/` on any filesystem pyarrow knows (a local or shared directory, s3://,
gs://, abfs://). Ray Train owns the checkpoint bookkeeping in it; raytrain adds its own files:

    STORAGE/NAME/
        checkpoint_step_00000080/     one checkpoint (Ray Train merges every rank's files into it)
            raytrain.json             step, metrics and their history, the run's contract (rank 0)
            nccl_env_node<N>.json     the NCCL/Gloo environment node N's workers ran with
            latest                    DeepSpeed's pointer to the tag below
            step_00000080/            DeepSpeed's tag: per-rank model and optimizer shards
        universal/checkpoint_step_*-<digest>/  DeepSpeed universal copies for another world size (reshard)
        model/                        the model's config, tokenizer and generation config, copied at start
        tracking.json                 the run's MLflow run id (rank 0): a continued run logs to the same MLflow run
        tensorboard/, summary.md, loss_curve.png
    STORAGE/.raytrain-live/NAME.json  while a driver trains the run: its heartbeat (raytrain.driver.live)

Trust: DeepSpeed loads its shards with full unpickling (torch.load(weights_only=False)), which can
run code: only load checkpoints from storage you trust.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from typing import Any

from raytrain.config import ConfigError

METADATA = "raytrain.json"
LATEST = "latest"
"""DeepSpeed's file naming the tag directory `engine.load_checkpoint` reads."""
UNIVERSAL_DIR = "universal"
MODEL_DIR = "model"
TENSORBOARD_DIR = "tensorboard"
SAMPLES_DIR = "samples"


def tag_for(step: int) -> str:
    """DeepSpeed's tag (the shard directory inside a checkpoint) for `step`."""
    return f"step_{step:08d}"


def checkpoint_dir_name(step: int) -> str:
    """The checkpoint's directory name in the run directory (what ray.train.report is told)."""
    return f"checkpoint_{tag_for(step)}"


def run_uri(storage_path: str, name: str) -> str:
    """STORAGE/NAME as a path or URI (no trailing slash)."""
    return f"{storage_path.rstrip('/')}/{name}"


def filesystem(uri: str):
    """(pyarrow filesystem, path on it) for a local path or a URI."""
    import pyarrow.fs

    if "://" not in uri:
        return pyarrow.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    return pyarrow.fs.FileSystem.from_uri(uri)


def checkpoint_uri(run: str, checkpoint) -> str:
    """A checkpoint of run `run` (a path or URI, as layout.run_uri makes it), named as the user gave the
    storage. Ray's Checkpoint.path is a path on its filesystem, without the scheme ("bucket/runs/r/
    checkpoint_step_00000003" for s3://bucket/runs): printed as it is, it reads as a local path, and
    --resume-from or the export given it would look on local disk."""
    return f"{run.rstrip('/')}/{checkpoint.path.rstrip('/').rsplit('/', 1)[-1]}"


# Object stores without directories: a run directory is a prefix of objects, moved one object at a time.
_OBJECT_STORES = ("s3", "gcs")
# S3 copies an object server-side in one request only up to 5 GiB (CopyObject); Arrow's move of a larger
# one fails, so those are streamed through this process instead (a large model's optimizer shard is
# tens of GB: minutes, not seconds).
S3_COPY_LIMIT_BYTES = 5 * 1024**3
_STREAM_CHUNK_BYTES = 64 * 1024**2


def set_aside(run: str, suffix: str | None = None) -> str:
    """Rename run directory `run` (a path or URI) to `run + suffix`, by default `.replaced-` and the
    local time (what --fresh and the model files' note name); returns the new path or URI. A single
    file there is moved the same way.

    A local, shared or HDFS directory is renamed at once. On S3 and GCS a "directory" is a prefix, so
    each object is moved (a server-side copy, then a delete), Ray Train's record of the run (its
    top-level files) last: a set-aside cut short leaves a run whose record names checkpoints that are
    gone, which --fresh sets aside again (into a second name) rather than training over it."""
    import pyarrow.fs

    if suffix is None:
        suffix = f".replaced-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    fs, path = filesystem(run)
    path = path.rstrip("/")
    aside = path + suffix
    if fs.type_name not in _OBJECT_STORES or fs.get_file_info(path).type == pyarrow.fs.FileType.File:
        fs.move(path, aside)
    else:
        infos = [i for i in fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
                 if i.type == pyarrow.fs.FileType.File]
        infos.sort(key=lambda i: i.path.count("/"), reverse=True)  # deepest first: the run's own record last
        for info in infos:
            dest = aside + info.path[len(path):]
            if fs.type_name == "s3" and info.size > S3_COPY_LIMIT_BYTES:
                _stream_copy(fs, info.path, dest)
                fs.delete_file(info.path)
            else:
                fs.move(info.path, dest)
    return run.rstrip("/") + suffix


def _stream_copy(fs, src: str, dest: str) -> None:
    with fs.open_input_stream(src) as inp, fs.open_output_stream(dest) as out:
        while chunk := inp.read(_STREAM_CHUNK_BYTES):
            out.write(chunk)


def exists(uri: str) -> bool:
    import pyarrow.fs

    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


_SHARD_RANK = re.compile(r"zero_pp_rank_(\d+)_")  # DeepSpeed's per-rank files: [bf16_]zero_pp_rank_R_mp_rank_..


def remove_shards_of_ranks_from(tag_dir: str, world_size: int) -> list[str]:
    """Delete the shard files of ranks `world_size` and up in DeepSpeed tag directory `tag_dir` (a path or URI), if
    any; their names. One listing (one request on object storage)."""
    import pyarrow.fs

    fs, path = filesystem(tag_dir)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path.rstrip("/"), allow_not_found=True))
    removed = []
    for info in infos:
        match = _SHARD_RANK.search(info.base_name)
        if match and int(match[1]) >= world_size and info.type == pyarrow.fs.FileType.File:
            fs.delete_file(info.path)
            removed.append(info.base_name)
    return sorted(removed)


# What storage that cannot be reached needs, by filesystem: the error quoted before it says which of them.
_REACH_FIX = {"s3": "the driver's AWS credentials (AWS_ACCESS_KEY_ID, a profile or an instance profile), the bucket's "
                    "region and endpoint (AWS_ENDPOINT_URL for an S3-compatible store)",
              "gcs": "the driver's Google credentials (GOOGLE_APPLICATION_CREDENTIALS or workload identity)",
              "abfs": "the driver's Azure credentials (AZURE_CLIENT_ID and its secret, or a managed identity)"}
# How long the probe lets GCS retry: pyarrow's GcsFileSystem retries a request for up to 15 minutes by default
# (google-cloud-cpp's policy; without a network, measured: no answer in 5 minutes), which made the probe a hang.
# S3's retries end after ~6 s of their own (Arrow's connect retry strategy; measured against a closed port).
_PROBE_RETRY_S = 20


def check_reachable(uri: str, key: str) -> None:
    """A one-line ConfigError, naming `key` and the fix, unless pyarrow can open `uri`'s filesystem and look
    `uri` up (whether it exists or not), as the run's first read there does: after ray.init, an unreachable
    bucket (no network, no credentials, a wrong endpoint or region) was a 32-line pyarrow OSError traceback.
    Costs a round trip or two to the store (S3: the bucket's region, then a HEAD and a LIST); fails within
    the filesystem's retries (S3 ~6 s, GCS `_PROBE_RETRY_S`)."""
    import datetime

    try:
        fs, path = filesystem(uri)
        if fs.type_name == "gcs":  # its pickling arguments are its constructor's: the same filesystem, bounded
            rebuild, (kwargs,) = fs.__reduce__()
            fs = rebuild({**kwargs, "retry_time_limit": datetime.timedelta(seconds=_PROBE_RETRY_S)})
        fs.get_file_info(path)
    except Exception as e:  # noqa: BLE001: pyarrow's own are OSError, ValueError (ArrowInvalid) and, for Azure,
        # ArrowException (measured, pyarrow 26); a scheme it reaches through an fsspec handler raises that library's
        # (hf://: huggingface_hub's httpx ConnectError without a network, a 100-line traceback and exit 1 before).
        # This is a probe: whatever stops it is "cannot reach it".
        raise unreachable(f"{key}={uri}", uri, e) from None


def unreachable(shown: str, uri: str, error: BaseException) -> ConfigError:
    """The one line for storage `shown` ("KEY=URI") that pyarrow could not reach at `uri`, quoting its `error`."""
    from raytrain.config_files import first_line

    scheme = uri.partition("://")[0].lower()
    where = _REACH_FIX.get({"gs": "gcs", "abfss": "abfs"}.get(scheme, scheme), "the driver's credentials for it")
    said = first_line(error)
    said = said if len(said) <= 300 else said[:300] + "..."
    return ConfigError(f"{shown}: cannot reach it ({said}): check the URI, {where}, and this machine's network")


class BrokenRun(ConfigError):
    """Ray Train's record of a run names a checkpoint that is gone (deleted from storage by hand):
    Ray Train refuses to continue that run, so raytrain does too, in one line."""


def latest_checkpoint(run: str):
    """The run's latest reported checkpoint (a ray.train.Checkpoint), or None when the run has none.

    Read through Ray Train's own `Result.from_path`, which is what a restarted worker group's
    `ray.train.get_checkpoint()` is based on; a run directory without Ray Train's bookkeeping
    (never reached its first checkpoint) has none. Raises BrokenRun when the record names a
    checkpoint that no longer exists, and a ConfigError naming checkpoint.storage_path (`run` is
    STORAGE/NAME) when the storage cannot be reached.
    """
    import pyarrow
    import ray.train
    from raytrain.compat import CheckpointManagerInitializationError, no_run_snapshot_line

    storage, _, name = run.rstrip("/").rpartition("/")
    try:
        if not exists(run):
            return None
        with no_run_snapshot_line():  # Ray Train's 3-line INFO on reading a run's record: raytrain says it continues
            result = ray.train.Result.from_path(run)
    except (OSError, pyarrow.lib.ArrowException) as e:  # storage that cannot be reached: see check_reachable
        raise unreachable(f"checkpoint.storage_path={storage} (run {name!r})", run, e) from None
    except CheckpointManagerInitializationError:
        # which one to resume, named: "one of its remaining checkpoints" left the user to find and check them
        remaining = latest_complete_checkpoint(run)
        resume = (f"continue from its latest complete checkpoint under a new name (--resume-from {remaining} "
                  f"checkpoint.name=NEW_NAME), or " if remaining else "")
        raise BrokenRun(f"run {name!r} in {storage}: Ray Train's record of its checkpoints names one that was deleted "
                        f"from storage, so the run cannot continue under its name: {resume}pass --fresh to start "
                        f"over (the old run is kept under another name)") from None
    except RuntimeError:  # the directory exists but holds no Ray Train run (no checkpoint reported)
        return None
    return result.checkpoint


class IncompleteCheckpoint(ConfigError):
    """A checkpoint DeepSpeed cannot load: files missing or cut short. `problem`: the line without its advice."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        super().__init__(f"{problem}: {fix}")


def check_is_checkpoint(path: str, key: str, shown: str | None = None) -> None:
    """A one-line ConfigError unless `path` (local or URI) is a raytrain checkpoint DeepSpeed can load:
    its raytrain.json (valid JSON, with the keys the driver reads: `_missing_metadata`), DeepSpeed's
    `latest` file, the tag directory it names, and in that directory every rank's shard files for the
    world size raytrain.json records (`missing_shards`). A universal copy, or a directory with
    raytrain.json alone, is none. A path pyarrow cannot open (an unknown scheme, no credentials) is
    one line too. `shown` replaces the line's "KEY=PATH" (a run's own latest checkpoint: then a file missing
    anywhere is IncompleteCheckpoint, whose caller gives its own advice)."""
    from raytrain.config_files import first_line

    try:
        _check_is_checkpoint(path, key, shown)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # pyarrow: unknown scheme (ArrowInvalid is a ValueError), no network
        raise ConfigError(f"{key}={path}: cannot read it ({first_line(e)[:300]}): check the path or URI and its "
                          f"credentials") from None


def latest_complete_checkpoint(run: str, but: str | None = None) -> str | None:
    """The newest checkpoint_step_* directory of run `run` (a path or URI) that check_is_checkpoint accepts,
    `but` (a checkpoint's URI) left out, or None: what a run whose latest checkpoint is damaged or gone can
    continue from, with --resume-from. One listing and each checkpoint's checks, newest first: only on the way
    to an error."""
    import pyarrow.fs

    fs, path = filesystem(run)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path.rstrip("/")))
    except OSError:
        return None
    names = sorted((i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory
                    and re.fullmatch(r"checkpoint_step_\d+", i.base_name)), reverse=True)
    for uri in (f"{run.rstrip('/')}/{name}" for name in names):
        if uri == but:
            continue
        try:
            check_is_checkpoint(uri, "checkpoint")
            return uri
        except ConfigError:
            continue
    return None


def latest_checkpoint_uri(run: str) -> str | None:
    """latest_checkpoint's URI, named as the user gave the storage (checkpoint_uri), or None; raises as it does."""
    checkpoint = latest_checkpoint(run)
    return checkpoint_uri(run, checkpoint) if checkpoint is not None else None


def _latest_if_run(run: str) -> str | None:
    """The latest checkpoint of `run` where it is a run's directory (STORAGE/NAME, given where a checkpoint was
    asked for), else None: the one-line answer to the commonest wrong path, at the cost of reading Ray Train's
    record once, only on the way to an error."""
    try:
        return latest_checkpoint_uri(run)
    except ConfigError:  # a broken record, storage that cannot be reached: the plain message stands
        return None


def _check_is_checkpoint(path: str, key: str, shown: str | None) -> None:
    root = path.rstrip("/")
    missing = None
    if not exists(f"{root}/{METADATA}"):
        missing = f"no {METADATA} in it"
    elif not exists(f"{root}/{LATEST}"):
        missing = f"it has {METADATA} but no DeepSpeed {LATEST!r} file"
    else:
        fs, latest = filesystem(f"{root}/{LATEST}")
        with fs.open_input_stream(latest) as f:
            tag = f.read().decode().strip()
        if not tag or not exists(f"{root}/{tag}"):
            missing = f"its DeepSpeed {LATEST!r} file names tag {tag!r}, which is not in it"
    fix = "choose an earlier checkpoint_step_* directory of the run"
    if missing and shown:  # a run's own latest checkpoint: cut short or thinned by hand, not a wrong path
        raise IncompleteCheckpoint(f"{shown} is incomplete ({missing}: a save cut short, or files deleted)", fix)
    if missing:
        latest = _latest_if_run(root) if not exists(f"{root}/{METADATA}") else None
        fix = (f"it is a run's directory: give one of its checkpoints, the latest being {latest}" if latest else
               "give a checkpoint_step_* directory of a run")
        if not latest and not exists(f"{root}/{METADATA}") and exists(f"{root}/config.json"):
            # an export or a hub download: its weights start a new run, where DeepSpeed's shards continue one
            fix = ("it is a Hugging Face model directory (config.json) already" if key != "checkpoint.resume_from"
                   else f"it is a Hugging Face model directory (config.json): to train from its weights, set "
                        f"model.name_or_path={path} model.pretrained=true instead")
        raise ConfigError(f"{key}={path} is not a raytrain checkpoint ({missing}): {fix}")
    meta_fs, meta_path = filesystem(f"{root}/{METADATA}")
    meta = _read_json(meta_fs, meta_path, f"{root}/{METADATA}")
    absent = missing_shards(f"{root}/{tag}", meta)
    if absent:
        more = f" and {len(absent) - 1} more of its shard files" if len(absent) > 1 else ""
        world = written_world_size(meta)
        raise IncompleteCheckpoint(f"{shown or key + '=' + path} is incomplete: {METADATA} says {world} worker"
                                   f"{'s' if world != 1 else ''} wrote it, and its DeepSpeed tag {tag}/ has no "
                                   f"{absent[0]}{more} (a save cut short, or files deleted)", fix)
    cut = cut_short_shards(f"{root}/{tag}")
    if cut:
        more = f" and {len(cut) - 1} more of its shard files" if len(cut) > 1 else ""
        raise IncompleteCheckpoint(f"{shown or key + '=' + path} is damaged: its shard file {tag}/{cut[0]}{more} is "
                                   f"cut short (a torch.save archive without its end: a save or copy that stopped, or "
                                   f"a full disk; DeepSpeed cannot load it)", fix)


# The first bytes of a zip archive (a local file header), which torch.save writes since torch 1.6 (DeepSpeed's shards).
_ZIP_START = b"PK\x03\x04"


def cut_short_shards(tag_dir: str) -> list[str]:
    """The shard files (*.pt) in DeepSpeed tag directory `tag_dir` that begin as torch.save's zip archive but lack
    the end-of-archive record a complete one ends with: a save, copy or sync that stopped part way. torch.load
    fails on them ("failed finding central directory") in every worker, and Ray Train retried that
    checkpoint.max_failures times, each after a full engine build (measured: 4 attempts, 2 minutes and 168 lines of
    tracebacks for the tiny model). Only on a local or shared filesystem, where it costs two small reads a file;
    on object storage (one request per file) each worker checks its own files after the download (shards.restore).
    Files in another format (empty, torch's pre-1.6 pickle) are not judged."""
    import pyarrow.fs

    fs, path = filesystem(tag_dir)
    if not isinstance(fs, pyarrow.fs.LocalFileSystem):
        return []
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path.rstrip("/")))
    return sorted(i.base_name for i in infos if i.base_name.endswith(".pt") and i.type == pyarrow.fs.FileType.File
                  and is_cut_short(i.path))


def is_cut_short(path: str) -> bool:
    """Whether local file `path` starts as a zip archive (torch.save's format) and lacks the record it ends with."""
    import zipfile

    with open(path, "rb") as f:
        return f.read(len(_ZIP_START)) == _ZIP_START and not zipfile.is_zipfile(f)


def written_world_size(meta: dict[str, Any]) -> int:
    """The world size that wrote a checkpoint (its raytrain.json `meta`): the group's own (an elastic
    run's varies), else the spec's (older checkpoints record only that)."""
    return meta.get("world_size") or meta.get("spec", {}).get("cluster", {}).get("num_workers") or 1


def missing_shards(tag_dir: str, meta: dict[str, Any]) -> list[str]:
    """The shard files DeepSpeed's load_checkpoint opens (deepspeed 0.19.8, runtime/engine.py
    `_get_ckpt_name`, `_get_rank_zero_ckpt_name`) that `tag_dir` lacks, for the world size and ZeRO
    stage `meta` (raytrain.json) records: ZeRO-3 writes zero_pp_rank_R_mp_rank_00_model_states.pt per
    rank (stages 0-2 one mp_rank_00_model_states.pt) and ZeRO 1-3 one optimizer file per rank, named
    with a bf16_ prefix in bf16 mode (either is accepted; so is DeepSpeed's older `..._00optim_states.pt`).
    Without the full set the workers fail inside DeepSpeed's load, and Ray Train retries that
    checkpoint.max_failures times. One directory listing (a single LIST request on S3/GCS), not a stat
    per file: a 512-rank checkpoint holds 1,024 files."""
    import pyarrow.fs

    fs, path = filesystem(tag_dir)
    names = {i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector(path.rstrip("/")))}
    stage = int(meta.get("spec", {}).get("deepspeed", {}).get("zero_stage", 3))
    wanted: list[tuple[str, ...]] = []
    for rank in range(written_world_size(meta)):
        if stage >= 3:
            wanted.append((f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",))
        elif rank == 0:
            wanted.append(("mp_rank_00_model_states.pt",))
        if stage >= 1:
            optim = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            wanted.append((optim, "bf16_" + optim, optim.replace("_optim", "optim")))
    return [spellings[0] for spellings in wanted if not names.intersection(spellings)]


def read_metadata(checkpoint) -> dict[str, Any]:
    """raytrain.json of a ray.train.Checkpoint (local or remote storage); a ConfigError naming the
    file when it is not JSON (cut short, edited by hand), or lacks a key the driver reads."""
    path = f"{checkpoint.path.rstrip('/')}/{METADATA}"
    return _read_json(checkpoint.filesystem, path, f"{shown_uri(checkpoint)}/{METADATA}")


def shown_uri(checkpoint) -> str:
    """A ray.train.Checkpoint's path as the user would paste it: Ray's Checkpoint.path drops a URI's scheme,
    which this puts back (s3://, gs://, abfs://; a local path as it is)."""
    name = checkpoint.filesystem.type_name
    if name.startswith("py::fsspec+"):  # fsspec behind pyarrow: "py::fsspec+('abfs', 'az')", "py::fsspec+memory"
        protocols = re.findall(r"'([^']+)'", name) or [name.removeprefix("py::fsspec+")]
        name = "local" if protocols[0] == "file" else protocols[0]
    scheme = {"local": "", "gcs": "gs://"}.get(name, f"{name}://")
    return scheme + checkpoint.path.rstrip("/")


def _read_json(fs, path: str, shown: str) -> dict[str, Any]:
    with fs.open_input_stream(path) as f:
        text = f.read()
    try:
        meta = json.loads(text.decode())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{shown} is not valid JSON ({str(e)[:200]}): the checkpoint's save was cut short or the file "
                          f"was edited; choose another checkpoint (an earlier checkpoint_step_* of the run), or "
                          f"for a run's own latest checkpoint pass --fresh to start over") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{shown} holds {type(meta).__name__}, not raytrain's record of a checkpoint: choose "
                          f"another checkpoint (an earlier checkpoint_step_* of the run)")
    missing = _missing_metadata(meta)
    if missing:
        raise ConfigError(f"{shown} lacks {', '.join(missing)}, which raytrain writes into every checkpoint's "
                          f"record (the file was edited, or written by another program): choose another checkpoint "
                          f"(an earlier checkpoint_step_* of the run), or for a run's own latest checkpoint pass "
                          f"--fresh to start over")
    return meta


def _missing_metadata(meta: dict[str, Any]) -> list[str]:
    """The keys of raytrain.json the driver reads before any worker starts (the step it resumes at, the model
    and data settings `check_resume` compares) that `meta` lacks or holds as another type: without them the
    run stopped on a KeyError traceback. The rest (history, metrics, the whole spec the export rebuilds) is
    read where it is used."""
    spec = meta.get("spec")
    config = spec.get("config") if isinstance(spec, dict) else None
    wanted = {"step (an integer)": type(meta.get("step")) is int,
              "spec.model": isinstance(spec, dict) and isinstance(spec.get("model"), dict),
              "spec.config.data": isinstance(config, dict) and isinstance(config.get("data"), dict)}
    return [key for key, present in wanted.items() if not present]
