"""What is at a data path, checked on the driver before any worker starts: `inspect_sources`.

Everything that can be known cheaply about a source (the path exists, it holds files of one
format, no file is reached twice and no link leads nowhere, no raytrain checkpoint is among them,
the text column is there, it is not empty, no eval file is a training file) is checked here with
listings, a stat per local file, parquet footers, the first record of every local JSON file (a
JSON line or an array's first object and its text value; remote: of the first file with one), the header line of every local CSV file
(remote: the first), the first bytes of every local text file
(a UTF-16/32 byte order mark) and the first MiB of the first one under data.invalid_utf8=error, and
raises a one-line `ConfigError` naming the key. `--dry-run` and a real run both run these checks.
What a source leaves unread (files of other splits or with other extensions, a labels column) and
data settings that have no effect get one note each (`Sources.notes`, printed by the caller).
The `Source` it returns tells raytrain.data.pipeline how to read it.

Splits: data.hf_split of data.path and data.eval_hf_split ("validation") of data.eval_path, read
from a DatasetDict, a hub dataset, or a directory of hub-named shards ({split}-00000-of-00004.*,
a hub snapshot's data/: the other splits' files are left out). An eval source that is the
training source (the same files, or the same hub id and split) is refused.

Documents, by source:
- text files (.txt, .text, .md): `data.text_document="file"` (default) makes each file one
  document, as for books (read in pieces of ~64k characters, so a file of any size streams through
  bounded memory; raytrain.data.readers); "line" makes each non-blank line one (blank lines are
  not documents).
- JSON lines (.jsonl, .ndjson, .json): each line is one record; `data.text_column` of it is the
  document. A .json file that starts with "[" is read as one array of records (parsed a record at
  a time).
- CSV (.csv; .tsv tab-separated), as Hugging Face's `load_dataset("csv")` takes it: a header
  line, then a row per record (quoted values may hold commas and newlines); `data.text_column` of
  each row is the document. Read a block at a time by pyarrow's CSV reader. Unlike pandas (under
  load_dataset) every value stays text ("NA" and "123" are documents, not dropped or numbers), and a
  row with another number of fields stops the run (a bad record) rather than being padded. A bad
  record is named by the file's line it starts on, as an editor numbers lines (the header, blank
  lines and the lines inside quoted values counted), not by pyarrow's "Row #N" (records, header
  included) or a count of data rows.
- parquet / a `datasets` save_to_disk directory / a hub dataset: each row's `data.text_column`.
- pre-tokenized parquet (`data.format=tokenized`, or auto when a parquet file has `input_ids` and
  no text column): each row's `input_ids` is one document, packed as-is (EOS appended unless the
  row already ends with it). Token ids outside the model's embedding table stop the run.
Text, JSON and CSV files may be compressed (.gz, .bz2, .zst, .lz4, .br, .xz, by suffix in any case);
archives (.zip, .tar, .tar.gz, ...) are refused: they hold many files, read as text they are noise.
Paths may be local or on any filesystem pyarrow understands (s3://, gs://, hdfs://, abfs://);
directories are read recursively, skipping names that start with "." or "_": with data.format
"auto" the files whose extension names a format (the others left out with a note), with
data.format set every file (a .parquet file among text/JSON ones, or a text/JSON-named one among
parquet, is refused). A save_to_disk directory of input_ids is refused (export it to parquet).
As with Ray Data's own readers, a local path must be visible on every node that runs tasks (a shared filesystem).

Bad input, at run time (things only reading all the data can tell):
- invalid UTF-8 in text/JSON/CSV files: `data.invalid_utf8="replace"` (default) decodes the bad bytes
  as U+FFFD; "error" makes each such line (or file) a bad record, naming the file and line. JSON's
  lone surrogate escapes ("\\ud83d" without its pair: no character) follow the same policy.
- a file that cannot be read whole (permissions, a corrupt or truncated compressed file, a damaged
  parquet file) is a bad record naming it (the driver reads the head of the first file, so most
  fail there); so is a UTF-16/32 file or a JSON file none of whose records has data.text_column
  (on a remote filesystem, where the driver reads only the first), and a null inside a
  pre-tokenized row's input_ids (naming the row).
- empty documents (null, missing key, "", an empty file or an empty id list) are skipped.
  What both policies skip or change is counted by the run's counter and reported in one line at
  the end of the run (raytrain.data.progress); read outside a run, each task logs it instead.
- malformed JSON or CSV (a row with another number of fields), a text value that is not a string, token ids beyond the embedding table: bad
  records (raytrain.data.bad_records). The first stops the run, never retried: one line naming the
  file and line or the value, how many more were found, and the key to change; exit code 2.
"""

from __future__ import annotations

import errno
import json
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

from raytrain.config import ConfigError, DataConfig
from raytrain.config_files import first_line
from raytrain.console import say
from raytrain.model import hub_retries_held, hub_unreachable, unreachable_fix
from raytrain.run_spec import DataFacts

FORMATS = ("text", "json", "csv", "parquet", "hf", "tokenized")
_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
               ".ndjson": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
# What open_text decompresses, by lower-case suffix -> pyarrow codec ("xz": python's lzma, which
# pyarrow lacks). Named, not pyarrow's "detect": that misses upper-case suffixes and .xz.
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4", ".br": "brotli", ".xz": "xz"}
# Archives hold many files in one: read as text they would be their binary headers and members.
_ARCHIVES = (".zip", ".tar", ".tgz", ".tbz2", ".txz", ".7z", ".rar") + tuple(f".tar{c}" for c in _COMPRESSED)
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
    split: str | None = None
    """The split read (data.hf_split, or data.eval_hf_split for eval_path): of a hub dataset, a
    DatasetDict or a directory of hub-named shards. None: the source has no splits."""

# ---------------------------------------------------------------------------------------------
# Driver-side checks: cheap reads (listings, parquet footers, one JSON line), no Ray.


@dataclass(frozen=True)
class Sources:
    """The training source and the held-out one, inspected once on the driver (`inspect_sources`)."""

    train: Source
    eval: Source | None
    """None: no held-out data. With data.eval_fraction this is the training source again, split by hash."""
    notes: tuple[str, ...] = ()
    """Settings and files that have no effect on this run, one line each: the caller prints them
    (`say_notes`) once every check before training has passed (a note above an error line is noise)."""

    def say_notes(self) -> None:
        for note in self.notes:
            say(f"raytrain: note: {note}", err=True)


