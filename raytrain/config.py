"""The run configuration: one typed tree, loaded from defaults < YAML file < KEY=VALUE overrides.

Start at `load_config`. Every section is a dataclass that owns its own fields; components receive
only their section. Each field declares its type, range and choices once, beside it (pydantic
dataclasses: `Annotated[Int, Field(ge=1)]`, `Literal[...]`), checked wherever a section is built
(a loaded file, a worker's `RunConfig.from_dict`, a direct `DataConfig(...)`). Scalars are strict:
a YAML string is not a number, 1 is not true. The DeepSpeed part stays a plain dict (the user's
own JSON, used unchanged), resolved for the cluster shape in raytrain.deepspeed_config and checked
by DeepSpeed's own models in raytrain.planning.deepspeed_check. Files are read in raytrain.config_files; how a
field is declared and how its errors read: raytrain.config_fields.

User mistakes raise `ConfigError`, whose message is one line naming the key or file and the fix;
`raytrain.main` prints it without a traceback and exits 2.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

from raytrain import nccl_variables
from raytrain.config_fields import (Bool, Float, Int, NonEmptyStr, Str, directory_name, one_line, ray_address, section,
                                    worker_range)
from raytrain.config_files import ConfigError, parse_override, read_json_file, read_yaml_file

__all__ = ["ConfigError", "RunConfig", "load_config", "read_json_file", "DEFAULT_DEEPSPEED"]


@section("model")
class ModelConfig:
    """Which causal LM to train."""

    name_or_path: NonEmptyStr | None = None
    """Hugging Face hub id or local directory with a config.json. None: the built-in tiny Llama."""
    config: dict[Str, Any] = field(default_factory=dict)
    """Overrides applied to the model's config (for the built-in model: LlamaConfig keyword args)."""
    pretrained: Bool = False
    """Load the weights of `name_or_path` (else random init from its config)."""
    tokenizer: NonEmptyStr | None = None
    """Hub id or local directory. None: `name_or_path`'s tokenizer, or the built-in byte tokenizer."""
    gradient_checkpointing: Bool | Literal["auto"] = False
    """Recompute activations in backward: ~1/3 more compute for far less activation memory.
    "auto": the planner decides, with the other "auto" settings (raytrain.planning.choose)."""
    attn_implementation: NonEmptyStr = "auto"
    """transformers attention backend: "sdpa", "eager", "flash_attention_2", ... (checked on the driver
    against the implementations transformers registers and the model's class supports). "auto": SDPA
    where the model's class supports it, else eager, as transformers itself picks; resolved on the
    driver, so the planner and the workers see the one the run uses. "flash_attention_4" (the flash-attn-4
    package on the GPU nodes, a beta: FlashAttention's CuTe DSL kernels, compiled at a worker's first step):
    +1.8-2.7% tokens/s at the shipped 1.1B step on an H100, +1.6% (+2.9% plain DeepSpeed) at micro-batch 24 on
    an H200, the same losses (docs/benchmarks.md, "FlashAttention-4"); the planner's tokens/s does not count it."""
    trust_remote_code: Bool = False
    """Allow model/tokenizer code from the hub repo to run (only for repos you trust)."""
    liger_kernel: Literal["none", "loss", "all"] = "none"
    """Llama only, GPU: "loss" (fused linear+cross-entropy: no logits in memory), "all" (+ RMSNorm,
    RoPE, SwiGLU kernels). +15% tokens/s and -30 GiB at 1.1B on an H200; needs liger-kernel."""
    fused_layers: Bool | Literal["auto"] = "auto"
    """Llama only: q/k/v and gate/up each as one GEMM over the unrenamed weights, the residual adds fused
    into the RMSNorm and down_proj's GEMM (raytrain/worker/fused.py): +3.1% tokens/s at 1.1B on an H200,
    same parameters, names and checkpoints. "auto": on for a Llama model with liger_kernel=all (the GPU
    kernels), off otherwise; true also runs on CPU (torch ops)."""
    fp8: Bool = False
    """The fused decoder layers' projections (q|k|v, o, gate|up, down) as FP8 GEMMs: e4m3 activations and
    weights, e5m2 gradients, one dynamic scale per tensor (torchao's "tensorwise" recipe), bf16 everywhere
    else (raytrain/worker/fp8.py). Measured on an H200 against the same bf16 step: +21% tokens/s at 1.1B,
    +36% at 7.24B, 7.5 GiB less GPU memory at 1.1B (docs/benchmarks.md, "FP8 GEMMs"). Needs
    model.fused_layers on and FP8 tensor cores (compute capability 8.9+: L40S, H100, H200, B200; elsewhere
    the projections stay bf16, with a note). FP8 rounds more than bf16: compare a run's loss against bf16
    before relying on it (docs/benchmarks.md has one comparison)."""
    compile: Bool = False
    """torch.compile the model through DeepSpeed's engine.compile() (inductor; DeepCompile when the
    DeepSpeed config says compile.deepcompile=true). Costs a compile at start-up on every worker.
    Off by default: under ZeRO-3 it was no faster on an H200 (1.1B, -2%: dynamo recompiles at
    DeepSpeed's per-module hooks) and it fails with Liger's kernels (docs/benchmarks.md)."""


