"""Activation memory of a Llama-style decoder (and of GPT-2's, GPT-NeoX's, OPT's, XGLM's and GPTBigCode's layers) at
the start of backward (its peak), per worker, and the shapes the planner reads from a Hugging Face config: the dense
widths (`decoder_dims`) and a mixture of experts' (`moe_dims`, with the parameters a token runs:
`active_parameters`)."""

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
    # OPT and XGLM spell the MLP's width ffn_dim, GPT-2 and GPTBigCode n_inner (None: 4h)
    inter = next((getattr(hf_config, k, None) for k in ("intermediate_size", "ffn_dim", "n_inner")
                  if getattr(hf_config, k, None)), 4 * h)
    return DecoderDims(h, hf_config.num_hidden_layers, heads, heads * head_dim, kv_heads * head_dim, inter)


# Decoders that normalise q and k per head before the rotary embedding (Qwen3Attention's q_norm, k_norm).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")

# Decoders whose norms are LayerNorms and whose MLP is one activation between two projections, not SwiGLU (GPT-2's
# ln_1 and ln_2, c_fc, the activation, c_proj; GPT-NeoX's input_layernorm and post_attention_layernorm,
# dense_h_to_4h, the activation, dense_4h_to_h; OPT's and XGLM's self_attn_layer_norm and final_layer_norm, fc1,
# the activation, fc2; GPTBigCode's as GPT-2's): measured in tests/unit/planning/test_activations.py.
GPT2_LIKE = ("gpt2", "gpt_neox", "opt", "xglm", "gpt_bigcode")
# Values of the MLP's width an activation keeps for backward, besides its output (kept by the down projection):
# transformers' NewGELUActivation ("gelu_new", GPT-2's default) is Python arithmetic that keeps x, tanh(...), 0.5*x
# and 1 + tanh(...); torch's own GELU ("gelu", GPT-NeoX's and XGLM's default, "gelu_pytorch_tanh", GPTBigCode's)
# keeps its input alone (the default here); ReLU (OPT's default) keeps its output, which the down projection keeps
# anyway: nothing more.
ACTIVATION_KEPT_VALUES = {"gelu_new": 4, "relu": 0}
# Activations whose backward reads their output: a dropout after them (XGLM's activation_dropout) leaves it kept
# besides the dropped values the down projection keeps.
ACTIVATION_KEEPS_OUTPUT = ("relu",)
# Decoders whose q, k and v are views of one fused projection's output (GPT-2's and GPTBigCode's c_attn, GPT-NeoX's
# query_key_value, Phi3's qkv_proj): while anything keeps v, the whole output, e*(q + 2kv), stays alive.
FUSED_QKV = ("gpt2", "gpt_neox", "phi3", "gpt_bigcode")
# Those whose rotary embedding copies q and k (all but GPT-2, whose q and k are the output itself): SDPA keeps the
# rotated q and k besides the whole output, e*(q + kv) more than separate projections keep.
FUSED_ROTATED_QKV = ("gpt_neox", "phi3")
# Decoders whose attention is their own code whatever attn_implementation says: XGLMAttention's two bmms and a
# softmax in the model's dtype (transformers 5.25 registers no SDPA for XGLM: raytrain resolves it to "eager").
BMM_ATTENTION = ("xglm",)


class DropoutProbabilities(NamedTuple):
    """Where a decoder drops values in training, and with what probability (0: no dropout there)."""
    embeddings: float
    residual: float      # each of a layer's two residual branches: attention's output and the MLP's
    attention: float     # the attention probabilities
    activation: float    # the MLP's activation output, the down projection's input (XGLM's activation_dropout)


