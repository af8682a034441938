"""The driver-to-worker contract (raytrain.run_spec): resolved once, it survives the trip to the
workers (plain JSON, as Ray pickles it and raytrain.json stores it) unchanged, and cannot be edited."""

import dataclasses
import json

import pytest

from raytrain.config import load_config
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.run_spec import ResolvedRun, RunSpec


def place(*overrides):
    cfg = load_config(None, ["training.max_steps=7", "data.eval_fraction=0.1", "data.num_shards=4", *overrides])
    return RunSpec.place(resolve_run(cfg, shape_from_config(cfg)), run_name="r", storage_path="/tmp/runs",
                         resume_from="/tmp/runs/old/checkpoint_step_00000004")


@pytest.fixture(scope="module")
def spec():
    return place()


@pytest.fixture(scope="module")
def elastic():
    # 2 or 3 workers: 6 shards, a global batch of 12 in micro-batches of 2 (accumulation 3 or 2)
    return place("scaling.num_workers=[2, 3]", "data.num_shards=6", "training.micro_batch_size_per_gpu=2",
                 "deepspeed.train_batch_size=12")


@pytest.mark.parametrize("which", ["spec", "elastic"])
def test_round_trips_through_json_unchanged(which, request):
    spec = request.getfixturevalue(which)
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert again.ds_config == spec.ds_config
    assert "auto" not in json.dumps([again.ds_config, *(p.ds_config for p in again.world_sizes)])


def test_carries_every_derived_fact_by_name(spec):
    assert (spec.cluster.num_workers, spec.cluster.use_gpu) == (2, False)
    assert spec.deepspeed.train_batch_size == spec.deepspeed.micro_batch_per_gpu * \
        spec.deepspeed.gradient_accumulation_steps * spec.cluster.num_workers
    assert spec.tokens_per_step == spec.deepspeed.train_batch_size * 128
    assert spec.model.config_class == "LlamaConfig" and spec.model.num_parameters > 0
    assert spec.model.hf_config["hidden_size"] == spec.model.hidden_size == 128
    assert spec.data.has_eval and spec.run_uri == "/tmp/runs/r"


def test_every_field_crosses_the_trip_not_only_those_the_fixture_sets(spec):
    # the fixture leaves these at their defaults, so a field that to_dict or from_dict dropped would come back
    # equal: the counter rank 0 reports to, the planner's lines, a GPU shape, a packing's BOS, a URI's slash
    full = dataclasses.replace(
        spec, cluster=dataclasses.replace(spec.cluster, use_gpu=True, gpus_per_node=8, cpus_total=96.0,
                                          driver_on_worker_node=False),
        model=dataclasses.replace(spec.model, document_start_ids=(1,)), plan=("micro-batch 4: fits",),
        counter="raytrain-counter-r", storage_path="s3://bucket/runs/")
    for record in (full.to_dict(), json.loads(json.dumps(full.to_dict()))):  # as Ray pickles it; as raytrain.json
        assert RunSpec.from_dict(record) == full
    assert full.run_uri == "s3://bucket/runs/r"
    # tokens_per_step is derived: --dry-run prints it (ResolvedRun), the record a worker reads does not hold it
    assert "tokens_per_step" not in full.to_dict()
    assert ResolvedRun.to_dict(full)["tokens_per_step"] == full.tokens_per_step


def test_a_record_from_the_first_run_spec_loads_as_that_raytrain_ran(spec):
    # a checkpoint's raytrain.json written before these fields (resumed, exported): a fixed number of workers, no
    # plan, no counter, nothing before each document, and the driver's packages checked as the workers' (what
    # raytrain did before ClusterShape.driver_on_worker_node)
    old = json.loads(json.dumps(spec.to_dict()))
    for key in ("world_sizes", "plan", "counter"):
        del old[key]
    del old["model"]["document_start_ids"], old["cluster"]["min_workers"], old["cluster"]["driver_on_worker_node"]
    again = RunSpec.from_dict(old)
    assert again == spec and again.cluster.driver_on_worker_node and not again.cluster.elastic


def test_a_record_from_before_active_parameters_loads_with_every_parameter_active(spec):
    # a checkpoint's raytrain.json written before ModelFacts.num_active_parameters: MFU counts them all (dense)
    assert spec.model.num_active_parameters == spec.model.num_parameters  # a dense Llama runs every parameter
    old = spec.to_dict()
    del old["model"]["num_active_parameters"]
    model = RunSpec.from_dict(old).model
    assert model.num_active_parameters is None and model.active_parameters == spec.model.num_parameters


def test_a_mixture_of_experts_counts_the_parameters_a_token_runs(spec):
    # MFU's FLOPs per token: a mixture of experts runs fewer parameters than it holds, and the record keeps the count
    active = spec.model.num_parameters // 4
    moe = dataclasses.replace(spec, model=dataclasses.replace(spec.model, num_active_parameters=active))
    model = RunSpec.from_dict(json.loads(json.dumps(moe.to_dict()))).model
    assert model.active_parameters == active < model.num_parameters


@pytest.mark.parametrize("part, name", [(None, "run_name"), ("deepspeed", "micro_batch_per_gpu"),
                                        ("cluster", "num_workers"), ("model", "hidden_size"), ("data", "source"),
                                        ("world_sizes", "world_size")])
def test_is_frozen_all_the_way_down(part, name, elastic):
    # every fact a worker reads, the elastic run's plan per size included, is the one the driver resolved
    obj = elastic if part is None else getattr(elastic, part)
    obj = obj[0] if part == "world_sizes" else obj
    before = getattr(obj, name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, 1)
    assert getattr(obj, name) == before


def test_a_fixed_run_is_its_own_plan_at_its_size(spec):
    assert spec.at_world_size(2) is spec and spec.world_sizes == ()
    with pytest.raises(ValueError, match="world size 3 is not one this run was resolved for"):
        spec.at_world_size(3)


def test_an_elastic_run_carries_the_plan_of_every_size_and_each_group_takes_its_own(elastic):
    assert (elastic.cluster.min_workers, elastic.cluster.num_workers) == (2, 3) and elastic.cluster.elastic
    assert [(p.world_size, p.deepspeed.gradient_accumulation_steps) for p in elastic.world_sizes] == [(2, 3), (3, 2)]
    two = elastic.at_world_size(2)
    assert (two.cluster.num_workers, two.cluster.elastic) == (2, False)
    assert two.ds_config["gradient_accumulation_steps"] == two.deepspeed.gradient_accumulation_steps == 3
    assert (two.deepspeed.train_batch_size, two.deepspeed.micro_batch_per_gpu) == (12, 2)
    assert two.run_uri == elastic.run_uri and two.resume_from == elastic.resume_from  # the placement stays
    assert elastic.at_world_size(3).ds_config == elastic.ds_config  # the top-level facts are the maximum's
    with pytest.raises(ValueError, match=r"world size 4 is not one this run was resolved for \(\[2, 3\]\)"):
        elastic.at_world_size(4)
