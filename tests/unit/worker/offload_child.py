"""One process of test_engine_offload.py: raytrain's worker engine (raytrain.worker.engine.build_engine:
zero.Init, raytrain's optimizer, deepspeed.initialize, the LR workaround) on real DeepSpeed ZeRO-3,
world size 1, gloo on CPU, for one variant of KEY=VALUE overrides; a few steps on random tokens.

    python offload_child.py OUT.json [--deepspeed-overflow-scan] KEY=VALUE ...

Writes what DeepSpeed made of it: the sub-groups and where each lives, the dtypes of master weights,
gradients and Adam moments, the learning rates of both optimizers after each step, the losses, and
with fp16 the loss scale after each step. `--deepspeed-overflow-scan` puts back the host inf/nan scan
that raytrain.compat.skip_host_overflow_scan drops (the comparison run).
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch


def main(out_path: str, overrides: list[str], keep_scan: bool) -> None:
    from raytrain import compat
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run
    from raytrain.run_spec import ClusterShape
    from raytrain.worker.engine import after_checkpoint_load, build_engine, import_deepspeed, train_step

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    cfg = load_config(None, overrides)
    # fp16 resolves for a GPU run only: its variant says scaling.use_gpu=true and still runs here, on the
    # CPU (DeepSpeed's CPU accelerator has fp16 where oneDNN does)
    resolved = resolve_run(cfg, ClusterShape(num_workers=1, use_gpu=cfg.scaling.use_gpu))
    device = torch.device("cpu")
    import_deepspeed(device)
    from deepspeed.accelerator import get_accelerator

    if resolved.deepspeed.precision == "fp16" and not get_accelerator().is_fp16_supported():
        with open(out_path, "w") as f:
            json.dump({"skipped": "DeepSpeed's CPU accelerator has no fp16 here (needs oneDNN fp16: AVX512-FP16 "
                                  "or AMX); benchmarks/gpu_x1.sh fp16 runs it on a GPU"}, f)
        return
    engine, scheduler, _ = build_engine(resolved, device)
    zopt = engine.optimizer
    scan_dropped = compat.host_overflow_scan_dropped(zopt)  # before the comparison run puts it back
    if keep_scan:
        compat.restore_host_overflow_scan(zopt)
    backup = getattr(zopt, "backup_optimizer", None)
    out = {"ds_config": resolved.ds_config, "zero_optimizer": type(zopt).__name__,
           "cpu_optimizer": type(zopt.optimizer).__name__,
           "fp32_optimizer_states": getattr(zopt.optimizer, "fp32_optimizer_states", None),
           "master_dtype": str(zopt.master_weights_and_grads_dtype),
           "sub_group_numels": [int(x) for x in zopt.fp16_partitioned_groups_flat_numel],
           "subgroup_to_device": getattr(zopt, "subgroup_to_device", None),
           "has_backup_optimizer": backup is not None, "host_overflow_scan_dropped": scan_dropped,
           "backup_groups_are_the_cpu_groups": None if backup is None else
           [a is b for a, b in zip(backup.param_groups, zopt.optimizer.param_groups)]}
    g = torch.Generator().manual_seed(0)
    vocab, micro, seq = resolved.model.vocab_size, resolved.deepspeed.micro_batch_per_gpu, cfg.data.seq_len
    fixed = {"input_ids": torch.randint(0, vocab, (micro, seq), generator=g)}
    batches = iter(lambda: fixed, None)  # one batch over and over: the loss must fall on it
    losses, cpu_lrs, backup_lrs, loss_scales = [], [], [], []
    for _ in range(cfg.training.max_steps):
        loss, _ = train_step(engine, batches, resolved.deepspeed.gradient_accumulation_steps, device)
        losses.append(loss.item())
        loss_scales.append(float(zopt.loss_scale))
        cpu_lrs.append([grp["lr"] for grp in zopt.optimizer.param_groups])
        if backup is not None:
            backup_lrs.append([grp["lr"] for grp in backup.param_groups])
    states = []
    for i, master in enumerate(zopt.fp32_partitioned_groups_flat):
        state = zopt.optimizer.state.get(master) or (backup.state.get(master) if backup is not None else None) or {}
        states.append({"master": str(master.dtype), "grad": None if master.grad is None else str(master.grad.dtype),
                       "moments": sorted({str(v.dtype) for k, v in state.items() if k.startswith("exp_avg")})})
    out.update(losses=losses, cpu_lrs=cpu_lrs, backup_lrs=backup_lrs, states=states, loss_scales=loss_scales,
               skipped_steps=engine.skipped_steps,
               scheduler=type(scheduler).__name__ if scheduler is not None else None)
    if backup is not None:  # a resume: loading replaces the CPU optimizer's param-group dicts
        ckpt = os.path.join(os.path.dirname(out_path), "ckpt")
        engine.save_checkpoint(ckpt, tag="t")
        engine.load_checkpoint(ckpt, tag="t")
        shared = lambda: [a is b for a, b in zip(backup.param_groups, zopt.optimizer.param_groups)]  # noqa: E731
        out["shared_after_load"] = shared()
        after_checkpoint_load(engine)
        out["shared_after_reattach"] = shared()
    with open(out_path, "w") as f:
        json.dump(out, f)
    engine.destroy()


if __name__ == "__main__":
    keep = "--deepspeed-overflow-scan" in sys.argv[2:]
    main(sys.argv[1], [a for a in sys.argv[2:] if a != "--deepspeed-overflow-scan"], keep)
