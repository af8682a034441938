"""Where a long text is cut, so that its pieces tokenize to the whole text's ids, and a document's key.

Both Ray Data tasks use the one rule (`cut`): the reader (raytrain.data.readers) cuts a text file
that is one document (data.text_document="file") into rows as it streams the file, so no file sits
in a task's memory whole; the packer (raytrain.data.packing) cuts a long document it was given
whole (a JSON value, a parquet cell) before tokenizing it. A cut falls right after a lone newline
between two non-space characters, else right before a lone space between two: byte-level and
GPT-2/tiktoken-style pre-tokenizers split there anyway, so the pieces' ids joined are the whole
text's (the packer checks that per tokenizer, `packing._can_cut`). A text with no such place in
HARD_CUT pieces' length (CJK text with neither spaces nor lone newlines, a CRLF file without
spaces) is cut there anyway, at a character: the ids near that cut may differ from the whole
text's, which bounds the tokenizer's memory (~200 bytes per character it is given at once).
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Iterator

PIECE_CHARS = 1 << 16
"""A piece's length, about (from half of it to all of it; longer only where there is no place to cut)."""
HARD_CUT = 16
"""A piece with no place to cut is cut at HARD_CUT times the piece length (1 MiB characters at 64k)."""
LINE_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # right after a lone newline between two non-space characters
SPACE_CUT = re.compile(r"(?<=\S)(?= \S)")  # right before a lone space between two non-space characters


def cut(chunks: Iterable[str], size: int) -> Iterator[str]:
    """The text that `chunks` spell, in pieces of about `size` characters, each cut at the last lone
    newline of its window (size/2 to size), else its last lone space, else at the first place to cut
    after the window, else at HARD_CUT * size. The pieces are the same however the text is chunked:
    a cut found in what was read so far is also where the whole text would be cut."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        start = 0
        while len(buffer) - start > size:
            at = _last_cut(buffer, start + size // 2, start + size) or _next_cut(buffer, start + size,
                                                                              start + HARD_CUT * size)
            # `>`, not `>=`: a cut just before the hard one is seen only with the character after it
            if at is None and len(buffer) - start > HARD_CUT * size:
                at = start + HARD_CUT * size
            if at is None:
                break  # read on: the next cut may lie in the next chunk
            yield buffer[start:at]
            start = at
        buffer = buffer[start:]
    if buffer:
        yield buffer


def _last_cut(text: str, lo: int, hi: int) -> int | None:
    for pattern in (LINE_CUT, SPACE_CUT):
        at = None
        for found in pattern.finditer(text, lo, hi):
            at = found.start()
        if at:
            return at
    return None


def _next_cut(text: str, pos: int, end: int) -> int | None:
    """The first place to cut from `pos` to `end`; the space search stops at the first line cut (else
    a text with a newline every 70k characters and few spaces searched 1M characters at every cut)."""
    line = LINE_CUT.search(text, pos, end + 1)
    space = SPACE_CUT.search(text, pos, line.start() if line else end + 1)
    return space.start() if space else line.start() if line else None


def key(data: bytes) -> bytes:
    """A document's key for the eval split (raytrain.data.packing._eval_side): 8 bytes of blake2b.
    A text file read in pieces is keyed by its first piece, which every piece carries."""
    return hashlib.blake2b(data, digest_size=8).digest()
