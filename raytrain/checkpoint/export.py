"""A raytrain checkpoint -> a Hugging Face model directory (`python -m raytrain.tools.export` runs it).

The ZeRO-3 shards are merged with DeepSpeed's lazy reader (each rank's fp32 partition is memory-
mapped and tensors are materialised one output shard at a time), so the host needs about one full
fp32 copy of the weights, not one per rank. OUT_DIR gets safetensors weights (sharded past 5 GB),
config.json, the tokenizer and the generation config: `AutoModelForCausalLM.from_pretrained(OUT_DIR)`
loads it. The weights are the files DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict`
writes, byte for byte, except that a tied tensor is written once, as save_pretrained writes it
(safetensors refuses two names for one tensor; from_pretrained ties them again), and that a model
transformers 5 keeps in another layout than its checkpoints (a mixture of experts) is written back in
the checkpoints' layout, as save_pretrained writes it (`saved_layout`). raytrain runs
its steps itself because the library call has no progress hook (it prints tqdm bars, escape codes
in `ray job logs`), and a 70B export takes minutes: raytrain prints bytes, rate and ETA every few
seconds instead.

Self-contained: the config comes from the checkpoint's raytrain.json (the run's ModelFacts), the
tokenizer, generation config and a remote-code model's Python files from the run's own copy
(STORAGE/RUN/model/, next to the checkpoint: raytrain.checkpoint.model_files), so the export works
after the model directory and tokenizer the run started from are gone. Everything is written into
OUT_DIR.tmp-XXXX beside OUT_DIR and renamed to OUT_DIR at the end: OUT_DIR is complete or absent,
never half written. An OUT_DIR
that exists and is not empty is refused (nothing is overwritten).

The checkpoint and OUT_DIR may be URIs pyarrow knows (s3://, gs://, abfs://, file://), as the run's
storage may: a cloud checkpoint is downloaded first (Ray Train's Checkpoint.as_directory), and a cloud
OUT_DIR is written locally, then uploaded with config.json last: an object store has no rename, so a
cut-short upload leaves files without the config that `from_pretrained` starts from. Local disk: one
checkpoint plus one model copy.

Trust: reading the shards unpickles them (DeepSpeed's format); only export checkpoints you trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable

from raytrain.checkpoint.layout import METADATA, MODEL_DIR, check_is_checkpoint, filesystem
from raytrain.checkpoint.model_files import local_model_files, save_generation_config
from raytrain.config import ConfigError
from raytrain.config_files import first_line
from raytrain.console import Meter, say
from raytrain.model import (GENERATION_CONFIG, causal_lm_class, causal_lm_class_name, config_from_facts,
                            load_tokenizer, token_id_warning_held)
from raytrain.run_spec import RunSpec

PROGRESS_EVERY_S = 5.0


def export(checkpoint_dir: str, out_dir: str, max_shard_size: str = "5GB", model_dir: str | None = None,
           key: str = "OUT_DIR") -> str:
    """Write the Hugging Face directory of `checkpoint_dir` to `out_dir` (each a local path or a URI).

    `model_dir`: the run's copy of the model's files (STORAGE/RUN/model/); default the `model`
    directory next to the checkpoint, else the tokenizer the run was started with. `key`: what
    out_dir is called in an error (checkpoint.export_dir at the end of a run)."""
    from ray.train import Checkpoint  # a plain class: no Ray cluster needed
    import pyarrow.fs

    # raytrain.json, `latest` and every rank's shards, before anything is created: DeepSpeed's reader
    # would otherwise stop mid-merge on a missing shard with a FileNotFoundError traceback.
    check_is_checkpoint(checkpoint_dir, "the checkpoint")
    check_out_dir(out_dir, key)
    source_fs, source = filesystem(checkpoint_dir)
    fs, out_path = filesystem(out_dir)
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(Checkpoint(source.rstrip("/"), filesystem=source_fs).as_directory())
        if model_dir is None:
            run = checkpoint_dir.rstrip("/").rpartition("/")[0] if "://" in checkpoint_dir else os.path.dirname(source)
            model_dir = stack.enter_context(local_model_files(run))
        shown = f"{checkpoint_dir.rstrip('/')}/{METADATA}"
        if isinstance(fs, pyarrow.fs.LocalFileSystem):
            return _export(local, out_path, max_shard_size, model_dir, shown)
        scratch = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="raytrain-export-")), "out")
        _export(local, scratch, max_shard_size, model_dir, shown)
        start = time.perf_counter()
        upload(scratch, fs, out_path)
        say(f"raytrain.export: uploaded to {out_dir} in {time.perf_counter() - start:.1f}s")
        return out_dir


def _export(checkpoint_dir: str, out_dir: str, max_shard_size: str, model_dir: str | None, shown: str) -> str:
    """The export between local directories: into OUT_DIR.tmp-XXXX, renamed to `out_dir` at the end.
    `shown`: raytrain.json's path as the user named the checkpoint, for messages."""
    with open(os.path.join(checkpoint_dir, METADATA)) as f:
        spec = _read_spec(json.load(f)["spec"], shown)  # (check_is_checkpoint read the keys the resume reads)
    start = time.perf_counter()
    parent = os.path.dirname(out_dir)
    created = []  # the directories made for OUT_DIR's parent, innermost first: removed again on a failure
    directory = parent
    while directory and not os.path.exists(directory):
        created.append(directory)
        directory = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        say(f"raytrain.export: [1/3] merging the ZeRO shards of {checkpoint_dir}")
        write_weights(checkpoint_dir, tmp, max_shard_size, saved_layout(spec))
        say(f"raytrain.export: [2/3] config ({time.perf_counter() - start:.1f}s)")
        write_config(spec, model_dir, tmp)
        say(f"raytrain.export: [3/3] tokenizer and generation config ({time.perf_counter() - start:.1f}s)")
        write_tokenizer(spec, model_dir, tmp)
        # mkdtemp made it 0700, which the rename keeps: a serving user of a shared cluster could not read the
        # export. The mode os.makedirs gives (0777 less the umask; 755 under umask 022), or that of the empty
        # OUT_DIR it replaces (made by the user, perhaps group-writable on purpose).
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, stat.S_IMODE(os.stat(out_dir).st_mode) if os.path.isdir(out_dir) else 0o777 & ~umask)
        # safetensors' save_file creates its file 0600 (save_pretrained's weights too), which the directory's mode
        # does not open: every file gets the mode open() gives (644 under umask 022)
        for root, _, names in os.walk(tmp):
            for name in names:
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above): the rename below needs the name free
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in created:
            with contextlib.suppress(OSError):  # not empty: something else writes there now
                os.rmdir(directory)
        raise
    say(f"raytrain.export: wrote {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


def upload(local_dir: str, fs, path: str) -> None:
    """The files of `local_dir` (flat, as save_pretrained writes them) into `path` on `fs`, config.json last."""
    import pyarrow.fs

    fs.create_dir(path, recursive=True)
    for name in sorted(os.listdir(local_dir), key=lambda n: n == "config.json"):
        pyarrow.fs.copy_files(os.path.join(local_dir, name), f"{path.rstrip('/')}/{name}",
                              source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)


def _read_spec(data: dict, shown: str) -> RunSpec:
    """The run spec of raytrain.json, or a one-line ConfigError naming the file: a record edited or written by
    another program stopped the export on a KeyError or TypeError traceback (a spec without `cluster`)."""
    try:
        return RunSpec.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{shown}: its run config is not one raytrain reads ({e}): choose another checkpoint "
                          f"(an earlier checkpoint_step_* of the run)") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, KeyError):
            # a RunSpec field missing at the top, else a key missing deeper in (a world_sizes entry's world_size)
            top = e.args[0] in {f.name for f in dataclasses.fields(RunSpec)} and e.args[0] not in data
            what = f"lacks spec.{e.args[0]}" if top else f"lacks {e.args[0]!r} inside its spec"
        else:
            what = f"holds a spec raytrain cannot read ({first_line(e)})"
        raise ConfigError(f"{shown} {what}, which raytrain writes into every checkpoint's record (the file was "
                          f"edited, or written by another program): choose another checkpoint (an earlier "
                          f"checkpoint_step_* of the run)") from None


