"""The resolved DeepSpeed dict, checked on the driver before any worker starts: `check_deepspeed`.

1. DeepSpeed's own parsing, for the run's world size (raytrain.compat.parse_deepspeed_config): its
   pydantic models refuse wrong types, values out of range and unknown keys in the sections they
   own (zero_optimization and its offload sections, bf16, fp16, compile, the monitors, ...), its
   batch assertion runs with the run's world size, and its own asserts run. DeepSpeed knows its
   rules better than a copy of them would.
2. Keys DeepSpeed never reads. DeepSpeed reads its top level, and sections such as
   activation_checkpointing or flops_profiler, with one `dict.get` per key, so a key it does not
   know is ignored without a word (`zero_optimisation` beside `zero_optimization` never takes
   effect). The dict is handed to DeepSpeed wrapped in `_Reads`, which records every key DeepSpeed
   looks up; a key of the user's that DeepSpeed never looked up, in a section it read key by key,
   is refused with the closest key it did look up. The set therefore follows DeepSpeed's version.
3. A string where DeepSpeed reads a number or a boolean ("zero_hpz_partition_size": "2",
   "partition_activations": "false"): pydantic's lax mode converts such strings, and a plain
   `dict.get` hands them on ("false" is true). Both are refused; which keys DeepSpeed reads as
   numbers is found from DeepSpeed itself (the default it passes to `get`, or its model refusing
   the string once it no longer spells a number).
4. raytrain's own rules, where DeepSpeed has none or only finds out inside the workers: DeepSpeed's
   old cpu_offload spellings (raytrain reads only the offload sections), optimizer and scheduler
   params against the one class DeepSpeed builds with them, an optimizer ZeRO was not tested with,
   offload and hpZ combinations, the micro-batch's token count.

Every failure is one ConfigError line naming `deepspeed.<dotted.key>` and the fix. What DeepSpeed logs
while it parses goes to stderr: stdout carries --dry-run's JSON.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import logging
import re
import sys
import typing
from collections.abc import KeysView
from typing import Any

from raytrain import compat
from raytrain.config import DEFAULT_DEEPSPEED, ConfigError
from raytrain.config_files import first_line

MAX_TOKENS_PER_MICRO_BATCH = 2**31 - 1
"""A micro-batch's token ids (micro-batch x seq_len) must be indexable with int32, as many of
torch's and DeepSpeed's kernels index; beyond that the ids alone are 16 GiB per GPU."""

# Handed whole to a constructor as keyword arguments (deepspeed/runtime/engine.py, 0.19.8:
# _configure_basic_optimizer, _scheduler_from_config): checked against its signature instead.
_KWARGS = {("optimizer", "params"), ("scheduler", "params")}
# Read by deepspeed.initialize itself before DeepSpeedConfig parses the rest (deepspeed/__init__.py,
# 0.19.8: the sequence-parallel mesh). raytrain never builds that mesh, but the keys are DeepSpeed's.
_READ_BY_INITIALIZE = ("sequence_parallel_size", "data_parallel_size")
_NUMBER = re.compile(r"^\s*[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")
_BOOLS = {"true": "true", "t": "true", "yes": "true", "y": "true", "on": "true", "1": "true",
          "false": "false", "f": "false", "no": "false", "n": "false", "off": "false", "0": "false"}
"""The strings pydantic's lax mode reads as booleans."""
_MISSING = object()


def check_deepspeed(ds: dict[str, Any], *, world_size: int, seq_len: int, use_gpu: bool) -> None:
    """Refuse anything DeepSpeed or raytrain would refuse (or silently ignore) in the resolved dict."""
    params = (ds.get("optimizer") or {}).get("params") if isinstance(ds.get("optimizer"), dict) else None
    if isinstance(params, dict) and "max_grad_norm" in params:
        # DeepSpeed refuses it for every optimizer type (in the workers; its parsing only logs a warning).
        raise ConfigError("deepspeed.optimizer.params.max_grad_norm is not an optimizer parameter: clip with "
                          "deepspeed.gradient_clipping instead (\"auto\" or absent: training.gradient_clipping)")
    refuse_old_offload_spellings(ds)  # before DeepSpeed maps them (and warns)
    parsed = ds
    if use_gpu and isinstance(ds.get("aio"), dict) and ds["aio"].get("use_gds") is True:
        # DeepSpeed asserts GPUDirect Storage against the accelerator of the process that parses
        # (swap_tensor/aio_config.py, 0.19.8): the driver's, maybe a CPU, not the GPU workers'.
        parsed = {**ds, "aio": {**ds["aio"], "use_gds": False}}
    with _deepspeed_logs_on_stderr():
        reads = _parse(parsed, world_size)
        _refuse_unread_keys(ds, reads)
        _refuse_quoted_numbers(parsed, reads, world_size)
        _check_param_values(ds)
        _check_constructor_params(ds)
    _raytrain_rules(ds, world_size, seq_len, use_gpu)


