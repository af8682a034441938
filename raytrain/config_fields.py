"""How a run-config field is declared, and how a mistake in one becomes one line naming its key.

raytrain.config declares every field once, with its type, range and choices beside it:

    warmup_steps: Annotated[Int, Field(ge=0)] = 10
    precision: Literal["fp32", "bf16", "fp16"] | None = None

`section` makes each section a pydantic dataclass (unknown keys refused). pydantic checks the
declarations wherever a section is built: a loaded file, a worker's `RunConfig.from_dict`, a
direct `DataConfig(...)` in code. `one_line` turns pydantic's ValidationError into a ConfigError
whose words come from the same declaration: `training.warmup_steps must be an integer >= 0, got
-1`, `unknown key training.max_step; did you mean training.max_steps? (valid keys under ...)`.

Scalars are strict (`Int`, `Float`, `Bool`, `Str`): pydantic's default mode would read the string
"10" as 10 and 1 as true; a YAML value of the wrong type is a mistake to report, not to convert.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import math
import re
import types
import typing
from typing import Annotated, Any, Literal

import pydantic.dataclasses
from pydantic import ConfigDict, Field, Strict, ValidationError

from raytrain.config_files import ConfigError, quoted_number, yaml_11_number

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # an int is a float too: `learning_rate: 1`
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
NonEmptyStr = Annotated[Str, Field(min_length=1)]
"""A path, URI or name: "" is refused (as a path it would be the current directory)."""

SECTIONS: dict[str, type] = {}
"""Every section by its key ("data": DataConfig), for "did you mean data.seq_len?" across sections."""


def section(key: str):
    """Class decorator: a pydantic dataclass that refuses unknown keys and whose direct construction,
    like `DataConfig(format="csv")`, raises the same one-line ConfigError as a loaded file does."""

    def wrap(cls):
        cls = pydantic.dataclasses.dataclass(cls, config=ConfigDict(extra="forbid"))
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise one_line(e, cls, key) from None

        cls.__init__ = __init__
        if key:
            SECTIONS[key] = cls
        return cls

    return wrap


# ---------------------------------------------------------------------------------------------
# Field validators: rules a type and a range cannot say. Each raises ValueError with the reason;
# `one_line` prefixes the key and the value.

_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def ray_address(value: str) -> str:
    """A Ray address as ray.init takes it: "auto", "local", HOST:PORT or ray://HOST:PORT.

    Ray's own parser takes "host:" or "host:abc" and fails later, deep in the connection, with a
    traceback; an http:// address is the dashboard's (what `ray job submit` wants), not the GCS's."""
    if value in ("auto", "local"):
        return value
    if value.startswith(("http://", "https://")):
        raise ValueError("is the dashboard's address (what `ray job submit` takes), not the cluster's: give "
                         "the head's GCS address HOST:6379 (or ray://HOST:10001 for Ray Client)")
    scheme, sep, rest = value.rpartition("://")
    match = _HOST_PORT.fullmatch(rest)  # not match(): its `$` passed "head:6379\n" (a RAY_ADDRESS read from a file)
    if (sep and scheme != "ray") or not match or not 0 < int(match.group(1)) < 65536:
        raise ValueError("is not a Ray address: write HOST:PORT (the head's GCS port, e.g. 10.0.0.1:6379), "
                         "ray://HOST:PORT (Ray Client), auto or local")
    return value


def worker_range(value: int | list[int]) -> int | list[int]:
    """scaling.num_workers as [min, max] (an elastic run): two integers, 1 <= min <= max. (Ray
    itself accepts a minimum of 0, and takes only a tuple: raytrain.driver.run converts.)"""
    if isinstance(value, int):
        return value
    if len(value) != 2:
        raise ValueError("is neither a number of workers nor [min, max] (an elastic range): write for example 4 "
                         "or [2, 4]")
    low, high = value
    if low < 1:
        raise ValueError(f"has the minimum {low}: an elastic range needs at least 1 worker, for example "
                         f"[1, {max(high, 1)}]")
    if low > high:  # the swap, but never a minimum of 0 ([1, 0] was told "write [0, 1]", refused next)
        raise ValueError(f"has the minimum {low} above the maximum {high}: write [{max(high, 1)}, {low}]")
    return value


def directory_name(value: str) -> str:
    if not value.strip() or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError("is not one directory name: write a name without '/', for example my-run")
    return value


# ---------------------------------------------------------------------------------------------
# pydantic's ValidationError as one line.


