"""Do the planner's picks depend on the host term? (session 50: hosts did ZeRO-3's per-layer work in 4.3-9.7 ms)

    python benchmarks/host_term_picks.py                 # the model's term (9.6 ms fused, 14.9 transformers' layers)
    python benchmarks/host_term_picks.py --fused-ms 4.0 --unfused-ms 6.2   # session 50's faster host

Prints the pick and the runner-up of `python -m raytrain.tools.plan` for 1.1B (configs/llama-1b-1gpu.yaml with the
micro-batch, optimizer offload and checkpointing "auto", GA 4) uncapped and at 70, 24, 22 and 20 GiB, and for the
13B config as shipped, on a 125 GiB host, with raytrain.planning.throughput.HOST_S_PER_LAYER set as given.
"""
import argparse
import contextlib
import io

from raytrain.planning import throughput
from raytrain.tools import plan

CASES = {"1.1B, 139 GiB": ("configs/llama-1b-1gpu.yaml", 139), "1.1B, 70 GiB": ("configs/llama-1b-1gpu.yaml", 70),
         "1.1B, 24 GiB": ("configs/llama-1b-1gpu.yaml", 24), "1.1B, 22 GiB": ("configs/llama-1b-1gpu.yaml", 22),
         "1.1B, 20 GiB": ("configs/llama-1b-1gpu.yaml", 20), "13B, 139 GiB": ("configs/llama-13b-1gpu.yaml", 139)}
AUTO = ["training.micro_batch_size_per_gpu=auto", "deepspeed.zero_optimization.offload_optimizer=auto",
        "model.gradient_checkpointing=auto", "deepspeed.train_batch_size=auto", "training.gradient_accumulation_steps=4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fused-ms", type=float, default=throughput.HOST_S_PER_LAYER[True] * 1000)
    parser.add_argument("--unfused-ms", type=float, default=throughput.HOST_S_PER_LAYER[False] * 1000)
    args = parser.parse_args()
    throughput.HOST_S_PER_LAYER = {True: args.fused_ms / 1000, False: args.unfused_ms / 1000}
    print(f"host term: {args.fused_ms} ms a layer (fused), {args.unfused_ms} (transformers' layers)")
    for name, (config, gib) in CASES.items():
        argv = ["--config", config, "--gpu-memory-gib", str(gib), "--host-memory-gib", "125", "--gpus-per-node", "1"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            plan.main(argv + (AUTO if "1b" in config else []))
        lines = [line.removeprefix("raytrain: plan: ") for line in out.getvalue().splitlines()
                 if line.startswith("raytrain: plan: ")]
        print(f"{name}: {lines[0] if lines else 'no plan'}")
        print(f"{' ' * len(name)}  {lines[1].split(';')[0] if len(lines) > 1 else ''}")


if __name__ == "__main__":
    main()
