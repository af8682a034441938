"""Reading, packing, splitting and the driver-side checks (pure functions and files in tmp_path; Ray
Data runs the same functions in tests/integration/test_data_sources.py)."""

import gzip
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrain.config import ConfigError, DataConfig, ModelConfig, RunConfig
from raytrain.data import (builtin_corpus, document_positions, inspect_source, read_documents, resolve_format,
                           tokenize_and_pack)
from raytrain.model import load_tokenizer

TOK = load_tokenizer(ModelConfig())
EOS = TOK.eos_token_id


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def pack(texts, seq_len=16, **kwargs):
    return tokenize_and_pack({"text": np.array(texts, dtype=object)}, seq_len=seq_len, model=ModelConfig(),
                             text_column="text", pretokenized=False, **kwargs)


def read(path, fmt, **kwargs):
    options = {"text_column": "text", "text_document": "file", "invalid_utf8": "replace", **kwargs}
    return [r["text"] for r in read_documents({"path": str(path)}, format=fmt, filesystem=pafs.LocalFileSystem(),
                                              **options)]


# --- packing ------------------------------------------------------------------------------------


def test_packing_joins_documents_with_eos_and_cuts_exact_blocks():
    docs = ["hello world", "a" * 40, "xyz"]
    blocks = pack(docs)["input_ids"]
    stream = [t for d in docs for t in ids(d) + [EOS]]
    assert blocks.dtype == np.int32 and blocks.shape == (len(stream) // 16, 16)
    assert blocks.flatten().tolist() == stream[: blocks.size]  # long document split across blocks, order kept
    assert len(stream) - blocks.size < 16  # only the tail shorter than one block is dropped


def test_per_document_position_ids_restart_after_eos_and_at_block_start():
    out = pack(["abc", "defghij", "k" * 20], seq_len=8, position_ids="per_document")
    # documents with EOS: 4, 8, 21 tokens -> 33 tokens -> 4 blocks of 8
    assert out["position_ids"].dtype == np.int32 and out["position_ids"].shape == out["input_ids"].shape
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3],
                                            [0, 1, 2, 3, 0, 1, 2, 3],
                                            [0, 1, 2, 3, 4, 5, 6, 7],
                                            [0, 1, 2, 3, 4, 5, 6, 7]]
    assert "position_ids" not in pack(["abc"], seq_len=2)  # "packed": the model counts 0..seq_len-1


def test_document_positions_of_a_document_spanning_blocks():
    assert document_positions(np.array([3, 10]), 12, 4).tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_empty_documents_are_skipped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        out = pack(["", None, "abcdefg"], seq_len=4)["input_ids"]
    assert out.flatten().tolist() == ids("abcdefg") + [EOS]
    assert "skipped 2 empty documents" in caplog.text


def test_pretokenized_input_is_packed_as_is_with_one_eos_per_document():
    rows = np.array([np.arange(10), np.append(np.arange(10, 29), EOS), np.array([], dtype=np.int64)], dtype=object)
    out = tokenize_and_pack({"input_ids": rows}, seq_len=31, model=ModelConfig(), text_column="text",
                            pretokenized=True, vocab_size=320)["input_ids"]
    # the second row already ends with EOS: not doubled; the empty row adds nothing (10+1 + 20 = 31)
    assert out.flatten().tolist() == list(range(10)) + [EOS] + list(range(10, 29)) + [EOS]


def test_token_ids_beyond_the_embedding_table_are_an_error():
    rows = np.array([np.array([1, 2, 999])], dtype=object)
    with pytest.raises(ConfigError, match="token id 999 is outside the model's embedding table \\(320 rows\\)"):
        tokenize_and_pack({"input_ids": rows}, seq_len=2, model=ModelConfig(), text_column="text",
                          pretokenized=True, vocab_size=320)
    with pytest.raises(ConfigError, match="set model.config.vocab_size"):
        pack(["abc"], seq_len=2, vocab_size=100)  # bytes above 100 exist in "abc"


def test_text_column_must_exist_and_hold_strings():
    with pytest.raises(ConfigError, match="data.text_column='text' is not a column"):
        tokenize_and_pack({"body": np.array(["x"], dtype=object)}, seq_len=2, model=ModelConfig(),
                          text_column="text", pretokenized=False)
    with pytest.raises(ConfigError, match="holds int values"):
        pack([1, 2])


def test_eval_fraction_splits_documents_by_content_disjointly_and_deterministically():
    docs = [f"document number {i}" for i in range(400)]

    def side(split):
        out = pack(docs, seq_len=1, split=split, eval_fraction=0.25)["input_ids"].flatten().tolist()
        return set(TOK.decode(out).split(TOK.eos_token)) - {""}

    train, held_out = side("train"), side("eval")
    assert train | held_out == set(docs) and not train & held_out
    assert 60 < len(held_out) < 140  # ~100 expected
    assert side("eval") == held_out  # same split every time


# --- reading files ------------------------------------------------------------------------------


