"""Resolve a RunConfig for a cluster shape: every derived value computed once, every check done.

Runs on the driver, before any worker starts, both for `--dry-run` (shape from the config alone)
and for a real run (shape read from the live Ray cluster). Start at `resolve_run`; its result, a
`ResolvedRun` (raytrain.run_spec), is what `--dry-run` prints and what the driver places into the
`RunSpec` the workers receive.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
from typing import Any

from raytrain.config import ConfigError, RunConfig
from raytrain.data.sources import Sources, data_facts, inspect_sources
from raytrain.deepspeed_config import AUTO, DeepSpeedFacts, load_deepspeed, resolve_deepspeed
from raytrain.hardware import Target
from raytrain.model import (PER_DOCUMENT_MODEL_TYPES, attention_backends, causal_lm_class, causal_lm_class_name,
                            config_from_facts, document_start_ids, embedding_padding_row, flash_attention_version,
                            fused_layers_enabled, load_generation_config, load_model_config, load_tokenizer,
                            param_stats, token_ids_from_tokenizer, token_ids_outside_vocab)
from raytrain.planning.activations import ATTENTION_ONLY_DROPOUT, DROPOUT_KEYS, active_parameters, dropout_probabilities
from raytrain.planning.choose import resolve_auto
from raytrain.planning.deepspeed_check import check_deepspeed
from raytrain.run_spec import ClusterShape, ModelFacts, ResolvedRun, WorldSizePlan


def shape_from_config(cfg: RunConfig, gpus_available: int = 0) -> ClusterShape:
    """The shape the config asks for, without a Ray cluster (dry runs on a laptop)."""
    return _shape(cfg, gpus_available, gpus_available or None, None,
                  "scaling.num_workers is not set and there are no GPUs here to count: "
                  "set scaling.num_workers to the number of GPUs of the target cluster")


def shape_from_cluster(cfg: RunConfig, resources: dict[str, float], gpus_per_node: int | None) -> ClusterShape:
    """The shape on a live Ray cluster (`ray.cluster_resources()`)."""
    return _shape(cfg, int(resources.get("GPU", 0)), gpus_per_node, resources.get("CPU"),
                  "scaling.use_gpu=true but the cluster has no GPU yet: set scaling.num_workers "
                  "(the autoscaler adds GPU nodes for the workers you ask for)")


def _shape(cfg: RunConfig, gpus: int, gpus_per_node: int | None, cpus_total: float | None,
           no_gpu_message: str) -> ClusterShape:
    use_gpu = cfg.scaling.use_gpu if cfg.scaling.use_gpu is not None else gpus > 0
    num_workers, min_workers = cfg.scaling.num_workers, None
    if isinstance(num_workers, list):
        min_workers, num_workers = num_workers  # checked where it is declared (raytrain.config_fields.worker_range)
    elif num_workers is None:
        if use_gpu and gpus == 0:
            raise ConfigError(no_gpu_message)
        num_workers = gpus if use_gpu else 2  # one worker per GPU; 2 on CPU (ZeRO-3 needs >1 to partition)
    if num_workers < 1:
        raise ConfigError(f"scaling.num_workers must be at least 1, got {num_workers}")
    return ClusterShape(num_workers=num_workers, use_gpu=use_gpu, gpus_per_node=gpus_per_node, cpus_total=cpus_total,
                        min_workers=min_workers)


def resolve_run(cfg: RunConfig, shape: ClusterShape, sources: Sources | None = None,
                target: Target | None = None) -> ResolvedRun:
    """Validate the config for `shape` and derive every fact the run needs, once.

    `sources`: the data sources when the caller already inspected them (the driver builds its
    datasets from the same objects); None: inspected here. `target`: the GPU memory, host RAM and
    GPUs per node the run goes to, which "auto" settings are chosen for (raytrain.planning.choose);
    a config with "auto" settings and no known GPU memory is an error.
    """
    hf_config = load_model_config(cfg.model)
    hidden = getattr(hf_config, "hidden_size", None)
    if hidden is None:
        raise ConfigError(f"model: {type(hf_config).__name__} has no hidden_size; raytrain trains decoder LMs")
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_len > max_pos:
        # A pretrained model's limit is what it was trained for, and where its positions are weights (GPT-2's wpe) a
        # larger model.config.max_position_embeddings is refused as changing them: only the first fix is sure.
        fix = (f"lower data.seq_len to at most {max_pos}, the length {cfg.model.name_or_path} was trained for "
               f"(model.config.max_position_embeddings can raise it only where positions are computed, as RoPE's "
               f"are, not learned weights)" if cfg.model.pretrained else
               "lower data.seq_len or set model.config.max_position_embeddings")
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings={max_pos}: "
                          f"{fix}")
    cfg = _resolve_attention(cfg, hf_config)
    _check_model_options(cfg, hf_config, shape)
    tokenizer = load_tokenizer(cfg.model)
    if len(tokenizer) > hf_config.vocab_size:
        if cfg.model.pretrained:  # a bigger table would not load (raytrain does not resize pretrained weights)
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the pretrained embedding table of "
                              f"{cfg.model.name_or_path} has {hf_config.vocab_size}: use the model's own tokenizer "
                              f"(unset model.tokenizer) or one of at most {hf_config.vocab_size} tokens")
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding table has "
                          f"{hf_config.vocab_size}: set model.config.vocab_size >= {len(tokenizer)} or use the "
                          f"model's own tokenizer")
    token_ids_from_tokenizer(hf_config, tokenizer, cfg.model)
    _check_cpus_for_data(cfg, shape)
    if cfg.data.sample_log and "://" in cfg.checkpoint.storage_path:
        raise ConfigError(f"data.sample_log=true appends to files under checkpoint.storage_path="
                          f"{cfg.checkpoint.storage_path}, which needs a local or shared filesystem: "
                          f"use one, or set data.sample_log=false")
    if shape.elastic:  # before resolving at the maximum, which would name that size alone
        _check_elastic_batch(cfg, shape)
    # before the "auto" search, which needs the shards to divide among the workers; the batch as written, if any
    written_batch = load_deepspeed(cfg.deepspeed).get("train_batch_size")
    check_shards(cfg.data.num_shards, shape, written_batch if isinstance(written_batch, int) else None)
    cfg, choice = resolve_auto(cfg, shape, hf_config, target)
    try:
        ds = resolve_deepspeed(cfg.deepspeed, cfg.training, world_size=shape.num_workers, use_gpu=shape.use_gpu,
                               hidden_size=hidden, gpus_per_node=shape.gpus_per_node)
        # raytrain's combination rules first: they name both keys, where DeepSpeed's own assert (run by
        # check_deepspeed) can only point at the last key it read. Types are check_deepspeed's.
        _check_zero_options(ds)
        check_deepspeed(ds, world_size=shape.num_workers, seq_len=cfg.data.seq_len, use_gpu=shape.use_gpu)
    except ConfigError as e:
        if not shape.elastic:
            raise
        raise ConfigError(f"{_range(shape)}, at world size {shape.num_workers}: {e}") from None
    facts = DeepSpeedFacts.of(ds)
    _check_attention_precision(cfg, facts, hf_config)
    derived = not isinstance(written_batch, int)  # "auto" or absent: the error says what it was derived from
    check_shards(cfg.data.num_shards, shape, facts.train_batch_size, facts if derived else None, written_batch)
    world_sizes = resolve_world_sizes(cfg, shape, facts, hidden) if shape.elastic else ()
    if (ds.get("compile") or {}).get("deepcompile") and not cfg.model.compile:
        # DeepSpeed reads the flag only inside engine.compile(); without it the run would be eager.
        raise ConfigError("deepspeed.compile.deepcompile=true takes effect only when the model is compiled: "
                          "set model.compile=true (or drop deepcompile)")
    missing = _missing_monitor_packages(ds) if shape.driver_on_worker_node else []
    if missing:  # this environment is the workers' (see _check_attention); elsewhere `advice` notes it
        section, package = missing[0]
        raise ConfigError(f"deepspeed.{section}.enabled=true needs the {package} package, which is not installed "
                          f"here: install it on the cluster's nodes (pip install {package}), or set "
                          f"deepspeed.{section}.enabled=false")
    sources = sources or inspect_sources(cfg.data)
    num_params = param_stats(hf_config, cfg.model.trust_remote_code).num_params
    model = ModelFacts(config_class=type(hf_config).__name__, model_type=hf_config.model_type, hidden_size=hidden,
                       num_hidden_layers=hf_config.num_hidden_layers, vocab_size=hf_config.vocab_size,
                       tokenizer_size=len(tokenizer), document_start_ids=document_start_ids(tokenizer),
                       num_parameters=num_params, num_active_parameters=active_parameters(hf_config, num_params),
                       hf_config=json.loads(hf_config.to_json_string(use_diff=False)))
    return ResolvedRun(config=cfg.with_deepspeed(ds), cluster=shape, model=model, deepspeed=facts,
                       data=data_facts(cfg.data, sources), world_sizes=world_sizes,
                       plan=choice.lines if choice else ())


def advice(resolved: ResolvedRun) -> list[str]:
    """Settings that run but cost throughput, or that only the workers' nodes can check, each a line naming the
    key and what to do (not errors)."""
    from raytrain.model import flash_attention_missing  # read at the call: tests replace it

    notes = []
    cpus = resolved.config.scaling.cpus_per_worker
    if resolved.deepspeed.offload_optimizer != "none" and cpus < 4:
        # Ray sets each worker's OMP_NUM_THREADS to its CPUs, and CPU Adam runs on OpenMP threads.
        notes.append(f"deepspeed.zero_optimization.offload_optimizer runs DeepSpeed's CPU Adam on the worker's "
                     f"scaling.cpus_per_worker={cpus:g} CPU threads: at 1.1B on one H200 that halved tokens/s "
                     f"(1 CPU: 26k, 14 CPUs: 51k; docs/benchmarks.md); raise scaling.cpus_per_worker")
    model = resolved.config.model
    outside = token_ids_outside_vocab(resolved.model.hf_config, resolved.model.vocab_size)
    pad = _generation_pad(resolved)
    if outside:
        notes.append(_token_ids_note(resolved, outside, pad))
    if token_ids_outside_vocab({"pad_token_id": pad}, resolved.model.vocab_size) and outside.get("pad_token_id") != pad:
        # the model's generation_config.json has one of its own: model.config.pad_token_id set to config.json's (or
        # null, where that is outside the vocabulary too) goes into the run's generation config, not changing the model
        kept = None if "pad_token_id" in outside else resolved.model.hf_config.get("pad_token_id")
        notes.append(f"{model.name_or_path}'s generation_config.json has pad_token_id={pad!r}, outside the model's "
                     f"vocabulary (0 to {resolved.model.vocab_size - 1}): {_GENERATE_PAD}; the export keeps it: set "
                     f"model.config.pad_token_id={'null' if kept is None else kept} (the run's generation config "
                     f"takes model.config's token ids)")
    if model.pretrained and "eos_token_id" not in outside:
        eos, ids = load_tokenizer(model).eos_token_id, resolved.model.hf_config.get("eos_token_id")
        if ids is None:  # generate() then stops only at max_new_tokens (the generation config has no EOS either)
            notes.append(f"the tokenizer's EOS is token {eos}, which packing ends every document with, but "
                         f"{model.name_or_path}'s config.json has no eos_token_id: generate() with the exported "
                         f"model never stops at the end of a text; set model.config.eos_token_id={eos}")
        elif eos not in (ids if isinstance(ids, list) else [ids]):
            notes.append(f"the tokenizer's EOS is token {eos}, which packing ends every document with, but "
                         f"{model.name_or_path}'s config.json has eos_token_id={ids}: generate() with the exported "
                         f"model stops on the config's; use the model's own tokenizer, or set "
                         f"model.config.eos_token_id={eos}")
    shape = resolved.cluster
    if shape.use_gpu and resolved.config.data.position_ids == "per_document" and model.attn_implementation == "sdpa":
        # Measured on an H100 (docs/benchmarks.md, "per-document attention"): with the mask SDPA leaves cuDNN's causal
        # kernel. Flash attention gets the micro-batch as one row (raytrain.worker.engine.model_inputs): its varlen
        # kernel, no mask (not yet measured on a GPU in that form).
        notes.append("data.position_ids=per_document with model.attn_implementation=sdpa: transformers keeps attention "
                     "within each document with a 4D mask, which SDPA runs in its memory-efficient kernel over every "
                     "score with k and v repeated to all heads (1.1B on an H100: attention 2.8x as long, 0.5 GiB more "
                     "a sequence; the plan counts both); flash_attention_2 or flash_attention_4 attend within "
                     "documents by position in their varlen kernels, without a mask: set model.attn_implementation "
                     "to one")
    version = flash_attention_version(model.attn_implementation)
    missing = version and not shape.driver_on_worker_node and flash_attention_missing(version)
    if missing:  # the GPU nodes may have it: not refused (_check_attention); a worker without it stops the run
        notes.append(f"model.attn_implementation={model.attn_implementation} needs {missing}, which this "
                     f"driver's node lacks; the workers run on other nodes, not checked from here: it must be "
                     f"installed on the GPU nodes, or the run stops as its workers start")
    if not shape.driver_on_worker_node:
        for section, package in _missing_monitor_packages(resolved.config.deepspeed):
            notes.append(f"deepspeed.{section}.enabled=true needs the {package} package, which this driver's node "
                         f"lacks; the workers run on other nodes, not checked from here: it must be installed there, "
                         f"or rank 0 fails in deepspeed.initialize")
    if shape.elastic:
        sizes = ", ".join(f"{p.world_size} x {p.deepspeed.gradient_accumulation_steps}" for p in resolved.world_sizes)
        notes.append(f"scaling.num_workers=[{shape.min_workers}, {shape.num_workers}] is elastic (workers x gradient "
                     f"accumulation: {sizes}); every node lost without notice costs one of checkpoint.max_failures="
                     f"{resolved.config.checkpoint.max_failures} (a grow costs none): set it to the losses the run "
                     f"should survive")
        if not resolved.config.checkpoint.every_n_steps and len(shape.world_sizes) > 1:
            # Every resize, a grow that the run starts itself too, restarts from the latest checkpoint; with
            # only the final one, that is where the run started (step 0) or resumed, each time capacity changes.
            notes.append(f"scaling.num_workers=[{shape.min_workers}, {shape.num_workers}] restarts from the latest "
                         f"checkpoint at every resize (a grow too), and checkpoint.every_n_steps=0 saves only at the "
                         f"end: each resize would discard every step since the run started or resumed; set "
                         f"checkpoint.every_n_steps (what a resize rolls back)")
    return notes


# What a pad_token_id outside the vocabulary does to generate() (transformers 5.25, checked on a tiny Llama): the rows
# of a batch that have ended are given the pad id as their next token, which the embedding then looks up.
_GENERATE_PAD = ("generate() with the exported model fails on a batch once one of its rows ends before the others "
                 "(the rows that ended are filled with this id: index out of range)")


def _generation_pad(resolved: ResolvedRun):
    """The pad_token_id that generate() with the exported model reads: that of the model's
    generation_config.json (which the run's copy keeps, raytrain.checkpoint.model_files, unless
    model.config sets one), else config.json's, from which from_pretrained derives a generation config."""
    model = resolved.config.model
    generation = None if "pad_token_id" in model.config else load_generation_config(model)
    return resolved.model.hf_config.get("pad_token_id") if generation is None else generation.pad_token_id


