"""raytrain.data.pieces: where a long text is cut, the same however it is read."""

import random

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