def one_line(error: ValidationError, cls: type, key: str) -> ConfigError:
    """The first error of `error` (raised building `cls`, found at config key `key`) as one line."""
    first = error.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a section's cross-field rule (its __post_init__)
        return cause
    where, tp, owner = _locate(cls, first["loc"], key)
    kind, value = first["type"], first.get("input")
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return _unknown_key(where, owner)
    if isinstance(cause, ValueError):  # a field validator's reason
        return ConfigError(f"{where}={value!r} {cause}")
    if first["loc"][-1] == "[key]":  # a mapping's key, such as `model.config: {1: 2}`
        return ConfigError(f"{where.rpartition('.')[0]} has the key {_shown(value)}: its keys must be strings "
                           f"(field names): write the name there")
    hint = ""
    if isinstance(value, datetime.date) and "a string" in describe(tp):
        hint = f": YAML reads an unquoted {value.isoformat()} as a date; quote it (\"{value.isoformat()}\")"
    elif yaml_11_number(value) is not None and re.search(r"\b(an integer|a number)\b", describe(tp)):
        # 022, 1_000, 1:1: numbers in YAML 1.1 (octal 18, 1000, base-60 61), text in 1.2 (raytrain.config_files)
        octal = re.fullmatch(r"([-+]?)0+([0-7]+)", value)
        octal = f"; octal is written {octal[1]}0o{octal[2]}" if octal else ""
        hint = (f": not a number in YAML 1.2, which raytrain reads (YAML 1.1 made it {yaml_11_number(value)!r}): "
                f"write it without the leading 0, '_' or ':'{octal}")
    elif quoted_number(value) and re.search(r"\b(an integer|a number)\b", describe(tp)):
        hint = f": a number in quotes is a string: write {value} without the quotes"
    elif value is None and describe(tp).startswith("a mapping"):
        hint = f": YAML reads a section with nothing under it (all commented out) as null; write {where}: {{}} or delete it"
    return ConfigError(f"{where} must be {describe(tp)}, got {_shown(value)}{hint}")


def _locate(cls: type, loc: tuple, key: str) -> tuple[str, Any, type | None]:
    """(dotted key, declared type, the dataclass owning the last key) of an error's location."""
    where, tp, owner = key, cls, None
    for part in loc:
        tp = _unwrap(tp)
        if dataclasses.is_dataclass(tp):
            owner, where = tp, f"{where}.{part}" if where else str(part)
            tp = typing.get_type_hints(tp, include_extras=True).get(str(part), Any)
        elif typing.get_origin(tp) is dict:
            where, tp = f"{where}.{part}", typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list and isinstance(part, int):
            where, tp = f"{where}[{part}]", typing.get_args(tp)[0]
        else:
            break  # a union member's tag ("str", "list[str]"): the field's whole type describes it
    return where, tp, owner


def _unknown_key(where: str, owner: type | None) -> ConfigError:
    parent, _, name = where.rpartition(".")
    valid = [f.name for f in dataclasses.fields(owner)] if owner else []
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?"
    else:  # the right key in another section: training.seq_len -> data.seq_len
        other = [k for k, s in SECTIONS.items() if name in {f.name for f in dataclasses.fields(s)}]
        hint = f"; did you mean {other[0]}.{name}?" if other else ""
    return ConfigError(f"unknown key {where}{hint} (valid keys under {parent or 'the run config'}: {', '.join(valid)})")


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _limits(tp: Any) -> dict[str, Any]:
    """The Field(ge=..., lt=..., min_length=...) constraints declared on a type."""
    out: dict[str, Any] = {}
    while typing.get_origin(tp) is Annotated:
        for meta in typing.get_args(tp)[1:]:
            for item in [meta, *getattr(meta, "metadata", [])]:
                for name in ("ge", "gt", "le", "lt", "min_length", "max_length"):
                    if getattr(item, name, None) is not None:
                        out[name] = getattr(item, name)
        tp = typing.get_args(tp)[0]
    return out


def describe(tp: Any) -> str:
    """A declared type in words: "an integer >= 1", "fp32, bf16 or fp16", "a list of 2 numbers in [0, 1)"."""
    limits, base = _limits(tp), _unwrap(tp)
    origin = typing.get_origin(base)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(base)
        words = [describe(a) for a in args if a is not type(None)]
        if "a number" in words and "an integer" in words:  # Int | Float: a number
            words.remove("an integer")
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is Literal:
        choices = [str(c) for c in typing.get_args(base)]
        return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    if origin is list:
        n = limits.get("min_length")
        count = f"{n} " if n is not None and n == limits.get("max_length") else ""
        item = describe(typing.get_args(base)[0]).removeprefix("an ").removeprefix("a ")
        for one, many in (("number", "numbers"), ("string", "strings"), ("integer", "integers")):
            item = item.replace(one, many, 1) if item.startswith(one) else item
        return f"a list of {count}{item}"
    if origin is dict or dataclasses.is_dataclass(base):
        return "a mapping"
    if base is bool:
        return "true or false"
    name = {int: "an integer", float: "a number", str: "a string"}.get(base, getattr(base, "__name__", str(base)))
    return name + _range(limits)


def _range(limits: dict[str, Any]) -> str:
    low = ("[", limits["ge"]) if "ge" in limits else ("(", limits["gt"]) if "gt" in limits else None
    high = ("]", limits["le"]) if "le" in limits else (")", limits["lt"]) if "lt" in limits else None
    if low and high:
        return f" in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f" {'<=' if high[0] == ']' else '<'} {high[1]}"
    return " (not empty)" if limits.get("min_length") else ""


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isinf(value):  # what 1e400 reads as
        return f"{value} (a number too large for a float)"
    if isinstance(value, (int, float)):
        return f"{value}"
    if isinstance(value, datetime.date):  # YAML's reading of an unquoted 2024-06-01
        return f"date {value.isoformat()}"
    return f"{type(value).__name__} {value!r}"