def check_out_dir(out_dir: str, key: str = "OUT_DIR") -> None:
    """A one-line ConfigError when `out_dir` (a local path or a URI) exists and is not an empty
    directory, or cannot be reached (a cloud URI is asked, with the driver's credentials)."""
    import pyarrow.fs

    try:
        fs, path = filesystem(out_dir)
        info = fs.get_file_info(path)
        full = info.type == pyarrow.fs.FileType.Directory and bool(fs.get_file_info(pyarrow.fs.FileSelector(path)))
    except (OSError, ValueError) as e:  # pyarrow: unknown scheme, no credentials or network (ArrowInvalid: ValueError)
        reason = first_line(e)
        raise ConfigError(f"{key} {out_dir}: cannot read it ({reason[:300]}): check the path or URI and its "
                          f"credentials") from None
    if full:
        raise ConfigError(f"{key} {out_dir} exists and is not empty: give a new directory (the export never "
                          f"overwrites one)")
    if info.type == pyarrow.fs.FileType.File:
        raise ConfigError(f"{key} {out_dir} is a file: give a directory to create")


def write_config(spec: RunSpec, model_dir: str | None, out_dir: str) -> None:
    """config.json as the run trained it (the checkpoint's ModelFacts), with what save_pretrained
    would write for the exported weights; a model with remote code gets its code files too."""
    model = spec.config.model
    code_dir = None
    if model.trust_remote_code and spec.model.hf_config.get("auto_map"):
        if not (model_dir and _code_files(model_dir)):
            where = model_dir or f"{MODEL_DIR}/ next to the checkpoint"
            raise ConfigError(f"the run's copy of the model's code ({where}) is missing: the config class of a "
                              f"model with its own code is imported from there; put the run's {MODEL_DIR}/ "
                              f"directory next to the checkpoint")
        code_dir = model_dir
    hf_config = config_from_facts(spec.model, model, code_dir)
    hf_config.use_cache = True  # training turned the KV cache off; generation wants it
    # The weights are written in fp32 whatever the source's dtype: a "bfloat16" left from the source
    # would make from_pretrained(dtype="auto") round the trained weights.
    hf_config.dtype = "float32"
    hf_config.architectures = [causal_lm_class_name(hf_config, model.trust_remote_code)]  # as save_pretrained
    with token_id_warning_held():  # save_pretrained validates it: the ids are the run's, said by its driver
        hf_config.save_pretrained(out_dir)
    for name in _code_files(code_dir) if code_dir else ():  # the modeling code: from_pretrained imports it
        if not os.path.exists(os.path.join(out_dir, name)):
            shutil.copyfile(os.path.join(code_dir, name), os.path.join(out_dir, name))


