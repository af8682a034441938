"""raytrain's elastic scaling policy (raytrain.driver.elastic) without a cluster: its decisions, and
what `policy_installed` does to the process around a fit. Ray's real ScalingConfig and policy
classes; the run on a real multi-node cluster, with nodes killed and added back, is
tests/integration/test_elastic.py."""

import os

import cloudpickle
import pytest

from raytrain import compat
from raytrain.config import load_config
from raytrain.driver.elastic import ReplacementPolicy, next_group_size, policy_installed
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.run_spec import RunSpec


@pytest.mark.parametrize("placeable, previous, retried, wait, expected", [
    (3, None, False, True, (3, False)),  # the first group: as many as fit
    (1, None, False, True, (None, False)),  # below the minimum: wait for capacity
    (2, 3, False, True, (3, True)),  # a node lost: one retry at 3, which waits for a replacement
    (2, 3, True, True, (2, True)),  # none came within the timeout: continue on 2
    (2, 3, False, False, (2, False)),  # replacement_timeout_s=0: continue on 2 at once
    (3, 3, False, True, (3, True)),  # the lost node still counted: that attempt is the retry
    (1, 3, True, True, (None, True)),  # below the minimum after the retry: wait
    (3, 2, False, True, (3, True)),  # more than before (a node came back meanwhile): all of them
])
def test_next_group_size(placeable, previous, retried, wait, expected):
    assert next_group_size(placeable, 2, previous, retried, wait) == expected


def test_the_policy_travels_to_the_controller_by_reference():
    from ray.train import ScalingConfig

    policy = ReplacementPolicy(ScalingConfig(num_workers=(2, 3)), replacement_timeout_s=30)
    policy.group_started(3)
    again = cloudpickle.loads(cloudpickle.dumps(policy))  # what Ray does to reach the controller actor
    assert type(again) is ReplacementPolicy and again._previous == 3 and again.replacement_timeout_s == 30
    assert b"next_group_size" not in cloudpickle.dumps(policy)  # the class by name, not by value


def spec(*overrides):
    cfg = load_config(None, ["data.num_shards=6", "training.micro_batch_size_per_gpu=2", "deepspeed.train_batch_size=12",
                             *overrides])
    return RunSpec.place(resolve_run(cfg, shape_from_config(cfg)), run_name="r", storage_path="/tmp", resume_from=None)


def test_an_elastic_fit_gets_the_policy_and_the_replacement_wait_and_then_neither(monkeypatch):
    import ray.train.v2.api.data_parallel_trainer as trainer_module
    from ray.train import ScalingConfig

    monkeypatch.delenv(compat.WORKER_GROUP_START_TIMEOUT_ENV, raising=False)
    stock = trainer_module.create_scaling_policy
    with policy_installed(spec("scaling.num_workers=[2, 3]", "scaling.replacement_timeout_s=45")):
        policy = trainer_module.create_scaling_policy(ScalingConfig(num_workers=(2, 3)))
        assert isinstance(policy, ReplacementPolicy) and policy.replacement_timeout_s == 45
        # another trainer of a fixed size in the same process keeps Ray's own policy
        assert not isinstance(trainer_module.create_scaling_policy(ScalingConfig(num_workers=2)), ReplacementPolicy)
        assert os.environ[compat.WORKER_GROUP_START_TIMEOUT_ENV] == "45.0"
    assert trainer_module.create_scaling_policy is stock and compat.WORKER_GROUP_START_TIMEOUT_ENV not in os.environ
    # 0 (shrink at once) still gives a placement group the few seconds it needs to be created
    with policy_installed(spec("scaling.num_workers=[2, 3]", "scaling.replacement_timeout_s=0")):
        assert float(os.environ[compat.WORKER_GROUP_START_TIMEOUT_ENV]) > 0


def test_a_fixed_size_fit_is_left_to_ray(monkeypatch):
    import ray.train.v2.api.data_parallel_trainer as trainer_module

    monkeypatch.setenv(compat.WORKER_GROUP_START_TIMEOUT_ENV, "77")
    stock = trainer_module.create_scaling_policy
    with policy_installed(spec("scaling.num_workers=2")):
        assert trainer_module.create_scaling_policy is stock and os.environ[compat.WORKER_GROUP_START_TIMEOUT_ENV] == "77"


