"""The run configuration: one typed tree, loaded from defaults < YAML file < KEY=VALUE overrides.

Start at `load_config`. Every section is a dataclass that owns its own fields; components receive
only their section. The DeepSpeed part stays a plain dict (the user's own JSON, used unchanged) and
is resolved against the cluster shape in `raytrain.deepspeed_config`.

User mistakes raise `ConfigError`, whose message is one line naming the key or file and the fix;
`raytrain.main` prints it without a traceback and exits 2.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A mistake in the user's configuration or input files; the message says how to fix it."""


@dataclass
class ModelConfig:
    """Which causal LM to train."""

    name_or_path: str | None = None
    """Hugging Face hub id or local directory with a config.json. None: the built-in tiny Llama."""
    config: dict[str, Any] = field(default_factory=dict)
    """Overrides applied to the model's config (for the built-in model: LlamaConfig keyword args)."""
    pretrained: bool = False
    """Load the weights of `name_or_path` (else random init from its config)."""
    tokenizer: str | None = None
    """Hub id or local directory. None: `name_or_path`'s tokenizer, or the built-in byte tokenizer."""
    gradient_checkpointing: bool | str = False
    """Recompute activations in backward: ~1/3 more compute for far less activation memory.
    "auto": the planner decides, with the other "auto" settings (raytrain.planning.choose)."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: "sdpa", "eager", "flash_attention_2"."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code from the hub repo to run (only for repos you trust)."""
    liger_kernel: str = "none"
    """Llama only, GPU: "loss" (fused linear+cross-entropy: no logits in memory), "all" (+ RMSNorm,
    RoPE, SwiGLU kernels). +15% tokens/s and -30 GiB at 1.1B on an H200; needs liger-kernel."""
    compile: bool = False
    """torch.compile the model through DeepSpeed's engine.compile() (inductor; DeepCompile when the
    DeepSpeed config says compile.deepcompile=true). Costs a compile at start-up on every worker.
    Off by default: under ZeRO-3 it was no faster on an H200 (1.1B, -2%: dynamo recompiles at
    DeepSpeed's per-module hooks) and it fails with Liger's kernels (docs/benchmarks.md)."""


