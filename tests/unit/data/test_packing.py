"""tokenize_and_pack (raytrain.data.packing): EOS joins, exact blocks, per-document positions, the
eval split, bad values. Ray Data runs the same function in tests/integration/test_data_sources.py."""

import json
import logging
import types

import numpy as np
import pytest

from raytrain.config import ConfigError, ModelConfig
from raytrain.data import packing, pieces
from raytrain.data.packing import block_arrays, document_positions, tokenize_and_pack
from raytrain.model import document_start_ids, load_tokenizer

TOK = load_tokenizer(ModelConfig())
EOS = TOK.eos_token_id


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def pack(texts, seq_len=16, **kwargs):
    return block_arrays(tokenize_and_pack({"text": np.array(texts, dtype=object)}, seq_len=seq_len,
                                          model=ModelConfig(), text_column="text", pretokenized=False, **kwargs))


def pack_ids(rows, seq_len, **kwargs):
    return block_arrays(tokenize_and_pack({"input_ids": rows}, seq_len=seq_len, model=ModelConfig(),
                                          text_column="text", pretokenized=True, **kwargs))


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


def test_in_a_run_empty_documents_go_to_the_runs_counter_not_the_log(monkeypatch, caplog):
    told = []
    monkeypatch.setattr(packing, "skipped", lambda counter, **counts: told.append((counter, counts)))
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        out = pack_ids(np.array([np.arange(3), None, np.array([], np.int64)], dtype=object), seq_len=1,
                       counter="run-counter")["input_ids"]
    assert out.flatten().tolist() == [0, 1, 2, EOS]  # a null or empty id list: no document, not a lone EOS
    assert ("run-counter", {"empty": 2}) in told and not caplog.text


def test_outside_a_run_empty_documents_are_logged_at_once_then_at_most_every_30_s(monkeypatch, caplog):
    clock = types.SimpleNamespace(monotonic=lambda: now)  # a fake clock: `now` of the loop below
    monkeypatch.setattr(packing, "time", clock)
    monkeypatch.setattr(packing, "_skipped_in_process", {"total": 0, "unreported": 0, "last_report": 0.0})
    logged = []
    for now, texts in ((10.0, ["", None, "a"]), (30.0, ["", "b"]), (40.0, ["", "", None, "c"])):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="raytrain.data"):
            pack(texts, seq_len=1)
        logged.append(caplog.text)
    assert "skipped 2 empty documents (null or \"\") since the last report, 2 in this process so far (latest " \
           "batch: 2 of 3)" in logged[0]  # the first at once, however early in the process
    assert logged[1] == ""  # 20 s later: counted, not told
    assert "skipped 4 empty documents (null or \"\") since the last report, 6 in this process so far (latest " \
           "batch: 3 of 4)" in logged[2]  # 30 s after the last report: the ones held back, told


def test_pretokenized_input_is_packed_as_is_with_one_eos_per_document():
    rows = np.array([np.arange(10), np.append(np.arange(10, 29), EOS), np.array([], dtype=np.int64)], dtype=object)
    out = pack_ids(rows, seq_len=31, vocab_size=320)["input_ids"]
    # the second row already ends with EOS: not doubled; the empty row adds nothing (10+1 + 20 = 31)
    assert out.flatten().tolist() == list(range(10)) + [EOS] + list(range(10, 29)) + [EOS]


def test_token_ids_beyond_the_embedding_table_are_an_error():
    rows = np.array([np.array([1, 2, 999])], dtype=object)
    with pytest.raises(ConfigError, match="token id 999 is outside the model's embedding table \\(320 rows\\)"):
        tokenize_and_pack({"input_ids": rows}, seq_len=2, model=ModelConfig(), text_column="text",
                          pretokenized=True, vocab_size=320)
    with pytest.raises(ConfigError, match="set model.config.vocab_size"):
        pack(["abc"], seq_len=2, vocab_size=100)  # bytes above 100 exist in "abc"


