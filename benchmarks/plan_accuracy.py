"""Check raytrain.planning.memory's estimates against measured peaks: DeepSpeed ZeRO-3 training on CPU (gloo).

    python benchmarks/plan_accuracy.py                       # the matrix in docs/plan-accuracy.md
    python benchmarks/plan_accuracy.py --only fp32-sdpa      # one case
    python benchmarks/plan_accuracy.py --published-h200      # against the H200 rows (raytrain/planning/calibration.py)
    python benchmarks/plan_accuracy.py --predict-h200        # what gpu_x1.sh's issue-14 parts should measure

Each case runs in fresh processes (one per rank: peak RSS is per process) that build the model and
optimizer exactly as a raytrain worker does (raytrain.model.build_model, raytrain.worker.build_optimizer,
deepspeed.initialize on an existing gloo process group, DeepSpeed's shm comm op disabled), train a few
steps on random tokens, and report peak RSS (VmHWM) minus the RSS after imports and process-group
setup. That is compared with `estimate_memory(...)`'s per-worker figure for the configured option.
On a GPU machine the same script measures torch.cuda.max_memory_allocated instead (--device cuda).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# name: (model.config overrides, data.seq_len, micro-batch, precision, extra KEY=VALUE overrides, world size)
MODEL_A = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 2048}
MODEL_B = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
           "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
# configs/llama-1b-1gpu.yaml's model, and a Llama-3.2-1B-like one (128k vocabulary, tied embeddings).
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
LLAMA32_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "tie_word_embeddings": True}
CPU_CASES = {
    # activation-dominated (logits + 8 layers at 2,048 tokens per micro-batch)
    "fp32-sdpa": (MODEL_A, 512, 4, "fp32", [], 1),
    "fp32-sdpa-ckpt": (MODEL_A, 512, 4, "fp32", ["model.gradient_checkpointing=true"], 1),
    "fp32-eager": (MODEL_A, 512, 4, "fp32", ["model.attn_implementation=eager"], 1),
    "bf16-sdpa": (MODEL_A, 512, 4, "bf16", [], 1),
    # model-state-dominated (200M parameters, short sequences)
    "fp32-states": (MODEL_B, 128, 2, "fp32", [], 1),
    "bf16-states": (MODEL_B, 128, 2, "bf16", [], 1),
    "fp32-states-2ranks": (MODEL_B, 128, 2, "fp32", [], 2),
}
GPU_CASES = {
    "1b-1gpu": (TINYLLAMA, 2048, 8, "bf16", [], 1),  # configs/llama-1b-1gpu.yaml as shipped
    "1b-1gpu-ckpt": (TINYLLAMA, 2048, 8, "bf16", ["model.gradient_checkpointing=true"], 1),
    "1b-1gpu-eager": (TINYLLAMA, 2048, 2, "bf16", ["model.attn_implementation=eager"], 1),
    "llama32-1b-seq4096": (LLAMA32_1B, 4096, 2, "bf16", [], 1),
    "1b-1gpu-offload": (TINYLLAMA, 2048, 8, "bf16", [
        'deepspeed.zero_optimization.offload_optimizer={"device": "cpu", "pin_memory": true}'], 1),
}
CASES = {**CPU_CASES, **GPU_CASES}


def overrides_for(case: str, device: str) -> list[str]:
    model, seq_len, micro, precision, extra, world = CASES[case]
    return [f"model.config={json.dumps(model)}", f"data.seq_len={seq_len}",
            f"training.micro_batch_size_per_gpu={micro}", f"training.precision={precision}",
            f"scaling.num_workers={world}", f"scaling.use_gpu={str(device == 'cuda').lower()}", *extra]


_HOST_ITEMS = {"gradient partition", "fp32 master weights", "Adam moments", "fp32 gradients"}


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def resolved_run(cfg, world: int, use_gpu: bool):
    """The run as raytrain.planning.resolve resolves it for `world` ranks on one node (no Ray needed)."""
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape

    return resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=use_gpu, gpus_per_node=world))


def child(case: str, device_type: str, steps: int) -> dict:
    import torch

    from raytrain.worker.engine import build_optimizer, import_deepspeed

    device = torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    deepspeed = import_deepspeed(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    import transformers  # noqa: F401  (imports count toward the baseline, not the estimate)

    from raytrain.config import load_config
    from raytrain.hardware import Target
    from raytrain.model import build_model, config_from_facts, param_stats
    from raytrain.planning.memory import CPU_HEAP_RETENTION, estimate_memory

    cfg = load_config(None, overrides_for(case, device_type))
    world = torch.distributed.get_world_size()
    resolved = resolved_run(cfg, world, device.type == "cuda")
    hf_config = config_from_facts(resolved.model, cfg.model)
    plan = estimate_memory(resolved, Target(gpus_per_node=1))
    param_stats(hf_config)  # build_model does this too: its imports are not model memory
    ds = resolved.ds_config

    torch.manual_seed(0)
    baseline = rss_bytes("VmRSS")
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_model(cfg.model, hf_config, ds)
    optimizer, scheduler = build_optimizer(model, cfg.training, resolved.deepspeed, device)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds, dist_init_required=False)
    phases = {"init": rss_bytes("VmHWM") - baseline}
    if device.type == "cuda":
        phases["init_cuda"] = torch.cuda.max_memory_allocated()
    micro = ds["train_micro_batch_size_per_gpu"]
    vocab = hf_config.vocab_size
    for step in range(steps):
        input_ids = torch.randint(0, vocab, (micro, cfg.data.seq_len), device=device)
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        loss.item()
    phases["peak"] = rss_bytes("VmHWM") - baseline
    out = {"case": case, "rank": torch.distributed.get_rank(), "baseline_rss": baseline,
           "measured_host": phases["peak"], "init_host": phases["init"], "seconds": time.perf_counter() - t0,
           "estimate": plan.configured.worker_bytes,
           # what the host-RAM check uses on CPU: live tensors plus glibc's heap retention
           "estimate_with_heap": int(plan.configured.worker_bytes * (1 + CPU_HEAP_RETENTION)),
           "estimate_items": dict(plan.configured.breakdown), "num_params": plan.num_params}
    if device.type == "cuda":
        out["measured_cuda"] = torch.cuda.max_memory_allocated()
        out["reserved_cuda"] = torch.cuda.max_memory_reserved()
        out["init_cuda"] = phases["init_cuda"]
        out["total_cuda"] = torch.cuda.get_device_properties(0).total_memory
        # host side: offloaded states (+ pinned buffers) against the plan's host figure without its
        # per-process allowance (the measurement already subtracts the process baseline)
        out["estimate_host"] = sum(b for name, b in plan.configured.breakdown if name in _HOST_ITEMS) \
            if plan.configured.offload != "none" else 0
        try:
            out["pinned_host"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", None)
        except (AttributeError, RuntimeError):
            out["pinned_host"] = None
    return out


def run_case(case: str, device: str, steps: int, port: int, glibc_default: bool = False) -> list[dict]:
    world = CASES[case][5]
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1"}
        if not glibc_default:
            # Make glibc serve every allocation over 64 KiB with its own mmap and return it on free, so
            # RSS follows live tensors (as max_memory_allocated does on GPU). By default glibc raises
            # this threshold up to 32 MiB as large blocks are freed, and freed heap memory below it
            # stays in RSS: the peak then also measures fragmentation.
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        # stderr goes to a file: a rank blocked on a full pipe would hang the others in a collective.
        log = tempfile.TemporaryFile(mode="w+")
        procs.append((subprocess.Popen([sys.executable, __file__, "--child", case, "--device", device,
                                        "--steps", str(steps)], env=env, stdout=subprocess.PIPE,
                                       stderr=log, text=True), log))
    results = []
    for p, log in procs:
        out, _ = p.communicate()
        log.seek(0)
        if p.returncode:
            raise SystemExit(f"{case}: rank exited with {p.returncode}:\n{log.read()[-4000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


# What the memory model is checked against on the H200: raytrain.planning.calibration's rows (the issue's
# table and docs/benchmarks.md), each rebuilt with raytrain.tools.bench's own parser and resolution.
_Z = ("--liger all --set deepspeed.zero_optimization.reduce_bucket_size=500000000 "
      "--set deepspeed.zero_optimization.stage3_prefetch_bucket_size=200000000 "
      "--set deepspeed.zero_optimization.stage3_param_persistence_threshold=10000000")
_AUTO = "--micro-batch auto --offload auto --set model.gradient_checkpointing=auto --set scaling.cpus_per_worker=14"
_S7 = "--hidden-size 4096 --num-layers 32 --num-heads 32 --num-kv-heads 8 --intermediate-size 14336"
_S13 = "--hidden-size 5120 --num-layers 40 --num-heads 40 --num-kv-heads 40 --intermediate-size 13824"
_BF16 = "--set deepspeed.bf16.bf16_master_weights_and_grads=true --set deepspeed.bf16.bf16_optimizer_states=true"
_GAS4 = "--micro-batch 24 --grad-accum 4"
_FP16 = "--set training.precision=fp16 --set deepspeed.fp16.enabled=true"
# benchmarks/gpu_x1.sh's issue-14 parts as bench arguments (keep in step with the script). plan13b's
# raytrain.main run is configs/llama-13b-1gpu.yaml, planned here by its bench twin.
GPU_PARTS = [
    ("plan13b", "13b (the config; its bench twin)", f"{_S13} {_AUTO} {_BF16} {_Z} --grad-accum 1"),
    ("plan7b", "7b-auto", f"{_S7} {_AUTO} {_Z} --grad-accum 2"),
    ("plan1b", "1b-ref-nocap", f"{_GAS4} {_Z} --set scaling.cpus_per_worker=14"),
    ("plan1b", "1b-cap24-auto", f"{_AUTO} --grad-accum 4 {_Z} --gpu-memory-fraction 0.171"),
    ("plan1b", "1b-cap24-runnerup", f"--micro-batch 13 --grad-accum 4 {_Z} --set model.gradient_checkpointing=true "
                                    "--set scaling.cpus_per_worker=14 --gpu-memory-fraction 0.171"),
    ("plan1b", "1b-cap84-auto", f"{_AUTO} --grad-accum 4 {_Z} --gpu-memory-fraction 0.598"),
    ("fp16", "1b-bf16-offload", f"{_GAS4} {_Z} --set scaling.cpus_per_worker=14 --offload"),
    ("fp16", "1b-fp16-offload", f"{_GAS4} {_Z} --set scaling.cpus_per_worker=14 --offload {_FP16}"),
    ("fp16", "1b-fp16-nooffload", f"{_GAS4} {_Z} --set scaling.cpus_per_worker=14 {_FP16}"),
    ("mfu62", "1b-base", f"{_GAS4} {_Z}"),
    ("mfu62", "1b-stage2", f"{_GAS4} {_Z} --set deepspeed.zero_optimization.stage=2"),
    ("mfu62", "1b-persistent", f"{_GAS4} {_Z} --set deepspeed.zero_optimization.stage3_param_persistence_threshold=100000000"),
]


def published_h200() -> None:
    """Compare the plan with the H200 rows of raytrain.planning.calibration (no GPU needed: same resolution)."""
    from raytrain.planning.calibration import ROWS
    from raytrain.tools.bench import overrides_for, parse_args
    from raytrain.tools.bench_paths import predicted, resolve

    print("| row (raytrain/planning/calibration.py) | GPU estimate GiB | measured | error | host estimate GiB | "
          "measured | error | tokens/s predicted | measured | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in ROWS:
        args = parse_args(row.argv())
        p = predicted(resolve(overrides_for(args, True) + [f"scaling.cpus_per_worker={row.cpus}"], 1, True),
                      param_groups=row.param_groups)
        host = (f"{p['host_gib']:.1f} | {row.host_used_gib:.1f} | {(p['host_gib'] - row.host_used_gib) / row.host_used_gib:+.1%}"
                if row.host_used_gib else f"{p['host_gib']:.1f} | | ")
        print(f"| {row.id} | {p['gpu_peak_gib']:.1f} | {row.gpu_peak_gib:.1f} | "
              f"{(p['gpu_peak_gib'] - row.gpu_peak_gib) / row.gpu_peak_gib:+.1%} | {host} | {p['tokens_per_s']:,.0f} | "
              f"{row.tokens_per_s:,.0f} | {(p['tokens_per_s'] - row.tokens_per_s) / row.tokens_per_s:+.1%} |")


def predict_h200() -> None:
    """What the planner chooses and predicts for each issue-14 variant of benchmarks/gpu_x1.sh, planned for
    the H200 machine (143,771 MiB GPU, 128,887 MiB host, 1 GPU) from here: no GPU needed."""
    import shlex

    from raytrain.hardware import Target
    from raytrain.tools.bench import overrides_for, parse_args
    from raytrain.tools.bench_paths import predicted, resolve

    target = Target(143_771 * 2**20, 128_887 * 2**20, 1)
    print("| part | variant | setting (the planner's, where auto) | tokens/s | MFU | GPU peak GiB | host GiB |")
    print("|---|---|---|---:|---:|---:|---:|")
    for part, name, argv in GPU_PARTS:
        args = parse_args(shlex.split(argv))
        resolved = resolve(overrides_for(args, True), 1, True, target=target)
        p = predicted(resolved, target=target)
        ds = resolved.ds_config
        setting = (f"mb {ds['train_micro_batch_size_per_gpu']} x {ds['gradient_accumulation_steps']}, {p['setting']}"
                   + (f", sub_group_size {ds['zero_optimization'].get('sub_group_size'):.0e}"
                      if "ratio" in p["setting"] else ""))
        print(f"| {part} | {name} | {setting} | {p['tokens_per_s']:,.0f} | {p['mfu']:.1%} | {p['gpu_peak_gib']:.1f} | "
              f"{p['host_gib']:.1f} |")
        for line in resolved.plan:
            print(f"|   | | plan: {line} | | | | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="run only these cases")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc's malloc tuning alone (CPU RSS then includes heap fragmentation)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--published-h200", action="store_true",
                        help="compare against the H200 rows of raytrain/planning/calibration.py instead of measuring")
    parser.add_argument("--predict-h200", action="store_true",
                        help="the planner's choice and predictions for benchmarks/gpu_x1.sh's issue-14 parts")
    args = parser.parse_args(argv)
    if args.published_h200:
        published_h200()
        return 0
    if args.predict_h200:
        predict_h200()
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.device, args.steps)))
        return 0
    gib = 1024**3
    rows = []
    measured_what = "max_memory_allocated" if args.device == "cuda" else "peak RSS - baseline"
    print(f"| case | params | estimate GiB | measured GiB ({measured_what}) | error | baseline RSS GiB | s |")
    print("|---|---|---|---|---|---|---|")
    for i, case in enumerate(args.only or (GPU_CASES if args.device == "cuda" else CPU_CASES)):
        try:
            results = run_case(case, args.device, args.steps, 29600 + i, args.glibc_default)
        except SystemExit as e:  # one failing case (say, a JIT build on a new machine) must not lose the rest
            print(f"| {case} | failed (stderr below) |", flush=True)
            print(str(e)[-3000:], file=sys.stderr, flush=True)
            continue
        for r in results:
            measured = r["measured_cuda"] if args.device == "cuda" else r["measured_host"]
            err = (r["estimate"] - measured) / measured
            rows.append({**r, "error": err})
            print(f"| {case} (rank {r['rank']}) | {r['num_params'] / 1e6:.0f}M | {r['estimate'] / gib:.2f} | "
                  f"{measured / gib:.2f} | {err:+.0%} | {r['baseline_rss'] / gib:.2f} | {r['seconds']:.0f} |", flush=True)
            if args.device == "cpu" and args.glibc_default:
                heap_err = (r["estimate_with_heap"] - measured) / measured
                print(f"|   with the plan's heap allowance: {r['estimate_with_heap'] / gib:.2f} GiB, {heap_err:+.0%} |",
                      flush=True)
            if args.device == "cuda":
                print(f"|   reserved {r['reserved_cuda'] / gib:.2f} GiB of {r['total_cuda'] / gib:.1f}; host: estimate "
                      f"{r['estimate_host'] / gib:.2f} GiB, measured RSS {r['measured_host'] / gib:.2f} GiB, "
                      f"pinned {r['pinned_host']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
