"""The throughput model's host term (session 50: hosts did ZeRO-3's per-layer work in 4.3-9.7 ms).

    python benchmarks/host_term_picks.py                 # the picks with the model's term (9.6 ms fused, 14.9 not)
    python benchmarks/host_term_picks.py --fused-ms 4.0 --unfused-ms 6.2   # session 50's faster host
    python benchmarks/host_term_picks.py --fit           # that host's term, fitted row by row

Picks: the pick and runner-up of `python -m raytrain.tools.plan` for 1.1B (configs/llama-1b-1gpu.yaml with the
micro-batch, optimizer offload and checkpointing "auto", GA 4) uncapped and at 70, 24, 22 and 20 GiB, and for the 13B
config as shipped, on a 125 GiB host, with raytrain.planning.throughput.HOST_S_PER_LAYER set as given.
--fit: for each held-out row of session 50's machine (raytrain/planning/calibration.py, `*-1205`), measured against
predicted tokens/s and GPU peak, and the per-layer host time that makes the model reproduce the row's tokens/s.
"""
import argparse
import contextlib
import io

from raytrain.planning import calibration, throughput
from raytrain.tools import bench, bench_paths, plan

ONE_B, THIRTEEN_B = "configs/llama-1b-1gpu.yaml", "configs/llama-13b-1gpu.yaml"
AUTO = ["training.micro_batch_size_per_gpu=auto", "deepspeed.zero_optimization.offload_optimizer=auto",
        "model.gradient_checkpointing=auto", "deepspeed.train_batch_size=auto", "training.gradient_accumulation_steps=4"]
# name: (config, GPU GiB, overrides)
CASES = {"1.1B, 139 GiB": (ONE_B, 139, AUTO), "1.1B, 70 GiB": (ONE_B, 70, AUTO), "1.1B, 24 GiB": (ONE_B, 24, AUTO),
         "1.1B, 22 GiB": (ONE_B, 22, AUTO), "1.1B, 20 GiB": (ONE_B, 20, AUTO), "13B, 139 GiB": (THIRTEEN_B, 139, [])}


def picks() -> None:
    for name, (config, gib, overrides) in CASES.items():
        argv = ["--config", config, "--gpu-memory-gib", str(gib), "--host-memory-gib", "125", "--gpus-per-node", "1"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            plan.main(argv + overrides)
        lines = [line.removeprefix("raytrain: plan: ") for line in out.getvalue().splitlines()
                 if line.startswith("raytrain: plan: ")]
        print(f"{name}: {lines[0] if lines else 'no plan'}")
        print(f"{' ' * len(name)}  {lines[1].split(';')[0] if len(lines) > 1 else ''}")


def predicted(row: calibration.Row) -> dict:
    """The row's prediction as tests/unit/planning/test_calibration.py makes it (the bench's own resolution)."""
    args = bench.parse_args(row.argv())
    overrides = bench.overrides_for(args, use_gpu=True) + [f"scaling.cpus_per_worker={row.cpus}"]
    return bench_paths.predicted(bench_paths.resolve(overrides, 1, True), param_groups=row.param_groups)


def fit() -> None:
    print("row | tokens/s | predicted | GPU peak GiB | predicted | host ms a layer that reproduces it")
    for row in (r for r in calibration.ROWS if r.id.endswith("-1205")):
        throughput.HOST_S_PER_LAYER = dict(KEPT)
        p = predicted(row)
        lo, hi = 0.0001, 0.03  # tokens/s fall as the term grows: bisect on it
        for _ in range(30):
            mid = (lo + hi) / 2
            throughput.HOST_S_PER_LAYER = {True: mid, False: mid}
            lo, hi = (mid, hi) if predicted(row)["tokens_per_s"] > row.tokens_per_s else (lo, mid)
        print(f"{row.id} | {row.tokens_per_s:,.0f} | {p['tokens_per_s']:,.0f} | {row.gpu_peak_gib} | "
              f"{p['gpu_peak_gib']:.1f} ({p['gpu_peak_gib'] / row.gpu_peak_gib - 1:+.1%}) | "
              + (f"{mid * 1000:.2f}" if mid > 0.001 else "none: the GPU term alone predicts it slower"))


KEPT = dict(throughput.HOST_S_PER_LAYER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fused-ms", type=float, default=KEPT[True] * 1000)
    parser.add_argument("--unfused-ms", type=float, default=KEPT[False] * 1000)
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    if args.fit:
        fit()
        return
    throughput.HOST_S_PER_LAYER = {True: args.fused_ms / 1000, False: args.unfused_ms / 1000}
    print(f"host term: {args.fused_ms} ms a layer (fused), {args.unfused_ms} (transformers' layers)")
    picks()


if __name__ == "__main__":
    main()
