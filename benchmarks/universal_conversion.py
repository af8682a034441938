"""Cost of DeepSpeed's universal conversion per GB of ZeRO-3 state, on this CPU.

Writes a real ZeRO-3 checkpoint (fp32 weights + AdamW moments) of a ~100M-parameter Llama from
2 gloo ranks (torch.multiprocessing, no Ray), then times `python -m deepspeed.checkpoint.ds_to_universal`
on it (default and 1/1 worker pools) and a universal load on 3 ranks.

    python benchmarks/universal_conversion.py [--hidden 768 --layers 8]

Numbers: docs/benchmarks.md, "Elastic resize" (written by the issue-15 research, 2026-12-01; this is
its script, with the output directory moved). The conversion raytrain runs is the same
ds_to_universal, started by rank 0 of a resized group (raytrain.checkpoint.reshard).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
OUT = os.environ.get("RAYTRAIN_BENCH_OUT", "/tmp/raytrain-bench-convert")


def ds_config(world: int, universal: bool = False) -> dict:
    cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def worker(rank: int, world: int, args, mode: str, port: int, q):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    hf = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                     num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
                     max_position_embeddings=128, tie_word_embeddings=False)
    cfg = ds_config(world, universal=mode == "load")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(hf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
    if mode == "save":
        x = torch.randint(0, 32000, (2, 32))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        t = time.perf_counter()
        engine.save_checkpoint(f"{OUT}/ckpt", tag="step_1")
        torch.distributed.barrier()
        if rank == 0:
            q.put({"save_s": time.perf_counter() - t,
                   "params": sum(p.ds_numel for p in engine.module.parameters())})
    else:
        t = time.perf_counter()
        engine.load_checkpoint(f"{OUT}/universal")
        torch.distributed.barrier()
        if rank == 0:
            q.put({"load_universal_s": time.perf_counter() - t})


def spawn(world: int, args, mode: str, port: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, args, mode, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank exited {p.exitcode}")
    return q.get()


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    res = spawn(2, args, "save", 6515)
    res["ckpt_bytes"] = dir_bytes(f"{OUT}/ckpt")
    for label, extra in (("default_pools", []), ("pools_1_1", ["--num_extract_workers", "1", "--num_merge_workers", "1"])):
        shutil.rmtree(f"{OUT}/universal", ignore_errors=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        f"{OUT}/ckpt/step_1", "--output_folder", f"{OUT}/universal/step_1_universal", *extra],
                       check=True, capture_output=True, text=True)
        res[f"convert_s_{label}"] = time.perf_counter() - t
    res["universal_bytes"] = dir_bytes(f"{OUT}/universal")
    res.update(spawn(3, args, "load", 6516))
    gb = res["ckpt_bytes"] / 1e9
    res["convert_s_per_gb_default"] = res["convert_s_default_pools"] / gb
    res["convert_s_per_gb_1_1"] = res["convert_s_pools_1_1"] / gb
    res["load_universal_s_per_gb"] = res["load_universal_s"] / gb
    print(json.dumps(res, indent=1))
    shutil.rmtree(OUT, ignore_errors=True)


if __name__ == "__main__":
    main()
