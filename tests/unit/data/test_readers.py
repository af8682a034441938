"""read_documents (raytrain.data.readers): text and JSON files, compression, invalid UTF-8, bad records."""

import gzip
import json
import logging
import re

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from raytrain.config import ConfigError
from raytrain.data.readers import read_documents


def read(path, fmt, **kwargs):
    options = {"text_column": "text", "text_document": "file", "invalid_utf8": "replace", **kwargs}
    return [r["text"] for r in read_documents({"path": str(path)}, format=fmt, filesystem=pafs.LocalFileSystem(),
                                              **options)]


def test_text_file_is_one_document_or_one_per_line(tmp_path):
    f = tmp_path / "book.txt"
    f.write_bytes(b"\xef\xbb\xbfChapter 1\r\n\r\nIt was a dark night.\n\n")
    assert read(f, "text") == ["Chapter 1\r\n\r\nIt was a dark night.\n\n"]  # BOM gone, text as is
    assert read(f, "text", text_document="line") == ["Chapter 1", "It was a dark night."]


def test_a_last_line_or_character_cut_by_the_files_end_is_kept_and_a_clean_file_logs_nothing(tmp_path, caplog):
    f = tmp_path / "a.txt"
    f.write_bytes(b"one\ntwo")  # no newline at the end
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "text", text_document="line") == ["one", "two"]
        assert read(f, "text") == ["one\ntwo"]
    assert not caplog.text  # nothing skipped or replaced: nothing logged
    f.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "text") == []
    assert caplog.text.count("skipped 1 empty documents") == 1
    f.write_bytes(b"caf\xc3")  # the file ends inside a character: replaced, not dropped
    assert read(f, "text") == ["caf\ufffd"]
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'{"text": "x"}\n{"text": "y"}\n{"text": 5}')
    with pytest.raises(ConfigError, match=f"^{f} line 3: data.text_column='text' holds a int"):
        read(f, "json")


def test_invalid_utf8_is_replaced_and_counted_or_an_error_naming_the_line(tmp_path, caplog):
    f = tmp_path / "a.txt"
    f.write_bytes(b"fine\nbad \xff\xfe here\nalso \xc3 bad\n")
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "text", text_document="line") == ["fine", "bad \ufffd\ufffd here", "also \ufffd bad"]
    assert f"{f}: 2 documents had invalid UTF-8" in caplog.text
    with pytest.raises(ConfigError, match=f"{f} line 2: invalid UTF-8 at byte 4"):
        read(f, "text", text_document="line", invalid_utf8="error")


def test_json_lines_arrays_compression_and_bad_records(tmp_path, caplog):
    f = tmp_path / "a.jsonl.gz"
    f.write_bytes(gzip.compress(b'{"text": "one"}\n\n{"text": null}\n{"id": 3}\n{"text": "two", "x": 1}\n'))
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "json") == ["one", "two"]
    assert "skipped 2 empty documents" in caplog.text
    for suffix, codec in ((".zst", "zstd"), (".br", "brotli")):  # pyarrow detects zstd, not brotli
        packed = tmp_path / f"d.jsonl{suffix}"
        with pa.output_stream(str(packed), compression=codec) as out:
            out.write(b'{"text": "three"}\n')
        assert read(packed, "json") == ["three"]
    arr = tmp_path / "b.json"
    arr.write_text(json.dumps([{"body": "x"}, {"body": "y"}]))
    assert read(arr, "json", text_column="body") == ["x", "y"]
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "cut\n')
    with pytest.raises(ConfigError, match=f"{bad} line 2: not valid JSON .*: fix or remove it"):
        read(bad, "json")
    bad.write_text('{"text": 5}\n')
    with pytest.raises(ConfigError, match="line 1: data.text_column='text' holds a int, not a string"):
        read(bad, "json")