def _token_ids_note(resolved: ResolvedRun, outside: dict[str, Any], generation_pad) -> str:
    """What the token ids of the model's config.json outside its vocabulary do to this run, in one line:
    transformers only warns about them ("may result in unexpected behavior"), in every process that loads
    the config, which raytrain holds back (raytrain.model.token_id_warning_held), as it does the warning
    about the generation config's pad_token_id that each model built derives from it. `generation_pad`: the
    pad_token_id generate() with the exported model reads (`_generation_pad`). With model.pretrained=false
    the EOS and BOS ids are the tokenizer's already (token_ids_from_tokenizer); an id the model cannot be
    built with is an error before this (raytrain.model._check_token_ids_build)."""
    model, facts = resolved.config.model, resolved.model
    tokenizer, hf_config, trust = load_tokenizer(model), config_from_facts(facts, model), model.trust_remote_code
    said, fixes = [], []
    for key, value in outside.items():
        fix = None
        if key == "eos_token_id":
            fix = tokenizer.eos_token_id
            what = (f"packing ends every document with the tokenizer's EOS (token {fix}), so the data is not "
                    f"affected, but generate() with the exported model stops only at this id, which it never "
                    f"produces")
        elif key == "bos_token_id":
            fix = facts.document_start_ids[-1] if facts.document_start_ids else None
            what = (f"packing starts every document with the tokenizer's BOS (token {fix}), not this id"
                    if fix is not None else "packing starts documents with no BOS (the tokenizer adds none)")
        elif key == "pad_token_id":
            row = embedding_padding_row(hf_config, trust)
            if row is None:
                what = "raytrain does not use it"
            else:
                token = (f"token {row} ({tokenizer.convert_ids_to_tokens(row)!r}) of the tokenizer"
                         if row < len(tokenizer) else "no token of the tokenizer")
                what = (f"{causal_lm_class_name(hf_config, trust)} makes it its embedding's padding row, row {row} "
                        f"({token}), which gets no gradient")
            if generation_pad == value:
                what += f", and {_GENERATE_PAD}"
        else:
            what = "raytrain does not use it"
        said.append(f"{key}={value!r}: {what}")
        fixes.append(f"model.config.{key}={'null' if fix is None else fix}")
    ids, them = ("token ids", "them") if len(said) > 1 else ("a token id", "it")
    where = "with model.config's overrides" if model.config else "in its config.json"
    return (f"{model.name_or_path} has {ids} {where} outside the model's vocabulary (0 to "
            f"{facts.vocab_size - 1}), which transformers only warns about: {'; '.join(said)}; the exported "
            f"config.json keeps {them}: set {' '.join(fixes)}")


