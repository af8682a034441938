"""The built-in corpus: generated, so nothing is downloaded; structured, so the loss visibly falls."""

from __future__ import annotations

import random

_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
_THINGS = ["apples", "books", "coins", "stones", "shells", "cards", "pens", "cups"]
_COLORS = ["red", "blue", "green", "yellow", "black", "white"]


def builtin_corpus(num_documents: int, seed: int) -> list[str]:
    """Short stories with counting and addition: learnable structure for a tiny model."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            a, b = rng.sample(_NAMES, 2)
            x, y = rng.randint(1, 9), rng.randint(1, 9)
            color, thing = rng.choice(_COLORS), rng.choice(_THINGS)
            sentences.append(f"{a} has {x} {color} {thing}. {b} has {y} {color} {thing}. "
                             f"together {a} and {b} have {x + y} {color} {thing}.")
        docs.append(" ".join(sentences))
    return docs