@pytest.fixture
def counter(monkeypatch):
    """What the readers tell the run's counter actor, collected here instead."""
    from raytrain.data import bad_records, readers

    told = {"bad": [], "more": [], "skipped": []}
    monkeypatch.setattr(bad_records, "bad_record", lambda name, record: told["bad"].append(record))
    monkeypatch.setattr(bad_records, "more_bad_records", lambda name, n: told["more"].append(n))
    monkeypatch.setattr(readers, "skipped", lambda name, where, **counts: told["skipped"].append((where, counts)))
    return told


def test_in_a_run_the_first_bad_record_is_reported_the_rest_counted_and_nothing_raised(tmp_path, counter, caplog):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "one"}\n{"text": ""}\n{nope\n{"text": "two"}\n[1]\n{"text": 3}\n')
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        # nothing after the first bad record is yielded: the run is stopping
        assert read(f, "json", counter="run-counter") == ["one"]
    assert [str(r) for r in counter["bad"]] == [f"{f} line 3: not valid JSON (Expecting property name enclosed in "
                                                f"double quotes at column 2): fix or remove it"]
    assert counter["more"] == [2]  # line 5 (not an object) and line 6 (not a string)
    # skipped documents go to the counter (printed once per run), not to the log of each task
    assert counter["skipped"] == [(str(f), {"empty": 1, "invalid_utf8": 0, "lone_surrogate": 0})] and not caplog.text


def test_a_tasks_first_bad_record_is_reported_at_once_and_every_other_counted_with_the_values_behind_it(counter):
    from raytrain.data.bad_records import BadRecord, BadRecords

    bad = BadRecords("run-counter")
    first, second = (BadRecord(f"a.parquet row {n}", "a null token id in input_ids", "write token ids without nulls")
                     for n in (3, 40))
    bad.found(first, more=2)  # a batch: row 3 and 2 more rows behind it
    assert bad.found_any and counter["bad"] == [first] and counter["more"] == []
    bad.found(second, more=3)
    bad.close()  # the task's end: one count of all but the first
    assert counter["bad"] == [first] and counter["more"] == [2 + 1 + 3]


def test_invalid_utf8_under_error_is_a_bad_record_of_its_line_in_a_run(tmp_path, counter):
    f = tmp_path / "a.txt"
    f.write_bytes(b"fine\nbad \xff here\nalso \xc3 bad\nok\n")
    assert read(f, "text", text_document="line", invalid_utf8="error", counter="c") == ["fine"]
    assert str(counter["bad"][0]).startswith(f"{f} line 2: invalid UTF-8 at byte 4: fix the file")
    assert counter["more"] == [1]


def test_lone_surrogate_escapes_follow_the_invalid_utf8_policy(tmp_path, caplog):
    """JSON's "\\ud83d" without its pair is no character: the tokenizer raised TypeError in a task."""
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "pair \\ud83d\\ude00 ok"}\n{"text": "lone \\ud83d here"}\n')
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "json") == ["pair \U0001f600 ok", "lone \ufffd here"]
    assert f"{f}: 1 documents had lone UTF-16 surrogates" in caplog.text
    with pytest.raises(ConfigError, match=f"{f} line 2: a lone UTF-16 surrogate \\\\ud83d at character 5 .*: fix the"):
        read(f, "json", invalid_utf8="error")