# DeepSpeed's monitors that rank 0 builds in deepspeed.initialize, each importing its package there
# (deepspeed/monitor/, 0.19.8): without it an ImportError on rank 0, retried as a worker failure. Its tensorboard
# monitor needs the `tensorboard` package, which raytrain's install does not bring (its own tracker is tensorboardX).
_MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _missing_monitor_packages(ds: dict[str, Any]) -> list[tuple[str, str]]:
    """(section, package) for each monitor the DeepSpeed dict turns on whose package this process cannot import.
    Imported, not only found, as DeepSpeed does: costs the package's import, only for a monitor turned on."""
    import importlib

    missing = []
    for section, package in _MONITOR_PACKAGES.items():
        if isinstance(ds.get(section), dict) and ds[section].get("enabled") is True:
            try:
                importlib.import_module(package)
            except ImportError:
                missing.append((section, package))
    return missing


def check_shards(num_shards: int | None, shape: ClusterShape, train_batch_size: int | None,
                 derived: DeepSpeedFacts | None = None, written: Any = None) -> None:
    """Each worker reads num_shards / num_workers whole data shards, and every optimizer step takes
    train_batch_size / num_shards rows from each (raytrain.data.ingest.MicroBatches), at every
    world size the run may have. `train_batch_size` None: not known yet (only the shard count is checked).
    `derived`: the resolved DeepSpeed facts where raytrain derived train_batch_size (the JSON's `written`
    value is "auto" or absent): the error then says how, and which train_batch_size to set (with the
    micro-batch: once train_batch_size is set, a micro-batch left to raytrain is derived from it)."""
    _check_shard_counts(num_shards, shape)
    if num_shards is None or train_batch_size is None or not train_batch_size % num_shards:
        return
    if derived is not None:
        raise ConfigError(_derived_batch_error(num_shards, shape, derived, written))
    raise ConfigError(f"deepspeed.train_batch_size={train_batch_size} is not divisible by data.num_shards="
                      f"{num_shards}: every optimizer step takes train_batch_size / num_shards rows from each "
                      f"data shard; choose a train_batch_size that is a multiple of {num_shards} or fewer shards")


