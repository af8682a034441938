"""The model and tokenizer: any Hugging Face causal LM, or the built-in tiny Llama and byte tokenizer.

`load_model_config` and `load_tokenizer` are cheap and run on the driver (for planning and
validation) as well as on workers. `build_model` runs on a worker and creates the parameters
under `deepspeed.zero.Init`, so each rank only ever holds its partition.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import logging
import os
import re
import socket
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

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

CODE_ERRORS = (SyntaxError, NameError, ImportError)
"""What loading or building a model raises for a fault of code, not of a config.json value: the model's own code
(model.trust_remote_code) does not parse or names what it never defined, or a package is not installed
(transformers' check_imports, an optional dependency): `_refuse_code_error`."""
GENERATION_CONFIG = "generation_config.json"  # a model's generation defaults: generate() reads its token ids there


def model_source(cfg: ModelConfig, checkpoint: str | None = None) -> str:
    """Where the run's initial weights come from, in words (the driver prints it once per run).
    `checkpoint`: the checkpoint the workers restore (the run's latest, or checkpoint.resume_from):
    its weights replace whatever the model was built with (`build_model(from_checkpoint=True)`)."""
    # The built-in Llama is tiny only as its defaults make it: model.config may make it 70B (configs/).
    builtin, its_config = (("the built-in Llama with model.config's overrides",
                            "the built-in Llama's config with model.config's overrides") if cfg.config else
                           ("the built-in tiny Llama", "the built-in tiny Llama's config"))
    if checkpoint is not None:
        built = f"{cfg.name_or_path}'s config" if cfg.name_or_path else its_config
        return f"weights from checkpoint {checkpoint} (the model built from {built}, no weights read)"
    if cfg.name_or_path is None:
        return f"random init of {builtin} (model.name_or_path=DIR trains your own)"
    if cfg.pretrained:
        return f"weights from {cfg.name_or_path} (model.pretrained=true)"
    return f"random init from {cfg.name_or_path}'s config (model.pretrained=true loads its weights)"


def load_model_config(cfg: ModelConfig):
    """The transformers config of the model to train, with `cfg.config` overrides applied.

    An override key the config does not have is refused with its closest field (transformers'
    configs take unknown keyword arguments as new attributes, so `hiden_size` would be ignored), and
    so is one that does nothing in raytrain (dtype: the DeepSpeed config holds the precision).
    Overrides are applied as a worker rebuilds the config (the config class constructed from its
    values: `config_from_facts`), so the class's own validators and conversions run here; a value
    they refuse, or that the model cannot be built with (a meta-device build), is one line naming
    the key. So are a model that is not a decoder-only causal LM, key/value heads that do not divide the
    query heads of an attention that repeats them (each worker's first forward would fail), and, with
    model.pretrained=true, an override that changes the shape or number of the weights to load (each
    worker's from_pretrained would fail, or leave new weights randomly initialised) and, for a local
    directory, weight files that are missing, unreadable or of another shape than the config's
    (`_check_weight_files`: names and shapes only). A hub id the hub cannot be reached for, with nothing of it in
    the local cache, is one line at once, not after huggingface_hub's retries (`hub_unreachable`)."""
    from transformers import AutoConfig, LlamaConfig

    if cfg.name_or_path is None:
        if cfg.pretrained:
            raise ConfigError("model.pretrained=true loads the weights of model.name_or_path, which is not set: "
                              "set model.name_or_path to a model directory or hub id")
        _check_override_keys(LlamaConfig(**BUILTIN_LLAMA), cfg.config)

        def builtin(overrides):  # keyword arguments, as a user's own LlamaConfig(...): head_dim follows the sizes
            return LlamaConfig(**{**BUILTIN_LLAMA, **copy.deepcopy(overrides)})  # (the constructor edits dicts)

        hf_config = _validated(builtin, cfg.config)
        if cfg.config:  # (no RoPE null check: the built-in model has no scaling and the class's theta)
            _check_builds(hf_config, cfg, builtin)
            _check_kv_heads(hf_config, cfg)
        return hf_config
    if os.path.isfile(cfg.name_or_path):
        raise ConfigError(f"model.name_or_path={cfg.name_or_path} is a file; give its directory "
                          f"(model.name_or_path={os.path.dirname(os.path.abspath(cfg.name_or_path))})")
    if cfg.pretrained and os.path.isdir(cfg.name_or_path) and not any(
            os.path.isfile(os.path.join(cfg.name_or_path, f)) for f in WEIGHT_FILES):
        raise ConfigError(f"model.pretrained=true but {cfg.name_or_path} holds no weights ({', '.join(WEIGHT_FILES)}): "
                          f"give a directory written by save_pretrained, or drop model.pretrained to train from "
                          f"random init")
    unreachable = None if os.path.isdir(cfg.name_or_path) else hub_unreachable(cfg.name_or_path)
    if unreachable:
        raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: cannot load its config: "
                          f"{unreachable_fix(cfg.name_or_path, unreachable, 'model.name_or_path')}")
    try:
        # the driver says the token-id warning once, in words (raytrain.planning.resolve.advice)
        with token_id_warning_held(), hub_retries_held():
            loaded = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: cannot load its config ({first_line(e)}); "
                          f"{_load_fix(cfg.name_or_path, e, 'model.name_or_path')}") from None
    except CODE_ERRORS as e:  # its configuration code (trust_remote_code), or a package: was a traceback
        _refuse_code_error(cfg.name_or_path, e, cfg.trust_remote_code, "cannot load its config")
        raise
    _check_override_keys(loaded, cfg.config)
    hf_config = loaded
    if cfg.config:
        written = type(loaded).get_config_dict(cfg.name_or_path)[0]  # config.json as written (read above: cached)

        def build(overrides):
            with token_id_warning_held():  # (model.config.vocab_size may put config.json's ids outside)
                return _with_overrides(loaded, written, overrides)

        hf_config = _validated(build, cfg.config)
        _check_rope_nulls(loaded, hf_config, cfg.config)
    _check_causal_lm(hf_config, cfg)
    _check_token_ids_build(hf_config, cfg, build if cfg.config else None)
    _check_builds(hf_config, cfg, build if cfg.config else None)
    _check_kv_heads(hf_config, cfg)
    if cfg.config and cfg.pretrained:
        _check_same_weights(loaded, hf_config, cfg, build)
    if cfg.pretrained and os.path.isdir(cfg.name_or_path):  # a hub id's weights are not read on the driver
        _check_weight_files(hf_config, cfg)
    return hf_config


# transformers 5.25's PreTrainedConfig.validate_token_ids: a `*_token_id` outside the vocabulary is a warning, not
# an error (hub configs carry pad_token_id=-1), logged once per process by whatever builds or loads the config first.
_TOKEN_ID_WARNING = "_token_id must be `None` or an integer within the vocabulary"
# transformers 5.25's GenerationConfig.validate: a negative pad_token_id is a "minor issue", one warning that lists
# every flag at fault. Each model built derives its generation config from the model's config (PreTrainedModel's
# constructor: GenerationConfig.from_model_config), so a config.json's pad_token_id=-1 is said again by every
# build, as by every read of the generation_config.json that save_pretrained derived from it. Only this list:
# a generation config with other flags at fault still warns (raytrain's note names none of them).
_PAD_FLAG_WARNING = "The following generation flags are not valid and may be ignored: ['pad_token_id']."


class _TokenIdWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return _TOKEN_ID_WARNING not in message and not message.startswith(_PAD_FLAG_WARNING)