def test_unreadable_compressed_files_are_a_bad_record_naming_the_file(tmp_path):
    full = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(2000)))
    (tmp_path / "cut.jsonl.gz").write_bytes(full[: len(full) // 2])
    (tmp_path / "plain.jsonl.gz").write_text('{"text": "not gzip"}\n')
    for name, reason in (("cut.jsonl.gz", "Truncated compressed stream"), ("plain.jsonl.gz", "incorrect header")):
        with pytest.raises(ConfigError, match=f"{tmp_path / name}: cannot be read \\(.*{reason}.*\\): its name says "
                                              f"gzip-compressed"):
            read(tmp_path / name, "json")


def test_xz_and_upper_case_suffixes_are_decompressed(tmp_path):
    import lzma

    (tmp_path / "a.TXT.GZ").write_bytes(gzip.compress(b"book one"))
    (tmp_path / "b.txt.xz").write_bytes(lzma.compress(b"book two"))
    assert read(tmp_path / "a.TXT.GZ", "text") + read(tmp_path / "b.txt.xz", "text") == ["book one", "book two"]
    (tmp_path / "c.txt.xz").write_bytes(lzma.compress(b"x" * 1000)[:-20])
    with pytest.raises(ConfigError, match="c.txt.xz: cannot be read"):
        read(tmp_path / "c.txt.xz", "text")


def test_a_utf16_file_is_a_bad_record_when_read(tmp_path):
    """The driver checks local files' first bytes; a remote file's BOM is found by its reader."""
    (tmp_path / "a.txt").write_bytes("hello\nworld\n".encode("utf-16"))
    for document in ("file", "line"):
        with pytest.raises(ConfigError, match=f"{tmp_path / 'a.txt'}: is UTF-16 LE text .*: re-encode it as UTF-8"):
            read(tmp_path / "a.txt", "text", text_document=document)
    (tmp_path / "b.jsonl").write_bytes('{"text": "x"}\n'.encode("utf-16-be"))  # no BOM: a NUL before each byte
    with pytest.raises(ConfigError, match="b.jsonl line 1: not valid JSON"):
        read(tmp_path / "b.jsonl", "json")


def test_a_json_file_whose_records_all_lack_the_key_is_a_bad_record(tmp_path, caplog):
    """A missing key is an empty document, but not in every record of a file: that file uses another key."""
    f = tmp_path / "a.jsonl"
    f.write_text('{"content": "x"}\n{"body": "y"}\n')  # the first record's keys are named
    with pytest.raises(ConfigError, match=f"{f}: none of its 2 records has the key data.text_column='text' \\(the "
                                          f"first has content\\): set data.text_column"):
        read(f, "json")
    f.write_text('{"content": "x"}\n{"text": "y"}\n')  # some records have it: the others are empty documents
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "json") == ["y"]
    assert "skipped 1 empty documents" in caplog.text


def test_a_json_line_nested_past_pythons_limit_is_a_bad_record_not_a_crashed_task(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=f"^{f} line 2: cannot be parsed by Python's json .*: fix or remove it"):
        read(f, "json")


def test_an_arrow_files_rows_are_its_documents_and_a_non_string_is_a_bad_record_naming_its_row(tmp_path, counter):
    """A save_to_disk directory's .arrow files: Arrow IPC streams."""
    def arrow(name, values):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, pa.schema([("id", pa.int64()), ("text", values.type)])) as out:
            out.write_batch(pa.record_batch([pa.array(range(len(values))), values], names=["id", "text"]))
        (tmp_path / name).write_bytes(sink.getvalue().to_pybytes())
        return tmp_path / name

    assert read(arrow("a.arrow", pa.array(["a", None, "", "b"])), "hf", counter="c") == ["a", "b"]
    assert counter["skipped"] == [(str(tmp_path / "a.arrow"), {"empty": 2, "invalid_utf8": 0, "lone_surrogate": 0})]
    assert read(arrow("b.arrow", pa.array([None, 7, 8])), "hf", counter="c") == []
    assert [str(r) for r in counter["bad"]] == [f"{tmp_path / 'b.arrow'} row 2: data.text_column='text' holds a int, "
                                                f"not a string: set data.text_column to the text field"]
    assert counter["more"] == [1]


def read_parquet(path, column="text", pretokenized=False, **kwargs):
    from raytrain.data.readers import read_parquet_rows

    return [r[column] for r in read_parquet_rows({"path": str(path)}, filesystem=pafs.LocalFileSystem(),
                                                 column=column, pretokenized=pretokenized, **kwargs)]