def _derived_batch_error(num_shards: int, shape: ClusterShape, facts: DeepSpeedFacts, written: Any) -> str:
    """`check_shards`' line for a train_batch_size the user never wrote: the product it was derived as (the
    error once named the product alone, e.g. 32, as if the user had set it), and the train_batch_size to set:
    the smallest that num_shards divides and that gives a whole gradient accumulation at every world size of
    the run (an elastic run keeps train_batch_size at each; raytrain.planning.resolve.resolve_world_sizes)."""
    batch, micro, accumulation = facts.train_batch_size, facts.micro_batch_per_gpu, facts.gradient_accumulation_steps
    sizes = shape.world_sizes
    # num_shards passed _check_shard_counts: every size divides it, so this is at most num_shards x micro
    wanted = math.lcm(num_shards, micro * math.lcm(*sizes))
    given = '"auto"' if written == AUTO else "not set"
    product = f"micro-batch {micro} x gradient accumulation {accumulation} x {shape.num_workers} workers"
    if shape.elastic:
        return (f"{_range(shape)}: deepspeed.train_batch_size is {given}, and raytrain derived {batch} at the range's "
                f"maximum ({product}), which data.num_shards={num_shards} does not divide: every optimizer step "
                f"takes train_batch_size / num_shards rows from each data shard, and an elastic run keeps "
                f"train_batch_size at every world size: set deepspeed.train_batch_size to a multiple of {wanted} "
                f"(divisible by {num_shards}, and by micro-batch {micro} x each world size from {sizes[0]} to "
                f"{sizes[-1]}) and training.micro_batch_size_per_gpu={micro}")
    fewer = [k for k in range(num_shards - 1, 0, -1) if not batch % k and not k % shape.num_workers]
    fewer_fix = f", or data.num_shards={fewer[0]}" if fewer else ""
    return (f"deepspeed.train_batch_size is {given}, and raytrain derived {batch} ({product}), which "
            f"data.num_shards={num_shards} does not divide: every optimizer step takes train_batch_size / num_shards "
            f"rows from each data shard: set deepspeed.train_batch_size={wanted} and training.micro_batch_size_per_gpu="
            f"{micro} (gradient accumulation {wanted // (micro * shape.num_workers)}){fewer_fix}")


