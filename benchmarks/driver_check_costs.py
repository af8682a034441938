"""What the driver-side input checks of session 39 cost, and the per-row cost of raytrain's parquet reader.

    python benchmarks/driver_check_costs.py [--files N]

Prints, on this machine, without Ray:
- `inspect_source` over N local JSON-lines files (every file's first record is read): ms per file;
- `_refuse_duplicates` over N local files (one stat each): us per file;
- the meta-device build that compares a pretrained model's weights before and after model.config
  overrides (raytrain.model.weight_shapes), for a Llama-70B-shaped config: seconds, first (uncached) call;
- `readers.read_parquet_rows` over one local file of short text rows and one of 500-id rows: us per row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    args = parser.parse_args()

    import numpy as np
    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq
    from transformers import LlamaConfig

    from raytrain.config import load_config
    from raytrain.data import sources
    from raytrain.data.readers import read_parquet_rows
    from raytrain.model import weight_shapes

    directory = tempfile.mkdtemp(prefix="driver-check-costs-")
    try:
        for i in range(args.files):
            with open(os.path.join(directory, f"part-{i:05d}.jsonl"), "w") as f:
                f.write('{"text": "a document of a few words"}\n' * 20)
        data = load_config(None, [f"data.path={directory}"]).data
        t = time.perf_counter()
        source = sources.inspect_source(data, data.path)
        s = time.perf_counter() - t
        print(f"inspect_source, {args.files} local JSON files: {s:.2f} s, {s / args.files * 1e3:.3f} ms per file")
        t = time.perf_counter()
        sources._refuse_duplicates(source.files, "data.path")
        s = time.perf_counter() - t
        print(f"_refuse_duplicates, {args.files} local files: {s * 1e3:.1f} ms, {s / args.files * 1e6:.1f} us per file")

        config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=128256)
        t = time.perf_counter()
        weight_shapes(config)
        print(f"weight_shapes, Llama-70B config on the meta device: {time.perf_counter() - t:.2f} s")

        fs = pyarrow.fs.LocalFileSystem()
        for name, column, table in (
                ("short text rows", "text", pa.table({"text": [f"document {j}" for j in range(200_000)]})),
                ("500-id rows", "input_ids", pa.table({"input_ids": pa.array(
                    [np.arange(500, dtype=np.int64)] * 20_000, pa.list_(pa.int64()))}))):
            path = os.path.join(directory, f"{column}.parquet")
            pq.write_table(table, path)
            t = time.perf_counter()
            rows = sum(1 for _ in read_parquet_rows({"path": path}, filesystem=fs, column=column,
                                                    pretokenized=column == "input_ids"))
            s = time.perf_counter() - t
            print(f"read_parquet_rows, {rows:,} {name}: {s:.2f} s, {s / rows * 1e6:.1f} us per row")
    finally:
        shutil.rmtree(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
