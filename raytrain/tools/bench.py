"""`python -m raytrain.tools.bench`: one model, batch and DeepSpeed config through three paths, side by side.

    python -m raytrain.tools.bench --micro-batch 16 --out bench_out       # 1.1B Llama shape, seq 2048, bf16

The paths, each in its own process (so each gets the whole GPU and a clean CUDA context):

- `raytrain`: the full product path, `raytrain.fit(cfg)`: Ray Train TorchTrainer + Ray Data
  (built-in corpus, tokenized and packed while training) + DeepSpeed ZeRO-3 in the worker.
- `deepspeed`: what raytrain's worker does, without Ray: one process, `zero.Init` +
  `deepspeed.initialize` with the same model builder, optimizer and DeepSpeed dict, synthetic tokens
  already on the GPU. Also raytrain's model options: with `--liger all` that includes the fused
  decoder layers ("auto"); `--set model.fused_layers=false` gives transformers' own layers, the step
  DeepSpeed alone would run.
- `torch`: plain PyTorch, no DeepSpeed: fp32 weights, bf16 autocast, fused AdamW (where it fits).

All three get the DeepSpeed dict that raytrain resolves from the same overrides for a world of
`--num-gpus`. They time steps the same way as the worker (raytrain.worker.metrics, one sync per
window of `--window` steps; the first `--warmup-steps` are not counted) and report tokens/s,
MFU = tokens/s x (6N + 12 L H S) / peak, peak GPU memory, the data-wait fraction and, on the two
in-process paths, a step-time breakdown (CUDA events) and the NCCL kernel time of one profiled step.
The raytrain row comes from the worker's progress lines; the run is stopped after its last step
rather than waiting for the final checkpoint (GBs of storage time, not training).
Results go to OUT/results.jsonl (one line per path, appended) and OUT/results.md (a table of every
line in results.jsonl), each child's output to OUT/<time>-<n>-<path>.log.

`--micro-batch auto`, `--offload auto` (and `--set model.gradient_checkpointing=auto`) leave those
settings to raytrain's planner, which each path's child resolves for this machine exactly as the driver
does (raytrain.planning.choose); `--gpu-memory-fraction F` caps every path's GPU and the plan alike.
Every record carries the planner's prediction for what ran (`predicted`) and the host's used memory,
sampled every 2 s while the path ran.

`--set KEY=VALUE` takes raytrain's override syntax
(`deepspeed.zero_optimization.reduce_bucket_size=500000000`, `model.gradient_checkpointing=true`) and
applies to every path. `--liger` swaps in Liger kernels
(pure Python + Triton; GPU only) for the loss, and optionally RMSNorm, SwiGLU and RoPE.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from raytrain.config import DEFAULT_DEEPSPEED
from raytrain.console import ArgumentParser, parse_progress
from raytrain.hardware import ALLOCATOR_VARS, allocator_env
from raytrain.tools.bench_report import HostSampler, markdown_table  # noqa: F401  (markdown_table: this module's API)

PATHS = ("raytrain", "deepspeed", "torch")
MAX_AUTO_MICRO_BATCH = 64  # sizes the built-in corpus when the planner picks the micro-batch
RESULT_PREFIX = "RAYTRAIN_BENCH_RESULT "
PRELIM_PREFIX = "RAYTRAIN_BENCH_PRELIM "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # raytrain's parser: a bad flag is one `raytrain: error:` line, exit 2, as for every command (flags not abbreviated)
    p = ArgumentParser(prog="python -m raytrain.tools.bench", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--paths", default="raytrain,deepspeed,torch",
                   help=f"comma-separated, run in this order: {', '.join(PATHS)}")
    shape = p.add_argument_group("model shape (Llama; defaults: the 1.1B of issue 8)")
    # default None: a flag left out takes LLAMA_1B's value, or, with --model-dir, the directory's config.json
    shape.add_argument("--hidden-size", type=int)
    shape.add_argument("--num-layers", type=int)
    shape.add_argument("--num-heads", type=int)
    shape.add_argument("--num-kv-heads", type=int)
    shape.add_argument("--intermediate-size", type=int)
    shape.add_argument("--vocab-size", type=int)
    shape.add_argument("--model-dir", default=None, metavar="DIR",
                       help="a model directory (config.json and a tokenizer) of any family, built from its config "
                            "(model.name_or_path=DIR); only the shape flags given override its config, as "
                            "model.config.KEY (the family's own names or the ones its config maps)")
    run = p.add_argument_group("batch and steps")
    run.add_argument("--seq-len", type=int, default=2048)
    run.add_argument("--micro-batch", type=_int_or_auto, default=8,
                     help="train_micro_batch_size_per_gpu, or auto: the planner chooses (raytrain.planning.choose)")
    run.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    run.add_argument("--num-gpus", type=int, default=1,
                     help="world size the DeepSpeed dict is resolved for; the deepspeed and torch paths run "
                          "one process, so only 1 is measured by them")
    run.add_argument("--offload", nargs="?", const="cpu", default=None, choices=("cpu", "auto"),
                     help="ZeRO-3 optimizer offload to pinned CPU memory (the seed config's "
                          "offload_optimizer: {device: cpu, pin_memory: true}; DeepSpeed's CPU Adam); "
                          "--offload auto: the planner chooses none or a ratio (with sub_group_size auto)")
    run.add_argument("--gpu-memory-fraction", type=float, default=None,
                     help="cap every path at this fraction of the GPU (torch.cuda.set_per_process_memory_fraction; "
                          "scaling.gpu_memory_fraction, so the planner plans against the same cap)")
    run.add_argument("--float8", action="store_true",
                     help="deepspeed path: torchao's float8 training for the decoder's Linear layers (not lm_head), "
                          "converted after zero.Init (needs torchao)")
    run.add_argument("--deepspeed-overflow-scan", action="store_true",
                     help="deepspeed path, fp16 with offload: keep DeepSpeed's inf/nan scan of the host gradient "
                          "buffer that raytrain drops (raytrain.compat.skip_host_overflow_scan), to compare")
    run.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    run.add_argument("--warmup-steps", type=int, default=4, help="untimed optimizer steps first")
    run.add_argument("--window", type=int, default=4,
                     help="steps per timing window (= training.log_every_n_steps on the raytrain path); "
                          "must divide --steps and --warmup-steps")
    run.add_argument("--peak-tflops", type=float, default=989.0,
                     help="dense bf16 peak of one GPU for MFU (989: H100/H200 SXM)")
    run.add_argument("--liger", choices=("none", "loss", "all"), default="none",
                     help="loss: fused linear cross-entropy in the lm_head (logits never materialised); "
                          "all: also Liger RMSNorm, SwiGLU, RoPE")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="raytrain config override for every path (repeatable)")
    out = p.add_argument_group("output")
    out.add_argument("--label", default=None, help="name of this variant in the table (default: its settings)")
    out.add_argument("--out", default="bench_out", help="directory for results.jsonl, results.md, logs")
    out.add_argument("--timeout-s", type=float, default=600, help="per path; a path past it is killed")
    out.add_argument("--no-profile", action="store_true",
                     help="skip the one profiled step that measures communication kernels (GPU only)")
    p.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)  # internal: run one path here
    args = p.parse_args(argv)
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction <= 1:
        p.error(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    paths = [s.strip() for s in args.paths.split(",") if s.strip()]
    unknown = [s for s in paths if s not in PATHS]
    if unknown or not paths:
        p.error(f"--paths: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(PATHS)}")
    args.paths = paths
    if args.steps < 1 or args.window < 1 or args.steps % args.window or args.warmup_steps % args.window:
        p.error(f"--window={args.window} must divide --steps={args.steps} and --warmup-steps={args.warmup_steps}")
    if args.warmup_steps < args.window:
        p.error("--warmup-steps must be at least one window: the first window holds start-up costs")
    return args


# ---------------------------------------------------------------------------------------------
# The run config every path shares.


# The bench's flag -> the model config's key, and the built-in shape: the 1.1B of issue 8 (configs/llama-1b-1gpu.yaml)
SHAPE_FLAGS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
               "vocab_size": "vocab_size"}
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
            "intermediate_size": 5632, "vocab_size": 32000}


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The model.config keys this benchmark sets: the shape flags given, over LLAMA_1B unless --model-dir."""
    given = {key: getattr(args, flag) for flag, key in SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    if args.model_dir:  # another family's config may not know Llama's keys (GPT-2 has no num_key_value_heads)
        return given
    return {**LLAMA_1B, **given, "max_position_embeddings": args.seq_len}


def overrides_for(args: argparse.Namespace, use_gpu: bool) -> list[str]:
    """raytrain KEY=VALUE overrides for this benchmark (the user's --set come last and win)."""
    max_steps = args.warmup_steps + args.steps
    micro_batch = MAX_AUTO_MICRO_BATCH if args.micro_batch == "auto" else args.micro_batch
    tokens_needed = max_steps * micro_batch * args.grad_accum * args.num_gpus * args.seq_len
    # The built-in documents average ~330 byte tokens; 2x margin keeps the run inside one epoch
    # (a second epoch re-runs the whole Ray Data pipeline and shows up as data wait).
    num_documents = max(4000, math.ceil(2 * tokens_needed / 330))
    model = model_overrides(args)
    # The whole DeepSpeed mapping, written out: a dotted `deepspeed.x=y` override alone would start
    # an empty mapping instead of editing raytrain's default one. --set deepspeed.* then edits it.
    ds = copy.deepcopy(DEFAULT_DEEPSPEED)
    if args.offload == "cpu":
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif args.offload == "auto":
        ds["zero_optimization"].update(offload_optimizer="auto", sub_group_size="auto")
    items = [f"model.config.{k}={v}" for k, v in model.items()] + [
        f"data.seq_len={args.seq_len}", f"data.num_builtin_documents={num_documents}",
        f"training.max_steps={max_steps}", f"training.log_every_n_steps={args.window}",
        f"training.peak_tflops_per_gpu={args.peak_tflops}",
        f"training.micro_batch_size_per_gpu={args.micro_batch}",
        f"training.gradient_accumulation_steps={args.grad_accum}",
        f"scaling.num_workers={args.num_gpus}", f"scaling.use_gpu={str(use_gpu).lower()}",
        f"model.liger_kernel={args.liger}", f"deepspeed={json.dumps(ds)}"]
    if args.gpu_memory_fraction is not None:
        items.append(f"scaling.gpu_memory_fraction={args.gpu_memory_fraction}")
    if args.model_dir:
        items.append(f"model.name_or_path={args.model_dir}")
    return items + list(args.overrides)


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {value!r}") from None


def versions() -> dict[str, Any]:
    from importlib import metadata

    info: dict[str, Any] = {}
    for dist in ("torch", "deepspeed", "ray", "transformers", "liger-kernel", "triton"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    import torch

    info["cuda"] = torch.version.cuda
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["gpu_count"] = torch.cuda.device_count()
    info["cpu_count"] = os.cpu_count()
    return info


# ---------------------------------------------------------------------------------------------
# Orchestration: one child process per path, results as JSON lines and a markdown table.


def default_label(args: argparse.Namespace) -> str:
    parts = [f"mb{args.micro_batch}"] + ([os.path.basename(os.path.normpath(args.model_dir))] if args.model_dir else [])
    if args.grad_accum != 1:
        parts.append(f"gas{args.grad_accum}")
    if args.offload:
        parts.append("offload" if args.offload == "cpu" else "offload-auto")
    if args.gpu_memory_fraction is not None:
        parts.append(f"gpu-fraction{args.gpu_memory_fraction:g}")
    if args.float8:
        parts.append("float8")
    if args.deepspeed_overflow_scan:
        parts.append("deepspeed-overflow-scan")
    if args.liger != "none":
        parts.append(f"liger-{args.liger}")
    parts += [o.split("=")[0].split(".")[-1] + "=" + o.split("=", 1)[1] for o in args.overrides]
    return " ".join(parts)


def run_child(args: argparse.Namespace) -> int:
    """Run one path in this process and print its result line."""
    import torch

    from raytrain.tools import bench_paths  # the child only: the parent never imports torch or DeepSpeed

    # the allocator this child ran under (hardware.allocator_env's default unless the caller set one)
    record: dict[str, Any] = {"path": args.child, "alloc_conf": {k: os.environ[k] for k in ALLOCATOR_VARS
                                                                 if k in os.environ}}
    try:
        use_gpu = torch.cuda.is_available()
        overrides = overrides_for(args, use_gpu)
        resolved = bench_paths.resolve(overrides, args.num_gpus, use_gpu)
        record["ds_config"] = resolved.ds_config
        record["plan"] = list(resolved.plan)
        for line in resolved.plan:
            print(f"raytrain: plan: {line}", flush=True)
        record["predicted"] = bench_paths.predicted(resolved)
        if args.child == "raytrain":
            hint = lambda prelim: print(PRELIM_PREFIX + json.dumps(prelim), flush=True)  # noqa: E731
            record.update(bench_paths.run_raytrain(args, resolved, overrides, hint))
        else:
            record.update({"deepspeed": bench_paths.run_deepspeed, "torch": bench_paths.run_torch}[args.child](
                args, resolved))
        record["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported in the table, the traceback in the log
        traceback.print_exc()
        text = f"{type(e).__name__}: {e}"
        record["status"] = "oom" if "out of memory" in text.lower() or isinstance(e, torch.OutOfMemoryError) else "error"
        record["error"] = text[-500:]
    print(RESULT_PREFIX + json.dumps(record, default=str), flush=True)
    return 0


def run_path(path: str, args: argparse.Namespace, argv: list[str], log_path: str) -> dict[str, Any]:
    """Run one path in a child process with a timeout; its output goes to log_path."""
    cmd = [sys.executable, "-m", "raytrain.tools.bench", *argv, "--child", path]
    start = time.perf_counter()
    host = HostSampler()
    with host, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                # the workers' allocator default on every path (raytrain's driver sets it for its own)
                                env={**os.environ, **allocator_env(use_gpu=True), "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)  # its own process group: a timeout kills Ray too
        record: dict[str, Any] | None = None
        prelim: dict[str, Any] = {}
        windows: dict[int, dict[str, float]] = {}
        try:
            deadline = start + args.timeout_s
            for line in _lines_until(proc, deadline):
                log.write(line)
                if line.startswith(RESULT_PREFIX):
                    record = json.loads(line[len(RESULT_PREFIX):])
                elif line.startswith(PRELIM_PREFIX):
                    prelim = json.loads(line[len(PRELIM_PREFIX):])
                elif path == "raytrain" and (m := add_window(windows, line)):
                    if m["step"] == m["max_steps"]:
                        # Every timed window is in: stop here rather than wait for the final ZeRO-3
                        # checkpoint (~15 GB for 1.1B parameters), which measures storage, not training.
                        record = _from_progress(prelim, windows, args)
                        break
        except TimeoutError:
            record = {"path": path, "status": "timeout", "error": f"killed after {args.timeout_s:.0f} s"}
        finally:
            _kill_group(proc)
    if record is None:
        record = {"path": path, "status": "error", "error": f"exit code {proc.returncode} without a result (see {log_path})"}
    record["wall_s"] = time.perf_counter() - start
    record.update(host.result())
    return record


def add_window(windows: dict[int, dict[str, Any]], line: str) -> dict[str, Any] | None:
    """Record the raytrain path's window from one of rank 0's progress lines (None: not one)."""
    m = parse_progress(line)
    if m is not None:
        windows[m["step"]] = {**m, "on_gpu": "mfu" in m}  # the worker shows MFU on GPUs only
    return m


def _from_progress(prelim: dict[str, Any], windows: dict[int, dict[str, float]],
                   args: argparse.Namespace) -> dict[str, Any]:
    """The raytrain path's record from its rank-0 progress lines (windows after warmup)."""
    timed = [w for step, w in sorted(windows.items()) if step > args.warmup_steps]
    tokens_per_step = prelim["ds_config"]["train_batch_size"] * args.seq_len
    step_time = sum(tokens_per_step / w["tokens_per_s"] for w in timed) / len(timed)
    tokens_per_s = tokens_per_step / step_time
    fpt = prelim["flops_per_token"]
    return {"path": "raytrain", "status": "ok", **prelim, "tokens_per_s": tokens_per_s, "step_time_s": step_time,
            "mfu": tokens_per_s * fpt / (args.peak_tflops * 1e12 * args.num_gpus) if timed[0]["on_gpu"] else None,
            "data_wait_frac": sum(w["data_wait_frac"] for w in timed) / len(timed),
            "peak_mem_gib": max(w["memory_gib"] for w in timed),
            "windows_tokens_per_s": [w["tokens_per_s"] for w in timed]}


def _lines_until(proc, deadline: float):
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        if sel.select(timeout=min(left, 5.0)):
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                return
            yield line


def _kill_group(proc) -> None:
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    if args.child:
        return run_child(args)
    os.makedirs(args.out, exist_ok=True)
    label = args.label or default_label(args)
    settings = {k: getattr(args, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                              "intermediate_size", "vocab_size", "seq_len", "micro_batch",
                                              "grad_accum", "num_gpus", "offload", "liger", "overrides",
                                              "steps", "warmup_steps", "window", "peak_tflops",
                                              "gpu_memory_fraction", "float8", "deepspeed_overflow_scan",
                                              "model_dir")}
    settings["model_config"] = model_overrides(args)
    info = versions()
    records = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in args.paths:
        log_path = os.path.join(args.out, f"{stamp}-{len(records)}-{path}.log")
        print(f"raytrain.bench: {label}: {path} ...", flush=True)
        record = run_path(path, args, argv, log_path)
        record.update(label=label, settings=settings, versions=info,
                      command="python -m raytrain.tools.bench " + " ".join(_quote(a) for a in argv))
        records.append(record)
        with open(os.path.join(args.out, "results.jsonl"), "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        print(markdown_table([record]).splitlines()[-1], flush=True)
    with open(os.path.join(args.out, "results.jsonl")) as f:
        everything = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown_table(everything))
    print(markdown_table(records), end="")
    return 0 if all(r["status"] == "ok" for r in records) else 1


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


if __name__ == "__main__":
    sys.exit(main())
