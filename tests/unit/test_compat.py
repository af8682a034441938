"""raytrain.compat: each private API raytrain uses still exists and still has the shape raytrain
relies on, for the versions installed. A failure here means a dependency moved: re-check the entry
(its docstring says what it is for) and bump compat.CHECKED."""

import inspect
import pickle
import sys
from importlib import metadata

import pytest

from raytrain import compat


@pytest.mark.parametrize("dist", sorted(compat.CHECKED))
def test_installed_versions_are_the_checked_ones(dist):
    installed = metadata.version(dist).split("+")[0]
    assert installed == compat.CHECKED[dist], f"{dist} {installed} is not the checked {compat.CHECKED[dist]}"


def test_ray_trains_torch_backend_starts_the_process_group_in_on_start():
    from ray.train.backend import Backend

    assert issubclass(compat.TorchBackend, Backend)
    assert list(inspect.signature(compat.TorchBackend.on_start).parameters) == ["self", "worker_group", "backend_config"]


def test_compat_has_no_other_lazy_attribute():
    # PEP 562's __getattr__ serves TorchBackend only: hasattr() and a typo still see a missing name
    with pytest.raises(AttributeError, match="module 'raytrain.compat' has no attribute 'TorchBackends'"):
        compat.TorchBackends
    assert not hasattr(compat, "torch_backend")


def test_ray_trains_deleted_checkpoint_error_is_where_layout_catches_it():
    from ray.train.v2._internal.exceptions import RayTrainError

    assert issubclass(compat.CheckpointManagerInitializationError, RayTrainError)


def test_ray_train_keeps_coordinators_of_stream_split_iterators():
    from ray.train.v2._internal.data_integration import dataset_manager

    source = inspect.getsource(dataset_manager)
    # the isinstance check and the attribute raytrain's ShardGroup poses with
    assert "isinstance(iterator, StreamSplitDataIterator)" in source and "iterator._coord_actor" in source
    owner = compat.SplitCoordinatorOwner("coordinator")
    assert owner._coord_actor == "coordinator"


def test_a_split_keeps_its_coordinator_in_the_attribute_compat_reads():
    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator

    assert "self._coord_actor = coord_actor" in inspect.getsource(StreamSplitDataIterator.__init__)


def test_ray_trains_report_logger_is_keyed_by_the_context_modules_path():
    import logging

    from ray.train.v2._internal.execution import context

    assert "logger = logging.getLogger(__file__)" in inspect.getsource(context)
    compat.quiet_ray_train_report_log()
    assert logging.getLogger(context.__file__).level == logging.WARNING


def test_torch_extension_build_dir_is_per_op(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = compat.torch_extension_build_dir("raytrain_probe_op")
    assert build_dir.is_dir() and build_dir.name == "raytrain_probe_op" and tmp_path in build_dir.parents


def test_deepspeed_compatible_ops_has_the_shm_comm_entry():
    import deepspeed.ops

    assert "deepspeed_shm_comm" in deepspeed.ops.__compatible_ops__
    before = deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]
    try:
        compat.disable_deepspeed_op("deepspeed_shm_comm")
        assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    finally:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = before


def test_ray_elastic_policy_has_what_raytrains_policy_calls():
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    for name in ("_count_possible_workers", "_get_resize_decision", "_maybe_send_resource_request",
                 "_get_reserved_resources", "make_decision_for_non_running_worker_group",
                 "make_decision_for_running_worker_group", "after_controller_state_update"):
        assert callable(getattr(ElasticScalingPolicy, name)), name
    assert list(inspect.signature(ElasticScalingPolicy._count_possible_workers).parameters) == ["self", "reserved_resources"]
    init = inspect.getsource(ElasticScalingPolicy.__init__)
    assert "self._latest_reserved_resources" in init and ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S == 1
    # both of Ray's decision paths read the cluster through the method raytrain overrides
    for path in (ElasticScalingPolicy.make_decision_for_non_running_worker_group,
                 ElasticScalingPolicy.make_decision_for_running_worker_group):
        assert "self._get_reserved_resources()" in inspect.getsource(path)
    source = inspect.getsource(inspect.getmodule(ElasticScalingPolicy).ScalingPolicy)
    assert "def _autoscaling_coordinator" in source and "self._requester_id" in source


