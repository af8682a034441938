"""Would checkpointing only part of the decoder layers beat the planner's all-or-nothing choice? A what-if
on the planner's own calibrated model (raytrain.planning), for issue 14's bound (docs/status.md #14).

    python benchmarks/partial_checkpointing.py PHI [raytrain.tools.plan arguments ...]

With PHI in (0, 1], "checkpointing" in the planner's search means: round(PHI x layers) layers keep only
their input and recompute their forward in backward, the others keep every activation. Interpolated
from the model's two ends, per layer: activations (activation_bytes with and without checkpointing),
the recompute's GPU time (RECOMPUTE_COST x PHI) and the host's extra work (HOST_CKPT_FACTOR's excess
x PHI). Prints the planner's choice and runner-up. Nothing here is measured: it is the calibrated
model asked a question it was not fitted on (PHI = 1 is the shipped planner).
"""

from __future__ import annotations

import contextlib
import io
import sys

import raytrain.planning.estimate as estimate
import raytrain.planning.throughput as throughput
from raytrain.planning.activations import activation_bytes


def main(argv: list[str]) -> int:
    phi = float(argv[0])

    def partial_activations(hf_config, micro_batch, seq_len, e, *, checkpointing, **kw):
        full = activation_bytes(hf_config, micro_batch, seq_len, e, checkpointing=False, **kw)
        if not checkpointing:
            return full
        every = activation_bytes(hf_config, micro_batch, seq_len, e, checkpointing=True, **kw)
        num_layers = hf_config.num_hidden_layers
        kept_input = micro_batch * seq_len * e * hf_config.hidden_size  # what a checkpointed layer keeps
        # full = L*layer + rest; every = L*kept_input + layer + rest (one layer recomputed at a time)
        layer = (full - every + num_layers * kept_input) / (num_layers - 1)
        rest = full - num_layers * layer
        k = round(phi * num_layers)
        return int(rest + k * kept_input + (num_layers - k) * layer + (layer if k else 0))

    estimate.activation_bytes = partial_activations
    host_s = throughput.host_s
    throughput.host_s = lambda layers, fused, ckpt: host_s(layers, fused, False) * (
        1 + phi * (throughput.HOST_CKPT_FACTOR[fused] - 1) if ckpt else 1)
    throughput.RECOMPUTE_COST *= phi

    from raytrain.tools.plan import main as plan

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = plan(argv[1:])
    for line in out.getvalue().splitlines():
        if "plan: chose" in line or "plan: runner-up" in line or "does not fit" in line:
            print(f"PHI {phi:g}: {line.split(';')[0]}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
