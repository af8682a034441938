"""The export's own steps (raytrain.checkpoint.export); a real export of a trained run, byte for byte
against DeepSpeed's converter, is in tests/integration/test_train_e2e.py."""

import torch

from raytrain.checkpoint.export import _materialise
from raytrain.console import Meter


def test_export_materialises_tensor_by_tensor_with_progress_lines(capsys):
    shared, other = torch.ones(1000), torch.zeros(250)
    meter = Meter(total=5000, every_s=0.0)
    out = _materialise({"embed": shared, "lm_head": shared, "norm": other}, ["embed", "lm_head", "norm"],
                       meter, "shard 1 of 1")
    assert out["embed"] is out["lm_head"] and meter.done == 5000  # a tied tensor is read and counted once
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("raytrain.export")]
    assert len(lines) == 1 and lines[0].startswith("raytrain.export: [1/3] 4.00 kB of 5.00 kB (80%), ")
    assert lines[0].endswith(", shard 1 of 1") and "B/s, ETA " in lines[0]