@section("data")
class DataConfig:
    """Where the text comes from, how it becomes fixed-length token blocks, and the held-out split."""

    path: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    """Files or directories (local, s3://, gs://, hdfs://, abfs://), or a hub id with format "hf".
    None: the built-in generated corpus."""
    format: Literal["auto", "text", "json", "csv", "parquet", "hf", "tokenized"] = "auto"
    """"auto" (by extension; parquet with an input_ids column and no text column is "tokenized"),
    "text", "json", "csv" (a header line; .tsv files tab-separated), "parquet", "hf" (save_to_disk
    directory or hub id) or "tokenized"."""
    text_column: NonEmptyStr = "text"
    """Column holding the documents (json, csv, parquet, hf)."""
    text_document: Literal["file", "line"] = "file"
    """What one document is in a text file: "file" (the whole file: books, articles) or "line"
    (each non-blank line)."""
    invalid_utf8: Literal["replace", "error"] = "replace"
    """Bytes that are not UTF-8 in text or JSON files: "replace" (decode them as U+FFFD and log the
    file and the number of documents affected) or "error" (stop, naming the file and line)."""
    hf_split: NonEmptyStr = "train"
    """Split of `path` to read: of a Hugging Face DatasetDict (save_to_disk), a hub dataset, or a
    directory of hub-named shards ({split}-00000-of-00004.parquet, a hub snapshot's data/: only
    this split's files are read)."""
    seq_len: Annotated[Int, Field(ge=1)] = 128
    """Tokens per packed training sequence."""
    position_ids: Literal["packed", "per_document"] = "packed"
    """"packed": positions 0..seq_len-1 in every block. "per_document": a position_ids column that
    restarts at 0 at each document (and each block) start, and attention stays within each document:
    flash_attention_2/4 by their varlen kernels (the worker gives them the micro-batch as one row,
    the only shape transformers runs them for); SDPA and eager by a 4D mask that transformers builds
    from the positions (SDPA then runs its slower masked kernel with k and v repeated: measured on an
    H100 at 1.1B, attention 2.8x as long and 0.5 GiB more a sequence; the planner counts both,
    docs/benchmarks.md "per-document attention"). Only for the model types checked to keep documents
    apart (raytrain.model.PER_DOCUMENT_MODEL_TYPES: Llama, Mistral, Qwen, Gemma, Phi, GPT-2, OLMo, ...);
    others are refused (OPT's mask ignores the positions; hybrid models' recurrent layers cross documents)."""
    tokenize_batch_size: Annotated[Int, Field(ge=1)] = 256
    """Rows per tokenization batch (documents; a text file that is one document is a row per ~64k
    characters); each batch's leftover tail (< seq_len tokens) is dropped."""
    tokenize_concurrency: Annotated[Int, Field(ge=1)] | None = None
    """Number of tokenizer tasks running at once. None: let Ray Data decide."""
    shuffle_buffer_size: Annotated[Int, Field(ge=0)] = 0
    """Shuffle each data shard in consecutive windows of at least this many rows (0: no shuffle).
    Seeded with (training.seed, epoch, shard, window): the order is the same in every run, after a
    restart and at any number of workers (raytrain.data.ingest)."""
    num_shards: Annotated[Int, Field(ge=1)] | None = None
    """Data streams the training rows are split into (Ray Data streaming_split, equal rows each);
    each worker reads num_shards / num_workers of them, and every optimizer step takes
    train_batch_size / num_shards rows from each shard (so train_batch_size must be divisible by
    it). None: one per worker. The data position in a checkpoint is per shard, so a run can resume
    on a different number of workers when num_shards is divisible by both: for example 48 allows
    1, 2, 3, 4, 6, 8, 12, 16, 24 or 48 workers. Required for an elastic scaling.num_workers range
    (divisible by every size in it). Fixed for the life of a run."""
    prefetch_batches: Annotated[Int, Field(ge=0)] = 4
    """Micro-batches each worker assembles ahead in a background thread (shard reads, shuffle,
    concatenation, int64; pinned in host memory on GPU), so the training thread only issues the
    device copy, and a slow block fetch (from another node's object store) is hidden. Each costs
    one micro-batch of host memory (24 x 2048 tokens: 400 KB). 0: read on the training thread."""
    sample_log: Bool = False
    """Write an 8-byte digest of every training row each step trained on, per rank, to
    STORAGE/RUN/samples/ (raytrain.worker.samples): an audit that no row is skipped or read twice,
    across restarts and resizes. Costs a hash per row; local or shared-filesystem storage only."""
    num_builtin_documents: Annotated[Int, Field(ge=1)] = 4000
    """Size of the built-in corpus (only used when `path` is None)."""
    eval_path: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    """Held-out data, read like `path` (same format rules). Exclusive with eval_fraction."""
    eval_hf_split: NonEmptyStr = "validation"
    """Split of `eval_path` to read (as hf_split is of `path`): "validation", as Hugging Face's
    run_clm evaluates on, so eval_path=org/corpus (or the same DatasetDict or snapshot directory
    as path) evaluates on its validation split; a dataset with "test" only needs
    eval_hf_split=test. The training split itself (same source, same split) is refused."""
    eval_fraction: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Hold out this fraction of `path`'s documents (chosen by a hash of each document, so train and
    eval never share one and the split is the same in every run). 0: no split. A single text file
    under text_document="file" is one document, so it is refused: split it by line, or use eval_path."""
    eval_every_n_steps: Annotated[Int, Field(ge=0)] = 0
    """Evaluate every N optimizer steps and after the last one (0: only after the last one).
    Ignored without eval_path or eval_fraction."""
    eval_max_batches: Annotated[Int, Field(ge=1)] = 8
    """Micro-batches each rank evaluates per evaluation; every rank runs the same count (all stop
    early together if one rank's eval shard runs out; a shard's last micro-batch may be short). Eval
    data without one row of seq_len tokens is an error before the first step."""
    progress_every_s: Annotated[Float, Field(ge=0)] = 30.0
    """Print how much of the training data has been read and tokenized (percent of the pass, rate,
    ETA) every this many seconds, from the driver (terminal and `ray job logs`). 0: never."""

    def __post_init__(self) -> None:
        if self.eval_fraction and self.eval_path is not None:
            raise ConfigError("data.eval_path and data.eval_fraction are both set: hold out a fraction of "
                              "data.path or read a separate eval_path, not both")


@section("training")
class TrainingConfig:
    """The optimisation loop. Values here fill DeepSpeed keys that are "auto" (the batch keys, precision
    and gradient_clipping also absent ones). A value the user wrote that a concrete DeepSpeed value
    contradicts, or that the JSON's own optimizer or scheduler would leave out, is an error (`load_config`)."""

    max_steps: Annotated[Int, Field(ge=1)] = 80
    """Optimizer steps to run (one step = gradient_accumulation_steps micro-batches)."""
    micro_batch_size_per_gpu: Annotated[Int, Field(ge=1)] | Literal["auto"] | None = None
    """Fills train_micro_batch_size_per_gpu when the DeepSpeed config says "auto" or leaves it out (None:
    derived from train_batch_size, else 8); a different value there is an error. "auto": the planner
    picks the micro-batch with the highest predicted tokens/s that fits the GPUs and host RAM, and
    prints why (raytrain.planning.choose)."""
    gradient_accumulation_steps: Annotated[Int, Field(ge=1)] | None = None
    """Fills gradient_accumulation_steps when the DeepSpeed config says "auto" or leaves it out (None:
    derived from train_batch_size, else 1); a different value there is an error."""
    learning_rate: Annotated[Float, Field(gt=0)] = 1e-3
    """Peak learning rate, reached after `warmup_steps`, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: Annotated[Float, Field(ge=0, le=1)] = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: Annotated[Int, Field(ge=0)] = 10
    """Linear warmup from 0 to the peak learning rate."""
    weight_decay: Annotated[Float, Field(ge=0)] = 0.1
    adam_betas: Annotated[list[Annotated[Float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = \
        field(default_factory=lambda: [0.9, 0.95])
    """Adam's (beta1, beta2): two numbers in [0, 1)."""
    adam_epsilon: Annotated[Float, Field(gt=0)] = 1e-8
    gradient_clipping: Annotated[Float, Field(ge=0)] = 1.0
    """Max global grad norm; used when the DeepSpeed config leaves gradient_clipping "auto" or absent."""
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    """"fp32", "bf16" or "fp16": fills DeepSpeed's bf16/fp16 "enabled" where it is "auto" or left out; a
    JSON that states another precision is an error. None: "auto" is bf16 on GPU, fp32 on CPU."""
    seed: Annotated[Int, Field(ge=0)] = 1234
    """Seeds torch's init and the data order (numpy's generators refuse a negative seed)."""
    log_every_n_steps: Annotated[Int, Field(ge=1)] = 5
    """Print one progress line (rank 0) and report metrics every N steps."""
    peak_tflops_per_gpu: Annotated[Float, Field(gt=0)] = 989.0
    """Dense bf16 peak of one GPU, for MFU (989 for H100/H200 SXM). MFU is not shown on CPU."""