def _check_shard_counts(num_shards: int | None, shape: ClusterShape) -> None:
    sizes = shape.world_sizes
    where = f"{_range(shape)}: " if shape.elastic else ""
    if num_shards is None:
        if shape.elastic:
            common = _common_multiple(sizes)
            if common is None:
                raise ConfigError(f"{where}an elastic run needs data.num_shards divisible by every world size of the "
                                  f"range, so that its data position means the same at any size, and "
                                  f"{_too_wide(shape)}")
            raise ConfigError(f"{where}an elastic run needs data.num_shards, divisible by every world size of the "
                              f"range (e.g. {common}), so that its data position means the same at any size")
        return
    # The first few only: a range may be wide (its sizes above num_shards are all bad)
    bad = list(itertools.islice((w for w in sizes if num_shards % w), 8))
    if bad and not shape.elastic:
        raise ConfigError(f"data.num_shards={num_shards} is not divisible by the {shape.num_workers} workers: choose a "
                          f"multiple of every worker count the run may use (e.g. 48), or null for one per worker")
    if bad:
        listed = f"[{', '.join(map(str, bad[:7]))}{', ...' if len(bad) > 7 else ''}]"
        common = _common_multiple(sizes)
        fix = (f"use a multiple of {common} shards, or a range without those sizes" if common is not None else
               _too_wide(shape))
        raise ConfigError(f"{where}data.num_shards={num_shards} is not divisible by world size(s) {listed}: {fix}")


# The largest shard count check_shards advises. Every optimizer step takes train_batch_size / num_shards
# rows from each shard, so a count above any real global batch (in sequences) is no advice; and the
# smallest count a range's sizes all divide grows exponentially with its width ([1, 100]: 28 digits,
# [1, 10000]: past Python's 4300-digit limit for printing an int, a ValueError).
MAX_ADVISED_SHARDS = 100_000


def _common_multiple(sizes: range) -> int | None:
    """The smallest number every size divides, or None above MAX_ADVISED_SHARDS (stops there: a wide range is
    not walked to its end)."""
    common = 1
    for w in sizes:
        common = math.lcm(common, w)
        if common > MAX_ADVISED_SHARDS:
            return None
    return common


def _too_wide(shape: ClusterShape) -> str:
    """The advice for a range no practical shard count divides: the widest range with the same maximum whose
    sizes all divide a count within MAX_ADVISED_SHARDS."""
    low, high = shape.world_sizes[0], shape.num_workers
    start, common = high, high
    while start > low and math.lcm(common, start - 1) <= MAX_ADVISED_SHARDS:
        start -= 1
        common = math.lcm(common, start)
    example = f", e.g. scaling.num_workers=[{start}, {high}] with data.num_shards={common}" if start < high else ""
    return f"for a range this wide the smallest such count is over {MAX_ADVISED_SHARDS:,}: narrow it{example}"


