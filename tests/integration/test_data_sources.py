"""Every source format through the real pipeline: Ray Data on the shared `ray start` cluster reads the
files written here, tokenizes with a tokenizer loaded by AutoTokenizer from a directory, and packs.
The blocks are compared token for token with what the packing policy says they must be."""

import gzip

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import ConfigError, DataConfig, ModelConfig
from raytrain.console import format_bytes, format_count
from raytrain.data.pipeline import build_datasets
from raytrain.data.progress import DataProgress
from raytrain.data.sources import inspect_sources
from raytrain.model import byte_tokenizer, load_model_config
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

DOCS = ["the first document.", "a second, longer document that spans more than one block of sixteen.",
        "third", "naïve café ✓"]


@pytest.fixture(scope="module")
def model(ray_cluster, tmp_path_factory):
    """The built-in model with its byte tokenizer saved to a directory: loaded back through AutoTokenizer."""
    import ray.data

    path = tmp_path_factory.mktemp("tokenizer")
    byte_tokenizer().save_pretrained(path)
    context = ray.data.DataContext.get_current()
    previous = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # compare whole streams, in order
    yield ModelConfig(tokenizer=str(path))
    context.execution_options.preserve_order = previous


def expected_blocks(docs, seq_len):
    """One tokenization batch (every test source is smaller than data.tokenize_batch_size): each
    document's tokens then EOS, cut into seq_len blocks, the tail dropped."""
    tok = byte_tokenizer()
    stream = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    n = len(stream) // seq_len
    return np.array(stream[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def rows(ds, column="input_ids"):
    return np.array([r[column] for r in ds.take_all()])


def datasets(data, model, progress=None):
    """The datasets exactly as a run builds them: the sources checked on the driver first."""
    return build_datasets(data, model, 0, inspect_sources(data), load_model_config(model).vocab_size, progress)


def build(model, seq_len=16, **data):
    return rows(datasets(DataConfig(seq_len=seq_len, **data), model)["train"])


def footer_readers(address):
    """Ray Data's parquet listing actors started on the cluster so far (dead ones too)."""
    from ray.util.state import list_actors

    return len(list_actors(address=address, filters=[("class_name", "=", "FooterReader")], limit=10_000))


def test_parquet_with_a_named_text_column_and_a_null_row(tmp_path, model, ray_cluster):
    pq.write_table(pa.table({"body": DOCS[:2] + [None]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"body": DOCS[2:]}), tmp_path / "part-1.parquet")
    before = footer_readers(ray_cluster["address"])
    np.testing.assert_array_equal(build(model, path=str(tmp_path), text_column="body"), expected_blocks(DOCS, 16))
    # read by raytrain.data.readers.read_parquet_rows, one task per file: no listing actors at all
    # (ray.data.read_parquet started a pool of them, 32 by default, at every epoch)
    assert footer_readers(ray_cluster["address"]) == before
    for i, docs in enumerate((DOCS[:2] + [None], DOCS[2:])):  # a categorical column, as pandas writes one
        pq.write_table(pa.table({"body": pa.array(docs).dictionary_encode()}), tmp_path / f"part-{i}.parquet")
    np.testing.assert_array_equal(build(model, path=str(tmp_path), text_column="body"), expected_blocks(DOCS, 16))


def test_a_damaged_parquet_file_or_a_null_token_id_is_one_line_naming_the_file(tmp_path, model):
    """Damaged pages under an intact footer raised a raw OSError in Ray Data's read task (retried,
    then a worker failure with pages of traceback)."""
    pq.write_table(pa.table({"text": [f"doc {i} " * 50 for i in range(2000)]}), tmp_path / "a.parquet",
                   row_group_size=1000, compression="none")
    damaged = bytearray((tmp_path / "a.parquet").read_bytes())
    damaged[5000:5400] = b"\xff" * 400
    (tmp_path / "a.parquet").write_bytes(bytes(damaged))
    with pytest.raises(Exception, match=f"{tmp_path / 'a.parquet'}: cannot be read as parquet"):
        build(model, path=str(tmp_path / "a.parquet"))
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3, None]], pa.list_(pa.int64()))}),
                   tmp_path / "ids.parquet")
    with pytest.raises(Exception, match=f"{tmp_path / 'ids.parquet'} row 2: a null token id in input_ids"):
        build(model, path=str(tmp_path / "ids.parquet"))


