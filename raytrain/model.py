"""The model and tokenizer: any Hugging Face causal LM, or the built-in tiny Llama and byte tokenizer.

`load_model_config` and `load_tokenizer` are cheap and run on the driver (for planning and
validation) as well as on workers. `build_model` runs on a worker and creates the parameters
under `deepspeed.zero.Init`, so each rank only ever holds its partition.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from raytrain.config import ConfigError, ModelConfig
from raytrain.config_files import first_line

# The built-in model: Llama-family, small enough to train in minutes on two CPU cores.
BUILTIN_LLAMA: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,  # 257 byte tokens, padded to a multiple of 64
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
BYTE_EOS = "<|endoftext|>"


# What save_pretrained writes as weights (safetensors, or the older pickle format), sharded or not.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_source(cfg: ModelConfig) -> str:
    """Where the run's initial weights come from, in words (the driver prints it once per run)."""
    if cfg.name_or_path is None:
        return "random init of the built-in tiny Llama (model.name_or_path=DIR trains your own)"
    if cfg.pretrained:
        return f"weights from {cfg.name_or_path} (model.pretrained=true)"
    return f"random init from {cfg.name_or_path}'s config (model.pretrained=true loads its weights)"


def load_model_config(cfg: ModelConfig):
    """The transformers config of the model to train, with `cfg.config` overrides applied.

    An override key the config does not have is refused with its closest field (transformers'
    configs take unknown keyword arguments as new attributes, so `hiden_size` would be ignored);
    a value the config's own validation refuses is one line naming the key."""
    from transformers import AutoConfig, LlamaConfig

    if cfg.name_or_path is None:
        if cfg.pretrained:
            raise ConfigError("model.pretrained=true loads the weights of model.name_or_path, which is not set: "
                              "set model.name_or_path to a model directory or hub id")
        _check_override_keys(LlamaConfig(**BUILTIN_LLAMA), cfg.config)
        return _validated(lambda: LlamaConfig(**{**BUILTIN_LLAMA, **cfg.config}), cfg.config)
    if cfg.pretrained and os.path.isdir(cfg.name_or_path) and not any(
            os.path.isfile(os.path.join(cfg.name_or_path, f)) for f in WEIGHT_FILES):
        raise ConfigError(f"model.pretrained=true but {cfg.name_or_path} holds no weights ({', '.join(WEIGHT_FILES)}): "
                          f"give a directory written by save_pretrained, or drop model.pretrained to train from "
                          f"random init")
    try:
        hf_config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        first = first_line(e)
        raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: cannot load its config ({first}); "
                          f"give a local directory with config.json or a Hugging Face hub id") from None
    _check_override_keys(hf_config, cfg.config)
    for key, value in cfg.config.items():
        _validated(lambda: setattr(hf_config, key, value), {key: value})
    return hf_config


def _check_override_keys(hf_config, overrides: dict[str, Any]) -> None:
    known = sorted(set(hf_config.to_dict()) | set(getattr(hf_config, "attribute_map", {}) or {}))
    for key in overrides:
        if not hasattr(hf_config, key):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean model.config.{close[0]}?" if close else ""
            raise ConfigError(f"model.config.{key}: {type(hf_config).__name__} has no such field{hint}")


def _validated(build, overrides: dict[str, Any]):
    """Run `build`, turning transformers' own config validation (huggingface_hub's strict
    dataclasses: a type per field, architecture checks) into one line naming the keys."""
    try:
        return build()
    except Exception as e:  # StrictDataclass*Error (huggingface_hub), ValueError, TypeError
        if not (type(e).__name__.startswith("StrictDataclass") or isinstance(e, (TypeError, ValueError))):
            raise
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__
        keys = ", ".join(f"model.config.{k}={v!r}" for k, v in overrides.items())
        raise ConfigError(f"{keys or 'model.config'}: the model's config refuses it ({reason})") from None


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec: str | None, trust_remote_code: bool, key: str = "model.tokenizer"):
    """`key`: the setting `spec` came from, named by the errors (model.name_or_path when
    model.tokenizer is unset)."""
    if spec is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = first_line(e)
        fix = ("give a local directory or hub id" if key == "model.tokenizer"
               else "set model.tokenizer to a directory or hub id that holds one")
        raise ConfigError(f"{key}={spec!r}: cannot load its tokenizer ({first}); {fix}") from None
    if not tok.is_fast:
        raise ConfigError(f"{key}={spec!r} has a slow tokenizer: raytrain needs a fast (Rust) tokenizer"
                          + ("" if key == "model.tokenizer" else "; set model.tokenizer to one"))
    if tok.eos_token_id is None:
        raise ConfigError(f"{key}={spec!r}: its tokenizer has no eos_token: documents are separated by EOS; "
                          + ("use a tokenizer with one" if key == "model.tokenizer"
                             else "set model.tokenizer to a tokenizer with one"))
    return tok


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer named by the config (cached per process: tokenization tasks call this per batch)."""
    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    return _cached_tokenizer(cfg.tokenizer or cfg.name_or_path, cfg.trust_remote_code, key)


def byte_tokenizer():
    """A byte-level fast tokenizer (256 byte tokens + EOS), built in code: no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[BYTE_EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BYTE_EOS, pad_token=BYTE_EOS)