def resolve_world_sizes(cfg: RunConfig, shape: ClusterShape, facts: DeepSpeedFacts, hidden: int) -> tuple[WorldSizePlan, ...]:
    """The DeepSpeed dict for every world size of an elastic range: train_batch_size and the
    micro-batch as resolved at the maximum, and the gradient accumulation that keeps them."""
    raw = load_deepspeed(cfg.deepspeed)
    batch, micro = facts.train_batch_size, facts.micro_batch_per_gpu
    if not isinstance(raw.get("train_batch_size"), int):
        how = (f" (train_batch_size is \"auto\": micro-batch x gradient accumulation x the maximum {shape.num_workers} "
               f"workers; set deepspeed.train_batch_size)")
    else:
        how = (f" (the micro-batch was derived at the maximum {shape.num_workers} workers; set "
               f"training.micro_batch_size_per_gpu, fixed across sizes)")
    _check_batch_sizes(shape, batch, micro, how)
    # The per-size dicts are resolved from the user's own with the batch pinned: every other
    # "auto" (hpZ, buckets, precision) and every check is raytrain's single-size rule at that size.
    training = dataclasses.replace(cfg.training, micro_batch_size_per_gpu=None, gradient_accumulation_steps=None)
    plans = []
    for w in shape.world_sizes:
        pinned = {**raw, "train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
                  "gradient_accumulation_steps": batch // (micro * w)}
        try:
            ds = resolve_deepspeed(pinned, training, world_size=w, use_gpu=shape.use_gpu, hidden_size=hidden,
                                   gpus_per_node=shape.gpus_per_node)
            _check_zero_options(ds)
            check_deepspeed(ds, world_size=w, seq_len=cfg.data.seq_len, use_gpu=shape.use_gpu)
        except ConfigError as e:
            raise ConfigError(f"{_range(shape)}, at world size {w}: {e}") from None
        plans.append(WorldSizePlan(world_size=w, ds_config=ds, deepspeed=DeepSpeedFacts.of(ds)))
    return tuple(plans)


def _check_elastic_batch(cfg: RunConfig, shape: ClusterShape) -> None:
    """An elastic range keeps train_batch_size and the micro-batch; the accumulation follows the
    world size. Checked for every size at once where the config states both."""
    raw = load_deepspeed(cfg.deepspeed)
    accumulation = raw.get("gradient_accumulation_steps")
    if accumulation not in (None, AUTO) and len(shape.world_sizes) > 1:
        raise ConfigError(f"{_range(shape)}: deepspeed.gradient_accumulation_steps={accumulation} is fixed, and an "
                          f"elastic run changes it with the world size to keep train_batch_size: set it to \"auto\" "
                          f"(or remove it)")
    batch = raw.get("train_batch_size")
    micro = raw.get("train_micro_batch_size_per_gpu")
    micro = cfg.training.micro_batch_size_per_gpu if micro in (None, AUTO) else micro
    if isinstance(batch, int) and isinstance(micro, int) and batch > 0 and micro > 0:
        _check_batch_sizes(shape, batch, micro)


def _check_batch_sizes(shape: ClusterShape, batch: int, micro: int, how: str = "") -> None:
    sizes = shape.world_sizes
    bad = [w for w in sizes if batch % (micro * w)]
    if bad:
        shown = ", ".join(map(str, bad[:7])) + (f" and {len(bad) - 7} more" if len(bad) > 7 else "")
        common = _common_multiple(sizes)  # None past MAX_ADVISED_SHARDS: a wide range's lcm has thousands of digits
        fix = (f"use a train_batch_size that is a multiple of {micro * common}, or a range without those sizes{how}"
               if common else f"no practical train_batch_size suits every size of a range this wide (their smallest "
                              f"common multiple is over {MAX_ADVISED_SHARDS:,}): narrow the range{how}")
        raise ConfigError(f"{_range(shape)}: train_batch_size={batch} with micro-batch {micro} needs a whole gradient "
                          f"accumulation at every world size, and [{shown}] do(es) not divide {batch // micro}: {fix}")


def _range(shape: ClusterShape) -> str:
    return f"scaling.num_workers=[{shape.world_sizes[0]}, {shape.world_sizes[-1]}]"


def _check_model_options(cfg: RunConfig, hf_config, shape: ClusterShape) -> None:
    _check_attention(cfg, hf_config, shape)
    model_type = getattr(hf_config, "model_type", None)
    if cfg.data.position_ids == "per_document" and model_type not in PER_DOCUMENT_MODEL_TYPES:
        raise ConfigError(f"data.position_ids=per_document keeps each document's attention within the document for "
                          f"the model types {', '.join(sorted(PER_DOCUMENT_MODEL_TYPES))} (checked by raytrain's "
                          f"tests), and this model is {model_type or type(hf_config).__name__}, for which "
                          f"transformers' mask or the model's recurrent layers may carry one document into the next: "
                          f"set data.position_ids=packed")
    if cfg.model.compile and cfg.model.liger_kernel != "none":
        # Measured on an H200 (torch 2.11, liger-kernel 0.8.5, docs/benchmarks.md): with "all" dynamo fails
        # to trace Liger's SwiGLU kernel; with "loss" the first compiled step hit an illegal memory access.
        raise ConfigError(f"model.compile=true does not work with model.liger_kernel={cfg.model.liger_kernel} "
                          f"(torch.compile fails on Liger's kernels): set one of them off; Liger is the faster "
                          f"lever under ZeRO-3 (docs/benchmarks.md)")
    if cfg.model.liger_kernel != "none":
        if getattr(hf_config, "model_type", None) != "llama":
            raise ConfigError(f"model.liger_kernel={cfg.model.liger_kernel} patches Llama models only, and this "
                              f"model is {getattr(hf_config, 'model_type', '?')}: set model.liger_kernel=none")
        if cfg.model.liger_kernel == "all" and not shape.use_gpu:
            raise ConfigError("model.liger_kernel=all needs GPUs (triton kernels): use loss or none on CPU")
    if cfg.model.fused_layers is True:
        if getattr(hf_config, "model_type", None) != "llama":
            raise ConfigError(f"model.fused_layers=true fuses Llama decoder layers only, and this model is "
                              f"{getattr(hf_config, 'model_type', '?')}: set model.fused_layers=false")
        if cfg.model.compile:
            raise ConfigError("model.fused_layers=true with model.compile=true: not measured together (the fused "
                              "layers are hand-written autograd functions); set one of them off")
    if cfg.model.fp8 and not fused_layers_enabled(cfg.model, hf_config):
        why = (f"model.fused_layers={cfg.model.fused_layers}" if cfg.model.fused_layers != "auto" else
               f"model.fused_layers=auto, which is on only for a Llama model with model.liger_kernel=all "
               f"(this run: {getattr(hf_config, 'model_type', '?')}, liger_kernel={cfg.model.liger_kernel})")
        raise ConfigError(f"model.fp8=true runs the fused decoder layers' projections in FP8, and this run has "
                          f"none ({why}): set model.fused_layers=true (Llama models), or model.fp8=false")


def _resolve_attention(cfg: RunConfig, hf_config) -> RunConfig:
    """model.attn_implementation="auto" (the default) made concrete: SDPA where the model's class
    supports it (no seq_len^2 score matrix kept), else eager (Gemma2, Bloom, GPT-Neo, MPT in
    transformers 5.25), as transformers' own default chooses."""
    if cfg.model.attn_implementation != "auto":
        return cfg
    chosen = _default_attention(hf_config, cfg.model.trust_remote_code)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_implementation=chosen))


def _default_attention(hf_config, trust_remote_code: bool) -> str:
    """SDPA where the model's class supports it, else eager: what "auto" becomes, and the fix a refusal names."""
    return "sdpa" if "sdpa" in attention_backends(causal_lm_class(hf_config, trust_remote_code)) else "eager"