def test_token_ids_outside_the_table_name_the_worst_and_count_the_documents_holding_one():
    rows = np.array([np.array([0, 5]), np.array([320]), np.array([-1, 5]), np.array([0, 319])], dtype=object)
    with pytest.raises(ConfigError) as e:
        pack_ids(rows, seq_len=2, vocab_size=320)  # ids 0..319 fit: 320 is one past the last row
    assert str(e.value) == ("token id 320 is outside the model's embedding table (320 rows) (and 1 more bad record): "
                            "the data was tokenized with another vocabulary: re-tokenize it with model.tokenizer")
    for row, worst in ((1, 320), (2, -1)):
        with pytest.raises(ConfigError, match=f"^token id {worst} is outside"):
            pack_ids(rows[row:row + 1], seq_len=2, vocab_size=320)


def test_in_a_run_a_batch_with_ids_outside_the_table_yields_no_block(monkeypatch):
    from raytrain.data import bad_records

    told = []
    monkeypatch.setattr(bad_records, "bad_record", lambda name, record: told.append(str(record)))
    monkeypatch.setattr(bad_records, "more_bad_records", lambda name, n: told.append(n))
    rows = np.array([np.arange(8), np.array([999])], dtype=object)
    assert pack_ids(rows, seq_len=2, vocab_size=320, counter="run-counter")["input_ids"].shape == (0, 2)
    assert told == ["token id 999 is outside the model's embedding table (320 rows): the data was tokenized with "
                    "another vocabulary: re-tokenize it with model.tokenizer"]


@pytest.mark.parametrize("position_ids, columns", [("packed", ["input_ids"]),
                                                   ("per_document", ["input_ids", "position_ids"])])
def test_a_batch_with_no_document_yields_zero_rows_of_the_usual_columns(position_ids, columns):
    """An empty block has no columns at all; a batch of empty documents has no token."""
    for batch in ({}, {"text": np.array(["", None], dtype=object)}):
        out = block_arrays(tokenize_and_pack(batch, seq_len=1, model=ModelConfig(), text_column="text",
                                             pretokenized=False, position_ids=position_ids))
        assert list(out) == columns and all(array.shape == (0, 1) for array in out.values())


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
    assert side(None) == set(docs)  # no split: every document, whatever eval_fraction says
    assert pack(docs[:20], seq_len=1, split="eval")["input_ids"].size == 0  # no eval_fraction: nothing held out


def test_pretokenized_documents_are_split_by_their_ids():
    rows = np.array([np.arange(i, i + 3) for i in range(100)], dtype=object)

    def side(split):
        out = pack_ids(rows, seq_len=4, split=split, eval_fraction=0.5)["input_ids"]
        return {tuple(block[:3]) for block in out.tolist()}

    train, held_out = side("train"), side("eval")
    assert train | held_out == {tuple(r) for r in rows.tolist()} and not train & held_out
    assert 30 < len(held_out) < 70
    key = pieces.key(np.arange(0, 3, dtype=np.int64).tobytes())
    assert ((0, 1, 2) in held_out) == bool(packing._eval_side([key], 0.5)[0])


def test_an_eval_fraction_of_0_holds_out_nothing_and_1_everything():
    assert packing._eval_side([bytes(8), b"\xff" * 8], 0.0).tolist() == [False, False]
    assert packing._eval_side([bytes(8), b"\xff" * 8], 1.0).tolist() == [True, True]


def test_a_batch_without_a_whole_block_has_the_tensor_type_of_every_other_not_pickles(caplog):
    """Fewer than seq_len tokens in a batch: zero rows, of the Arrow type Ray Data gives full
    batches (from a zero-row 2-D array it fell back to pickled Python objects, with a warning)."""
    from ray.data._internal.tensor_extensions.arrow import convert_to_pyarrow_array

    reference = convert_to_pyarrow_array(np.zeros((3, 16), np.int32), "input_ids").type
    with caplog.at_level(logging.WARNING):
        empty = tokenize_and_pack({"text": np.array(["abc"], dtype=object)}, seq_len=16, model=ModelConfig(),
                                  text_column="text", pretokenized=False, position_ids="per_document")
        full = tokenize_and_pack({"text": np.array(["a" * 40], dtype=object)}, seq_len=16, model=ModelConfig(),
                                 text_column="text", pretokenized=False)
    assert empty.num_rows == 0 and empty.column_names == ["input_ids", "position_ids"]
    assert empty.schema.field("input_ids").type == full.schema.field("input_ids").type == reference
    assert "pickled" not in caplog.text


