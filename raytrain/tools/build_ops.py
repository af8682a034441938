"""`python -m raytrain.tools.build_ops OP [OP ...]`: compile DeepSpeed's JIT ops on this node before a run needs them.

    python -m raytrain.tools.build_ops cpu_adam                        # optimizer offload's CPU Adam
    python -m raytrain.tools.build_ops --if-buildable cpu_adam pin_memory async_io    # the test suite's (CPU)

A run builds the ops it needs itself, on each node at its first step (raytrain.worker.ops): CPU Adam for
optimizer offload takes ~45 s on a 16-core GPU node and ~1 min on 2 cores, async_io (NVMe offload) ~3 min
on 2 cores. That is time every worker of the run waits, again on each node an autoscaler or an elastic run
adds. Built here instead (a node's setup_commands, an image build, CI's install step), the run finds them
in TORCH_EXTENSIONS_DIR (torch's default ~/.cache/torch_extensions) and loads them in milliseconds. The
ops are DeepSpeed's names, as `ds_report` lists them; the build is the worker's own (same accelerator:
CUDA where torch sees a GPU, else CPU; same lock handling). Exit 0: built or already built; 2: an op
unknown to this DeepSpeed, or one this machine cannot build (what it lacks is DeepSpeed's `ds_report`'s),
unless --if-buildable, which says so in a note and builds the rest (the test suite then skips what needs it).
"""

from __future__ import annotations

import sys

from raytrain.console import ArgumentParser, say


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(
        prog="python -m raytrain.tools.build_ops",
        description="Compile DeepSpeed's JIT ops on this node ahead of a run (which otherwise compiles them at "
                    "its first step on every node): e.g. cpu_adam for optimizer offload, async_io for NVMe "
                    "offload. Exit 0: built or already built; 2: an unknown op or one this machine cannot build.")
    parser.add_argument("ops", nargs="+", metavar="OP", help="DeepSpeed op names, as ds_report lists them")
    parser.add_argument("--if-buildable", action="store_true",
                        help="an op this machine cannot build (async_io without libaio-dev) is a note, not an error")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    import torch

    from raytrain.worker.engine import import_deepspeed
    from raytrain.worker.ops import ensure_built, fix_cuda_arch_list

    import_deepspeed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS  # this accelerator's builders, by op name

    unknown = [name for name in args.ops if name not in ALL_OPS]
    if unknown:
        say(f"raytrain: error: {', '.join(unknown)}: not an op of DeepSpeed's {get_accelerator().device_name()} "
            f"accelerator here; its ops: {', '.join(sorted(ALL_OPS))}", err=True)
        return 2
    unbuildable = [name for name in args.ops if not ALL_OPS[name].is_compatible(verbose=False)]
    if unbuildable:
        what = (f"{', '.join(unbuildable)}: cannot be built on this machine (DeepSpeed's ds_report says what it "
                f"lacks, e.g. libaio-dev for async_io)")
        if not args.if_buildable:
            say(f"raytrain: error: {what}", err=True)
            return 2
        say(f"raytrain: note: {what}; left out")
    ops = [name for name in args.ops if name not in unbuildable]
    fix_cuda_arch_list(say)
    ensure_built([type(ALL_OPS[name]).__name__ for name in ops], log=say)
    say(f"raytrain: ops ready: {', '.join(ops) or 'none'} ({get_accelerator().device_name()} accelerator)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