def test_parquet_rows_and_a_damaged_file_is_a_bad_record_naming_it(tmp_path, counter):
    import pyarrow.parquet as pq

    docs = [f"doc {i} " * 50 for i in range(2000)]
    pq.write_table(pa.table({"text": docs, "n": range(2000)}), tmp_path / "a.parquet", row_group_size=1000,
                   compression="none")
    assert read_parquet(tmp_path / "a.parquet") == docs
    damaged = bytearray((tmp_path / "a.parquet").read_bytes())
    damaged[5000:5400] = b"\xff" * 400  # inside the first row group's data page; the footer is intact
    (tmp_path / "b.parquet").write_bytes(bytes(damaged))
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'b.parquet'}: cannot be read as parquet \\(.*\\): write the "
                                          f"file again"):
        read_parquet(tmp_path / "b.parquet")
    # in a run: reported to the counter (which stops the run, never retried), nothing raised
    assert read_parquet(tmp_path / "b.parquet", counter="c") == []
    assert str(counter["bad"][0]).startswith(f"{tmp_path / 'b.parquet'}: cannot be read as parquet")
    # damaged in its second row group (pyarrow's batches span row groups up to 65,536 rows): the rows before it
    # were read, and the line says how many (0.2 s)
    from raytrain.data.readers import read_parquet_rows

    docs = [f"doc {i}" for i in range(70_000)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=65_536, compression="none")
    second = pq.ParquetFile(tmp_path / "c.parquet").metadata.row_group(1).column(0).dictionary_page_offset
    damaged = bytearray((tmp_path / "c.parquet").read_bytes())
    damaged[second + 100:second + 500] = b"\xff" * 400
    (tmp_path / "c.parquet").write_bytes(bytes(damaged))
    read_before = []
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'c.parquet'}: cannot be read as parquet after its first "
                                          f"65,536 rows \\(.*\\): write the file again"):
        for row in read_parquet_rows({"path": str(tmp_path / "c.parquet")}, filesystem=pafs.LocalFileSystem(),
                                     column="text", pretokenized=False):
            read_before.append(row["text"])
    assert read_before == docs[:65_536]


def test_a_parquet_file_without_the_column_and_an_all_null_id_column(tmp_path, counter):
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError) as e:
        read_parquet(tmp_path / "a.parquet")
    assert str(e.value) == (f"{tmp_path / 'a.parquet'}: has no column 'text' (columns: body, n): set data.text_column, "
                            f"or write every file with the same columns")
    pq.write_table(pa.table({"input_ids": pa.nulls(3)}), tmp_path / "t.parquet")  # Arrow's null type
    assert read_parquet(tmp_path / "t.parquet", "input_ids", pretokenized=True, counter="c") == []
    assert counter["skipped"] == [(str(tmp_path / "t.parquet"), {"empty": 3, "invalid_utf8": 0, "lone_surrogate": 0})]


def test_a_null_token_id_is_a_bad_record_naming_its_row(tmp_path):
    import numpy as np
    import pyarrow.parquet as pq

    ids = pa.array([[1, 2], None, [], [3, 4, 5]], pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "a.parquet")
    out = read_parquet(tmp_path / "a.parquet", "input_ids", pretokenized=True)
    assert [o.tolist() for o in out] == [[1, 2], [3, 4, 5]] and {o.dtype for o in out} == {np.dtype(np.int64)}
    ids = pa.array([[1, 2], [3, None], [None], [4]], pa.list_(pa.int64()))
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "b.parquet")
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'b.parquet'} row 2: a null token id in input_ids "
                                          f"\\(and 1 more bad record\\): write token ids without nulls"):
        read_parquet(tmp_path / "b.parquet", "input_ids", pretokenized=True)


def test_a_parquet_files_empty_documents_are_counted_per_file(tmp_path, counter):
    """As read_documents counts a text file's: the run's counter keeps a file's count once, where the
    tokenizer's per-batch count was added up at every read of the file."""
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "", "b"]}), tmp_path / "a.parquet")
    assert read_parquet(tmp_path / "a.parquet", counter="c") == ["a", "b"]
    pq.write_table(pa.table({"input_ids": pa.array([[1], None, []], pa.list_(pa.int64()))}), tmp_path / "t.parquet")
    assert len(read_parquet(tmp_path / "t.parquet", "input_ids", pretokenized=True, counter="c")) == 1
    assert counter["skipped"] == [(str(tmp_path / "a.parquet"), {"empty": 2, "invalid_utf8": 0, "lone_surrogate": 0}),
                                  (str(tmp_path / "t.parquet"), {"empty": 2, "invalid_utf8": 0, "lone_surrogate": 0})]


