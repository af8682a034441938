"""What the model's own init costs a ZeRO-3 build on CPU: raytrain.model.build_model (transformers' from_config
under HfDeepSpeedConfig: initialize_weights_zero3 gathers each module, rank 0 initialises it, the rest receive it)
against the bare deepspeed.zero.Init + from_config raytrain used before session 42 (no init: PyTorch's defaults on
empty partitions), on 2 gloo ranks, the default config's tiny Llama, three builds each.

    python benchmarks/model_build_time.py

docs/status.md #16 (session 42) quotes it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch.multiprocessing as mp


def rank_main(rank: int, world: int, rendezvous: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from raytrain.config import load_config
    from raytrain.model import build_model, config_from_facts
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape, RunSpec
    from raytrain.worker.engine import import_deepspeed

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    deepspeed = import_deepspeed(torch.device("cpu"))
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config(None, [])
    spec = RunSpec.place(resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=False)), run_name="x",
                         storage_path=os.path.dirname(rendezvous), resume_from=None)
    hf_config = config_from_facts(spec.model, cfg.model)
    for i in range(3):
        dist.barrier()
        start = time.perf_counter()
        build_model(cfg.model, hf_config, spec.ds_config)
        dist.barrier()
        own = time.perf_counter() - start
        start = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=spec.ds_config):
            AutoModelForCausalLM.from_config(hf_config)
        dist.barrier()
        bare = time.perf_counter() - start
        if rank == 0:
            print(f"build {i + 1}: the model's own init {own:.2f} s, bare zero.Init {bare:.2f} s", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(rank_main, args=(2, f"{d}/rendezvous"), nprocs=2, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