def test_the_coordinator_recomputes_its_reservation_on_request():
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor

    parameters = inspect.signature(_AutoscalingCoordinatorActor.get_reserved_resources).parameters
    # Ray adds _ray_trace_ctx to an actor class's methods once tracing hooks ran in this process
    # (a whole-suite run defines actors first): not a parameter of the method's own.
    assert [p for p in parameters if p != "_ray_trace_ctx"] == ["self", "requester_id", "recompute"] and parameters["recompute"].default is False


def test_the_policy_hears_of_a_started_group_from_rays_own_states():
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.controller.state import ReschedulingState, RunningState, SchedulingState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    started = []

    class Policy(compat.ElasticPolicyBase):
        def group_started(self, num_workers):
            started.append(num_workers)

    policy = Policy(ScalingConfig(num_workers=(2, 3)))
    policy.after_controller_state_update(SchedulingState(ResizeDecision(3, {"CPU": 1})), RunningState())
    policy.after_controller_state_update(RunningState(), ReschedulingState(training_failed_error=None))
    # a group that failed to schedule never started
    policy.after_controller_state_update(SchedulingState(ResizeDecision(2, {"CPU": 1})),
                                         ReschedulingState(training_failed_error=None))
    assert started == [3]
    assert policy.start_group(2) == ResizeDecision(num_workers=2, resources_per_worker={"CPU": 1})