def inspect_sources(data: DataConfig) -> Sources:
    """Check `data.path` and `data.eval_path` before any worker starts (one-line ConfigErrors), and
    say in `Sources.notes` what setting or file the sources leave unused."""
    notes: list[str] = []
    train = inspect_source(data, data.path, "data.path", notes)
    held_out = None
    if data.eval_path is not None:
        held_out = inspect_source(data, data.eval_path, "data.eval_path", notes, train=train)
        _refuse_eval_in_train(train, held_out)
    notes.extend(_idle_settings(data, train, held_out))
    if held_out is not None:
        return Sources(train, held_out, tuple(notes))
    return Sources(train, train if data.eval_fraction else None, tuple(notes))


def _idle_settings(data: DataConfig, train: Source, held_out: Source | None) -> list[str]:
    """Data settings that this run's sources make do nothing: a note each (a setting that silently
    does nothing reads as one that works). Only values that differ from the default are named."""
    defaults, notes = DataConfig(), []
    if data.hf_split != defaults.hf_split and train.split is None:
        notes.append(f"data.hf_split={data.hf_split!r} has no effect: data.path has no splits (it is not a "
                     f"DatasetDict, a hub dataset or a directory of hub-named shards such as "
                     f"{data.hf_split}-00000-of-00001.parquet)")
    if data.eval_hf_split != defaults.eval_hf_split and (held_out is None or held_out.split is None):
        why = "there is no data.eval_path" if held_out is None else "data.eval_path has no splits"
        notes.append(f"data.eval_hf_split={data.eval_hf_split!r} has no effect: {why}")
    sources = [train] + ([held_out] if held_out is not None else [])
    if data.text_column != defaults.text_column and all(s.format in ("text", "tokenized") for s in sources):
        notes.append(f"data.text_column={data.text_column!r} has no effect: "
                     + ("text files have no columns (a file or a line is a document)" if train.format == "text"
                        else "pre-tokenized data is read from its input_ids column"))
    if data.text_document != defaults.text_document and all(s.format != "text" for s in sources):
        notes.append(f"data.text_document={data.text_document!r} has no effect: it applies to text files "
                     f"(.txt, .text, .md), and the data is {train.format}")
    return notes


def _refuse_eval_in_train(train: Source, held_out: Source) -> None:
    """An eval file that is also a training file would make the eval loss a training loss. Local
    files compare by (device, inode), one stat each (a link or another spelling is the same file);
    remote ones by path; a hub dataset by its id and split."""
    if train.hub_id is not None and train.hub_id == held_out.hub_id and train.split == held_out.split:
        raise ConfigError(f"data.eval_path: the hub dataset {held_out.hub_id!r} split {held_out.split!r} is the "
                          f"training data (data.path, data.hf_split={train.split!r}): evaluate on another split "
                          f"(data.eval_hf_split, e.g. validation or test), or leave data.eval_path out and set "
                          f"data.eval_fraction")
    if not train.files or not held_out.files or train.filesystem.type_name != held_out.filesystem.type_name:
        return
    identity = _file_identity if train.filesystem.type_name == "local" else (lambda f: f)
    trained = {identity(f): f for f in train.files}
    for f in held_out.files:
        same = trained.get(identity(f))
        if same is not None:
            also = "" if same == f else f" (as {same})"
            split = (f" (the split {held_out.split!r} of both: set data.eval_hf_split to another one)"
                     if held_out.split is not None and held_out.split == train.split else "")
            raise ConfigError(f"data.eval_path: {f} is also in data.path{also}{split}: evaluate on files that are "
                              f"not trained on: take it out of data.path, or leave data.eval_path out and set "
                              f"data.eval_fraction")


def data_facts(data: DataConfig, sources: Sources) -> DataFacts:
    """What the data section resolved to: carried to the workers and printed by --dry-run."""
    source = str(data.path) if data.path is not None else f"built-in corpus ({data.num_builtin_documents} documents)"
    if sources.train.split is not None:
        source += f" (split {sources.train.split})"
    if sources.eval is None:
        return DataFacts(source=source, format=sources.train.format)
    if data.eval_path is not None:
        split = f" (split {sources.eval.split})" if sources.eval.split is not None else ""
        return DataFacts(source=source, format=sources.train.format, eval_source=f"{data.eval_path}{split}",
                         eval_format=sources.eval.format)
    return DataFacts(source=source, format=sources.train.format,
                     eval_source=f"{data.eval_fraction:g} of the documents of {source} (by content hash)",
                     eval_format=sources.train.format)


def inspect_source(data: DataConfig, path, key: str = "data.path", notes: list[str] | None = None,
                   train: Source | None = None) -> Source:
    """List and check a source before any worker starts; every problem is a one-line ConfigError.
    What it leaves unread (files of other splits or extensions, a labels column) is added to `notes`.
    `train`: data.path's source, when this is data.eval_path's (the fix for a missing column differs)."""
    if path is None:
        return Source("builtin")
    notes = [] if notes is None else notes
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise ConfigError(f"{key} is an empty list: give at least one file or directory"
                          + (" (or null for the built-in corpus)" if key == "data.path" else ""))
    split = (_split_key(key), data.eval_hf_split if key == "data.eval_path" else data.hf_split)
    fix = _column_fix(data, key, train)
    if data.format == "hf" or (data.format == "auto" and _looks_like_hf(paths[0])):
        return _inspect_hf(data, paths, key, split, fix)
    if data.format == "tokenized":
        _refuse_tokenized_save_to_disk(paths, key)
    fs, files, split_read = _list_files(paths, data.format, key, split, notes)
    fmt = data.format if data.format != "auto" else _format_of_files(files, paths, key)
    # Text and JSON files go through read_documents, which yields a "text" column.
    column = data.text_column if fmt in ("parquet", "tokenized") else "text"
    source = Source(fmt, column=column, filesystem=fs, files=[f for f, _ in files], split=split_read)
    if fmt == "text":
        readme = next((f for f, _ in files if os.path.basename(f).lower() in ("readme.md", "readme.txt")), None)
        if readme is not None and len(files) > 1:
            notes.append(f"{key}: {readme} is read as a training document, like the text files beside it: move it "
                         f"out, or list the files to read in {key}")
    if fmt in ("parquet", "tokenized"):
        return _check_parquet(source, data, key, notes, fix)
    if all(size == 0 for _, size in files):
        raise ConfigError(f"{key}: every file of {', '.join(paths)} is empty: give files with documents in them")
    nonempty = [f for f, size in files if size]
    if key == "data.path" and data.eval_fraction and fmt == "text" and data.text_document == "file" \
            and len(nonempty) * data.eval_fraction < 1 and data.eval_path is None:
        # One document: all trained on, or all held out. A few: fewer than one expected held out (by content
        # hash), often none, and the run stopped once tokenized ("eval data yields not one row") after a dry
        # run that passed. Counted from the listing: no file is read.
        held = (f"holds one text file, {nonempty[0]}, read as one document (data.text_document=file)"
                if len(nonempty) == 1 else
                f"holds {len(nonempty)} text files, read as one document each (data.text_document=file): "
                f"{len(nonempty) * data.eval_fraction:.2g} of a document is expected held out, often none")
        raise ConfigError(f"data.eval_fraction={data.eval_fraction:g} holds out whole documents, and data.path "
                          f"{held}: set data.text_document=line (each line a document), or give held-out text in "
                          f"data.eval_path")
    # Every local file's head, as every local parquet footer is read: a file whose records use
    # another key (or that is UTF-16) would otherwise train as nothing but "empty documents" (or as
    # noise). One open and one small read per file: a JSON line's first record (64 KiB unless it is
    # longer; an array's first 1 MiB), a text file's first 4 bytes; 0.04 ms a file from the page cache
    # (benchmarks/driver_check_costs.py), more from a cold disk. On a remote filesystem each read is a request, so only the first file with a
    # record is read there; the readers refuse a file none of whose records has the key, and a
    # UTF-16 file, when they reach it.
    local = fs.type_name == "local"
    if fmt == "json":
        found_record = False
        for f in nonempty:  # files of blank lines or "[]" hold no record
            if found_record and not local:
                break
            found_record = _check_json_column(source, f, data, key, fix) or found_record
    elif fmt == "csv":
        for f in nonempty if local else nonempty[:1]:
            _check_csv_header(source, f, data, key, fix)
    elif fmt == "text":
        _check_text_head(source, nonempty[0], data, key)
        for f in nonempty[1:] if local else ():
            _refuse_wide_encoding(_read_head(source, f, key, limit=4), f, key)
    return source


