"""Ray Data tasks that turn input files into documents (rows of {"text": ...}).

Start at `read_documents`: one file in, its documents out, streamed (a line-per-document file
never sits in memory whole). What a document is, by format, and the bad-input policy (invalid
UTF-8, empty documents, malformed JSON) are described in raytrain.data.sources' docstring.
"""

from __future__ import annotations

import collections
import json
import logging
from typing import Any, Iterator

from raytrain.config import ConfigError
from raytrain.data.progress import FileReads
from raytrain.data.sources import BOM, open_text

logger = logging.getLogger("raytrain.data")

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
            text = _decode(f.read().removeprefix(BOM), invalid_utf8, path, counts)
            if text:
                yield {"text": text}
            else:
                counts["empty"] += 1
        elif format == "text":
            for lineno, raw in _lines(f, f.read(1 << 20).removeprefix(BOM)):
                raw = raw.rstrip(b"\r")
                if raw.strip():  # a blank line separates documents, it is not one
                    yield {"text": _decode(raw, invalid_utf8, f"{path} line {lineno}", counts)}
        else:
            head = f.read(1 << 20).removeprefix(BOM)
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

