"""A raytrain checkpoint -> a Hugging Face model directory (`python -m raytrain.tools.export` runs it).

The ZeRO-3 shards are merged with DeepSpeed's lazy reader (each rank's fp32 partition is memory-
mapped and tensors are materialised one output shard at a time), so the host needs about one full
fp32 copy of the weights, not one per rank. OUT_DIR gets safetensors weights (sharded past 5 GB),
config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it. The
weights are the files DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict` writes, byte for
byte; raytrain runs its steps itself because the library call has no progress hook (it prints tqdm
bars, escape codes in `ray job logs`), and a 70B export takes minutes: raytrain prints bytes, rate
and ETA every few seconds instead.

Trust: reading the shards unpickles them (DeepSpeed's format); only export checkpoints you trust.
"""

from __future__ import annotations

import json
import os
import time

from raytrain.checkpoint.layout import METADATA, check_is_checkpoint
from raytrain.console import Meter, say
from raytrain.model import config_from_facts, load_tokenizer
from raytrain.run_spec import RunSpec

PROGRESS_EVERY_S = 5.0


def export(checkpoint_dir: str, out_dir: str, max_shard_size: str = "5GB") -> str:
    check_is_checkpoint(checkpoint_dir, "the checkpoint")
    with open(os.path.join(checkpoint_dir, METADATA)) as f:
        spec = RunSpec.from_dict(json.load(f)["spec"])
    start = time.perf_counter()
    say(f"raytrain.export: [1/3] merging ZeRO-3 shards of {checkpoint_dir}")
    os.makedirs(out_dir, exist_ok=True)
    write_weights(checkpoint_dir, out_dir, max_shard_size)
    say(f"raytrain.export: [2/3] config ({time.perf_counter() - start:.1f}s)")
    hf_config = config_from_facts(spec.model, spec.config.model)
    hf_config.use_cache = True  # training turned the KV cache off; generation wants it
    hf_config.save_pretrained(out_dir)
    say(f"raytrain.export: [3/3] tokenizer ({time.perf_counter() - start:.1f}s)")
    load_tokenizer(spec.config.model).save_pretrained(out_dir)
    say(f"raytrain.export: wrote {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


def write_weights(checkpoint_dir: str, out_dir: str, max_shard_size: str,
                  every_s: float = PROGRESS_EVERY_S) -> None:
    """fp32 safetensors of a ZeRO-3 checkpoint: DeepSpeed's convert_zero_checkpoint_to_state_dict
    (deepspeed/utils/zero_to_fp32.py) with safe_serialization, step by step, with a progress line."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    lazy = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, lazy_mode=True)
    # Uninitialised tensors plan the shards without reading a weight (their pages are never touched).
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype=torch.float32)
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    meter = Meter(sum(t.nbytes for t in _unique(empty)), "B", every_s)
    shards = list(split.filename_to_tensors.items())
    for i, (filename, names) in enumerate(shards, 1):
        tensors = _materialise(lazy, names, meter, f"shard {i} of {len(shards)}")
        save_file(tensors, os.path.join(out_dir, filename), metadata={"format": "pt"})
        del tensors  # before the next shard is read: one shard in memory at a time
    say(f"raytrain.export: [1/3] {meter.line()}, shard {len(shards)} of {len(shards)}")
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _materialise(lazy: dict, names: list[str], meter: Meter, where: str) -> dict:
    """Read the fp32 tensors `names` (gathered from every rank's partition); tied names stay one tensor."""
    import torch
    from deepspeed.utils.zero_to_fp32 import to_torch_tensor

    out, by_id = {}, {}
    for name in names:
        lazy_tensor = lazy[name]
        if id(lazy_tensor) not in by_id:
            by_id[id(lazy_tensor)] = to_torch_tensor({name: lazy_tensor}, dtype=torch.float32)[name]
            if meter.add(by_id[id(lazy_tensor)].nbytes):
                say(f"raytrain.export: [1/3] {meter.line()}, {where}")
        out[name] = by_id[id(lazy_tensor)]
    return out


def _unique(state_dict: dict) -> list:
    """The tensors of `state_dict`, each tied tensor once."""
    return list({id(t): t for t in state_dict.values()}.values())
