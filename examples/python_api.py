"""Drive raytrain from Python: build a run config in code, train, read the result.

    python examples/python_api.py            # local Ray cluster (or RAY_ADDRESS)
"""

import raytrain

config = raytrain.load_config(None, ["training.max_steps=30", "checkpoint.name=python-api",
                                     "data.seq_len=64"])
config.training.learning_rate = 2e-3  # the typed tree can be edited directly, too
result = raytrain.fit(config)
print(f"loss {result.history[0]['loss']:.3f} -> {result.metrics['loss']:.3f}")
print(f"checkpoint: {result.checkpoint_path}")