def test_a_worker_that_finds_no_step_or_no_eval_row_waits_for_the_abort_instead_of_raising(counter, monkeypatch):
    """Raised, the record reached Ray Train, which printed its traceback before the run's one line."""
    from raytrain.data import bad_records
    from raytrain.data.ingest import MicroBatches
    from raytrain.worker.evaluation import no_eval_rows

    class Killed(BaseException):
        """What the abort does to the waiting worker."""

    def wait(wait_s):
        assert wait_s >= 30  # the abort takes about a second; a slow cluster must not see the traceback either
        raise Killed

    waited = []
    monkeypatch.setattr(bad_records, "_wait_for_abort", wait)
    monkeypatch.setattr(bad_records, "_wait_for_kill", waited.append)
    with pytest.raises(Killed):
        no_eval_rows("c")
    no_step = MicroBatches.__new__(MicroBatches)
    no_step.step_rows, no_step._read_epoch, no_step._counter = 8, 0, "c"
    with pytest.raises(Killed):
        no_step._no_step()
    assert [str(r).split(" of ")[0] for r in counter["bad"]] == ["the eval data yields not one row",
                                                                  "the training data yields no step"]
    # Both are empty streams, which a group being stopped also sees: each waited for that kill first
    assert waited == [bad_records.STREAM_CUT_WAIT_S] * 2 and bad_records.STREAM_CUT_WAIT_S > 5 + 5
    with pytest.raises(ConfigError, match="^the eval data yields not one row"):  # outside a run: raised at once
        no_eval_rows(None)
    # an abort that never comes (the counter gone with its node): after the wait, the record is raised after all
    monkeypatch.setattr(bad_records, "_wait_for_abort", lambda wait_s: None)
    with pytest.raises(ConfigError, match="^the eval data yields not one row"):
        no_eval_rows("c")
    assert len(counter["bad"]) == 3


def test_an_empty_stream_in_a_group_being_stopped_is_killed_before_it_reports_the_users_data(counter, monkeypatch):
    """A stopping group's streams can end early: "yields no step" from it ended a healthy run with exit 2."""
    from raytrain.data import bad_records
    from raytrain.data.ingest import MicroBatches
    from raytrain.worker.evaluation import no_eval_rows

    class Killed(BaseException):
        """Ray Train's kill of the stopping group, during the wait."""

    def killed(wait_s):
        raise Killed

    monkeypatch.setattr(bad_records, "_wait_for_kill", killed)
    no_step = MicroBatches.__new__(MicroBatches)
    no_step.step_rows, no_step._read_epoch, no_step._counter = 8, 0, "c"
    for stop in (no_step._no_step, lambda: no_eval_rows("c")):
        with pytest.raises(Killed):
            stop()
    assert counter["bad"] == []  # nothing told: the run goes on with the group's successor
    # a setup mistake is no stream: told at once
    monkeypatch.setattr(bad_records, "_wait_for_abort", killed)
    with pytest.raises(Killed):
        bad_records.stop_run(bad_records.SetupMistake("node n", "no package x", "install x"), "c")
    assert len(counter["bad"]) == 1
    # outside a run (no counter) nothing is stopping: raised at once, with no wait
    with pytest.raises(ConfigError, match="^the eval data yields not one row"):
        no_eval_rows(None)


def rows_of(path, **kwargs):
    options = {"text_column": "text", "text_document": "file", "invalid_utf8": "replace", **kwargs}
    return list(read_documents({"path": str(path)}, format="text", filesystem=pafs.LocalFileSystem(), **options))