def _code_files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".py"))


def write_tokenizer(spec: RunSpec, model_dir: str | None, out_dir: str) -> None:
    """The tokenizer (and generation config) from the run's copy in `model_dir`, else from the
    tokenizer the run was started with (a run written before raytrain kept its own copy)."""
    from transformers import AutoTokenizer, GenerationConfig

    if model_dir and os.path.isdir(model_dir):
        trust = spec.config.model.trust_remote_code  # without it a tokenizer with code asks on stdin
        with token_id_warning_held():  # AutoTokenizer reads the run's config.json: its ids as the run trained them
            AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust).save_pretrained(out_dir)
        if os.path.isfile(os.path.join(model_dir, GENERATION_CONFIG)):
            with token_id_warning_held():  # a pad_token_id=-1, kept as the run's driver said
                generation = GenerationConfig.from_pretrained(model_dir)
            # generate() stops on the generation config's EOS only. One without any (derived from a config.json
            # that had none) takes the exported config's, as transformers derives one (from_model_config): so a
            # model.config.eos_token_id set for such a model reaches generate() (raytrain.planning.resolve.advice).
            eos = spec.model.hf_config.get("eos_token_id")
            if generation.eos_token_id is None and eos is not None:
                generation.eos_token_id = eos
            save_generation_config(generation, out_dir)  # every other value as the run's copy has it
        return
    try:
        tokenizer = load_tokenizer(spec.config.model)
    except ConfigError as e:
        raise ConfigError(f"the run's copy of the tokenizer ({model_dir}) is missing, and the tokenizer the run "
                          f"started with cannot be loaded either ({e}); put the run's {MODEL_DIR}/ directory next "
                          f"to the checkpoint") from None
    tokenizer.save_pretrained(out_dir)


