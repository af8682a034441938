"""The tokenization progress of a run (raytrain.data.progress): its arithmetic and what the Ray Data
functions report, with a fake clock. The real counter actor runs in tests/integration/test_data_sources.py."""

import gzip

import numpy as np
import pyarrow.fs as pafs
import pytest

from raytrain.config import DataConfig, ModelConfig
from raytrain.data import packing
from raytrain.data import progress as data_progress
from raytrain.data.packing import tokenize_and_pack
from raytrain.data.progress import Counter, DataProgress, FileReads, input_total, progress_line, tokenized
from raytrain.data.readers import read_documents
from raytrain.data.sources import Source


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def reports(monkeypatch):
    """What the Ray Data functions send to the counter actor, collected here instead."""
    sent = []
    monkeypatch.setattr(data_progress, "report", lambda progress, **counts: sent.append((progress, counts)))
    return sent


def test_counter_times_from_its_first_report():
    clock = Clock()
    counter = Counter(clock)
    clock.now += 50  # the actor waits for the first task: not part of the rate
    counter.add(bytes=10, rows=2)
    clock.now += 4
    counter.add(bytes=30, documents=2, tokens=99)
    assert counter.counts() == {"documents": 2, "tokens": 99, "rows": 2, "bytes": 40, "rows_read": 0,
                                "elapsed_s": 4.0}


def test_counter_before_any_report_is_all_zeros():
    """The driver's thread reads the counter before the first task has reported."""
    assert Counter(Clock()).counts() == {"documents": 0, "tokens": 0, "rows": 0, "bytes": 0, "rows_read": 0,
                                         "elapsed_s": 0.0}


def test_progress_line_names_the_pass_and_rates_the_last_interval():
    total = 4.8e9
    first = {"documents": 1.0e6, "tokens": 250e6, "rows": 1.0e6, "bytes": 1.2e9, "rows_read": 1.0e6, "elapsed_s": 60.0}
    line = progress_line(first, None, "B", total)
    assert line == ("raytrain: data: pass 1: 1.20 GB of 4.80 GB (25%), 20.0 MB/s, ETA 3m00s; "
                    "tokenized 1.00M documents, 250M tokens")
    # A second pass: 6.0 GB in all is 1.2 GB into pass 2; the rate is the last 30 s only.
    second = {**first, "bytes": 6.0e9, "rows": 5.0e6, "rows_read": 5.0e6, "documents": 5.0e6, "elapsed_s": 90.0}
    assert progress_line(second, first, "B", total).startswith(
        "raytrain: data: pass 2: 1.20 GB of 4.80 GB (25%), 160 MB/s, ETA 22s; tokenized 5.00M documents")
    end_of_pass = {**first, "bytes": total}
    assert "pass 1: 4.80 GB of 4.80 GB (100%)" in progress_line(end_of_pass, first, "B", total)


def test_bytes_count_once_their_documents_are_tokenized():
    # The readers are ahead: 2.4 GB read held 2M documents, of which the tokenizer has had half.
    ahead = {"documents": 1.0e6, "tokens": 250e6, "rows": 1.0e6, "bytes": 2.4e9, "rows_read": 2.0e6, "elapsed_s": 60}
    assert tokenized(ahead, "B") == 1.2e9 and tokenized(ahead, "rows") == 1.0e6
    # A file's reports lag the tokenizer by up to a second: never more than what was read.
    assert tokenized({**ahead, "rows": 2.1e6}, "B") == 2.4e9
    assert tokenized({**ahead, "rows_read": 0}, "B") == 0.0


def test_progress_line_without_a_known_size_has_counts_and_rate_only():
    now = {"documents": 900, "tokens": 45_000, "rows": 1000, "bytes": 0, "rows_read": 0, "elapsed_s": 10.0}
    assert progress_line(now, None, "documents", None) == \
        "raytrain: data: 1.00k documents, 100 documents/s; tokenized 900 documents, 45.0k tokens"
    assert "pass 1: 1.00k documents of 4.00k documents (25%)" in progress_line(now, None, "documents", 4000)
    # readings less than a second apart (data.progress_every_s=0.5) still rate their interval
    later = {**now, "rows": 1100, "elapsed_s": 10.5}
    assert progress_line(later, now, "documents", None).startswith("raytrain: data: 1.10k documents, 200 documents/s;")


