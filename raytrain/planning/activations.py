"""Activation memory of a Llama-style decoder at the start of backward (its peak), per worker."""

from __future__ import annotations

from typing import NamedTuple


class DecoderDims(NamedTuple):
    """A Llama-style decoder's widths, as the planner reads them from a Hugging Face config (with the usual
    defaults where a family leaves one out): the activation model and the throughput model's FLOP counts."""
    hidden: int
    num_layers: int
    heads: int
    q: int           # heads x head_dim: the width of q and of o_proj's input
    kv: int          # key/value heads x head_dim: the width of k and of v
    intermediate: int


def decoder_dims(hf_config) -> DecoderDims:
    h = hf_config.hidden_size
    heads = getattr(hf_config, "num_attention_heads", None) or max(1, h // 64)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter = getattr(hf_config, "intermediate_size", None) or 4 * h
    return DecoderDims(h, hf_config.num_hidden_layers, heads, heads * head_dim, kv_heads * head_dim, inter)


def activation_bytes(hf_config, micro_batch: int, seq_len: int, bytes_per_value: int, *,
                     checkpointing: bool, attn_implementation: str = "sdpa", liger_kernel: str = "none",
                     sdpa_out_copies: int = 2, fp8: bool = False) -> int:
    """Activation memory of one worker at the start of backward (its peak), in bytes.

    Korthikanti et al. (2022) give s*b*h*(34 + 5*a*s/h) bytes per layer for a GPT layer in fp16.
    A Hugging Face Llama layer keeps different tensors for backward; per token, with e bytes per
    activation (2 for bf16/fp16, 4 for fp32):
      2 RMSNorms   2 x (4h + 2*e*h)     fp32 upcast of the input, the normalised value (kept by the
                                        weight multiply) and the output (kept by the next projections)
      attention    e*(q + 2*kv)         rotated q, k and v, kept by SDPA (no GQA copies)
                   c*e*q + 4*a          SDPA's output and the fp32 logsumexp; c = `sdpa_out_copies`:
                                        2 when o_proj's input is a copy of the output (CPU's math path,
                                        eager), 1 when it is a view (the GPU's fused kernels return
                                        (batch, seq, heads, head_dim)-contiguous output; issue 14 SPEC §2.3)
      SwiGLU MLP   4*e*i                gate, silu(gate), up and their product (the down_proj input)
      eager attn   a*s*(4 + e)          + fp32 softmax probabilities and their cast (SDPA/flash: none)
    Outside the layers: the final norm and the logits. HF's loss upcasts the logits to fp32, and at
    the start of backward the fp32 log-softmax (kept), its incoming gradient and the gradient w.r.t.
    the logits coexist: 12*vocab bytes per token, often more than a whole layer.
    With checkpointing each layer keeps only its input (e*h per token) and one layer at a time is
    recomputed with its full activations.
    Liger kernels (model.liger_kernel): "loss" computes the loss in chunks without materialising
    the logits (12*vocab -> 0); "all" also keeps only the input and output of each RMSNorm (2*e*h)
    and gate, up and their product in the MLP (3*e*i), recomputing silu in backward.
    FP8 GEMMs (model.fp8, raytrain/worker/fp8.py) keep a 1-byte copy of each projection's input instead of
    the e-byte value: both norms' outputs and the down_proj input shrink to 1 byte, and o_proj adds a
    1-byte copy of SDPA's output (which SDPA keeps anyway): (e - 1)(2h + i) - q bytes less.
    Measured at 1.1B (mb 24): 71.1 GiB against 78.6 (this term: 7.7 GiB less).
    """
    h, num_layers, heads, q, kv, inter = decoder_dims(hf_config)
    vocab = hf_config.vocab_size
    e = bytes_per_value

    fused = liger_kernel == "all"
    norm = (e * h if fused else 4 * h + e * h) + e * h
    attention = e * (q + 2 * kv) + sdpa_out_copies * e * q + 4 * heads
    if attn_implementation == "eager":
        attention += heads * seq_len * (4 + (e if e < 4 else 0))
    mlp = (3 if fused else 4) * e * inter
    layer = 2 * norm + attention + mlp
    if fp8:
        layer -= (e - 1) * (2 * h + inter) - q
    layers = num_layers * e * h + layer if checkpointing else num_layers * layer
    logits = 0 if liger_kernel in ("loss", "all") else 12 * vocab
    per_token = layers + norm + logits
    return micro_batch * seq_len * per_token
