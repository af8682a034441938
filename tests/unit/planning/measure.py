"""What real transformers models keep on CPU, for the activation model's tests (raytrain.planning.activations):
the tensors autograd saves for backward (`saved_bytes`) and the allocator's peak while a step runs (`peak_bytes`)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

SEQ_LEN = 256


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layers, whatever the family calls them (model.layers, transformer.h, gpt_neox.layers)."""
    n = model.config.num_hidden_layers
    return next(m for m in model.base_model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n)


def saved_bytes(hf_config, dtype, attn_implementation="sdpa", with_loss=False, position_ids=None):
    """Bytes autograd keeps for backward after one forward of micro-batch 1, up to the LM head's output (weights
    and the loss excluded: the planner's 12*vocab logits term is the start of backward, not saved tensors, and
    is calibrated apart): (without checkpointing, with it). With checkpointing a run keeps each layer's input,
    what lies outside the layers, and at the start of backward one layer recomputed whole: the largest layer's
    share of the first figure. `with_loss`: what the loss keeps is counted too, in the first figure. The model
    is built as raytrain.model.build_model leaves it: in training mode (dropout on), no KV cache. `position_ids`: the
    positions a row of data.position_ids=per_document carries (restarting at each document), else none."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation).to(dtype).train()
    model.config.use_cache = False  # a cache's copies of k and v would stand in for the views SDPA keeps
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = decoder_layers(model)
    current = [None]  # the layer running now (None: outside the layers)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda module, args, out: current.__setitem__(0, None))
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: current.__setitem__(0, "loss"))
    kept = {}  # storage -> (bytes, the layer that saved it first); a storage kept twice counts once

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept.setdefault(storage.data_ptr(), (storage.nbytes(), current[0]))
        return t

    ids = torch.randint(0, hf_config.vocab_size, (1, SEQ_LEN))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, position_ids=position_ids)
    per_layer = [sum(n for n, owner in kept.values() if owner == i) for i in range(len(layers))]
    outside = sum(n for n, owner in kept.values() if owner is None or (with_loss and owner == "loss"))
    inputs = len(layers) * SEQ_LEN * hf_config.hidden_size * dtype.itemsize
    return sum(per_layer) + outside, inputs + outside + max(per_layer)


def peak_bytes(step) -> int:
    """The most bytes the CPU allocator held at once while `step()` ran, above what it held before: the running
    sum of the profiler's allocation records (each allocation and free, in order; torch 2.13's kineto records)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    records = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in records:
        held += nbytes
        peak = max(peak, held)
    return peak
