"""`python -m raytrain.main [--config FILE] [--dry-run] [KEY=VALUE ...]`: parse, resolve, train."""

from __future__ import annotations

import argparse
import json
import sys

from raytrain.config import ConfigError, load_config
from raytrain.console import say
from raytrain.driver.run import dry_run, fit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m raytrain.main",
        description="Train a causal LM with DeepSpeed ZeRO-3 on a Ray cluster. "
                    "Precedence: KEY=VALUE > --config FILE > defaults.")
    parser.add_argument("--config", help="YAML run config (sections: model, data, training, scaling, "
                                         "checkpoint, cluster, network, deepspeed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and validate for the requested cluster shape, print the run as JSON, exit")
    parser.add_argument("--resume-from", metavar="PATH",
                        help="start from this checkpoint directory (same as checkpoint.resume_from=PATH)")
    parser.add_argument("--fresh", action="store_true",
                        help="the run name exists: set the old run aside (renamed, not deleted) and start over")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. training.max_steps=20 deepspeed=ds_config.json")
    # intermixed: KEY=VALUE overrides may come before and after the flags (`--resume-from X a.b=1`)
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.resume_from:
        overrides.append(f"checkpoint.resume_from={args.resume_from}")
    try:
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            resolved, notes = dry_run(cfg)
            for note in notes:  # stdout stays the JSON plan
                say(f"raytrain: {note}" if note.startswith("plan: ") else f"raytrain: note: {note}", err=True)
            say(json.dumps(resolved.to_dict(), indent=2))
            return 0
        result = fit(cfg, fresh=args.fresh)
    except ConfigError as e:
        say(f"raytrain: error: {e}", err=True)
        return 2
    loss = result.metrics.get("loss")
    say(f"raytrain: done at step {result.metrics.get('step')}, loss {loss:.4f}" if loss is not None else "raytrain: done")
    say(f"raytrain: checkpoint {result.checkpoint_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