def test_the_policy_reads_the_cluster_at_most_once_per_rays_interval(monkeypatch, caplog):
    import logging
    import time

    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision

    assert compat.ElasticPolicyBase.RESERVATION_INTERVAL_S == ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S
    policy = compat.ElasticPolicyBase(ScalingConfig(num_workers=(1, 3)))
    assert isinstance(policy.no_decision(), NoopDecision)
    # the controller has not started: no coordinator to ask, so Ray's handling (log, decide nothing this round)
    monkeypatch.setattr(logging.getLogger("ray.train"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="ray.train"):
        assert policy.placeable_workers() is None
    assert [r.getMessage() for r in caplog.records] == ["raytrain: could not read the cluster's reserved resources"]
    # within the interval the last reservation answers: 4 CPUs for 1-CPU workers, capped at the maximum of 3
    policy._raytrain_reserved_at = time.monotonic()
    monkeypatch.setattr(compat.ElasticPolicyBase, "RESERVATION_INTERVAL_S", 3600.0)
    policy._latest_reserved_resources = {"node-1": {"CPU": 4.0}}
    assert policy.placeable_workers() == 3
    policy._latest_reserved_resources = {"node-1": {"CPU": 2.0}}
    assert policy.placeable_workers() == 2
    # past the interval it asks again
    policy._raytrain_reserved_at = time.monotonic() - 7200.0
    assert policy.placeable_workers() is None and len(caplog.records) == 2


def test_fit_builds_its_scaling_policy_through_the_trainer_modules_name():
    import ray.train.v2.api.data_parallel_trainer as trainer_module
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, FixedScalingPolicy

    assert "scaling_policy=create_scaling_policy(self.scaling_config)" in inspect.getsource(trainer_module.DataParallelTrainer.fit)
    stock = trainer_module.create_scaling_policy
    undo = compat.install_scaling_policy(lambda config: "mine" if config.elasticity_enabled else None)
    try:
        assert trainer_module.create_scaling_policy(ScalingConfig(num_workers=(1, 2))) == "mine"
        assert isinstance(trainer_module.create_scaling_policy(ScalingConfig(num_workers=2)), FixedScalingPolicy)
    finally:
        undo()
    assert trainer_module.create_scaling_policy is stock
    assert isinstance(stock(ScalingConfig(num_workers=(1, 2))), ElasticScalingPolicy)


def test_the_placement_group_wait_is_the_env_var_ray_propagates():
    from ray.train.v2._internal import constants

    assert constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR == compat.WORKER_GROUP_START_TIMEOUT_ENV
    assert compat.WORKER_GROUP_START_TIMEOUT_ENV in constants.ENV_VARS_TO_PROPAGATE


def test_deepspeeds_universal_load_still_shares_group_0s_settings_and_one_step_tensor():
    # When this fails DeepSpeed's universal load changed: re-check compat.repair_universal_load (and
    # its call in raytrain.checkpoint.shards.restore), which may go. tests/unit/checkpoint/test_universal.py
    # shows both effects on a real load.
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    assert 'optim_sd[OPTIMIZER_STATE_DICT]["param_groups"][0].items()' in source
    assert "self.optimizer.state[fp32_param]['step'] = state_step" in source
    assert "self.optimizer.param_groups" in source and "self.optimizer = " in inspect.getsource(DeepSpeedZeroOptimizer_Stage3.__init__)


def test_deepspeed_builds_the_gpu_side_optimizer_with_a_copy_of_group_0():
    """The bug compat.share_backup_optimizer_param_groups works around (DeepSpeed 0.19.8, stage3.py:313-326):
    group 0's hyper-parameters are copied into a new AdamW, groups 1+ are the CPU optimizer's dicts. When
    this construction changes (upstream fixed it, or moved it), re-check the workaround."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3.__init__)
    assert "self.backup_optimizer = torch.optim.AdamW([backup_gpu_param]," in source
    assert 'lr=self.optimizer.param_groups[0]["lr"],' in source
    assert "self.backup_optimizer.add_param_group(self.optimizer.param_groups[i])" in source
    step = inspect.getsource(DeepSpeedZeroOptimizer_Stage3._optimizer_step)
    assert "self.backup_optimizer.param_groups[param_group_id]['params'] = [fp32_param]" in step
    # The workaround itself runs on a real DeepSpeed optimizer in tests/unit/worker/test_engine_offload.py.


def test_deepspeeds_stage3_step_finds_an_overflow_again_in_the_offloaded_gradient_norm():
    """What compat.skip_host_overflow_scan relies on (DeepSpeed 0.19.8, stage3.py): step() checks the raw
    gradients (has_overflow, the host scan with offload), then marks an inf/nan gradient norm as an overflow;
    with offload that norm comes from norms taken on the accelerator at the accumulation boundary, in fp64.
    When this moves, re-check the workaround. (It runs on real DeepSpeed in tests/unit/worker/test_engine_offload.py.)"""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    def source(method):  # DeepSpeed's instrument_w_nvtx wraps without functools.wraps: its closure holds it
        return inspect.getsource(inspect.getclosurevars(method).nonlocals.get("func", method))

    step = source(Stage3.step)
    check = step.index("self._overflow_check_and_loss_scale_update(update_scale=False)")
    again = step.index("if is_invalid_grad_norm(scaled_global_grad_norm):\n                self.overflow = True")
    assert check < step.index("norm_groups = self._get_norm_groups()") < again < step.index(
        "if self._loss_scale_update_and_overflow_cleanup():")
    assert "self.complete_grad_norm_calculation_for_cpu_offload(" in source(Stage3._get_norm_groups)
    boundary = source(Stage3._offload_grad_partition_at_boundary)
    assert "self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(grad_buffer)" in boundary
    assert "get_norm_dtype()" in source(Stage3._constant_buffered_norm2)
    assert "self.check_overflow()" in source(Stage3._overflow_check_and_loss_scale_update)


def test_deepspeed_config_is_built_the_way_its_init_builds_it():
    from deepspeed.runtime.config import DeepSpeedConfig

    source = inspect.getsource(DeepSpeedConfig.__init__)
    steps = ["_reject_removed_config_keys(self._param_dict)", "self._initialize_params(param_dict)",
             "self._configure_train_batch_size()", "self._do_sanity_check()"]
    assert all(step in source for step in steps)
    assert [source.index(step) for step in steps] == sorted(source.index(step) for step in steps)
    batch = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    parsed = compat.parse_deepspeed_config(dict(batch), world_size=4)  # 16 = 2 x 2 x 4 ranks
    assert (parsed.world_size, parsed.train_batch_size, parsed.zero_optimization_stage) == (4, 16, 0)
    with pytest.raises(AssertionError, match="16 != 2 \\* 2 \\* 8"):
        compat.parse_deepspeed_config(dict(batch), world_size=8)


def test_deepspeed_imports_on_the_driver_without_its_accelerator_guess_on_stdout():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "from raytrain import compat; compat.import_deepspeed_quietly()"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Setting accelerator" not in p.stdout and p.stdout == ""


def test_deepspeed_imports_without_mlflow_which_stays_importable():
    import subprocess

    # a fresh process: this one may have imported both already
    code = ("import sys; from raytrain import compat; compat.import_deepspeed_quietly(); "
            "from deepspeed.autotuning import autotuner; assert autotuner.has_mlflow is False, 'imported'; "
            "assert 'mlflow' not in sys.modules, sys.modules.get('mlflow'); "
            "import mlflow; assert mlflow.__version__; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_controller_callbacks_get_after_controller_start_and_the_controller_has_abort():
    from ray.train.v2._internal.execution.controller.controller import TrainController

    told = []
    callback = compat.OnControllerStart(told.append)
    assert list(inspect.signature(callback.after_controller_start).parameters) == ["train_run_context"]
    # the controller invokes every ControllerCallback of RunConfig.callbacks after it started
    assert '"after_controller_start"' in inspect.getsource(TrainController)
    assert inspect.iscoroutinefunction(TrainController.abort)
    assert "self._worker_group.abort()" in inspect.getsource(TrainController.abort)


def test_a_placement_groups_creator_is_in_the_gcs_record_and_an_actor_handle_has_its_id():
    """compat.remove_placement_groups_of reads them (the killed controller's group; the integration test in
    tests/integration/test_driver_checks.py removes one through it)."""
    from ray._private.state import GlobalState
    from ray.actor import ActorHandle
    from ray.core.generated import gcs_pb2

    fields = {f.name for f in gcs_pb2.PlacementGroupTableData.DESCRIPTOR.fields}
    assert {"placement_group_id", "creator_actor_id", "state"} <= fields
    assert gcs_pb2.PlacementGroupTableData.REMOVED
    assert "accessor = self._connect_and_get_accessor()" in inspect.getsource(GlobalState.placement_group_table)
    assert "accessor.get_placement_group_table()" in inspect.getsource(GlobalState.placement_group_table)
    assert isinstance(ActorHandle._actor_id, property)


def test_ray_says_whether_its_dashboard_can_start():
    """raytrain.driver.cluster starts a local cluster with the dashboard only where this says it can (on
    a minimal ray, ray.init(include_dashboard=True) raises a bare Exception halfway through the start).
    The test environment installs ray[default]: the dashboard can start."""
    from ray._private import utils

    assert callable(utils.get_dashboard_dependency_error)
    assert compat.dashboard_dependency_error() is None


def test_ray_train_poll_interval_is_rays_default_or_the_env_var(monkeypatch):
    from raytrain import compat

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert compat.ray_train_poll_interval_s() == 2.0  # ray 2.60's DEFAULT_HEALTH_CHECK_INTERVAL_S
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    assert compat.ray_train_poll_interval_s() == 0.5


def test_an_upload_function_gets_rays_own_upload_through_the_train_context():
    # compat.persist_checkpoint: what checkpoint.upload_async's wrapped upload calls (raytrain.worker.loop)
    import inspect

    from ray.train.v2._internal.execution import context
    from ray.train.v2._internal.execution.storage import StorageContext

    assert callable(context.get_train_context)
    assert context.TrainContext.get_storage.__code__.co_names == ("storage_context",)
    assert list(inspect.signature(StorageContext.persist_current_checkpoint).parameters) == [
        "self", "checkpoint", "checkpoint_dir_name"]
    assert "checkpoint_upload_fn" in inspect.signature(context.TrainContext.report).parameters


def test_the_autoscaling_request_warning_keeps_its_message_in_one_line():
    import logging

    import ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client as client
    from ray.exceptions import GetTimeoutError

    from raytrain import compat

    assert client.logger.name == compat.AUTOSCALING_CLIENT_LOGGER  # the logger the filter goes on
    client.logger.removeFilter(compat._exception_in_one_line)
    pickle.loads(pickle.dumps(compat.OneLineAutoscalingWarning()))  # as Ray hands it to the controller
    assert compat._exception_in_one_line in client.logger.filters
    try:
        raise GetTimeoutError("Get timed out: some object(s) not ready.")
    except GetTimeoutError:
        record = logging.LogRecord(client.logger.name, logging.WARNING, __file__, 1,
                                   "Failed to send resource request for %s.", ("train-1",), sys.exc_info())
    assert compat._exception_in_one_line(record)  # kept, not dropped
    line = logging.Formatter("%(levelname)s %(message)s").format(record)
    assert line == ("WARNING Failed to send resource request for train-1. "
                    "(GetTimeoutError: Get timed out: some object(s) not ready.)")
    # a warning without an exception passes as it is
    plain = logging.LogRecord(client.logger.name, logging.WARNING, __file__, 1, "Slow: %s.", ("train-1",), None)
    assert compat._exception_in_one_line(plain) and (plain.msg, plain.args) == ("Slow: %s.", ("train-1",))


def test_ray_init_prints_worker_logs_through_the_handler_compat_removes(monkeypatch):
    import ray
    from ray._private import worker
    from ray._private.ray_logging import WorkerStandardStreamDispatcher

    # ray.init(log_to_driver=True) registers the printer under this name; ray.shutdown removes it so
    assert '"ray_print_logs"' in inspect.getsource(worker.connect)
    assert 'remove_handler("ray_print_logs")' in inspect.getsource(worker.disconnect)
    # a dispatcher of this test's own: in a whole-suite run this process is a connected driver whose
    # real printer must stay
    dispatcher = WorkerStandardStreamDispatcher()
    monkeypatch.setattr(worker, "global_worker_stdstream_dispatcher", dispatcher)
    printed = []
    dispatcher.add_handler("ray_print_logs", printed.append)
    dispatcher.emit({"lines": ["x"]})
    undo = compat.stop_printing_worker_logs()
    dispatcher.emit({"lines": ["y"]})
    compat.stop_printing_worker_logs()  # idempotent
    assert printed == [{"lines": ["x"]}]
    undo()
    # the undo puts Ray's printer back only while this process is a connected driver (not in a unit run
    # alone: ray.init there registers its own again)
    assert dispatcher.handlers == ([] if not ray.is_initialized() else [("ray_print_logs", printed.append)])


def test_only_the_run_snapshot_line_is_dropped_and_only_within_the_block():
    import logging

    logger = logging.getLogger(compat.CHECKPOINT_MANAGER_LOGGER)

    def record(msg):
        return logging.LogRecord(logger.name, logging.INFO, __file__, 1, msg, None, None)

    snapshot = "A run snapshot was found in storage folder at /tmp/run"
    with compat.no_run_snapshot_line():
        assert not logger.filter(record(snapshot))
        assert logger.filter(record("Restoring the checkpoint manager")) and logger.filter(record(ValueError("x")))
    assert logger.filter(record(snapshot))


def test_optimizers_other_than_zero_3s_are_left_as_they_are():
    """engine.optimizer is no ZeRO-3 optimizer at stages 0-2: no backup optimizer to share, no host scan to drop
    (the ZeRO-3 cases run on real DeepSpeed in tests/unit/worker/test_engine_offload.py)."""
    import torch

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert compat.share_backup_optimizer_param_groups(optimizer) is False
    assert compat.skip_host_overflow_scan(optimizer) is False
    assert compat.host_overflow_scan_dropped(optimizer) is False


def test_the_run_snapshot_line_and_the_printers_list_are_where_compat_reads_them():
    from ray._private.ray_logging import WorkerStandardStreamDispatcher
    from ray.train.v2._internal.execution.checkpoint import checkpoint_manager

    # Result.from_path builds a CheckpointManager, which logs this INFO from its module's logger
    assert checkpoint_manager.logger.name == compat.CHECKPOINT_MANAGER_LOGGER
    source = inspect.getsource(checkpoint_manager.CheckpointManager._maybe_load_state_from_storage)
    assert '"A run snapshot was found' in source and "logger.info(" in source
    # the undo of stop_printing_worker_logs reads the (name, handler) pairs back from the dispatcher
    dispatcher = WorkerStandardStreamDispatcher()
    dispatcher.add_handler(compat.PRINT_HANDLER, print)
    assert dispatcher.handlers == [(compat.PRINT_HANDLER, print)]


def test_ray_train_takes_a_failure_with_a_preempted_worker_for_a_preemption():
    """compat.preempted is Ray Train's own rule for the budget a group failure is charged to: the failure line
    (raytrain.driver.watch.RunWatch) names it so."""
    from ray.exceptions import RayActorError
    from ray.train import FailureConfig
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    dead = WorkerHealthCheckFailedError("health check failed", RayActorError(preempted=True))
    assert compat.preempted(dead) and compat.preempted(RayActorError(preempted=True))
    assert not compat.preempted(WorkerHealthCheckFailedError("health check failed", RayActorError()))
    assert not compat.preempted(RuntimeError("boom"))
    policy = DefaultFailurePolicy(FailureConfig(max_failures=0))  # as raytrain sets it: no max_preemption_failures
    assert policy.make_decision(WorkerGroupError("x", {0: RuntimeError("gloo"), 1: dead})) == FailureDecision.RETRY
    assert policy.make_decision(WorkerGroupError("x", {0: RuntimeError("boom")})) == FailureDecision.RAISE
