"""Resolve the user's DeepSpeed JSON for a cluster shape: "auto" values and the batch arithmetic.

The user's file is used unchanged except that "auto" values are filled (as Hugging Face's
integration does), `gradient_clipping` is filled from `training.gradient_clipping` when absent
too (DeepSpeed's own default would be no clipping), a micro-batch, accumulation or precision the
user set in `training` fills the JSON's absent key too (a stated one that differs is an error),
the old key "bfloat16" is renamed "bf16" (DeepSpeed reads both alike), and the batch triple is
completed by DeepSpeed's own rule. DeepSpeed itself silently drops "auto" inside sub-configs and
falls back to its defaults, so no "auto" ever reaches it: any that raytrain cannot resolve is an
error naming the key. (Training values the user wrote that a concrete JSON value contradicts are
refused earlier, by raytrain.config.load_config, which knows what the user wrote.) The resolved
dict is then checked by DeepSpeed's own models (raytrain.planning.deepspeed_check).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from raytrain.config import ConfigError, TrainingConfig, read_json_file

AUTO = "auto"
FALLBACK_MICRO_BATCH = 8


def load_deepspeed(raw: dict[str, Any] | str) -> dict[str, Any]:
    """The DeepSpeed mapping from an inline dict or a path to the user's JSON."""
    if isinstance(raw, str):
        return read_json_file(raw, "deepspeed")
    return copy.deepcopy(raw)