@section("scaling")
class ScalingConfig:
    """How many Ray Train workers, and what each one holds."""

    num_workers: Annotated[Annotated[Int, Field(ge=1)] | list[Int], AfterValidator(worker_range)] | None = None
    """Training processes: a number, or [min, max] for an elastic run (Ray Train's elastic worker
    group: it starts as many as it can place, continues on fewer when nodes are lost, down to min,
    and grows back when capacity returns, up to max; needs data.num_shards; README "Elastic
    training"). None: one per GPU in the cluster, or 2 on a CPU-only cluster."""
    # At most ~32 years: Ray's placement-group wait (this timeout, raytrain.driver.elastic) fails at once from
    # ~9e15 s (its deadline in int64 milliseconds overflows, Ray 2.60), and every group start with it: a
    # "wait for ever" of 1e18 retried the first group without end, tracebacks only.
    replacement_timeout_s: Annotated[Float, Field(ge=0, le=10**9)] = 120.0
    """Elastic runs: after losing a node, wait this long for a replacement at the same size (a
    restart, no resize) before continuing on the workers that remain (0: shrink at once; 1e9, the
    largest, waits for ever in practice)."""
    resize_interval_s: Annotated[Float, Field(ge=0)] = 300.0
    """Elastic runs: a running group checks for returned capacity at most this often, and grows
    (Ray's elastic_resize_monitor_interval_s). A grow restarts every worker from the latest
    checkpoint, discarding the steps since then."""
    use_gpu: Bool | None = None
    """None: true when the Ray cluster has GPUs."""
    cpus_per_worker: Annotated[Float, Field(gt=0)] = 1.0
    """Logical CPUs each worker reserves; the rest of the cluster's CPUs feed Ray Data."""
    accelerator_type: NonEmptyStr | None = None
    """Ray accelerator type to schedule on, for example "H200"."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"] = "PACK"
    """Ray placement group strategy: "PACK" (fill nodes: fast intra-node NVLink), "SPREAD",
    "STRICT_SPREAD" (one worker per node), "STRICT_PACK"."""
    gpu_memory_fraction: Annotated[Float, Field(gt=0, le=1)] | None = None
    """Cap each worker at this fraction of its GPU's memory (torch.cuda.set_per_process_memory_fraction)
    and plan against the same cap. None: the whole GPU. For a GPU shared with another process, or
    to rehearse a smaller GPU (the benchmarks' capped runs)."""


@section("checkpoint")
class CheckpointConfig:
    """Where the run lives and how often it is saved."""

    storage_path: NonEmptyStr = "~/raytrain_runs"
    """Run storage: a local directory, a shared filesystem or a cloud URI (s3://, gs://)."""
    name: Annotated[Str, AfterValidator(directory_name)] | None = None
    """Run name (a directory under storage_path). None: raytrain-<date>-<time>."""
    every_n_steps: Annotated[Int, Field(ge=0)] = 0
    """Save a sharded checkpoint every N steps (0: only at the end). A failure loses at most N steps."""
    num_to_keep: Annotated[Int, Field(ge=1)] = 2
    """Keep the latest K checkpoints in storage."""
    max_failures: Annotated[Int, Field(ge=0)] = 3
    """Worker-group restarts Ray Train attempts before the run fails. Ray's -1 (retry forever) is
    refused: a mistake that fails every attempt would then never end the run."""
    upload_async: Bool = False
    """Upload checkpoints to storage in the background (Ray's ASYNC mode): training continues while
    shards travel; costs local disk for a second copy until the upload ends."""
    resume_from: NonEmptyStr | None = None
    """Start from this checkpoint directory (`--resume-from PATH`); the run's own latest wins after a restart."""
    export_dir: NonEmptyStr | None = None
    """At the end, write the final checkpoint as a Hugging Face model directory here."""


@section("cluster")
class ClusterConfig:
    """The Ray cluster to run on."""

    address: Annotated[Str, AfterValidator(ray_address)] | None = None
    """Ray address: HOST:PORT (the head's GCS port, 6379 by default), ray://HOST:PORT (Ray Client),
    "auto" (the cluster running on this machine) or "local" (always a new one). None: RAY_ADDRESS
    (set under `ray job submit`), else start a local cluster."""
    num_cpus: Annotated[Int, Field(ge=1)] | None = None
    """Logical CPUs of a local cluster. None: enough for the workers plus Ray Data."""


# Environment variables network.env may set: NCCL's, Gloo's and libfabric's (FI_*, read by
# aws-ofi-nccl on EFA). The worker records the same families as the environment it ran with.
NETWORK_ENV_PREFIXES = ("NCCL_", "GLOO_", "FI_")


@section("network")
class NetworkConfig:
    """NCCL over InfiniBand. raytrain derives each node's NCCL environment from its hardware."""

    env: dict[Str, Str | Int | Float] = field(default_factory=dict)
    """NCCL_*/GLOO_*/FI_* variables to force on every worker (strings or numbers, as NCCL reads them:
    "1" or 1); they win over what raytrain computes."""
    auto_configure: Bool = True
    """Compute NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ... per node from /sys and the node's Ray IP."""
    preflight: Bool = False
    """Run the preflight (raytrain.network.preflight: bandwidth and transport checks) before training starts."""

    def __post_init__(self) -> None:
        for key in self.env:
            meant = nccl_variables.misspelling_of(key)  # NCCL ignores a name it does not read, without a word
            if not key.startswith(NETWORK_ENV_PREFIXES):
                raise ConfigError(f"network.env.{key}: only {', '.join(p + '*' for p in NETWORK_ENV_PREFIXES)} "
                                  "variables belong here; set others through Ray's runtime_env"
                                  + (f"; did you mean {meant}?" if meant else ""))
            if meant:
                # A name close to none is let through (a newer NCCL's variable, a plugin's): the workers'
                # network lines note it (raytrain.network.nccl_env).
                raise ConfigError(f"network.env.{key}: NCCL reads no such variable (it would be ignored); did you "
                                  f"mean {meant}? (raytrain knows NCCL's variables up to NCCL "
                                  f"{nccl_variables.NEWEST_RELEASE}: one that a newer NCCL added can be set in the "
                                  f"workers' environment through Ray's runtime_env)")
        self.env = {k: str(v) for k, v in self.env.items()}  # as NCCL reads them: strings


@section("tracking")
class TrackingConfig:
    """Where metrics go besides the progress line and ray.train.report."""

    tensorboard: Bool = True
    """TensorBoard event files under STORAGE/RUN/tensorboard (for a cloud storage_path: ~/raytrain_tensorboard/RUN on rank 0's node)."""
    mlflow_tracking_uri: NonEmptyStr | None = None
    """MLflow tracking URI (a server, or file:///path for a local store). None: no MLflow."""
    mlflow_experiment: NonEmptyStr = "raytrain"


@section("")
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
    deepspeed: dict[Str, Any] | NonEmptyStr = field(default_factory=lambda: copy.deepcopy(DEFAULT_DEEPSPEED))
    """DeepSpeed config: a path to the user's JSON or an inline mapping."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        """The typed tree of plain data (a loaded file, or `to_dict()`'s output on a worker: ~100 us)."""
        if not isinstance(data, dict):
            raise ConfigError(f"the run config must be a mapping of sections, got {type(data).__name__}")
        try:
            return _adapter().validate_python(data)
        except ValidationError as e:
            raise one_line(e, cls, "") from None

    def with_deepspeed(self, ds: dict[str, Any]) -> "RunConfig":
        """This config with `ds` as its DeepSpeed mapping (the resolved one)."""
        return dataclasses.replace(self, deepspeed=ds)

    def with_overrides(self, overrides: list[str]) -> "RunConfig":
        """This config with KEY=VALUE overrides applied on top (a new config; this one is unchanged)."""
        data = self.to_dict()
        _apply_overrides(data, [(*parse_override(item), item) for item in overrides], refuse_repeats=False)
        return RunConfig.from_dict(data)


AUTO = "auto"

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


# DeepSpeed's ZeRO fields that it reads under two names, the field's and its stage3_ alias
# (DeepSpeedZeroConfig, 0.19.8; tests/unit/test_config.py pins the list against it). A dotted override
# under one name replaces a value under the other: the default writes the stage3_ names.
ZERO_ALIASED = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
_ZERO_OTHER_NAME = {**{f: f"stage3_{f}" for f in ZERO_ALIASED}, **{f"stage3_{f}": f for f in ZERO_ALIASED}}


# ---------------------------------------------------------------------------------------------
# Loading: defaults < file < command line.


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                values: dict[str, Any] | None = None, *, command_line: bool = False) -> RunConfig:
    """Build the run config from an optional YAML file and KEY=VALUE overrides (dotted keys).

    `values`: more overrides whose values are taken exactly as given, not read as YAML (a flag's
    path: `--resume-from "ck #2"` or `yes` is that directory, not a comment or a boolean).
    `command_line`: the overrides are what a user typed, one mapping like a YAML file, so a key
    given twice is an error; otherwise (lists composed in code, such as a benchmark's base
    overrides plus its --set ones) the later one wins."""
    data: dict[str, Any] = read_yaml_file(path) if path is not None else {}
    pairs = [(*parse_override(item), item) for item in overrides]
    pairs += [(key, value, f"{key}={value}") for key, value in (values or {}).items()]
    _apply_overrides(data, pairs, refuse_repeats=command_line)
    cfg = RunConfig.from_dict(data)
    training = data.get("training")
    _refuse_ignored_training_values(cfg, set(training) if isinstance(training, dict) else set())
    _refuse_unexpanded_variables(cfg)
    return cfg


def check_config(cfg: Any, argument: str = "config") -> RunConfig:
    """`cfg` checked again as `load_config` checks what it loads; the checked copy is returned.

    For a RunConfig built or edited in code (examples/python_api.py): its sections are plain
    dataclasses that nothing checks on assignment, so `cfg.training.learning_rate = -1` or
    `cfg.training.max_steps = 30.0` (a worker's failure, retried, after minutes) would reach the run, and
    `cfg.training.max_step = 20` (no such field) would be dropped without a word (`_add_stray_attributes`).
    The same one-line ConfigError as the command line's; a TypeError, naming `argument`, for a value
    that is no RunConfig. A training value other than its default counts as written, for the rule that
    the DeepSpeed JSON must not override or ignore it (a loaded config passes again: what it was loaded
    with includes every such value). Costs a copy of the tree (~0.2 ms)."""
    if not isinstance(cfg, RunConfig):
        kind = f"{type(cfg).__module__}.{type(cfg).__qualname__}".removeprefix("builtins.")
        hint = {str: "; for a YAML file: raytrain.load_config(path)",
                dict: "; for a mapping of sections: raytrain.RunConfig.from_dict(mapping)"}.get(type(cfg), "")
        if type(cfg).__name__ == "RunConfig":  # Ray Train's, or another library's
            hint = ("; raytrain's comes from raytrain.load_config (Ray's name, storage_path, failure and checkpoint "
                    "settings are its checkpoint section)")
        raise TypeError(f"{argument} must be a raytrain.RunConfig (from raytrain.load_config), got {kind}{hint}")
    data = cfg.to_dict()
    _add_stray_attributes(cfg, data)
    checked = RunConfig.from_dict(data)
    defaults = TrainingConfig()
    _refuse_ignored_training_values(checked, {f.name for f in dataclasses.fields(TrainingConfig)
                                              if getattr(checked.training, f.name) != getattr(defaults, f.name)})
    _refuse_unexpanded_variables(checked)
    return checked


_PATH_KEYS = ("model.name_or_path", "model.tokenizer", "data.path", "data.eval_path", "checkpoint.storage_path",
              "checkpoint.resume_from", "checkpoint.export_dir", "deepspeed")
_VARIABLE = re.compile(r"\$(?:\{[A-Za-z_]\w*\}|[A-Za-z_]\w*)")


def _refuse_unexpanded_variables(cfg: RunConfig) -> None:
    """A path holding $NAME or ${NAME}: a YAML file (or a quoted command-line value) keeps it as written, and raytrain
    expands only ~, so `storage_path: ${SCRATCH}/runs` was a directory named "${SCRATCH}" in the working directory
    (under `ray job submit`, the job's, discarded with it) and `data.path: $DATA` a path that does not exist."""
    for key in _PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name) if name else getattr(cfg, section)
        for item in value if isinstance(value, list) else [value]:
            match = _VARIABLE.search(item) if isinstance(item, str) else None
            if match:
                raise ConfigError(f"{key}={item} holds {match[0]}, an environment variable, which raytrain does not "
                                  f"expand (a YAML file keeps it as written): write the path itself, or give "
                                  f"{key} on the command line unquoted, where the shell expands it")