def _filesystem(path: str, key: str):
    import pyarrow.fs as pafs

    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    try:
        return pafs.FileSystem.from_uri(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ValueError... by scheme
        raise ConfigError(f"{key}: cannot open {path} ({first_line(e)}): check the URI, the filesystem's "
                          f"pyarrow support and the credentials") from None


def _file_info(fs, fs_path: str, path: str, key: str):
    import pyarrow.fs as pafs

    try:
        info = fs.get_file_info(fs_path)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({first_line(e)}): check the path and credentials") from None
    if info.type == pafs.FileType.NotFound:
        if any(c in path for c in "*?["):
            hint = "patterns are not expanded: give the directory, or list the files"
        elif "://" not in path and not path.startswith((".", "/", "~")) and path.count("/") == 1:
            hint = "give an existing file or directory, or for a Hugging Face hub dataset set data.format=hf"
        else:
            hint = "give an existing file or directory (local, s3://, gs://, ...)"
        raise ConfigError(f"{key}: {path} does not exist; {hint}")
    return info


# Hugging Face's shard names, {split}-NNNNN-of-NNNNN.{ext}: what push_to_hub and the hub's parquet
# conversion write, and what `datasets` reads as that split (datasets.data_files). Matched here on
# the base name rather than through datasets.data_files, whose import costs ~3.6 s on the driver.
_HUB_SHARD = re.compile(r"^(?P<split>\w+?)-\d{5}-of-\d{5}(\.|$)")
# The split names `datasets` knows by their words (datasets.splits, data_files' keywords). Files of
# one other prefix only are not a split (a Beam job's output-00000-of-00010.jsonl): read whole.
_SPLIT_WORDS = frozenset({"train", "training", "validation", "valid", "val", "dev", "test", "testing", "eval",
                          "evaluation"})


def _column_fix(data: DataConfig, key: str, train: Source | None) -> str | None:
    """The fix for data.eval_path's files without data.text_column (or with no text there) when
    data.path's files are read by that column too: there is no eval column of its own, so setting
    data.text_column would break data.path; the eval files must change. None: the usual fix (set
    data.text_column)."""
    if key != "data.eval_path" or train is None or train.format not in ("json", "csv", "parquet", "hf"):
        return None
    return (f"data.eval_path's files must use the same column as data.path's "
            f"(data.text_column={data.text_column!r}; there is no separate eval column): write the eval text "
            f"under {data.text_column!r}")


def _split_key(key: str) -> str:
    """The setting that names the split read of `key` (data.path or data.eval_path)."""
    return "data.eval_hf_split" if key == "data.eval_path" else "data.hf_split"


def _files(n: int) -> str:
    return f"{n} file{'s' if n > 1 else ''}"


def _split_of(path: str) -> str | None:
    """The split a hub-named shard belongs to (train-00000-of-00004.parquet: "train"), or None."""
    found = _HUB_SHARD.match(path.rsplit("/", 1)[-1])
    return found.group("split") if found else None


def _list_files(paths: list[str], fmt: str, key: str, split: tuple[str, str], notes: list[str]):
    """(filesystem, [(file, size)], the split read or None): named files as given, directories
    recursively by extension. In a directory of hub-named shards only `split`'s (key, name) files
    are read; files with other extensions (data.format "auto") are left out with a note."""
    import pyarrow.fs as pafs

    fs0, files, split_read = None, [], None
    for path in paths:
        fs, fs_path = _filesystem(path, key)
        if fs0 is None:
            fs0 = fs
        elif fs.type_name != fs0.type_name:
            raise ConfigError(f"{key} mixes filesystems ({fs0.type_name} and {fs.type_name}): "
                              f"read from one filesystem per path list")
        info = _file_info(fs, fs_path, path, key)
        if info.type == pafs.FileType.File:
            kind = _format_of(info.path)
            if fmt != "auto" and kind is not None and (kind == "parquet") != (fmt in ("parquet", "tokenized")):
                # as in a directory (below): a parquet file read as text trained on its bytes, with U+FFFD for
                # every invalid one; a text file read as parquet failed on the workers
                raise ConfigError(f"{key}: {path} is a {kind} file, and data.format={fmt}: set data.format=auto "
                                  f"(which reads each file by its extension), or give {key} files of that format")
            files.append((info.path, info.size))
            continue
        found, other_extensions = [], []
        try:
            listing = fs.get_file_info(pafs.FileSelector(fs_path, recursive=True))
        except OSError as e:  # a subdirectory this user cannot list (lost+found, another user's)
            raise ConfigError(f"{key}: cannot list directory {path} ({first_line(e)}): make it readable, or "
                              f"point {key} at the readable files") from None
        for f in listing:
            rel = os.path.relpath(f.path, fs_path)
            if any(p.startswith((".", "_")) for p in rel.split("/")):
                continue
            # data.format set: every file, as Ray Data's readers take a directory (a stray README.md
            # then fails loudly, naming itself); auto: the files whose extension names a format.
            kind = _format_of(f.path)
            if f.type != pafs.FileType.File:
                continue
            if "checkpoint_step_" in rel or rel.rsplit("/", 1)[-1] == _RUN_METADATA:
                _refuse_run_directory(path, fs_path, rel, key)
            if fmt != "auto" and kind is not None and (kind == "parquet") != (fmt in ("parquet", "tokenized")):
                # parquet read as text (or text as parquet) would be noise, or fail mid-run
                raise ConfigError(f"{key}: directory {path} holds {f.path}, a {kind} file, and data.format={fmt}: "
                                  f"move it out, or list the files to read in {key}")
            if _is_archive(f.path) or fmt != "auto" or kind is not None:
                found.append((f.path, f.size))
            else:
                other_extensions.append(f.path)
        if fs.type_name == "local":
            link = _dangling_link(fs_path, lambda f: fmt != "auto" or _format_of(f) is not None or _is_archive(f))
            if link is not None:
                raise ConfigError(f"{key}: {link} is a symbolic link to {os.readlink(link)}, which does not exist: "
                                  f"fetch the file (git annex get, dvc pull), or remove the link")
        if not found:
            if fmt != "auto":
                raise ConfigError(f"{key}: directory {path} has no files (names starting with '.' or '_' are "
                                  f"skipped): point it at your data")
            raise ConfigError(f"{key}: directory {path} has no {'/'.join(sorted(_EXTENSIONS))} files: point it at "
                              f"your data (or set data.format if the files have other extensions)")
        if other_extensions:
            first = sorted(other_extensions)[0]
            notes.append(f"{key}: reading {_files(len(found))} of {path}; left out "
                         f"{len(other_extensions)} with other extensions (first: {first}): set data.format to read "
                         f"every file, or rename them (.jsonl, .txt, .csv, .parquet, compressed .gz/.zst/...)")
        found, split_read = _of_split(sorted(found), path, key, split, notes, split_read)
        files.extend(found)
    archive = next((f for f, _ in files if _is_archive(f)), None)
    if archive is not None:
        raise ConfigError(f"{key}: {archive} is an archive, which raytrain does not unpack: extract it and point "
                          f"{key} at its files (single-file compression .gz/.bz2/.zst/.lz4/.br/.xz is read)")
    if fs0 is not None and fs0.type_name == "local":  # one access() per file: cheap, and root reads all
        unreadable = next((f for f, _ in files if not os.access(f, os.R_OK)), None)
        if unreadable is not None:
            raise ConfigError(f"{key}: cannot read {unreadable} (permission denied): make it readable, or "
                              f"leave it out of {key}")
        _refuse_duplicates([f for f, _ in files], key)
    return fs0, files, split_read


# A raytrain run's checkpoint directories and the record in each (raytrain.checkpoint.layout's
# names; data code sits below checkpoint code and cannot import them).
_RUN_CHECKPOINT = re.compile(r"checkpoint_step_\d+")
_RUN_METADATA = "raytrain.json"


def _refuse_run_directory(path: str, root: str, rel: str, key: str) -> None:
    """A raytrain run (or one of its checkpoints) among the data: its .pt shards, events, plots and
    summaries would be read as documents (under data.format=text, silently), or end in a "mixes
    formats" error whose advice named a directory of the run. A file at `rel` under `root` (the
    listed directory `path`) inside a checkpoint_step_* directory, or named raytrain.json."""
    parts = rel.split("/")
    at = next((i for i, p in enumerate(parts[:-1]) if _RUN_CHECKPOINT.match(p)), None)
    if at is None and parts[-1] != _RUN_METADATA:
        return
    checkpoint = "/".join([root.rstrip("/")] + parts[:at + 1 if at is not None else -1])
    raise ConfigError(f"{key}: {path} holds a raytrain checkpoint ({checkpoint}), which would be read as data: point "
                      f"{key} at a directory holding only the data (move run directories out; "
                      f"checkpoint.storage_path must be outside the data)")


def _of_split(found: list[tuple[str, int]], path: str, key: str, split: tuple[str, str], notes: list[str],
              split_read: str | None):
    """A directory's files without those of other splits than `split` (key, name), where files are
    hub-named shards (a hub snapshot's data/): (files, the split read, or `split_read` when none)."""
    split_key, name = split
    by_split: dict[str, list[str]] = {}
    for f, _ in found:
        by_split.setdefault(_split_of(f), []).append(f)
    named = {s: fs for s, fs in by_split.items() if s is not None}
    if not named or set(named) == {name}:
        return found, (name if named else split_read)
    if len(named) == 1 and not set(named) & _SPLIT_WORDS:
        return found, split_read
    if name not in named:
        listed = ", ".join(f"{s} ({_files(len(fs))})" for s, fs in sorted(named.items()))
        raise ConfigError(f"{split_key}={name!r} is not a split of {key}={path}: its files are named for the splits "
                          f"{listed}: set {split_key}")
    left_out = ", ".join(f"{s} ({_files(len(fs))})" for s, fs in sorted(named.items()) if s != name)
    notes.append(f"{key}: reading the {name!r} split of {path} ({_files(len(named[name]))}: {split_key}); left out "
                 f"the splits {left_out}")
    return [(f, size) for f, size in found if _split_of(f) in (None, name)], name


def _dangling_link(root: str, read) -> str | None:
    """The first symbolic link to nothing under local directory `root` that would be `read`, or None.
    pyarrow's listing leaves such links out without a word, and they are often data files not
    fetched yet (git-annex, DVC): the run would train on a part of the data. A second listing of
    the tree (os.scandir: no stat per file, one per link and directory), each directory once
    (a link to a directory above it is not followed round)."""
    seen, todo = set(), [root]
    while todo:
        directory = todo.pop()
        try:
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            entries = list(os.scandir(directory))
        except OSError:  # unreadable: pyarrow's listing has said so already
            continue
        for entry in entries:
            if entry.name.startswith((".", "_")):
                continue
            if entry.is_dir():  # follows links, as the listing does
                todo.append(entry.path)
            elif entry.is_symlink() and not os.path.exists(entry.path) and read(entry.path):
                return entry.path
    return None


def _file_identity(path: str) -> tuple[int, int]:
    st = os.stat(path)  # follows links: a link and its target are one file
    return st.st_dev, st.st_ino


def _refuse_duplicates(files: list[str], key: str) -> None:
    """A file listed twice would be trained on twice per epoch: named twice, named and inside a
    listed directory, reached through a symbolic link to it or to a directory (a link to its own
    directory makes the listing repeat every file ~40 levels deep), or a hard link. One stat per
    file, by (device, inode): ~3 us each, 0.3 s for 100,000 files (benchmarks/driver_check_costs.py)."""
    seen: dict[tuple[int, int], str] = {}
    for f in files:
        identity = _file_identity(f)
        first = seen.get(identity)
        if first is None:
            seen[identity] = f
            continue
        if first == f:
            raise ConfigError(f"{key}: {f} is read twice ({key} names it twice, or names it and a directory "
                              f"holding it): list each file and directory once")
        link = _link_on(f, first) or _link_on(first, f)
        if link is not None:
            raise ConfigError(f"{key}: {f} and {first} are the same file, through the symbolic link {link}: "
                              f"read each file once: remove the link, or list the files to read in {key}")
        raise ConfigError(f"{key}: {f} and {first} are the same file (hard links): read each file once: "
                          f"remove one, or list the files to read in {key}")


def _link_on(path: str, other: str) -> str | None:
    """The first symbolic link on `path` (itself or a directory above it) that `other` does not pass
    through: the one that leads to the same file twice."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if os.path.islink(prefix) and not (other == prefix or other.startswith(prefix + os.sep)):
            return prefix
    return None


def _is_archive(name: str) -> bool:
    return name.lower().endswith(_ARCHIVES)


def _format_of(name: str) -> str | None:
    base, codec = _without_codec(name)
    fmt = _EXTENSIONS.get(os.path.splitext(base)[1])
    return None if codec and fmt == "parquet" else fmt  # parquet compresses inside the file


def _without_codec(name: str) -> tuple[str, bool]:
    """The lower-case name without its compression suffix (.gz, .zst, ...), and whether it had one."""
    base = name.lower()
    suffix = next((s for s in _COMPRESSED if base.endswith(s)), "")
    return base[: len(base) - len(suffix)], bool(suffix)


def _format_of_files(files: list[tuple[str, int]], paths: list[str], key: str) -> str:
    formats = {_format_of(f) for f, _ in files}
    if None in formats:
        unknown = next(f for f, _ in files if _format_of(f) is None)
        raise ConfigError(f"{key}: cannot tell the format of {unknown}: set data.format to one of {', '.join(FORMATS)}")
    if len(formats) > 1:
        raise ConfigError(_mixed_formats(files, paths, key))
    return formats.pop()


def _mixed_formats(files: list[tuple[str, int]], paths: list[str], key: str) -> str:
    """The error for files of several formats: each format's count and first file, fewest first (the
    odd ones out: a README.md beside parquet shards), and, where one format's files all sit in a
    subdirectory without the others (a hub snapshot's data/), that subdirectory to point at."""
    import posixpath

    by_format: dict[str, list[str]] = {}
    for f, _ in files:
        by_format.setdefault(_format_of(f), []).append(f)
    counted = sorted(by_format.items(), key=lambda kv: (len(kv[1]), kv[0]))
    found = " and ".join(f"{len(fs)} {fmt} file{'s' if len(fs) > 1 else ''} ({fs[0]}{', ...' if len(fs) > 1 else ''})"
                         for fmt, fs in counted)
    roots = {_filesystem(p, key)[1].rstrip("/") for p in paths}
    # the most files first; on a tie not text (.md and .txt files beside data are usually its docs)
    for fmt, fs in sorted(counted, key=lambda kv: (len(kv[1]), kv[0] != "text"), reverse=True):
        where = posixpath.commonpath(fs) if len(fs) > 1 else posixpath.dirname(fs[0])
        others = [f for other, ofs in by_format.items() if other != fmt for f in ofs]
        if where not in roots and not any(f.startswith(where + "/") for f in others) \
                and any(where.startswith(root + "/") for root in roots):
            splits = sorted({s for s in map(_split_of, fs) if s is not None})
            read = f" (of its hub-named shards, those of the split {splits[0]!r}: {_split_key(key)})" if splits else ""
            return (f"{key}: {', '.join(paths)} mixes formats: {found}: point {key} at {where}, which holds the "
                    f"{fmt} files only{read}")
    return (f"{key}: {', '.join(paths)} mixes formats: {found}: give one format per path list (move the "
            f"other files out, or list the files to read in {key})")


def _column_kind(t) -> str:
    """An Arrow type as the readers see it: read_parquet_rows yields Python strings and int64 id
    arrays whatever the width, so string/large_string/string_view (and a dictionary of them) are
    one kind, and so is every list type of integers."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t):
        return "string"
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or getattr(pa.types, "is_list_view", bool)(t)) and pa.types.is_integer(t.value_type):
        return "list of integers"
    return str(t)


def _check_parquet(source: Source, data: DataConfig, key: str, notes: list[str], fix: str | None) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def open_file(path):
        try:
            return pq.ParquetFile(source.filesystem.open_input_file(path))
        except (OSError, pa.ArrowInvalid) as e:
            raise ConfigError(f"{key}: {path} is not a readable parquet file ({first_line(e)})") from None

    first = open_file(source.files[0])
    schema = first.schema_arrow
    # input_ids and no text column: pre-tokenized, unless the user named a text column (the
    # default's name is "text"): then a missing column is their mistake, reported below.
    if source.format == "parquet" and data.format == "auto" and data.text_column not in schema.names \
            and "input_ids" in schema.names and data.text_column == "text":
        source.format = "tokenized"
    if source.format == "tokenized":
        source.column = "input_ids"

    def check(path, schema):
        if source.format == "tokenized":
            field_ = schema.field("input_ids") if "input_ids" in schema.names else None
            if field_ is not None and pa.types.is_null(field_.type):  # no row, or every row null: untyped
                return
            if field_ is None or not (pa.types.is_list(field_.type) or pa.types.is_large_list(field_.type)
                                      or pa.types.is_fixed_size_list(field_.type)) \
                    or not pa.types.is_integer(field_.type.value_type):
                found = f"its input_ids is {field_.type}" if field_ else f"columns: {', '.join(schema.names)}"
                raise ConfigError(f"data.format=tokenized needs an input_ids column of integer lists in "
                                  f"{path} ({found}): write token ids there, or set data.format=parquet")
            return
        if data.text_column not in schema.names:
            raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {path} "
                              f"(columns: {', '.join(schema.names)}): {fix or 'set data.text_column'}")
        t = schema.field(data.text_column).type
        if pa.types.is_null(t):  # no row, or every row null (written untyped): no document, or empty ones
            return
        if pa.types.is_dictionary(t):  # a categorical column: Ray Data reads it as its strings
            t = t.value_type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)):
            raise ConfigError(f"data.text_column={data.text_column!r} in {path} holds {t}, not strings: "
                              f"{fix or 'set data.text_column to the text column'}")

    check(source.files[0], schema)
    if source.format == "tokenized" and "labels" in schema.names:
        notes.append(f"{key}: the labels column of {source.files[0]} is not read: raytrain trains on every token "
                     f"of input_ids (its labels are input_ids), so tokens masked there with -100 (an SFT prompt) "
                     f"are trained on too; raytrain has no label masking")
    column_type, typed_by = schema.field(source.column).type, source.files[0]
    rows = first.metadata.num_rows
    # Every file's footer on a local filesystem (one small read each); on a remote one only until
    # the first with rows: a footer there is a request, and thousands of them would hold the start
    # for minutes (a later file with another schema then fails when Ray Data reads it).
    local = source.filesystem.type_name == "local"
    for path in source.files[1:]:
        if rows and not local:
            break
        meta = open_file(path)
        check(path, meta.schema_arrow)
        this_type = meta.schema_arrow.field(source.column).type
        if pa.types.is_null(column_type):  # Ray Data merges an all-null column with any other type
            column_type, typed_by = this_type, path
        elif not pa.types.is_null(this_type) and _column_kind(this_type) != _column_kind(column_type):
            raise ConfigError(f"{key}: {path} holds {source.column} as {this_type}, {typed_by} as {column_type}: "
                              f"write every file with one type")
        rows = rows or meta.metadata.num_rows
    if not rows:
        raise ConfigError(f"{key}: the parquet files have no rows ({len(source.files)} files, first "
                          f"{source.files[0]}): give a non-empty dataset")
    return source


def compression_of(path: str) -> str | None:
    """The codec open_text decompresses `path` with (by its suffix, any case), or None."""
    return next((codec for suffix, codec in _COMPRESSED.items() if path.lower().endswith(suffix)), None)


def open_text(filesystem, path: str):
    """A text/JSON file's stream, decompressed by its suffix (compression_of). Reading a corrupt or
    truncated file raises one of READ_ERRORS."""
    codec = compression_of(path)
    if codec != "xz":
        return filesystem.open_input_stream(path, compression=codec)
    return _XzStream(filesystem.open_input_stream(path, compression=None))


READ_ERRORS = (OSError, EOFError)
"""What opening or reading a file through open_text raises when it is unreadable, corrupt or
truncated: pyarrow's OSError (PermissionError, "zlib inflate failed", "Truncated compressed
stream"), lzma's EOFError (truncated .xz); _XzStream turns LZMAError into OSError."""


_NETWORK_ERRNOS = frozenset((errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                             errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET))


def transient(e: BaseException) -> bool:
    """A read error that may pass on its own, so that the file is read again rather than reported as damaged
    (raytrain.data.readers): a connection's (ConnectionError, TimeoutError, a network errno: fsspec's
    filesystems), or one that Ray Data retries in its own reads, by message (`DataContext.retried_io_errors`:
    S3's throttling and network errors by default; a user adds their storage's there, as for ray.data.read_*).
    pyarrow raises OSError for a damaged file and a dropped connection alike, so the type alone cannot tell."""
    if isinstance(e, (ConnectionError, TimeoutError)) or getattr(e, "errno", None) in _NETWORK_ERRNOS:
        return True
    from ray.data import DataContext

    text = "".join(traceback.format_exception_only(type(e), e)).rstrip("\n")  # as Ray's format_exception
    for pattern in DataContext.get_current().retried_io_errors:  # as Ray's: a substring, else a regex
        try:
            if pattern in text or re.search(pattern, text):
                return True
        except re.error:
            continue
    return False


class _XzStream:
    """python's lzma over a pyarrow stream; closes both (LZMAFile leaves a stream it was given open)."""

    def __init__(self, raw):
        import lzma

        self._raw, self._xz = raw, lzma.LZMAFile(raw)

    def read(self, nbytes: int = -1) -> bytes:
        import lzma

        try:
            return self._xz.read(nbytes)
        except lzma.LZMAError as e:  # a plain Exception: made the OSError of any other codec
            raise OSError(f"xz: {e}") from None

    @property
    def closed(self) -> bool:  # pyarrow.PythonFile (the CSV reader's stream) asks
        return self._xz.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self._xz.close()
        self._raw.close()


def _check_json_column(source: Source, path: str, data: DataConfig, key: str, fix: str | None) -> bool:
    """The first record of `path`: valid JSON (a line, or an array's first element), an object with
    `data.text_column`, holding a string (or null), its bytes UTF-8 under data.invalid_utf8=error.
    One read of up to 1 MiB; the readers check every later record. False: the file holds no record."""
    column = data.text_column
    head = _read_head(source, path, key, enough=_has_first_line)
    _refuse_wide_encoding(head, path, key)
    unmarked = head.removeprefix(BOM)
    body = unmarked.lstrip()
    if not body:
        return False  # blank lines only: no record to check here
    if body.startswith(b"["):  # one JSON array of records
        # the readers' error for an array names the byte's offset in the file (a byte order mark counted)
        text = _utf8(body[1:], data, path, offset=len(head) - len(body) + 1, cut=len(head) == 1 << 20)
        where = f"{path} (its first record)"
        if text.lstrip().startswith("]"):
            return False  # an empty array
        try:
            record, _ = json.JSONDecoder().raw_decode(text.lstrip())
        except json.JSONDecodeError as e:
            if len(head) == 1 << 20:
                return True  # a first record over 1 MiB: the reader checks it
            raise ConfigError(f"{key}: {path} is not a valid JSON array ({e.msg} in its first record): "
                              f"give JSON lines or an array of objects") from None
    else:
        # the first record's line from the line's start, not from its first non-blank byte: the readers
        # count an error's byte within the line
        start = len(unmarked) - len(body)
        line, newline, rest = unmarked[unmarked.rfind(b"\n", 0, start) + 1:].partition(b"\n")
        if not newline and len(head) == 1 << 20:
            return True  # a huge first line: the reader checks each record
        lineno = unmarked[:start].count(b"\n") + 1
        where = f"{path} line {lineno}"
        text = _utf8(line, data, path, first_line=lineno)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if rest.strip() and e.pos >= len(text.rstrip()):
                # The line is valid as far as it goes and more lines follow: JSON written over several lines
                # (json.dump with indent, a `{` line first), whatever the file's size (only its head is read).
                raise ConfigError(f"{key}: {path} holds JSON written over several lines (pretty-printed), which is "
                                  f"neither JSON lines nor one array of records: write one object per line (jq -c . "
                                  f"FILE; json.dumps without indent), or one array of objects") from None
            raise ConfigError(f"{key}: {where} is not valid JSON ({e.msg}): "
                              f"give JSON lines (one object per line)") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{key}: {where} is a {type(record).__name__}, not a JSON object: "
                          f"give JSON lines (one object per line)")
    if column not in record:
        raise ConfigError(f"data.text_column={column!r} is not a key of the records in {path} "
                          f"(keys: {', '.join(record)}): {fix or 'set data.text_column'}")
    if record[column] is not None and not isinstance(record[column], str):
        raise ConfigError(f"data.text_column={column!r} holds {type(record[column]).__name__} values in {where}, "
                          f"not text: {fix or 'set data.text_column to the text key'}")
    return True


