"""`python -m raytrain.tools.export CHECKPOINT OUT_DIR`: a raytrain checkpoint -> a Hugging Face model directory.

`AutoModelForCausalLM.from_pretrained(OUT_DIR)` then loads it. What it writes and what it costs:
raytrain.checkpoint.export. Exit 0: written; 2: not a raytrain checkpoint, or another input mistake.
"""

from __future__ import annotations

import argparse
import sys

from raytrain.checkpoint.export import export
from raytrain.config import ConfigError
from raytrain.console import say


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrain.tools.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint_step_* directory of a raytrain run (local path)")
    parser.add_argument("out_dir", help="where to write the Hugging Face model directory")
    parser.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out_dir, args.max_shard_size)
    except ConfigError as e:
        say(f"raytrain.export: error: {e}", err=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