class _ImportWarningFilter(logging.Filter):
    """transformers' "Encountered exception while importing X: No module named 'X'" (dynamic_module_utils'
    check_imports, for a model's own code): the ImportError it raises right after names the same packages, and
    raytrain says that in one line (`_refuse_code_error`); the warning printed above it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Encountered exception while importing")


@contextlib.contextmanager
def token_id_warning_held():
    """Holds back transformers' warnings that the config has a `*_token_id` outside the vocabulary
    ("Model config: eos_token_id must be `None` or an integer within the vocabulary ...") and that the
    generation config's pad_token_id is negative ("The following generation flags are not valid and may be
    ignored: ['pad_token_id']. ..."), and only them, while the block loads or builds a config, a generation
    config or a model. Otherwise every process that does prints them: every Ray Data tokenize task whose
    tokenizer is loaded from a model directory (AutoTokenizer reads its config.json), every worker, the driver
    and the export; the driver says instead, once, what such an id does to the run and to generate()
    (token_ids_outside_vocab: an error before anything starts or a note). transformers' warning_once
    remembers the message as said, so a later build in the same process stays quiet too. Also held: the
    warning before a model's own code's missing-package ImportError (`_ImportWarningFilter`)."""
    with _filtered(_TokenIdWarningFilter(), ("transformers.configuration_utils",
                                             "transformers.generation.configuration_utils")), \
            _filtered(_ImportWarningFilter(), ("transformers.dynamic_module_utils",)):
        yield


@contextlib.contextmanager
def _filtered(held: logging.Filter, logger_names: tuple[str, ...]):
    """`held` filters what the named loggers say while the block runs, and only then."""
    loggers = [logging.getLogger(name) for name in logger_names]
    for logger in loggers:
        logger.addFilter(held)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(held)


def load_generation_config(cfg: ModelConfig):
    """The model's GenerationConfig (generation_config.json of a local directory or hub repo), or None: a
    new one at every call (the run's copy of it changes its token ids: raytrain.checkpoint.model_files)."""
    if cfg.name_or_path is None:
        return None
    if os.path.isdir(cfg.name_or_path) and not os.path.isfile(os.path.join(cfg.name_or_path, GENERATION_CONFIG)):
        return None
    from transformers import GenerationConfig

    try:
        with token_id_warning_held(), hub_retries_held():  # a pad_token_id outside the vocabulary: the note says it
            return GenerationConfig.from_pretrained(cfg.name_or_path)
    except OSError:  # a hub model without one
        return None


def token_ids_outside_vocab(values: dict[str, Any], vocab_size: int | None) -> dict[str, Any]:
    """{key: value} of a config's `*_token_id` values (an id or a list of ids) that name an id outside
    0 .. vocab_size - 1: what transformers' config validation only warns about. `values`: the config's
    to_dict() (or a run spec's copy of it)."""
    if not isinstance(vocab_size, int):
        return {}
    return {key: value for key, value in values.items() if key.endswith("_token_id") and any(
        isinstance(i, int) and not isinstance(i, bool) and not 0 <= i < vocab_size
        for i in (value if isinstance(value, list) else [value]))}


def _check_token_ids_build(hf_config, cfg: ModelConfig, build=None) -> None:
    """A token id of config.json outside the vocabulary that the model cannot be built with is a
    mistake of the file: Llama-family models make pad_token_id their embedding's padding_idx, which
    torch refuses past the table ("Padding_idx must be within num_embeddings"): a traceback from the
    driver's meta build, else from every worker. One line naming the key instead. Only when there is
    such an id: a meta-device build (cached), and one more without the ids on failure, to tell their
    failure from any other (left to `_check_builds`, which names the key or config.json).
    `build(overrides)`: the config with `overrides` (model.config's are in `hf_config`), where there are any."""
    vocab = getattr(hf_config, "vocab_size", None)
    outside = token_ids_outside_vocab(hf_config.to_dict(), vocab)
    if not outside:
        return

    def builds(keys) -> bool:
        without = copy.deepcopy(hf_config)
        for key in keys:
            setattr(without, key, None)
        try:
            weight_shapes(without, cfg.trust_remote_code)
        except Exception:
            return False
        return True

    try:
        weight_shapes(hf_config, cfg.trust_remote_code)
    except Exception as e:  # whatever the model's constructor raises: AssertionError, IndexError, ...
        if not builds(outside):  # not the ids' doing: left to _check_builds
            ids = _id_overrides(cfg.config)
            if build is not None and ids != cfg.config:  # unless the ids fail without the other overrides too:
                # _check_builds would name only config.json for that failure; the ids are named first, more precisely
                _check_token_ids_build(build(ids), dataclasses.replace(cfg, config=ids))
            return
        # the ids the build fails on (Llama's pad_token_id, not its eos_token_id), each tried alone; all if it
        # takes more than one (a meta build each, cached, and only on this error path)
        culprits = [key for key in outside if builds([key])] or list(outside)
        given = ", ".join(f"{key}={outside[key]!r}" for key in culprits)
        fixes = " ".join(f"model.config.{key}=null" for key in culprits)
        model_class = causal_lm_class_name(hf_config, cfg.trust_remote_code)
        where = "with model.config's overrides" if cfg.config else "in its config.json"
        raise ConfigError(f"{cfg.name_or_path} has {given} {where}, outside the model's vocabulary "
                          f"(vocab_size={vocab}): {model_class} cannot be built with it ({type(e).__name__}: "
                          f"{first_line(e)}); set {fixes} (or an id from 0 to {vocab - 1})") from None


def _with_overrides(loaded, written: dict[str, Any], overrides: dict[str, Any]):
    """`loaded` (the config class of model.name_or_path) built again from its config.json with
    `overrides`: the constructor derives what depends on them (head_dim from the sizes where the
    file leaves it out, layer types) and runs the class's validators, as it will on each worker.
    Setting attributes on the loaded config skips both: with transformers 5.25, rope_scaling set
    that way loses rope_theta (None: a TypeError in every worker's rotary embedding)."""
    data = copy.deepcopy(written)
    aliases = getattr(loaded, "attribute_map", None) or {}
    for key, value in copy.deepcopy(overrides).items():  # not the run config's own: the constructor edits dicts
        data[aliases.get(key, key)] = value
    rope = getattr(loaded, "rope_parameters", None)
    given = [overrides[k] for k in ("rope_scaling", "rope_parameters") if isinstance(overrides.get(k), dict)]
    if given and "rope_theta" not in given[0] and isinstance(rope, dict) and "rope_theta" in rope:
        # A rope dict without rope_theta takes the constructor's rope_theta argument (config.json's, in
        # transformers 4's layout), else the class default 10000: the model's own theta is kept, as
        # rope_scaling beside a rope_theta meant in transformers 4.
        data.setdefault("rope_theta", rope["rope_theta"])
    return type(loaded).from_dict(data, name_or_path=loaded.name_or_path)


def _load_fix(spec: str, error: BaseException, key: str) -> str:
    """The fix to name when transformers cannot load `spec` (a local path or a hub id)."""
    text = str(error)
    if "trust_remote_code" in text or "custom code" in text:
        return ("its config names its own Python code (auto_map): set model.trust_remote_code=true to run it "
                "(only for code you trust)")
    if os.path.isdir(spec):
        return "give a directory written by save_pretrained (with config.json), or a hub id"
    if not _looks_like_hub_id(spec):
        return f"there is no directory {spec}: check the path"
    # Not a local directory, so transformers read it as a hub id: a typo, no network, or
    # HF_HUB_OFFLINE=1 with the model not in the local cache all end here.
    from huggingface_hub import constants

    offline = " (HF_HUB_OFFLINE=1 is set: only the local hub cache is read)" if constants.is_offline_mode() else ""
    return (f"no local directory {spec!r}, so it is a Hugging Face hub id{offline}: check the name and the "
            f"network, or download it first (hf download {spec} --local-dir DIR) and set {key}=DIR")


# huggingface_hub 2.4's lines for each failed try of a request it retries (utils/_http.py's _http_backoff_base; its
# hf_api has its own): when a HEAD for a file fails and the file is not in the local hub cache, hf_hub_download tries
# five times more, 1 + 2 + 4 + 8 + 8 s apart, two lines a try, and AutoTokenizer asks for config.json twice: 23 lines
# over 50 s before raytrain's one line. `hub_unreachable` spares the wait where there is no network at all.
_HUB_RETRY_LINES = (" thrown while requesting ", "Retrying in ", "Rate limited. Waiting ")
_HUB_RETRY_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.hf_api")


class _HubRetryFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line in message for line in _HUB_RETRY_LINES)