def test_a_text_file_longer_than_a_piece_is_read_in_pieces_that_join_to_it(tmp_path, monkeypatch):
    """A file that is one document never sits in the task's memory whole: a 10 GB file was one row."""
    from raytrain.data import pieces

    monkeypatch.setattr(pieces, "PIECE_CHARS", 4000)
    text = "".join(f"Line {i}: caf\u00e9 \u65e5\u672c {'x' * (i % 50)}\n" for i in range(30_000))  # ~1.3 MB
    f = tmp_path / "book.txt.gz"
    f.write_bytes(gzip.compress(b"\xef\xbb\xbf" + text.encode()))
    rows = rows_of(f)
    assert "".join(r["text"] for r in rows) == text and len(rows) > 300
    assert [r["starts"] for r in rows] == [True] + [False] * (len(rows) - 1)
    assert [r["ends"] for r in rows] == [False] * (len(rows) - 1) + [True]
    assert {r["key"] for r in rows} == {pieces.key(rows[0]["text"].encode())}
    assert [r["text"] for r in rows] == list(pieces.cut([text], 4000))
    (tmp_path / "short.txt").write_text("one piece")
    assert rows_of(tmp_path / "short.txt") == [{"text": "one piece", "starts": True, "ends": True, "key": b""}]


def test_a_file_is_decoded_in_chunks_as_it_would_be_whole(tmp_path):
    """Characters cut by a read are carried over; invalid bytes are replaced as whole-file decoding
    replaces them, or an error naming the byte of the file."""
    import collections
    import io

    from raytrain.data.readers import _decoded

    raw = "a\u00e9\u65e5\U0001f600".encode() * 50 + b"bad \xff\xfe \xe6\x97 end" + "\u00e9".encode() * 20
    for chunk in range(1, 12):
        counts = collections.Counter()
        stream = io.BytesIO(raw[chunk:])
        assert "".join(_decoded(stream, raw[:chunk], "f", "replace", counts, chunk)) == raw.decode(errors="replace")
        assert counts["invalid_utf8"] == 1
    stray = b"\x80" * 8 + b" end"  # continuation bytes alone, 2 or 4 to a read: no character to look back to
    for chunk in (2, 4):
        decoded = _decoded(io.BytesIO(stray[chunk:]), stray[:chunk], "f", "replace", collections.Counter(), chunk)
        assert "".join(decoded) == stray.decode(errors="replace")
    f = tmp_path / "big.txt"
    f.write_bytes(b"word " * 400_000 + b"\xff")  # past the first 1 MiB read
    with pytest.raises(ConfigError, match=f"{f}: invalid UTF-8 at byte 2000000: fix the file"):
        rows_of(f, invalid_utf8="error")
    # the offset is the file's: a byte order mark counts; a compressed file's says it counts decompressed bytes
    f.write_bytes(b"\xef\xbb\xbf" + b"word " * 400_000 + b"\xff")
    with pytest.raises(ConfigError, match=f"{f}: invalid UTF-8 at byte 2000003: fix the file"):
        rows_of(f, invalid_utf8="error")
    import gzip
    g = tmp_path / "big.txt.gz"
    g.write_bytes(gzip.compress(b"word " * 400_000 + b"\xff"))
    with pytest.raises(ConfigError, match=f"{g}: invalid UTF-8 at byte 2000000 of the decompressed text: fix"):
        rows_of(g, invalid_utf8="error")


