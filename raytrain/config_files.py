"""Reading what the user wrote: YAML run configs, KEY=VALUE overrides and JSON files, as plain data.

Every way a file can be wrong is a one-line `ConfigError` naming the file (and line) and the fix:
it does not exist, is a directory, cannot be read, is not UTF-8, is not valid YAML/JSON, holds the
same key twice, is not a mapping, or is another kind of file than the one expected (a Ray cluster file
or a DeepSpeed JSON given as the run config, a run config given as deepspeed=FILE). The typed tree built
from this data is raytrain.config.

YAML is read with `RunConfigLoader`, PyYAML's SafeLoader with two changes, for files and overrides
alike:
- a key given twice in one mapping (at any depth, e.g. the same section twice) is an error;
  PyYAML's default keeps the last one and silently drops the first;
- numbers follow YAML 1.2's core schema: `1e-3` and `5E-4` are floats (YAML 1.1, PyYAML's default,
  reads a float without a dot as a string, so `training.learning_rate=1e-3` failed as "got str"), and
  what YAML 1.1 rewrote into another number stays the text it is: `022` (1.1: octal 18), `1:1`
  (1.1: base 60, 61), `1_000` and `0b11`. An integer with a leading 0 is text in either reading
  (1.2 would read `022` as 22, not what a user who meant octal typed): `checkpoint.name=0755` is the
  name "0755", and `training.max_steps=022` is an error naming the value as typed. Octal is `0o22`,
  hex `0x12`. YAML 1.1's booleans stay (`yes`/`no`/`on`/`off` are true/false): the README's examples
  and users' files rely on them, and a type error names them where a string was meant;
- network.env values are environment variables, strings: a number there is kept as typed
  (`NCCL_IB_TIMEOUT=022` is "022", `1e-3` "1e-3"), never re-printed from the number YAML made of it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml


class ConfigError(ValueError):
    """A mistake in the user's configuration or input files; the message says how to fix it."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its class name: what a one-line ConfigError quotes
    of the library error behind it."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class RunConfigLoader(yaml.SafeLoader):
    """SafeLoader + duplicate keys refused + YAML 1.2 numbers (module docstring)."""


_INT, _FLOAT, _STR = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:str"
# YAML 1.2 core schema numbers in place of YAML 1.1's (whose int resolver also takes 0NNN as octal, 1:1 as
# base 60, 0b11 and 1_000; its float resolver 1:1.5 and 1_0.5, and no exponent without a dot), less a decimal
# integer with a leading 0 (module docstring). A plain scalar matching neither is a string. PyYAML's own
# int and float constructors read every form these let through as YAML 1.2 does ("0o17" is int("0o17", 8)).
_INT_12 = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9]*)|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+)"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
RunConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in yaml.SafeLoader.yaml_implicit_resolvers.get(first, [])
            if tag not in (_INT, _FLOAT)]
    + [(tag, regexp) for tag, regexp, firsts in ((_INT, _INT_12, "-+0123456789"), (_FLOAT, _FLOAT_12, "-+.0123456789"))
       if first in firsts]
    for first in set(yaml.SafeLoader.yaml_implicit_resolvers) | set("-+.0123456789")}