def test_input_total_by_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("x" * 300)
    (tmp_path / "b.txt").write_text("y" * 700)
    fs = pafs.LocalFileSystem()
    text = Source("text", filesystem=fs, files=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert input_total(text, 4000) == ("B", 1000.0)
    for i, n in enumerate((3, 5)):
        pq.write_table(pa.table({"text": ["d"] * n}), tmp_path / f"{i}.parquet")
    parquet = Source("parquet", filesystem=fs, files=[str(tmp_path / f"{i}.parquet") for i in range(2)])
    assert input_total(parquet, 4000) == ("rows", 8.0)
    assert input_total(Source("builtin"), 4000) == ("documents", 4000.0)
    assert input_total(Source("hf", hub_id="org/name"), 4000) == ("documents", None)


def test_file_reads_report_bytes_and_documents_at_most_once_a_second_and_at_the_end(reports):
    clock = Clock()
    reads = FileReads("counter", clock)
    documents = reads.count(iter(["a", "b", "c"]))
    for position in (100, 200, 300):
        clock.now += 0.4
        next(documents)
        reads.at(position)  # 0.4, 0.8, 1.2 s after opening: one report, at 300
    reads.at(350)
    reads.close()
    assert reports == [("counter", {"bytes": 300, "rows_read": 3}), ("counter", {"bytes": 50, "rows_read": 0})]


def test_file_reads_report_only_what_is_new(reports):
    """Rows parsed from bytes already reported (a read buffer holds many) are reported without bytes; a file
    whose reads were all reported sends nothing more when it ends."""
    clock = Clock()
    reads = FileReads("counter", clock)
    documents = reads.count(iter(["a", "b", "c"]))
    next(documents)
    clock.now += 1.0
    reads.at(300)
    next(documents)
    next(documents)
    clock.now += 1.0
    reads.at(300)
    reads.close()
    assert reports == [("counter", {"bytes": 300, "rows_read": 1}), ("counter", {"bytes": 0, "rows_read": 2})]


def test_a_file_read_again_after_a_storage_blip_never_reports_negative_bytes(reports):
    """raytrain.data.readers reads a file again from its start after an error that may pass: its reads count from 0
    again, and a report then had sent bytes = 0 + new position - what was reported, below zero."""
    clock = Clock()
    reads = FileReads("counter", clock)
    documents = reads.count(iter(["a", "b", "c"]))
    next(documents)
    clock.now += 1.0
    reads.at(300)
    next(documents)  # a row past the last report; then the read fails, and the file is read again
    clock.now += 1.0
    reads.at(100)
    reads.at(400)
    reads.close(lambda: (_ for _ in ()).throw(OSError("AWS Error SLOW_DOWN")))  # the size, at the end: kept
    assert reports == [("counter", {"bytes": 300, "rows_read": 1}), ("counter", {"bytes": 0, "rows_read": 1}),
                       ("counter", {"bytes": 100, "rows_read": 0})]


def test_read_documents_reports_every_byte_of_plain_and_compressed_files(tmp_path, reports):
    lines = b"".join(b'{"text": "document %d"}\n' % i for i in range(1000))
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    for name in ("a.jsonl", "b.jsonl.gz"):
        reports.clear()
        docs = list(read_documents({"path": str(tmp_path / name)}, format="json", filesystem=pafs.LocalFileSystem(),
                                   text_column="text", text_document="file", invalid_utf8="replace",
                                   progress="counter"))
        assert len(docs) == 1000 and sum(c["rows_read"] for _, c in reports) == 1000
        # compressed: the file's own size (not the decompressed bytes), once, when it ends
        assert sum(c["bytes"] for _, c in reports) == (tmp_path / name).stat().st_size


def test_a_compressed_file_reported_as_it_is_read_counts_its_own_bytes_not_the_decompressed(tmp_path, reports,
                                                                                            monkeypatch):
    monkeypatch.setattr(data_progress, "REPORT_EVERY_S", 0.0)  # a report at every read, as a long file's
    f = tmp_path / "b.jsonl.gz"
    f.write_bytes(gzip.compress(b'{"text": "document"}\n' * 1000))
    docs = list(read_documents({"path": str(f)}, format="json", filesystem=pafs.LocalFileSystem(),
                               text_column="text", text_document="file", invalid_utf8="replace", progress="counter"))
    assert len(docs) == 1000 and sum(c["bytes"] for _, c in reports) == f.stat().st_size


def test_read_documents_reports_an_arrow_files_bytes(tmp_path, reports):
    import datasets

    datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(100)]}).save_to_disk(str(tmp_path / "ds"))
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    docs = list(read_documents({"path": str(arrow)}, format="hf", filesystem=pafs.LocalFileSystem(),
                               text_column="text", text_document="file", invalid_utf8="replace", progress="counter"))
    assert len(docs) == 100 and sum(c["bytes"] for _, c in reports) == arrow.stat().st_size
    assert sum(c["rows_read"] for _, c in reports) == 100


