"""`python -m raytrain.export CHECKPOINT OUT_DIR`: a raytrain checkpoint -> a Hugging Face model directory.

The ZeRO-3 shards are merged with DeepSpeed's own converter in lazy mode (each rank's fp32
partition is read once and tensors are materialised shard by shard), so the host needs about one
full fp32 copy of the weights, not one per rank. OUT_DIR gets safetensors weights (sharded past
5 GB), config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it.

Trust: reading the shards unpickles them (DeepSpeed's format); only export checkpoints you trust.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from raytrain.config import ConfigError, RunConfig


def export(checkpoint_dir: str, out_dir: str, max_shard_size: str = "5GB") -> str:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    from raytrain.checkpoint import METADATA
    from raytrain.model import load_model_config, load_tokenizer

    meta_path = os.path.join(checkpoint_dir, METADATA)
    if not os.path.isfile(meta_path):
        raise ConfigError(f"{checkpoint_dir} is not a raytrain checkpoint (no {METADATA}): "
                          f"give a checkpoint_step_* directory of a run")
    with open(meta_path) as f:
        run = RunConfig.from_dict(json.load(f)["run"])
    start = time.perf_counter()
    print(f"raytrain.export: [1/3] merging ZeRO-3 shards of {checkpoint_dir}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, out_dir, max_shard_size=max_shard_size,
                                               safe_serialization=True)
    print(f"raytrain.export: [2/3] config ({time.perf_counter() - start:.1f}s)", flush=True)
    hf_config = load_model_config(run.model)
    hf_config.use_cache = True  # training turned the KV cache off; generation wants it
    hf_config.save_pretrained(out_dir)
    print(f"raytrain.export: [3/3] tokenizer ({time.perf_counter() - start:.1f}s)", flush=True)
    load_tokenizer(run.model).save_pretrained(out_dir)
    print(f"raytrain.export: wrote {out_dir} in {time.perf_counter() - start:.1f}s", flush=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint_step_* directory of a raytrain run (local path)")
    parser.add_argument("out_dir", help="where to write the Hugging Face model directory")
    parser.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out_dir, args.max_shard_size)
    except ConfigError as e:
        print(f"raytrain.export: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