# DeepSpeed's old offload switches (runtime/zero/config.py, 0.19.8): the first two it still maps onto
# offload_optimizer / offload_param with a deprecation warning, the third it reads into nothing. raytrain's
# planner, memory facts and optimizer choice read the new sections only: with cpu_offload it would build
# torch's AdamW for a run DeepSpeed offloads, and every worker fails in deepspeed.initialize ("ZeRO-Offload
# with a client provided optimizer").
_UNREAD = ('which raytrain does not read (its plan and optimizer would assume no offload): write "{}": {{"device": '
           '"cpu"}} in zero_optimization instead, or remove it for no offload')
_OLD_OFFLOAD_SPELLINGS = {
    "cpu_offload": _UNREAD.format("offload_optimizer"),
    "cpu_offload_param": _UNREAD.format("offload_param"),
    "cpu_offload_use_pin_memory": 'which neither DeepSpeed nor raytrain reads: write "pin_memory": true inside '
                                  'offload_optimizer (and offload_param) instead, or remove it (pinned is the default)',
}


def refuse_old_offload_spellings(ds: dict[str, Any]) -> None:
    """Refuse DeepSpeed's deprecated cpu_offload* keys, naming their replacement. Called by check_deepspeed and,
    before the planner reads the offload sections, by raytrain.planning.choose.resolve_auto."""
    zero = ds.get("zero_optimization")
    for key, fix in _OLD_OFFLOAD_SPELLINGS.items():
        if isinstance(zero, dict) and key in zero:
            raise ConfigError(f"deepspeed.zero_optimization.{key} is DeepSpeed's old spelling, {fix}")


@contextlib.contextmanager
def _deepspeed_logs_on_stderr():
    """DeepSpeed's logger writes to stdout (deepspeed/utils/logging.py, 0.19.8: a StreamHandler on sys.stdout),
    and its config classes log while they parse (a deprecated key's warning): on the driver that line would
    land in --dry-run's JSON. Meanwhile its lines go to stderr (same format and level), beside raytrain's notes."""
    compat.import_deepspeed_quietly()  # the handler is made by the import
    logger = logging.getLogger("DeepSpeed")
    moved = [h for h in logger.handlers if type(h) is logging.StreamHandler]
    if not moved:
        yield
        return
    # A handler of its own, not setStream on DeepSpeed's: that flushes the old stream, which under a
    # test runner may be a capture closed since the import.
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(moved[0].level)
    stderr.setFormatter(moved[0].formatter)
    for handler in moved:
        logger.removeHandler(handler)
    logger.addHandler(stderr)
    try:
        yield
    finally:
        logger.removeHandler(stderr)
        for handler in moved:
            logger.addHandler(handler)


# ---------------------------------------------------------------------------------------------
# 1. DeepSpeed's parsing, with every lookup recorded.


class _Log:
    def __init__(self) -> None:
        self.lookups: dict[tuple, dict[str, Any]] = {}
        """section path -> {key looked up: the default DeepSpeed gave (or _MISSING)}"""
        self.enumerated: list[tuple] = []
        """sections DeepSpeed took whole (a pydantic model's **kwargs, .items()): checked by their model"""
        self.last: tuple = ()
        """the last key looked up: where an exception from DeepSpeed's hand parsing points"""


class _Reads(dict):
    """A section of the user's dict that records what DeepSpeed reads from it (module docstring, 2)."""

    def __init__(self, data: dict, path: tuple, log: _Log):
        super().__init__(data)
        self._path, self._log = path, log

    def _looked_up(self, key, default=_MISSING):
        section = self._log.lookups.setdefault(self._path, {})
        if key not in section or section[key] is _MISSING:
            section[key] = default
        self._log.last = (*self._path, key)

    def _child(self, key, value):
        if isinstance(value, dict) and not isinstance(value, _Reads):
            value = _Reads(value, (*self._path, key), self._log)
            dict.__setitem__(self, key, value)
        return value

    def get(self, key, default=None):
        self._looked_up(key, default)
        return self._child(key, dict.__getitem__(self, key)) if dict.__contains__(self, key) else default

    def __getitem__(self, key):
        self._looked_up(key)
        return self._child(key, dict.__getitem__(self, key))

    def __contains__(self, key):
        self._looked_up(key)
        return dict.__contains__(self, key)

    def _whole(self):
        self._log.enumerated.append(self._path)

    def keys(self):
        return _Keys(self)  # `key in d.keys()` is a lookup (DeepSpeed writes that), iterating is not

    def __iter__(self):
        self._whole()
        return dict.__iter__(self)

    def items(self):
        self._whole()
        return [(k, self._child(k, v)) for k, v in dict.items(self)]

    def values(self):
        return [v for _, v in self.items()]


class _Keys(KeysView):
    def __contains__(self, key):
        return key in self._mapping  # recorded by _Reads.__contains__

    def __iter__(self):
        self._mapping._whole()
        return dict.__iter__(self._mapping)


