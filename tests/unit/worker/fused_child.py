"""One run of test_fused.py: raytrain's worker engine (raytrain.worker.engine.build_engine) on real DeepSpeed
ZeRO-3, gloo on CPU, 2 ranks, each rank holding half of every parameter: the same seed and batches with
transformers' Llama layers, with model.fused_layers=true, with both fused layers and activation
checkpointing (the fused forward runs again in the backward), and with that and model.fp8=true (FP8 GEMMs),
one engine after the other in the same processes.

    python fused_child.py OUT.json KEY=VALUE ...

Writes rank 0's view of each run: the losses (averaged over the ranks), the parameter names of each
engine's module, the layer classes, and how much of a weight each rank holds.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

STEPS = 3


def rank_main(rank: int, world: int, port: int, out_path: str, overrides: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape
    from raytrain.worker import fused
    from raytrain.worker.engine import build_engine, train_step

    out: dict = {}
    try:
        for name, flag, ckpt, fp8 in (("plain", "false", "false", "false"), ("fused", "true", "false", "false"),
                                      ("fused-checkpointing", "true", "true", "false"),
                                      ("fp8-checkpointing", "true", "true", "true")):
            cfg = load_config(None, overrides + [f"model.fused_layers={flag}", f"model.gradient_checkpointing={ckpt}",
                                                 f"model.fp8={fp8}"])
            resolved = resolve_run(cfg, ClusterShape(num_workers=world, use_gpu=False))
            engine, _, _ = build_engine(resolved, torch.device("cpu"))
            g = torch.Generator().manual_seed(100 + rank)
            vocab, micro, seq = resolved.model.vocab_size, resolved.deepspeed.micro_batch_per_gpu, cfg.data.seq_len
            fixed = [{"input_ids": torch.randint(0, vocab, (micro, seq), generator=g)} for _ in range(2)]
            batches = iter(fixed * STEPS * resolved.deepspeed.gradient_accumulation_steps)
            losses, accumulation = [], resolved.deepspeed.gradient_accumulation_steps
            for _ in range(STEPS):
                loss, _ = train_step(engine, batches, accumulation, torch.device("cpu"))
                torch.distributed.all_reduce(loss)
                losses.append(loss.item() / world)
            layer = engine.module.model.layers[0]
            out[name] = {"losses": losses, "params": [n for n, _ in engine.module.named_parameters()],
                         "layer_class": type(layer).__name__, "attention_class": type(layer.self_attn).__name__,
                         "o_proj_class": type(layer.self_attn.o_proj).__name__,
                         "checkpointing": bool(getattr(engine.module, "is_activation_checkpointing", False)),
                         "partition_numel": int(layer.mlp.gate_proj.weight.ds_tensor.numel()),
                         "full_numel": int(layer.mlp.gate_proj.weight.ds_numel)}
            engine.destroy()
    except Exception as e:  # noqa: BLE001 - the test reads what failed
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    if rank == 0:
        out["paths"] = dict(fused.PATHS)
        with open(out_path, "w") as f:
            json.dump(out, f)
    torch.distributed.destroy_process_group()


def main(out_path: str, overrides: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, out_path, overrides), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
