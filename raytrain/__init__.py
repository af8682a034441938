"""raytrain: train causal language models with DeepSpeed ZeRO-3 on a Ray cluster.

Entry points: `python -m raytrain.main` (command line) and `raytrain.fit(config)` (notebooks).
Reading order: config.py (the typed run config) -> resolve.py and deepspeed_config.py (checks and
derived values, driver side) -> driver.py (Ray cluster, TorchTrainer, datasets) -> worker.py (the
per-worker loop) with model.py, data.py, metrics.py, checkpoint.py.
"""

from raytrain.config import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "fit", "load_config"]


def fit(config: RunConfig, fresh: bool = False):
    """Train `config` on the connected (or a new local) Ray cluster; returns a driver.FitResult."""
    from raytrain.driver import fit as _fit

    return _fit(config, fresh=fresh)
