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
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

from raytrain.config_fields import Bool, Float, Int, Str, directory_name, one_line, ray_address, section, worker_range
from raytrain.config_files import ConfigError, parse_override, read_json_file, read_yaml_file

__all__ = ["ConfigError", "RunConfig", "load_config", "read_json_file", "DEFAULT_DEEPSPEED"]


@section("model")
class ModelConfig:
    """Which causal LM to train."""

    name_or_path: Str | None = None
    """Hugging Face hub id or local directory with a config.json. None: the built-in tiny Llama."""
    config: dict[Str, Any] = field(default_factory=dict)
    """Overrides applied to the model's config (for the built-in model: LlamaConfig keyword args)."""
    pretrained: Bool = False
    """Load the weights of `name_or_path` (else random init from its config)."""
    tokenizer: Str | None = None
    """Hub id or local directory. None: `name_or_path`'s tokenizer, or the built-in byte tokenizer."""
    gradient_checkpointing: Bool | Literal["auto"] = False
    """Recompute activations in backward: ~1/3 more compute for far less activation memory.
    "auto": the planner decides, with the other "auto" settings (raytrain.planning.choose)."""
    attn_implementation: Str = "sdpa"
    """transformers attention backend: "sdpa", "eager", "flash_attention_2", ... (checked on the driver
    against the implementations transformers registers)."""
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
    compile: Bool = False
    """torch.compile the model through DeepSpeed's engine.compile() (inductor; DeepCompile when the
    DeepSpeed config says compile.deepcompile=true). Costs a compile at start-up on every worker.
    Off by default: under ZeRO-3 it was no faster on an H200 (1.1B, -2%: dynamo recompiles at
    DeepSpeed's per-module hooks) and it fails with Liger's kernels (docs/benchmarks.md)."""


