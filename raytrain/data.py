"""Training data on the driver: read a source with Ray Data, tokenize, pack into fixed-length blocks.

Start at `build_dataset` (and `build_eval_dataset` for the held-out split). Everything that can be
known cheaply about the source is checked on the driver first (`inspect_source`: the path exists,
it holds files of one format, the text column is there, it is not empty) and raises `ConfigError`
naming the key. Tokenization then runs as Ray Data tasks on the cluster's CPUs while the workers
train; each worker reads its share through `ray.train.get_dataset_shard("train")` (Ray Train splits
it with `streaming_split(equal=True)`, so every rank gets the same number of rows).
`ingest_config` is the Ray Train DataConfig that keeps the order deterministic. The tasks report
what they read to the run's progress counter (raytrain.data_progress), which the driver prints.

Documents, by source:
- text files (.txt, .text, .md): `data.text_document="file"` (default) makes each file one
  document, as for books; "line" makes each non-blank line one (blank lines are not documents).
- JSON lines (.jsonl, .ndjson, .json): each line is one record; `data.text_column` of it is the
  document. A .json file that starts with "[" is read as one array of records.
- parquet / a `datasets` save_to_disk directory / a hub dataset: each row's `data.text_column`.
- pre-tokenized parquet (`data.format=tokenized`, or auto when a parquet file has `input_ids` and
  no text column): each row's `input_ids` is one document, packed as-is (EOS appended unless the
  row already ends with it). Token ids outside the model's embedding table stop the run.
Text and JSON files may be compressed (.gz, .bz2, .zst, .lz4, .br; detected by pyarrow).
Paths may be local or on any filesystem pyarrow understands (s3://, gs://, hdfs://, abfs://);
directories are read recursively, skipping names that start with "." or "_". As with Ray Data's
own readers, a local path must be visible on every node that runs tasks (a shared filesystem).

Bad input, at run time (things only reading all the data can tell):
- invalid UTF-8 in text/JSON files: `data.invalid_utf8="replace"` (default) decodes the bad bytes
  as U+FFFD and logs one warning per file with the number of documents affected; "error" raises,
  naming the file and line. Nothing is dropped silently either way.
- empty documents (null, missing key, "", an empty file or an empty id list) are skipped and
  counted: one warning per file, or for row sources a warning with running totals (at most one
  per 30 s per tokenizer process, so a dataset full of nulls doesn't flood the log).
- malformed JSON, a text value that is not a string, token ids beyond the embedding table: the
  Ray Data task raises, naming the file and line or the value and the key to change.

Packing policy: documents are joined with one EOS token after each and cut into blocks of exactly
`seq_len` tokens; a document longer than seq_len continues in the next block (never dropped).
Packing is done per tokenization batch (`data.tokenize_batch_size` documents); the leftover tail of
each batch (< seq_len tokens) is dropped, which costs on average seq_len / 2 tokens per batch
(about 0.1% with 256 documents of 1k tokens at seq_len 2048). With `data.position_ids=
"per_document"` each row also carries `position_ids` that restart at 0 after every EOS and at
every block start (a block is all the context the model sees).

Held-out data: `data.eval_path` (read like `data.path`), or `data.eval_fraction` of `data.path`'s
documents chosen by a hash of each document's content: the same split in every run, train and
eval never share a document (identical duplicates land on the same side).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from raytrain.config import ConfigError, DataConfig, ModelConfig
from raytrain.data_progress import DataProgress, FileReads, report

logger = logging.getLogger("raytrain.data")

FORMATS = ("text", "json", "parquet", "hf", "tokenized")
_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
               ".ndjson": "json", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4", ".br")  # what open_text decompresses
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark is not text


@dataclass
class Source:
    """What the driver found at a data path: the format, the filesystem and the files to read."""

    format: str
    """One of FORMATS, or "builtin" (the generated corpus)."""
    column: str = "text"
    """The column the reader yields: the text column, or input_ids for pre-tokenized data."""
    filesystem: Any = None
    """pyarrow.fs.FileSystem holding `files`."""
    files: list[str] = field(default_factory=list)
    hub_id: str | None = None
    """A Hugging Face hub dataset id (format "hf", not on any filesystem)."""


def build_dataset(data: DataConfig, model: ModelConfig, seed: int, progress: DataProgress | None = None):
    """The packed training dataset: rows of {"input_ids": int32[seq_len]} (+ "position_ids").
    `progress` counts what its tasks read (the held-out data is never counted)."""
    return _build(data, model, seed, data.path, "data.path", "train" if data.eval_fraction else None, progress)


def build_eval_dataset(data: DataConfig, model: ModelConfig, seed: int):
    """The packed held-out dataset (same rows as training), or None when no eval data is configured."""
    if data.eval_path is not None:
        return _build(data, model, seed, data.eval_path, "data.eval_path", None)
    if data.eval_fraction:
        return _build(data, model, seed, data.path, "data.path", "eval")
    return None


def _build(data: DataConfig, model: ModelConfig, seed: int, path, key: str, split: str | None,
           progress: DataProgress | None = None):
    import ray.data

    from raytrain.model import load_model_config

    # Ray Data's tqdm bars redraw into every log line (and into `ray job logs`) as escape codes;
    # progress is in raytrain's own lines instead (raytrain.data_progress, and data_wait).
    ray.data.DataContext.get_current().enable_progress_bars = False
    source = inspect_source(data, path, key)
    counter = progress.track(source) if progress is not None else None
    if source.format == "builtin":
        ds = ray.data.from_items([{"text": t} for t in builtin_corpus(data.num_builtin_documents, seed)])
    elif source.format in ("text", "json", "hf") and source.hub_id is None:
        # One task per file: flat_map (unlike map_batches) is not fused into the tokenizer's
        # batches, which would otherwise pull tokenize_batch_size *files* into one task.
        ds = ray.data.from_items([{"path": f} for f in source.files], override_num_blocks=len(source.files))
        ds = ds.flat_map(read_documents, fn_kwargs={
            "format": source.format, "filesystem": source.filesystem, "text_column": data.text_column,
            "text_document": data.text_document, "invalid_utf8": data.invalid_utf8, "progress": counter})
    elif source.format in ("parquet", "tokenized"):
        ds = ray.data.read_parquet(source.files, filesystem=source.filesystem).select_columns([source.column])
    else:  # a hub dataset, streamed: nothing is downloaded on the driver
        import datasets

        hub = datasets.load_dataset(source.hub_id, split=data.hf_split, streaming=True)
        ds = ray.data.from_huggingface(hub.select_columns([data.text_column]))
    fn_kwargs = {"seq_len": data.seq_len, "model": model, "text_column": source.column,
                 "pretokenized": source.format == "tokenized", "position_ids": data.position_ids,
                 "split": split, "eval_fraction": data.eval_fraction,
                 "vocab_size": load_model_config(model).vocab_size, "progress": counter}
    return ds.map_batches(tokenize_and_pack, fn_kwargs=fn_kwargs, batch_size=data.tokenize_batch_size,
                          batch_format="numpy", concurrency=data.tokenize_concurrency)


def ingest_config(num_shards: int | None = None):
    """Ray Train's DataConfig for raytrain: order preserved, training rows in `num_shards` shards
    (None: one per worker). See raytrain.ingest."""
    from raytrain.ingest import ShardedIngest

    return ShardedIngest(num_shards)


def resolve_format(data: DataConfig, path=None, key: str = "data.path") -> str:
    """The source format of `path` (default: data.path), from `data.format` or what is there."""
    return inspect_source(data, data.path if path is None else path, key).format


# ---------------------------------------------------------------------------------------------
# Driver-side checks: cheap reads (listings, parquet footers, one JSON line), no Ray.


def inspect_source(data: DataConfig, path, key: str = "data.path") -> Source:
    """List and check a source before any worker starts; every problem is a one-line ConfigError."""
    if data.format != "auto" and data.format not in FORMATS:
        raise ConfigError(f"data.format must be auto or one of {', '.join(FORMATS)}, got {data.format!r}")
    if path is None:
        return Source("builtin")
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise ConfigError(f"{key} is an empty list: give at least one file or directory"
                          + (" (or null for the built-in corpus)" if key == "data.path" else ""))
    if data.format == "hf" or (data.format == "auto" and _looks_like_hf(paths[0])):
        return _inspect_hf(data, paths, key)
    fs, files = _list_files(paths, data.format, key)
    fmt = data.format if data.format != "auto" else _format_of_files(files, paths, key)
    # Text and JSON files go through read_documents, which yields a "text" column.
    column = data.text_column if fmt in ("parquet", "tokenized") else "text"
    source = Source(fmt, column=column, filesystem=fs, files=[f for f, _ in files])
    if fmt in ("parquet", "tokenized"):
        return _check_parquet(source, data, key)
    if all(size == 0 for _, size in files):
        raise ConfigError(f"{key}: every file of {', '.join(paths)} is empty: give files with documents in them")
    if fmt == "json":
        _check_json_column(source, data.text_column, key)
    return source


def _filesystem(path: str, key: str):
    import pyarrow.fs as pafs

    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    try:
        return pafs.FileSystem.from_uri(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ValueError... by scheme
        raise ConfigError(f"{key}: cannot open {path} ({_first_line(e)}): check the URI, the filesystem's "
                          f"pyarrow support and the credentials") from None


def _file_info(fs, fs_path: str, path: str, key: str):
    import pyarrow.fs as pafs

    try:
        info = fs.get_file_info(fs_path)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({_first_line(e)}): check the path and credentials") from None
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"{key}: {path} does not exist; give an existing file or directory "
                          f"(local, s3://, gs://, ...)")
    return info


def _list_files(paths: list[str], fmt: str, key: str):
    """(filesystem, [(file, size)]): named files as given, directories recursively by extension."""
    import pyarrow.fs as pafs

    fs0, files = None, []
    for path in paths:
        fs, fs_path = _filesystem(path, key)
        if fs0 is None:
            fs0 = fs
        elif fs.type_name != fs0.type_name:
            raise ConfigError(f"{key} mixes filesystems ({fs0.type_name} and {fs.type_name}): "
                              f"read from one filesystem per path list")
        info = _file_info(fs, fs_path, path, key)
        if info.type == pafs.FileType.File:
            files.append((info.path, info.size))
            continue
        wanted = {"tokenized": "parquet"}.get(fmt, fmt)
        found = []
        for f in fs.get_file_info(pafs.FileSelector(fs_path, recursive=True)):
            rel = os.path.relpath(f.path, fs_path)
            if f.type != pafs.FileType.File or any(p.startswith((".", "_")) for p in rel.split("/")):
                continue
            if _format_of(f.path) is not None and (fmt == "auto" or _format_of(f.path) == wanted):
                found.append((f.path, f.size))
        if not found:
            kinds = sorted(ext for ext, f in _EXTENSIONS.items() if fmt == "auto" or f == wanted)
            raise ConfigError(f"{key}: directory {path} has no {'/'.join(kinds)} files: point it at your data "
                              f"(or set data.format if the files have other extensions)")
        files.extend(sorted(found))
    return fs0, files


def _format_of(name: str) -> str | None:
    base = name.lower()
    for suffix in _COMPRESSED:
        if base.endswith(suffix):
            fmt = _EXTENSIONS.get(os.path.splitext(base[: -len(suffix)])[1])
            return None if fmt == "parquet" else fmt  # parquet compresses inside the file
    return _EXTENSIONS.get(os.path.splitext(base)[1])


def _format_of_files(files: list[tuple[str, int]], paths: list[str], key: str) -> str:
    formats = {_format_of(f) for f, _ in files}
    if None in formats:
        unknown = next(f for f, _ in files if _format_of(f) is None)
        raise ConfigError(f"{key}: cannot tell the format of {unknown}: set data.format to one of {', '.join(FORMATS)}")
    if len(formats) > 1:
        raise ConfigError(f"{key}: {', '.join(paths)} mixes formats ({', '.join(sorted(formats))}): "
                          f"give one format per path list, or set data.format")
    return formats.pop()


def _check_parquet(source: Source, data: DataConfig, key: str) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def open_file(path):
        try:
            return pq.ParquetFile(source.filesystem.open_input_file(path))
        except (OSError, pa.ArrowInvalid) as e:
            raise ConfigError(f"{key}: {path} is not a readable parquet file ({_first_line(e)})") from None

    first = open_file(source.files[0])
    schema = first.schema_arrow
    if source.format == "parquet" and data.format == "auto" and data.text_column not in schema.names \
            and "input_ids" in schema.names:
        source.format = "tokenized"
    if source.format == "tokenized":
        source.column = "input_ids"
        field_ = schema.field("input_ids") if "input_ids" in schema.names else None
        if field_ is None or not (pa.types.is_list(field_.type) or pa.types.is_large_list(field_.type)
                                  or pa.types.is_fixed_size_list(field_.type)) \
                or not pa.types.is_integer(field_.type.value_type):
            found = f"its input_ids is {field_.type}" if field_ else f"columns: {', '.join(schema.names)}"
            raise ConfigError(f"data.format=tokenized needs an input_ids column of integer lists in "
                              f"{source.files[0]} ({found}): write token ids there, or set data.format=parquet")
    else:
        if data.text_column not in schema.names:
            raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {source.files[0]} "
                              f"(columns: {', '.join(schema.names)}): set data.text_column")
        t = schema.field(data.text_column).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)):
            raise ConfigError(f"data.text_column={data.text_column!r} in {source.files[0]} holds {t}, not strings: "
                              f"set data.text_column to the text column")
    rows = first.metadata.num_rows
    for path in source.files[1:]:
        if rows:
            break
        rows = open_file(path).metadata.num_rows  # footers only: stops at the first non-empty file
    if not rows:
        raise ConfigError(f"{key}: the parquet files have no rows ({len(source.files)} files, first "
                          f"{source.files[0]}): give a non-empty dataset")
    return source


def open_text(filesystem, path: str):
    """A text/JSON file's stream, decompressed by extension. pyarrow detects .gz, .bz2, .lz4 and
    .zst itself but not brotli's .br, which it can decode when told."""
    return filesystem.open_input_stream(path, compression="brotli" if path.endswith(".br") else "detect")