@dataclass
class DataConfig:
    """Where the text comes from, how it becomes fixed-length token blocks, and the held-out split."""

    path: str | list[str] | None = None
    """Files or directories (local, s3://, gs://, hdfs://, abfs://), or a hub id with format "hf".
    None: the built-in generated corpus."""
    format: str = "auto"
    """"auto" (by extension; parquet with an input_ids column and no text column is "tokenized"),
    "text", "json", "parquet", "hf" (save_to_disk directory or hub id) or "tokenized"."""
    text_column: str = "text"
    """Column holding the documents (json, parquet, hf)."""
    text_document: str = "file"
    """What one document is in a text file: "file" (the whole file: books, articles) or "line"
    (each non-blank line)."""
    invalid_utf8: str = "replace"
    """Bytes that are not UTF-8 in text or JSON files: "replace" (decode them as U+FFFD and log the
    file and the number of documents affected) or "error" (stop, naming the file and line)."""
    hf_split: str = "train"
    """Split to read from a Hugging Face DatasetDict (save_to_disk) or hub dataset."""
    seq_len: int = 128
    """Tokens per packed training sequence."""
    position_ids: str = "packed"
    """"packed": positions 0..seq_len-1 in every block. "per_document": a position_ids column that
    restarts at 0 at each document (and each block) start; flash_attention_2 then also keeps
    attention within documents."""
    tokenize_batch_size: int = 256
    """Documents per tokenization batch; each batch's leftover tail (< seq_len tokens) is dropped."""
    tokenize_concurrency: int | None = None
    """Number of tokenizer tasks running at once. None: let Ray Data decide."""
    shuffle_buffer_size: int = 0
    """Shuffle each data shard in consecutive windows of at least this many rows (0: no shuffle).
    Seeded with (training.seed, epoch, shard, window): the order is the same in every run, after a
    restart and at any number of workers (raytrain.data.ingest)."""
    num_shards: int | None = None
    """Data streams the training rows are split into (Ray Data streaming_split, equal rows each);
    each worker reads num_shards / num_workers of them. None: one per worker. The data position in
    a checkpoint is per shard, so a run can resume on a different number of workers when
    num_shards is divisible by both (and the micro-batch by num_shards / num_workers): for example
    48 allows 1, 2, 3, 4, 6, 8, 12, 16, 24 or 48 workers. Fixed for the life of a run."""
    prefetch_batches: int = 4
    """Micro-batches each worker assembles ahead in a background thread (shard reads, shuffle,
    concatenation, int64; pinned in host memory on GPU), so the training thread only issues the
    device copy, and a slow block fetch (from another node's object store) is hidden. Each costs
    one micro-batch of host memory (24 x 2048 tokens: 400 KB). 0: read on the training thread."""
    num_builtin_documents: int = 4000
    """Size of the built-in corpus (only used when `path` is None)."""
    eval_path: str | list[str] | None = None
    """Held-out data, read like `path` (same format rules). Exclusive with eval_fraction."""
    eval_fraction: float = 0.0
    """Hold out this fraction of `path`'s documents (chosen by a hash of each document, so train and
    eval never share one and the split is the same in every run). 0: no split."""
    eval_every_n_steps: int = 0
    """Evaluate every N optimizer steps and after the last one (0: only after the last one).
    Ignored without eval_path or eval_fraction."""
    eval_max_batches: int = 8
    """Micro-batches each rank evaluates per evaluation; every rank runs the same count (all stop
    early together if one rank's eval shard runs out)."""
    progress_every_s: float = 30.0
    """Print how much of the training data has been read and tokenized (percent of the pass, rate,
    ETA) every this many seconds, from the driver (terminal and `ray job logs`). 0: never."""

    def __post_init__(self) -> None:
        choices = {"format": ("auto", "text", "json", "parquet", "hf", "tokenized"),
                   "text_document": ("file", "line"), "invalid_utf8": ("replace", "error"),
                   "position_ids": ("packed", "per_document")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"data.{key} must be {' or '.join(allowed[:-1])} or {allowed[-1]}, "
                                  f"got {getattr(self, key)!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_path is not None:
            raise ConfigError("data.eval_path and data.eval_fraction are both set: hold out a fraction of "
                              "data.path or read a separate eval_path, not both")
        if self.eval_every_n_steps < 0:
            raise ConfigError(f"data.eval_every_n_steps must be >= 0 (0: only after the last step), "
                              f"got {self.eval_every_n_steps}")
        if self.num_shards is not None and self.num_shards < 1:
            raise ConfigError(f"data.num_shards must be at least 1 (or null: one per worker), got {self.num_shards}")
        if self.prefetch_batches < 0:
            raise ConfigError(f"data.prefetch_batches must be >= 0 (0: no prefetch), got {self.prefetch_batches}")
        if self.eval_max_batches < 1:
            raise ConfigError(f"data.eval_max_batches must be at least 1, got {self.eval_max_batches}")
        if self.progress_every_s < 0:
            raise ConfigError(f"data.progress_every_s must be >= 0 (0: no data progress lines), "
                              f"got {self.progress_every_s}")
        _at_least(1, "data.seq_len", self.seq_len)
        _at_least(1, "data.tokenize_batch_size", self.tokenize_batch_size)


@dataclass
class TrainingConfig:
    """The optimisation loop. Values here fill DeepSpeed keys that are "auto" or absent."""

    max_steps: int = 80
    """Optimizer steps to run (one step = gradient_accumulation_steps micro-batches)."""
    micro_batch_size_per_gpu: int | str | None = None
    """Fills train_micro_batch_size_per_gpu when the DeepSpeed config says "auto" (or leaves it
    underdetermined: then 8). "auto": the planner picks the micro-batch with the highest predicted
    tokens/s that fits the GPUs and host RAM, and prints why (raytrain.planning.choose)."""
    gradient_accumulation_steps: int | None = None
    """Fills gradient_accumulation_steps when the DeepSpeed config says "auto" (or leaves it
    underdetermined: then 1)."""
    learning_rate: float = 1e-3
    """Peak learning rate, reached after `warmup_steps`, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 10
    """Linear warmup from 0 to the peak learning rate."""
    weight_decay: float = 0.1
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adam_epsilon: float = 1e-8
    gradient_clipping: float = 1.0
    """Max global grad norm; used when the DeepSpeed config leaves gradient_clipping "auto" or absent."""
    precision: str | None = None
    """"fp32", "bf16" or "fp16", used for DeepSpeed's "auto". None: bf16 on GPU, fp32 on CPU."""
    seed: int = 1234
    log_every_n_steps: int = 5
    """Print one progress line (rank 0) and report metrics every N steps."""
    peak_tflops_per_gpu: float = 989.0
    """Dense bf16 peak of one GPU, for MFU (989 for H100/H200 SXM). MFU is not shown on CPU."""

    def __post_init__(self) -> None:
        _at_least(1, "training.max_steps", self.max_steps)
        _at_least(1, "training.log_every_n_steps", self.log_every_n_steps)
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ConfigError(f"training.learning_rate must be a positive number, got {self.learning_rate}")


@dataclass
class ScalingConfig:
    """How many Ray Train workers, and what each one holds."""

    num_workers: int | None = None
    """Training processes. None: one per GPU in the cluster, or 2 on a CPU-only cluster."""
    use_gpu: bool | None = None
    """None: true when the Ray cluster has GPUs."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves; the rest of the cluster's CPUs feed Ray Data."""
    accelerator_type: str | None = None
    """Ray accelerator type to schedule on, for example "H200"."""
    placement_strategy: str = "PACK"
    """Ray placement group strategy: "PACK" (fill nodes: fast intra-node NVLink), "SPREAD",
    "STRICT_SPREAD" (one worker per node), "STRICT_PACK"."""
    gpu_memory_fraction: float | None = None
    """Cap each worker at this fraction of its GPU's memory (torch.cuda.set_per_process_memory_fraction)
    and plan against the same cap. None: the whole GPU. For a GPU shared with another process, or
    to rehearse a smaller GPU (the benchmarks' capped runs)."""

    def __post_init__(self) -> None:
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"):
            raise ConfigError(f"scaling.placement_strategy must be PACK, SPREAD, STRICT_SPREAD or STRICT_PACK, "
                              f"got {self.placement_strategy!r}")
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"scaling.cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError(f"scaling.gpu_memory_fraction must be in (0, 1] (or null: the whole GPU), "
                              f"got {self.gpu_memory_fraction}")