def resolve_deepspeed(raw: dict[str, Any] | str, training: TrainingConfig, *, world_size: int,
                      use_gpu: bool, hidden_size: int, gpus_per_node: int | None = None) -> dict[str, Any]:
    """Return the DeepSpeed dict to hand to deepspeed.initialize, with every value concrete."""
    ds = load_deepspeed(raw)
    _resolve_batch(ds, training, world_size)
    _resolve_precision(ds, training, use_gpu)
    # Documented: used when the JSON leaves gradient_clipping "auto" *or absent*.
    ds.setdefault("gradient_clipping", AUTO)
    _fill(ds, "gradient_clipping", training.gradient_clipping)
    if ds.get("zero_optimization") is None:
        ds["zero_optimization"] = {}
    zero = _section(ds, "zero_optimization", '{"stage": 3}')
    # Hugging Face's formulas: buckets sized to a layer's hidden x hidden matrix; parameters smaller
    # than 10 x hidden stay resident (gathering them costs more latency than their memory).
    _fill(zero, "reduce_bucket_size", hidden_size * hidden_size, "zero_optimization.")
    _fill(zero, "stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size), "zero_optimization.")
    _fill(zero, "stage3_param_persistence_threshold", 10 * hidden_size, "zero_optimization.")
    _resolve_hpz(zero, world_size, use_gpu, gpus_per_node)
    _resolve_optimizer(ds, training)
    leftover = _find_auto(ds)
    if leftover:
        raise ConfigError(f"deepspeed.{leftover} is \"auto\" but raytrain has no value for it: write the value "
                          f"there (see DeepSpeed's config documentation for the key)")
    return ds


@dataclass(frozen=True)
class DeepSpeedFacts:
    """What raytrain needs to know about a resolved DeepSpeed dict, read once on the driver.

    Everything else reads these by name; nothing parses the dict's string keys a second time.
    """

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    zero_stage: int
    precision: str
    """"bf16", "fp16" or "fp32"."""
    offload_optimizer: str
    """"none", "cpu" or "nvme"."""
    offload_param: str
    """"none", "cpu" or "nvme"."""
    optimizer_type: str | None
    """The DeepSpeed JSON's own optimizer ("AdamW", ...), or None: raytrain builds AdamW itself."""
    torch_adam: bool
    """The JSON's Adam asks for torch's implementation (optimizer.params.torch_adam)."""
    has_scheduler: bool
    """The JSON brings its own LR scheduler (else raytrain's warmup + cosine)."""
    bf16_master_weights: bool = False
    """bf16.bf16_master_weights_and_grads: master weights and their gradients in bf16."""
    bf16_optimizer_states: bool = False
    """bf16.bf16_optimizer_states: Adam's moments in bf16 too (raytrain's CPU Adam is then built with
    fp32_optimizer_states=False, which DeepSpeed requires). Both cost accuracy: opt-in only."""

    @classmethod
    def of(cls, ds: dict[str, Any]) -> "DeepSpeedFacts":
        zero = ds.get("zero_optimization") or {}

        def device(which: str) -> str:
            return str((zero.get(which) or {}).get("device", "none")).lower()

        optimizer = ds.get("optimizer") or None
        precision = ("bf16" if (ds.get("bf16") or {}).get("enabled") is True else
                     "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32")
        return cls(train_batch_size=ds["train_batch_size"], micro_batch_per_gpu=ds["train_micro_batch_size_per_gpu"],
                   gradient_accumulation_steps=ds["gradient_accumulation_steps"],
                   zero_stage=int(zero.get("stage", 0)), precision=precision,
                   offload_optimizer=device("offload_optimizer"), offload_param=device("offload_param"),
                   optimizer_type=str(optimizer.get("type")) if optimizer else None,
                   torch_adam=bool(optimizer and (optimizer.get("params") or {}).get("torch_adam")),
                   has_scheduler=bool(ds.get("scheduler")),
                   bf16_master_weights=(ds.get("bf16") or {}).get("bf16_master_weights_and_grads") is True,
                   bf16_optimizer_states=(ds.get("bf16") or {}).get("bf16_optimizer_states") is True)


# ---------------------------------------------------------------------------------------------


def _section(parent: dict[str, Any], key: str, example: str, prefix: str = "") -> dict[str, Any]:
    """A section of the JSON raytrain reads to resolve it ({} when absent); anything but a mapping
    is an error here, before DeepSpeed's own check, which would hit the same value later."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"deepspeed.{prefix}{key} must be a mapping (a JSON object, for example {example}), "
                          f"got {type(value).__name__} {json.dumps(value, default=str)}")
    return value


def _fill(section: dict[str, Any], key: str, value: Any, prefix: str = "") -> None:
    """Replace an "auto" value; a concrete value the user wrote is left exactly as written."""
    if section.get(key) == AUTO:
        if value is None:
            raise ConfigError(f"deepspeed.{prefix}{key} is \"auto\" but nothing sets it: write a value there")
        section[key] = value


def _int_or_auto(ds: dict[str, Any], key: str) -> int | str | None:
    value = ds.get(key)
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"deepspeed.{key} must be a positive integer or \"auto\", got {value!r}")
    return value


def _resolve_batch(ds: dict[str, Any], training: TrainingConfig, world_size: int) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {k: _int_or_auto(ds, k) for k in keys}
    from_training = {"train_micro_batch_size_per_gpu": training.micro_batch_size_per_gpu,
                     "gradient_accumulation_steps": training.gradient_accumulation_steps,
                     "train_batch_size": None}
    training_keys = {"train_micro_batch_size_per_gpu": "micro_batch_size_per_gpu",
                     "gradient_accumulation_steps": "gradient_accumulation_steps"}
    known: dict[str, int] = {}
    named = {k: f"deepspeed.{k}" for k in keys}  # where each value came from, for the errors below
    for k in keys:
        if isinstance(given[k], int):
            train_key = training_keys.get(k)
            if train_key and from_training[k] is not None and from_training[k] != given[k]:
                raise ConfigError(f"training.{train_key}={from_training[k]} contradicts deepspeed.{k}={given[k]}: "
                                  f"set it in one place (or make the DeepSpeed value \"auto\")")
            known[k] = given[k]
        elif from_training[k] is not None:  # "auto" or absent: a value the user wrote is used, never dropped
            known[k], named[k] = from_training[k], f"training.{training_keys[k]}"
    tbs, mbs, gas = (known.get(k) for k in keys)

    # DeepSpeed's rule (runtime/config.py _set_batch_related_parameters), done here so a world size
    # that doesn't divide is reported before any worker starts.
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world_size:
            raise ConfigError(
                f"deepspeed.train_batch_size={tbs} != {named[keys[1]]}={mbs} x {named[keys[2]]}={gas} x "
                f"world size {world_size} = {mbs * gas * world_size}: change one of them (or set "
                f"train_batch_size to \"auto\")")
    elif tbs is not None:
        if mbs is None and gas is None:
            gas, named[keys[2]] = training.gradient_accumulation_steps or 1, "gradient_accumulation_steps"
        fixed, fixed_key = (mbs, named[keys[1]]) if mbs is not None else (gas, named[keys[2]])
        if tbs % (fixed * world_size):
            # Offer only the alternatives that can work: no number of workers helps when `fixed` itself
            # does not divide train_batch_size, and no value of `fixed` when the world size does not.
            others = ([f"a number of workers (scaling.num_workers) that divides {tbs // fixed}"] if tbs % fixed == 0
                      else [f"a {fixed_key} that divides {tbs // world_size}"] if tbs % world_size == 0 else [])
            raise ConfigError(
                f"deepspeed.train_batch_size={tbs} is not divisible by {fixed_key}={fixed} x world size "
                f"{world_size}: choose a train_batch_size that is a multiple of {fixed * world_size}"
                + "".join(f", or {other}" for other in others))
        derived = tbs // (fixed * world_size)
        if mbs is None:
            mbs = derived
        else:
            gas = derived
    else:
        mbs = mbs if mbs is not None else FALLBACK_MICRO_BATCH
        gas = gas if gas is not None else 1
        tbs = mbs * gas * world_size
    ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = tbs, mbs, gas


def micro_batch_lever(raw: dict[str, Any] | str, training: TrainingConfig, micro_batch: int, world_size: int) -> str:
    """How to make a run's micro-batch smaller, in the key the user set it with (`_resolve_batch`'s
    sources), for the planner's refusal: naming deepspeed.train_micro_batch_size_per_gpu to a user who wrote
    training.micro_batch_size_per_gpu got "contradicts" when followed, and one derived from train_batch_size
    is lowered by more accumulation."""
    if _concrete(training.micro_batch_size_per_gpu):  # (the JSON's, if concrete, is the same number)
        return f"lower training.micro_batch_size_per_gpu={micro_batch}"
    ds = load_deepspeed(raw)
    if _concrete(ds.get("train_micro_batch_size_per_gpu")):
        return f"lower deepspeed.train_micro_batch_size_per_gpu={micro_batch}"
    if _concrete(tbs := ds.get("train_batch_size")):
        key = ("deepspeed.gradient_accumulation_steps" if _concrete(ds.get("gradient_accumulation_steps"))
               else "training.gradient_accumulation_steps")
        return (f"raise {key} (the micro-batch is deepspeed.train_batch_size={tbs} / (accumulation x {world_size} "
                f"workers)) or lower deepspeed.train_batch_size")
    return f"set training.micro_batch_size_per_gpu below {micro_batch}"


def _concrete(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _resolve_precision(ds: dict[str, Any], training: TrainingConfig, use_gpu: bool) -> None:
    if ds.get("bf16") is None and "bfloat16" in ds:
        # DeepSpeed's old spelling, read alike (runtime/precision_config.py, 0.19.8: "bf16", else
        # "bfloat16"). Renamed so that every reader of the resolved dict finds it under one key.
        ds.pop("bf16", None)
        ds["bf16"] = ds.pop("bfloat16")
    sections = {name: _section(ds, name, '{"enabled": true}') for name in ("bf16", "fp16")}
    # Checked against the values the JSON states, before any "auto" is filled: the default JSON's bf16
    # "auto", filled from training.precision=bf16, is no bf16 the user turned on, so bf16 beside a
    # stated fp16 true is a contradiction with training.precision, not "both true".
    stated = [name for name, section in sections.items() if section.get("enabled") is True]
    if len(stated) == 2:
        raise ConfigError("deepspeed.fp16.enabled and deepspeed.bf16.enabled are both true: enable one of them")
    if training.precision is not None and stated and stated[0] != training.precision:
        raise _precision_contradiction(training.precision, stated[0], True)
    # "auto" follows training.precision, else the precision the JSON itself turns on (fp16 true beside
    # bf16 "auto" is an fp16 run, not both), else bf16 on GPUs.
    default = "bf16" if use_gpu and sections["bf16"].get("enabled") is not False else "fp32"
    wanted = training.precision or (stated[0] if len(stated) == 1 else default)
    delegated = False
    for name, section in sections.items():
        if section.get("enabled") == AUTO:
            section["enabled"], delegated = wanted == name, True
    if delegated and wanted != "fp32" and "enabled" not in sections[wanted]:
        # An "auto" precision with the wanted section absent (Hugging Face's stock ZeRO-3 JSON has only
        # fp16 "auto"): add it, or the run would be fp32 on GPUs without a word, at twice the memory.
        ds[wanted] = sections[wanted] = {**sections[wanted], "enabled": True}
    bf16, fp16 = (sections[name].get("enabled") is True for name in ("bf16", "fp16"))
    actual = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if training.precision is not None and actual != training.precision:
        # The user's training.precision must take effect: used where the JSON leaves its section's
        # "enabled" out (DeepSpeed's default would be fp32), a contradiction where the JSON states it.
        other = "fp16" if training.precision == "bf16" else "bf16"
        name = actual if actual != "fp32" else training.precision
        if training.precision == "fp32" or sections[other].get("enabled") is True or "enabled" in sections[name]:
            raise _precision_contradiction(training.precision, name, sections[name].get("enabled"))
        ds[training.precision] = {**sections[training.precision], "enabled": True}
        fp16 = training.precision == "fp16"
    if fp16 and not use_gpu and training.precision == "fp16":
        raise ConfigError("training.precision=fp16 needs GPUs, and this run is on CPU (scaling.use_gpu=false): "
                          "use bf16 or fp32, or run on GPUs with scaling.use_gpu=true")
    if fp16 and not use_gpu:
        raise ConfigError("deepspeed.fp16.enabled=true needs GPUs, and this run is on CPU (scaling.use_gpu=false): "
                          "set deepspeed.fp16.enabled=false (or use bf16), or run on GPUs with scaling.use_gpu=true")


def _precision_contradiction(precision: str, name: str, enabled: Any) -> ConfigError:
    return ConfigError(f"training.precision={precision} contradicts deepspeed.{name}.enabled={json.dumps(enabled)}: "
                       f"set it in one place (remove training.precision, or make deepspeed.{name}.enabled \"auto\")")


def _resolve_hpz(zero: dict[str, Any], world_size: int, use_gpu: bool, gpus_per_node: int | None) -> None:
    """ZeRO++ hpZ "auto": across nodes, a secondary parameter partition within each node so backward's
    all-gather stays on NVLink (costs params/gpus_per_node more memory per GPU); otherwise 1."""
    if zero.get("zero_hpz_partition_size") != AUTO:
        return
    spans_nodes = use_gpu and gpus_per_node is not None and world_size > gpus_per_node
    zero["zero_hpz_partition_size"] = math.gcd(world_size, gpus_per_node) if spans_nodes else 1


def _resolve_optimizer(ds: dict[str, Any], training: TrainingConfig) -> None:
    opt = _section(ds, "optimizer", '{"type": "AdamW", "params": {"lr": "auto"}}')
    if opt.get("params") is not None:
        p = _section(opt, "params", '{"lr": "auto"}', "optimizer.")
        _fill(p, "lr", training.learning_rate, "optimizer.params.")
        _fill(p, "betas", list(training.adam_betas), "optimizer.params.")
        _fill(p, "eps", training.adam_epsilon, "optimizer.params.")
        _fill(p, "weight_decay", training.weight_decay, "optimizer.params.")
    sched = _section(ds, "scheduler", '{"type": "WarmupLR", "params": {}}')
    if sched.get("params") is not None:
        p = _section(sched, "params", '{"warmup_num_steps": "auto"}', "scheduler.")
        _fill(p, "warmup_num_steps", training.warmup_steps, "scheduler.params.")
        _fill(p, "total_num_steps", training.max_steps, "scheduler.params.")
        _fill(p, "warmup_max_lr", training.learning_rate, "scheduler.params.")
        _fill(p, "warmup_min_lr", 0.0, "scheduler.params.")


def _find_auto(node: Any, path: str = "") -> str | None:
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found = _find_auto(v, f"{path}[{i}]")
            if found:
                return found
    elif node == AUTO:
        return path
    return None