def _check_json_column(source: Source, column: str, key: str) -> None:
    """The first record of the first non-empty file must have `column` (one read of up to 1 MiB)."""
    with open_text(source.filesystem, source.files[0]) as f:
        head = f.read(1 << 20)
    line, newline, _ = head.removeprefix(_BOM).lstrip().partition(b"\n")
    if not line or line.startswith(b"[") or (not newline and len(head) == 1 << 20):
        return  # an empty first file, a JSON array or a huge first line: the reader checks each record
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {source.files[0]} line 1 is not valid JSON ({e.msg}): "
                          f"give JSON lines (one object per line)") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{key}: {source.files[0]} line 1 is a {type(record).__name__}, not a JSON object: "
                          f"give JSON lines (one object per line)")
    if column not in record:
        raise ConfigError(f"data.text_column={column!r} is not a key of the records in {source.files[0]} "
                          f"(keys: {', '.join(record)}): set data.text_column")


def _looks_like_hf(path: str) -> bool:
    if "://" in path:
        return False  # listing a remote directory to sniff it costs requests; say data.format=hf
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in _HF_MARKERS)


def _inspect_hf(data: DataConfig, paths: list[str], key: str) -> Source:
    """A save_to_disk directory (its .arrow files, read directly on the cluster) or a hub id."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    if len(paths) != 1:
        raise ConfigError(f"{key}: data.format=hf reads one dataset; give one directory or hub id")
    path = paths[0]
    if "://" not in path and not os.path.exists(os.path.expanduser(path)):
        if path.startswith((".", "/", "~")) or path.count("/") > 1:
            raise ConfigError(f"{key}: {path} does not exist; give a save_to_disk directory or a hub id (org/name)")
        return _inspect_hub(data, path, key)
    fs, root = _filesystem(path, key)
    if _file_info(fs, root, path, key).type != pafs.FileType.Directory:
        raise ConfigError(f"{key}: {path} is a file; data.format=hf needs a save_to_disk directory")

    def read_json_file(p):
        try:
            with fs.open_input_stream(p) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    splits = read_json_file(f"{root}/dataset_dict.json")
    if splits is not None:  # a DatasetDict: one subdirectory per split
        if data.hf_split not in splits.get("splits", []):
            raise ConfigError(f"data.hf_split={data.hf_split!r} is not a split of {path} "
                              f"(splits: {', '.join(splits.get('splits', []))}): set data.hf_split")
        root = f"{root}/{data.hf_split}"
    state = read_json_file(f"{root}/state.json")
    if state is None:
        raise ConfigError(f"{key}: {path} has no state.json: give a directory written by datasets' save_to_disk")
    files = [f"{root}/{f['filename']}" for f in state.get("_data_files", [])]
    rows, names = 0, None
    for f in files:  # stream headers only; stops at the first file with a row
        with fs.open_input_file(f) as stream:
            reader = pa.ipc.open_stream(stream)
            names = names or reader.schema.names
            for batch in reader:
                rows += batch.num_rows
                if rows:
                    break
        if rows:
            break
    if names is not None and data.text_column not in names:
        raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {path} "
                          f"(columns: {', '.join(names)}): set data.text_column")
    if not rows:
        raise ConfigError(f"{key}: the dataset at {path} has no rows: give a non-empty dataset")
    return Source("hf", column="text", filesystem=fs, files=files)


def _inspect_hub(data: DataConfig, hub_id: str, key: str) -> Source:
    import datasets

    try:
        hub = datasets.load_dataset(hub_id, split=data.hf_split, streaming=True)
    except Exception as e:  # datasets raises many types (network, missing split, missing repo)
        raise ConfigError(f"{key}: cannot open the hub dataset {hub_id!r} split {data.hf_split!r} "
                          f"({_first_line(e)}): check the id, data.hf_split and your network/token") from None
    if hub.column_names is not None and data.text_column not in hub.column_names:
        raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {hub_id} "
                          f"(columns: {', '.join(hub.column_names)}): set data.text_column")
    return Source("hf", column=data.text_column, hub_id=hub_id)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------
# Ray Data tasks: read files into documents, then tokenize and pack.


def read_documents(row: dict[str, Any], *, format: str, filesystem, text_column: str, text_document: str,
                   invalid_utf8: str, progress: str | None = None) -> Iterator[dict[str, str]]:
    """One file -> rows of {"text": document}, streamed (a line-per-document file never sits in memory whole).
    `progress`: the run's counter actor, told how many bytes of the file were read and how many
    documents they held."""
    reads = FileReads(progress)
    if format == "hf":
        documents = _read_arrow_file(row["path"], filesystem, text_column, reads)
    else:
        documents = _read_text_file(row["path"], format, filesystem, text_column, text_document, invalid_utf8, reads)
    yield from reads.count(documents)


def _read_text_file(path: str, format: str, filesystem, text_column: str, text_document: str, invalid_utf8: str,
                    reads: FileReads) -> Iterator[dict[str, str]]:
    """A text or JSON file (format "text" or "json"), read as `read_documents` says."""
    import pyarrow as pa

    counts: collections.Counter = collections.Counter()
    with open_text(filesystem, path) as stream:  # decompresses .gz/.zst/.br/... by extension
        # Decompressed bytes are not the file's bytes: a compressed file counts whole when it ends.
        compressed = isinstance(stream, pa.CompressedInputStream)
        f = stream if compressed else reads.counting(stream)
        if format == "text" and text_document == "file":
            text = _decode(f.read().removeprefix(_BOM), invalid_utf8, path, counts)
            if text:
                yield {"text": text}
            else:
                counts["empty"] += 1
        elif format == "text":
            for lineno, raw in _lines(f, f.read(1 << 20).removeprefix(_BOM)):
                raw = raw.rstrip(b"\r")
                if raw.strip():  # a blank line separates documents, it is not one
                    yield {"text": _decode(raw, invalid_utf8, f"{path} line {lineno}", counts)}
        else:
            head = f.read(1 << 20).removeprefix(_BOM)
            if head.lstrip().startswith(b"["):  # one JSON array: the whole file is one value
                records = _parse_json(_decode(head + f.read(), invalid_utf8, path, counts), path, None)
                items = ((f"{path} record {i + 1}", r) for i, r in enumerate(records))
            else:
                items = ((f"{path} line {n}", _parse_json(_decode(raw, invalid_utf8, f"{path} line {n}", counts),
                                                          path, n))
                         for n, raw in _lines(f, head) if raw.strip())
            for where, record in items:
                if not isinstance(record, dict):
                    raise ConfigError(f"{where} is a {type(record).__name__}, not a JSON object: "
                                      f"give one object per line")
                if _is_document(record.get(text_column), where, text_column, counts):
                    yield {"text": record[text_column]}
    reads.close((lambda: filesystem.get_file_info(path).size) if compressed else None)
    _report_file(path, counts)


def _lines(f, head: bytes = b"", chunk_bytes: int = 1 << 24) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a stream, read in chunks; `head` is what was already read of it."""
    lineno, rest, chunk = 0, b"", head or f.read(chunk_bytes)
    while chunk:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        for part in parts:
            lineno += 1
            yield lineno, part
        chunk = f.read(chunk_bytes)
    if rest:
        yield lineno + 1, rest


