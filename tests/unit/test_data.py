"""Packing and the built-in corpus (pure functions; Ray Data runs them in the integration tests)."""

import numpy as np
import pytest

from raytrain.config import ConfigError, DataConfig, ModelConfig
from raytrain.data import builtin_corpus, resolve_format, tokenize_and_pack
from raytrain.model import load_tokenizer


def pack(texts, seq_len=16):
    return tokenize_and_pack({"text": np.array(texts, dtype=object)}, seq_len=seq_len, model=ModelConfig(),
                             text_column="text", pretokenized=False)["input_ids"]


def test_packing_joins_documents_with_eos_and_cuts_exact_blocks():
    tok = load_tokenizer(ModelConfig())
    docs = ["hello world", "a" * 40, "xyz"]
    blocks = pack(docs)
    stream = []
    for d in docs:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert blocks.shape == (len(stream) // 16, 16)
    assert blocks.flatten().tolist() == stream[: blocks.size]  # long document split across blocks, order kept
    assert (blocks == tok.eos_token_id).sum() == stream[: blocks.size].count(tok.eos_token_id) >= 1
    assert len(stream) - blocks.size < 16  # only the tail shorter than one block is dropped


def test_empty_documents_are_skipped_and_pretokenized_input_is_packed_as_is():
    assert pack(["", ""]).shape == (0, 16)
    ids = np.array([np.arange(10), np.arange(10, 30)], dtype=object)
    out = tokenize_and_pack({"input_ids": ids}, seq_len=8, model=ModelConfig(), text_column="text",
                            pretokenized=True)["input_ids"]
    eos = load_tokenizer(ModelConfig()).eos_token_id
    assert out.flatten().tolist() == list(range(10)) + [eos] + list(range(10, 30)) + [eos]  # 32 = 4 blocks


def test_byte_tokenizer_round_trips_any_text():
    tok = load_tokenizer(ModelConfig())
    text = "naïve café — 3 + 4 = 7 ✓"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tok) == 257


def test_builtin_corpus_is_deterministic_and_structured():
    a, b = builtin_corpus(50, seed=1), builtin_corpus(50, seed=1)
    assert a == b and a != builtin_corpus(50, seed=2)
    assert all("together" in d for d in a)


def test_format_detection(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    assert resolve_format(DataConfig(path=str(tmp_path / "a.jsonl"))) == "json"
    assert resolve_format(DataConfig(path=str(tmp_path))) == "json"
    (tmp_path / "b.bin").write_text("x")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        resolve_format(DataConfig(path=str(tmp_path / "b.bin")))
    with pytest.raises(ConfigError, match="data.format must be"):
        resolve_format(DataConfig(format="csv"))
