"""The one contract between the driver and the workers: `RunSpec`, resolved once, never edited.

The driver builds it in two steps: `raytrain.planning.resolve.resolve_run` validates the user's
config for a cluster shape and derives every fact once (a `ResolvedRun`: the config with a concrete
DeepSpeed dict, the cluster shape, the model's facts, the DeepSpeed facts, the data source); the
driver then places the run in storage and adds where it lives and what it resumes from
(`RunSpec.place`). Workers receive `spec.to_dict()` (plain JSON, what Ray pickles to them) and rebuild
it with `RunSpec.from_dict`; the same dict is saved in every checkpoint's raytrain.json.

Frozen dataclasses all the way down: a fact computed on the driver is read by name on the worker,
never recomputed from string keys, never changed on the way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from raytrain.config import RunConfig
from raytrain.deepspeed_config import DeepSpeedFacts


@dataclass(frozen=True)
class ClusterShape:
    """What the run is placed on."""

    num_workers: int
    """The run's number of workers; for an elastic run the range's maximum."""
    use_gpu: bool
    gpus_per_node: int | None = None
    """GPUs of one node (None: unknown, e.g. planning without a cluster)."""
    cpus_total: float | None = None
    """Logical CPUs of the live cluster (None when planning without one)."""
    min_workers: int | None = None
    """An elastic run's minimum (scaling.num_workers=[min, max]); None: a fixed number of workers."""
    driver_on_worker_node: bool = True
    """Whether the driver runs on a node the workers run on (a local cluster; a GPU node of the cluster it
    joined): its Python environment then stands for theirs, and a package they need (flash-attn) is checked
    here. False: a CPU head node, a Ray Client, a dry run for stated sizes; the GPU nodes' image is their own."""

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    @property
    def world_sizes(self) -> range:
        """Every number of workers the run may have."""
        return range(self.num_workers if self.min_workers is None else self.min_workers, self.num_workers + 1)


@dataclass(frozen=True)
class ModelFacts:
    """The model as the driver loaded it once: its transformers config (overrides applied) and sizes."""

    config_class: str
    """The transformers config class, e.g. LlamaConfig."""
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    tokenizer_size: int
    num_parameters: int
    """Counted on the meta device (shared parameters once)."""
    hf_config: dict[str, Any]
    """The config as JSON (`to_json_string`): workers rebuild it from this instead of loading it again."""
    document_start_ids: tuple[int, ...] = ()
    """What packing puts before each document (the tokenizer's BOS, or nothing: raytrain.model.document_start_ids).
    Recorded so that a continued run can tell rows cut another way (raytrain before 2026-12-04 put none)."""
    num_active_parameters: int | None = None
    """The parameters a token runs (raytrain.planning.activations.active_parameters): fewer than num_parameters
    for a mixture of experts. None in records written before it was added: read `active_parameters`."""

    @property
    def active_parameters(self) -> int:
        """What a token's FLOPs (MFU) count: num_active_parameters, or every parameter where it is not recorded."""
        return self.num_parameters if self.num_active_parameters is None else self.num_active_parameters


@dataclass(frozen=True)
class DataFacts:
    """The data sources as the driver found them (raytrain.data.sources.inspect_source)."""

    source: str
    format: str
    eval_source: str | None = None
    eval_format: str | None = None

    @property
    def has_eval(self) -> bool:
        return self.eval_source is not None


@dataclass(frozen=True)
class WorldSizePlan:
    """One world size of an elastic run: the DeepSpeed dict resolved for it and its facts. The
    global batch and the micro-batch are the same at every size; the accumulation follows."""

    world_size: int
    ds_config: dict[str, Any]
    deepspeed: DeepSpeedFacts


@dataclass(frozen=True)
class ResolvedRun:
    """The run validated for a cluster shape: what `--dry-run` prints."""

    config: RunConfig
    """The user's config; its `deepspeed` is the resolved, concrete DeepSpeed dict (no "auto")."""
    cluster: ClusterShape
    model: ModelFacts
    deepspeed: DeepSpeedFacts
    data: DataFacts
    world_sizes: tuple[WorldSizePlan, ...] = ()
    """Elastic runs: the plan for every size of the range, resolved and checked on the driver (a
    worker group takes its own with `at_world_size`); empty for a fixed number of workers. The
    fields above are those of the range's maximum."""
    plan: tuple[str, ...] = ()
    """What the planner chose for the config's "auto" settings, and why (raytrain.planning.choose): the
    `raytrain: plan:` lines the driver prints. Empty when nothing was "auto"."""

    def at_world_size(self, world_size: int):
        """This run as a group of `world_size` workers runs it: its DeepSpeed dict, facts and size."""
        if not self.cluster.elastic and world_size == self.cluster.num_workers:
            return self
        plan = next((p for p in self.world_sizes if p.world_size == world_size), None)
        if plan is None:
            raise ValueError(f"world size {world_size} is not one this run was resolved for "
                             f"({list(self.cluster.world_sizes)})")
        return dataclasses.replace(self, config=self.config.with_deepspeed(plan.ds_config), deepspeed=plan.deepspeed,
                                   cluster=dataclasses.replace(self.cluster, num_workers=world_size, min_workers=None))

    @property
    def ds_config(self) -> dict[str, Any]:
        """The dict deepspeed.initialize receives."""
        return self.config.deepspeed  # type: ignore[return-value]  (resolved: always a mapping)

    @property
    def tokens_per_step(self) -> int:
        return self.deepspeed.train_batch_size * self.config.data.seq_len

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: what the workers receive, raytrain.json stores and --dry-run prints."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {**out, "tokens_per_step": self.tokens_per_step}


@dataclass(frozen=True)
class RunSpec(ResolvedRun):
    """A resolved run placed in storage: everything a worker needs, and nothing it must look up again."""

    run_name: str = ""
    storage_path: str = ""
    """Absolute local path or URI of the storage the run directory lives in."""
    resume_from: str | None = None
    """checkpoint.resume_from: where a new run starts (the run's own latest checkpoint wins after a restart)."""
    counter: str | None = None
    """The run's counter actor (raytrain.data.progress) in this session: rank 0 tells it each step
    it reached, which the driver names when Ctrl-C stops the run. None: none (tests)."""

    @classmethod
    def place(cls, resolved: ResolvedRun, *, run_name: str, storage_path: str, resume_from: str | None,
              counter: str | None = None) -> "RunSpec":
        return cls(**{f.name: getattr(resolved, f.name) for f in dataclasses.fields(ResolvedRun)},
                   run_name=run_name, storage_path=storage_path, resume_from=resume_from, counter=counter)

    @property
    def run_uri(self) -> str:
        return f"{self.storage_path.rstrip('/')}/{self.run_name}"

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("tokens_per_step")  # derived: from_dict must not be handed it
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSpec":
        sizes = tuple(WorldSizePlan(world_size=p["world_size"], ds_config=p["ds_config"],
                                    deepspeed=DeepSpeedFacts(**p["deepspeed"])) for p in data.get("world_sizes", ()))
        return cls(config=RunConfig.from_dict(data["config"]), cluster=ClusterShape(**data["cluster"]),
                   model=ModelFacts(**{**data["model"], "document_start_ids": tuple(data["model"].get(
                       "document_start_ids", ()))}), deepspeed=DeepSpeedFacts(**data["deepspeed"]),
                   data=DataFacts(**data["data"]), world_sizes=sizes, plan=tuple(data.get("plan", ())),
                   run_name=data["run_name"], storage_path=data["storage_path"],
                   resume_from=data.get("resume_from"), counter=data.get("counter"))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