def test_in_a_run_bad_values_are_reported_once_with_their_count(monkeypatch):
    from raytrain.data import bad_records

    told = []
    monkeypatch.setattr(bad_records, "bad_record", lambda name, record: told.append(("first", str(record))))
    monkeypatch.setattr(bad_records, "more_bad_records", lambda name, n: told.append(("more", n)))
    out = pack(["fine", 1, 2.5, 3], counter="run-counter")
    assert out["input_ids"].shape == (0, 16)  # nothing of a bad batch is trained on
    assert told == [("first", "data.text_column='text' holds int values, not strings: set data.text_column to the "
                              "text column"), ("more", 2)]


def test_text_that_spells_a_special_token_stays_text():
    out = pack([f"a{TOK.eos_token}b"], seq_len=1)["input_ids"].flatten().tolist()
    assert out == ids("a") + TOK(TOK.eos_token, add_special_tokens=False, split_special_tokens=True)["input_ids"] \
        + ids("b") + [EOS]
    assert out.count(EOS) == 1  # only the separator the packer appends


def test_each_batchs_dropped_tail_is_counted_for_the_run(monkeypatch):

    told = []
    monkeypatch.setattr(packing, "skipped", lambda counter, **counts: told.append((counter, counts)))
    # "abc" + EOS and "defghij" + EOS: 12 tokens, one block of 8, 4 dropped; then a batch with no block at all
    assert pack(["abc", "defghij"], seq_len=8, counter="run-counter")["input_ids"].shape == (1, 8)
    assert pack(["abc"], seq_len=8, counter="run-counter")["input_ids"].shape == (0, 8)
    assert told == [("run-counter", {"tail_tokens": 4, "packed_tokens": 12}),
                    ("run-counter", {"tail_tokens": 4, "packed_tokens": 4})]


def test_a_tokenize_task_whose_tokenizer_reads_a_config_with_an_eos_outside_the_vocabulary_says_nothing(tmp_path):
    """AutoTokenizer.from_pretrained(DIR) reads DIR's config.json, and transformers warned in every tokenize task's
    process about its eos_token_id outside the vocabulary (seen: once per MapBatches(tokenize_and_pack) process
    of a run, and on the driver); the driver says what it means instead (raytrain.planning.resolve advice)."""
    from transformers import AutoTokenizer

    from tests.helpers import transformers_log

    for name, eos in (("model", 4501), ("control", 4502)):  # a message of its own each: transformers warns once
        TOK.save_pretrained(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320,
                                                                 "eos_token_id": eos}))
    warning = "must be `None` or an integer within the vocabulary"
    with transformers_log() as log:
        AutoTokenizer.from_pretrained(tmp_path / "control")  # what the task called: the warning is there
    assert [m for m in log if warning in m and "got 4502" in m], log
    with transformers_log() as log:
        blocks = tokenize_and_pack({"text": np.array(["hello world"] * 4, dtype=object)}, seq_len=8,
                                   model=ModelConfig(name_or_path=str(tmp_path / "model")), text_column="text",
                                   pretokenized=False)
    assert not [m for m in log if warning in m], log
    assert block_arrays(blocks)["input_ids"].flatten().tolist() == (ids("hello world") + [EOS]) * 4