@contextlib.contextmanager
def hub_retries_held():
    """Holds back huggingface_hub's lines about a request it retries ("'[Errno -2] Name or service not known'
    thrown while requesting HEAD https://huggingface.co/gpt2/resolve/main/config.json", "Retrying in 1s [Retry
    1/5].") while the block loads a model's config, a tokenizer or a hub dataset, and only them: a load that
    still fails says so in raytrain's one line (naming the id and the fix), one that succeeds had nothing to say."""
    with _filtered(_HubRetryFilter(), _HUB_RETRY_LOGGERS):
        yield


def _looks_like_hub_id(spec: str) -> bool:
    """A hub id is NAME or ORG/NAME; anything else that is not a directory is a path that is not there."""
    return not (os.path.isabs(spec) or spec.startswith((".", "~")) or spec.count("/") > 1)


def hub_unreachable(repo_id: str, repo_type: str = "model") -> str | None:
    """Why the Hugging Face hub cannot be reached for `repo_id`, when a load of it would only fail after
    huggingface_hub's retries (~23 s per file asked for): one HEAD request, no retry, fails before any answer (no
    network, a name that does not resolve, a refused connection) and the local hub cache holds nothing of the
    repo. Else None, and the load runs as it would without this: with a network (the HEAD answered, whatever
    it said; one request more), HF_HUB_OFFLINE=1 (only the cache is read, no request), or with some of the repo
    in the cache (transformers may read it from there). A network that drops this one request stops the run
    at once, where the retries might have got through: running it again retries."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import _http

    if constants.is_offline_mode() or not _looks_like_hub_id(repo_id):
        return None
    if os.path.isdir(os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type=repo_type))):
        return None
    # What hf_hub_download retries on (no answer at all): httpx's timeouts, network and protocol errors
    unanswered = getattr(_http, "_DEFAULT_RETRY_ON_EXCEPTIONS", ())
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json" if repo_type == "model" else "README.md",
                                        repo_type=repo_type))
    except unanswered as e:
        return f"{constants.ENDPOINT}: {first_line(e)}"
    except Exception:  # an answer (404, 401, ...) or an id the hub refuses: the load says what it is
        return None
    return None


def unreachable_fix(spec: str, why: str, key: str, repo_type: str = "model") -> str:
    """The one line's text after `key`='spec': for `hub_unreachable`'s `why`."""
    from huggingface_hub import constants

    download = f"hf download {spec}" + (" --repo-type dataset" if repo_type == "dataset" else "") + " --local-dir DIR"
    where = f"set {key}=DIR" if repo_type == "model" else f"set {key} to its data files in DIR"
    return (f"no local directory {spec!r}, so it is a Hugging Face hub id, but the hub cannot be reached ({why}) "
            f"and the local hub cache ({constants.HF_HUB_CACHE}) has no copy of it: check the network (or "
            f"HF_ENDPOINT, HF_HUB_CACHE), or download it where there is one ({download}) and {where}")


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
    if getattr(hf_config, "is_decoder", None) is False and _attends_ahead(hf_config, cfg.trust_remote_code):
        raise ConfigError(f"model.name_or_path={name} is an encoder (is_decoder=false: each token attends to the "
                          f"tokens after it, so the next-token loss would see its answer): {fix}")


def _attends_ahead(hf_config, trust_remote_code: bool) -> bool:
    """Whether a config with is_decoder=false builds a model whose attention sees later tokens.
    The flag is the encoder families' switch (BERT, RoBERTa, ...: bidirectional unless it is true),
    but GPT-NeoX (Pythia) and GPT-NeoX-Japanese carry it as false too and always mask causally.
    A family with a masked-LM class is an encoder; any other is asked the model itself: transformers'
    attention modules say is_causal (BertGeneration's follows is_decoder), checked on the meta-device
    build that param_stats makes anyway."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    if type(hf_config) in MODEL_FOR_MASKED_LM_MAPPING:
        return True
    return _meta_build(*_config_key(hf_config), trust_remote_code).attends_ahead


def _check_builds(hf_config, cfg: ModelConfig, build=None) -> None:
    """Anything else the model's constructor refuses (what each worker's from_config would raise), one
    line naming the override that makes it fail, else config.json: a meta-device build, no memory, that
    param_stats and model.pretrained's comparison reuse. `build(overrides)` makes the config with
    `overrides`, where model.config sets any."""
    try:
        weight_shapes(hf_config, cfg.trust_remote_code)
    except Exception as e:  # whatever the model's constructor raises: KeyError, AssertionError, ValueError, ...
        reason = f"{type(e).__name__}: {first_line(e)}"
        if build is None:
            _refuse_own_config(hf_config, cfg, e, reason)

        def builds(overrides):
            weight_shapes(build(overrides), cfg.trust_remote_code)

        # Without the overrides, or with only those of the ids (config.json's ids may fail its build: the token-id
        # check named them unless an override fixes them); failing both ways, it is not the overrides' doing
        for baseline in ({}, _id_overrides(cfg.config)):
            try:
                builds(baseline)
                break
            except Exception:
                continue
        else:
            _refuse_own_config(hf_config, cfg, e, reason)
        raise ConfigError(f"{_named(cfg.config, builds)}: the model cannot be built with it ({reason}): set a value "
                          f"{type(hf_config).__name__} accepts") from None


def _refuse_own_config(hf_config, cfg: ModelConfig, error: Exception, reason: str) -> NoReturn:
    """The model fails to build from model.name_or_path's own config.json (a value its constructor refuses:
    torch's "negative dimension", an assertion), its own code or a package it imports (`_refuse_code_error`): one
    line on the driver instead of the same traceback from the driver's planner and every worker. The built-in
    model always builds from its own sizes: a failure there is raised as it is."""
    if cfg.name_or_path is None:
        raise error
    model_class = causal_lm_class_name(hf_config, cfg.trust_remote_code)
    if isinstance(error, CODE_ERRORS):
        _refuse_code_error(cfg.name_or_path, error, cfg.trust_remote_code, f"{model_class} cannot be built")
    fix = "correct the value in config.json, or override it with model.config.KEY=VALUE"
    raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: {model_class} cannot be built from its config.json "
                      f"({reason}): {fix}") from None


def _refuse_code_error(name_or_path: str, error: BaseException, trusted: bool, what: str,
                       key: str = "model.name_or_path") -> None:
    """One line for `error` (one of CODE_ERRORS) raised loading or building `name_or_path`: a fault of the model's
    own code (model.trust_remote_code) names its file and line where it can (it had been blamed on config.json,
    or a configuration file's was a traceback on the driver); a package missing for transformers' own code says
    to install it (`what`: what failed, "cannot load its tokenizer"); anything else is the caller's (returns)."""
    where = _own_code_line(name_or_path, error) if trusted else None
    said = error.msg if isinstance(error, SyntaxError) else first_line(error)  # its "(<unknown>, line N)" goes
    if where is not None or (trusted and isinstance(error, SyntaxError)):
        reason = f"{type(error).__name__}: {said}" + (f", {where}" if where else "")
        fix = ("install what it names on the driver and every node" if isinstance(error, ImportError) else
               "fix that code (model.trust_remote_code runs it on the driver and in every worker)")
        raise ConfigError(f"{key}={name_or_path!r}: its own code fails ({reason}): {fix}") from None
    if isinstance(error, ImportError):
        raise ConfigError(f"{key}={name_or_path!r}: {what} ({type(error).__name__}: {said}): install what it "
                          f"names on the driver and every node") from None


