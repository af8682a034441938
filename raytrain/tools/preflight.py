"""`python -m raytrain.tools.preflight`: check the cluster's GPUs and network before training.

    python -m raytrain.tools.preflight                          # one task per GPU of the running cluster
    python -m raytrain.tools.preflight --sizes 1M,64M,1G --min-ib-busbw-gbs 45
    python -m raytrain.tools.preflight --no-use-gpu --num-workers 2 --sizes 1M,4M   # CPU + gloo (tests)

Exit 0: pass; 1: fail; 2: a configuration mistake. What it measures: raytrain.network.preflight.
"""

from __future__ import annotations

import argparse
import sys

from raytrain.config import ConfigError, load_config
from raytrain.console import ArgumentParser, add_config_flag, flag_number, one_config, say
from raytrain.driver.cluster import preflight_cluster
from raytrain.network.preflight_report import (
    DEFAULT_MIN_IB_BUSBW_GBS, DEFAULT_MIN_NVLINK_BUSBW_GBS, LINK_RATE_FRACTION, parse_sizes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m raytrain.tools.preflight", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Check the cluster's GPUs and network before training: versions agree across nodes, "
                    "NCCL uses InfiniBand, RoCE or EFA where it exists, collective bus bandwidth meets a minimum. "
                    "Exit 0 pass, 1 fail, 2 configuration mistake.")
    add_config_flag(p, "YAML run config: its network, scaling and cluster sections apply")
    p.add_argument("--num-workers", type=flag_number(int, minimum=1),
                   help="ranks (same as scaling.num_workers=N); default: one per GPU in the cluster, 2 on a "
                        "CPU-only cluster")
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=None,
                   help="same as scaling.use_gpu; default: true when the cluster has GPUs")
    p.add_argument("--sizes", help="comma-separated message sizes (K/M/G = KiB/MiB/GiB); default 1M..1G doubling "
                                   "on GPU, 1M..16M on CPU")
    p.add_argument("--iters", type=flag_number(int, minimum=1), default=20, help="timed calls per size")
    p.add_argument("--warmup-iters", type=flag_number(int, minimum=0), default=5, help="untimed calls per size first")
    p.add_argument("--min-nvlink-busbw-gbs", type=flag_number(float, minimum=0),
                   help=f"minimum all-reduce busbw within a node, GB/s (10^9 bytes/s) at the largest size; "
                        f"default {DEFAULT_MIN_NVLINK_BUSBW_GBS:g} on GPU (NVLink/NVSwitch), unchecked on CPU; "
                        f"0 disables")
    p.add_argument("--min-ib-busbw-gbs", type=flag_number(float, minimum=0),
                   help=f"minimum all-reduce busbw across nodes per NIC, GB/s, 1 rank per node (all ranks: x rails "
                        f"per node); default on GPU: {LINK_RATE_FRACTION * 100:.0f}%% of the link rates the nodes "
                        f"report (ports/1/rate), {DEFAULT_MIN_IB_BUSBW_GBS:g} per rail where one is unknown; "
                        f"unchecked on CPU")
    p.add_argument("--timeout-s", type=flag_number(float, above=0), default=600.0,
                   help="limit for placing workers, building the process group and each measurement")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="raytrain config overrides, e.g. network.env.NCCL_IB_HCA==mlx5_0 cluster.address=HOST:6379")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after flags
    args.config = one_config(p, args.config)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    overrides = list(args.overrides)
    if args.num_workers is not None:
        overrides.append(f"scaling.num_workers={args.num_workers}")
    if args.use_gpu is not None:
        overrides.append(f"scaling.use_gpu={str(args.use_gpu).lower()}")
    try:
        report = preflight_cluster(load_config(args.config, overrides, command_line=True), parse_sizes(args.sizes) if args.sizes else None,
                                   iters=args.iters, warmup_iters=args.warmup_iters,
                                   min_nvlink_busbw_gbs=args.min_nvlink_busbw_gbs,
                                   min_ib_busbw_gbs=args.min_ib_busbw_gbs, timeout_s=args.timeout_s)
    except ConfigError as e:
        say(f"raytrain: error: {e}", err=True)
        return 2
    say(report.render())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
