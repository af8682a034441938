"""`python -m raytrain.tools.export CHECKPOINT OUT_DIR`: a raytrain checkpoint -> a Hugging Face model directory.

`AutoModelForCausalLM.from_pretrained(OUT_DIR)` then loads it. What it writes and what it costs:
raytrain.checkpoint.export. Exit 0: written; 2: not a raytrain checkpoint, or another input mistake.
"""

from __future__ import annotations

import argparse
import re
import sys

from raytrain.checkpoint.export import export
from raytrain.config import ConfigError
from raytrain.console import ArgumentParser, say
from raytrain.driver.checks import check_writable_dir


def shard_size(text: str) -> str:
    """--max-shard-size as huggingface_hub's sharding reads it (5GB, 500MB), refused here rather
    than after the shards were merged; a size <= 0 would put every tensor in its own file."""
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split_torch_state_dict_into_shards({}, max_shard_size=text)  # parses the size, shards nothing
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    number = re.match(r"\s*([-+]?[\d.]+)", text)
    if not number or float(number.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size such as 5GB or 500MB, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m raytrain.tools.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint_step_* directory of a raytrain run (a local path or a URI)")
    parser.add_argument("out_dir", help="where to write the Hugging Face model directory (a local path or a URI)")
    parser.add_argument("--max-shard-size", default="5GB", type=shard_size,
                        help="largest safetensors file, e.g. 5GB or 500MB (huggingface_hub's units)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    try:
        check_writable_dir(args.out_dir, "OUT_DIR")
        export(args.checkpoint, args.out_dir, args.max_shard_size)
    except ConfigError as e:
        say(f"raytrain: error: {e}", err=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