def test_tokenize_and_pack_reports_rows_documents_and_tokens(monkeypatch):
    sent = []
    monkeypatch.setattr(packing, "report", lambda progress, **counts: sent.append((progress, counts)))
    batch = {"text": np.array(["abc", "ij", "klmno"], dtype=object)}  # "abc" is held out at 0.5
    tokenize_and_pack(batch, seq_len=4, model=ModelConfig(), text_column="text", pretokenized=False,
                      split="train", eval_fraction=0.5, progress="counter")
    # rows: all the readers gave; documents and tokens: the training side only (bytes + EOS each)
    assert sent == [("counter", {"rows": 3, "documents": 2, "tokens": 3 + 6})]


def test_a_setup_mistake_on_several_nodes_is_one_mistake_said_once():
    """Every worker of a node without a package the config needs, and every such node, reports the same
    SetupMistake: the first node is named, the others are not "more bad records"; it crosses processes whole."""
    import pickle

    from raytrain.data.bad_records import BadRecord, SetupMistake

    what, fix = "model.attn_implementation=flash_attention_2 needs flash-attn, which is not installed there", "install"
    counter = Counter()
    counter.bad_record(SetupMistake("node a", what, fix))
    counter.bad_record(SetupMistake("node a", what, fix))
    counter.bad_record(SetupMistake("node b", what, fix))
    summary = counter.summary()
    assert str(summary.bad_record) == f"node a: {what}: {fix}" and isinstance(summary.bad_record, SetupMistake)
    assert pickle.loads(pickle.dumps(summary.bad_record)).line() == summary.bad_record.line()
    assert SetupMistake("node b", what, fix).same(SetupMistake("node a", what, fix))
    assert not SetupMistake("node a", what, fix).same(BadRecord("node a", what, fix))


def test_data_progress_off_counts_no_reads_but_the_counter_still_has_a_name():
    progress = DataProgress(DataConfig(progress_every_s=0), "run")
    assert progress.track(Source("builtin")) is None  # the tasks report no reads
    assert progress.name.startswith("raytrain-data-run-")  # skips and bad records still go to it
    assert DataProgress(DataConfig(), "run").name != progress.name  # one per fit


def test_counter_keeps_the_first_bad_record_counts_the_rest_and_the_skips():
    import pickle

    from raytrain.data.bad_records import BadRecord

    counter = Counter()
    assert counter.summary().bad_record is None and counter.summary().skipped_line() is None
    counter.bad_record(BadRecord("a.jsonl line 3", "not valid JSON", "fix or remove it"))
    counter.bad_record(BadRecord("b.jsonl line 9", "not valid JSON", "fix or remove it"))
    counter.bad_record(BadRecord("a.jsonl line 3", "not valid JSON", "fix or remove it"))  # again: not another
    counter.more_bad_records(5)
    counter.skipped("a.jsonl", empty=2)
    counter.skipped("b.jsonl", empty=1, invalid_utf8=4)
    counter.reached(12)
    summary = counter.summary()
    assert str(summary.bad_record) == "a.jsonl line 3: not valid JSON (and 6 more bad records): fix or remove it"
    assert pickle.loads(pickle.dumps(summary.bad_record)).line() == str(summary.bad_record)  # on to the driver
    assert summary.step == 12
    assert summary.skipped_line() == (
        "raytrain: data: 3 empty documents skipped (null, \"\", a missing key, an empty file or id list), the first "
        "in a.jsonl; 4 documents with invalid UTF-8 decoded with U+FFFD replacement characters "
        "(data.invalid_utf8=error stops on them instead), the first in b.jsonl")

    counter.skipped(None, tail_tokens=1000, packed_tokens=3000)
    counter.skipped(None, tail_tokens=0, packed_tokens=5000)  # a batch that packed whole
    assert counter.summary().skipped_line().endswith(
        "; 1,000 tokens (12.5% of 8,000 tokenized) dropped at the end of tokenize batches, each tail shorter than "
        "data.seq_len, counted at every read of the data (a larger data.tokenize_batch_size drops fewer)")