def test_a_json_array_is_parsed_a_record_at_a_time_as_json_loads_parses_it_whole(tmp_path):
    """However the file's reads cut it (a character, a string, a number, an escape), the records are
    json.loads' own; a malformed array is a bad record naming the record, the same at every cut."""
    import collections
    import io
    import random

    from raytrain.data.bad_records import BadRecord
    from raytrain.data.readers import _array_records, _decoded

    def parse(raw, chunk):
        stream = io.BytesIO(raw[chunk:])
        return [r for _, r in _array_records(_decoded(stream, raw[:chunk], "f", "replace", collections.Counter(),
                                                      chunk), "f")]

    rng = random.Random(0)
    records = [{"text": "x" * rng.randint(0, 300) + "\u00e9\U0001f600 \"q\" \\ \n", "n": rng.random() * 1e6,
                "i": 12345678901, "t": True, "none": None, "l": [1, -2.5e-3, "\\u00e9"]} for _ in range(100)]
    records += [{"text": "y" * 100_000}, {"text": "\ud83d\ude00 pair"}]
    raw = ("\n  " + json.dumps(records, indent=1) + " \n").encode()
    for chunk in (1, 2, 3, 7, 100, 4096, 1 << 20):
        assert parse(raw, chunk) == json.loads(raw)
    cases = {b'[{"a": 1} {"b": 2}]': "record 1: not valid JSON (',' or ']' expected after it, not '{')",
             b'[{"a": 1}, ': "record 2: not valid JSON (the file ends inside the array)",
             b'[1, 2': "record 2: not valid JSON (the file ends inside the array)",
             b'[{"a": tru}]': "record 1: not valid JSON (Expecting value at character 7 of the record)",
             b'[{"a": "cut}]': "record 1: not valid JSON (Unterminated string starting at character 7 of the record)",
             b'[1, 2] x': "f: holds more after its JSON array's closing ']'",
             b'[]x': "f: holds more after its JSON array's closing ']'"}
    for raw, message in cases.items():
        for chunk in (1, 3, 100):
            with pytest.raises(BadRecord, match=re.escape(message)):
                parse(raw, chunk)
    assert parse(b"[ ]", 1) == [] and parse(b"[1,2]", 1) == [1, 2]
    numbers = b"[1.5, 2e3, -7, 0.25E-2, 12345678901234567890]"  # "1." parses as 1: a number cut by a read
    assert all(parse(numbers, chunk) == json.loads(numbers) for chunk in range(1, len(numbers) + 1))
    for raw in (b"[" + b"[" * 100_000, b'[{"n": ' + b"9" * 5000 + b'}]'):  # Python's limits: not a crashed task
        with pytest.raises(BadRecord, match="record 1: cannot be parsed by Python's json"):
            parse(raw, 1 << 20)
    f = tmp_path / "a.json"
    f.write_text(json.dumps([{"text": "one"}, {"text": "two"}, {"text": 3}]))
    with pytest.raises(ConfigError, match=f"{f} record 3: data.text_column='text' holds a int"):
        read(f, "json")


def test_csv_rows_as_hugging_face_reads_them_and_bad_rows_are_bad_records(tmp_path, caplog, monkeypatch):
    import lzma

    f = tmp_path / "a.csv"
    f.write_bytes(b'\xef\xbb\xbfid,text\r\n1,"hello, ""world""\nsecond line"\r\n2,\r\n3,plain \xff bad\r\n4,x\r\n')
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert read(f, "csv") == ['hello, "world"\nsecond line', "plain \ufffd bad", "x"]
    assert "1 documents had invalid UTF-8" in caplog.text and "skipped 1 empty documents" in caplog.text
    with pytest.raises(ConfigError, match=f"{f} line 5: invalid UTF-8 at byte 6 of its 'text' value: fix the file"):
        read(f, "csv", invalid_utf8="error")
    with pytest.raises(ConfigError, match=f"{f}: has no column data.text_column='body' in its header"):
        read(f, "csv", text_column="body")
    tsv = tmp_path / "b.tsv.xz"
    tsv.write_bytes(lzma.compress(b"text\tid\na, b\t1\n"))
    assert read(tsv, "csv") == ["a, b"]
    (tmp_path / "empty.csv").write_text("")  # as an empty text file: nothing, counted, not an error
    assert read(tmp_path / "empty.csv", "csv") == []
    bad = tmp_path / "c.csv"
    bad.write_text("id,text\n1,a\n2,b,c\n")
    with pytest.raises(ConfigError, match=f"^{bad} line 3: not valid CSV \\(CSV parse error: Expected 2 "
                                          f"columns, got 3: 2,b,c\\): fix or remove it$"):
        read(bad, "csv")
    from raytrain.data import readers

    monkeypatch.setattr(readers, "_CSV_BLOCK", 1 << 16)  # a value over two blocks: valid CSV pyarrow cannot take
    (tmp_path / "long.csv").write_text("id,text\n1,short\n2," + "word " * 40_000 + "\n")
    with pytest.raises(ConfigError, match="long.csv line 3: holds a value of over 0.0625 MiB, more than the "
                                          "CSV reader takes: split that document, or give JSON lines or parquet"):
        read(tmp_path / "long.csv", "csv")


