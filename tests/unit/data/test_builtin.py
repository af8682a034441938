"""The built-in pieces that need no download: the byte tokenizer (raytrain.model) and the generated
corpus (raytrain.data.builtin)."""

import re

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


# One sentence group: "a has x c t. b has y c t. together a and b have x+y c t.", groups joined by a space.
STORY = re.compile(r"(\w+) has (\d+) (\w+) (\w+)\. (\w+) has (\d+) \3 \4\. "
                   r"together \1 and \5 have (\d+) \3 \4\.(?: |$)")


def test_builtin_stories_add_two_different_peoples_single_digit_counts():
    sentences_per_doc, firsts, seconds = set(), set(), set()
    for doc in builtin_corpus(200, seed=0):
        stories = STORY.findall(doc)
        assert STORY.sub("", doc) == "", doc  # nothing but such stories
        assert all(a != b and int(x) + int(y) == int(total) for a, x, _, _, b, y, total in stories), doc
        sentences_per_doc.add(len(stories))
        firsts |= {int(story[1]) for story in stories}
        seconds |= {int(story[5]) for story in stories}
    assert sentences_per_doc == {2, 3, 4, 5} and firsts == seconds == set(range(1, 10))