def _add_stray_attributes(obj: Any, data: dict[str, Any]) -> None:
    """Add to `data` (`obj`'s to_dict()) each attribute set on `obj` or its sections that is no field, so that
    from_dict refuses it in the command line's words: `cfg.training.max_step = 20` (a typo for max_steps) is
    "unknown key training.max_step; did you mean training.max_steps? ...". to_dict() copies fields only, so
    such an attribute was dropped without a word and the run kept the old max_steps.

    Checked here rather than by slotted sections, which would refuse the typo at the assignment itself (an
    AttributeError at the line of the mistake, better feedback): slots are set by raytrain.config_fields.section
    for every section at once, change how the classes pickle, copy and validate (Ray ships the config to each
    worker), and refuse any attribute a user's own code hangs on a config object. Here it costs a walk of the
    tree at the check fit() and dry_run make anyway, and a valid config is unchanged. The free-form mappings
    (deepspeed, model.config, network.env) are dicts, not sections: not walked."""
    fields = {f.name for f in dataclasses.fields(obj)}
    for name, value in getattr(obj, "__dict__", {}).items():  # a user's slotted stand-in has none
        if name not in fields:
            data[name] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and isinstance(data.get(name), dict):
            _add_stray_attributes(value, data[name])


def _apply_overrides(data: dict[str, Any], pairs: list[tuple[str, Any, str]], refuse_repeats: bool) -> None:
    """Apply (key, value, as written) overrides. A section given whole is applied before the dotted
    keys inside it, whatever their order, so `deepspeed.x=1 deepspeed=ds.json` edits the file's
    contents. `refuse_repeats`: a key given twice, also inside a section given whole, is an error."""
    given: dict[str, tuple[Any, str]] = {}
    for key, value, item in sorted(pairs, key=lambda p: p[0].count(".")):  # stable: sections first
        parts = key.split(".")
        zero_key = parts[:2] == ["deepspeed", "zero_optimization"] and len(parts) == 3
        other = _ZERO_OTHER_NAME.get(parts[2]) if zero_key else None
        if refuse_repeats and (first := _given_before(given, parts)) is not None:
            raise ConfigError(f"{key} is given twice on the command line ({first} and {item}); one would "
                              f"silently replace the other: keep one")
        if refuse_repeats and other and (first := _given_before(given, [*parts[:2], other])) is not None:
            raise ConfigError(f"{first} and {item} are one setting under two names on the command line "
                              f"(DeepSpeed reads either); one would silently replace the other: keep one")
        given[key] = (value, item)
        if parts[0] == "deepspeed" and len(parts) > 1 and "deepspeed" not in data:
            # deepspeed.x=y with no DeepSpeed config given edits the default one, not an empty one.
            data["deepspeed"] = copy.deepcopy(DEFAULT_DEEPSPEED)
        _set_dotted(data, key, value)
        if other:
            # The override replaces the value under the other name, as it would under its own: the default
            # writes stage3_prefetch_bucket_size, and `deepspeed.zero_optimization.prefetch_bucket_size=N`
            # means that setting (left beside it, DeepSpeed's check refuses the pair).
            data["deepspeed"]["zero_optimization"].pop(other, None)


