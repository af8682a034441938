"""The Ray Data task that tokenizes documents and packs them into fixed-length blocks.

Start at `tokenize_and_pack`. Packing policy: each document starts with the tokenizer's BOS where
it adds one (Llama, Mistral and Gemma tokenizers, as Hugging Face's own training tokenizes; GPT-2's
and the byte tokenizer add none) and ends with one EOS; documents are joined and cut into blocks of
exactly `seq_len` tokens; a document longer than seq_len continues in the next block (never dropped).
Packing is done per tokenization batch (`data.tokenize_batch_size` rows: documents, or pieces of
a text file that is one document, see below); the leftover tail
of each batch (< seq_len tokens) is dropped, which costs on average seq_len / 2 tokens per batch
(about 0.1% with 256 documents of 1k tokens at seq_len 2048, but all of a batch holding fewer than
seq_len tokens). The dropped tokens are counted and printed at the end of the run
(raytrain.data.progress). Carrying a tail into the next batch would need one
stateful packer per stream: with parallel tokenize tasks, which tail joined which batch would
differ from run to run, and exact resume (raytrain.data.ingest) needs the same blocks every run.
A text file that is one document (data.text_document="file") arrives as rows of pieces of about
64k characters (raytrain.data.readers, cut as raytrain.data.pieces says), each saying whether the
document starts or ends there: one BOS before its first piece, one EOS after its last, per-document
positions that run on across pieces, and one side of the eval split (its first piece's). A piece
whose successor falls in the next batch ends this batch (the tail dropped as any batch's); the
next batch goes on with the same document. Any other long document (a JSON value, a parquet cell)
is cut into such pieces here. Either way the pieces' ids joined are the whole document's (checked
once per tokenizer on a probe text: byte-level and GPT-2/tiktoken-style pre-tokenizers split there
anyway), except at a hard cut (no place to cut in 1M characters, raytrain.data.pieces). A tokenizer that adds a prefix space to every call, as SentencePiece's legacy Llama
tokenizers do, is not cut here; a text file's pieces it tokenizes one by one, so such a document
gets one extra prefix-space token per piece (~1 in 16k tokens): the price of not holding the file.
Whole, the tokenizer held ~200 bytes per input character (its encodings' offsets and strings):
2 GB for a 10 MB file; in pieces, tokenizer calls of at most 1M characters hold ~200 MB (benchmarks/long_document.py).
Text that spells a special token ("</s>") stays text, tokenized as its characters
(split_special_tokens), never as the control token. With
`data.position_ids="per_document"` each row also carries `position_ids` that restart at 0 after
every EOS and at every block start (a block is all the context the model sees).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from raytrain.config import ModelConfig
from raytrain.data import pieces
from raytrain.data.bad_records import BadRecord, BadRecords
from raytrain.data.progress import report, skipped
from raytrain.model import document_start_ids, load_tokenizer

logger = logging.getLogger("raytrain.data")

_skipped_in_process = {"total": 0, "unreported": 0, "last_report": 0.0}
_REPORT_EVERY_S = 30.0


def _report_skipped_rows(n: int, batch_size: int, counter: str | None) -> None:
    """Count empty rows: to the run's counter (reported once per run), else logged (the first at
    once, then running totals at most every 30 s)."""
    if counter is not None:
        skipped(counter, empty=n)
        return
    state = _skipped_in_process
    state["total"] += n
    state["unreported"] += n
    now = time.monotonic()
    if state["last_report"] == 0.0 or now - state["last_report"] >= _REPORT_EVERY_S:
        logger.warning("raytrain data: skipped %d empty documents (null or \"\") since the last report, "
                       "%d in this process so far (latest batch: %d of %d)",
                       state["unreported"], state["total"], n, batch_size)
        state["unreported"], state["last_report"] = 0, now


def tokenize_and_pack(batch: dict[str, np.ndarray], *, seq_len: int, model: ModelConfig, text_column: str,
                      pretokenized: bool, position_ids: str = "packed", split: str | None = None,
                      eval_fraction: float = 0.0, vocab_size: int | None = None,
                      progress: str | None = None, counter: str | None = None):
    """One Ray Data batch of documents -> blocks of seq_len token ids (see the packing policy above).

    `split` "train"/"eval" keeps the documents on that side of `eval_fraction` (by content hash);
    `vocab_size` (the model's embedding rows) makes any token id beyond it a bad record, not a crash
    on GPU; `progress` (the run's counter actor, training data only) gets the batch's rows,
    documents and tokens (BOS and EOS included); `counter` (the run's counter actor) the skipped documents
    and the bad records (raytrain.data.bad_records: without it, a bad record raises).

    Returns a table of n rows with "input_ids" (and "position_ids"), each int32[seq_len], in Ray
    Data's tensor type, built here rather than by Ray Data from arrays: a batch with fewer than
    seq_len tokens has zero rows, and Ray Data cannot convert a zero-row 2-D array to its tensor
    type; it fell back to pickled Python objects ("Failed to convert column 'input_ids' into
    pyarrow array"), a slow path and a second block type in one dataset.
    """
    tokenizer = load_tokenizer(model)  # cached per Ray worker process
    eos = tokenizer.eos_token_id
    bos = list(document_start_ids(tokenizer))  # the BOS, or nothing (cached per tokenizer)
    start = np.asarray(bos, np.int64)
    bad = BadRecords(counter)
    column = "input_ids" if pretokenized else text_column
    num_rows = len(next(iter(batch.values()))) if batch else 0
    if column not in batch:
        if num_rows:  # (an empty block has no columns at all)
            _bad_batch(bad, num_rows, f"data.text_column={column!r} is not a column of the data "
                                      f"(columns: {', '.join(batch)})", "set data.text_column")
        return _no_blocks(seq_len, position_ids)
    values = batch[column]
    if pretokenized:
        kept = [i for i, v in enumerate(values) if v is not None and len(v)]
        docs = [np.asarray(values[i], dtype=np.int64) for i in kept]
    else:
        texts = values.tolist()
        kept = [i for i, v in enumerate(texts) if v is not None and v != ""]
        docs = [texts[i] for i in kept]
        wrong = [v for v in docs if not isinstance(v, str)]
        if wrong:
            _bad_batch(bad, len(wrong), f"data.text_column={column!r} holds {type(wrong[0]).__name__} values, "
                                        f"not strings", "set data.text_column to the text column")
            return _no_blocks(seq_len, position_ids)
    if len(docs) < len(values):
        _report_skipped_rows(len(values) - len(docs), len(values), counter)
    # A text file read in pieces (raytrain.data.readers) has a row per piece, saying whether the
    # document starts (BOS) or ends (EOS) there, each with the document's key; any other row is a
    # whole document. Order is kept (ShardedIngest's preserve_order), so a piece follows the one
    # before it, in this batch or at the end of the one before.
    starts, ends = _column(batch, "starts", kept, True), _column(batch, "ends", kept, True)
    if split:
        given = _column(batch, "key", kept, b"")
        keys = [k or pieces.key(d.tobytes() if pretokenized else d.encode("utf-8", errors="surrogatepass"))
                for d, k in zip(docs, given)]
        keep = _eval_side(keys, eval_fraction) == (split == "eval")
        docs, starts, ends = ([x for x, k in zip(column_, keep) if k] for column_ in (docs, starts, ends))
    if not pretokenized:
        docs = _encode(tokenizer, docs)
    parts, lengths = [], []
    end = np.array([eos], np.int64)
    for j, d in enumerate(docs):  # one concatenate for the batch, not one per document
        # Pre-tokenized documents may hold their BOS and EOS already (tokenized with special tokens): not doubled.
        head = starts[j] and start.size and not (pretokenized and d[:start.size].tolist() == bos)
        tail = ends[j] and not (pretokenized and len(d) and d[-1] == eos)
        if head:
            parts.append(start)
        parts.append(d)
        if tail:
            parts.append(end)
        length = len(d) + (start.size if head else 0) + tail
        if not starts[j] and j and not ends[j - 1]:
            lengths[-1] += length  # the document's next piece
        else:
            lengths.append(length)
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if vocab_size is not None and flat.size and (flat.max() >= vocab_size or flat.min() < 0):
        worst = int(flat.max() if flat.max() >= vocab_size else flat.min())
        outside = sum(1 for d in docs if d.size and (d.max() >= vocab_size or d.min() < 0))
        fix = ("the data was tokenized with another vocabulary: re-tokenize it with model.tokenizer"
               if pretokenized else "set model.config.vocab_size >= len(tokenizer) or use the model's own tokenizer")
        _bad_batch(bad, outside, f"token id {worst} is outside the model's embedding table ({vocab_size} rows)", fix)
        return _no_blocks(seq_len, position_ids)
    report(progress, rows=len(values), documents=int(sum(starts)), tokens=int(flat.size))
    n_blocks = len(flat) // seq_len
    # What the end-of-run line says is dropped, and of how much (one fire-and-forget actor call per
    # batch; no counter in tests and the bench: not told).
    skipped(counter, tail_tokens=len(flat) - n_blocks * seq_len, packed_tokens=len(flat))
    out = {"input_ids": flat[: n_blocks * seq_len].reshape(n_blocks, seq_len).astype(np.int32)}
    if position_ids == "per_document":
        out["position_ids"] = document_positions(np.asarray(lengths, np.int64), n_blocks * seq_len, seq_len)
    return _table(out)


CALL_CHARS = 1 << 20
"""Characters per tokenizer call, at most, as a piece is (pieces.HARD_CUT * PIECE_CHARS); longer only for
a document whose tokenizer cannot be cut (`_can_cut`), given whole."""
_PROBE = ("Hello world.\nThe 2nd line, 12345 numbers; caf\u00e9 na\u00efve!\n\u65e5\u672c\u8a9e "
          "\u30c6\u30ad\u30b9\u30c8 (x) don't\nend")
_cuts_keep_ids: dict[int, bool] = {}


def _encode(tokenizer, docs: list[str]) -> list[np.ndarray]:
    """Each document's token ids (no special tokens), long documents in pieces (raytrain.data.pieces),
    in tokenizer calls of at most CALL_CHARS characters."""
    size = pieces.PIECE_CHARS
    size = size if any(len(d) > size for d in docs) and _can_cut(tokenizer) else None
    parts, owner = [], []
    for i, d in enumerate(docs):
        for piece in pieces.cut((d,), size) if size else (d,):
            parts.append(piece)
            owner.append(i)
    ids: list[list[np.ndarray]] = [[] for _ in docs]
    start = 0
    while start < len(parts):
        end, chars = start + 1, len(parts[start])
        while end < len(parts) and chars + len(parts[end]) <= CALL_CHARS:
            chars, end = chars + len(parts[end]), end + 1
        for i, encoded in zip(owner[start:end], _tokenize(tokenizer, parts[start:end])):
            ids[i].append(np.asarray(encoded, dtype=np.int64))
        start = end
    return [p[0] if len(p) == 1 else np.concatenate(p) for p in ids]


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    # return_attention_mask=False: the mask is all ones here and building it costs ~half the time.
    # add_special_tokens=False: the BOS is `start`, put below; a template's EOS would double the packer's.
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False,
                     split_special_tokens=True)["input_ids"]


def _can_cut(tokenizer) -> bool:
    """Whether pieces cut as `pieces.cut` cuts give the whole text's ids: checked once per tokenizer
    (load_tokenizer caches them per process) by tokenizing a probe at every cut point."""
    key = id(tokenizer)
    if key not in _cuts_keep_ids:
        cuts = sorted({0, len(_PROBE), *(m.start() for p in (pieces.LINE_CUT, pieces.SPACE_CUT)
                                         for m in p.finditer(_PROBE))})
        joined = [i for ids in _tokenize(tokenizer, [_PROBE[a:b] for a, b in zip(cuts, cuts[1:])]) for i in ids]
        _cuts_keep_ids[key] = joined == _tokenize(tokenizer, [_PROBE])[0]
    return _cuts_keep_ids[key]


def _column(batch: dict[str, np.ndarray], name: str, kept: list[int], default) -> list:
    """Column `name` of the kept rows; `default` where the batch has no such column, or a null (a
    row whose source has no such column, in a batch with one that has)."""
    values = batch.get(name)
    return [default if values is None or values[i] is None else values[i] for i in kept]


def _bad_batch(bad: BadRecords, n: int, what: str, fix: str) -> None:
    """`n` bad documents in one batch of a row source (no file or line to name): the first one
    reported (or raised, outside a run), the others counted."""
    bad.found(BadRecord(None, what, fix), more=n - 1)
    bad.close()


def _no_blocks(seq_len: int, position_ids: str):
    """Zero rows of the output's columns (a batch that yields no block, or a bad one)."""
    empty = np.zeros((0, seq_len), np.int32)
    return _table({"input_ids": empty, **({"position_ids": empty} if position_ids == "per_document" else {})})


def _table(columns: dict[str, np.ndarray]):
    """int32[n, seq_len] arrays -> a pyarrow table of Ray Data's tensor type (zero-copy)."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    return pa.table({name: ArrowTensorArray.from_numpy(array) for name, array in columns.items()})


def block_arrays(table) -> dict[str, np.ndarray]:
    """tokenize_and_pack's table back as int32[n, seq_len] arrays (tests, the data benchmark)."""
    return {name: np.concatenate([chunk.to_numpy() for chunk in table.column(name).chunks])
            for name in table.column_names}


def document_positions(lengths: np.ndarray, num_tokens: int, seq_len: int) -> np.ndarray:
    """int32[num_tokens // seq_len, seq_len]: each token's offset from the later of its document's
    start and its block's start (documents given by `lengths`, BOS and EOS included)."""
    doc_start = np.repeat(np.cumsum(lengths) - lengths, lengths)[:num_tokens]
    index = np.arange(num_tokens)
    block_start = index - index % seq_len
    return (index - np.maximum(doc_start, block_start)).astype(np.int32).reshape(-1, seq_len)


def _eval_side(keys: list[bytes], eval_fraction: float) -> np.ndarray:
    """True for documents in the held-out fraction: each key (raytrain.data.pieces.key) as a uniform number."""
    threshold = eval_fraction * 2.0**64
    return np.array([int.from_bytes(k, "little") < threshold for k in keys], dtype=bool)
