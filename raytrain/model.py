"""The model and tokenizer: any Hugging Face causal LM, or the built-in tiny Llama and byte tokenizer.

`load_model_config` and `load_tokenizer` are cheap and run on the driver (for planning and
validation) as well as on workers. `build_model` runs on a worker and creates the parameters
under `deepspeed.zero.Init`, so each rank only ever holds its partition.
"""

from __future__ import annotations

import copy
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
    a value the config's own validation refuses is one line naming the key. So are a model that is
    not a decoder-only causal LM, and, with model.pretrained=true, an override that changes the
    shape or number of the weights to load (each worker's from_pretrained would fail, or leave new
    weights randomly initialised)."""
    from transformers import AutoConfig, LlamaConfig

    if cfg.name_or_path is None:
        if cfg.pretrained:
            raise ConfigError("model.pretrained=true loads the weights of model.name_or_path, which is not set: "
                              "set model.name_or_path to a model directory or hub id")
        _check_override_keys(LlamaConfig(**BUILTIN_LLAMA), cfg.config)
        return _validated(lambda: LlamaConfig(**{**BUILTIN_LLAMA, **cfg.config}), cfg.config)
    if os.path.isfile(cfg.name_or_path):
        raise ConfigError(f"model.name_or_path={cfg.name_or_path} is a file; give its directory "
                          f"(model.name_or_path={os.path.dirname(os.path.abspath(cfg.name_or_path))})")
    if cfg.pretrained and os.path.isdir(cfg.name_or_path) and not any(
            os.path.isfile(os.path.join(cfg.name_or_path, f)) for f in WEIGHT_FILES):
        raise ConfigError(f"model.pretrained=true but {cfg.name_or_path} holds no weights ({', '.join(WEIGHT_FILES)}): "
                          f"give a directory written by save_pretrained, or drop model.pretrained to train from "
                          f"random init")
    try:
        hf_config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: cannot load its config ({first_line(e)}); "
                          f"{_load_fix(cfg.name_or_path, e, 'model.name_or_path')}") from None
    _check_override_keys(hf_config, cfg.config)
    loaded = copy.deepcopy(hf_config) if cfg.pretrained and cfg.config else None
    for key, value in cfg.config.items():
        _validated(lambda: setattr(hf_config, key, value), {key: value})
    _check_causal_lm(hf_config, cfg)
    if loaded is not None:
        _check_same_weights(loaded, hf_config, cfg)
    return hf_config


def _load_fix(spec: str, error: BaseException, key: str) -> str:
    """The fix to name when transformers cannot load `spec` (a local path or a hub id)."""
    text = str(error)
    if "trust_remote_code" in text or "custom code" in text:
        return ("its config names its own Python code (auto_map): set model.trust_remote_code=true to run it "
                "(only for code you trust)")
    if os.path.isdir(spec):
        return "give a directory written by save_pretrained (with config.json), or a hub id"
    if os.path.isabs(spec) or spec.startswith((".", "~")) or spec.count("/") > 1:  # a hub id is NAME or ORG/NAME
        return f"there is no directory {spec}: check the path"
    # Not a local directory, so transformers read it as a hub id: a typo, no network, or
    # HF_HUB_OFFLINE=1 with the model not in the local cache all end here.
    from huggingface_hub import constants

    offline = " (HF_HUB_OFFLINE=1 is set: only the local hub cache is read)" if constants.is_offline_mode() else ""
    return (f"no local directory {spec!r}, so it is a Hugging Face hub id{offline}: check the name and the "
            f"network, or download it first (hf download {spec} --local-dir DIR) and set {key}=DIR")


def _check_causal_lm(hf_config, cfg: ModelConfig) -> None:
    """raytrain's loss is next-token prediction with a causal mask: a model that is not a decoder-only
    causal LM either fails later with a traceback (T5: no AutoModelForCausalLM) or, worse, trains
    (BERT's BertLMHeadModel with is_decoder=false attends to later tokens: the loss sees the answer)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    name = f"{cfg.name_or_path} ({type(hf_config).__name__})"
    fix = "raytrain trains decoder-only causal LMs (Llama, Qwen2, Mistral, GPT-2, ...): use one"
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ConfigError(f"model.name_or_path={name} is an encoder-decoder model: {fix}")
    remote = cfg.trust_remote_code and "AutoModelForCausalLM" in (getattr(hf_config, "auto_map", None) or {})
    if not remote and type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"model.name_or_path={name} has no causal LM class (AutoModelForCausalLM): {fix}")
    if getattr(hf_config, "is_decoder", None) is False:  # encoder families carry the flag; decoder-only ones do not
        raise ConfigError(f"model.name_or_path={name} is an encoder (is_decoder=false: each token attends to the "
                          f"tokens after it, so the next-token loss would see its answer): {fix}")