def _own_code_line(name_or_path: str, error: BaseException) -> str | None:
    """`FILE line N` of the model's own code (trust_remote_code) where `error` arose, or None. A SyntaxError of an
    imported file names it; transformers parses the module it loads first with ast.parse (check_imports), which
    names none, so a local directory's code files are parsed again and the one failing with the same message at
    the same place is named (not merely the first that fails: scripts beside the model's code). Anything else: its
    traceback's last frame in that code (transformers imports it as transformers_modules.*)."""
    import ast
    import traceback

    if isinstance(error, SyntaxError):
        if error.filename and os.path.isfile(error.filename):
            return f"{os.path.basename(error.filename)} line {error.lineno}"
        if not os.path.isdir(name_or_path):
            return None
        for name in sorted(f for f in os.listdir(name_or_path) if f.endswith(".py")):
            try:
                with open(os.path.join(name_or_path, name), encoding="utf-8") as f:
                    ast.parse(f.read())
            except SyntaxError as e:
                if (e.msg, e.lineno, e.offset) == (error.msg, error.lineno, error.offset):
                    return f"{name} line {e.lineno}"
            except (OSError, ValueError):  # unreadable, not UTF-8: not the file transformers parsed
                continue
        return None
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "transformers_modules" in f.filename]
    return f"{os.path.basename(frames[-1].filename)} line {frames[-1].lineno}" if frames else None


def _id_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides that set token ids or the vocabulary they index: what the token-id check judges."""
    return {k: v for k, v in overrides.items() if k.endswith("_token_id") or k == "vocab_size"}


def _named(overrides: dict[str, Any], attempt) -> str:
    """The override that makes `attempt` fail on its own (`model.config.KEY=VALUE`), else all of them."""
    for key, value in overrides.items():
        try:
            attempt({key: value})
        except Exception:
            return f"model.config.{key}={value!r}"
    return ", ".join(f"model.config.{k}={v!r}" for k, v in overrides.items()) or "model.config"


def _check_same_weights(loaded, hf_config, cfg: ModelConfig, build) -> None:
    """With model.pretrained=true, `cfg.config` (which made `loaded` into `hf_config`: `build`) must
    leave every weight's name and shape as the checkpoint has them: compared on meta-device builds (no
    memory; 0.8 s for a Llama-70B config on 2 CPU cores: benchmarks/driver_check_costs.py), so any field counts (vocab_size,
    num_hidden_layers, tie_word_embeddings, GPT-2's n_positions, ...). Only when something differs
    is each override tried alone, to name it."""
    before = weight_shapes(loaded, cfg.trust_remote_code)
    if weight_shapes(hf_config, cfg.trust_remote_code) == before:  # the run's own build: param_stats reuses it
        return
    for key, value in cfg.config.items():
        after = weight_shapes(build({key: value}), cfg.trust_remote_code)
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


def _check_kv_heads(hf_config, cfg: ModelConfig) -> None:
    """num_key_value_heads must divide num_attention_heads where the model's attention shares key/value heads as
    Llama's does (`_kv_heads`): 4 query heads over 3 key/value heads build (the meta build passes) and the config
    class takes them, then each worker's first forward fails ("The size of tensor a (4) must match the size of
    tensor b (3)"). Only attention classes seen to repeat their k_proj's heads are checked: JetMoE (its query heads
    are num_key_value_heads x num_experts_per_tok), GPT-BigCode, Inkling and the MLA families (GLM-4-MoE-Lite) read
    num_key_value_heads otherwise and run with 4 over 3. Falcon's new_decoder_architecture is checked by its
    config (`_falcon_fused`): its fused query_key_value has no k_proj to look at."""
    kv_key = "num_key_value_heads"
    try:  # a per-layer value (Gemma 4) raises on the global attribute: not checked
        heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
        fused = _falcon_fused(hf_config)
        if fused:
            kv_key, kv = "num_kv_heads", hf_config.num_kv_heads
        built = () if fused else _meta_build(*_config_key(hf_config), cfg.trust_remote_code).kv_heads
    except Exception:  # a model that cannot be built is named by the checks that build it
        return
    if not (isinstance(heads, int) and isinstance(kv, int) and 0 < kv and heads % kv):
        return
    if fused:
        cause = (f"Falcon's fused query_key_value (new_decoder_architecture=true) holds each key/value head with "
                 f"its num_attention_heads / {kv_key} query heads (every worker's first forward fails in its "
                 f"reshape)")
    else:
        # the classes that make num_key_value_heads key heads and repeat each num_attention_heads // num_key_value_heads
        # times (Inkling's and GPT-BigCode's num_key_value_groups is their own: they run)
        uneven = [(name, groups) for name, key_heads, groups in built if key_heads == kv and groups == heads // kv]
        if not uneven:
            return
        attention, groups = uneven[0]
        cause = (f"{attention} shares each key/value head among num_attention_heads // num_key_value_heads = {groups} "
                 f"query heads, {kv * groups} of {heads} (every worker's first forward fails on the size mismatch)")
    aliases = getattr(hf_config, "attribute_map", None) or {}
    fields = {"num_attention_heads", kv_key}
    given = [key for key in cfg.config if key in fields or aliases.get(key) in fields]
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    divisors = ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}" if len(divisors) > 1 else str(heads)
    if given:
        where = ", ".join(f"model.config.{key}={cfg.config[key]!r}" for key in given)
        if all(aliases.get(key, key) == "num_attention_heads" for key in given):
            fix = f"set model.config.num_attention_heads to a multiple of {kv_key}={kv}"
        else:
            fix = f"set model.config.{kv_key} to a divisor of num_attention_heads={heads}: {divisors}"
    else:
        where = f"{cfg.name_or_path}'s config.json"
        fix = (f"correct {kv_key} in its config.json (a divisor of {heads}: {divisors}; the one the weights were "
               f"saved with)" if cfg.pretrained else
               f"set model.config.{kv_key} to a divisor of num_attention_heads={heads}: {divisors}")
    raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of {kv_key}={kv}, and {cause}; {fix}")


def _falcon_fused(hf_config) -> bool:
    """Falcon's new decoder layout (transformers 5.25's FalconAttention._split_heads): query_key_value's rows are
    grouped by key/value head, each group its queries then one key and one value, and the forward views them as
    (num_kv_heads, -1, head_dim), which only a num_kv_heads dividing num_attention_heads allows. The older
    layouts (multi-query, or one key/value per query head) take any count."""
    return getattr(hf_config, "model_type", None) == "falcon" and bool(getattr(hf_config, "new_decoder_architecture",
                                                                               False))


def _weight_file(path: str, hf_config) -> str:
    """The weight file from_pretrained reads in the directory `path`, as transformers 5.25's
    _get_resolved_checkpoint_files picks it: config.json's transformers_weights if set, else the first of
    WEIGHT_FILES there (safetensors before the pickle format, a whole file before an index)."""
    explicit = getattr(hf_config, "transformers_weights", None)
    if isinstance(explicit, str):
        return explicit
    return next(f for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f)))


def _check_weight_files(hf_config, cfg: ModelConfig) -> None:
    """model.pretrained=true with a local directory: the weight files from_pretrained reads are there, and hold
    what the model built from the config has, before each worker reads them (a FileNotFoundError for a shard
    its index names, safetensors' "header too large" for a damaged file, a size mismatch for weights of another
    config, each in every worker). Cheap at any size: safetensors headers only (names and shapes, no tensor read;
    30 shards of a 70B model, ~1 MB of JSON), and the meta-device build param_stats makes anyway. Pickled weights
    (pytorch_model.bin) are unpickled onto the meta device, as transformers' own meta loading does: the pickle's
    names and shapes, no tensor data read (0.014 s for 1 GiB: docs/status.md #12, session 61); weights_only, so
    no code in them runs."""
    path = cfg.name_or_path
    chosen = _weight_file(path, hf_config)
    fix = (f"give the directory save_pretrained wrote (copy or download {path} again), or drop model.pretrained to "
           f"train from random init")
    if chosen.endswith(".index.json"):
        index = os.path.join(path, chosen)
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"model.pretrained=true but {index} is not an index of weight files (a JSON object "
                              f"whose weight_map names a shard per weight; {type(e).__name__}: {first_line(e)}): "
                              f"{fix}") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ConfigError(f"model.pretrained=true but {index} names shards that are not in {path}: {missing[0]}"
                              f"{more} ({len(missing)} of {len(shards)} files): {fix}")
    else:
        shards = [chosen]
        if not os.path.isfile(os.path.join(path, chosen)):  # config.json's transformers_weights
            raise ConfigError(f"model.pretrained=true but {path} has no {chosen} (its config.json's "
                              f"transformers_weights): {fix}")
    saved: dict[str, tuple[tuple[int, ...], str]] = {}  # tensor name -> (shape, file)
    if not chosen.endswith((".safetensors", ".safetensors.index.json")):
        # Unchecked, a .bin of other names (a DDP "module." prefix) trained from random init without a word, and
        # one of other shapes failed from_pretrained in every worker, a failure Ray Train retried.
        for shard in shards:
            saved.update(_pickled_shapes(os.path.join(path, shard), fix))
        _check_saved_names(saved, hf_config, cfg)
        return
    from safetensors import safe_open

    for shard in shards:
        file = os.path.join(path, shard)
        try:
            with safe_open(file, framework="pt") as f:  # the header: names, dtypes, shapes and offsets
                saved.update({name: (tuple(f.get_slice(name).get_shape()), file) for name in f.keys()})
        except Exception as e:  # safetensors' SafetensorError ("header too large", "file not fully covered"), OSError
            raise ConfigError(f"model.pretrained=true but {file} is not a readable safetensors file "
                              f"({type(e).__name__}: {first_line(e)}; damaged, cut short or not a weight file): "
                              f"{fix}") from None
    _check_saved_names(saved, hf_config, cfg)


def _pickled_shapes(file: str, fix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, file)} of a torch.save'd state dict, as from_pretrained reads it (weights_only)."""
    import torch

    try:
        with warnings.catch_warnings():  # torch's note on an unusual pickle protocol: the error below says enough
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="meta", weights_only=True)
    except Exception as e:  # UnpicklingError (a whole pickled model, not a state dict), EOFError, RuntimeError
        why = first_line(e)  # an empty file's EOFError has no message: its name alone
        why = why if why == type(e).__name__ else f"{type(e).__name__}: {why}"
        raise ConfigError(f"model.pretrained=true but {file} is not a readable PyTorch state dict ({why}; damaged, "
                          f"cut short or not a weight file): {fix}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"model.pretrained=true but {file} holds a {type(state).__name__}, not a state dict of "
                          f"named tensors: {fix}")
    return {name: (tuple(t.shape), file) for name, t in state.items() if isinstance(t, torch.Tensor)}


