"""One large text file that is one document (data.text_document="file"), or one JSON file holding
one array of records (--format json), read and packed as a training run's Ray Data tasks do, each
variant in a fresh process: seconds, the process's peak RSS, the blocks and the tokens they hold.

- "one row" (text): the file decoded whole into one row, as raytrain's reader did before session
  44, then `tokenize_and_pack` on that row (which tokenizes it in pieces since session 42);
- "whole array" (json): the file decoded whole and parsed by json.loads, as the reader did before
  session 44, its records' texts then packed in batches;
- "rows in pieces" / "records": `read_documents`' rows (text: a row per ~64k-character piece; json:
  a record at a time, since session 44), in batches of data.tokenize_batch_size (256) rows, each
  through `tokenize_and_pack`.

In a run the reader and the packer are separate Ray Data tasks; here one process runs both, so its
peak is at least either task's. The file is seeded short words and lines, the tokenizer raytrain's
default (model.tokenizer unset: the built-in byte-level one, a token per byte), seq_len 2048.

    python benchmarks/large_text_file.py --mib 512
    python benchmarks/large_text_file.py --mib 512 --format json

Prints one line per variant; docs/benchmarks.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time


def write(path: str, mib: float, fmt: str) -> None:
    """Seeded lines of short words; json: an array of records of ~20 such lines each."""
    words = "the quick brown fox jumps over a lazy dog and cat".split()
    rng = random.Random(0)
    size, record, records = 0, [], 0
    with open(path, "w") as f:
        f.write("[" if fmt == "json" else "")
        while size < mib * 2**20:
            line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "\n"
            if fmt == "text":
                f.write(line)
            elif len(record) < 20:
                record.append(line)
            else:
                f.write(("," if records else "") + json.dumps({"id": records, "text": "".join(record)}) + "\n")
                record, records = [], records + 1
            size += len(line)
        f.write("]" if fmt == "json" else "")


def child(path: str, variant: str, seq_len: int, batch_rows: int, fmt: str) -> None:
    import numpy as np
    import pyarrow.fs as pafs

    from raytrain.config import ModelConfig
    from raytrain.data import packing
    from raytrain.data.readers import read_documents

    def pack(batch):
        return packing.block_arrays(packing.tokenize_and_pack(batch, seq_len=seq_len, model=ModelConfig(),
                                                              text_column="text", pretokenized=False))["input_ids"]

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    blocks = rows = 0
    if variant == "one row":
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        rows, blocks = 1, len(pack({"text": np.array([text], dtype=object)}))
    elif variant == "whole array":
        with open(path, "rb") as f:
            texts = [record["text"] for record in json.loads(f.read().decode("utf-8"))]
        rows = len(texts)
        for i in range(0, rows, batch_rows):
            blocks += len(pack({"text": np.array(texts[i:i + batch_rows], dtype=object)}))
    else:
        batch: list[dict] = []
        for row in read_documents({"path": path}, format=fmt, filesystem=pafs.LocalFileSystem(),
                                  text_column="text", text_document="file", invalid_utf8="replace"):
            batch.append(row)
            rows += 1
            if len(batch) == batch_rows:
                blocks += len(pack(_columns(batch, np)))
                batch = []
        if batch:
            blocks += len(pack(_columns(batch, np)))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows": rows, "seconds": round(seconds, 1), "peak_rss_mib": peak // 1024,
                      "rss_before_mib": base // 1024, "blocks": blocks, "tokens": blocks * seq_len}))


def _columns(rows: list[dict], np) -> dict:
    """Rows -> the numpy batch Ray Data's map_batches(batch_format="numpy") hands the packer."""
    out = {"text": np.array([r["text"] for r in rows], dtype=object)}
    if "starts" in rows[0]:
        out["starts"] = np.array([r["starts"] for r in rows])
        out["ends"] = np.array([r["ends"] for r in rows])
        out["key"] = np.array([r["key"] for r in rows], dtype=object)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-rows", type=int, default=256, help="data.tokenize_batch_size")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--variants", help="default: one row,rows in pieces (text); whole array,records (json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.path, args.child, args.seq_len, args.batch_rows, args.format)
        return 0
    variants = args.variants or ("one row,rows in pieces" if args.format == "text" else "whole array,records")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "book.txt" if args.format == "text" else "records.json")
        write(path, args.mib, args.format)
        print(f"file: {os.path.getsize(path) / 2**20:.0f} MiB")
        for variant in variants.split(","):
            p = subprocess.run([sys.executable, __file__, "--child", variant, "--path", path, "--seq-len",
                                str(args.seq_len), "--batch-rows", str(args.batch_rows), "--format", args.format],
                               capture_output=True, text=True)
            last = (p.stdout.strip().splitlines() or [""])[-1]
            print(f"{variant}: {last if p.returncode == 0 else f'exit {p.returncode}: {p.stderr.strip()[-300:]}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
