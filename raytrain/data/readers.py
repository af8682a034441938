"""Ray Data tasks that turn input files into documents (rows of {"text": ...}).

Start at `read_documents`: one file in, its documents out, streamed: no text or JSON file sits in
memory whole (a file that is one document comes out in pieces, a JSON array a record at a time);
`read_parquet_rows` does the same for a parquet file's rows. What a
document is, by format, and the bad-input policy (invalid UTF-8, empty documents, malformed JSON)
are described in raytrain.data.sources' docstring; what a task does with a bad record, in
raytrain.data.bad_records'.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import re
import time
from typing import Any, Callable, Iterator

from raytrain.config_files import first_line
from raytrain.data import pieces
from raytrain.data.bad_records import BadRecord, BadRecords
from raytrain.data.progress import FileReads, report, skipped
from raytrain.data.sources import (BOM, INVALID_UTF8_FIX, READ_ERRORS, compression_of, csv_delimiter, open_text,
                                   transient, unreadable_fix, wide_encoding, wide_encoding_fix)

logger = logging.getLogger("raytrain.data")


def read_documents(row: dict[str, Any], *, format: str, filesystem, text_column: str, text_document: str,
                   invalid_utf8: str, progress: str | None = None,
                   counter: str | None = None) -> Iterator[dict[str, Any]]:
    """One file -> rows of {"text": document}, streamed; a text file that is one document, longer
    than a piece, -> a row per piece (`_file_document`).

    `progress`: the run's counter actor (training data only), told how many bytes of the file were
    read and how many documents they held. `counter`: the run's counter actor, told what the data
    policies skipped and the bad records (None: skips are logged, a bad record raises)."""
    reads = FileReads(progress)
    bad = BadRecords(counter)
    counts: collections.Counter = collections.Counter()

    def documents() -> Iterator[dict[str, Any]]:  # the file from its start: each attempt replays the last's
        counts.clear()
        if format == "hf":
            return _read_arrow_file(row["path"], filesystem, text_column, reads, bad, counts)
        if format == "csv":
            return _read_csv_file(row["path"], filesystem, text_column, invalid_utf8, reads, bad, counts)
        return _read_text_file(row["path"], format, filesystem, text_column, text_document, invalid_utf8,
                               reads, bad, counts)

    yield from reads.count(_with_retries(documents, bad))
    bad.close()
    _report_file(row["path"], counts, counter)


READ_ATTEMPTS = 10
"""Reads of a file whose error may pass (sources.transient) before it is a bad record, with Ray Data's
backoff for its own reads (iterate_with_retry: up to 2**n s, at most 32, times a random factor): ~1.5 min
of waiting on average, which a storage's blip or throttling outlasts. A file that fails so every time
(an outage, a revoked credential) stops the run in one line as a damaged one does, that much later."""
_MAX_BACKOFF_S = 32


class _Transient(Exception):
    """A reader's error that may pass: raised past its bad-record handling with the record it would have
    reported, so that `_with_retries` reads the file again."""

    def __init__(self, record: BadRecord):
        super().__init__(str(record))
        self.record = record


def _unreadable(bad: BadRecords, record: BadRecord, e: BaseException) -> None:
    """`record` (a file that cannot be read, for `e`) is a bad record, unless `e` may pass: then the file is
    read again (`_Transient`). Not after a bad record of this file: the run is stopping anyway."""
    if transient(e) and not bad.found_any:
        raise _Transient(record) from e
    bad.found(record)


def _with_retries(attempt: Callable[[], Iterator[Any]], bad: BadRecords) -> Iterator[Any]:
    """`attempt()`'s items (one file's rows, the same from its start at every call), read again after an
    error that may pass, its items already yielded skipped (Ray Data's iterate_with_retry, which is private),
    up to READ_ATTEMPTS times; then the record that error makes is a bad record saying so. The replayed
    prefix is read and parsed again (its bytes are not reported twice: FileReads counts positions)."""
    yielded = 0
    for n in range(1, READ_ATTEMPTS + 1):
        try:
            for i, item in enumerate(attempt()):
                if i >= yielded:
                    yielded += 1
                    yield item
            return
        except _Transient as e:
            if n == READ_ATTEMPTS:
                record = e.record
                bad.found(BadRecord(record.where, f"{record.what}, {READ_ATTEMPTS} times",
                                    "check the storage (its connection, credentials and limits), then run again"))
                return
            backoff = min(2 ** n, _MAX_BACKOFF_S) * random.random()
            logger.warning("raytrain data: %s: %s; reading it again in %.1f s (attempt %d of %d)", e.record.where,
                           e.record.what, backoff, n + 1, READ_ATTEMPTS)
            time.sleep(backoff)


def _read_text_file(path: str, format: str, filesystem, text_column: str, text_document: str, invalid_utf8: str,
                    reads: FileReads, bad: BadRecords, counts: collections.Counter) -> Iterator[dict[str, str]]:
    """A text or JSON file (format "text" or "json"), read as `read_documents` says. After a bad
    record the rest of the file is only checked (its bad records counted), not yielded."""
    # Decompressed bytes are not the file's bytes: a compressed file counts whole when it ends.
    compressed = compression_of(path) is not None
    try:
        with open_text(filesystem, path) as stream:  # decompresses .gz/.zst/.br/.xz/... by suffix
            f = stream if compressed else reads.counting(stream)
            head = f.read(1 << 20)
            encoding = wide_encoding(head)
            if encoding is not None:  # the driver checks local files; a remote one is found here
                bad.found(BadRecord(path, f"is {encoding} text (it starts with a {encoding} byte order mark), "
                                          f"not UTF-8", wide_encoding_fix(encoding)))
            elif format == "text" and text_document == "file":
                yield from _file_document(f, head, path, invalid_utf8, bad, counts)
            elif format == "text":
                for lineno, raw in _lines(f, head.removeprefix(BOM)):
                    raw = raw.rstrip(b"\r")
                    if raw.strip():  # a blank line separates documents, it is not one
                        text = _checked(bad, _decode, raw, invalid_utf8, f"{path} line {lineno}", counts)
                        if text is not None and not bad.found_any:
                            yield {"text": text}
            else:
                records, keyed, other_keys = 0, 0, None
                for where, record in _json_records(f, head, path, invalid_utf8, bad, counts):
                    records += 1
                    if isinstance(record, dict) and text_column in record:
                        keyed += 1
                    elif other_keys is None and isinstance(record, dict):
                        other_keys = list(record)
                    text = _checked(bad, _document_of, record, where, text_column, counts)
                    if text is not None:
                        text = _checked(bad, _without_surrogates, text, invalid_utf8, where, counts)
                    if text is not None and not bad.found_any:
                        yield {"text": text}
                if records and not keyed and other_keys is not None:
                    # A missing key is an empty document, but a file with the key in no record uses
                    # another one: the driver checks each local file's first record, this a remote one.
                    bad.found(BadRecord(path, f"none of its {records:,} records has the key data.text_column="
                                              f"{text_column!r} (the first has {', '.join(other_keys) or 'none'})",
                                        "set data.text_column, or leave the file out of the data"))
    except READ_ERRORS as e:
        # Unreadable, corrupt or truncated (often only at its end, past what the driver checked):
        # the same file every retry, so a bad record of the file, not a task failure.
        _unreadable(bad, BadRecord(path, f"cannot be read ({first_line(e)})", unreadable_fix(path)), e)
    reads.close((lambda: filesystem.get_file_info(path).size) if compressed else None)


_CSV_BLOCK = 1 << 26
"""pyarrow's CSV block (64 MiB, its memory per task): a value of over two blocks cannot be read (at
4 MiB, a document of 8 MiB stopped the run)."""


def _read_csv_file(path: str, filesystem, text_column: str, invalid_utf8: str, reads: FileReads, bad: BadRecords,
                   counts: collections.Counter) -> Iterator[dict[str, str]]:
    """A CSV file (tab-separated for .tsv), a block at a time by pyarrow's reader, only the text
    column, as bytes: decoded here under data.invalid_utf8 (pyarrow's own decoding only refuses).
    Quoted values may hold newlines (newlines_in_values: pyarrow then parses a block serially).
    A bad record is named by the line of the file it starts on, as an editor numbers lines (from 1,
    the header and blank lines counted), as JSON lines are: `_csv_line` finds it."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    row = 0  # data records read (pyarrow's: the header and blank lines are none)
    try:
        with open_text(filesystem, path) as stream:  # decompresses by suffix, as for text and JSON
            if not isinstance(stream, pa.NativeFile):  # .xz: python's lzma
                stream = pa.PythonFile(stream, mode="r")
            batches = pacsv.open_csv(
                stream, read_options=pacsv.ReadOptions(block_size=_CSV_BLOCK),
                parse_options=pacsv.ParseOptions(delimiter=csv_delimiter(path), newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(include_columns=[text_column],
                                                     column_types={text_column: pa.binary()}))
            for batch in batches:
                for raw in batch.column(0).to_pylist():
                    row += 1
                    if not raw:  # an empty value
                        counts["empty"] += 1
                        continue
                    try:
                        text = _decode(raw, invalid_utf8, path, counts)
                    except BadRecord as record:
                        # only the first is named (the file read again up to it); the others are counted
                        line = None if bad.found_any else _csv_line(filesystem, path, lambda n, _: n == row)
                        bad.found(BadRecord(_at_line(path, line), f"{record.what} of its {text_column!r} value",
                                            record.fix))
                        continue
                    if not bad.found_any:
                        yield {"text": text}
    except KeyError:  # pyarrow's "Column 'text' in include_columns does not exist": the driver reads local headers
        bad.found(BadRecord(path, f"has no column data.text_column={text_column!r} in its header",
                            "set data.text_column, or leave the file out of the data"))
    except pa.ArrowInvalid as e:  # "CSV parse error: Expected 2 columns, got 3: ..."
        if str(e).startswith("Empty CSV file"):  # as an empty text or JSON file: nothing to read
            counts["empty"] += 1
        elif "straddl" in str(e):  # a record over a block (two boundaries): valid CSV that pyarrow cannot read
            line = _csv_line(filesystem, path, lambda n, fields: n > row and sum(map(len, fields)) > _CSV_BLOCK)
            bad.found(BadRecord(_at_line(path, line), f"holds a value of over {_CSV_BLOCK / 2**20:g} MiB, more than "
                                                      f"the CSV reader takes",
                                "split that document, or give JSON lines or parquet"))
        else:
            # pyarrow quotes the record and may number it ("Row #4: "), counting records with the header, so not
            # blank lines or the lines inside quoted values: replaced by the file's line where that is found
            line = _csv_line(filesystem, path, _other_width())
            what = first_line(e) if line is None else re.sub(r"^(CSV parse error: )Row #\d+: ", r"\1", first_line(e))
            bad.found(BadRecord(_at_line(path, line), f"not valid CSV ({what})", "fix or remove it"))
    except READ_ERRORS as e:
        _unreadable(bad, BadRecord(path, f"cannot be read ({first_line(e)})", unreadable_fix(path)), e)
    reads.close(lambda: filesystem.get_file_info(path).size)


def _other_width():
    """A `_csv_line` match: the first data record with another number of fields than the header (pyarrow's
    "Expected 2 columns, got 3")."""
    width = []

    def match(number: int, fields: list[str]) -> bool:
        if number == 0:
            width.append(len(fields))
        return len(fields) != width[0]

    return match


def _at_line(path: str, line: int | None) -> str:
    return path if line is None else f"{path} line {line}"


def _csv_line(filesystem, path: str, match) -> int | None:
    """The line of `path` (from 1, as an editor numbers them: the header, blank lines and the lines
    inside quoted values counted) that the first record for which `match(number, fields)` is true
    starts on; `number` is 0 for the header, then 1, 2, ... for the data records as pyarrow's reader
    reads them (a blank line is none). None: no such record, or the file cannot be read again.
    pyarrow's reader counts no lines, so the file is read again up to that record by Python's csv
    module: only to name a bad record (0.6 s for 100 MiB of generated documents on a 2-core VM: ~6 s a
    GB up to it, once per bad file, while the run is stopping anyway).
    Its bytes are read as Latin-1, a character each: delimiters, quotes and line ends are ASCII,
    which no byte of a UTF-8 character is, so records split as in UTF-8 whatever bad bytes it holds."""
    import csv
    import io
    import sys

    class Raw(io.RawIOBase):  # open_text's streams have read() alone; TextIOWrapper wants readinto
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            data = stream.read(len(buffer))
            buffer[:len(data)] = data
            return len(data)

    limit = csv.field_size_limit(sys.maxsize)  # a document is longer than csv's default of 128k characters
    try:
        with open_text(filesystem, path) as stream:
            text = io.TextIOWrapper(io.BufferedReader(Raw(), 1 << 20), encoding="latin-1", newline="")
            reader = csv.reader(text, delimiter=csv_delimiter(path))
            number, ended = 0, 0
            for fields in reader:
                start, ended = ended + 1, reader.line_num  # line_num: the lines read so far
                if not fields:  # a blank line: pyarrow skips it too
                    continue
                if match(number, fields):
                    return start
                number += 1
    except (csv.Error, *READ_ERRORS):
        return None
    finally:
        csv.field_size_limit(limit)
    return None


def _file_document(f, head: bytes, path: str, invalid_utf8: str, bad: BadRecords,
                   counts: collections.Counter) -> Iterator[dict[str, Any]]:
    """A text file that is one document, read and yielded in pieces (raytrain.data.pieces.cut), so
    that neither this task nor the tokenizer's holds the file whole (a 10 GB file was read into
    one 10 GB row, then the packer's task held its ids). A file of one piece is one row, as any
    document; a longer one is a row per piece, each row saying whether the document starts or ends
    with it and carrying the document's key for the eval split (its first piece's), which the
    packer (raytrain.data.packing) reads (a whole document's key is b"": the packer hashes its text).
    `head`: what was read of the file already, a byte order mark included."""
    rows = pieces.cut(_decoded(f, head, path, invalid_utf8, counts), pieces.PIECE_CHARS)
    try:
        piece = next(rows, None)
        if piece is None:
            counts["empty"] += 1
            return
        after = next(rows, None)
        # Every row of a file-per-document source has these columns, whole documents too: a batch of
        # two files' blocks would otherwise hold nulls where one file's rows lack them.
        key, starts = (pieces.key(piece.encode("utf-8")) if after is not None else b""), True
        while piece is not None:
            yield {"text": piece, "starts": starts, "ends": after is None, "key": key}
            piece, starts = after, False
            after = next(rows, None) if piece is not None else None
    except BadRecord as record:  # invalid UTF-8 under data.invalid_utf8=error, found as it is read
        bad.found(record)


def _decoded(f, head: bytes, where: str, invalid_utf8: str, counts: collections.Counter,
             chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """The text of a UTF-8 stream, decoded a chunk at a time (a character cut by a read is carried
    to the next), under data.invalid_utf8 as `_decode` (bad bytes counted once per file). `head`: its
    first bytes, a byte order mark (left out of the text) included, so that an error's byte offset is
    the file's; `where`: the file's path (a compressed file's offset counts decompressed bytes)."""
    offset = len(BOM) if head.startswith(BOM) else 0
    carried, replaced, chunk = b"", False, head[offset:]
    while chunk:
        raw = carried + chunk
        chunk = f.read(chunk_bytes)
        whole = _whole_characters(raw) if chunk else len(raw)
        raw, carried = raw[:whole], raw[whole:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if invalid_utf8 == "error":
                of = " of the decompressed text" if compression_of(where) is not None else ""
                raise BadRecord(where, f"invalid UTF-8 at byte {offset + e.start}{of}", INVALID_UTF8_FIX) from None
            replaced = True
            text = raw.decode("utf-8", errors="replace")
        offset += len(raw)
        yield text
    if replaced:
        counts["invalid_utf8"] += 1


def _whole_characters(raw: bytes) -> int:
    """How many of `raw`'s bytes end at a character boundary: all but a multi-byte character's
    beginning at its end (at most 3 bytes)."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character's first byte
            need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return len(raw) - back if need > back else len(raw)
    return len(raw)


def _json_records(f, head: bytes, path: str, invalid_utf8: str, bad: BadRecords,
                  counts: collections.Counter) -> Iterator[tuple[str, Any]]:
    """(where, record) of a JSON-lines file, or of a file holding one JSON array (`head`: what was
    read of it already); bad lines are handed to `bad` and left out."""
    # one JSON array: parsed a record at a time as it is read
    if head.removeprefix(BOM).lstrip(_JSON_SPACE.encode()).startswith(b"["):
        try:
            yield from _array_records(_decoded(f, head, path, invalid_utf8, counts), path)
        except BadRecord as record:  # the rest of the array cannot be parsed: nothing more is read
            bad.found(record)
        return
    for n, raw in _lines(f, head.removeprefix(BOM)):
        if raw.strip():
            where = f"{path} line {n}"
            record = _checked(bad, lambda: _parse_json(_decode(raw, invalid_utf8, where, counts), where))
            if record is not None:
                yield where, record


_JSON_SPACE = " \t\n\r"
_NEAR_END = 16  # chars: a value cut by the end of what was read fails within this of it (a literal, \uXXXX)


def _array_records(chunks: Iterator[str], path: str) -> Iterator[tuple[str, Any]]:
    """(where, record) of a text holding one JSON array, given as `chunks`, parsed a record at a
    time: a file of one array of GBs is never held whole, nor all its records at once (json.loads
    of the whole file built them all). Raises a BadRecord naming the record where the array stops
    parsing."""
    decoder = json.JSONDecoder()
    text, pos, n, ended = "", 0, 0, False

    def more(grow: bool = False) -> bool:
        """Read a chunk on (grow: until the unparsed text has doubled, so that a record of many
        chunks is parsed again a few times, not once a chunk); what was parsed is let go."""
        nonlocal text, pos, ended
        parts, size, want = [text[pos:]], 0, max(1, len(text) - pos) if grow else 1
        while size < want and not ended:
            chunk = next(chunks, None)
            ended = chunk is None
            if chunk:
                parts.append(chunk)
                size += len(chunk)
        if size:  # (nothing read: positions into the text stay valid)
            text, pos = "".join(parts), 0
        return size > 0

    def skip_space() -> str | None:  # the next non-space character, or None at the end
        nonlocal pos
        while True:
            while pos < len(text) and text[pos] in _JSON_SPACE:
                pos += 1
            if pos < len(text):
                return text[pos]
            if not more():
                return None

    def fail(what: str, record: int) -> BadRecord:
        return BadRecord(f"{path} record {record}", f"not valid JSON ({what})", "fix or remove it")

    more()
    skip_space()
    pos += 1  # the "[" (`_json_records` looked)
    if skip_space() == "]":
        pos += 1
    else:
        while True:
            if skip_space() is None:
                raise fail("the file ends inside the array", n + 1)
            try:
                record, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                at = e.pos - pos + 1  # (more() moves the text)
                # A record cut by the end of what was read fails near it, or inside a string: read on.
                if (e.pos >= len(text) - _NEAR_END or e.msg.startswith("Unterminated string")) and more(grow=True):
                    continue
                raise fail(_at(e.msg, f"character {at} of the record"), n + 1) from None
            except (RecursionError, ValueError) as e:
                raise _beyond_python(f"{path} record {n + 1}", e) from None
            if len(text) - end < _NEAR_END and more(grow=True):  # a number may go on ("1." is 1, then ".")
                continue
            pos = end
            yield f"{path} record {n + 1}", record
            n += 1
            after = skip_space()
            pos += 1
            if after == "]":
                break
            if after != ",":
                raise fail(f"',' or ']' expected after it, not {after!r}" if after else "the file ends inside the array", n)
    if skip_space() is not None:
        raise BadRecord(path, "holds more after its JSON array's closing ']'", "give one array, or JSON lines")


def _checked(bad: BadRecords, fn, *args):
    """fn(*args), or None when it finds a bad record (handed to `bad`, which raises outside a run)."""
    try:
        return fn(*args)
    except BadRecord as record:
        bad.found(record)
        return None


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
            raise BadRecord(where, f"invalid UTF-8 at byte {e.start}", INVALID_UTF8_FIX) from None
        counts["invalid_utf8"] += 1
        return raw.decode("utf-8", errors="replace")


def _parse_json(text: str, where: str) -> Any:
    """One JSON line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(where, f"not valid JSON ({_at(e.msg, f'column {e.colno}')})", "fix or remove it") from None
    except (RecursionError, ValueError) as e:
        raise _beyond_python(where, e) from None


def _beyond_python(where: str, e: Exception) -> BadRecord:
    # Valid JSON past Python's limits (nesting ~1000 deep, an integer of over 4300 digits) crashed the task.
    return BadRecord(where, f"cannot be parsed by Python's json ({first_line(e)})", "fix or remove it")


def _at(msg: str, where: str) -> str:
    # json's messages that name a position end in " at" ("Unterminated string starting at")
    return f"{msg} {where}" if msg.endswith(" at") else f"{msg} at {where}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(text: str, invalid_utf8: str, where: str, counts: collections.Counter) -> str:
    """`text` without lone surrogates, which JSON escapes ("\\ud83d" without its pair) decode to:
    no character, no UTF-8, and the tokenizer refuses them (a TypeError). They follow the policy of
    invalid UTF-8: U+FFFD and counted, or a bad record under data.invalid_utf8=error."""
    if text.isascii():  # most documents: one C-speed pass, no regex
        return text
    found = _SURROGATE.search(text)
    if found is None:
        return text
    if invalid_utf8 == "error":
        raise BadRecord(where, f"a lone UTF-16 surrogate \\u{ord(found.group()):04x} at character {found.start()} "
                               f"(a JSON escape that is not a character)",
                        "fix the file, or set data.invalid_utf8=replace to read such escapes as U+FFFD "
                        "(counted and reported)")
    counts["lone_surrogate"] += 1
    return _SURROGATE.sub("\ufffd", text)


def _document_of(record: Any, where: str, text_column: str, counts: collections.Counter) -> str | None:
    if not isinstance(record, dict):
        raise BadRecord(where, f"a {type(record).__name__}, not a JSON object", "give one object per line")
    return _document(record.get(text_column), where, text_column, counts)


def _read_arrow_file(path: str, filesystem, column: str, reads: FileReads, bad: BadRecords,
                     counts: collections.Counter) -> Iterator[dict[str, str]]:
    """One .arrow file of a save_to_disk directory (Arrow IPC stream), one record batch at a time."""
    import pyarrow as pa

    row = 0
    try:
        with filesystem.open_input_file(path) as stream:
            for batch in pa.ipc.open_stream(stream):
                for value in batch.column(batch.schema.get_field_index(column)).to_pylist():
                    row += 1
                    text = _checked(bad, _document, value, f"{path} row {row}", column, counts)
                    if text is not None and not bad.found_any:
                        yield {"text": text}
                reads.at(stream.tell())
            reads.close(stream.size)  # the IPC stream's end marker is never "read" as a batch
    except (OSError, pa.ArrowInvalid) as e:  # unreadable or cut short: the same at every retry
        _unreadable(bad, BadRecord(path, f"cannot be read ({first_line(e)})", "copy the save_to_disk directory again"),
                    e)


def read_parquet_rows(row: dict[str, Any], *, filesystem, column: str, pretokenized: bool,
                      counter: str | None = None, progress: str | None = None) -> Iterator[dict[str, Any]]:
    """One parquet file -> rows of {column: value}, one row group's batch at a time: the text
    column's strings, or (`pretokenized`) the input_ids column's int64 arrays. Empty documents (a
    null or "" text, a null or empty id list) are skipped and counted per file, as read_documents
    counts them (the run's counter keeps a file's count once, however often it is read). `progress`
    (the run's counter actor, training data only) is told their number at every read, as rows.

    Used instead of ray.data.read_parquet for one reason: a file that cannot be read (damaged pages
    under an intact footer, cut short after the driver read it) raised a raw OSError inside Ray
    Data's read task, which Ray retried, then failed the workers with pages of traceback; here it
    is a bad record naming the file (raytrain.data.bad_records), as an unreadable JSON file is. A
    null inside a row's id list is one too, naming the row (as int64 it became -2**63, "outside the
    embedding table"). What it costs: one task per file (Ray Data splits a file by row groups), and
    rows built in Python (0.2 us a short text row, 16 us a 500-id row: benchmarks/driver_check_costs.py;
    far below tokenizing a document, and for pre-tokenized data ~30M ids a second per file).
    """
    path = row["path"]
    bad = BadRecords(counter)
    counts: collections.Counter = collections.Counter()

    def rows() -> Iterator[dict[str, Any]]:  # the file from its start: each attempt replays the last's
        counts.clear()
        return _parquet_rows(path, filesystem, column, pretokenized, bad, counts)

    try:
        yield from _with_retries(rows, bad)
        if bad.found_any:
            return
        _report_file(path, counts, counter)
        # The progress line's total is the footers' rows, empty ones included, and the tokenizer never sees
        # those: without them the rows tokenized fell short of every pass (a share of empties: that share
        # never reached, and the passes named ever later).
        if counts["empty"]:
            report(progress, rows=counts["empty"])
    finally:
        bad.close()


def _parquet_rows(path: str, filesystem, column: str, pretokenized: bool, bad: BadRecords,
                  counts: collections.Counter) -> Iterator[dict[str, Any]]:
    """One attempt of `read_parquet_rows`: the file's rows from its start."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fix = "write the file again (or copy it again: it is damaged), or leave it out of the data"
    done = 0
    try:
        with filesystem.open_input_file(path) as stream:
            parquet = pq.ParquetFile(stream)
            if column not in parquet.schema_arrow.names:  # a remote file past those the driver read
                names = ", ".join(parquet.schema_arrow.names)
                bad.found(BadRecord(path, f"has no column {column!r} (columns: {names})",
                                    "set data.text_column, or write every file with the same columns"))
                return
            for batch in parquet.iter_batches(columns=[column]):
                values = batch.column(0)
                if not pretokenized:
                    for text in values.to_pylist():
                        if text is None or text == "":
                            counts["empty"] += 1
                        else:
                            yield {column: text}
                    done += len(values)
                    continue
                if pa.types.is_null(values.type):  # every row null: empty documents
                    counts["empty"] += len(values)
                    done += len(values)
                    continue
                lengths = pc.fill_null(pc.list_value_length(values), 0).to_numpy()
                flat = pc.list_flatten(values)
                if flat.null_count:
                    rows = [done + i + 1 for i, ids in enumerate(values.to_pylist()) if ids and None in ids]
                    bad.found(BadRecord(f"{path} row {rows[0]}", "a null token id in input_ids",
                                        "write token ids without nulls (drop or fix the row)"), more=len(rows) - 1)
                    return
                ids = flat.to_numpy().astype(np.int64, copy=False)
                for document in np.split(ids, np.cumsum(lengths)[:-1]):
                    if len(document):
                        yield {column: document}
                    else:
                        counts["empty"] += 1
                done += len(values)
    except (OSError, pa.ArrowException) as e:
        # Damaged or cut short: the same at every retry, so a bad record of the file, not a task failure.
        after = f" after its first {done:,} rows" if done else ""
        _unreadable(bad, BadRecord(path, f"cannot be read as parquet{after} ({first_line(e)})", fix), e)


def _document(value: Any, where: str, column: str, counts: collections.Counter) -> str | None:
    """A non-empty string; None for an empty or missing value (counted as skipped)."""
    if value is None or value == "":
        counts["empty"] += 1
        return None
    if not isinstance(value, str):
        raise BadRecord(where, f"data.text_column={column!r} holds a {type(value).__name__}, not a string",
                        "set data.text_column to the text field")
    return value


def _report_file(path: str, counts: collections.Counter, counter: str | None) -> None:
    """A file's skipped and changed documents: to the run's counter (reported once per run), or logged."""
    if counter is not None:
        skipped(counter, path, empty=counts["empty"], invalid_utf8=counts["invalid_utf8"],
                lone_surrogate=counts["lone_surrogate"])
        return
    if counts["invalid_utf8"]:
        logger.warning("raytrain data: %s: %d documents had invalid UTF-8, decoded with U+FFFD replacement "
                       "characters (data.invalid_utf8=error stops on it instead)", path, counts["invalid_utf8"])
    if counts["lone_surrogate"]:
        logger.warning("raytrain data: %s: %d documents had lone UTF-16 surrogates (JSON \\ud800-\\udfff escapes), "
                       "read as U+FFFD (data.invalid_utf8=error stops on them instead)", path, counts["lone_surrogate"])
    if counts["empty"]:
        logger.warning("raytrain data: %s: skipped %d empty documents", path, counts["empty"])