def _check_saved_names(saved: dict[str, tuple[tuple[int, ...], str]], hf_config, cfg: ModelConfig) -> None:
    """Each of the model's weights is in `saved` ({tensor name: (shape, file)}) with its shape, as from_pretrained
    matches them: by name, the base model's prefix added where the checkpoint leaves it out, either name of a tied
    weight. Tensors the model has no weight for (old checkpoints' rotary inv_freq, GPT-2's attn.bias buffers) are
    ignored by from_pretrained, and here. A checkpoint that transformers converts on load (a name one of the
    model's weight conversions matches: MoE experts saved one by one, renamed modules) and a quantized one
    (quantization_config: packed weights of their own names and shapes) are not compared."""
    names = _meta_build(*_config_key(hf_config), cfg.trust_remote_code).names
    if names.renamed is None or getattr(hf_config, "quantization_config", None) is not None:
        return
    if any(pattern.search(name) for pattern in names.renamed for name in saved):
        return
    known = {alias for aliases in names.aliases for alias in aliases}

    def model_name(name: str) -> str:
        with_prefix = f"{names.prefix}.{name}"
        return with_prefix if names.prefix and name not in known and with_prefix in known else name

    found = {model_name(name): value for name, value in saved.items()}
    expected = weight_shapes(hf_config, cfg.trust_remote_code)
    source = f"{cfg.name_or_path}/config.json" + (" with model.config's overrides" if cfg.config else "")
    differ = [(alias, found[alias], expected[aliases[0]]) for aliases in names.aliases for alias in aliases
              if alias in found and found[alias][0] != expected[aliases[0]]]
    if differ:
        name, (shape, file), want = differ[0]
        more = f" (and {len(differ) - 1} more weights differ)" if len(differ) > 1 else ""
        raise ConfigError(f"model.pretrained=true but {file} holds {name} as {list(shape)}, where the model "
                          f"{source} describes has {list(want)}{more}: give the config.json the weights were saved "
                          f"with, or drop model.pretrained to train from random init")
    missing = [aliases[0] for aliases in names.aliases if not any(alias in found for alias in aliases)
               and not any(re.search(pattern, aliases[0]) for pattern in names.optional)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"model.pretrained=true but the weights in {cfg.name_or_path} have no {missing[0]}{more} "
                          f"of the {len(names.aliases)} the model {source} describes has (from_pretrained would "
                          f"initialise them randomly): give the weights saved with this config.json, or drop "
                          f"model.pretrained to train from random init")


# model.config.dtype (torch_dtype is its older name) -> the training.precision that does what it asks.
_PRECISION_OF_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                       "float32": "fp32", "fp32": "fp32", "float": "fp32"}


# What every transformers config has (PreTrainedConfig's own fields: return_dict, id2label, architectures, ...),
# left out of the fields listed for an unknown override: a model's own are the ones meant.
_GENERIC_FIELDS = {"_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "id2label",
                   "is_encoder_decoder", "label2id", "model_type", "output_attentions", "output_hidden_states",
                   "problem_type", "return_dict", "transformers_version", "torch_dtype", "use_cache"}


def _check_override_keys(hf_config, overrides: dict[str, Any]) -> None:
    """Each override of `hf_config` (the model's config as loaded) names a field it has, and a value
    transformers would not take without a word: an id past the vocabulary (it only warns, as hub
    configs carry pad_token_id=-1; the embedding's padding_idx then fails in every worker), an
    activation or RoPE type it does not know (a bare KeyError in the model's constructor)."""
    from transformers.activations import ACT2CLS
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = sorted(set(hf_config.to_dict()) | set(getattr(hf_config, "attribute_map", {}) or {}))
    vocab = overrides.get("vocab_size", getattr(hf_config, "vocab_size", None))
    rope_types = sorted({"default", *ROPE_INIT_FUNCTIONS})
    for key, value in overrides.items():
        if key in ("dtype", "torch_dtype"):
            # Refused, not honoured: the DeepSpeed config is the one place precision is set (training.precision
            # writes its bf16/fp16 sections). Under ZeRO-3, zero.Init builds the parameters in that dtype and
            # this one is ignored; below stage 3, from_config would build the model in it behind DeepSpeed's back.
            precision = _PRECISION_OF_DTYPE.get(str(value).removeprefix("torch."), "bf16, fp16 or fp32")
            raise ConfigError(f"model.config.{key}={value!r} does not set the training precision, which the DeepSpeed "
                              f"config holds: remove it and set training.precision={precision} (or the DeepSpeed "
                              f"JSON's bf16/fp16 sections)")
        if key.lstrip("_") == "attn_implementation":
            # Not a config field but how transformers builds the model (PreTrainedConfig keeps it as
            # _attn_implementation): raytrain passes model.attn_implementation to each worker's build, which
            # replaces the config's, so `_attn_implementation` here was accepted and never used.
            raise ConfigError(f"model.config.{key}={value!r} does not choose the attention backend, "
                              f"model.attn_implementation does: remove it and set model.attn_implementation={value}")
        if not hasattr(hf_config, key):
            close = difflib.get_close_matches(key, known, n=1)
            own = sorted(set(known) - _GENERIC_FIELDS)  # without every config's (return_dict, id2label, ...)
            hint = f"; did you mean model.config.{close[0]}?" if close else f"; its fields: {', '.join(own)}"
            if key == "rope_theta" and isinstance(getattr(hf_config, "rope_parameters", None), dict):
                # transformers 5 keeps it in rope_parameters; given beside them it would be ignored
                hint = (f"; it is part of model.config.rope_parameters (now "
                        f"{json.dumps(hf_config.rope_parameters, default=str)}): give that with your rope_theta")
            raise ConfigError(f"model.config.{key}: {type(hf_config).__name__} has no such field{hint}")
        ids = value if isinstance(value, list) else [value]
        if key.endswith("_token_id") and isinstance(vocab, int) and any(
                isinstance(i, int) and not 0 <= i < vocab for i in ids):
            raise ConfigError(f"model.config.{key}={value!r} is outside the model's vocabulary (vocab_size={vocab}): "
                              f"use ids from 0 to {vocab - 1}, or null")
        was = getattr(hf_config, key)
        if isinstance(was, str) and was in ACT2CLS and isinstance(value, str) and value not in ACT2CLS:
            close = difflib.get_close_matches(value, list(ACT2CLS), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"model.config.{key}={value!r} is not an activation transformers knows: {hint}"
                              f"(known: {', '.join(sorted(ACT2CLS))})")
        if key in ("rope_scaling", "rope_parameters") and isinstance(value, dict):
            for rope in [v for v in value.values() if isinstance(v, dict)] or [value]:  # nested: per layer type
                rope_type = rope.get("rope_type", rope.get("type", "default"))
                if rope_type not in rope_types:
                    close = difflib.get_close_matches(str(rope_type), rope_types, n=1)
                    hint = f"did you mean {close[0]}? " if close else ""
                    raise ConfigError(f"model.config.{key}: rope_type={rope_type!r} is not a RoPE type transformers "
                                      f"knows: {hint}(known: {', '.join(rope_types)})")