def _parse(ds: dict[str, Any], world_size: int) -> _Log:
    from pydantic import ValidationError

    log = _Log()
    root = _Reads(copy.deepcopy(ds), (), log)  # DeepSpeed may edit what it parses; the run's dict stays
    for key in _READ_BY_INITIALIZE:
        root._looked_up(key)
    try:
        compat.parse_deepspeed_config(root, world_size)
    except ValidationError as e:
        raise _from_pydantic(e, ds, log) from None
    except Exception as e:  # AssertionError, ValueError, TypeError, DeepSpeedConfigError (removed features), ...
        raise _from_exception(e, ds, log) from None
    return log


def _from_pydantic(error, ds: dict[str, Any], log: _Log) -> ConfigError:
    first = error.errors(include_url=False)[0]
    loc = tuple(str(p) for p in first["loc"])
    prefix = _section_of(loc, ds, log)
    key = _dotted((*prefix, *loc))
    value = first.get("input")
    if first["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return _one_setting_twice(error.title, loc, prefix, ds) or _unknown(key, _model_keys(error.title, loc[:-1]))
    message = first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if first["type"] in ("model_type", "dict_type", "model_attributes_type"):
        return ConfigError(f"{key} must be a mapping (a JSON object), got {_shown(value)}: "
                           f"see DeepSpeed's config documentation for its keys")
    if not loc:  # a model validator across several keys
        return ConfigError(f"{key or 'deepspeed'}: {message} (DeepSpeed's rule): fix the values there")
    if message.startswith("Input should be "):
        message = "must be " + _deduplicated(message.removeprefix("Input should be "))
    # DeepSpeed's own field validators start with the key ("fp16.loss_scale must be >= 0"): said once
    message = message.removeprefix(f"{'.'.join((*prefix, *loc))} ")
    return ConfigError(f"{key} {message} (DeepSpeed's rule), got {_shown(value)}")


def _deduplicated(choices: str) -> str:
    """pydantic's "0, 1, 2, 3 or 3" (DeepSpeed 0.19.8's ZeroStageEnum lists max_stage = 3 as its own
    member) as "0, 1, 2 or 3"; any other message is returned as it is."""
    head, sep, last = choices.rpartition(" or ")
    items = head.split(", ") + [last] if sep else []
    unique = list(dict.fromkeys(items))
    if not sep or len(unique) == len(items):
        return choices
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " or " + unique[-1]


def _from_exception(error: Exception, ds: dict[str, Any], log: _Log) -> ConfigError:
    """An exception from DeepSpeed's hand-written parsing points at the last key it looked up."""
    try:
        _refuse_strings_for_defaults(ds, log)  # the usual cause: "no" where DeepSpeed wants false
    except ConfigError as quoted:
        return quoted
    text = first_line(error)
    key = _dotted(log.last) if log.last else "deepspeed"
    value = _get(ds, log.last)
    if value is not _MISSING and not isinstance(value, dict) and isinstance(error, (TypeError, AttributeError)) \
            and re.search(r"mapping|has no attribute '(get|keys|items)'", text):
        return ConfigError(f"{key} must be a mapping (a JSON object), got {_shown(value)}")
    shown = f"={json.dumps(value)}" if value is not _MISSING and not isinstance(value, dict) else ""
    return ConfigError(f"{key}{shown}: DeepSpeed refuses it ({text}): fix it there")


def _section_of(loc: tuple, ds: dict[str, Any], log: _Log) -> tuple:
    """Which section of the user's dict a pydantic model was built from: the most recent section
    DeepSpeed took whole under which the error's location exists (the monitors are built from the
    top level itself)."""
    for prefix in [*reversed(log.enumerated), ()]:
        path = (*prefix, *loc)
        if _get(ds, path) is not _MISSING or (loc and _get(ds, path[:-1]) is not _MISSING):
            return prefix
    return log.enumerated[-1] if log.enumerated else ()


def _one_setting_twice(title: str, loc: tuple, prefix: tuple, ds: dict[str, Any]) -> ConfigError | None:
    """A field given under both of its names ("stage3_prefetch_bucket_size" and "prefetch_bucket_size",
    DeepSpeed's alias and field name): pydantic reads the alias and refuses the name as an unknown key,
    whose closest valid key is itself."""
    path = (*prefix, *loc[:-1])
    model, section = _model(title, loc[:-1]), _get(ds, path)
    if model is None or not isinstance(section, dict):
        return None
    for name, field in model.model_fields.items():
        names = (field.alias, name)
        if field.alias and field.alias != name and loc[-1] in names and set(names) <= set(section):
            # (a dotted override under one name replaces the other's value: raytrain.config._ZERO_OTHER_NAME)
            both = " and ".join(f"{_dotted((*path, k))}={json.dumps(section[k], default=str)}" for k in names)
            return ConfigError(f"{both} are one setting under two names (DeepSpeed reads either): keep one")
    return None


def _model(title: str, inner: tuple):
    """The DeepSpeed pydantic model (by its class name) of the section at `inner` under it, or None."""
    from pydantic import BaseModel

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    model = next((c for c in subclasses(BaseModel) if c.__name__ == title), None)
    for part in inner:
        if model is None:
            break
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        inside = (field.annotation, *typing.get_args(field.annotation)) if field is not None else ()
        model = next((tp for tp in inside if isinstance(tp, type) and issubclass(tp, BaseModel)), None)
    return model


def _model_keys(title: str, inner: tuple) -> list[str]:
    """The keys a DeepSpeed pydantic model (by its class name) accepts at `inner` under it."""
    model = _model(title, inner)
    if model is None:
        return []
    return sorted({f.alias or name for name, f in model.model_fields.items()} | set(model.model_fields))


# ---------------------------------------------------------------------------------------------
# 2. and 3.: keys DeepSpeed never read, strings where it reads numbers.


def _refuse_unread_keys(ds: dict[str, Any], log: _Log) -> None:
    whole = set(log.enumerated) | _KWARGS
    for path, looked_up in log.lookups.items():
        section = _get(ds, path)
        if not isinstance(section, dict) or path in whole:
            continue
        for key in section:
            if key not in looked_up:
                raise _unknown(_dotted((*path, key)), sorted(looked_up))


def _refuse_quoted_numbers(ds: dict[str, Any], log: _Log, world_size: int) -> None:
    _refuse_strings_for_defaults(ds, log)
    # Keys inside DeepSpeed's models: a string spelling a number or boolean that its model converts.
    # Spelled so that it no longer reads as one, it is refused exactly where the model wanted one.
    quoted = [p for p in _string_leaves(ds) if _spelled(_get(ds, p))]
    if not quoted:
        return
    probe = copy.deepcopy(ds)
    for path in quoted:
        _set(probe, path, "\x00" + _get(ds, path))
    try:
        _parse(probe, world_size)
    except ConfigError as e:
        for path in quoted:
            if str(e).startswith((_dotted(path) + " ", _dotted(path) + ":", _dotted(path) + "=")):
                raise _quoted(path, _get(ds, path), _spelled(_get(ds, path))) from None
        raise  # (a key the probe did not touch cannot fail: the dict passed once already)


def _refuse_strings_for_defaults(ds: dict[str, Any], log: _Log) -> None:
    """A string where DeepSpeed's `get` has a numeric or boolean default ("gradient_clipping", 0.0)."""
    for path, looked_up in log.lookups.items():
        section = _get(ds, path)
        for key, default in looked_up.items():
            value = section.get(key, _MISSING) if isinstance(section, dict) else _MISSING
            if isinstance(default, (bool, int, float)) and isinstance(value, str):
                raise _quoted((*path, key), value, "boolean" if isinstance(default, bool) else "number")


def _spelled(value: str) -> str | None:
    """"number" or "boolean" when a string spells one (as pydantic's lax mode would read it)."""
    return "number" if _NUMBER.match(value) else "boolean" if value.strip().lower() in _BOOLS else None


def _quoted(path: tuple, value: str, wants: str | None) -> ConfigError:
    wants = wants or "number"
    if _spelled(value) == wants:
        literal = _BOOLS[value.strip().lower()] if wants == "boolean" else value.strip()
        fix = f"write {literal} without quotes"
    else:
        fix = "write true or false (without quotes)" if wants == "boolean" else "write a number (without quotes)"
    return ConfigError(f"{_dotted(path)} is the string {json.dumps(value)}, but DeepSpeed reads a {wants} there: {fix}")


def _string_leaves(node: Any, path: tuple = ()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _string_leaves(v, (*path, k))
    elif isinstance(node, str):
        yield path


# Optimizer params torch's optimizers refuse below 0 in the workers (AdamW: "Invalid learning rate"),
# while DeepSpeed's fused ones would run with them.
_NON_NEGATIVE = ("lr", "eps", "weight_decay")


def _check_param_values(ds: dict[str, Any]) -> None:
    """optimizer.params and scheduler.params go to a constructor as they are, outside DeepSpeed's
    models: a number written as a string ("lr": "3e-4") reaches torch as a string, and a value out of
    range is refused there, each in the workers and retried as a worker failure; a boolean where a
    number goes ("lr": true) is taken as 1 or 0 without a word. The same values under training.* are
    refused on the driver, so these are too."""
    for section in ("optimizer", "scheduler"):
        params = (ds.get(section) or {}).get("params") if isinstance(ds.get(section), dict) else None
        if not isinstance(params, dict):
            continue
        for key, value in params.items():
            pair = isinstance(value, (list, tuple)) and len(value) == 2
            if section == "optimizer" and key == "betas" and not pair:
                # Adam's and Lion's classes (torch's and DeepSpeed's) take two: anything else fails in every worker
                # (torch's AdamW: "'float' object is not subscriptable" for 0.9, an IndexError for [0.9])
                raise ConfigError(f"deepspeed.optimizer.params.betas={json.dumps(value, default=str)} must be a list "
                                  f"of two decay rates (for example [0.9, 0.95])")
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                path = (section, "params", key if i is None else f"{key}[{i}]")
                if isinstance(item, str) and _spelled(item):
                    raise _quoted(path, item, _spelled(item))
                betas = section == "optimizer" and key == "betas"
                # a scheduler's step counts, sizes and learning rates; last_batch_iteration=-1 is legitimate
                checked = key in _NON_NEGATIVE if section == "optimizer" else key.endswith(("steps", "_lr", "size"))
                if isinstance(item, bool) and (betas or checked):
                    # Python's arithmetic reads true as 1 and false as 0: "lr": true would train at 1.0 without a word
                    raise ConfigError(f"{_dotted(path)}={json.dumps(item)} is a boolean, but its constructor reads a "
                                      f"number there (it would take {json.dumps(item)} as {int(item)}): write a number")
                if isinstance(item, bool) or not isinstance(item, (int, float)):
                    continue
                if betas and not 0 <= item < 1:
                    raise ConfigError(f"{_dotted(path)}={item} is outside [0, 1): Adam's and Lion's betas are decay "
                                      f"rates (for example [0.9, 0.95])")
                if item < 0 and checked:
                    raise ConfigError(f"{_dotted(path)}={item} is negative: write a value >= 0")
    clip = ds.get("gradient_clipping")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip < 0:
        # DeepSpeed clips only when the value is > 0: a negative one turns clipping off without a word.
        raise ConfigError(f"deepspeed.gradient_clipping={clip} is negative, which DeepSpeed reads as no clipping: "
                          f"write the maximum gradient norm (for example 1.0), or 0 for none")


def _check_constructor_params(ds: dict[str, Any]) -> None:
    """optimizer.params / scheduler.params against the one class DeepSpeed will build with them, and
    the optimizer against ZeRO's tested list: on the workers an unknown or missing argument is a
    TypeError in deepspeed.initialize, an untested optimizer an assertion, each retried as a worker
    failure."""
    import inspect

    import torch

    compat.import_deepspeed_quietly()
    from deepspeed.runtime import config as ds_config, lr_schedules

    for section in ("optimizer", "scheduler"):
        spec = ds.get(section)
        if not isinstance(spec, dict) or spec.get("type") is None:
            continue
        name = str(spec["type"])
        params = spec.get("params") or {}
        if section == "optimizer":
            known = list(ds_config.DEEPSPEED_OPTIMIZERS) + [n for n in dir(torch.optim) if n[0].isupper()]
            cls, passed, popped = _optimizer_class(name, ds, params)
            _refuse_untested_optimizer(name, cls, ds)
            if cls is None and name.lower() in ds_config.DEEPSPEED_OPTIMIZERS:
                continue  # built by DeepSpeed's own code paths; their keyword arguments vary by device
        else:
            known = list(lr_schedules.VALID_LR_SCHEDULES) + [n for n in dir(torch.optim.lr_scheduler) if n[0].isupper()]
            cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
            passed, popped = set(), set()
            if cls is not None and not hasattr(lr_schedules, name):
                _refuse_torch_scheduler_on_a_wrapped_optimizer(name, ds)
        if cls is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"deepspeed.{section}.type={name!r} is neither DeepSpeed's nor torch's{hint} "
                              f"(DeepSpeed would fail inside the workers)")
        signature = inspect.signature(cls.__init__)
        if not isinstance(params, dict):
            continue
        arguments = {n: p for n, p in signature.parameters.items()
                     if n not in ("self", "params", "model_params", "optimizer") and n not in passed
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [n for n, p in arguments.items() if p.default is p.empty and n not in params]
        if missing:
            fills = " (or \"auto\": raytrain fills it from training)" if missing[0] in _FILLED else ""
            raise ConfigError(f"deepspeed.{section}.params.{missing[0]} is missing: {name} needs it (its "
                              f"constructor would refuse to start in the workers): write a value there{fills}")
        if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            continue
        accepted = set(arguments) | popped
        built = f"{name}, which DeepSpeed builds as {cls.__name__} here" if cls.__name__ != name else name
        for key in params:
            if key not in accepted:
                raise _unknown(f"deepspeed.{section}.params.{key}", sorted(accepted),
                               f"is not a parameter of {built} (its constructor would refuse it in the workers)")


def _refuse_torch_scheduler_on_a_wrapped_optimizer(name: str, ds: dict[str, Any]) -> None:
    """DeepSpeed builds a torch scheduler (0.19.8 engine._scheduler_from_config) on the optimizer it
    holds, which under ZeRO (stage >= 1) or bf16/fp16 is its own wrapper, not a torch.optim.Optimizer:
    torch's LRScheduler raises "DeepSpeedZeroOptimizer_Stage3 is not an Optimizer" in every worker
    (measured: stages 1-3, and stage 0 with bf16; only stage 0 in fp32 builds it)."""
    from deepspeed.runtime import lr_schedules

    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    low_precision = any(isinstance(ds.get(k), dict) and ds[k].get("enabled") not in (None, False, "false")
                        for k in ("bf16", "fp16"))
    if not ((isinstance(stage, int) and stage >= 1) or low_precision):
        return
    why = f"ZeRO stage {stage}" if isinstance(stage, int) and stage >= 1 else "bf16/fp16"
    raise ConfigError(f"deepspeed.scheduler.type={name!r} is torch's, which DeepSpeed builds on its own optimizer "
                      f"wrapper under {why} and torch refuses (\"not an Optimizer\" in every worker): use one of "
                      f"DeepSpeed's ({', '.join(lr_schedules.VALID_LR_SCHEDULES)}) or remove deepspeed.scheduler "
                      f"(raytrain's schedule: training.warmup_steps, training.min_lr_ratio)")


# Scheduler params raytrain fills when they are "auto" (raytrain.deepspeed_config._resolve_optimizer).
_FILLED = {"warmup_num_steps", "total_num_steps", "warmup_max_lr", "warmup_min_lr"}


def _optimizer_class(name: str, ds: dict[str, Any], params: Any) -> tuple[type | None, set[str], set[str]]:
    """(the class DeepSpeed builds for optimizer.type `name`, the arguments it passes itself, the
    params it takes out before the call), as deepspeed/runtime/engine.py (0.19.8)
    _configure_basic_optimizer and get_optimizer_configuration choose: for Adam and AdamW, torch's
    class with torch_adam, DeepSpeedCPUAdam with an offloaded optimizer, else FusedAdam; Adagrad and
    Lion likewise (their CPU twins when offloaded). None for DeepSpeed's other names (Lamb, mup's)."""
    import torch

    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime import config as ds_config

    params = params if isinstance(params, dict) else {}
    lowered = name.lower()
    if lowered not in ds_config.DEEPSPEED_OPTIMIZERS:
        return getattr(torch.optim, name, None), set(), set()
    zero = ds.get("zero_optimization") or {}
    offloaded = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower() in ("cpu", "nvme")
    if lowered == "adagrad":  # the CPU twins with an offloaded optimizer (zero_use_cpu_optimizer)
        return (_deepspeed_class("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad") if offloaded
                else torch.optim.Adagrad), set(), set()
    if lowered == "lion":
        return _deepspeed_class("deepspeed.ops.lion", "DeepSpeedCPULion" if offloaded else "FusedLion"), set(), set()
    if lowered not in ("adam", "adamw"):
        return None, set(), set()
    popped = {ds_config.ADAM_W_MODE, ds_config.TORCH_ADAM_PARAM, "fp32_optimizer_states"}
    adam_w_mode = lowered == "adamw" or params.get(ds_config.ADAM_W_MODE, ds_config.ADAM_W_MODE_DEFAULT)
    if params.get(ds_config.TORCH_ADAM_PARAM):
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), {"foreach"}, popped | {"foreach"}
    if offloaded:
        return DeepSpeedCPUAdam, {"adamw_mode", "fp32_optimizer_states"}, popped
    return FusedAdam, {"adam_w_mode"}, popped


def _refuse_untested_optimizer(name: str, cls: type | None, ds: dict[str, Any]) -> None:
    """ZeRO (stage >= 1) asserts that its optimizer is one it was tested with, unless
    zero_allow_untested_optimizer is true (deepspeed/runtime/engine.py, 0.19.8:
    _do_optimizer_sanity_check against zero/utils.py ZERO_SUPPORTED_OPTIMIZERS)."""
    import torch

    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero.get("stage", 0), int) or zero.get("stage", 0) < 1 or ds.get("zero_allow_untested_optimizer"):
        return
    lowered = name.lower()
    if lowered == "muon":
        return  # MuonWithAuxAdam: is_zero_supported_optimizer adds it to the list when it checks
    if cls is None:  # DeepSpeed's own names other than Adam/AdamW build these (with offload: the CPU twins)
        cls = {"adagrad": torch.optim.Adagrad, "lion": _deepspeed_class("deepspeed.ops.lion", "FusedLion"),
               "lamb": _deepspeed_class("deepspeed.ops.lamb", "FusedLamb")}.get(lowered)
        if cls is None and lowered not in ("muadam", "muadamw", "musgd"):  # mup's classes are never in the list
            return  # neither DeepSpeed's nor torch's: refused next, with the closest name
    if cls is not None and cls in ZERO_SUPPORTED_OPTIMIZERS:
        return
    raise ConfigError(f"deepspeed.optimizer.type={name!r} is not an optimizer ZeRO (stage {zero['stage']}) supports; "
                      f"DeepSpeed would refuse it in the workers: use Adam, AdamW, Adagrad or Lion, or set "
                      f"deepspeed.zero_allow_untested_optimizer=true to run it untested")