def test_json_lines_compressed_with_blank_lines_and_invalid_utf8(tmp_path, model):
    lines = b"\n".join(b'{"text": "%s", "id": %d}' % (d.encode(), i) for i, d in enumerate(DOCS[:3]))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines + b'\n\n{"text": "bad \xff byte"}\n'
                                                        b'{"text": "lone \\ud83d surrogate"}\n'))
    blocks = build(model, path=str(tmp_path / "a.jsonl.gz"))
    np.testing.assert_array_equal(blocks, expected_blocks(DOCS[:3] + ["bad \ufffd byte", "lone \ufffd surrogate"], 16))
    with pytest.raises(Exception, match="a.jsonl.gz line 5: invalid UTF-8 at byte 14"):
        build(model, path=str(tmp_path / "a.jsonl.gz"), invalid_utf8="error")


def test_text_files_are_documents_or_lines_are(tmp_path, model):
    (tmp_path / "a.txt").write_text(DOCS[0] + "\n" + DOCS[1] + "\n")
    (tmp_path / "b.txt").write_text(DOCS[2] + "\n\n" + DOCS[3])
    (tmp_path / "_SUCCESS").write_text("")  # hidden/marker files are not read
    files = [DOCS[0] + "\n" + DOCS[1] + "\n", DOCS[2] + "\n\n" + DOCS[3]]
    np.testing.assert_array_equal(build(model, path=str(tmp_path)), expected_blocks(files, 16))
    np.testing.assert_array_equal(build(model, path=str(tmp_path), text_document="line"), expected_blocks(DOCS, 16))


def test_a_text_file_read_in_pieces_trains_as_the_whole_document(tmp_path, model):
    """A file longer than a piece (64k characters) is rows of pieces (raytrain.data.readers): packed
    back to the whole document's tokens, with per-document positions that do not restart at a piece."""
    from raytrain.data.packing import document_positions

    book = "".join(f"Chapter line {i}: caf\u00e9, \u65e5\u672c {'word ' * (i % 9)}\n" for i in range(8000))
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(book.encode()))
    (tmp_path / "b.txt").write_text(DOCS[0])
    ds = datasets(DataConfig(path=str(tmp_path), seq_len=64, position_ids="per_document"), model)["train"]
    out = ds.take_all()
    expected = expected_blocks([book, DOCS[0]], 64)
    np.testing.assert_array_equal(np.array([r["input_ids"] for r in out]), expected)
    lengths = np.array([len(book.encode()) + 1, len(DOCS[0].encode()) + 1])
    np.testing.assert_array_equal(np.array([r["position_ids"] for r in out]),
                                  document_positions(lengths, expected.size, 64))


def test_csv_and_tsv_files_as_hugging_face_reads_them(tmp_path, model):
    (tmp_path / "a.csv").write_text('id,text\n1,"' + DOCS[0] + '"\n2,"' + DOCS[1].replace(",", ",\n") + '"\n')
    (tmp_path / "b.tsv.gz").write_bytes(gzip.compress(f"text\tid\n{DOCS[2]}\t3\n{DOCS[3]}\t4\n".encode()))
    expected = expected_blocks([DOCS[0], DOCS[1].replace(",", ",\n"), DOCS[2], DOCS[3]], 16)
    np.testing.assert_array_equal(build(model, path=str(tmp_path)), expected)


def test_hf_save_to_disk_directory(tmp_path, model):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(4))}).save_to_disk(str(tmp_path / "ds"))
    np.testing.assert_array_equal(build(model, path=str(tmp_path / "ds")), expected_blocks(DOCS, 16))


