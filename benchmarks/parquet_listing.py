"""What reading parquet costs per epoch: Ray Data's read_parquet against raytrain's reader (one task
per file, raytrain.data.readers.read_parquet_rows, which makes a damaged file one bad record).

    python benchmarks/parquet_listing.py [--files N] [--rows R] [--epochs E] [--num-cpus C]

Starts a local Ray cluster (no dashboard), writes N parquet files of R short text rows, then for each
variant reads them as one dataset and iterates it E times, printing per epoch the seconds, the rows
per second and the FooterReader actors started so far (from the GCS's actor table: dead ones count
too; Ray's reader lists the files' footers on a pool of them, 32 unless
RAY_DATA_PARQUET_FOOTER_NUM_ACTORS says otherwise, at every execution). Both variants run in the
same cluster, Ray's first; the first epoch of the first variant also warms the worker pool.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=4)
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq
    import ray
    import ray.data
    from ray._private import state

    from raytrain.data.readers import read_parquet_rows

    directory = tempfile.mkdtemp(prefix="parquet-listing-")
    files = []
    for i in range(args.files):
        files.append(os.path.join(directory, f"part-{i:04d}.parquet"))
        pq.write_table(pa.table({"text": [f"document {i} {j}" for j in range(args.rows)]}), files[-1])
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False

    def footer_readers() -> int:
        return sum("FooterReader" in a["ActorClassName"] for a in state.actors().values())

    def raytrains():  # as raytrain.data.pipeline builds it
        ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=len(files))
        return ds.flat_map(read_parquet_rows, fn_kwargs={"filesystem": pyarrow.fs.LocalFileSystem(),
                                                         "column": "text", "pretokenized": False})

    print(f"{args.files} files of {args.rows:,} rows, {args.epochs} epochs, a local cluster of {args.num_cpus} CPUs")
    print("| variant | epoch | s | rows/s | FooterReader actors started |\n| --- | ---: | ---: | ---: | ---: |")
    variants = [("Ray's ray.data.read_parquet", lambda: ray.data.read_parquet(files)),
                ("raytrain (data.readers.read_parquet_rows)", raytrains)]
    for name, read in variants:
        start_count = footer_readers()
        ds = read()
        for epoch in range(args.epochs):
            t = time.perf_counter()
            rows = sum(len(batch["text"]) for batch in ds.iter_batches())
            assert rows == args.rows * args.files, rows
            s = time.perf_counter() - t
            print(f"| {name} | {epoch} | {s:.1f} | {rows / s:,.0f} | {footer_readers() - start_count} |", flush=True)
    ray.shutdown()
    shutil.rmtree(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