def _deepspeed_class(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------
# 4. raytrain's rules.


def _raytrain_rules(ds: dict[str, Any], world_size: int, seq_len: int, use_gpu: bool) -> None:
    zero = ds.get("zero_optimization") or {}
    if isinstance(zero.get("stage"), bool):
        # pydantic's lax mode reads true as stage 1 and false as stage 0: a ZeRO that shards nothing
        # the user asked for, without a word.
        raise ConfigError(f"deepspeed.zero_optimization.stage is {json.dumps(zero['stage'])}, but it is a stage "
                          f"number: write 3 (ZeRO-3 shards parameters, gradients and optimizer states) or 0-2")
    stage = int(zero.get("stage", 0))
    if str((zero.get("offload_param") or {}).get("device", "none")).lower() != "none" and stage != 3:
        # DeepSpeed ignores offload_param below stage 3 (only stage 3 partitions parameters).
        raise ConfigError(f"deepspeed.zero_optimization.offload_param needs stage 3 (stage is {stage}): "
                          f"set zero_optimization.stage=3 or remove offload_param")
    for which in ("offload_optimizer", "offload_param"):
        section = zero.get(which) or {}
        if str(section.get("device", "none")).lower() == "nvme" and not section.get("nvme_path"):
            # DeepSpeed finds out when the first swap file is opened, inside the workers.
            raise ConfigError(f"deepspeed.zero_optimization.{which}.device is nvme but nvme_path is missing: "
                              f"set zero_optimization.{which}.nvme_path to a local NVMe directory")
    hpz = zero.get("zero_hpz_partition_size")
    if hpz is not None and hpz > 1 and world_size % hpz:
        # DeepSpeed builds the hpZ groups inside deepspeed.initialize and fails there.
        raise ConfigError(f"deepspeed.zero_optimization.zero_hpz_partition_size={hpz} does not divide world size "
                          f"{world_size}: use the GPUs per node or a divisor of {world_size}")
    sequence_parallel = ds.get("sequence_parallel_size")
    if sequence_parallel is not None and sequence_parallel != 1:
        # deepspeed.initialize and zero.Init count world size / sequence_parallel_size data-parallel ranks
        # (runtime/config.py, 0.19.8), so the batch assertion fails in every worker, a retried failure; raytrain
        # feeds every rank whole sequences and never wraps the attention, as Ulysses would need.
        raise ConfigError(f"deepspeed.sequence_parallel_size={json.dumps(sequence_parallel)}: raytrain does not run "
                          f"DeepSpeed's sequence parallelism (every worker trains on whole sequences), and DeepSpeed "
                          f"would count world size {world_size} / {sequence_parallel} data-parallel ranks and fail its "
                          f"batch check in every worker: remove it")
    data_parallel = ds.get("data_parallel_size")
    if data_parallel is not None and data_parallel != world_size:
        # With sequence_parallel_size beside it, deepspeed.initialize builds a (data, sequence) device mesh of that
        # shape: bigger than the world, torch refuses it in every worker; smaller, it leaves workers out. Alone,
        # DeepSpeed ignores it. Either way the user expects a data-parallel degree raytrain does not run: every
        # worker is a data-parallel rank.
        raise ConfigError(f"deepspeed.data_parallel_size={json.dumps(data_parallel)} is not this run's world size "
                          f"{world_size}: raytrain's data-parallel ranks are its workers (each reads its own data "
                          f"shard), so it is scaling.num_workers that sets it: remove data_parallel_size")
    checkpoint = ds.get("checkpoint")
    if isinstance(checkpoint, dict) and checkpoint.get("load_universal"):
        # raytrain adds it itself where a checkpoint was written by another number of workers and converted
        # (raytrain.checkpoint.reshard); set here, every load of a checkpoint as written (a continued run, Ray
        # Train's restart after a worker failure) fails in every worker: "latest_universal does not exist".
        raise ConfigError(f"deepspeed.checkpoint.load_universal={json.dumps(checkpoint['load_universal'])} is "
                          f"raytrain's to set: it converts a checkpoint to DeepSpeed's universal form and loads that "
                          f"when the number of workers changes; set here, continuing or restarting from a checkpoint "
                          f"as written would fail in every worker: remove it")
    tensor_parallel = ds.get("tensor_parallel")
    autotp = tensor_parallel.get("autotp_size") if isinstance(tensor_parallel, dict) else None
    if isinstance(autotp, (int, float)) and not isinstance(autotp, bool) and autotp > 1:
        # AutoTP wants one batch for every rank of a tensor-parallel group and checks it at each forward
        # (runtime/engine.py, 0.19.8): raytrain hands each worker its own data shard, so every worker fails at
        # its first step with "Data inconsistency within the TP group".
        raise ConfigError(f"deepspeed.tensor_parallel.autotp_size={autotp}: raytrain does not run DeepSpeed's AutoTP "
                          f"(each worker reads its own data shard, and AutoTP needs one batch on all {autotp} ranks of "
                          f"a tensor-parallel group: every worker would fail at its first step): remove it (ZeRO-3 "
                          f"already shards the model over all workers)")
    if stage == 3 and not use_gpu:
        _refuse_zero_quantization_on_cpu(zero)
    if not use_gpu:
        _refuse_hybrid_engine_on_cpu(ds.get("hybrid_engine"))
    _check_steps_per_print(ds.get("steps_per_print"))
    micro = ds["train_micro_batch_size_per_gpu"]
    if micro * seq_len > MAX_TOKENS_PER_MICRO_BATCH:
        raise ConfigError(f"deepspeed.train_micro_batch_size_per_gpu={micro} x data.seq_len={seq_len} = "
                          f"{micro * seq_len:,} tokens per micro-batch, more than {MAX_TOKENS_PER_MICRO_BATCH:,} "
                          f"(int32 indexing; the token ids alone would take {micro * seq_len * 8 / 2**30:,.0f} GiB "
                          f"per GPU): lower the micro-batch (training.micro_batch_size_per_gpu)")


def _refuse_zero_quantization_on_cpu(zero: dict[str, Any]) -> None:
    """ZeRO++'s quantized all-gather and reduce-scatter (stage 3 only) load DeepSpeed's QuantizerBuilder, which
    its CPU accelerator has no kernels for (accelerator/cpu_accelerator.py, 0.19.8: NotImplementedBuilder):
    every worker fails in deepspeed.initialize (weights) or at the first backward (gradients). Asked of
    DeepSpeed's CPU accelerator, so the rule goes once a DeepSpeed version has them."""
    keys = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
            if zero.get(k) is True]
    if not keys or not _no_cpu_kernels("QuantizerBuilder"):
        return
    raise ConfigError(f"deepspeed.zero_optimization.{keys[0]}=true needs GPUs (DeepSpeed has no CPU kernels for "
                      f"ZeRO++'s quantization: \"This op had not been implemented on CPU backend\" in every worker), "
                      f"and this run is on CPU (scaling.use_gpu=false): set it to false, or run on GPUs with "
                      f"scaling.use_gpu=true")


