"""The memory plan as the table `python -m raytrain.tools.plan` prints (raytrain.planning.memory.MemoryPlan)."""

from __future__ import annotations

from raytrain.planning.memory import GPU_RESERVE_FRACTION, HOST_RESERVE_FRACTION, MemoryPlan, Option, fits, gib


def option_label(option: Option) -> str:
    s = option.setting
    if s.offload_param:
        label = "offload param+optimizer"
    elif s.offload_optimizer and s.ratio < 1:
        label = f"offload optimizer, ratio {s.ratio:.2f} ({option.params_on_host / 1e9:.2f}B)"
    elif s.offload_optimizer:
        label = "offload optimizer"
    else:
        label = "no offload"
    return label + (", checkpointing" if s.gradient_checkpointing else "")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: batch arithmetic, parameters, model states, activations, and what fits."""
    f = plan.facts
    device = "GPU" if plan.use_gpu else "worker"
    node_note = " (assumed: pass --gpus-per-node)" if plan.workers_per_node_assumed and plan.num_nodes > 1 else ""
    states = ("bf16 master weights and optimizer states" if f.bf16_states else
              "bf16 master weights, fp32 Adam moments" if f.bf16_master else "fp32 master weights and Adam moments")
    lines = [
        f"model       {plan.model_type}, {plan.num_params:,} parameters (largest layer {plan.largest_layer_params:,}), "
        f"{plan.precision}, ZeRO-{plan.zero_stage}, {states}",
        f"cluster     {plan.world_size} {'GPU' if plan.use_gpu else 'CPU'} workers = {plan.num_nodes} node(s) x "
        f"{plan.workers_per_node}{node_note}",
        f"batch       train_batch_size {plan.train_batch_size} = micro-batch {plan.micro_batch_per_gpu} x "
        f"gradient_accumulation_steps {plan.gradient_accumulation_steps} x world size {plan.world_size}; "
        f"seq_len {plan.seq_len} ({plan.train_batch_size * plan.seq_len:,} tokens per step)",
        f"target      {_target(plan)}",
        "",
        f"model states per {device} (ZeRO-{plan.zero_stage} over {plan.world_size})"
        + ("   on GPU      in host RAM per node" if plan.use_gpu else "   in host RAM"),
    ]
    for offload, (resident, host) in plan.model_states.items():
        if not plan.use_gpu and offload != "none":
            continue
        label = "no offload" if offload == "none" else f"offload {offload} to {_devices(f, offload)}"
        if plan.use_gpu:
            lines.append(f"  {label:<40} {gib(resident):>11}  {gib(host * plan.workers_per_node):>11}")
        else:
            lines.append(f"  {label:<40} {gib(resident + host):>11}")
    lines.append(f"activations per {device} (micro-batch {plan.micro_batch_per_gpu} x seq_len {plan.seq_len})")
    for ckpt in (False, True):
        label = "gradient checkpointing" if ckpt else "no checkpointing"
        lines.append(f"  {label:<40} {gib(plan.activations[ckpt]):>11}")
    lines += ["", f"peak (states + working set + activations)       per {device:<6}  host per node  fits"
              + ("   (ratio: the offloaded fraction of sub-groups; in brackets, the parameters whose states are "
                 "on the host)" if any(o.setting.ratio < 1 for o in plan.options) else "")]
    target_known = plan.gpu_memory_bytes is not None or plan.host_memory_bytes is not None
    for option in plan.options:
        if not plan.use_gpu and option.offload != "none":
            continue
        fit = fits(option, plan.gpu_memory_bytes, plan.host_memory_bytes, plan.use_gpu)
        verdict = ("yes" if fit else "no") if target_known else "?"
        mark = "  <- configured" if option.configured else ""
        lines.append(f"  {option_label(option):<45} {gib(option.worker_bytes):>11}  "
                     f"{gib(option.host_bytes_per_node):>13}  {verdict:<4}{mark}")
    return "\n".join(lines)


def _devices(f, offload: str) -> str:
    """Where an offload goes: the device the config names (the planner's alternatives: the CPU)."""
    opt = "nvme" if f.nvme("offload_optimizer") else "cpu"
    if offload == "optimizer":
        return opt
    par = "nvme" if f.nvme("offload_param") else "cpu"
    return par if par == opt else f"{par} (param), {opt} (optimizer)"


def _target(plan: MemoryPlan) -> str:
    parts = []
    if plan.use_gpu:
        cap = (f", scaling.gpu_memory_fraction={plan.gpu_memory_fraction:g}"
               if plan.gpu_memory_fraction is not None else "")
        gpu = plan.gpu_memory_bytes
        parts.append(f"{gib(gpu)} per GPU{cap} ({gib(gpu * (1 - GPU_RESERVE_FRACTION))} usable)" if gpu
                     else "GPU memory unknown (pass --gpu-memory-gib)")
    parts.append(f"{gib(plan.host_memory_bytes)} host RAM per node "
                 f"({gib(plan.host_memory_bytes * (1 - HOST_RESERVE_FRACTION))} usable)"
                 if plan.host_memory_bytes else "host RAM unknown (pass --host-memory-gib)")
    return ", ".join(parts)