def _decode(raw: bytes, invalid_utf8: str, where: str, counts: collections.Counter) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if invalid_utf8 == "error":
            raise ConfigError(f"{where}: invalid UTF-8 at byte {e.start}: fix the file, or set data.invalid_utf8="
                              f"replace to decode such bytes as U+FFFD (counted in the log)") from None
        counts["invalid_utf8"] += 1
        return raw.decode("utf-8", errors="replace")


def _parse_json(text: str, path: str, lineno: int | None) -> Any:
    """One JSON line (lineno given) or a whole file holding one array (lineno None)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        where = path if lineno is None else f"{path} line {lineno}"
        raise ConfigError(f"{where} is not valid JSON ({e.msg} at column {e.colno}): fix or remove it") from None
    if lineno is None and not isinstance(value, list):
        raise ConfigError(f"{path} starts with '[' but is not a JSON array: give JSON lines or one array")
    return value


def _read_arrow_file(path: str, filesystem, column: str, reads: FileReads) -> Iterator[dict[str, str]]:
    """One .arrow file of a save_to_disk directory (Arrow IPC stream), one record batch at a time."""
    import pyarrow as pa

    counts = collections.Counter()
    with filesystem.open_input_file(path) as stream:
        for batch in pa.ipc.open_stream(stream):
            for value in batch.column(batch.schema.get_field_index(column)).to_pylist():
                if _is_document(value, path, column, counts):
                    yield {"text": value}
            reads.at(stream.tell())
        reads.close(stream.size)  # the IPC stream's end marker is never "read" as a batch
    _report_file(path, counts)


def _is_document(value: Any, where: str, column: str, counts: collections.Counter) -> bool:
    """True for a non-empty string; empty or missing values are counted (reported per file)."""
    if value is None or value == "":
        counts["empty"] += 1
        return False
    if not isinstance(value, str):
        raise ConfigError(f"{where}: data.text_column={column!r} holds a {type(value).__name__}, "
                          f"not a string: set data.text_column to the text field")
    return True


def _report_file(path: str, counts: collections.Counter) -> None:
    if counts["invalid_utf8"]:
        logger.warning("raytrain data: %s: %d documents had invalid UTF-8, decoded with U+FFFD replacement "
                       "characters (data.invalid_utf8=error stops on it instead)", path, counts["invalid_utf8"])
    if counts["empty"]:
        logger.warning("raytrain data: %s: skipped %d empty documents", path, counts["empty"])


_skipped_in_process = {"total": 0, "unreported": 0, "last_report": 0.0}
_REPORT_EVERY_S = 30.0


def _report_skipped_rows(n: int, batch_size: int) -> None:
    """Count empty rows; log the first at once, then running totals at most every 30 s."""
    state = _skipped_in_process
    state["total"] += n
    state["unreported"] += n
    now = time.monotonic()
    if state["last_report"] == 0.0 or now - state["last_report"] >= _REPORT_EVERY_S:
        logger.warning("raytrain data: skipped %d empty documents (null or \"\") since the last report, "
                       "%d in this process so far (latest batch: %d of %d)",
                       state["unreported"], state["total"], n, batch_size)
        state["unreported"], state["last_report"] = 0, now


def tokenize_and_pack(batch: dict[str, np.ndarray], *, seq_len: int, model: ModelConfig, text_column: str,
                      pretokenized: bool, position_ids: str = "packed", split: str | None = None,
                      eval_fraction: float = 0.0, vocab_size: int | None = None,
                      progress: str | None = None) -> dict[str, np.ndarray]:
    """One Ray Data batch of documents -> blocks of seq_len token ids (see the packing policy above).

    `split` "train"/"eval" keeps the documents on that side of `eval_fraction` (by content hash);
    `vocab_size` (the model's embedding rows) makes any token id beyond it an error, not a crash on GPU;
    `progress` (the run's counter actor) gets the batch's rows, documents and tokens (EOS included).
    """
    from raytrain.model import load_tokenizer

    tokenizer = load_tokenizer(model)  # cached per Ray worker process
    eos = tokenizer.eos_token_id
    column = "input_ids" if pretokenized else text_column
    if column not in batch:
        raise ConfigError(f"data.text_column={column!r} is not a column of the data "
                          f"(columns: {', '.join(batch)}): set data.text_column")
    values = batch[column]
    if pretokenized:
        docs = [np.asarray(v, dtype=np.int64) for v in values if v is not None and len(v)]
        keys = [d.tobytes() for d in docs] if split else []
    else:
        docs = [v for v in values.tolist() if v is not None and v != ""]
        for v in docs:
            if not isinstance(v, str):
                raise ConfigError(f"data.text_column={column!r} holds {type(v).__name__} values, not strings: "
                                  f"set data.text_column to the text column")
        keys = [d.encode("utf-8", errors="surrogatepass") for d in docs] if split else []
    if len(docs) < len(values):
        _report_skipped_rows(len(values) - len(docs), len(values))
    if split:
        keep = _eval_side(keys, eval_fraction) == (split == "eval")
        docs = [d for d, k in zip(docs, keep) if k]
    if not pretokenized:
        # return_attention_mask=False: the mask is all ones here and building it costs ~half the time.
        encoded = tokenizer(docs, add_special_tokens=False, return_attention_mask=False,
                            return_token_type_ids=False)["input_ids"] if docs else []
        docs = [np.asarray(ids, dtype=np.int64) for ids in encoded]
    pieces, lengths = [], []
    for d in docs:
        ends_with_eos = pretokenized and len(d) and d[-1] == eos
        pieces.append(d if ends_with_eos else np.append(d, eos))
        lengths.append(len(pieces[-1]))
    flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    if vocab_size is not None and flat.size and (flat.max() >= vocab_size or flat.min() < 0):
        bad = int(flat.max() if flat.max() >= vocab_size else flat.min())
        fix = ("the data was tokenized with another vocabulary: re-tokenize it with model.tokenizer"
               if pretokenized else "set model.config.vocab_size >= len(tokenizer) or use the model's own tokenizer")
        raise ConfigError(f"token id {bad} is outside the model's embedding table ({vocab_size} rows): {fix}")
    report(progress, rows=len(values), documents=len(docs), tokens=int(flat.size))
    n_blocks = len(flat) // seq_len
    out = {"input_ids": flat[: n_blocks * seq_len].reshape(n_blocks, seq_len).astype(np.int32)}
    if position_ids == "per_document":
        out["position_ids"] = document_positions(np.asarray(lengths, np.int64), n_blocks * seq_len, seq_len)
    return out


def document_positions(lengths: np.ndarray, num_tokens: int, seq_len: int) -> np.ndarray:
    """int32[num_tokens // seq_len, seq_len]: each token's offset from the later of its document's
    start and its block's start (documents given by `lengths`, EOS included)."""
    doc_start = np.repeat(np.cumsum(lengths) - lengths, lengths)[:num_tokens]
    index = np.arange(num_tokens)
    block_start = index - index % seq_len
    return (index - np.maximum(doc_start, block_start)).astype(np.int32).reshape(-1, seq_len)


def _eval_side(keys: list[bytes], eval_fraction: float) -> np.ndarray:
    """True for documents in the held-out fraction: the first 8 bytes of blake2b as a uniform number."""
    threshold = eval_fraction * 2.0**64
    return np.array([int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little") < threshold
                     for k in keys], dtype=bool)


# ---------------------------------------------------------------------------------------------
# The built-in corpus: generated, so nothing is downloaded; structured, so the loss visibly falls.

_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
_THINGS = ["apples", "books", "coins", "stones", "shells", "cards", "pens", "cups"]
_COLORS = ["red", "blue", "green", "yellow", "black", "white"]


def builtin_corpus(num_documents: int, seed: int) -> list[str]:
    """Short stories with counting and addition: learnable structure for a tiny model."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            a, b = rng.sample(_NAMES, 2)
            x, y = rng.randint(1, 9), rng.randint(1, 9)
            color, thing = rng.choice(_COLORS), rng.choice(_THINGS)
            sentences.append(f"{a} has {x} {color} {thing}. {b} has {y} {color} {thing}. "
                             f"together {a} and {b} have {x + y} {color} {thing}.")
        docs.append(" ".join(sentences))
    return docs


def describe(data: DataConfig) -> dict[str, Any]:
    """What the data section resolves to (for --dry-run)."""
    out = {"source": data.path or f"built-in corpus ({data.num_builtin_documents} documents)",
           "format": resolve_format(data), "seq_len": data.seq_len, "position_ids": data.position_ids}
    if data.eval_path is not None:
        out["eval"] = {"source": data.eval_path, "format": resolve_format(data, data.eval_path, "data.eval_path")}
    elif data.eval_fraction:
        out["eval"] = {"source": f"{data.eval_fraction:g} of the documents of {out['source']} (by content hash)"}
    return out