def _rope_layers(rope) -> dict[str, dict]:
    """rope_parameters per layer type: {"": it} for one dict, itself where it is nested (Gemma 3's full and
    sliding attention, each its own dict)."""
    if not isinstance(rope, dict):
        return {}
    nested = rope and all(isinstance(v, dict) for v in rope.values())
    return dict(rope) if nested else {"": rope}


def _check_rope_nulls(before, after, overrides: dict[str, Any]) -> None:
    """model.config.rope_scaling=null or rope_parameters=null, on a transformers that keeps RoPE's theta and
    scaling together in rope_parameters (5.x): rope_scaling=null leaves a scaling there as it was (5.25 reads
    rope_scaling only as the old name of a dict), and rope_parameters=null resets rope_theta to the class default
    (Llama: 10000). Either trains another model than the one meant without a word: refused, naming the dict that
    says "no scaling, the model's own theta". A null that changes nothing (no scaling to keep, the same theta)
    passes."""
    if not any(key in overrides and overrides[key] is None for key in ("rope_scaling", "rope_parameters")):
        return
    layers = _rope_layers(getattr(before, "rope_parameters", None))
    if not layers:  # transformers 4, or a model without RoPE
        return
    fix = {name: {"rope_type": "default", **({"rope_theta": r["rope_theta"]} if "rope_theta" in r else {})}
           for name, r in layers.items()}
    fix_text = json.dumps(fix.get("", fix), default=str)
    now = json.dumps(getattr(before, "rope_parameters"), default=str)
    after_layers = _rope_layers(getattr(after, "rope_parameters", None))
    if ("rope_scaling" in overrides and overrides["rope_scaling"] is None and "rope_parameters" not in overrides
            and any(r.get("rope_type", "default") != "default" for r in after_layers.values())):
        raise ConfigError(f"model.config.rope_scaling=null leaves the model's RoPE scaling as it is: this transformers "
                          f"keeps it in rope_parameters (now {now}); to train without it set "
                          f"model.config.rope_parameters={fix_text}")
    thetas = {name: r.get("rope_theta") for name, r in layers.items()}
    after_thetas = {name: r.get("rope_theta") for name, r in after_layers.items()}
    if ("rope_parameters" in overrides and overrides["rope_parameters"] is None
            and not isinstance(overrides.get("rope_scaling"), dict) and after_thetas != thetas):
        raise ConfigError(f"model.config.rope_parameters=null resets the model's rope_theta to the class default "
                          f"(now {now}, then {json.dumps(after.rope_parameters, default=str)}): to train without "
                          f"scaling at the model's own theta set model.config.rope_parameters={fix_text}")