def csv_delimiter(path: str) -> str:
    """A tab for a .tsv file (compressed or not), else a comma."""
    return "\t" if _without_codec(path)[0].endswith(".tsv") else ","


def _check_csv_header(source: Source, path: str, data: DataConfig, key: str, fix: str | None) -> None:
    """The header of a CSV file names data.text_column: its first record, parsed by Python's csv
    module from the file's first 64 KiB (more, up to 1 MiB, until a line ends). Any line ending
    (\\r alone too, as Excel for Mac writes), a quoted newline in a name, blank lines before it: as
    pyarrow's reader takes them. A header over 1 MiB is left to the reader."""
    import csv
    import io

    head = _read_head(source, path, key, enough=lambda h: b"\n" in h or b"\r" in h)
    _refuse_wide_encoding(head, path, key)
    if len(head) == 1 << 20 and b"\n" not in head and b"\r" not in head:
        return
    text = head.removeprefix(BOM).decode("utf-8", errors="replace")
    try:
        columns = next((r for r in csv.reader(io.StringIO(text, newline=""), delimiter=csv_delimiter(path)) if r), [])
    except csv.Error as e:
        raise ConfigError(f"{key}: the header of {path} is not valid CSV ({e}): fix it") from None
    if data.text_column not in columns:
        tsv = " (tab-separated: the file's name ends in .tsv)" if csv_delimiter(path) == "\t" else ""
        names = ", ".join(map(repr, columns[:20])) + (f" and {len(columns) - 20} more" if len(columns) > 20 else "")
        if not tsv and len(columns) == 1 and "\t" in columns[0]:
            # A tab-separated file named .csv: read with commas, its header is one column holding the tabs, and
            # data.text_column (the fix the line below names) could never match it
            raise ConfigError(f"{key}: {path} looks tab-separated (its header {names} has tabs and no commas), but "
                              f"only a file whose name ends in .tsv (compressed or not) is read with tabs: rename it "
                              f"to end in .tsv")
        raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {path}{tsv} (its header: "
                          f"{names or 'empty'}): {fix or 'set data.text_column'}")


