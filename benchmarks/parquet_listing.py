"""What Ray Data's parquet listing costs per epoch, with Ray's default pool of footer readers and with
raytrain's (raytrain.compat.read_parquet_listed: one actor per 10 files, at most 32).

    python benchmarks/parquet_listing.py [--files N] [--epochs E] [--num-cpus C]

Starts a local Ray cluster (no dashboard), writes N small parquet files, then for each variant reads
them as one dataset and iterates it E times, printing per epoch the seconds and the FooterReader
actors started so far (from the GCS's actor table: dead ones count too). Both variants run in the
same cluster, the default first; the first epoch of the first variant also warms the worker pool.
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
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=4)
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import ray.data
    from ray._private import state

    from raytrain import compat

    directory = tempfile.mkdtemp(prefix="parquet-listing-")
    files = []
    for i in range(args.files):
        files.append(os.path.join(directory, f"part-{i:04d}.parquet"))
        pq.write_table(pa.table({"text": [f"document {i} {j}" for j in range(100)]}), files[-1])
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False

    def footer_readers() -> int:
        return sum("FooterReader" in a["ActorClassName"] for a in state.actors().values())

    print(f"{args.files} files, {args.epochs} epochs, a local cluster of {args.num_cpus} CPUs")
    print("| variant | epoch | s | FooterReader actors started |\n| --- | ---: | ---: | ---: |")
    variants = [("Ray's default (ray.data.read_parquet)", lambda: ray.data.read_parquet(files)),
                ("raytrain (compat.read_parquet_listed)", lambda: compat.read_parquet_listed(files, None))]
    for name, read in variants:
        start_count = footer_readers()
        ds = read()
        for epoch in range(args.epochs):
            t = time.perf_counter()
            rows = sum(len(batch["text"]) for batch in ds.iter_batches())
            assert rows == 100 * args.files, rows
            print(f"| {name} | {epoch} | {time.perf_counter() - t:.1f} | {footer_readers() - start_count} |", flush=True)
    ray.shutdown()
    shutil.rmtree(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