def _validated(build, overrides: dict[str, Any]):
    """`build(overrides)` (the config with those overrides), turning transformers' own config
    validation (huggingface_hub's strict dataclasses: a type per field, architecture checks; RoPE
    validation's KeyError for a missing parameter) into one line naming the key: the one that fails
    alone, else all of them."""
    try:
        return build(overrides)
    except Exception as e:  # StrictDataclass*Error (huggingface_hub), ValueError, TypeError, KeyError
        if not (type(e).__name__.startswith("StrictDataclass") or isinstance(e, (TypeError, ValueError, KeyError))):
            raise
        lines = [line.strip() for line in str(e).strip().strip('"').splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__
        raise ConfigError(f"{_named(overrides, build)}: the model's config refuses it ({reason})") from None


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
    unreachable = None if os.path.isdir(spec) else hub_unreachable(spec)
    if unreachable:
        raise ConfigError(f"{key}={spec!r}: cannot load its tokenizer: {unreachable_fix(spec, unreachable, key)}")
    try:
        # From a model directory AutoTokenizer reads its config.json: in every tokenize task's process
        with token_id_warning_held(), hub_retries_held():
            tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except CODE_ERRORS as e:  # the tokenizer's own code (trust_remote_code), or a package it needs (sentencepiece)
        _refuse_code_error(spec, e, trust_remote_code, "cannot load its tokenizer", key)
        raise
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
    special = set(tok.all_special_tokens)
    if all(token in special for token in tok.get_vocab()):
        # transformers 5 builds a Qwen2/GPT-2/GPT-NeoX/Gemma tokenizer from a directory that holds only the
        # model's config.json: no error, every text encodes to nothing (or <unk>), and the run would train on
        # EOS tokens alone
        tokens = f"{len(tok)} token{'' if len(tok) == 1 else 's'}"
        raise ConfigError(f"{key}={spec!r}: its tokenizer has no vocabulary ({tokens}, all special: "
                          f"{', '.join(sorted(special))}): no tokenizer files (tokenizer.json, tokenizer.model, or "
                          f"vocab.json and merges.txt) where it was loaded from; "
                          + ("give a directory or hub id that holds them" if key == "model.tokenizer"
                             else "set model.tokenizer to a directory or hub id that holds them"))
    if tok.eos_token_id is None:
        raise ConfigError(f"{key}={spec!r}: its tokenizer has no eos_token: documents are separated by EOS; "
                          + ("use a tokenizer with one" if key == "model.tokenizer"
                             else "set model.tokenizer to a tokenizer with one"))
    return tok


@functools.lru_cache(maxsize=8)
def document_start_ids(tokenizer) -> tuple[int, ...]:
    """The ids `tokenizer` puts before a text when it adds its special tokens: the BOS of Llama,
    Mistral or Gemma tokenizers, nothing for GPT-2's, Qwen2's or the byte tokenizer. Hugging Face's
    own training tokenizes with them (run_clm: tokenizer(text)), so each document starts with its BOS;
    packing puts these ids before every document (raytrain.data.packing). Read from the tokenizer's
    own post-processor once (cached per tokenizer): a probe encoded with and without special tokens,
    the difference before it. What the template puts after a text is not taken: packing ends every
    document with one EOS of its own."""
    probe = "a"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return tuple(full[:start])
    return ()


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


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6N for the matmuls, 12 L H S for attention. N: the parameters
    a token runs (ModelFacts.active_parameters: a mixture of experts' idle experts do no matmuls). The one
    definition: the planner's tokens/s (raytrain.planning.throughput) and the workers' MFU both read it."""
    return 6 * num_params + 12 * num_layers * hidden * seq_len


def param_stats(hf_config, trust_remote_code: bool = False) -> ParamStats:
    """Parameter sizes from the config alone: the model is built on the meta device (no memory is
    allocated; shared parameters such as tied embeddings count once). Cached per config."""
    return _meta_build(*_config_key(hf_config), trust_remote_code).stats


def weight_shapes(hf_config, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every distinct parameter of the model `hf_config` builds (meta device, cached):
    what a checkpoint of it holds (a tied lm_head is not listed: it is the embedding)."""
    return dict(_meta_build(*_config_key(hf_config), trust_remote_code).shapes)


def embedding_padding_row(hf_config, trust_remote_code: bool = False) -> int | None:
    """The row of the input embedding that the model makes its padding row (torch's padding_idx, counted
    from 0: a pad_token_id of -1 is the last row), or None: that row gets no gradient (meta build, cached)."""
    return _meta_build(*_config_key(hf_config), trust_remote_code).padding_row


def _config_key(hf_config) -> tuple[str, type]:
    return json.dumps(hf_config.to_dict(), sort_keys=True, default=str), type(hf_config)


class _CheckpointNames(NamedTuple):
    """How from_pretrained matches a checkpoint's tensor names to the model's parameters (`_check_weight_files`)."""

    prefix: str
    """The base model's attribute (Llama's "model", GPT-2's "transformer"): a checkpoint saved from the base
    model names its weights without it, and from_pretrained adds it."""
    aliases: tuple[tuple[str, ...], ...]
    """The names of each distinct parameter: a tied lm_head is the embedding, and either name loads it."""
    optional: tuple[str, ...]
    """The model's _keys_to_ignore_on_load_missing (patterns): weights a checkpoint may leave out unsaid."""
    renamed: tuple[Any, ...] | None
    """The compiled source patterns of the model's weight conversions (transformers 5's conversion_mapping:
    renamed keys, MoE experts fused on load, legacy LayerNorm.gamma, ...); a checkpoint with a name one of
    them matches is loaded through them, so its names are not the model's. None: not known."""


class _MetaBuild(NamedTuple):
    stats: ParamStats
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    attends_ahead: bool  # _attends_ahead
    padding_row: int | None  # embedding_padding_row
    names: _CheckpointNames
    kv_heads: tuple[tuple[str, int, int], ...]  # _check_kv_heads


@functools.lru_cache(maxsize=8)
def _meta_build(config_json: str, config_class: type, trust_remote_code: bool) -> _MetaBuild:
    import torch
    from transformers import AutoModelForCausalLM

    with token_id_warning_held(), torch.device("meta"):  # the model's constructor derives its generation config
        hf_config = config_class.from_dict(json.loads(config_json))
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    numels = tuple(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    stats = ParamStats(num_params=sum(numels), largest_layer_params=largest, param_numels=numels,
                       param_ndims=tuple(p.dim() for p in model.parameters()))
    attends_ahead = any(getattr(m, "is_causal", None) is False for m in model.modules())  # _attends_ahead
    try:  # embedding_padding_row
        padding_row = getattr(model.get_input_embeddings(), "padding_idx", None)
    except NotImplementedError:  # a model with its own code that does not say which module it is
        padding_row = None
    shapes = tuple((name, tuple(p.shape)) for name, p in model.named_parameters())
    return _MetaBuild(stats, shapes, attends_ahead, padding_row, _checkpoint_names(model), _kv_heads(model))


def _checkpoint_names(model) -> _CheckpointNames:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    try:  # transformers 5's, as from_pretrained collects them (legacy renamings included)
        from transformers.conversion_mapping import get_model_conversion_mapping

        renamed = tuple(t.compiled_sources for t in get_model_conversion_mapping(model))
    except Exception:  # another transformers (no such module or attribute), or a mapping it refuses: not known
        renamed = None
    return _CheckpointNames(prefix=getattr(model, "base_model_prefix", "") or "",
                            aliases=tuple(tuple(names) for names in aliases.values()),
                            optional=tuple(sorted(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())),
                            renamed=renamed)


def _kv_heads(model) -> tuple[tuple[str, int, int], ...]:
    """(class, key/value heads, num_key_value_groups) of each distinct attention class that shares key/value
    heads among query heads as Llama's does (GQA): the key heads its projection makes (k_proj's rows, or a fused
    qkv_proj's after the query heads' rows) and how many times its forward repeats each (repeat_kv) before the
    scores. Classes with neither projection (JetMoE's kv_proj, MLA's kv_b_proj) are not listed."""
    found = {}
    heads = getattr(model.config, "num_attention_heads", None)
    for module in model.modules():
        groups, head_dim = getattr(module, "num_key_value_groups", None), getattr(module, "head_dim", None)
        if not (isinstance(groups, int) and isinstance(head_dim, int) and head_dim > 0):
            continue
        key_heads = None
        for projection, query_rows in (("k_proj", 0), ("qkv_proj", heads)):
            weights = [p for p in getattr(getattr(module, projection, None), "parameters", list)() if p.dim() >= 2]
            if weights and isinstance(query_rows, int) and weights[0].shape[-2] % head_dim == 0:
                # Moshi's k_proj holds its Linear one level down; Ergo's qkv_proj rows: queries, keys, values
                key_heads = (weights[0].shape[-2] // head_dim - query_rows) // (2 if query_rows else 1)
                break
        if key_heads is not None:
            found.setdefault(type(module).__name__, (key_heads, groups))
    return tuple((name, key_heads, groups) for name, (key_heads, groups) in found.items())


def config_from_facts(facts, cfg: ModelConfig, code_dir: str | None = None):
    """The transformers config the driver resolved (raytrain.run_spec.ModelFacts), rebuilt on a worker
    without reading it again. A model with remote code has its config class in that code, imported
    from `code_dir` (the run's copy of the model's files: raytrain.checkpoint.model_files) or else
    from model.name_or_path; the values are still the driver's."""
    from transformers import AutoConfig, PretrainedConfig

    # The driver's to_json_string wrote inf and nan as {"__float__": "Infinity"} (JSON has neither; Mamba2
    # layers' time_step_limit is (0, inf)): decoded as transformers decodes its own config.json. A private
    # classmethod of transformers 5.25's PreTrainedConfig; older versions wrote no such tags.
    decode = getattr(PretrainedConfig, "_decode_special_floats", lambda values: values)
    values = decode(facts.hf_config)
    with token_id_warning_held():  # every worker builds it: the driver has said what such an id does
        if cfg.trust_remote_code and values.get("auto_map"):
            config_class = type(AutoConfig.from_pretrained(code_dir or cfg.name_or_path, trust_remote_code=True))
            return config_class.from_dict(values)
        return AutoConfig.for_model(facts.model_type, **{k: v for k, v in values.items() if k != "model_type"})


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


def causal_lm_class(hf_config, trust_remote_code: bool = False) -> type:
    """The class AutoModelForCausalLM builds for `hf_config`; a model with remote code has it in its
    own files, imported as from_config imports it (fetched once: the run's build needs the same file)."""
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], hf_config.name_or_path)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


def attention_backends(model_class: type) -> list[str]:
    """The attention implementations `model_class` declares: its _supports_sdpa / _supports_flash_attn
    / _supports_flex_attn flags, which its constructor checks (transformers 5.25 modeling_utils,
    get_correct_attn_implementation; remote code may still say _supports_flash_attn_2). A flag that
    is not a plain bool (a property, known only on an instance) counts as support."""
    def declares(*flags: str) -> bool:
        values = [inspect.getattr_static(model_class, flag, False) for flag in flags]
        return any(v is True or not isinstance(v, bool) for v in values)

    backends = ["eager"]
    if declares("_supports_sdpa"):
        backends.append("sdpa")
    if declares("_supports_flash_attn", "_supports_flash_attn_2"):
        backends += ["flash_attention_2", "flash_attention_3", "flash_attention_4"]
    if declares("_supports_flex_attn"):
        backends.append("flex_attention")
    return backends


# data.position_ids=per_document promises that a document's tokens attend to its own tokens only. These model types
# keep it, with raytrain's inputs (raytrain.worker.engine.model_inputs: rows under SDPA and eager, whose 4D mask
# transformers builds from the positions; one row under flash attention, whose varlen kernel takes the documents'
# bounds): every document's logits equal those of the document run alone, in both forms
# (tests/unit/worker/test_per_document_families.py, tiny models of each type, transformers 5.25). Left out, because
# they do not: OPT and BioGPT build their causal mask without the positions (their SDPA and eager attention cross
# documents); hybrid models (Jamba, LFM2, Falcon-H1, Bamba, NemotronH, MiniMax, ...) run recurrent, convolution or
# linear-attention layers along the whole row, which carry one document into the next, and under flash attention's
# one row one row into the next; gpt-oss's attention sinks are not checked. Any other type is refused, not guessed.
PER_DOCUMENT_MODEL_TYPES = frozenset({
    "apertus", "arcee", "codegen", "cohere", "cohere2", "ernie4_5", "exaone4", "falcon", "gemma", "gemma2",
    "gemma3_text", "glm", "glm4", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granitemoe", "helium",
    "hunyuan_v1_dense", "llama", "ministral", "mistral", "mixtral", "olmo", "olmo2", "olmo3", "olmoe", "persimmon",
    "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "stablelm",
    "starcoder2"})

# The distribution each flash_attention_N of transformers 5.25 looks for (FLASH_ATTENTION_COMPATIBILITY_MATRIX's
# pkg_availability_check), named in the error line.
FLASH_ATTENTION_PACKAGES = {2: "flash-attn", 3: "flash-attn-3", 4: "flash-attn-4"}


def flash_attention_version(attn_implementation: str | None) -> int | None:
    """N of model.attn_implementation=flash_attention_N, else None."""
    match = re.fullmatch(r"flash_attention_(\d)", attn_implementation or "")
    return int(match[1]) if match else None


def flash_attention_missing(version: int) -> str | None:
    """None when flash_attention_`version` can load in this environment: its package is installed, or
    the `kernels` package is, through which transformers fetches a hub build instead (on the GPU
    nodes, at model build). Else what to install, in words. Asked on the driver where its environment
    stands for the workers' (ClusterShape.driver_on_worker_node: the same node, the same image); the GPU
    itself is not looked for here."""
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX
        from transformers.utils import is_kernels_available
    except ImportError:  # another transformers: its own check runs in the workers
        return None
    facts = FLASH_ATTENTION_COMPATIBILITY_MATRIX.get(version)
    if facts is None or facts["pkg_availability_check"]() or is_kernels_available():
        return None
    return f"the {FLASH_ATTENTION_PACKAGES.get(version, 'flash-attn')} package (or `kernels`, for a hub build)"


def node_lacks(cfg: ModelConfig) -> tuple[str, str] | None:
    """(what, fix) when this node lacks a package the model config needs (model.attn_implementation=
    flash_attention_N's), else None. The driver checks its own environment only where it is a workers' node
    (ClusterShape.driver_on_worker_node); each worker asks this of its own before it builds the model."""
    version = flash_attention_version(cfg.attn_implementation)
    missing = version and flash_attention_missing(version)
    if not missing:
        return None
    return (f"model.attn_implementation={cfg.attn_implementation} needs {missing}, which is not installed there",
            "install it on the GPU nodes, or set model.attn_implementation=sdpa")


def fused_layers_enabled(cfg: ModelConfig, hf_config) -> bool:
    """model.fused_layers resolved: true/false as set; "auto" is on for a Llama model with Liger's GPU
    kernels (liger_kernel=all, measured there) and off otherwise (raytrain/worker/fused.py)."""
    if cfg.fused_layers == "auto":
        return cfg.liger_kernel == "all" and not cfg.compile and getattr(hf_config, "model_type", None) == "llama"
    return bool(cfg.fused_layers)


def build_model(cfg: ModelConfig, hf_config, ds_config: dict[str, Any], from_checkpoint: bool = False):
    """Create the model on this worker, partitioned as it is created (ZeRO-3).

    `from_checkpoint`: the caller restores a checkpoint into it next, so model.pretrained's weights
    are not read (the checkpoint replaces every one; on a 70B hub model that read took minutes at
    every continue and every Ray Train restart): the model is built from its config, as for a
    random init."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    # Import the model's modules (and torch._dynamo, which transformers pulls in) before zero.Init
    # patches torch's tensor constructors: importing them inside it fails. Building on the meta
    # device does that at no memory cost.
    param_stats(hf_config, cfg.trust_remote_code)
    # "auto" is transformers' own default (None: SDPA where the class has it, else eager); the driver has
    # already made it concrete in a run's spec (planning.resolve._resolve_attention), a direct call may not.
    attn = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
    lacking = node_lacks(cfg)
    if lacking:  # a run's workers stop on it before this (raytrain.worker.loop); a direct call raises
        raise ImportError(f"node {socket.gethostname()}: {lacking[0]}: {lacking[1]}")
    # transformers' DeepSpeed integration: while an HfDeepSpeedConfig with stage 3 is alive (a weak
    # global reference reads it), from_pretrained and from_config create the model under zero.Init
    # themselves (dtype from the config's bf16/fp16 section), with what zero.Init alone gets wrong:
    # RoPE's inv_freq kept in fp32 (prevent_arange_dtype_change; zero.Init made it bf16), the
    # model's own weight init (initialize_weights_zero3; under a bare zero.Init _init_weights saw
    # empty partitions and left PyTorch's defaults: embeddings std 1.0, not initializer_range), and
    # tied weights tied. from_pretrained then loads each shard into its partition. Below stage 3 it
    # does nothing: DeepSpeed converts the model when the engine is built.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    # Each build derives the model's generation config from hf_config, and from_pretrained reads the model's
    # generation_config.json: transformers would warn of a pad_token_id=-1 on every worker (the driver's note says it)
    with token_id_warning_held():
        if cfg.pretrained and not from_checkpoint:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.name_or_path, config=hf_config, attn_implementation=attn,
                trust_remote_code=cfg.trust_remote_code)
        else:
            # What the init costs (initialize_weights_zero3), module by module: one all-gather of its
            # parameters, _init_weights on rank 0 alone, one broadcast back into every rank's partition
            # (GatheredParameters' modifier_rank); a rank holds at most one module's weights and its
            # direct children's whole beside its partition (a Llama MLP's three projections: 0.42 GB in
            # bf16 at 13B) and rank 0 draws every random number (13B, on the GPU) while the others wait:
            # a few collectives per layer, like one forward's gathers, once per build. A build for a checkpoint
            # restore pays it too: the checkpoint then replaces every weight, but skipping the init would
            # mean patching transformers' build.
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn,
                                                     trust_remote_code=cfg.trust_remote_code)
    del hf_ds_config  # built: from here transformers sees no ZeRO-3 (as before for from_pretrained)
    # from_pretrained returns the model in eval mode: without train() a fine-tune ran without dropout, without
    # checkpointing's recompute (transformers checkpoints only when training) and without Liger's fused loss
    # (kernels.py: full logits), so above the memory the planner counted on.
    model.train()
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = False  # no KV cache in training: it only costs memory
    return model


def enable_checkpointing(model) -> None:
    """Activation checkpointing, non-reentrant. transformers 5.25 renamed gradient_checkpointing_enable to
    activation_checkpointing_enable (the old name prints a two-line FutureWarning on every rank); 5.17, the GPU
    image's, has only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