def test_pretokenized_parquet_skips_tokenization_and_restarts_positions_per_document(tmp_path, model):
    docs = [list(range(1, 12)), list(range(20, 40)), [7]]
    pq.write_table(pa.table({"input_ids": docs}), tmp_path / "ids.parquet")
    ds = datasets(DataConfig(path=str(tmp_path / "ids.parquet"), seq_len=8, position_ids="per_document"),
                  model)["train"]
    out = ds.take_all()
    eos = byte_tokenizer().eos_token_id
    stream = docs[0] + [eos] + docs[1] + [eos] + docs[2] + [eos]  # 35 tokens -> 4 blocks of 8
    assert np.concatenate([r["input_ids"] for r in out]).tolist() == stream[:32]
    assert [r["position_ids"].tolist() for r in out] == [
        [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]


def test_eval_fraction_and_eval_path(tmp_path, model):
    docs = [f"doc {i}" for i in range(60)]
    (tmp_path / "all.txt").write_text("\n".join(docs))
    data = DataConfig(path=str(tmp_path / "all.txt"), text_document="line", seq_len=1, eval_fraction=0.3)
    eos = byte_tokenizer().eos_token

    def documents(ds):
        return byte_tokenizer().decode(rows(ds).flatten().tolist()).split(eos)[:-1]

    split = datasets(data, model)
    train, held_out = documents(split["train"]), documents(split["eval"])
    assert sorted(train + held_out) == sorted(docs) and 5 < len(held_out) < 35
    (tmp_path / "eval.txt").write_text("held out")
    separate = datasets(DataConfig(path=str(tmp_path / "all.txt"), eval_path=str(tmp_path / "eval.txt"),
                                   seq_len=1), model)["eval"]
    assert documents(separate) == ["held out"]
    assert "eval" not in datasets(DataConfig(), model)


def test_bad_input_is_a_config_error_before_any_task(tmp_path, model):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.jsonl").write_text('{"content": "x"}\n')
    cases = [(DataConfig(path=str(tmp_path / "nope.parquet")), "data.path: .*nope.parquet does not exist"),
             (DataConfig(path=str(tmp_path / "empty.txt")), "every file of .*empty.txt is empty"),
             (DataConfig(path=str(tmp_path / "a.jsonl")),
              "data.text_column='text' is not a key of the records in .*a.jsonl \\(keys: content\\)"),
             (DataConfig(eval_path=str(tmp_path / "missing")), "data.eval_path: .*missing does not exist")]
    for data, message in cases:
        with pytest.raises(ConfigError, match=message):
            datasets(data, model)


def test_progress_counts_every_byte_document_and_token_of_each_pass(tmp_path, model, capsys):
    import re

    docs = [f"document number {i}, " + "x" * (i % 50) for i in range(600)]
    (tmp_path / "a.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in docs[:400]))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress("".join(f'{{"text": "{d}"}}\n' for d in docs[400:]).encode()))
    size = sum(f.stat().st_size for f in tmp_path.iterdir())  # the compressed file counts by its own size
    tokens = sum(len(d.encode()) + 1 for d in docs)  # the byte tokenizer: one token per byte, plus EOS
    data = DataConfig(path=str(tmp_path), seq_len=16, progress_every_s=0.5)
    progress = DataProgress(data, "data-sources")
    ds = datasets(data, model, progress)["train"]
    printed = []

    def line_for_pass(n):
        printed.extend(line for line in capsys.readouterr().out.splitlines() if line.startswith("raytrain: data:"))
        return any(line.startswith(f"raytrain: data: pass {n}: {format_bytes(size)} of ") for line in printed)

    with progress:
        for n in (1, 2):  # two passes, as two epochs read the data
            rows(ds)
            wanted = {"bytes": n * size, "rows_read": n * 600, "rows": n * 600, "documents": n * 600,
                      "tokens": n * tokens}
            # the tasks' reports are fire-and-forget, and the thread prints after the pass's last one
            wait_until(lambda: {k: progress.counts()[k] for k in wanted} == wanted, 30, f"pass {n}'s counts")
            wait_until(lambda: line_for_pass(n), 30, f"pass {n}'s 100% line")
    lines = printed
    line = re.compile(r"raytrain: data: pass (\d): [\d.]+ k?B of ([\d.]+ kB) \((\d+)%\), "
                      r"(?:[\d.]+ [kM]?B/s, )?ETA \S+; tokenized ([\d.]+k?) documents, ([\d.]+k?) tokens")
    # A line can come before the first tokenize batch has reported (a slow machine: CI printed
    # "tokenized 0 documents, 0 tokens" once), so the counts are matched whatever their size.
    parsed = [line.fullmatch(text).groups() for text in lines]
    assert ("1", format_bytes(size), "100", "600", format_count(tokens)) in parsed, lines
    assert parsed[-1] == ("2", format_bytes(size), "100", "1.20k", format_count(2 * tokens)), lines
