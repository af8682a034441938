"""CPU-seconds of a Train worker's imports with Python's cyclic garbage collector on and off, each in a fresh
process: what the collector costs a process of the test suite before any raytrain code runs (docs/status.md #16,
session 43). Ray's workers import before raytrain's code runs, so raytrain cannot turn it off there.

    python benchmarks/import_gc.py [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import gc, resource, sys
if sys.argv[1] == "off":
    gc.disable()
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
start = cpu()
import ray.train.torch
from raytrain import compat
compat.import_deepspeed_without_mlflow()
from transformers import LlamaForCausalLM
import raytrain.worker.loop
print(f"{cpu() - start:.2f} {gc.get_stats()[2]['collections']}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    for mode in ("on", "off"):
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                                 env={"OMP_NUM_THREADS": "1", **os.environ})
            seconds, full = out.stdout.splitlines()[-1].split()  # DeepSpeed prints its accelerator first
            print(f"gc {mode}: {seconds} CPU-s of imports, {full} full collections")


if __name__ == "__main__":
    main()