def _check_text_head(source: Source, path: str, data: DataConfig, key: str) -> None:
    """The file is not UTF-16/32 (its first bytes); under data.invalid_utf8=error, its first MiB must
    be UTF-8 (the readers check the rest); under "replace" any other bytes are read, and only a
    compressed file is read further (a mislabelled or corrupt one fails here, not in a task)."""
    if data.invalid_utf8 != "error" and compression_of(path) is None:
        _refuse_wide_encoding(_read_head(source, path, key, limit=4), path, key)
        return
    head = _read_head(source, path, key)
    _refuse_wide_encoding(head, path, key)
    text, cut = head.removeprefix(BOM), len(head) == 1 << 20
    if data.text_document == "file":
        _utf8(text, data, path, offset=len(head) - len(text), cut=cut)
    else:
        _utf8(text, data, path, first_line=1, cut=cut)


_HEAD_CHUNK = 1 << 16


def _read_head(source: Source, path: str, key: str, limit: int = 1 << 20, enough=None) -> bytes:
    """Up to `limit` bytes of `path`, decompressed, read in 64 KiB chunks until `enough(head)` is
    true (None: to the limit); a file that cannot be read is a one-line ConfigError."""
    head = b""
    try:
        with open_text(source.filesystem, path) as f:
            while len(head) < limit:
                chunk = f.read(min(_HEAD_CHUNK, limit - len(head)))
                head += chunk
                if not chunk or (enough is not None and enough(head)):
                    break
    except READ_ERRORS as e:
        raise ConfigError(f"{key}: cannot read {path} ({first_line(e)}): {unreadable_fix(path)}") from None
    return head