@section("data")
class DataConfig:
    """Where the text comes from, how it becomes fixed-length token blocks, and the held-out split."""

    path: Str | list[Str] | None = None
    """Files or directories (local, s3://, gs://, hdfs://, abfs://), or a hub id with format "hf".
    None: the built-in generated corpus."""
    format: Literal["auto", "text", "json", "parquet", "hf", "tokenized"] = "auto"
    """"auto" (by extension; parquet with an input_ids column and no text column is "tokenized"),
    "text", "json", "parquet", "hf" (save_to_disk directory or hub id) or "tokenized"."""
    text_column: Annotated[Str, Field(min_length=1)] = "text"
    """Column holding the documents (json, parquet, hf)."""
    text_document: Literal["file", "line"] = "file"
    """What one document is in a text file: "file" (the whole file: books, articles) or "line"
    (each non-blank line)."""
    invalid_utf8: Literal["replace", "error"] = "replace"
    """Bytes that are not UTF-8 in text or JSON files: "replace" (decode them as U+FFFD and log the
    file and the number of documents affected) or "error" (stop, naming the file and line)."""
    hf_split: Str = "train"
    """Split to read from a Hugging Face DatasetDict (save_to_disk) or hub dataset."""
    seq_len: Annotated[Int, Field(ge=1)] = 128
    """Tokens per packed training sequence."""
    position_ids: Literal["packed", "per_document"] = "packed"
    """"packed": positions 0..seq_len-1 in every block. "per_document": a position_ids column that
    restarts at 0 at each document (and each block) start; flash_attention_2 then also keeps
    attention within documents."""
    tokenize_batch_size: Annotated[Int, Field(ge=1)] = 256
    """Documents per tokenization batch; each batch's leftover tail (< seq_len tokens) is dropped."""
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
    eval_path: Str | list[Str] | None = None
    """Held-out data, read like `path` (same format rules). Exclusive with eval_fraction."""
    eval_fraction: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Hold out this fraction of `path`'s documents (chosen by a hash of each document, so train and
    eval never share one and the split is the same in every run). 0: no split."""
    eval_every_n_steps: Annotated[Int, Field(ge=0)] = 0
    """Evaluate every N optimizer steps and after the last one (0: only after the last one).
    Ignored without eval_path or eval_fraction."""
    eval_max_batches: Annotated[Int, Field(ge=1)] = 8
    """Micro-batches each rank evaluates per evaluation; every rank runs the same count (all stop
    early together if one rank's eval shard runs out)."""
    progress_every_s: Annotated[Float, Field(ge=0)] = 30.0
    """Print how much of the training data has been read and tokenized (percent of the pass, rate,
    ETA) every this many seconds, from the driver (terminal and `ray job logs`). 0: never."""

    def __post_init__(self) -> None:
        if self.eval_fraction and self.eval_path is not None:
            raise ConfigError("data.eval_path and data.eval_fraction are both set: hold out a fraction of "
                              "data.path or read a separate eval_path, not both")


@section("training")
class TrainingConfig:
    """The optimisation loop. Values here fill DeepSpeed keys that are "auto" or absent."""

    max_steps: Annotated[Int, Field(ge=1)] = 80
    """Optimizer steps to run (one step = gradient_accumulation_steps micro-batches)."""
    micro_batch_size_per_gpu: Annotated[Int, Field(ge=1)] | Literal["auto"] | None = None
    """Fills train_micro_batch_size_per_gpu when the DeepSpeed config says "auto" (or leaves it
    underdetermined: then 8). "auto": the planner picks the micro-batch with the highest predicted
    tokens/s that fits the GPUs and host RAM, and prints why (raytrain.planning.choose)."""
    gradient_accumulation_steps: Annotated[Int, Field(ge=1)] | None = None
    """Fills gradient_accumulation_steps when the DeepSpeed config says "auto" (or leaves it
    underdetermined: then 1)."""
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
    """"fp32", "bf16" or "fp16", used for DeepSpeed's "auto". None: bf16 on GPU, fp32 on CPU."""
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
    replacement_timeout_s: Annotated[Float, Field(ge=0)] = 120.0
    """Elastic runs: after losing a node, wait this long for a replacement at the same size (a
    restart, no resize) before continuing on the workers that remain (0: shrink at once)."""
    resize_interval_s: Annotated[Float, Field(ge=0)] = 300.0
    """Elastic runs: a running group checks for returned capacity at most this often, and grows
    (Ray's elastic_resize_monitor_interval_s). A grow restarts every worker from the latest
    checkpoint, discarding the steps since then."""
    use_gpu: Bool | None = None
    """None: true when the Ray cluster has GPUs."""
    cpus_per_worker: Annotated[Float, Field(gt=0)] = 1.0
    """Logical CPUs each worker reserves; the rest of the cluster's CPUs feed Ray Data."""
    accelerator_type: Str | None = None
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

    storage_path: Annotated[Str, Field(min_length=1)] = "~/raytrain_runs"
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
    resume_from: Str | None = None
    """Start from this checkpoint directory (`--resume-from PATH`); the run's own latest wins after a restart."""
    export_dir: Str | None = None
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
            if not key.startswith(NETWORK_ENV_PREFIXES):
                raise ConfigError(f"network.env.{key}: only {', '.join(p + '*' for p in NETWORK_ENV_PREFIXES)} "
                                  "variables belong here; set others through Ray's runtime_env")
        self.env = {k: str(v) for k, v in self.env.items()}  # as NCCL reads them: strings


@section("tracking")
class TrackingConfig:
    """Where metrics go besides the progress line and ray.train.report."""

    tensorboard: Bool = True
    """TensorBoard event files under STORAGE/RUN/tensorboard (for a cloud storage_path: ~/raytrain_tensorboard/RUN on rank 0's node)."""
    mlflow_tracking_uri: Str | None = None
    """MLflow tracking URI (a server, or file:///path for a local store). None: no MLflow."""
    mlflow_experiment: Str = "raytrain"


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
    deepspeed: dict[Str, Any] | Str = field(default_factory=lambda: copy.deepcopy(DEFAULT_DEEPSPEED))
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
        for item in overrides:
            _set_dotted(data, *parse_override(item))
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
    data: dict[str, Any] = read_yaml_file(path) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        if key.startswith("deepspeed.") and "deepspeed" not in data:
            # deepspeed.x=y with no DeepSpeed config given edits the default one, not an empty one.
            data["deepspeed"] = copy.deepcopy(DEFAULT_DEEPSPEED)
        _set_dotted(data, key, value)
    return RunConfig.from_dict(data)


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


@functools.cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(RunConfig)