# The config keys of a family's dropout probabilities (`DropoutProbabilities`' order), as transformers 5.25's
# modeling files use them. Families not listed drop only the attention probabilities (Llama, Mistral, Qwen, Gemma,
# Mixtral); their other dropout keys, if any, are not read (raytrain.planning.estimate.model_caveat names them).
DROPOUT_KEYS = {
    "gpt2": ("embd_pdrop", "resid_pdrop", "attn_pdrop", None),
    "gptj": ("embd_pdrop", "resid_pdrop", "attn_pdrop", None),
    "gpt_neox": ("hidden_dropout", "hidden_dropout", "attention_dropout", None),
    "phi": ("embd_pdrop", "resid_pdrop", "attention_dropout", None),
    "phi3": (None, "resid_pdrop", "attention_dropout", None),  # Phi3Config has embd_pdrop, which the model never uses
    "starcoder2": ("embedding_dropout", "residual_dropout", "attention_dropout", None),
    "opt": (None, "dropout", "attention_dropout", None),  # OPTDecoder sets self.dropout and never applies it
    "xglm": ("dropout", "dropout", "attention_dropout", "activation_dropout"),
    "gpt_bigcode": ("embd_pdrop", "resid_pdrop", "attn_pdrop", None),
}
ATTENTION_ONLY_DROPOUT = (None, None, "attention_dropout", None)


def unread_dropout(hf_config) -> dict[str, float]:
    """A family's nonzero dropout probabilities that `dropout_probabilities` does not read: for a family DROPOUT_KEYS
    does not list, every *dropout* or *pdrop key but attention_dropout (Falcon's and Bloom's hidden_dropout, GPT-Neo's
    resid_dropout, CodeGen's resid_pdrop), except a classification or summary head's, which a causal LM never runs."""
    if getattr(hf_config, "model_type", None) in DROPOUT_KEYS:
        return {}
    return {key: float(value) for key, value in hf_config.to_dict().items()
            if ("dropout" in key or key.endswith("pdrop")) and key not in ATTENTION_ONLY_DROPOUT
            and not key.startswith(("classifier", "summary")) and isinstance(value, (int, float))
            and not isinstance(value, bool) and value > 0}


def dropout_probabilities(hf_config) -> DropoutProbabilities:
    """The config's dropout probabilities, 0 where the family has no such dropout (`DROPOUT_KEYS`)."""
    keys = DROPOUT_KEYS.get(getattr(hf_config, "model_type", None), ATTENTION_ONLY_DROPOUT)
    return DropoutProbabilities(*(float(getattr(hf_config, key, None) or 0) if key else 0.0 for key in keys))


# What autograd keeps per token and routed expert besides activations: transformers' grouped_mm path keeps three
# int64 indices (the sort's permutation for the gathered input and for the weights, and its inverse), top-k's
# int64 expert index, and the fp32 routing weight and top-k value (Mixtral; Qwen's weights are cast to e bytes).
ROUTED_INDEX_BYTES = 3 * 8 + 8 + 4 + 4


class MoeDims(NamedTuple):
    """A mixture-of-experts decoder's sparse MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek spellings)."""
    experts: int
    per_token: int        # num_experts_per_tok: the experts each token runs
    intermediate: int     # one routed expert's width (moe_intermediate_size, else intermediate_size)
    shared: int           # the shared experts' width, all together (0: none)
    shared_gate: bool     # Qwen2-MoE's sigmoid gate on the shared expert's output
    sparse_layers: int    # layers whose MLP is the experts; the others are dense (intermediate_size)


def moe_dims(hf_config) -> MoeDims | None:
    """The config's experts, or None for a dense model. A layer is sparse unless mlp_only_layers lists it, it is
    below first_k_dense_replace (DeepSeek) or (index + 1) is not a multiple of decoder_sparse_step (Qwen2/3-MoE)."""
    def get(key: str, default=None):
        return getattr(hf_config, key, None) or default  # configs write None (or 0) for "none"

    experts = next((get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(get(k), int) and get(k) > 1), None)
    if experts is None:
        return None
    dense_inter = get("intermediate_size", 4 * hf_config.hidden_size)
    inter = get("moe_intermediate_size", dense_inter)
    shared = get("shared_expert_intermediate_size", get("n_shared_experts", 0) * inter)
    step, first = get("decoder_sparse_step", 1), get("first_k_dense_replace", 0)
    dense_only = set(get("mlp_only_layers", ()))
    sparse = sum(1 for i in range(first, hf_config.num_hidden_layers) if i not in dense_only and (i + 1) % step == 0)
    return MoeDims(experts, get("num_experts_per_tok", 1), inter, shared,
                   get("shared_expert_intermediate_size") is not None, sparse)