def _has_first_line(head: bytes) -> bool:
    """Whether a JSON-lines head holds its first record whole (an array's first record: never, read
    to the limit)."""
    body = head.removeprefix(BOM).lstrip()
    return bool(body) and not body.startswith(b"[") and b"\n" in body


# UTF-16 and UTF-32 byte order marks, the longer first (UTF-32 LE starts with UTF-16 LE's). Such a
# file decodes "as UTF-8 with replacement" into a NUL between every character: noise, not text.
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 LE"), (b"\x00\x00\xfe\xff", "UTF-32 BE"),
              (b"\xff\xfe", "UTF-16 LE"), (b"\xfe\xff", "UTF-16 BE"))


def wide_encoding(head: bytes) -> str | None:
    """The UTF-16/32 encoding whose byte order mark starts `head` (a file's first bytes), or None."""
    return next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None)


def wide_encoding_fix(encoding: str) -> str:
    """The fix for a UTF-16/32 file: what the one-line error (here, or a reader's) advises."""
    return f"re-encode it as UTF-8 (iconv -f {encoding.split()[0]} -t UTF-8)"


def _refuse_wide_encoding(head: bytes, path: str, key: str) -> None:
    encoding = wide_encoding(head)
    if encoding is not None:
        raise ConfigError(f"{key}: {path} is {encoding} text (it starts with a {encoding} byte order mark), "
                          f"not UTF-8: {wide_encoding_fix(encoding)}")