def _given_before(given: dict[str, tuple[Any, str]], parts: list[str]) -> str | None:
    """The override, as written, that already set the key `parts` on the command line: the same dotted key,
    or a section given whole that holds it; None if none did."""
    for i in range(1, len(parts) + 1):
        outer = ".".join(parts[:i])
        if outer not in given:
            continue
        inner, first = given[outer]
        for part in parts[i:]:
            inner = inner.get(part, _ABSENT) if isinstance(inner, dict) else _ABSENT
        if inner is not _ABSENT:
            return first
    return None


_ABSENT = object()


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


# The training keys that reach DeepSpeed through its JSON: where raytrain fills them when the JSON
# says "auto" (raytrain.deepspeed_config). The batch keys and precision are checked there.
_FILLS = {"learning_rate": [("optimizer", "lr"), ("scheduler", "warmup_max_lr")],
          "weight_decay": [("optimizer", "weight_decay")], "adam_betas": [("optimizer", "betas")],
          "adam_epsilon": [("optimizer", "eps")], "warmup_steps": [("scheduler", "warmup_num_steps")],
          "max_steps": [("scheduler", "total_num_steps")]}


# DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py, 0.19.8) that take no warmup_num_steps
# or warmup_max_lr and set the learning rate from their own params, ignoring the optimizer's lr
# (tests/unit/test_config.py pins this against their signatures).
_SETS_ITS_OWN_LR = {"OneCycle": "cycle_min_lr / cycle_max_lr and cycle_first_step_size",
                    "LRRangeTest": "lr_range_test_min_lr and lr_range_test_step_size"}


