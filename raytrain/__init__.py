"""raytrain: train causal language models with DeepSpeed ZeRO-3 on a Ray cluster.

Entry points: `python -m raytrain.main` (command line) and `raytrain.fit(config)` (notebooks).
Where to start reading: docs/architecture.md (the layout, and the path of a run from `main` to a
worker step); then config.py (the typed run config) and run_spec.py (the driver-to-worker contract).
"""

from raytrain.config import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "fit", "load_config"]


def fit(config: RunConfig, fresh: bool = False):
    """Train `config` on the connected (or a new local) Ray cluster; returns a raytrain.driver.run.FitResult.

    Imported here on first use: `import raytrain` (config loading, a notebook's first cell) stays
    free of Ray, torch and DeepSpeed until a run starts.
    """
    from raytrain.driver.run import fit as _fit

    return _fit(config, fresh=fresh)
