"""raytrain.data.pieces: where a long text is cut, the same however it is read."""

import random

import pytest

from raytrain.data import pieces

SIZE = 4000
TEXT = ("".join(f"Line {i}: the quick brown fox, {i * 7} caf\u00e9s!\n" + ("  indented\n\n" if i % 5 == 0 else "")
                for i in range(2000))
        + "\u65e5\u672c\u8a9e\u30c6\u30ad\u30b9\u30c8" * 20000  # CJK: no space, no newline for 160k characters
        + " then words again," * 3000)


def chunked(text, sizes):
    start = 0
    while start < len(text):
        n = sizes()
        yield text[start:start + n]
        start += n


def test_pieces_are_the_same_however_the_text_is_read_and_join_to_it():
    whole = list(pieces.cut([TEXT], SIZE))
    assert "".join(whole) == TEXT and len(whole) > 30
    rng = random.Random(0)
    for sizes in (lambda: 1000, lambda: SIZE, lambda: 3 * SIZE + 1, lambda: rng.randint(1, 9000)):
        assert list(pieces.cut(chunked(TEXT, sizes), SIZE)) == whole
    # a piece ends before a non-space character, after a newline or before a space
    assert all(p[-1] == "\n" or nxt[0] == " " for p, nxt in zip(whole, whole[1:]) if len(p) <= SIZE)


def test_a_text_with_no_place_to_cut_is_cut_at_hard_cut_pieces_length():
    whole = list(pieces.cut([TEXT], SIZE))
    sizes = [len(p) for p in whole]
    long = [i for i, s in enumerate(sizes) if s > SIZE]  # the CJK run's 160k characters
    assert len(long) == 3 and sizes[long[0]] == sizes[long[1]] == pieces.HARD_CUT * SIZE
    assert whole[long[2]].endswith("\u30c8") and whole[long[2] + 1].startswith(" then")  # to its first space
    assert all(SIZE // 2 <= s for s in sizes[:-1])


def test_a_cut_just_before_the_hard_cut_is_found_whatever_chunk_ends_there():
    """A chunk that ended exactly at the hard cut hid the space before it (it needs the character after)."""
    hard = pieces.HARD_CUT * 4
    text = "a" * (hard - 1) + " " + "b" * 10
    assert [len(p) for p in pieces.cut([text], 4)] == [hard - 1, 11]
    assert list(pieces.cut([text[:hard], text[hard:]], 4)) == list(pieces.cut([text], 4))


def test_a_short_text_is_one_piece():
    assert list(pieces.cut(["short ", "text"], SIZE)) == ["short text"]
    assert list(pieces.cut([], SIZE)) == []


HARD = pieces.HARD_CUT * 4  # the hard cut for pieces of 4 characters


@pytest.mark.parametrize("text, lengths", [
    ("ab c", [4]),  # a text of exactly the piece's length is not cut
    ("a bcdef gh", [7, 3]),  # not in the window's first half: no piece is shorter than half the size
    ("a" * 10 + "\n" + "b" * 5 + " c", [11, 5, 2]),  # after the window, the first place to cut: a line...
    ("a" * 10 + " " + "b" * 5 + "\nc", [10, 7, 1]),  # ... or a space
    ("a" * (HARD - 2) + "\n" + "b" * 10, [HARD - 1, 10]),  # a line cut just before the hard cut is found
    ("a" * HARD + "\nb", [HARD, 2]),  # one just after it is not: no piece is longer than the hard cut
], ids=["exactly one piece", "no short piece", "line after the window", "space after the window",
        "line before the hard cut", "line after the hard cut"])
def test_where_a_piece_past_its_window_is_cut(text, lengths):
    whole = list(pieces.cut([text], 4))
    assert [len(p) for p in whole] == lengths and "".join(whole) == text
    assert list(pieces.cut(text, 4)) == whole  # read a character at a time


def test_a_documents_key_is_8_bytes_of_its_blake2b_and_stable():
    # The eval split (packing._eval_side) is drawn from the key: the same text must land on the same side
    # in every run and release.
    assert pieces.key(b"a document") == bytes.fromhex("7cc11abfa1ce1dff")
    assert pieces.key(b"another document") != pieces.key(b"a document")