def test_a_files_skipped_documents_count_once_however_often_the_file_is_read():
    """Every epoch, every evaluation, the eval check and (with data.eval_fraction) the eval pipeline
    read the same files: their counts were added up (42 empty documents in 24)."""
    counter = Counter()
    for _ in range(4):  # two epochs, each read by the training and the eval pipeline
        counter.skipped("a.jsonl", empty=2)
        counter.skipped("b.jsonl", empty=1)
    counter.skipped(None, empty=5)  # a batch of a streamed hub dataset: no file to tell its reads apart
    assert counter.summary().skipped["empty"] == (8, "a.jsonl")
    counter.skipped("a.jsonl", empty=1)  # fewer at a later read: the file's largest count stays
    assert counter.summary().skipped["empty"] == (8, "a.jsonl")


def test_each_other_bad_record_counts_once_and_the_first_stops_the_run():
    from raytrain.data.bad_records import BadRecord

    counter = Counter()
    assert not counter.stopped()
    first, second = (BadRecord(f"a.jsonl line {n}", "not valid JSON", "fix or remove it") for n in (3, 9))
    counter.bad_record(first)
    assert counter.stopped()
    counter.bad_record(second)
    assert str(counter.summary().bad_record) == \
        "a.jsonl line 3: not valid JSON (and 1 more bad record): fix or remove it"


def test_data_progress_on_gives_the_tasks_its_counters_name():
    progress = DataProgress(DataConfig(progress_every_s=5), "run")
    assert progress.track(Source("builtin")) == progress.name


def test_counter_keeps_the_controller_it_is_told_and_stops_nothing_without_a_bad_record():
    """raytrain.compat.abort_train_run only once a bad record is found (the handle is opaque to the counter:
    anything else here would fail on it)."""
    counter = Counter()
    handle = object()
    counter.watch_run(handle)
    assert counter.controller() is handle and not counter.stopped()


def test_a_file_with_none_of_a_kind_is_not_the_first_of_it():
    """A file's count of 0 (the batches' counts arrive whole, zeros included) neither names the file nor holds
    back the file's later count."""
    counter = Counter()
    counter.skipped("a.jsonl", empty=0, invalid_utf8=1)
    counter.skipped("b.jsonl", empty=2)
    counter.skipped("a.jsonl", empty=1)  # a later read of a.jsonl that found one: counted
    assert counter.summary().skipped["empty"] == (3, "b.jsonl")
    # tail tokens told without the tokens packed: no share of them
    counter = Counter()
    counter.skipped(None, tail_tokens=7)
    assert counter.summary().skipped_line().startswith("raytrain: data: 7 tokens dropped at the end")


def test_file_reads_without_a_counter_read_the_stream_itself():
    """A dataset read outside `fit` (progress off, unit tests): no counting wrapper around the file's stream."""
    import io

    reads = FileReads(None, Clock())
    stream = io.BytesIO(b"abc")
    assert reads.counting(stream) is stream
    assert list(reads.count(iter(["a", "b"]))) == ["a", "b"]


def test_parquet_rows_reach_the_footers_total_with_empty_documents(tmp_path, monkeypatch):
    """The total of a parquet pass is its footers' rows, empty documents included; the reader skips those, so the
    tokenizer's rows alone stopped short: "2 rows of 4 rows (50%)" at the end of pass 1, the end of pass 2 read
    as "pass 1: 100%", and every later pass named ever later."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain.data import readers
    from raytrain.data.readers import read_parquet_rows

    sent = []
    monkeypatch.setattr(packing, "report", lambda progress, **counts: sent.append(counts))
    monkeypatch.setattr(readers, "report", lambda progress, **counts: sent.append(counts))
    pq.write_table(pa.table({"text": ["abc", "", None, "klmno"]}), tmp_path / "a.parquet")
    source = Source("parquet", filesystem=pafs.LocalFileSystem(), files=[str(tmp_path / "a.parquet")])
    unit, total = input_total(source, 4000)
    rows = [r["text"] for r in read_parquet_rows({"path": str(tmp_path / "a.parquet")}, filesystem=source.filesystem,
                                                 column="text", pretokenized=False, progress="counter")]
    tokenize_and_pack({"text": np.array(rows, dtype=object)}, seq_len=4, model=ModelConfig(), text_column="text",
                      pretokenized=False, progress="counter")
    now = {k: float(sum(c.get(k, 0) for c in sent)) for k in ("documents", "tokens", "rows", "bytes", "rows_read")}
    assert (unit, total, now["rows"], now["documents"]) == ("rows", 4.0, 4.0, 2.0)
    assert progress_line({**now, "elapsed_s": 2.0}, None, unit, total).startswith(
        "raytrain: data: pass 1: 4 rows of 4 rows (100%), 2 rows/s, ETA 0s;")
