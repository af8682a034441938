"""What is at a data path, checked on the driver before any worker starts: `inspect_sources`.

Everything that can be known cheaply about a source (the path exists, it holds files of one
format, the text column is there, it is not empty) is checked here with listings, parquet footers
and the first records of the first file (a JSON line or an array's first object and its text
value, the UTF-8 of a text file under data.invalid_utf8=error), and raises a one-line `ConfigError`
naming the key. `--dry-run` and a real run both run these checks. The `Source` it returns
tells raytrain.data.pipeline how to read it.

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
  as U+FFFD; "error" makes each such line (or file) a bad record, naming the file and line.
- empty documents (null, missing key, "", an empty file or an empty id list) are skipped.
  What both policies skip or change is counted by the run's counter and reported in one line at
  the end of the run (raytrain.data.progress); read outside a run, each task logs it instead.
- malformed JSON, a text value that is not a string, token ids beyond the embedding table: bad
  records (raytrain.data.bad_records). The first stops the run, never retried: one line naming the
  file and line or the value, how many more were found, and the key to change; exit code 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from raytrain.config import ConfigError, DataConfig
from raytrain.run_spec import DataFacts

FORMATS = ("text", "json", "parquet", "hf", "tokenized")
_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
               ".ndjson": "json", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4", ".br")  # what open_text decompresses
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark is not text


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

# ---------------------------------------------------------------------------------------------
# Driver-side checks: cheap reads (listings, parquet footers, one JSON line), no Ray.


@dataclass(frozen=True)
class Sources:
    """The training source and the held-out one, inspected once on the driver (`inspect_sources`)."""

    train: Source
    eval: Source | None
    """None: no held-out data. With data.eval_fraction this is the training source again, split by hash."""


def inspect_sources(data: DataConfig) -> Sources:
    """Check `data.path` and `data.eval_path` before any worker starts (one-line ConfigErrors)."""
    train = inspect_source(data, data.path, "data.path")
    if data.eval_path is not None:
        return Sources(train, inspect_source(data, data.eval_path, "data.eval_path"))
    return Sources(train, train if data.eval_fraction else None)


def data_facts(data: DataConfig, sources: Sources) -> DataFacts:
    """What the data section resolved to: carried to the workers and printed by --dry-run."""
    source = str(data.path) if data.path is not None else f"built-in corpus ({data.num_builtin_documents} documents)"
    if sources.eval is None:
        return DataFacts(source=source, format=sources.train.format)
    if data.eval_path is not None:
        return DataFacts(source=source, format=sources.train.format, eval_source=str(data.eval_path),
                         eval_format=sources.eval.format)
    return DataFacts(source=source, format=sources.train.format,
                     eval_source=f"{data.eval_fraction:g} of the documents of {source} (by content hash)",
                     eval_format=sources.train.format)


def inspect_source(data: DataConfig, path, key: str = "data.path") -> Source:
    """List and check a source before any worker starts; every problem is a one-line ConfigError."""
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
    first = next(f for f, size in files if size)  # the first file with something in it
    if fmt == "json":
        _check_json_column(source, first, data, key)
    elif fmt == "text":
        _check_text_head(source, first, data)
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


def _check_json_column(source: Source, path: str, data: DataConfig, key: str) -> None:
    """The first record of the first file: valid JSON (a line, or an array's first element), an
    object with `data.text_column`, holding a string (or null), its bytes UTF-8 under
    data.invalid_utf8=error. One read of up to 1 MiB; the readers check every later record."""
    column = data.text_column
    with open_text(source.filesystem, path) as f:
        head = f.read(1 << 20)
    body = head.removeprefix(BOM).lstrip()
    if body.startswith(b"["):  # one JSON array of records
        where, text = f"{path} (its first record)", _utf8(body[1:], data, path, 1, cut=len(head) == 1 << 20)
        try:
            record, _ = json.JSONDecoder().raw_decode(text.lstrip())
        except json.JSONDecodeError as e:
            if len(head) == 1 << 20:
                return  # a first record over 1 MiB: the reader checks it
            raise ConfigError(f"{key}: {path} is not a valid JSON array ({e.msg} in its first record): "
                              f"give JSON lines or an array of objects") from None
    else:
        line, newline, _ = body.partition(b"\n")
        if not line or (not newline and len(head) == 1 << 20):
            return  # an empty first file or a huge first line: the reader checks each record
        lineno = head.removeprefix(BOM)[:len(head.removeprefix(BOM)) - len(body)].count(b"\n") + 1
        where = f"{path} line {lineno}"
        try:
            record = json.loads(_utf8(line, data, path, lineno))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: {where} is not valid JSON ({e.msg}): "
                              f"give JSON lines (one object per line)") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{key}: {where} is a {type(record).__name__}, not a JSON object: "
                          f"give JSON lines (one object per line)")
    if column not in record:
        raise ConfigError(f"data.text_column={column!r} is not a key of the records in {path} "
                          f"(keys: {', '.join(record)}): set data.text_column")
    if record[column] is not None and not isinstance(record[column], str):
        raise ConfigError(f"data.text_column={column!r} holds {type(record[column]).__name__} values in {where}, "
                          f"not text: set data.text_column to the text key")


def _check_text_head(source: Source, path: str, data: DataConfig) -> None:
    """Under data.invalid_utf8=error, the first MiB of the first file must be UTF-8 (the readers
    check the rest); under "replace" any bytes are read."""
    if data.invalid_utf8 != "error":
        return
    with open_text(source.filesystem, path) as f:
        head = f.read(1 << 20)
    _utf8(head.removeprefix(BOM), data, path, 1, cut=len(head) == 1 << 20)


def _utf8(raw: bytes, data: DataConfig, path: str, first_line: int, cut: bool = False) -> str:
    """`raw` decoded; invalid UTF-8 under data.invalid_utf8=error is the readers' one-line error,
    found here first. `cut`: raw ends mid-file, so a character split at its end is not an error."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("strict" if data.invalid_utf8 == "error" else "replace")
    try:
        return decoder.decode(raw, final=not cut)
    except UnicodeDecodeError as e:
        line = first_line + raw[:e.start].count(b"\n")
        raise ConfigError(f"{path} line {line}: invalid UTF-8 at byte {e.start}: fix the file, or set "
                          f"data.invalid_utf8=replace to read such bytes as U+FFFD") from None


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
    rows, names, text_type = 0, None, None
    for f in files:  # stream headers only; stops at the first file with a row
        with fs.open_input_file(f) as stream:
            reader = pa.ipc.open_stream(stream)
            names = names or reader.schema.names
            if text_type is None and data.text_column in reader.schema.names:
                text_type = reader.schema.field(data.text_column).type
            for batch in reader:
                rows += batch.num_rows
                if rows:
                    break
        if rows:
            break
    if names is not None and data.text_column not in names:
        raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {path} "
                          f"(columns: {', '.join(names)}): set data.text_column")
    if text_type is not None and not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise ConfigError(f"data.text_column={data.text_column!r} in {path} holds {text_type}, not strings: "
                          f"set data.text_column to the text column")
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

