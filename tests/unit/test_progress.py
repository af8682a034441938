"""Progress lines: the shared formatting (raytrain.progress), the tokenization progress arithmetic
and reporting (raytrain.data_progress), and the export's cadence, all with a fake clock. The real
counter actor and a real export run in tests/integration (test_data_sources.py, test_train_e2e.py)."""

import gzip

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from raytrain import data_progress
from raytrain.config import DataConfig, ModelConfig
from raytrain.data import Source, read_documents, tokenize_and_pack
from raytrain.data_progress import Counter, DataProgress, FileReads, input_total, progress_line, tokenized
from raytrain.progress import Meter, format_bytes, format_count, format_duration, status


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


def test_formatting():
    assert [format_duration(s) for s in (0, 41.6, 252, 3600 * 2 + 300, 86400 * 3 + 3600 * 4, None, -1)] == \
        ["0s", "42s", "4m12s", "2h05m", "3d04h", "?", "?"]
    assert [format_bytes(n) for n in (512, 12_500, 4.8e9, 140e9, 1.2e12)] == \
        ["512 B", "12.5 kB", "4.80 GB", "140 GB", "1.20 TB"]
    assert [format_count(n) for n in (7, 999, 1234, 1.23e6, 310.2e6, 4.5e9, 2.5)] == \
        ["7", "999", "1.23k", "1.23M", "310M", "4.50B", "2.50"]


def test_status_with_and_without_a_total_or_a_rate():
    assert status(1.2e9, 4.8e9, 310e6, "B") == "1.20 GB of 4.80 GB (25%), 310 MB/s, ETA 12s"
    assert status(1640, 4000, 20, "documents") == \
        "1.64k documents of 4.00k documents (41%), 20 documents/s, ETA 1m58s"
    assert status(1.23e6, None, 2100, "documents") == "1.23M documents, 2.10k documents/s"
    assert status(0, 4.8e9, None, "B") == "0 B of 4.80 GB (0%), ETA ?"


def test_meter_is_due_every_few_seconds_never_at_the_end():
    clock = Clock()
    meter = Meter(total=100e6, every_s=5.0, clock=clock)
    due = []
    for _ in range(10):  # 10 MB per second
        clock.now += 1.0
        due.append(meter.add(10e6))
    assert due == [False, False, False, False, True, False, False, False, False, False]
    assert meter.line() == "100 MB of 100 MB (100%), 10.0 MB/s, ETA 0s"


def test_counter_times_from_its_first_report():
    clock = Clock()
    counter = Counter(clock)
    clock.now += 50  # the actor waits for the first task: not part of the rate
    counter.add(bytes=10, rows=2)
    clock.now += 4
    counter.add(bytes=30, documents=2, tokens=99)
    assert counter.counts() == {"documents": 2, "tokens": 99, "rows": 2, "bytes": 40, "rows_read": 0,
                                "elapsed_s": 4.0}


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
    monkeypatch.setattr("raytrain.data.report", lambda progress, **counts: sent.append((progress, counts)))
    batch = {"text": np.array(["abc", "ij", "klmno"], dtype=object)}  # "abc" is held out at 0.5
    tokenize_and_pack(batch, seq_len=4, model=ModelConfig(), text_column="text", pretokenized=False,
                      split="train", eval_fraction=0.5, progress="counter")
    # rows: all the readers gave; documents and tokens: the training side only (bytes + EOS each)
    assert sent == [("counter", {"rows": 3, "documents": 2, "tokens": 3 + 6})]


def test_data_progress_off_counts_nothing():
    progress = DataProgress(DataConfig(progress_every_s=0), "run")
    assert progress.track(Source("builtin")) is None
    with progress:  # no actor, no thread (and no Ray needed)
        pass
    assert DataProgress(DataConfig(), "run").name.startswith("raytrain-data-run-")


def test_export_materialises_tensor_by_tensor_with_progress_lines(capsys):
    from raytrain.export import _materialise

    shared, other = torch.ones(1000), torch.zeros(250)
    meter = Meter(total=5000, every_s=0.0)
    out = _materialise({"embed": shared, "lm_head": shared, "norm": other}, ["embed", "lm_head", "norm"],
                       meter, "shard 1 of 1")
    assert out["embed"] is out["lm_head"] and meter.done == 5000  # a tied tensor is read and counted once
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("raytrain.export")]
    assert len(lines) == 1 and lines[0].startswith("raytrain.export: [1/3] 4.00 kB of 5.00 kB (80%), ")
    assert lines[0].endswith(", shard 1 of 1") and "B/s, ETA " in lines[0]
