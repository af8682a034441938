"""The driver-to-worker contract (raytrain.run_spec): resolved once, it survives the trip to the
workers (plain JSON, as Ray pickles it and raytrain.json stores it) unchanged, and cannot be edited."""

import dataclasses
import json

import pytest

from raytrain.config import load_config
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.run_spec import RunSpec, UniversalCopy


@pytest.fixture(scope="module")
def spec():
    cfg = load_config(None, ["training.max_steps=7", "data.eval_fraction=0.1", "data.num_shards=4"])
    resolved = resolve_run(cfg, shape_from_config(cfg))
    return RunSpec.place(resolved, run_name="r", storage_path="/tmp/runs", resume_from=None,
                         universal=UniversalCopy(step=4, path="/tmp/runs/r/universal/checkpoint_step_00000004",
                                                 from_world=4))


def test_round_trips_through_json_unchanged(spec):
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert again.ds_config == spec.ds_config and "auto" not in json.dumps(again.ds_config)


def test_carries_every_derived_fact_by_name(spec):
    assert (spec.cluster.num_workers, spec.cluster.use_gpu) == (2, False)
    assert spec.deepspeed.train_batch_size == spec.deepspeed.micro_batch_per_gpu * \
        spec.deepspeed.gradient_accumulation_steps * spec.cluster.num_workers
    assert spec.tokens_per_step == spec.deepspeed.train_batch_size * 128
    assert spec.model.config_class == "LlamaConfig" and spec.model.num_parameters > 0
    assert spec.model.hf_config["hidden_size"] == spec.model.hidden_size == 128
    assert spec.data.has_eval and spec.run_uri == "/tmp/runs/r"


def test_is_frozen(spec):
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.run_name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.deepspeed.micro_batch_per_gpu = 1