def _refuse_hybrid_engine_on_cpu(hybrid: Any) -> None:
    """DeepSpeed-Chat's hybrid engine swaps DeepSpeed's inference kernels into the model inside deepspeed.initialize
    (runtime/hybrid_engine.py, 0.19.8), and its CPU accelerator has none (InferenceBuilder is a NotImplementedBuilder):
    every worker fails there, retried by Ray Train (measured: "This op had not been implemented on CPU backend").
    Asked of DeepSpeed's CPU accelerator, like ZeRO++'s quantization. On GPUs it is left to DeepSpeed: not run here."""
    if not (isinstance(hybrid, dict) and hybrid.get("enabled") is True) or not _no_cpu_kernels("InferenceBuilder"):
        return
    raise ConfigError("deepspeed.hybrid_engine.enabled=true needs GPUs (DeepSpeed's hybrid engine swaps in its "
                      "inference kernels, which have no CPU build: \"This op had not been implemented on CPU "
                      "backend\" in every worker), and this run is on CPU (scaling.use_gpu=false): set it to false "
                      "(raytrain's training does not use it)")


def _no_cpu_kernels(builder: str) -> bool:
    """DeepSpeed's CPU accelerator has no build of the op `builder` (a NotImplementedBuilder), asked of DeepSpeed
    itself so that a rule built on it goes once a version has one."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return CPU_Accelerator().get_op_builder(builder).__name__ == "NotImplementedBuilder"


def _check_steps_per_print(every: Any) -> None:
    """DeepSpeed reads steps_per_print with a plain get (default None: never print) and, after every step,
    prints when (step + 1) % steps_per_print == 0 (runtime/engine.py, 0.19.8): 0 (or false) is a
    ZeroDivisionError in every worker at step 1, a string a TypeError. 1e9 in JSON is a float: it works."""
    if every is None or (isinstance(every, (int, float)) and not isinstance(every, bool) and every >= 1
                         and (isinstance(every, int) or every.is_integer())):
        return
    if isinstance(every, str) and _spelled(every) == "number":
        raise _quoted(("steps_per_print",), every, "number")
    raise ConfigError(f"deepspeed.steps_per_print={json.dumps(every)} must be a positive integer (DeepSpeed takes "
                      f"each step's number modulo it, and 0 is a ZeroDivisionError in every worker at step 1): write a "
                      f"number of steps >= 1, or leave it out (raytrain's default, "
                      f"{DEFAULT_DEEPSPEED['steps_per_print']}, keeps DeepSpeed's own progress line quiet)")


# ---------------------------------------------------------------------------------------------


def _unknown(key: str, valid: list[str],
             what: str = "is not a key DeepSpeed reads (it would be ignored)") -> ConfigError:
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {parent}.{close[0]}?" if close else ""
    keys = f"valid keys there: {', '.join(valid)}" if 0 < len(valid) <= 12 else \
        f"see DeepSpeed's config documentation for the keys under {parent}"
    return ConfigError(f"{key} {what}{hint} ({keys})")


def _dotted(path: tuple) -> str:
    return ".".join(["deepspeed", *map(str, path)])


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(node: dict, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {json.dumps(value, default=str)}"