@dataclass
class CheckpointConfig:
    """Where the run lives and how often it is saved."""

    storage_path: str = "~/raytrain_runs"
    """Run storage: a local directory, a shared filesystem or a cloud URI (s3://, gs://)."""
    name: str | None = None
    """Run name (a directory under storage_path). None: raytrain-<date>-<time>."""
    every_n_steps: int = 0
    """Save a sharded checkpoint every N steps (0: only at the end). A failure loses at most N steps."""
    num_to_keep: int = 2
    """Keep the latest K checkpoints in storage."""
    max_failures: int = 3
    """Worker-group restarts Ray Train attempts before the run fails."""
    upload_async: bool = False
    """Upload checkpoints to storage in the background (Ray's ASYNC mode): training continues while
    shards travel; costs local disk for a second copy until the upload ends."""
    resume_from: str | None = None
    """Start from this checkpoint directory (`--resume-from PATH`); the run's own latest wins after a restart."""
    export_dir: str | None = None
    """At the end, write the final checkpoint as a Hugging Face model directory here."""

    def __post_init__(self) -> None:
        _at_least(1, "checkpoint.num_to_keep", self.num_to_keep)
        if self.every_n_steps < 0:
            raise ConfigError(f"checkpoint.every_n_steps must be >= 0 (0: only at the end), got {self.every_n_steps}")


@dataclass
class ClusterConfig:
    """The Ray cluster to run on."""

    address: str | None = None
    """Ray address. None: RAY_ADDRESS (set under `ray job submit`), else start a local cluster."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster. None: enough for the workers plus Ray Data."""


# Environment variables network.env may set: NCCL's, Gloo's and libfabric's (FI_*, read by
# aws-ofi-nccl on EFA). The worker records the same families as the environment it ran with.
NETWORK_ENV_PREFIXES = ("NCCL_", "GLOO_", "FI_")


