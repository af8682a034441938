"""One long text document through raytrain.data.packing.tokenize_and_pack: tokenized in pieces (the
default since session 42) against whole (pieces.PIECE_CHARS raised past the document), each in a fresh
process: seconds and the process's peak RSS, and whether both give the same ids. The document is a
seeded random text of short words and lines (what a text file under data.text_document="file" is),
the tokenizer raytrain's default (model.tokenizer unset: the built-in byte-level one).

    python benchmarks/long_document.py --mib 10

Prints one line per variant; docs/status.md #12 (session 42) quotes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import subprocess
import sys
import time


def child(mib: float, whole: bool) -> None:
    import numpy as np

    from raytrain.config import ModelConfig
    from raytrain.data import packing, pieces

    words = "the quick brown fox jumps over a lazy dog and cat".split()
    rng = random.Random(0)
    lines, size = [], 0
    while size < mib * 2**20:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(line)
        size += len(line) + 1
    text = "\n".join(lines)
    if whole:
        pieces.PIECE_CHARS = len(text) + 1
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = packing.block_arrays(packing.tokenize_and_pack({"text": np.array([text], dtype=object)}, seq_len=128,
                                                         model=ModelConfig(), text_column="text", pretokenized=False))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"chars": len(text), "seconds": round(seconds, 1), "peak_rss_mib": peak // 1024,
                      "rss_before_mib": base // 1024, "blocks": int(out["input_ids"].shape[0]),
                      "ids_sha1": hashlib.sha1(out["input_ids"].tobytes()).hexdigest()[:12]}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=10)
    parser.add_argument("--child", choices=("pieces", "whole"))
    args = parser.parse_args()
    if args.child:
        child(args.mib, args.child == "whole")
        return 0
    results = {}
    for variant in ("pieces", "whole"):
        p = subprocess.run([sys.executable, __file__, "--mib", str(args.mib), "--child", variant],
                           capture_output=True, text=True, check=True)
        results[variant] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{variant}: {json.dumps(results[variant])}")
    print("same ids:", results["pieces"]["ids_sha1"] == results["whole"]["ids_sha1"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