def test_text_file_is_one_document_or_one_per_line(tmp_path):
    f = tmp_path / "book.txt"
    f.write_bytes(b"\xef\xbb\xbfChapter 1\r\n\r\nIt was a dark night.\n\n")
    assert read(f, "text") == ["Chapter 1\r\n\r\nIt was a dark night.\n\n"]  # BOM gone, text as is
    assert read(f, "text", text_document="line") == ["Chapter 1", "It was a dark night."]


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
    with pytest.raises(ConfigError, match=f"{bad} line 2 is not valid JSON"):
        read(bad, "json")
    bad.write_text('{"text": 5}\n')
    with pytest.raises(ConfigError, match="line 1: data.text_column='text' holds a int, not a string"):
        read(bad, "json")


# --- driver-side checks -------------------------------------------------------------------------


def test_format_detection(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    assert resolve_format(DataConfig(path=str(tmp_path / "a.jsonl"))) == "json"
    assert resolve_format(DataConfig(path=str(tmp_path))) == "json"
    (tmp_path / "b.bin").write_text("x")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        resolve_format(DataConfig(path=str(tmp_path / "b.bin")))
    assert resolve_format(DataConfig(path=str(tmp_path / "b.bin"), format="text")) == "text"
    with pytest.raises(ConfigError, match="data.format must be"):
        DataConfig(format="csv")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ConfigError, match="mixes formats \\(json, text\\)"):
        resolve_format(DataConfig(path=str(tmp_path)))


def test_parquet_with_input_ids_is_pretokenized(tmp_path):
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "t.parquet")
    source = inspect_source(DataConfig(), str(tmp_path))
    assert (source.format, source.column) == ("tokenized", "input_ids")
    pq.write_table(pa.table({"input_ids": ["not ids"]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="needs an input_ids column of integer lists"):
        inspect_source(DataConfig(format="tokenized"), str(tmp_path))


@pytest.mark.parametrize("make, key, message", [
    (lambda p: None, "missing", "data.path: .*missing does not exist"),
    (lambda p: (p / "d").mkdir(), "d", "directory .*d has no .* files"),
    (lambda p: (p / "e.txt").write_text(""), "e.txt", "every file of .*e.txt is empty"),
    (lambda p: (p / "f.jsonl").write_text('{"body": "x"}\n'), "f.jsonl",
     "data.text_column='text' is not a key of the records in .*f.jsonl \\(keys: body\\)"),
    (lambda p: pq.write_table(pa.table({"body": ["x"]}), p / "g.parquet"), "g.parquet",
     "data.text_column='text' is not a column of .*g.parquet \\(columns: body\\)"),
    (lambda p: pq.write_table(pa.table({"text": [1]}), p / "h.parquet"), "h.parquet", "holds int64, not strings"),
    (lambda p: pq.write_table(pa.table({"text": pa.array([], pa.string())}), p / "i.parquet"), "i.parquet",
     "the parquet files have no rows"),
])
def test_bad_sources_fail_on_the_driver_naming_the_key(tmp_path, make, key, message):
    make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        inspect_source(DataConfig(path=str(tmp_path / key)), str(tmp_path / key))


def test_hf_save_to_disk_directories(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": ["x", "y"]}).save_to_disk(str(tmp_path / "one"))
    source = inspect_source(DataConfig(text_column="body"), str(tmp_path / "one"))
    assert source.format == "hf" and len(source.files) == 1 and source.files[0].endswith(".arrow")
    with pytest.raises(ConfigError, match="data.text_column='text' is not a column of .*one \\(columns: body\\)"):
        inspect_source(DataConfig(), str(tmp_path / "one"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match="data.hf_split='train' is not a split of .*dd \\(splits: validation\\)"):
        inspect_source(DataConfig(), str(tmp_path / "dd"))
    assert inspect_source(DataConfig(hf_split="validation"), str(tmp_path / "dd")).files[0].endswith(".arrow")
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="has no rows"):
        inspect_source(DataConfig(), str(tmp_path / "empty"))


def test_data_config_checks_its_own_fields():
    for kwargs, message in [({"position_ids": "doc"}, "data.position_ids must be packed or per_document"),
                            ({"text_document": "para"}, "data.text_document must be file or line"),
                            ({"eval_fraction": 1.0}, "data.eval_fraction must be in \\[0, 1\\)"),
                            ({"eval_fraction": 0.1, "eval_path": "x"}, "both set"),
                            ({"eval_max_batches": 0}, "data.eval_max_batches must be at least 1"),
                            ({"progress_every_s": -1}, "data.progress_every_s must be >= 0")]:
        with pytest.raises(ConfigError, match=message):
            DataConfig(**kwargs)
    with pytest.raises(ConfigError, match="data.invalid_utf8 must be replace or error"):
        RunConfig.from_dict({"data": {"invalid_utf8": "ignore"}})


# --- the built-in pieces ------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_any_text():
    text = "naïve café — 3 + 4 = 7 ✓"
    assert TOK.decode(ids(text)) == text
    assert len(TOK) == 257


def test_builtin_corpus_is_deterministic_and_structured():
    a, b = builtin_corpus(50, seed=1), builtin_corpus(50, seed=1)
    assert a == b and a != builtin_corpus(50, seed=2)
    assert all("together" in d for d in a)
