"""Write a user's own data in the formats raytrain reads, and a BPE tokenizer, for a run on a GPU host
(benchmarks/gpu_x1.sh files1b): the same generated documents as JSONL files, CSV files and one large text file.

    python benchmarks/user_files.py OUT [--mib 64] [--vocab-size 8192]

OUT/jsonl/part-*.jsonl   {"text": ...} per line, 8 files
OUT/csv/part-*.csv       header "id,text", 4 files (values with commas quoted)
OUT/one.txt              every document joined by blank lines: one document under data.text_document=file,
                         read in ~64k-character pieces (raytrain/data/pieces.py)
OUT/tokenizer/           a byte-level BPE tokenizer trained on a quarter of the documents (AutoTokenizer loads it)

The documents are raytrain.tools.bench_data's Zipf-distributed made-up words (~5 bytes per BPE token, like
English). Prints what it wrote.
"""

from __future__ import annotations

import csv
import json
import os
import sys

from raytrain.console import ArgumentParser
from raytrain.tools.bench_data import generate_corpus, train_bpe


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--mib", type=float, default=64.0, help="text per format")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    docs = generate_corpus(int(args.mib * 2**20))
    for sub in ("jsonl", "csv"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    for i in range(8):
        with open(os.path.join(args.out, "jsonl", f"part-{i}.jsonl"), "w", encoding="utf-8") as f:
            for doc in docs[i::8]:
                f.write(json.dumps({"text": doc}) + "\n")
    for i in range(4):
        with open(os.path.join(args.out, "csv", f"part-{i}.csv"), "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "text"])
            for j, doc in enumerate(docs[i::4]):
                writer.writerow([j, doc])
    with open(os.path.join(args.out, "one.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(docs))
    train_bpe(docs, os.path.join(args.out, "tokenizer"), vocab_size=args.vocab_size)
    print(f"user_files: {len(docs):,} documents, {sum(map(len, docs)) / 2**20:.0f} MiB of text per format, "
          f"in {args.out}/jsonl, csv, one.txt; BPE tokenizer ({args.vocab_size}) in {args.out}/tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