def active_parameters(hf_config, num_params: int) -> int:
    """The parameters a token runs, the count its FLOPs scale with: all of a dense model's; a mixture of experts'
    less its routed experts that do not run (each a SwiGLU MLP: 3 x hidden x width, no biases)."""
    moe = moe_dims(hf_config)
    if moe is None:
        return num_params
    idle = moe.sparse_layers * (moe.experts - moe.per_token) * 3 * hf_config.hidden_size * moe.intermediate
    return num_params - idle


def activation_bytes(hf_config, micro_batch: int, seq_len: int, bytes_per_value: int, *,
                     checkpointing: bool, attn_implementation: str = "sdpa", liger_kernel: str = "none",
                     sdpa_out_copies: int = 2, fp8: bool = False, on_gpu: bool = True, fp16: bool = False,
                     document_mask: bool = False) -> int:
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
      documents    2*e*(q - kv) + e*s   SDPA with `document_mask` (data.position_ids=per_document): transformers
                                        masks attention within each document with a 4D mask, then repeats k and
                                        v to q's heads (no GQA in SDPA with a mask) and SDPA keeps its own float
                                        copy of the bool mask, per layer (measured on CPU; on an H100 the 1.1B
                                        kept +0.55 GiB a sequence against these terms' 0.47). Flash attention's
                                        varlen kernels take the positions instead: none of it.
    GPT-2 (`GPT2_LIKE`) differs in its norms and MLP: a LayerNorm keeps its input, the fp32 mean and rstd and
    its output (2*e*h + 8), and the MLP keeps what the activation keeps of c_fc's output (`ACTIVATION_KEPT_VALUES`:
    4 values for gelu_new, GPT-2's default) and the activation's output, c_proj's input: 5*e*i. (Planned as
    Llama's norms and SwiGLU, GPT-2 kept 1.02x the plan in fp32 and 0.94x in bf16, by errors that cancel.)
    GPT-NeoX's layers are planned the same way (GELU keeps its input: 2*e*i); with use_parallel_residual (its
    default) both LayerNorms read the layer's input, kept once: e*h less. (Planned as Llama's, it kept 0.67-0.78x.)
    So are OPT's (ReLU keeps its output, c_proj's input: e*i), XGLM's and GPTBigCode's (GELU: 2*e*i). Planned as
    Llama's layers 4h wide (their ffn_dim and n_inner were not read) they kept 0.34-0.78x the plan without dropout,
    and GPTBigCode 1.4-2.2x with dropout 0.1 under SDPA, whose keys were not read.
    XGLM's attention is its own code whatever attn_implementation says (`BMM_ATTENTION`): the reshaped copies of
    q, k and v, o_proj's input and two e-byte score matrices, torch.max's input and softmax's output,
    e*(2q + 2kv) + 2*e*a*s (none of SDPA's terms). Under fp16 (`fp16`) softmax's output is fp32 (4 bytes a score
    in place of e), and without dropout its e-byte cast is kept besides (XGLM kept 1.57x the plan without this). XGLM
    also drops the MLP's activation output (activation_dropout): a mask of the MLP's width, whose dropped values
    take the activation's output's place as the down projection's input (m*i more; ReLU, `ACTIVATION_KEEPS_OUTPUT`,
    keeps its output besides: (m + e)*i).
    A fused q, k and v projection (`FUSED_QKV`) whose q and k the rotary embedding copies (GPT-NeoX, Phi3)
    keeps its whole output, held by v, a view into it, besides the rotated q and k: e*(q + kv) more. (Phi3 kept
    1.09-1.10x the plan without it.) Phi3's fused gate_up_proj keeps no more than SwiGLU's four values.
    Dropout, where the config's probability is > 0 (`dropout_probabilities`; raytrain trains in training mode,
    raytrain.model.build_model): each dropout keeps a mask of its input's size, m bytes a value: 1 on a GPU
    (native_dropout's bool mask), e on a CPU, whose dropout multiplies by a noise tensor of the input's dtype
    (`on_gpu`). The embeddings' keeps m*h per token, the residual branches' 2*m*h per layer (the dropped values
    themselves only flow into an add). The attention probabilities' dropout keeps nothing in a GPU's fused SDPA
    kernels (flash, memory-efficient, cuDNN: the RNG's seed and offset); in eager attention its mask and the
    dropped probabilities, which replace the cast as the matmul's input: a*s*(4 + m + e) in all (XGLM's
    attention: a*s*(m + e) more, its softmax's output being kept by softmax itself). On a CPU, SDPA
    with dropout takes its math path, in fp32 whatever e: the scaled q, k transposed and v (k and v repeated to
    q's width under GQA), the softmax's output, its noise and the dropped probabilities, and o_proj's input:
    4*3*q + 12*a*s + e*q in place of SDPA's terms above (no logsumexp; at s=256 a GPT-2 layer keeps 2.0x
    what it keeps without dropout in fp32, 2.9x in bf16). There a fused projection's v (GPT-2's too), in fp32 and
    without GQA neither cast nor repeated, stays a view that keeps the whole output: e*(q + 2kv) in place of 4*q
    (GPT-2 kept 1.04x the plan without it).
    Outside the layers: the final norm and the logits. HF's loss (ForCausalLMLoss) upcasts the logits to fp32
    and keeps log_softmax's fp32 output; at the start of backward that output, its incoming gradient (from
    nll_loss) and the gradient w.r.t. the logits coexist: 12*vocab bytes per token, often more than a whole
    layer. The logits (e*vocab) and their fp32 copy are freed after the forward: nothing saves them and
    raytrain's train_step keeps only the loss of the model's output (its step's peak on CPU, with a 16k
    vocabulary: 1.000 of this plan; tests/unit/planning/test_activations.py). A loop that holds the output
    across backward holds the logits too: 14*vocab in bf16, 16 in fp32.
    With checkpointing each layer keeps only its input (e*h per token) and one layer at a time is
    recomputed with its full activations.
    Mixture of experts (`moe_dims`): a sparse layer's MLP keeps, per token, for each of its k =
    num_experts_per_tok experts the gathered input and the expert's output (kept by the routing weight's
    multiply) besides the SwiGLU's four values at the expert's width i_e: k*(e*(2h + 4*i_e) + 40), the 40
    bytes the routing's indices and weights (ROUTED_INDEX_BYTES); the router's fp32 softmax (4 x experts); a shared
    expert is a dense MLP (4*e*i_s), gated (Qwen2-MoE) by a sigmoid that keeps it and its output (e*h + e).
    That is what transformers 5's experts keep, the default grouped_mm path and the reference loop alike
    (measured on Mixtral, Qwen2-MoE and Qwen3-MoE: tests/unit/planning/test_moe.py); fused MoE kernels keep
    less. With checkpointing the recomputed layer is the larger kind.
    Qwen3's per-head RMSNorms of q and k (`QK_NORM_MODEL_TYPES`) keep what a norm keeps: (4 + e)(q + kv).
    Gemma2's soft-capping: final_logit_softcapping keeps tanh's output, one more e-byte copy of the logits
    (unless Liger's loss makes none); attn_logit_softcapping, with eager attention, one more score matrix.
    Liger kernels (model.liger_kernel): "loss" computes the loss in chunks without materialising
    the logits (12*vocab -> 0); "all" also keeps only the input and output of each RMSNorm (2*e*h)
    and gate, up and their product in the MLP (3*e*i), recomputing silu in backward.
    FP8 GEMMs (model.fp8, raytrain/worker/fp8.py) keep a 1-byte copy of each projection's input instead of
    the e-byte value: both norms' outputs and the down_proj input shrink to 1 byte, and o_proj adds a
    1-byte copy of SDPA's output (which SDPA keeps anyway): (e - 1)(2h + i) - q bytes less.
    Measured at 1.1B (mb 24): 71.1 GiB against 78.6 (this term: 7.7 GiB less).
    (Liger and FP8 patch Llama layers only, never a mixture of experts: raytrain.planning.resolve.)
    """
    h, num_layers, heads, q, kv, inter = decoder_dims(hf_config)
    vocab = hf_config.vocab_size
    e = bytes_per_value
    model_type = getattr(hf_config, "model_type", None)
    layer_norms = model_type in GPT2_LIKE  # LayerNorms and a single-activation MLP (GPT-2, GPT-NeoX, OPT, ...)
    embed_dropout, residual_dropout, attention_dropout, activation_dropout = dropout_probabilities(hf_config)
    mask = 1 if on_gpu else e  # bytes of a dropout's mask per value

    fused = liger_kernel == "all"
    if layer_norms:
        norm = 2 * e * h + 8
    else:
        norm = (e * h if fused else 4 * h + e * h) + e * h
    # GPT-NeoX's parallel residual: both LayerNorms read the layer's input, kept once
    norms = 2 * norm - (e * h if layer_norms and getattr(hf_config, "use_parallel_residual", False) else 0)
    if model_type in BMM_ATTENTION:
        # the reshaped copies of q, k and v (kept by the two bmms), o_proj's input (a copy), torch.max's input (the
        # masked scores) and softmax's output, fp32 under fp16 (XGLM upcasts it there), whose cast the bmm keeps;
        # with dropout the mask and the dropped probabilities, the bmm's input in the cast's place
        attention = e * (q + 2 * kv) + e * q + heads * seq_len * (e + (4 if fp16 else e))
        if attention_dropout:
            attention += heads * seq_len * (mask + e)
        elif fp16:
            attention += heads * seq_len * e
    elif attention_dropout and attn_implementation == "sdpa" and not on_gpu:
        # fp32 q, and k and v repeated to q's width (the math path repeats them under GQA); three score matrices
        attention = 4 * 3 * q + 3 * 4 * heads * seq_len + e * q
        if model_type in FUSED_QKV and e == 4 and kv == q:
            attention += e * (q + 2 * kv) - 4 * q  # v neither cast nor repeated: a view of the whole fused output
    else:
        attention = e * (q + 2 * kv) + sdpa_out_copies * e * q + 4 * heads
        if document_mask and attn_implementation == "sdpa":
            attention += 2 * e * (q - kv) + e * seq_len
        if model_type in FUSED_ROTATED_QKV:
            attention += e * (q + kv)
    if model_type in QK_NORM_MODEL_TYPES:
        attention += (4 + e) * (q + kv)
    if attn_implementation == "eager" and model_type not in BMM_ATTENTION:
        cast = e if e < 4 else 0
        attention += heads * seq_len * (4 + cast)
        if attention_dropout:
            attention += heads * seq_len * (mask + e - cast)
        if getattr(hf_config, "attn_logit_softcapping", None):
            attention += e * heads * seq_len
    if layer_norms:
        activation = getattr(hf_config, "activation_function", None) or getattr(hf_config, "hidden_act", None)
        mlp = (ACTIVATION_KEPT_VALUES.get(activation, 1) + 1) * e * inter
        if activation_dropout:  # its mask; the dropped values take the activation's output's place as c_proj's input
            mlp += (mask + (e if activation in ACTIVATION_KEEPS_OUTPUT else 0)) * inter
    else:
        mlp = (3 if fused else 4) * e * inter
    layer = norms + attention + mlp
    if residual_dropout:
        layer += 2 * mask * h
    if fp8:
        layer -= (e - 1) * (2 * h + inter) - q
    moe = moe_dims(hf_config)
    sparse_layers = moe.sparse_layers if moe else 0
    sparse_layer = layer
    if moe:
        experts_mlp = moe.per_token * (e * (2 * h + 4 * moe.intermediate) + ROUTED_INDEX_BYTES) + 4 * moe.experts
        shared_mlp = 4 * e * moe.shared + ((e * h + e) if moe.shared_gate else 0)
        sparse_layer = layer - mlp + experts_mlp + shared_mlp
    if checkpointing:
        layers = num_layers * e * h + (max(layer, sparse_layer) if sparse_layers < num_layers else sparse_layer)
    else:
        layers = (num_layers - sparse_layers) * layer + sparse_layers * sparse_layer
    no_logits = liger_kernel in ("loss", "all")
    logits = 0 if no_logits else 12 * vocab
    if getattr(hf_config, "final_logit_softcapping", None) and not no_logits:
        logits += e * vocab
    per_token = layers + norm + logits + (mask * h if embed_dropout else 0)
    return micro_batch * seq_len * per_token