@dataclass(frozen=True)
class ParamStats:
    """What the planner and the metrics need to know about a model's parameters (from a meta-device build)."""

    num_params: int
    largest_layer_params: int
    """Most parameters owned directly by one module: DeepSpeed's "largest layer" (usually the
    embedding or lm_head), the biggest thing ZeRO-3 gathers whole on every rank."""
    param_numels: tuple[int, ...]
    """Size of every distinct parameter, in `model.parameters()` order (for
    stage3_param_persistence_threshold and ZeRO-3's optimizer sub-groups)."""
    param_ndims: tuple[int, ...] = ()
    """Dimensions of each parameter, same order: raytrain's optimizer decays the >= 2-D ones, in a
    param group of their own (raytrain.worker.engine.build_optimizer)."""


def param_stats(hf_config, trust_remote_code: bool = False) -> ParamStats:
    """Parameter sizes from the config alone: the model is built on the meta device (no memory is
    allocated; shared parameters such as tied embeddings count once). Cached per config."""
    return _param_stats(json.dumps(hf_config.to_dict(), sort_keys=True, default=str), type(hf_config),
                        trust_remote_code)


@functools.lru_cache(maxsize=8)
def _param_stats(config_json: str, config_class: type, trust_remote_code: bool) -> ParamStats:
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    numels = tuple(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return ParamStats(num_params=sum(numels), largest_layer_params=largest, param_numels=numels,
                      param_ndims=tuple(p.dim() for p in model.parameters()))


def config_from_facts(facts, cfg: ModelConfig):
    """The transformers config the driver resolved (raytrain.run_spec.ModelFacts), rebuilt on a worker
    without reading it again; a model with remote code is loaded again (its class lives in that code)."""
    from transformers import AutoConfig

    if cfg.trust_remote_code:
        return load_model_config(cfg)
    return AutoConfig.for_model(facts.model_type, **{k: v for k, v in facts.hf_config.items() if k != "model_type"})


def fused_layers_enabled(cfg: ModelConfig, hf_config) -> bool:
    """model.fused_layers resolved: true/false as set; "auto" is on for a Llama model with Liger's GPU
    kernels (liger_kernel=all, measured there) and off otherwise (raytrain/worker/fused.py)."""
    if cfg.fused_layers == "auto":
        return cfg.liger_kernel == "all" and not cfg.compile and getattr(hf_config, "model_type", None) == "llama"
    return bool(cfg.fused_layers)


def build_model(cfg: ModelConfig, hf_config, ds_config: dict[str, Any]):
    """Create the model on this worker, partitioned as it is created (ZeRO-3)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    stage3 = int((ds_config.get("zero_optimization") or {}).get("stage", 0)) == 3
    # Import the model's modules (and torch._dynamo, which transformers pulls in) before zero.Init
    # patches torch's tensor constructors: importing them inside it fails. Building on the meta
    # device does that at no memory cost.
    param_stats(hf_config, cfg.trust_remote_code)
    if cfg.pretrained:
        # transformers' DeepSpeed integration: while an HfDeepSpeedConfig with stage 3 is alive,
        # from_pretrained creates the model under zero.Init and loads each shard into its partition.
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 (a weak global reference reads it)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path, config=hf_config, attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code)
    else:
        # zero.Init partitions each submodule's parameters right after it is constructed, so the
        # full model never exists on one rank; dtype follows the config's bf16/fp16 section.
        with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=stage3):
            model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # no KV cache in training: it only costs memory
    return model