# DeepSpeed's schedulers (lr_schedules.py, 0.19.8) whose warmup_max_lr, left out, is a number of their own,
# not the optimizer's lr (WarmupLR falls back to that; WarmupCosineLR scales it by ratios): the run would
# warm up to this instead of training.learning_rate. raytrain's default learning_rate is the same 1e-3, so
# only a learning_rate the user wrote is refused (tests/unit/test_config.py pins both).
OWN_DEFAULT_PEAK_LR = {"WarmupDecayLR": 0.001}

# DeepSpeed's optimizers (engine._configure_basic_optimizer, 0.19.8; by the lower-case name it matches)
# whose classes take no betas or eps: Lion (FusedLion, DeepSpeedCPULion), Adagrad (torch's,
# DeepSpeedCPUAdagrad), mup's MuSGD (torch's SGD). Advice to write "eps": "auto" there would be refused
# next, as not a parameter of the class (tests/unit/test_config.py pins this against their signatures).
_TAKES_NO = {"lion": {"eps"}, "adagrad": {"betas"}, "musgd": {"betas", "eps"}}


def _refuse_ignored_training_values(cfg: RunConfig, given: set[str]) -> None:
    """A training value the user wrote must take effect: refuse one that a concrete value in the
    DeepSpeed JSON contradicts, or that the JSON's own optimizer or scheduler would silently leave
    out. Only here, where the keys the user wrote are known: a default is never a contradiction
    (a user's JSON with its own concrete lr works unchanged)."""
    if not given & {*_FILLS, "gradient_clipping", "min_lr_ratio"}:
        return
    ds = read_json_file(cfg.deepspeed, "deepspeed") if isinstance(cfg.deepspeed, str) else cfg.deepspeed
    where = f" (in {cfg.deepspeed})" if isinstance(cfg.deepspeed, str) else ""
    sections = {name: ds.get(name) if isinstance(ds.get(name), dict) else None for name in ("optimizer", "scheduler")}

    def refuse(key: str, why: str, fix: str) -> None:
        value = json.dumps(getattr(cfg.training, key))
        raise ConfigError(f"training.{key}={value} would be ignored: {why}{where}: {fix}, or remove training.{key}")

    for key in sorted(given):
        value = getattr(cfg.training, key)
        if key == "gradient_clipping" and ds.get(key, AUTO) not in (AUTO, value):
            raise ConfigError(f"training.{key}={value} contradicts deepspeed.{key}={json.dumps(ds[key])}{where}: "
                              f"set it in one place (or make the DeepSpeed value \"auto\")")
        for name, ds_key in _FILLS.get(key, []):
            section = sections[name]
            params = section.get("params", {}) if section is not None else None
            if not isinstance(params, dict):
                continue  # no such section, or a malformed one (raytrain.deepspeed_config names it)
            written = params.get(ds_key, _ABSENT)
            scheduler_type = str(section.get("type")) if name == "scheduler" else None
            if written is _ABSENT and scheduler_type in _SETS_ITS_OWN_LR and key in ("learning_rate", "warmup_steps"):
                # These take no warmup_num_steps or warmup_max_lr: writing one there would be refused next.
                refuse(key, f"deepspeed.scheduler ({scheduler_type}) sets the learning rate itself, from its "
                            f"own {_SETS_ITS_OWN_LR[scheduler_type]}", "set those in deepspeed.scheduler.params")
            if written is _ABSENT and key == "learning_rate" and scheduler_type in OWN_DEFAULT_PEAK_LR:
                refuse(key, f"deepspeed.scheduler ({scheduler_type}) has no params.warmup_max_lr, so DeepSpeed would "
                            f"warm up to its own default, {OWN_DEFAULT_PEAK_LR[scheduler_type]}",
                       'write "warmup_max_lr": "auto" there')
            optimizer_type = str(section.get("type")) if name == "optimizer" else ""
            if written is _ABSENT and ds_key in _TAKES_NO.get(optimizer_type.lower(), ()):
                raise ConfigError(f"training.{key}={json.dumps(value)} would be ignored: deepspeed.optimizer "
                                  f"({optimizer_type}) takes no {ds_key}{where}: remove training.{key}")
            if written is _ABSENT and (name == "optimizer" or key == "warmup_steps"):
                refuse(key, f"deepspeed.{name} ({section.get('type')}) has no params.{ds_key}, so DeepSpeed would use "
                            f"its own default", f'write "{ds_key}": "auto" there')
            if written not in (_ABSENT, AUTO) and written != (list(value) if isinstance(value, tuple) else value):
                raise ConfigError(f"training.{key}={json.dumps(value)} contradicts deepspeed.{name}.params.{ds_key}="
                                  f"{json.dumps(written)}{where}: set it in one place (or make the DeepSpeed value "
                                  f"\"auto\")")
        if key in ("warmup_steps", "min_lr_ratio") and sections["scheduler"] is None and sections["optimizer"]:
            refuse(key, "the DeepSpeed config has its own optimizer and no scheduler, so the learning rate stays "
                        "constant", 'add a deepspeed.scheduler (for example WarmupCosineLR with "warmup_num_steps": '
                                    '"auto")')
        if key == "min_lr_ratio" and sections["scheduler"] is not None:
            refuse(key, f"deepspeed.scheduler ({sections['scheduler'].get('type')}) replaces raytrain's warmup + "
                        f"cosine schedule", "set the DeepSpeed scheduler's own minimum there")


@functools.cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(RunConfig)