def _check_same_weights(loaded, hf_config, cfg: ModelConfig) -> None:
    """With model.pretrained=true, `cfg.config` (which made `loaded` into `hf_config`) must leave
    every weight's name and shape as the checkpoint has them: compared on meta-device builds (no
    memory; 0.8 s for a Llama-70B config on 2 CPU cores: benchmarks/driver_check_costs.py), so any field counts (vocab_size,
    num_hidden_layers, tie_word_embeddings, GPT-2's n_positions, ...). Only when something differs
    is each override tried alone, to name it."""
    before = weight_shapes(loaded, cfg.trust_remote_code)
    if weight_shapes(hf_config, cfg.trust_remote_code) == before:  # the run's own build: param_stats reuses it
        return
    for key, value in cfg.config.items():
        alone = copy.deepcopy(loaded)
        setattr(alone, key, value)
        after = weight_shapes(alone, cfg.trust_remote_code)
        if after == before:
            continue
        what = _shape_change(before, after)
        raise ConfigError(f"model.config.{key}={cfg.config[key]!r} changes the pretrained weights of "
                          f"{cfg.name_or_path} ({what}), which model.pretrained=true loads as saved: remove "
                          f"model.config.{key}, or drop model.pretrained to train from random init")
    keys = ", ".join(f"model.config.{k}" for k in cfg.config)  # only together (no single key changes a weight)
    raise ConfigError(f"{keys} together change the pretrained weights of {cfg.name_or_path} "
                      f"({_shape_change(before, weight_shapes(hf_config, cfg.trust_remote_code))}), which "
                      f"model.pretrained=true loads as saved: remove them, or drop model.pretrained")


def _shape_change(before: dict, after: dict) -> str:
    """The first difference between two {weight name: shape} maps, in words."""
    for name, shape in before.items():
        if name in after and after[name] != shape:
            return f"{name} {list(shape)} -> {list(after[name])}"
    added, removed = [n for n in after if n not in before], [n for n in before if n not in after]
    if added:
        return f"adds {added[0]}" + (f" and {len(added) - 1} more" if len(added) > 1 else "") + ", randomly initialised"
    return f"drops {removed[0]}" + (f" and {len(removed) - 1} more" if len(removed) > 1 else "")


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

    if os.path.isfile(spec):
        raise ConfigError(f"{key}={spec} is a file; give its directory "
                          f"({key}={os.path.dirname(os.path.abspath(spec))})")
    try:
        tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = first_line(e)
        if "trust_remote_code" in str(e) or "custom code" in str(e) or not (
                key == "model.name_or_path" or os.path.isdir(spec)):
            fix = _load_fix(spec, e, key)  # needs model.trust_remote_code, or no such directory or hub id
        elif key == "model.name_or_path":  # its config loaded: the model has no tokenizer of its own
            fix = "set model.tokenizer to a directory or hub id that holds one"
        else:
            fix = "give a local directory or hub id"
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
    return _meta_build(*_config_key(hf_config), trust_remote_code)[0]


def weight_shapes(hf_config, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every distinct parameter of the model `hf_config` builds (meta device, cached):
    what a checkpoint of it holds (a tied lm_head is not listed: it is the embedding)."""
    return dict(_meta_build(*_config_key(hf_config), trust_remote_code)[1])


def _config_key(hf_config) -> tuple[str, type]:
    return json.dumps(hf_config.to_dict(), sort_keys=True, default=str), type(hf_config)


@functools.lru_cache(maxsize=8)
def _meta_build(config_json: str, config_class: type, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    numels = tuple(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    stats = ParamStats(num_params=sum(numels), largest_layer_params=largest, param_numels=numels,
                       param_ndims=tuple(p.dim() for p in model.parameters()))
    return stats, tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def config_from_facts(facts, cfg: ModelConfig, code_dir: str | None = None):
    """The transformers config the driver resolved (raytrain.run_spec.ModelFacts), rebuilt on a worker
    without reading it again. A model with remote code has its config class in that code, imported
    from `code_dir` (the run's copy of the model's files: raytrain.checkpoint.model_files) or else
    from model.name_or_path; the values are still the driver's."""
    from transformers import AutoConfig

    if cfg.trust_remote_code and facts.hf_config.get("auto_map"):
        config_class = type(AutoConfig.from_pretrained(code_dir or cfg.name_or_path, trust_remote_code=True))
        return config_class.from_dict(facts.hf_config)
    return AutoConfig.for_model(facts.model_type, **{k: v for k, v in facts.hf_config.items() if k != "model_type"})


def token_ids_from_tokenizer(hf_config, tokenizer, cfg: ModelConfig) -> None:
    """A model built from a config (model.pretrained=false) learns the ids of the tokenizer it is
    trained with: packing separates documents with the tokenizer's EOS, so the config's
    eos_token_id/bos_token_id (LlamaConfig's defaults 2 and 1, or another tokenizer's in DIR's
    config.json) would make generate() stop on the wrong token. They are set from the tokenizer
    (None where it has no such token), unless model.config sets them.

    pad_token_id is left alone: Llama-family models make it the embedding's padding_idx, whose row
    gets no gradient, and the byte tokenizer's pad is its EOS (generate() pads with EOS anyway)."""
    if cfg.pretrained:
        return
    for key, value in (("eos_token_id", tokenizer.eos_token_id), ("bos_token_id", tokenizer.bos_token_id)):
        if key not in cfg.config:
            setattr(hf_config, key, value)


def causal_lm_class_name(hf_config, trust_remote_code: bool = False) -> str:
    """The class AutoModelForCausalLM builds for `hf_config`: what save_pretrained writes as
    config.json's "architectures" (pipelines and other tools read it)."""
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return auto_map["AutoModelForCausalLM"].rpartition(".")[2]  # "module.Class" or "org/repo--module.Class"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)].__name__


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
    # from_pretrained returns the model in eval mode: without train() a fine-tune ran without dropout, without
    # checkpointing's recompute (transformers checkpoints only when training) and without Liger's fused loss
    # (kernels.py: full logits), so above the memory the planner counted on.
    model.train()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # no KV cache in training: it only costs memory
    return model