class SeenCluster(ReplacementPolicy):
    """The policy on a cluster that can place `placeable` workers (None: the coordinator did not answer):
    Ray's AutoscalingCoordinator needs a running cluster, so raytrain's two queries of it are answered here."""

    placeable: int | None = None
    requests = 0

    def request_resources(self):
        self.requests += 1

    def placeable_workers(self):
        return self.placeable


def test_the_policys_decisions_while_no_group_runs(monkeypatch, capfd):
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    import raytrain.driver.elastic as elastic

    monkeypatch.setattr(elastic, "IDLE_PAUSE_S", 0.0)
    policy = SeenCluster(ScalingConfig(num_workers=(2, 3)), replacement_timeout_s=30)

    def decide(placeable):
        policy.placeable = placeable
        decision = policy.make_decision_for_non_running_worker_group()
        return decision.num_workers if isinstance(decision, ResizeDecision) else type(decision)

    assert decide(None) is NoopDecision and decide(1) is NoopDecision  # no answer; below the minimum
    assert decide(3) == 3 and capfd.readouterr().out == ""  # the first group: nothing to say
    policy.group_started(3)
    assert decide(2) == 3  # a node lost: one retry at 3, waiting for a replacement
    assert capfd.readouterr().out == ("raytrain: 2 of 3 workers can be placed now: waiting up to 30 s "
                                      "(scaling.replacement_timeout_s=30) for a replacement\n")
    assert decide(2) == 2  # none came: continue on 2
    assert capfd.readouterr().out == "raytrain: resizing from 3 to 2 workers (the cluster holds 2, range 2-3)\n"
    policy.group_started(2)
    assert decide(3) == 3 and "resizing from 2 to 3 workers" in capfd.readouterr().out
    policy.group_started(3)
    assert decide(3) == 3 and capfd.readouterr().out == ""  # a restart at the same size: nothing to say
    assert policy.requests == 7  # the request for max workers renewed at every decision
    for timeout_s, size in ((1, 3), (0, 2)):  # any replacement timeout waits once; 0 continues on what is there
        policy = SeenCluster(ScalingConfig(num_workers=(2, 3)), replacement_timeout_s=timeout_s)
        policy.group_started(3)
        assert decide(2) == size
        if timeout_s:  # the placement group waits MIN_PLACEMENT_WAIT_S at least: the line said "up to 1 s"
            assert "waiting up to 5 s (scaling.replacement_timeout_s=1)" in capfd.readouterr().out


class RunningOn(ReplacementPolicy):
    """The policy of a running group on a cluster that can place `placeable` workers: Ray's own check of a running
    group (kept by raytrain) asks the coordinator through these two."""

    placeable = 2

    def _maybe_send_resource_request(self):
        pass

    def _get_reserved_resources(self):
        return {}

    def _count_possible_workers(self, reserved):
        return self.placeable


def test_a_grow_of_a_running_group_is_said_as_a_shrink_is(capfd):
    """Ray's running-group check decides a grow itself (raytrain's non-running decision is never asked), and its own
    line is INFO: the driver said nothing while a healthy group was stopped and its steps since the latest
    checkpoint discarded."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.train.v2._internal.execution.worker_group import WorkerGroupPollStatus, WorkerGroupState

    policy = RunningOn(ScalingConfig(num_workers=(2, 3), elastic_resize_monitor_interval_s=0), replacement_timeout_s=30)
    group = WorkerGroupState(start_time=0.0, placement_group_handle=None, workers=[None, None], sync_actor=None)
    status = WorkerGroupPollStatus(worker_statuses={})
    assert isinstance(policy.make_decision_for_running_worker_group(group, status), NoopDecision)  # the same 2
    assert capfd.readouterr().out == ""
    policy.placeable = 3
    decision = policy.make_decision_for_running_worker_group(group, status)
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 3
    assert capfd.readouterr().out == ("raytrain: resizing from 2 to 3 workers (range 2-3): every worker restarts from "
                                      "the latest checkpoint\n")


def test_a_fit_restores_the_placement_wait_the_process_had(monkeypatch):
    monkeypatch.setenv(compat.WORKER_GROUP_START_TIMEOUT_ENV, "77")
    with policy_installed(spec("scaling.num_workers=[2, 3]", "scaling.replacement_timeout_s=0")):
        assert os.environ[compat.WORKER_GROUP_START_TIMEOUT_ENV] == "5.0"  # the shortest wait a group can have
    assert os.environ[compat.WORKER_GROUP_START_TIMEOUT_ENV] == "77"