def test_csv_values_with_newlines_across_blocks_and_bad_rows_in_a_run(tmp_path, monkeypatch, counter):
    from raytrain.data import readers

    monkeypatch.setattr(readers, "_CSV_BLOCK", 1 << 12)  # 4 KiB blocks: many boundaries, some inside quotes
    f = tmp_path / "a.csv"
    f.write_text("id,text\n" + "".join(f'{i},"line {i}\nnext {i}"\n' for i in range(1000)))
    assert read(f, "csv") == [f"line {i}\nnext {i}" for i in range(1000)]
    f.write_bytes(b"id,text\n1,fine\n2,bad \xff\n3,also\n")
    (tmp_path / "empty.csv").write_text("")
    # in a run: the first bad record reported, nothing after it yielded, the empty file counted
    docs = read(f, "csv", invalid_utf8="error", counter="c") + read(tmp_path / "empty.csv", "csv", counter="c")
    assert docs == ["fine"]
    assert [str(r).split(":")[0] for r in counter["bad"]] == [f"{f} line 3"]
    assert [counts["empty"] for _, counts in counter["skipped"]] == [0, 1]


def test_a_bad_csv_record_is_named_by_the_line_it_starts_on_as_an_editor_numbers_them(tmp_path):
    """raytrain said `row N` counting data records (the header, blank lines and the lines inside quoted values
    not counted), pyarrow `Row #N` counting records with the header (when it reads without threads), and the
    user looks for the file's line: for the 3rd data record below, rows 3 and #4 where an editor shows line 6.
    Every CSV message now names the line the record starts on, as JSON lines' do."""
    import pyarrow.csv as pacsv

    head = b'id,text\r\n1,"one\r\ntwo"\r\n\r\n2,fine\r\n'  # lines 1-5: a quoted newline, a blank line
    bad = tmp_path / "bad.csv"
    bad.write_bytes(head + b"3,x,extra\r\n4,y\r\n")
    assert bad.read_bytes().split(b"\r\n").index(b"3,x,extra") + 1 == 6  # as an editor shows it
    with pytest.raises(pa.ArrowInvalid, match="Row #4: Expected 2 columns"):  # pyarrow's own numbering
        pacsv.read_csv(bad, read_options=pacsv.ReadOptions(use_threads=False))
    with pytest.raises(ConfigError, match=f"^{bad} line 6: not valid CSV \\(CSV parse error: Expected 2 columns, "
                                          f"got 3: 3,x,extra\\): fix or remove it$"):
        read(bad, "csv")
    utf8 = tmp_path / "utf8.csv.gz"  # compressed: the lines of the decompressed text
    utf8.write_bytes(gzip.compress(head + b"3,caf\xe9\r\n"))
    with pytest.raises(ConfigError, match=f"^{utf8} line 6: invalid UTF-8 at byte 3 of its 'text' value: "):
        read(utf8, "csv", invalid_utf8="error")
    tsv = tmp_path / "a.tsv"  # a lone \r ends a line too (Excel for Mac), and the delimiter is the tab
    tsv.write_bytes(b'text\tid\r"a\rb"\t1\rc\t2\t3\r')
    with pytest.raises(ConfigError, match=f"^{tsv} line 4: not valid CSV "):
        read(tsv, "csv")
