"""A raytrain checkpoint -> a Hugging Face model directory (`python -m raytrain.tools.export` runs it).

The ZeRO-3 shards are merged with DeepSpeed's lazy reader (each rank's fp32 partition is memory-
mapped and tensors are materialised one output shard at a time), so the host needs about one full
fp32 copy of the weights, not one per rank. OUT_DIR gets safetensors weights (sharded past 5 GB),
config.json, the tokenizer and the generation config: `AutoModelForCausalLM.from_pretrained(OUT_DIR)`
loads it. The weights are the files DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict`
writes, byte for byte; raytrain runs its steps itself because the library call has no progress
hook (it prints tqdm bars, escape codes in `ray job logs`), and a 70B export takes minutes: raytrain
prints bytes, rate and ETA every few seconds instead.

Self-contained: the config comes from the checkpoint's raytrain.json (the run's ModelFacts), the
tokenizer and generation config from the run's own copy (STORAGE/RUN/model/, next to the
checkpoint: raytrain.checkpoint.model_files), so the export works after the model directory and
tokenizer the run started from are gone. Everything is written into OUT_DIR.tmp-XXXX beside OUT_DIR
and renamed to OUT_DIR at the end: OUT_DIR is complete or absent, never half written. An OUT_DIR
that exists and is not empty is refused (nothing is overwritten).

Trust: reading the shards unpickles them (DeepSpeed's format); only export checkpoints you trust.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time

from raytrain.checkpoint.layout import MODEL_DIR, METADATA, check_is_checkpoint
from raytrain.config import ConfigError
from raytrain.console import Meter, say
from raytrain.model import config_from_facts, load_tokenizer
from raytrain.run_spec import RunSpec

PROGRESS_EVERY_S = 5.0


def export(checkpoint_dir: str, out_dir: str, max_shard_size: str = "5GB", model_dir: str | None = None) -> str:
    """Write the Hugging Face directory of `checkpoint_dir` (local) to `out_dir`.

    `model_dir`: the run's copy of the model's files (STORAGE/RUN/model/); default the `model`
    directory next to the checkpoint, else the tokenizer the run was started with."""
    check_is_checkpoint(checkpoint_dir, "the checkpoint")
    check_out_dir(out_dir)
    with open(os.path.join(checkpoint_dir, METADATA)) as f:
        spec = RunSpec.from_dict(json.load(f)["spec"])
    if model_dir is None:
        model_dir = os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir.rstrip("/"))), MODEL_DIR)
    start = time.perf_counter()
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        say(f"raytrain.export: [1/3] merging ZeRO-3 shards of {checkpoint_dir}")
        write_weights(checkpoint_dir, tmp, max_shard_size)
        say(f"raytrain.export: [2/3] config ({time.perf_counter() - start:.1f}s)")
        hf_config = config_from_facts(spec.model, spec.config.model)
        hf_config.use_cache = True  # training turned the KV cache off; generation wants it
        hf_config.save_pretrained(tmp)
        say(f"raytrain.export: [3/3] tokenizer and generation config ({time.perf_counter() - start:.1f}s)")
        write_tokenizer(spec, model_dir, tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above): the rename below needs the name free
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"raytrain.export: wrote {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


def check_out_dir(out_dir: str, key: str = "OUT_DIR") -> None:
    """A one-line ConfigError when `out_dir` exists and is not an empty directory."""
    path = os.path.expanduser(out_dir)
    if os.path.isdir(path) and os.listdir(path):
        raise ConfigError(f"{key} {out_dir} exists and is not empty: give a new directory (the export never "
                          f"overwrites one)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key} {out_dir} is a file: give a directory to create")


def write_tokenizer(spec: RunSpec, model_dir: str | None, out_dir: str) -> None:
    """The tokenizer (and generation config) from the run's copy in `model_dir`, else from the
    tokenizer the run was started with (a run written before raytrain kept its own copy)."""
    from transformers import AutoTokenizer, GenerationConfig

    if model_dir and os.path.isdir(model_dir):
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
        if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
            GenerationConfig.from_pretrained(model_dir).save_pretrained(out_dir)
        return
    try:
        tokenizer = load_tokenizer(spec.config.model)
    except ConfigError as e:
        raise ConfigError(f"the run's copy of the tokenizer ({model_dir}) is missing and {e}: put the run's "
                          f"{MODEL_DIR}/ directory next to the checkpoint") from None
    tokenizer.save_pretrained(out_dir)


def write_weights(checkpoint_dir: str, out_dir: str, max_shard_size: str,
                  every_s: float = PROGRESS_EVERY_S) -> None:
    """fp32 safetensors of a ZeRO-3 checkpoint: DeepSpeed's convert_zero_checkpoint_to_state_dict
    (deepspeed/utils/zero_to_fp32.py) with safe_serialization, step by step, with a progress line."""
    import torch
    # The merge runs on the host: DeepSpeed's CPU accelerator, without its "Setting accelerator to
    # CPU" warning or a CUDA context (where DeepSpeed is imported already, this changes nothing).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    with _without_deepspeed_chatter():
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


# What zero_to_fp32 prints while it reads a checkpoint (print() and tqdm bars, deepspeed 0.19.8):
# raytrain's own progress lines say the same.
_CHATTER = re.compile(r"(Processing zero checkpoint |Parsing checkpoint created by |Detected checkpoint of type "
                      r"|Reconstructed (Trainable|Frozen) fp32 state dict |(Loading checkpoint shards|Gathering "
                      r"sharded weights):|\s*$)")


@contextlib.contextmanager
def _without_deepspeed_chatter():
    """Capture stdout and stderr; write back every line that is not zero_to_fp32's known chatter
    (a warning or anything unexpected still shows)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        for captured, stream in ((out, sys.stdout), (err, sys.stderr)):
            for line in re.split(r"[\r\n]", captured.getvalue()):
                if not _CHATTER.match(line):
                    stream.write(line + "\n")
            stream.flush()