def _refuse_duplicates(node: yaml.Node, where: str, path: str = "") -> None:
    """Raise on a mapping key given twice anywhere under `node` (checked on the composed node tree,
    where each key still has its line)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":  # "<<" is YAML's merge key; its entries may be overridden
                dotted = f"{path}.{key}" if path else str(key)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"{where} line {line}: key {dotted} is given twice (first at line {seen[key]}); "
                                      f"the second would silently replace the first: keep one")
                seen[key] = line
                _refuse_duplicates(value_node, where, dotted)
            else:
                _refuse_duplicates(value_node, where, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(item, where, f"{path}[{i}]")


def yaml_11_number(text: Any) -> int | float | None:
    """The number YAML 1.1 (PyYAML's default) reads `text` as, where RunConfigLoader reads it as a string
    (022, 1:1, 1_000, 0b11); else None. For the type error of a number field given one: it names both."""
    if not isinstance(text, str) or not text or text[0] not in "-+.0123456789" or quoted_number(text):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return value if type(value) in (int, float) else None


def quoted_number(text: Any) -> bool:
    """Whether `text` is a string that RunConfigLoader itself reads as a number when unquoted ("10", "1e-3"):
    a number quoted in YAML (`training.max_steps="10"`), not one that YAML 1.1 and 1.2 read differently."""
    return isinstance(text, str) and (_INT_12.match(text) is not None and not re.match(r"[-+]?0[0-9]", text)
                                      or _FLOAT_12.match(text) is not None)


# The section whose values are environment variables (raytrain.config.NetworkConfig.env): strings as typed.
_ENV_SECTION = "network.env"


def _env_values_as_written(node: yaml.Node, path: str) -> None:
    """Retag the plain numbers under network.env (`path`: where `node` sits in the run config) as strings,
    so each is constructed from its text: `0x10` stays "0x10" and `1e-3` "1e-3", where str() of the number
    YAML read would pass NCCL "16" and "0.001" (NCCL parses its integers itself, strtoll with base 0). Quoted
    values are strings already; booleans, null and lists keep their tags (the field refuses them, naming
    the key)."""
    if path.startswith(_ENV_SECTION + ".") and path.count(".") == _ENV_SECTION.count(".") + 1:
        if isinstance(node, yaml.ScalarNode) and node.style is None and node.tag in (_INT, _FLOAT):
            node.tag = _STR
    elif isinstance(node, yaml.MappingNode) and (not path or _ENV_SECTION == path
                                                 or _ENV_SECTION.startswith(path + ".")):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                _env_values_as_written(value_node, f"{path}.{key_node.value}" if path else str(key_node.value))


def _load(text: str, where: str, path: str = "") -> Any:
    """One YAML document read with RunConfigLoader (duplicates: ConfigError; syntax: yaml.YAMLError); `path`: the
    key it is the value of in the run config ("" for a whole file, the KEY of an override)."""
    loader = RunConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(node, where)
        _env_values_as_written(node, path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_yaml(text: str, where: str) -> Any:
    """Parse one YAML document; `where` names it in errors ("config file x.yaml")."""
    try:
        return _load(text, where)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML ({problem}{at}): fix the syntax there") from None


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of a user's file; `what` names it in errors (e.g. "config file", "deepspeed: file")."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        raise ConfigError(f"{what} {path} is a directory: give the path of the file itself")
    if not os.path.exists(expanded):
        # A relative path is read from the current directory (as every command line does), not from
        # the directory of the YAML file that names it: say which directory that was.
        relative = "" if os.path.isabs(expanded) else f" (relative to the current directory {os.getcwd()})"
        raise ConfigError(f"{what} {path} does not exist{relative}: check the path")
    try:
        with open(expanded, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror or type(e).__name__}): "
                          f"check its permissions") from None
    try:
        return raw.decode("utf-8-sig")  # a UTF-8 byte order mark is tolerated, as editors write one
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}): "
                          f"save it as UTF-8") from None


def read_yaml_file(path: str) -> dict[str, Any]:
    """A YAML run config as a plain mapping ({} for an empty file)."""
    data = parse_yaml(read_text(path, "config file"), f"config file {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections (model, data, training, ...), "
                          f"got {type(data).__name__}")
    if _RAY_UP_KEYS.intersection(data):  # else "unknown key cluster_name; did you mean cluster?": the wrong way
        raise ConfigError(f"config file {path} is a Ray cluster file (for ray up), not a run config: "
                          f"pass a run config such as configs/llama-1b-1gpu.yaml")
    deepspeed = [key for key in data if key in _DEEPSPEED_KEYS
                 and (key != "checkpoint" or _deepspeed_checkpoint_section(data[key]))]
    if deepspeed and not (RUN_CONFIG_SECTIONS - _DEEPSPEED_KEYS).intersection(data):
        # JSON is YAML: a ds_config.json given to --config read as a run config whose first key was unknown
        raise ConfigError(f"config file {path} is a DeepSpeed config ({', '.join(deepspeed[:3])}), not a run config: "
                          f"pass it as deepspeed={path} (and a run config, if any, with --config)")
    return data


# Top-level keys of a `ray up` cluster file (cluster/*.yaml) that no run config has.
_RAY_UP_KEYS = frozenset({"cluster_name", "provider", "available_node_types", "head_node_type"})
# The run config's sections (raytrain.config.RunConfig's fields; tests/unit/test_config.py keeps them equal).
RUN_CONFIG_SECTIONS = frozenset({"model", "data", "training", "scaling", "checkpoint", "cluster", "network", "tracking",
                                 "deepspeed"})
# Top-level keys of a DeepSpeed config (deepspeed/runtime/constants.py, 0.19.8): the ones its users' files open
# with. "checkpoint" is one too, and a run config's section: it tells neither apart.
_DEEPSPEED_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "zero_optimization", "fp16", "bf16", "amp", "optimizer", "scheduler", "gradient_clipping",
                             "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                             "activation_checkpointing", "communication_data_type", "prescale_gradients",
                             "flops_profiler", "checkpoint"})


# The keys of DeepSpeed's own "checkpoint" section (deepspeed/runtime/constants.py; "writer": its checkpoint engines).
_DEEPSPEED_CHECKPOINT_KEYS = frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                                       "writer"})


def _deepspeed_checkpoint_section(section: Any) -> bool:
    """Whether a top-level "checkpoint" is DeepSpeed's (only its keys) rather than a run config's (storage_path,
    name, ...: a run config of that one section was refused as a DeepSpeed config)."""
    return isinstance(section, dict) and bool(section) and set(section) <= _DEEPSPEED_CHECKPOINT_KEYS


def parse_override(item: str) -> tuple[str, Any]:
    """KEY=VALUE -> (KEY, VALUE read as YAML: numbers, true/false, null, lists and mappings). A '#' is
    part of the value, never the start of a YAML comment (`checkpoint.name=run #2` is "run #2")."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep and item.lower().endswith((".yaml", ".yml")):
        raise ConfigError(f"override {item!r} is not KEY=VALUE: a run config file comes after --config: "
                          f"--config {item}")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not KEY=VALUE: write for example training.max_steps=20")
    if any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: {key!r} has an empty part between dots: write for example "
                          f"training.max_steps=20")
    if raw == "":
        return key, ""
    if "#" in raw and _has_comment(raw):
        # A '#' the shell passed on is part of the value: YAML would read " #2" as a comment and cut
        # `checkpoint.name=run #2` to the name of another run. The plain string, as written (a
        # number or list with a '#' after it is then a type error naming the key, not a shorter value).
        return key, raw
    try:
        return key, _load(raw, f"override {key}", key)
    except yaml.YAMLError:
        return key, raw  # not YAML (e.g. "a: b: c"): the plain string, as written


