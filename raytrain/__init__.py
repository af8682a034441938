"""raytrain: train causal language models with DeepSpeed ZeRO-3 on a Ray cluster.

Entry points: `python -m raytrain.main` (command line) and `raytrain.fit(config)` (notebooks).
Where to start reading: docs/architecture.md (the layout, and the path of a run from `main` to a
worker step); then config.py (the typed run config) and run_spec.py (the driver-to-worker contract).
"""

from __future__ import annotations

import os
from typing import Any

from raytrain import config as _config
from raytrain.config import ConfigError, RunConfig

__all__ = ["ConfigError", "RunConfig", "fit", "load_config"]


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (),
                values: dict[str, Any] | None = None) -> RunConfig:
    """The run config from an optional YAML file and KEY=VALUE overrides (dotted keys), as the command
    line builds it: `load_config("run.yaml", ["training.max_steps=20"])`. `values`: more overrides whose
    values are taken as given, not read as YAML (`{"data.path": "/data/set #1"}`).

    An argument of the wrong kind is a TypeError naming it (a string of overrides would otherwise be
    read one character at a time); a mistake in the config is a one-line ConfigError."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if path is not None and not isinstance(path, str):
        hint = ": overrides go second, load_config(None, [...])" if isinstance(path, (list, tuple)) else \
            ": values in code go in overrides=[...] or values={...}" if isinstance(path, dict) else ""
        raise TypeError(f"raytrain.load_config: path must be the path of a YAML file (str or os.PathLike) or None, "
                        f"got {type(path).__name__}{hint}")
    if isinstance(overrides, str):
        raise TypeError(f"raytrain.load_config: overrides must be a list of KEY=VALUE strings, got the string "
                        f"{overrides!r}: write [{overrides!r}]")
    if not isinstance(overrides, (list, tuple)):
        raise TypeError(f"raytrain.load_config: overrides must be a list of KEY=VALUE strings, got "
                        f"{type(overrides).__name__}")
    for item in overrides:
        if not isinstance(item, str):
            raise TypeError(f"raytrain.load_config: overrides must be KEY=VALUE strings, got {type(item).__name__} "
                            f"{item!r}: write it as a string, for example \"training.max_steps=20\"")
    if values is not None and (not isinstance(values, dict) or not all(isinstance(k, str) for k in values)):
        raise TypeError(f"raytrain.load_config: values must be a dict of dotted keys to values "
                        f"({{\"data.path\": \"/data\"}}), got {type(values).__name__}")
    return _config.load_config(path, overrides, values)


def fit(config: RunConfig, fresh: bool = False):
    """Train `config` on the connected (or a new local) Ray cluster; returns a raytrain.driver.run.FitResult.

    `config` is checked again first, as the command line checks it (raytrain.config.check_config): a
    RunConfig edited in code gets the same one-line ConfigError, before the driver's modules are imported
    (Ray, torch and transformers: seconds). `import raytrain` (config loading, a notebook's first cell)
    stays free of them until a run starts.
    """
    config = _config.check_config(config, "raytrain.fit: config")
    if not isinstance(fresh, bool):
        raise TypeError(f"raytrain.fit: fresh must be True or False, got {type(fresh).__name__} {fresh!r}")
    from raytrain.driver.run import fit as _fit

    return _fit(config, fresh=fresh)