def _check_attention(cfg: RunConfig, hf_config, shape: ClusterShape) -> None:
    """model.attn_implementation must be one transformers registers (or a hub kernel, org/repo), one
    the model's class supports, and one that can run here: otherwise each worker fails in
    from_config/from_pretrained, retried as a worker failure. The facts are transformers' own, as its
    constructor checks them: the class's _supports_* flags, flash attention's packages, flex
    attention's torch (raytrain.model.attention_backends, flash_attention_missing)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils import is_torch_flex_attn_available

    from raytrain.model import attention_backends, causal_lm_class, flash_attention_missing

    try:
        from transformers.integrations.hub_kernels import is_kernel
    except ImportError:  # older transformers: no hub kernels
        def is_kernel(_):
            return False

    name = cfg.model.attn_implementation
    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if is_kernel(name):
        return
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"model.attn_implementation={name!r} is not an attention implementation transformers "
                          f"knows: {hint}(known: {', '.join(known)}, or a hub kernel such as "
                          f"kernels-community/flash-attn)")
    model_class = causal_lm_class(hf_config, cfg.model.trust_remote_code)
    supported = attention_backends(model_class)
    fix = "sdpa" if "sdpa" in supported else "eager"
    if name.removeprefix("paged|") not in supported:
        raise ConfigError(f"model.attn_implementation={name!r}: {model_class.__name__} does not support it (it "
                          f"supports {', '.join(supported)}): set model.attn_implementation={fix}")
    version = flash_attention_version(name)
    if version and not shape.use_gpu:
        raise ConfigError(f"model.attn_implementation={name} runs on GPUs only, and this run's workers have none: "
                          f"set model.attn_implementation={fix}")
    # Only where the driver's environment is the workers' (a local cluster, a driver on a GPU node): a CPU head
    # node's or a laptop's says nothing of the GPU nodes' image (`advice` notes it; a worker without it fails).
    missing = flash_attention_missing(version) if version and shape.driver_on_worker_node else None
    if missing:
        raise ConfigError(f"model.attn_implementation={name} needs {missing}, which is not installed here: install "
                          f"it on the cluster's nodes, or set model.attn_implementation={fix}")
    if name == "flex_attention" and not is_torch_flex_attn_available():
        raise ConfigError(f"model.attn_implementation=flex_attention needs torch's flex attention, which this torch "
                          f"lacks: set model.attn_implementation={fix}")
    _check_attention_dropout(name, version, hf_config, fix)


def _check_attention_precision(cfg: RunConfig, facts: DeepSpeedFacts, hf_config) -> None:
    """FlashAttention's kernels (2, 3 and 4) take fp16 and bf16 only: under ZeRO-3 in fp32 (training.precision=fp32,
    or a DeepSpeed JSON with neither section on) every worker's first forward fails in the kernel's dtype assert,
    retried as a worker failure. Checked once the precision is resolved (the JSON's sections and "auto")."""
    name = cfg.model.attn_implementation
    if flash_attention_version(name) and facts.precision == "fp32":
        fix = _default_attention(hf_config, cfg.model.trust_remote_code)
        raise ConfigError(f"model.attn_implementation={name} runs in bf16 or fp16 only, and this run trains in fp32 "
                          f"(training.precision, or the DeepSpeed config's bf16/fp16 sections): set "
                          f"training.precision=bf16, or model.attn_implementation={fix}")


def _check_attention_dropout(name: str, version: int | None, hf_config, fix: str) -> None:
    """An attention dropout the backend cannot apply. FlashAttention-3 and -4 take no dropout (their functions have
    no dropout_p, so transformers 5.25 passes none and only warns once per process): the run would train without the
    dropout its config asks for. flex_attention raises in every worker's first forward. Both are refused here, as
    one line naming the config key, since raytrain trains in training mode (dropout on)."""
    if not (version in (3, 4) or name == "flex_attention"):
        return
    probability = dropout_probabilities(hf_config).attention
    if probability <= 0:
        return
    key = DROPOUT_KEYS.get(getattr(hf_config, "model_type", None), ATTENTION_ONLY_DROPOUT)[2]
    effect = ("would train without it (transformers passes its kernels no dropout)" if version
              else "fails in every worker's first forward")
    raise ConfigError(f"model.attn_implementation={name} has no attention dropout, and the model's config has "
                      f"{key}={probability:g}: the run {effect}; set model.config.{key}=0.0 to train without it, or "
                      f"model.attn_implementation={fix} to keep it")


def _check_cpus_for_data(cfg: RunConfig, shape: ClusterShape) -> None:
    if shape.cpus_total is None or shape.use_gpu:
        return
    # Ray Train reserves the workers' CPUs; with none left, Ray Data cannot schedule a single
    # tokenization task and the run waits forever. The group that starts is the run's size, or for an
    # elastic range as many workers as the cluster's CPUs hold, up to the maximum (Ray Train's elastic
    # policy starts the largest group it can place): with cluster.num_cpus=2 and [1, 2], the 2 that start
    # take both CPUs, and with cluster.num_cpus=1 the 1 that starts takes the only one. Counted on the
    # cluster's total: several nodes whose CPUs do not divide by cpus_per_worker may hold fewer workers.
    # (A group above the cluster's CPUs is left to the autoscaler, which adds nodes for it.)
    cpus = cfg.scaling.cpus_per_worker
    starts = min(shape.num_workers, math.floor(shape.cpus_total / cpus + 1e-9))
    if starts < (shape.min_workers or shape.num_workers):
        return
    spare = shape.cpus_total - starts * cpus
    if spare >= 1:
        return
    if not shape.elastic:
        raise ConfigError(f"{starts} workers x scaling.cpus_per_worker={cpus:g} leave {spare:g} of the cluster's "
                          f"{shape.cpus_total:g} CPUs for Ray Data, which then hangs: lower scaling.cpus_per_worker "
                          f"(fractions work) or add CPUs")
    fewer = f", the range's maximum to {starts - 1}" if starts > shape.min_workers else ""
    raise ConfigError(f"{_range(shape)} starts as many workers as the cluster's {shape.cpus_total:g} CPUs hold, "
                      f"{starts} x scaling.cpus_per_worker={cpus:g}, which leave {spare:g} for Ray Data, which then "
                      f"hangs: lower scaling.cpus_per_worker (fractions work){fewer}, or add CPUs")


# ---------------------------------------------------------------------------------------------
# DeepSpeed options raytrain's planning and worker depend on (issue 14): one-line errors for what
# DeepSpeed would only assert in the workers, or silently get wrong.


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}  # a section of the wrong type is check_deepspeed's to name


