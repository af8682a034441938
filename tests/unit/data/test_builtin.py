"""The built-in pieces that need no download: the byte tokenizer (raytrain.model) and the generated
corpus (raytrain.data.builtin)."""

from raytrain.config import ModelConfig
from raytrain.data.builtin import builtin_corpus
from raytrain.model import load_tokenizer

TOK = load_tokenizer(ModelConfig())


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_byte_tokenizer_round_trips_any_text():
    text = "naïve café — 3 + 4 = 7 ✓"
    assert TOK.decode(ids(text)) == text
    assert len(TOK) == 257


def test_builtin_corpus_is_deterministic_and_structured():
    a, b = builtin_corpus(50, seed=1), builtin_corpus(50, seed=1)
    assert a == b and a != builtin_corpus(50, seed=2)
    assert all("together" in d for d in a)
