"""`python -m raytrain.tools.bench_data` as a user runs it, on a tiny corpus: its own local Ray cluster,
the three Ray Data pipelines and the worker's reader, with numbers that add up (the byte tokenizer
makes one token per byte, and every pipeline packs the same corpus)."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_bench_data_prints_every_table_with_consistent_numbers():
    p = subprocess.run([sys.executable, "-m", "raytrain.tools.bench_data", "--mib", "0.2", "--seq-len", "128",
                        "--num-cpus", "3", "--micro-batch", "8", "--step-ms", "1"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    mib = float(re.search(r"corpus: [\d,]+ documents, ([\d.]+) MiB", p.stdout).group(1))
    rows = dict(re.findall(r"^\| (tokenize\+pack, byte tokenizer|tokenize\+pack, BPE 8k \(AutoTokenizer\)|"
                           r"pre-tokenized parquet) \| ([\d,]+) \| [\d,]+ \| [\d,]+ \| [\d.]+ \| [\d.]+ \|$", p.stdout, re.M))
    tokens = {name: int(n.replace(",", "")) for name, n in rows.items()}
    assert len(tokens) == 3, p.stdout
    # one token per byte (+ EOS per document), less each batch's dropped tail: about the corpus size
    assert 0.9 * mib * 2**20 < tokens["tokenize+pack, byte tokenizer"] < 1.1 * mib * 2**20, (mib, tokens)
    # the BPE corpus packs to the same blocks whether tokenized in Ray Data or read pre-tokenized
    assert tokens["pre-tokenized parquet"] == pytest.approx(tokens["tokenize+pack, BPE 8k (AutoTokenizer)"], rel=0.05)
    readers = re.findall(r"^\| (raytrain MicroBatches[^|]*|Ray iter_torch_batches[^|]*) \| \d+ \| (\d+) \|", p.stdout, re.M)
    assert len(readers) == 3 and all(int(n) > 0 for _, n in readers), p.stdout