@dataclass
class NetworkConfig:
    """NCCL over InfiniBand. raytrain derives each node's NCCL environment from its hardware."""

    env: dict[str, str] = field(default_factory=dict)
    """NCCL_*/GLOO_*/FI_* variables to force on every worker; they win over what raytrain computes."""
    auto_configure: bool = True
    """Compute NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ... per node from /sys and the node's Ray IP."""
    preflight: bool = False
    """Run the preflight (raytrain.network.preflight: bandwidth and transport checks) before training starts."""

    def __post_init__(self) -> None:
        for key, value in self.env.items():
            if not str(key).startswith(NETWORK_ENV_PREFIXES):
                raise ConfigError(f"network.env.{key}: only {', '.join(p + '*' for p in NETWORK_ENV_PREFIXES)} "
                                  "variables belong here; set others through Ray's runtime_env")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ConfigError(f"network.env.{key} must be a string or number as NCCL reads it "
                                  f"(for example \"1\"), got {type(value).__name__} {value!r}")
        self.env = {str(k): str(v) for k, v in self.env.items()}


@dataclass
class TrackingConfig:
    """Where metrics go besides the progress line and ray.train.report."""

    tensorboard: bool = True
    """TensorBoard event files under STORAGE/RUN/tensorboard (for a cloud storage_path: ~/raytrain_tensorboard/RUN on rank 0's node)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (a server, or file:///path for a local store). None: no MLflow."""
    mlflow_experiment: str = "raytrain"


@dataclass
class RunConfig:
    """The whole run. `deepspeed` is the user's DeepSpeed JSON (a path or a mapping), used unchanged."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    deepspeed: dict[str, Any] | str = field(default_factory=lambda: dict(DEFAULT_DEEPSPEED))
    """DeepSpeed config: a path to the user's JSON or an inline mapping."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return _build(cls, data, "")

    def with_deepspeed(self, ds: dict[str, Any]) -> "RunConfig":
        """This config with `ds` as its DeepSpeed mapping (the resolved one)."""
        return dataclasses.replace(self, deepspeed=ds)

    def with_overrides(self, overrides: list[str]) -> "RunConfig":
        """This config with KEY=VALUE overrides applied on top (a new config; this one is unchanged)."""
        data = self.to_dict()
        for item in overrides:
            _set_dotted(data, *_parse_override(item))
        return RunConfig.from_dict(data)


# The embedded default: ZeRO-3 with "auto" batch and precision values that raytrain resolves from
# the `training` section and the cluster, like Hugging Face's integration does.
DEFAULT_DEEPSPEED: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        # ZeRO++ hpZ: "auto" = GPUs per node when the run spans nodes (backward's all-gather then
        # stays on NVLink, for params/gpus_per_node more memory per GPU), else 1 (off).
        "zero_hpz_partition_size": "auto",
    },
    "steps_per_print": 1_000_000_000,  # raytrain prints its own progress line
    "wall_clock_breakdown": False,
}


# ---------------------------------------------------------------------------------------------
# Loading: defaults < file < command line.


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build the run config from an optional YAML file and KEY=VALUE overrides (dotted keys)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(path)
    for item in overrides:
        key, value = _parse_override(item)
        if key.startswith("deepspeed.") and "deepspeed" not in data:
            # deepspeed.x=y with no DeepSpeed config given edits the default one, not an empty one.
            data["deepspeed"] = copy.deepcopy(DEFAULT_DEEPSPEED)
        _set_dotted(data, key, value)
    return RunConfig.from_dict(data)


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist: pass --config with the path to a YAML run config")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML ({problem} at{where}): fix the syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections (model, data, training, ...), "
                          f"got {type(data).__name__}")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not KEY=VALUE: write for example training.max_steps=20")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw  # not YAML: take it as a plain string
    return key.strip(), value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if isinstance(child, str) and parts[0] == "deepspeed" and i == 0:
            # deepspeed=path.json then deepspeed.x=y: the override applies to the file's contents.
            child = read_json_file(child, "deepspeed")
        elif child is None:
            child = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node[part] = child
        node = child
    node[parts[-1]] = value


def read_json_file(path: str, key: str) -> dict[str, Any]:
    """Read a JSON mapping named by config key `key`, with a one-line error for each way it fails."""
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise ConfigError(f"{key}: file {path} does not exist; give the path to your DeepSpeed JSON or an inline mapping")
    try:
        with open(expanded) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): fix it there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------
# Typed construction with one-line errors.


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the run config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown key {prefix}{key}{hint} (valid keys under {where}: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _at_least(minimum: int, key: str, value: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be at least {minimum}, got {value}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is dict:
        return "a mapping"
    if origin is list:
        return "a list"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))