def _deepspeed_adam(opt: dict) -> bool:
    """The JSON's optimizer section asks for DeepSpeed's own Adam/AdamW (CPU Adam with offload), not torch's."""
    return str(opt.get("type", "")).lower() in ("adam", "adamw") and not _mapping(opt.get("params")).get("torch_adam")


def _check_zenflow(ds: dict, zero: dict, stage: int) -> None:
    """ZenFlow at stages 1-2 (DeepSpeed 0.19.8, runtime/zenflow/zenflow_stage_1_and_2.py): what it needs, each
    found on CPU as a traceback from deepspeed.initialize in every worker. Measured on an H200 and an H100 it was
    no faster than plain offload (docs/benchmarks.md, session 50), but it is the user's DeepSpeed option."""
    if stage not in (1, 2):  # stage 0 has no ZeRO optimizer for ZenFlow's steps (3: refused above)
        raise ConfigError(f"deepspeed.zero_optimization.zenflow runs with ZeRO stage 1 or 2, not {stage}: set "
                          f"zero_optimization.stage=2, or remove zenflow")
    if str(_mapping(zero.get("offload_optimizer")).get("device", "none")).lower() != "cpu":
        raise ConfigError("deepspeed.zero_optimization.zenflow needs zero_optimization.offload_optimizer.device=cpu "
                          "(ZenFlow steps the unselected columns in a CPU Adam; DeepSpeed: 'Zenflow must be used with "
                          "cpu offload'): add it, or remove zenflow")
    if not _deepspeed_adam(_mapping(ds.get("optimizer"))):
        # DeepSpeed hands the section's params to ZenFlow's device-side AdamW (ZenFlowSelectiveAdamW(**params)):
        # with raytrain's own AdamW there are none (a TypeError), and torch_adam is not a parameter it takes.
        raise ConfigError("deepspeed.zero_optimization.zenflow needs the DeepSpeed config's own optimizer section, "
                          "type Adam or AdamW without torch_adam (DeepSpeed passes its params to ZenFlow's "
                          "GPU-side AdamW): add deepspeed.optimizer: {type: AdamW, params: {lr: ...}}")
    if ds.get("gradient_accumulation_steps", 1) != 1:
        # runtime/zenflow/engine.py sets the engine's gradient_accumulation_steps to update_interval: the
        # accumulation written here would be replaced, and raytrain's steps would not be DeepSpeed's
        raise ConfigError(f"deepspeed.zero_optimization.zenflow replaces gradient accumulation with its "
                          f"update_interval (DeepSpeed sets one to the other), and the batch has "
                          f"gradient_accumulation_steps={ds.get('gradient_accumulation_steps')}: set "
                          f"training.gradient_accumulation_steps=1 and zenflow.update_interval")


def _check_zero_options(ds: dict) -> None:
    zero = _mapping(ds.get("zero_optimization"))
    bf16 = _mapping(ds.get("bf16"))
    stage = zero.get("stage", 0) if isinstance(zero.get("stage", 0), int) else -1  # a bad stage: check_deepspeed
    if zero.get("zenflow") is not None and stage == 3:  # present (even {}) turns ZenFlow on
        # runtime/zenflow/engine_stage3.py transposes 2-D weights before partitioning, but under
        # zero.Init (how raytrain builds every model) they are already partitioned: nothing is transposed
        # while every fetch transposes back, so the embedding sees [hidden, vocab] (the CUDA device-side
        # assert measured on an H200; an IndexError on CPU). Upstream bug, DeepSpeed 0.19.8.
        raise ConfigError("deepspeed.zero_optimization.zenflow does not work with stage 3 on models built under "
                          "zero.Init, as raytrain builds them (DeepSpeed 0.19.8 transposes weights that are already "
                          "partitioned: wrong shapes in the first step): remove zenflow, or use offload_optimizer")
    if zero.get("zenflow") is not None and stage != -1:  # -1: not a number, which check_deepspeed names
        _check_zenflow(ds, zero, stage)
    master, states = bf16.get("bf16_master_weights_and_grads") is True, bf16.get("bf16_optimizer_states") is True
    offloaded = str(_mapping(zero.get("offload_optimizer")).get("device", "none")).lower() != "none"
    if (master or states) and bf16.get("enabled") is not True:
        raise ConfigError("deepspeed.bf16.bf16_master_weights_and_grads / bf16_optimizer_states need bf16.enabled=true "
                          "(training.precision=bf16)")
    if states and not master:
        raise ConfigError("deepspeed.bf16.bf16_optimizer_states=true needs bf16_master_weights_and_grads=true too "
                          "(DeepSpeed keeps the moments in the master weights' dtype)")
    if (master or states) and stage == 0:
        raise ConfigError("deepspeed.bf16.bf16_master_weights_and_grads needs ZeRO stage 1-3 (zero_optimization.stage)")
    if master and not states and not offloaded:
        raise ConfigError("deepspeed.bf16.bf16_master_weights_and_grads=true with fp32 optimizer states needs "
                          "zero_optimization.offload_optimizer.device=cpu (DeepSpeed's CPU Adam holds them), or "
                          "bf16_optimizer_states=true as well")
    opt = _mapping(ds.get("optimizer"))
    ratio = _mapping(zero.get("offload_optimizer")).get("ratio", 1.0)
    if offloaded and ratio != 1.0 and opt and not _deepspeed_adam(opt):
        raise ConfigError(f"deepspeed.zero_optimization.offload_optimizer.ratio={ratio} needs DeepSpeed's CPU Adam "
                          f"(stage3.py: 'Hybrid Optimizer Only Supports DeepSpeedCPUAdam'), and the DeepSpeed JSON's "
                          f"optimizer is {opt.get('type')!r}: use Adam/AdamW without torch_adam, or drop the ratio")