def _has_comment(text: str) -> bool:
    """Whether YAML would drop part of `text` as a comment: a '#' outside every token it scans
    (quoted "a #b" and plain a#b are inside their scalars). False where it does not scan at all."""
    try:
        spans = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(text, Loader=RunConfigLoader)]
    except yaml.YAMLError:
        return False
    return any(c == "#" and not any(start <= i < end for start, end in spans) for i, c in enumerate(text))


def read_json_file(path: str, key: str) -> dict[str, Any]:
    """A JSON object named by config key `key`, with a one-line error for each way it fails."""
    text = read_text(path, f"{key}: file")

    def refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:  # json keeps the last silently; DeepSpeed's own loader refuses it too
                raise ConfigError(f"{key}: {path} has the key {k!r} twice in one object; the second would "
                                  f"silently replace the first: keep one")
            out[k] = v
        return out

    try:
        data = json.loads(text, object_pairs_hook=refuse_duplicates)
    except json.JSONDecodeError as e:
        _refuse_yaml(path, key, text)
        raise ConfigError(f"{key}: {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                          f"fix it there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _refuse_yaml(path: str, key: str, text: str) -> None:
    """A ConfigError for a YAML file given where a JSON one goes (`text`: not valid JSON): a run config
    (`deepspeed=configs/seed-8gpu.yaml`, the two files swapped) is named as one, any other .yaml/.yml as
    YAML. Nothing for a file that is neither: the JSON error says where it is wrong."""
    try:
        data = _load(text, f"{key}: {path}")
    except (yaml.YAMLError, ConfigError):
        data = None
    sections = sorted(RUN_CONFIG_SECTIONS.intersection(data)) if isinstance(data, dict) else []
    if sections and not _DEEPSPEED_KEYS.issuperset(sections):
        raise ConfigError(f"{key}: {path} is a run config (sections {', '.join(sections)}), not DeepSpeed's JSON: "
                          f"pass it with --config {path}")
    if path.lower().endswith((".yaml", ".yml")):
        raise ConfigError(f"{key}: {path} is YAML, and {key}= takes DeepSpeed's JSON config: write it as JSON, or "
                          f"put its settings under {key}: in a run config (--config)")