@pytest.fixture(scope="module")
def llama_style(tmp_path_factory):
    """A Llama-style tokenizer, built in code and saved: its template puts <s> before every text."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
    path = tmp_path_factory.mktemp("llama_tokenizer")
    LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=True).save_pretrained(path)
    return ModelConfig(tokenizer=str(path))


def test_each_document_starts_with_the_bos_its_tokenizer_adds_as_hugging_face_training_does(llama_style):
    """run_clm tokenizes with tokenizer(text): <s> before each document for Llama-style tokenizers.
    Packing asked for no special tokens and so never placed it; the byte tokenizer (and GPT-2's) add none."""
    tok = load_tokenizer(llama_style)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    docs = ["ab", "cde"]
    stream = [t for d in docs for t in tok(d)["input_ids"] + [eos]]  # add_special_tokens=True: [<s>, ...]
    assert stream[0] == bos and stream.count(bos) == 2
    out = block_arrays(tokenize_and_pack({"text": np.array(docs, dtype=object)}, seq_len=len(stream),
                                         model=llama_style, text_column="text", pretokenized=False,
                                         position_ids="per_document"))
    assert out["input_ids"].flatten().tolist() == stream
    first = len(tok(docs[0])["input_ids"]) + 1
    assert out["position_ids"].flatten().tolist() == [*range(first), *range(len(stream) - first)]  # <s> at 0
    # pre-tokenized documents get the same, whether they were tokenized with the special tokens or without
    with_special = [np.array(tok(d)["input_ids"] + [eos]) for d in docs]
    without = [np.array(tok(d, add_special_tokens=False)["input_ids"]) for d in docs]
    for rows in (with_special, without):
        packed = block_arrays(tokenize_and_pack({"input_ids": np.array(rows, dtype=object)}, seq_len=len(stream),
                                                model=llama_style, text_column="text", pretokenized=True,
                                                position_ids="per_document"))
        assert packed["input_ids"].flatten().tolist() == stream
        assert packed["position_ids"].tolist() == out["position_ids"].tolist()  # a BOS already there counted once
    assert document_start_ids(TOK) == ()  # the byte tokenizer (as GPT-2's): nothing before a document
    assert pack(["ab"], seq_len=3)["input_ids"].flatten().tolist() == ids("ab") + [EOS]


def gpt2_style():
    """A byte-level BPE with GPT-2's pre-tokenizer regex, trained in code (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([LONG[:20000]], trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


LONG = "".join(f"Line {i}: the quick brown fox, {i * 7} caf\u00e9s!\n" + ("  indented\n\n" if i % 5 == 0 else "")
               for i in range(3000))


def test_a_long_document_is_tokenized_in_pieces_with_the_whole_documents_ids(monkeypatch, llama_style):
    """A text file is one document: tokenized whole it held ~200 bytes per character (2 GB for 10 MB)."""

    calls = []
    tokenize = packing._tokenize
    monkeypatch.setattr(packing, "_tokenize",
                        lambda tok, texts: calls.append(sum(map(len, texts))) or tokenize(tok, texts))
    monkeypatch.setattr(pieces, "PIECE_CHARS", 4000)
    monkeypatch.setattr(packing, "CALL_CHARS", 20000)
    two_pieces = LONG[:6000]
    assert len(list(pieces.cut([two_pieces], 4000))) == 2
    for tok in (TOK, gpt2_style()):
        for docs in ([LONG, two_pieces, "short"], [LONG]):
            packing._can_cut(tok)  # its probe's calls, once per tokenizer: not counted below
            calls.clear()
            encoded = packing._encode(tok, docs)
            assert [p.tolist() for p in encoded] == tok(docs, add_special_tokens=False)["input_ids"]
            # pieces of at most 4000 characters fill each call but the last up to the 20000
            assert len(calls) > 1 and max(calls) <= 20000 and min(calls[:-1]) > 20000 - 4000
    llama = load_tokenizer(llama_style)
    assert not packing._can_cut(llama)  # it puts a prefix space before every call: never cut
    calls.clear()
    assert [p.tolist() for p in packing._encode(llama, [LONG])] == llama([LONG], add_special_tokens=False)["input_ids"]
    assert calls == [len(LONG)]  # whole, in one call


def test_documents_share_a_tokenizer_call_up_to_call_chars_inclusive(monkeypatch):
    assert packing.CALL_CHARS == pieces.HARD_CUT * pieces.PIECE_CHARS  # a piece cut hard still fits one call
    calls = []
    tokenize = packing._tokenize
    monkeypatch.setattr(packing, "_tokenize", lambda tok, texts: calls.append(list(texts)) or tokenize(tok, texts))
    monkeypatch.setattr(packing, "CALL_CHARS", 20)
    docs = ["a" * 10, "b" * 10, "c" * 5]
    assert [p.tolist() for p in packing._encode(TOK, docs)] == [ids(d) for d in docs]
    assert calls == [docs[:2], docs[2:]]


def rows_in_pieces(text, size=4000):
    """A text file's rows as the reader yields them for a file that is one document (test_readers
    checks that it does), with a whole short document before and after it."""
    parts = list(pieces.cut([text], size))
    n = len(parts)
    return {"text": np.array(["before", *parts, "after"], dtype=object),
            "starts": np.array([True] + [i == 0 for i in range(n)] + [True]),
            "ends": np.array([True] + [i == n - 1 for i in range(n)] + [True]),
            "key": np.array([b""] + [pieces.key(parts[0].encode())] * n + [b""], dtype=object)}


def pack_rows(rows, seq_len=16, model=None, **kwargs):
    return block_arrays(tokenize_and_pack(rows, seq_len=seq_len, model=model or ModelConfig(), text_column="text",
                                          pretokenized=False, **kwargs))


def test_a_document_read_in_pieces_packs_as_the_whole_document(llama_style):
    rows = rows_in_pieces(LONG)
    assert len(rows["text"]) > 20
    whole = pack(["before", LONG, "after"], position_ids="per_document")
    in_pieces = pack_rows(rows, position_ids="per_document")
    np.testing.assert_array_equal(in_pieces["input_ids"], whole["input_ids"])
    np.testing.assert_array_equal(in_pieces["position_ids"], whole["position_ids"])  # one document, not 40
    # a tokenizer with a BOS: one before the document, one EOS after it, none between its pieces
    letters = " ".join("abcdefghij"[i % 10] * (1 + i % 7) for i in range(3000))
    tok = load_tokenizer(llama_style)
    out = pack_rows(rows_in_pieces(letters), seq_len=1, model=llama_style)["input_ids"].flatten().tolist()
    assert out.count(tok.bos_token_id) == 3 and out.count(tok.eos_token_id) == 3  # before, the document, after
    # a row whose source has no such columns, in a batch with one that has (nulls): a whole document
    nulls = {"text": np.array(["abc", "de"], dtype=object), "starts": np.array([None, True], dtype=object),
             "ends": np.array([None, True], dtype=object), "key": np.array([None, b""], dtype=object)}
    assert pack_rows(nulls, seq_len=1)["input_ids"].flatten().tolist() == ids("abc") + [EOS] + ids("de") + [EOS]


def test_a_document_whose_pieces_fall_in_two_batches_continues_in_the_second():
    rows = rows_in_pieces(LONG)
    k = len(rows["text"]) // 2
    first, second = ({name: column[part] for name, column in rows.items()} for part in (slice(0, k), slice(k, None)))
    out1, out2 = pack_rows(first, position_ids="per_document"), pack_rows(second, position_ids="per_document")
    stream1 = ids("before") + [EOS] + ids("".join(first["text"][1:]))  # no EOS: the document goes on
    stream2 = ids("".join(second["text"][:-1])) + [EOS] + ids("after") + [EOS]
    for out, stream in ((out1, stream1), (out2, stream2)):
        n = len(stream) // 16
        assert out["input_ids"].flatten().tolist() == stream[: n * 16]  # each batch's own tail dropped
    assert out2["position_ids"][0].tolist() == list(range(16))  # a block start, not a document start


def test_every_piece_of_a_document_falls_on_its_side_of_the_eval_split():
    rows = rows_in_pieces(LONG)
    docs = [f"document number {i}" for i in range(200)]
    batch = {"text": np.array([*docs, *rows["text"]], dtype=object),
             "starts": np.array([True] * 200 + rows["starts"].tolist()),
             "ends": np.array([True] * 200 + rows["ends"].tolist()),
             "key": np.array([b""] * 200 + rows["key"].tolist(), dtype=object)}
    sides = {split: TOK.decode(pack_rows(batch, seq_len=1, split=split, eval_fraction=0.5)["input_ids"].flatten()
                               .tolist()) for split in ("train", "eval")}
    held_out = bool(packing._eval_side([pieces.key(rows["text"][1].encode())], 0.5)[0])
    assert (LONG in sides["eval"]) == held_out and (LONG in sides["train"]) != held_out  # whole, on one side
    assert 60 < sum(d + TOK.eos_token in sides["eval"] for d in docs) < 140