def saved_layout(spec: RunSpec) -> Callable[[dict], dict] | None:
    """What turns the model's tensors into the layout of its checkpoints, as save_pretrained writes them, or None
    where they are the same. transformers 5 keeps some families' weights otherwise than their checkpoints hold
    them: a mixture of experts' per-expert matrices as one 3-D tensor per layer, under other names (Mixtral,
    Qwen2/3-MoE, DeepSeek ...), converted as it loads. save_pretrained converts them back
    (core_model_loading.revert_weight_conversion), and earlier transformers and other tools read only that
    layout: transformers 4.57 loaded a Mixtral export in the fused layout with its experts and router randomly
    initialised, and a warning. The conversion runs a shard at a time (one shard in memory): checked here on
    the meta device to give, a tensor at a time, what it gives the whole state dict (a split of one tensor into
    many does); a model whose conversion merges tensors is written in transformers 5's layout, and says so."""
    # transformers' conversions are keyed by its own model types; a model without an auto_map is built from
    # transformers' own class, trust_remote_code or not (causal_lm_class), and converted as it is
    if spec.config.model.trust_remote_code and spec.model.hf_config.get("auto_map"):
        return None
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    hf_config = config_from_facts(spec.model, spec.config.model)
    with token_id_warning_held(), torch.device("meta"):  # the constructor derives the model's generation config
        model = causal_lm_class(hf_config)(hf_config)
    meta = dict(model.named_parameters())  # as DeepSpeed's merge names them, each tied tensor once
    whole = revert_weight_conversion(model, dict(meta))
    if whole.keys() == meta.keys():
        return None
    each = {}
    for name, tensor in meta.items():
        each.update(revert_weight_conversion(model, {name: tensor}))
    if each.keys() != whole.keys() or any(each[k].shape != whole[k].shape for k in whole):
        say(f"raytrain.export: note: the weights are written as transformers 5 keeps them "
            f"({type(model).__name__}'s conversion to its checkpoints' layout merges tensors, which this export "
            f"does not do a shard at a time): transformers 5 loads them; earlier versions and other tools may not")
        return None
    return lambda tensors: {k: v.contiguous() for k, v in revert_weight_conversion(model, tensors).items()}


def write_weights(checkpoint_dir: str, out_dir: str, max_shard_size: str,
                  saved_layout: Callable[[dict], dict] | None = None, every_s: float = PROGRESS_EVERY_S) -> None:
    """fp32 safetensors of a ZeRO-3 checkpoint: DeepSpeed's convert_zero_checkpoint_to_state_dict
    (deepspeed/utils/zero_to_fp32.py) with safe_serialization, step by step, with a progress line;
    `saved_layout` (see `saved_layout`) applied to each shard's tensors."""
    import torch
    # The merge runs on the host: DeepSpeed's CPU accelerator, without its "Setting accelerator to
    # CPU" warning or a CUDA context (where DeepSpeed is imported already, this changes nothing).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    with _without_deepspeed_chatter():
        lazy = _one_name_per_tensor(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, lazy_mode=True))
    # Uninitialised tensors plan the shards without reading a weight (their pages are never touched).
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype=torch.float32)
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    meter = Meter(sum(t.nbytes for t in empty.values()), "B", every_s)
    shards = list(split.filename_to_tensors.items())
    weight_map = {}
    for i, (filename, names) in enumerate(shards, 1):
        tensors = _materialise(lazy, names, meter, f"shard {i} of {len(shards)}")
        if saved_layout is not None:
            tensors = saved_layout(tensors)
        save_file(tensors, os.path.join(out_dir, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors  # before the next shard is read: one shard in memory at a time
    say(f"raytrain.export: [1/3] {meter.line()}, shard {len(shards)} of {len(shards)}")
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": weight_map}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _one_name_per_tensor(state_dict: dict) -> dict:
    """`state_dict` with each tied tensor under its first name only, as save_pretrained writes it
    (safetensors refuses two names for one tensor). DeepSpeed stores a tied parameter once, under the
    name met first in the module tree, and adds the later names (its shared_params) after the stored
    ones: for a causal LM the embedding comes first, so lm_head.weight is the name dropped, the one
    transformers' _tied_weights_keys lists and from_pretrained ties back to the embedding."""
    kept = {}
    for name, tensor in state_dict.items():
        kept.setdefault(id(tensor), (name, tensor))
    return dict(kept.values())


def _materialise(lazy: dict, names: list[str], meter: Meter, where: str) -> dict:
    """Read the fp32 tensors `names` (gathered from every rank's partition), one at a time."""
    import torch
    from deepspeed.utils.zero_to_fp32 import to_torch_tensor

    out = {}
    for name in names:
        out[name] = to_torch_tensor({name: lazy[name]}, dtype=torch.float32)[name]
        if meter.add(out[name].nbytes):
            say(f"raytrain.export: [1/3] {meter.line()}, {where}")
    return out


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
