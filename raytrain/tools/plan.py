"""`python -m raytrain.tools.plan`: the memory a run needs per GPU and per node, and what fits, before allocating.

    python -m raytrain.tools.plan [--config FILE] [--gpu-memory-gib N] [--host-memory-gib N]
                                  [--gpus-per-node N] [KEY=VALUE ...]

The target is given by the flags (a cluster that does not exist yet), else read from the Ray
cluster at RAY_ADDRESS / cluster.address, else this machine. Exit 0: the configured run fits;
1: it does not (nor, with "auto" settings, does any setting of them); 2: a configuration error.
The model behind it: raytrain.planning.memory.
"""

from __future__ import annotations

import sys

from raytrain.config import ConfigError, load_config
from raytrain.console import ArgumentParser, add_config_flag, flag_number, one_config, say
from raytrain.driver.run import plan_memory
from raytrain.planning.memory import DoesNotFit
from raytrain.planning.table import format_plan


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(
        prog="python -m raytrain.tools.plan",
        description="Print the memory a run needs per GPU and per node (ZeRO-3 model states with and without "
                    "offload, activations with and without checkpointing) and what fits the target. The target "
                    "is given by the flags (a cluster that doesn't exist yet), else read from the Ray cluster at "
                    "RAY_ADDRESS / cluster.address, else this machine. Exit 0: the configured run fits; 1: it "
                    "does not (nor, with \"auto\" settings, does any setting of them); 2: a configuration error.")
    add_config_flag(parser, "YAML run config, as for python -m raytrain.main")
    parser.add_argument("--gpu-memory-gib", type=flag_number(float, above=0),
                        help="memory of one GPU of the target, e.g. 139.8 (H200)")
    parser.add_argument("--host-memory-gib", type=flag_number(float, above=0), help="host RAM of one node of the target")
    parser.add_argument("--gpus-per-node", type=flag_number(int, minimum=1), help="GPUs (workers) per node of the target")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. scaling.num_workers=16 model.gradient_checkpointing=true")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after flags
    args.config = one_config(parser, args.config)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    try:
        plan = plan_memory(load_config(args.config, args.overrides, command_line=True), gpu_memory_gib=args.gpu_memory_gib,
                           host_memory_gib=args.host_memory_gib, gpus_per_node=args.gpus_per_node)
    except DoesNotFit as e:  # also "auto" settings of which none fits: no configured run to tabulate
        if e.plan is not None:
            say(format_plan(e.plan))
            for line in dict.fromkeys(e.plan.notes):  # the model's caveat is both the table's and the choice's
                say(f"raytrain: plan: {line}")
        say(f"raytrain: does not fit: {e}", err=True)
        return 1
    except ConfigError as e:
        say(f"raytrain: error: {e}", err=True)
        return 2
    say(format_plan(plan))
    # what the planner chose for "auto" settings (the table shows that setting); the model's caveat once
    for line in dict.fromkeys(plan.notes):
        say(f"raytrain: plan: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