def unreadable_fix(path: str) -> str:
    """The fix for a file open_text cannot read (READ_ERRORS): what the one-line error advises."""
    codec = compression_of(path)
    if codec is not None:
        return (f"its name says {codec}-compressed: re-compress it whole (or fix its name), "
                f"or leave it out of the data")
    return "check that it is readable, or leave it out of the data"


INVALID_UTF8_FIX = ("fix the file, or set data.invalid_utf8=replace to decode such bytes as U+FFFD "
                    "(counted and reported)")


def _utf8(raw: bytes, data: DataConfig, path: str, *, offset: int = 0, first_line: int | None = None,
          cut: bool = False) -> str:
    """`raw` decoded; invalid UTF-8 under data.invalid_utf8=error is the readers' one-line error, found here
    first, naming the byte as they do: for a record a line (`first_line`: raw's first line's number, raw
    starting at a line's start) its line and its byte within the line; for a whole file or a JSON array the
    byte's offset in the file (`offset`: raw's, a byte order mark counted; a compressed file's counts its
    decompressed text). `cut`: raw ends mid-file, so a character split at its end is not an error."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("strict" if data.invalid_utf8 == "error" else "replace")
    try:
        return decoder.decode(raw, final=not cut)
    except UnicodeDecodeError as e:
        if first_line is None:
            of = " of the decompressed text" if compression_of(path) is not None else ""
            where, byte = path, f"{offset + e.start}{of}"
        else:
            line = first_line + raw.count(b"\n", 0, e.start)
            where = f"{path} line {line}"
            byte = e.start - raw.rfind(b"\n", 0, e.start) - 1
        raise ConfigError(f"{where}: invalid UTF-8 at byte {byte}: {INVALID_UTF8_FIX}") from None


def _looks_like_hf(path: str) -> bool:
    if "://" in path:
        return False  # listing a remote directory to sniff it costs requests; say data.format=hf
    path = os.path.expanduser(path)
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in _HF_MARKERS)


def _refuse_tokenized_save_to_disk(paths: list[str], key: str) -> None:
    """data.format=tokenized on a save_to_disk directory: its listing would fail on state.json, whose
    fix (move it out) breaks the dataset. Pre-tokenized data is read from parquet."""
    for path in paths:
        if "://" not in path and _looks_like_hf(path):
            raise ConfigError(_TOKENIZED_SAVE_TO_DISK.format(key=key, path=path))


_TOKENIZED_SAVE_TO_DISK = ("{key}: {path} is a datasets save_to_disk directory of token ids (input_ids), which raytrain "
                           "does not read: pre-tokenized data is read from parquet: export it with "
                           "datasets.load_from_disk('{path}').to_parquet('ids.parquet') and set {key} to that file")


def _inspect_hf(data: DataConfig, paths: list[str], key: str, split: tuple[str, str], fix: str | None) -> Source:
    """A save_to_disk directory (its .arrow files, read directly on the cluster) or a hub id.
    `split`: (the key, the split) read from a DatasetDict or a hub dataset."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    if len(paths) != 1:
        raise ConfigError(f"{key}: data.format=hf reads one dataset; give one directory or hub id")
    path = paths[0]
    if "://" not in path and not os.path.exists(os.path.expanduser(path)):
        if path.startswith((".", "/", "~")) or path.count("/") > 1:
            raise ConfigError(f"{key}: {path} does not exist; give a save_to_disk directory or a hub id (org/name)")
        return _inspect_hub(data, path, key, split, fix)
    fs, root = _filesystem(path, key)
    if _file_info(fs, root, path, key).type != pafs.FileType.Directory:
        raise ConfigError(f"{key}: {path} is a file; data.format=hf needs a save_to_disk directory")

    def read_json_file(p):
        try:
            with fs.open_input_stream(p) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable, or not JSON (UnicodeDecodeError is a ValueError)
            raise ConfigError(f"{key}: cannot read {p} ({first_line(e)}): give a directory written by "
                              f"datasets' save_to_disk, unchanged") from None

    split_key, split_name = split
    splits, split_read = read_json_file(f"{root}/dataset_dict.json"), None
    if splits is not None:  # a DatasetDict: one subdirectory per split
        if split_name not in splits.get("splits", []):
            raise ConfigError(f"{split_key}={split_name!r} is not a split of {path} "
                              f"(splits: {', '.join(splits.get('splits', []))}): set {split_key}")
        root, split_read = f"{root}/{split_name}", split_name
    state = read_json_file(f"{root}/state.json")
    if state is None:
        raise ConfigError(f"{key}: {path} has no state.json: give a directory written by datasets' save_to_disk")
    try:
        files = [f"{root}/{f['filename']}" for f in state.get("_data_files", [])]
    except (AttributeError, KeyError, TypeError):
        raise ConfigError(f"{key}: {root}/state.json has no list of _data_files with a filename each: give a "
                          f"directory written by datasets' save_to_disk, unchanged") from None
    # One listing call for all shards: a missing one would otherwise fail in a task, mid-run.
    missing = [i.path for i in fs.get_file_info(files) if i.type != pafs.FileType.File]
    if missing:
        raise ConfigError(f"{key}: {missing[0]}, a data file its state.json lists, is missing ({len(missing)} of "
                          f"{len(files)}): copy the whole save_to_disk directory")
    rows, names, text_type = 0, None, None
    for f in files:  # stream headers only; stops at the first file with a row
        try:
            with fs.open_input_file(f) as stream:
                reader = pa.ipc.open_stream(stream)
                names = names or reader.schema.names
                if text_type is None and data.text_column in reader.schema.names:
                    text_type = reader.schema.field(data.text_column).type
                for batch in reader:
                    rows += batch.num_rows
                    if rows:
                        break
        except (OSError, pa.ArrowInvalid) as e:
            raise ConfigError(f"{key}: {f} is not a readable Arrow stream ({first_line(e)}): copy the "
                              f"save_to_disk directory again") from None
        if rows:
            break
    if names is not None and data.text_column not in names and "input_ids" in names \
            and data.text_column == DataConfig().text_column:
        raise ConfigError(_TOKENIZED_SAVE_TO_DISK.format(key=key, path=path))
    if names is not None and data.text_column not in names:
        raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {path} "
                          f"(columns: {', '.join(names)}): {fix or 'set data.text_column'}")
    if text_type is not None and not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise ConfigError(f"data.text_column={data.text_column!r} in {path} holds {text_type}, not strings: "
                          f"{fix or 'set data.text_column to the text column'}")
    if not rows:
        raise ConfigError(f"{key}: the dataset at {path} has no rows: give a non-empty dataset")
    return Source("hf", column="text", filesystem=fs, files=files, split=split_read)


def _inspect_hub(data: DataConfig, hub_id: str, key: str, split: tuple[str, str], fix: str | None) -> Source:
    import datasets

    split_key, split_name = split
    unreachable = hub_unreachable(hub_id, repo_type="dataset")  # else ~25 s of retries before the error
    if unreachable:
        raise ConfigError(f"{key}={hub_id!r}: cannot open the hub dataset: "
                          f"{unreachable_fix(hub_id, unreachable, key, repo_type='dataset')}")
    try:
        with hub_retries_held():  # its lines for each retried request: the error below says what failed
            hub = datasets.load_dataset(hub_id, split=split_name, streaming=True)
    except Exception as e:  # datasets raises many types (network, missing split, missing repo)
        raise ConfigError(f"{key}: cannot open the hub dataset {hub_id!r} split {split_name!r} "
                          f"({first_line(e)}): check the id, {split_key} and your network/token") from None
    if hub.column_names is not None and data.text_column not in hub.column_names:
        raise ConfigError(f"data.text_column={data.text_column!r} is not a column of {hub_id} "
                          f"(columns: {', '.join(hub.column_names)}): {fix or 'set data.text_column'}")
    return Source("hf", column=data.text_column, hub_id=hub_id, split=split_name)
