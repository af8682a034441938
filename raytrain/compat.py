"""Every private API of Ray, torch and DeepSpeed that raytrain touches, in one place.

Each entry says what it is for, why no public API does it, and the version it was checked
against (`CHECKED`). tests/unit/test_compat.py fails when any of them moves or changes shape,
and when the installed versions differ from `CHECKED` (then re-check each entry and bump them).

DeepSpeed is imported inside the functions that need it: importing it picks its accelerator, and
a CPU worker must set DS_ACCELERATOR=cpu first (raytrain.worker.engine.import_deepspeed).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator
from ray.train.v2._internal.execution.controller.state import RunningState, SchedulingState
from ray.train.v2._internal.execution.scaling_policy import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
)
from ray.train.v2._internal.execution.callback import ControllerCallback

# Ray Train's only signal that its record of a run names a checkpoint deleted from storage (raised
# by ray.train.Result.from_path; ray/train/v2/_internal/exceptions.py, ray 2.60.0): raytrain turns it
# into one line (raytrain.checkpoint.layout.latest_checkpoint).
from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError  # noqa: F401

CHECKED = {"ray": "2.60.0", "deepspeed": "0.19.8", "torch": "2.13.0"}
"""The versions every entry below was checked against (torch: 2.11 on the GPU image too)."""


def __getattr__(name: str):
    """`compat.TorchBackend`: Ray Train's torch backend (ray/train/torch/config.py, class _TorchBackend,
    ray 2.60.0). raytrain's backend subclasses it to set each node's NCCL/Gloo environment in
    `on_start` before the parent creates the process group: TorchConfig has no public hook that runs
    on every worker that early. Imported on first use (PEP 562): ray.train.torch imports torch, and
    Ray Train's dataset manager imports this module (through raytrain.data.ingest) without needing it."""
    if name == "TorchBackend":
        from ray.train.torch.config import _TorchBackend

        return _TorchBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SplitCoordinatorOwner(StreamSplitDataIterator):
    """Not an iterator: what lets Ray Train shut a streaming_split's coordinator actor down.

    Ray Train's dataset manager keeps the coordinator of a shard it hands out only when the shard
    is a StreamSplitDataIterator (ray/train/v2/_internal/data_integration/dataset_manager.py:116,
    ray 2.60.0: `isinstance(...)` then `iterator._coord_actor`), and kills it with the worker group.
    raytrain hands out a group of shards instead (raytrain.data.ingest.ShardGroup), so it poses as
    one. super().__init__ is not called: that would start an iterator over one split.
    """

    def __init__(self, coordinator_actor):
        self._coord_actor = coordinator_actor


def split_coordinator(split: StreamSplitDataIterator):
    """The coordinator actor behind one split of `Dataset.streaming_split` (its private attribute)."""
    return split._coord_actor


class OnControllerStart(ControllerCallback):
    """Hands the Ray Train controller of a run to `tell(controller)`, in the controller's process,
    as it starts: raytrain's counter holds it to stop the run (`abort_train_run`).

    ControllerCallback (ray/train/v2/_internal/execution/callback.py, ray 2.60.0, a DeveloperAPI)
    in RunConfig(callbacks=...): Ray Train calls `after_controller_start` in the controller and
    passes callbacks that are not UserCallbacks on as they are ("custom workarounds built on top of
    internal callbacks", api/data_parallel_trainer.py). The public UserCallback has no start hook,
    and nothing public returns the controller's handle.
    """

    def __init__(self, tell):
        self._tell = tell

    def after_controller_start(self, train_run_context) -> None:
        import ray

        self._tell(ray.get_runtime_context().current_actor)


def abort_train_run(controller):
    """Stop a Ray Train run now, as Ctrl-C on its driver does: TrainController.abort (ray/train/v2/
    _internal/execution/controller/controller.py, ray 2.60.0; what DataParallelTrainer's SIGINT
    handler calls) kills the worker group, marks the run aborted and ends the controller, so the
    driver's trainer.fit() raises RayActorError. Never retried, unlike an error raised by a worker
    (FailureConfig.max_failures counts those). Returns at once: the ObjectRef of the call, which
    raises RayActorError when got (the controller ends itself)."""
    return controller.abort.remote()


def remove_placement_groups_of(actor) -> int:
    """Remove the placement groups `actor` created and that are not removed yet; how many. Used once a run's
    controller is killed: its worker group's placement group belongs to the driver's job, not to the actor
    (Ray ties a non-detached group's lifetime to its job), so it outlives the controller. Ray's public
    placement_group_table() drops the creator: the GCS record (gcs_pb2.PlacementGroupTableData's
    creator_actor_id, read through ray._private.state.state._connect_and_get_accessor()) has it, and the handle's
    actor id is ActorHandle._actor_id (ray 2.60.0). One GCS call for the whole table."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    creator = actor._actor_id.binary()
    removed = 0
    for record in state._connect_and_get_accessor().get_placement_group_table():
        group = gcs_pb2.PlacementGroupTableData.FromString(record)
        if group.creator_actor_id == creator and group.state != gcs_pb2.PlacementGroupTableData.REMOVED:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(group.placement_group_id)))
            removed += 1
    return removed


PRINT_HANDLER = "ray_print_logs"
"""The name under which `ray.init(log_to_driver=True)` registers its printer of the job's worker output on
ray._private.worker.global_worker_stdstream_dispatcher, and `ray.shutdown` removes it (ray/_private/worker.py,
ray 2.60.0; the dispatcher keeps (name, handler) pairs in its `handlers` list, ray/_private/ray_logging)."""


def stop_printing_worker_logs() -> Callable[[], None]:
    """This driver stops printing its job's worker output (what `ray.init(log_to_driver=True)` forwards)
    until the returned undo is called; no public API turns forwarding off, or on again, once connected.
    Used once a bad record has stopped the run: Ray Data's tasks are then killed mid-call, and one
    killed inside a finalizer printed `Exception ignored in ... SystemExit: 1` with a traceback after
    raytrain's one-line error (seen on a fast machine in the suite). The undo puts Ray's own handler
    back, once, while this process is still connected and has none (a ray.shutdown and ray.init in
    between registered their own): without it every later run of the process (a notebook's next fit())
    printed no worker line at all. Called again while stopped, it stops nothing more."""
    import ray
    from ray._private.worker import global_worker_stdstream_dispatcher as dispatcher

    removed = [pair for pair in dispatcher.handlers if pair[0] == PRINT_HANDLER]
    dispatcher.remove_handler(PRINT_HANDLER)

    def undo() -> None:
        if ray.is_initialized() and not any(name == PRINT_HANDLER for name, _ in dispatcher.handlers):
            for name, handler in removed:
                dispatcher.add_handler(name, handler)

    return undo


def persist_checkpoint(checkpoint, checkpoint_dir_name: str):
    """Ray Train's own upload of a reported checkpoint into the run's storage (what ray.train.report runs without a
    checkpoint_upload_fn: pyarrow's copy_files), for an upload function that wraps it; the stored Checkpoint
    (ray/train/v2/_internal/execution/context.py `_upload_checkpoint`, ray 2.60.0)."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().get_storage().persist_current_checkpoint(checkpoint, checkpoint_dir_name)


def preempted(worker_error: BaseException) -> bool:
    """Whether a worker's error is its death by its node's preemption, which Ray Train charges to
    FailureConfig.max_preemption_failures (unlimited by default), not max_failures; a group failure with any
    such error is a preemption to it (ray/train/v2/_internal/execution/worker_group/poll.py
    `_is_preempted_actor`, failure_handling/default.py `_is_preemption_failure`, ray 2.60.0). No public API
    says which budget a failure was charged to, and raytrain's failure line names it."""
    from ray.train.v2._internal.execution.worker_group.poll import _is_preempted_actor

    return _is_preempted_actor(worker_error)


def dead_actor_id(worker_error: BaseException) -> str | None:
    """The id of the worker actor whose death `worker_error` reports, where it says one (RayActorError.actor_id,
    inside Ray Train's WorkerHealthCheckFailedError as `_is_preempted_actor` unwraps it, ray 2.60.0)."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    if isinstance(worker_error, WorkerHealthCheckFailedError):
        worker_error = worker_error.health_check_failure
    return getattr(worker_error, "actor_id", None) if isinstance(worker_error, RayActorError) else None


def ray_train_poll_interval_s() -> float:
    """How often Ray Train's controller takes a report from each worker: one per worker per poll,
    every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default 2 s; the driver's value reaches the controller
    and the workers). The worker's result queue holds one report, so ray.train.report blocks while
    the previous one waits there (ray/train/v2/_internal/execution/context.py `_wait_then_report`,
    worker.py `poll_status`, ray 2.60.0)."""
    from ray.train.v2._internal.constants import DEFAULT_HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_INTERVAL_S_ENV_VAR

    return float(os.environ.get(HEALTH_CHECK_INTERVAL_S_ENV_VAR, DEFAULT_HEALTH_CHECK_INTERVAL_S))


AUTOSCALING_CLIENT_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"


class OneLineAutoscalingWarning(ControllerCallback):
    """Ray Train warns when a resource request to its autoscaling coordinator takes over 5 s (a fixed
    timeout, autoscaling_coordinator_client.py, ray 2.60.0), with the GetTimeoutError's traceback:
    ~20 lines on the user's console each time the machine is busy (seen on 2 CPU cores while the
    coordinator's actor process started; it broke the quick start's "at most 5 foreign lines" and its
    "no traceback after Ctrl-C"). Ray's message says it is safe to ignore when transient. It stays,
    in one line with the exception's type and text.

    The filter goes on in the controller's process when Ray unpickles this callback there, not in a
    hook: Ray Train's own scaling policy sends its first request from its `after_controller_start`,
    which runs before any callback of the run's (controller.py `_controller_callbacks`)."""

    def __init__(self):
        self.logger_name = AUTOSCALING_CLIENT_LOGGER  # non-empty state: pickle calls __setstate__ only then

    def __setstate__(self, state):
        self.__dict__.update(state)
        logger = logging.getLogger(self.logger_name)
        if _exception_in_one_line not in logger.filters:
            logger.addFilter(_exception_in_one_line)


def _exception_in_one_line(record: logging.LogRecord) -> bool:
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        record.msg, record.args = f"{record.getMessage()} ({type(exc).__name__}: {exc})", None
        record.exc_info, record.exc_text = None, None
    return True


def quiet_ray_train_report_log() -> None:
    """Ray Train V2 logs each ray.train.report at INFO from every rank, the whole metrics dict and
    checkpoint in one long line, burying raytrain's progress line. It is that module's only INFO
    message and its warnings still show. The logger is named after the module's file path
    (ray/train/v2/_internal/execution/context.py, ray 2.60.0), not a dotted name."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


CHECKPOINT_MANAGER_LOGGER = "ray.train.v2._internal.execution.checkpoint.checkpoint_manager"
"""The logger of Ray Train's CheckpointManager (its module's __name__, ray 2.60.0)."""


@contextlib.contextmanager
def no_run_snapshot_line():
    """Within the block, this process drops Ray Train's INFO "A run snapshot was found in storage folder
    at ..." (3 lines, on the driver's console: Ray configures its "ray" loggers at INFO on import), which
    CheckpointManager._maybe_load_state_from_storage logs whenever it reads a run's record, as
    ray.train.Result.from_path does (raytrain.checkpoint.layout.latest_checkpoint: several times per
    continued run). raytrain says itself that it continues the run. A filter on that logger, for the
    block only: its other messages, and this one from Ray Train's own controller, are untouched."""
    logger = logging.getLogger(CHECKPOINT_MANAGER_LOGGER)
    logger.addFilter(_not_the_snapshot_line)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_snapshot_line)


def _not_the_snapshot_line(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith("A run snapshot was found"))


def dashboard_dependency_error() -> str | None:
    """Why Ray's dashboard cannot start in this environment (a minimal `ray` without `ray[default]`'s
    packages), or None. ray.init(include_dashboard=True) raises a bare Exception for it, after it
    has started part of the cluster. ray/_private/utils.py, Ray 2.60."""
    from ray._private.utils import get_dashboard_dependency_error

    error = get_dashboard_dependency_error()
    return None if error is None else str(error)


def torch_extension_build_dir(op_name: str) -> Path:
    """Where torch's cpp_extension builds (and locks) a JIT extension: torch.utils.cpp_extension.
    _get_build_directory (torch 2.13.0 and 2.11), the one place that knows TORCH_EXTENSIONS_DIR's
    default and the per-Python/CUDA subdirectory. Creates the directory."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op_name, verbose=False))


def disable_deepspeed_op(name: str) -> None:
    """Mark a DeepSpeed op incompatible so that DeepSpeed never JIT-builds it in this process.

    deepspeed.ops.__compatible_ops__ (deepspeed/ops/__init__.py, 0.19.8; built lazily on first
    access) is what DeepSpeed's comm consults before loading its shared-memory all-reduce
    ("deepspeed_shm_comm"): on CPU that build costs ~35 s per process and gloo does the job.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[name] = False


# ---------------------------------------------------------------------------------------------
# Ray Train V2's elastic mode (ray 2.60.0). No public API chooses the scaling policy or reads the
# cluster the way raytrain's replacement timeout needs (raytrain.driver.elastic says why).


class ElasticPolicyBase(ElasticScalingPolicy):
    """Ray's ElasticScalingPolicy (ray/train/v2/_internal/execution/scaling_policy/elastic.py), with
    what raytrain's policy (raytrain.driver.elastic) uses of it by name, in one place. A subclass
    overrides `make_decision_for_non_running_worker_group` (Ray's hook, called by the controller
    while no group runs: start, restart, reschedule) with the helpers below, and `group_started`.
    Ray's running-group decision (a resize every elastic_resize_monitor_interval_s) is kept.
    """

    # Ray's own throttle of reservation queries (elastic.py: GET_RESERVED_RESOURCES_INTERVAL_S = 1)
    RESERVATION_INTERVAL_S = 1.0

    def group_started(self, num_workers: int) -> None:
        """A worker group of `num_workers` has started running."""

    def group_resizing(self, running: int, num_workers: int) -> None:
        """Ray's check of a running group (every elastic_resize_monitor_interval_s) restarts its `running`
        workers at `num_workers` (capacity returned)."""

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        """Ray's decision (elastic.py:194-245), kept; a resize it decides is told to `group_resizing` first:
        the controller then goes from Running to Resizing to Scheduling with it, and never asks
        `make_decision_for_non_running_worker_group` (controller.py:689-720)."""
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision):
            self.group_resizing(worker_group_state.num_workers, decision.num_workers)
        return decision

    def placeable_workers(self) -> int | None:
        """Workers the cluster can hold now (capped at the maximum), or None when the
        coordinator could not be asked (then decide nothing this round)."""
        reserved = self._get_reserved_resources()
        return None if reserved is None else self._count_possible_workers(reserved)

    def request_resources(self) -> None:
        """Renew the request for max workers with the AutoscalingCoordinator (and the autoscaler)."""
        self._maybe_send_resource_request()

    def start_group(self, num_workers: int):
        return self._get_resize_decision(num_workers)

    def no_decision(self):
        return NoopDecision()

    # -- overrides of Ray's private methods ------------------------------------------------

    def _get_reserved_resources(self):
        """Ray's reservation query (elastic.py:257-287), with recompute=True: the coordinator
        re-reads the cluster first instead of answering from its last tick (every 20 s,
        default_autoscaling_coordinator.py TICK_INTERVAL_S). Without it a node lost a moment ago
        still counts (the group is retried at the old size and waits for a placement group that
        cannot be placed), and a node that joined is seen up to 20 s late. Both paths use it:
        the non-running decisions and the running group's grow check."""
        import time

        import ray

        now = time.monotonic()
        if now - getattr(self, "_raytrain_reserved_at", float("-inf")) < self.RESERVATION_INTERVAL_S:
            return self._latest_reserved_resources
        try:
            reserved = ray.get(self._autoscaling_coordinator.get_reserved_resources.remote(
                self._requester_id, recompute=True), timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (Ray's own handling: log, decide nothing this round)
            logging.getLogger("ray.train").warning("raytrain: could not read the cluster's reserved resources",
                                                  exc_info=True)
            reserved = None
        self._raytrain_reserved_at, self._latest_reserved_resources = time.monotonic(), reserved
        return reserved

    def after_controller_state_update(self, previous_state, current_state) -> None:
        """ControllerCallback hook (ray/train/v2/_internal/execution/callback.py); the policy is
        the controller's first callback (controller.py:169-175). Scheduling -> Running: a group
        of the scheduled size started."""
        if isinstance(previous_state, SchedulingState) and isinstance(current_state, RunningState):
            self.group_started(previous_state.scaling_decision.num_workers)


def install_scaling_policy(factory) -> Callable[[], None]:
    """Make TorchTrainer.fit in this process build its scaling policy with `factory(scaling_config)`
    (None from the factory: Ray's own). Ray looks `create_scaling_policy` up in the trainer's module
    at fit() time (ray/train/v2/api/data_parallel_trainer.py:58 imports it, :182 calls it), and the
    policy object is pickled to the controller actor. Returns the undo."""
    import ray.train.v2.api.data_parallel_trainer as trainer_module

    stock = trainer_module.create_scaling_policy

    def create(scaling_config):
        return factory(scaling_config) or stock(scaling_config)

    trainer_module.create_scaling_policy = create

    def undo() -> None:
        trainer_module.create_scaling_policy = stock

    return undo


# Ray Train's environment variable for how long a worker group's placement group may stay pending
# (ray/train/v2/_internal/constants.py:45-46, default 60 s; read by WorkerGroup in the controller,
# worker_group.py:296-305, and propagated from the driver by get_env_vars_to_propagate). A public
# knob, but undocumented: raytrain's replacement timeout is built on it.
WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


# ---------------------------------------------------------------------------------------------
# DeepSpeed's universal checkpoint load and per-group optimizer settings (deepspeed 0.19.8).


def zero_basic_optimizer(engine):
    """The torch optimizer a ZeRO engine wraps (DeepSpeedZeroOptimizer_Stage3.optimizer, stage3.py),
    whose param_groups hold the hyperparameters the step reads."""
    return engine.optimizer.optimizer


# Keys a universal load must not bring back from the snapshot: the parameters (ZeRO's flat
# partitions, swapped in per step) and what the LR schedule drives.
_SCHEDULED_KEYS = ("params", "lr", "initial_lr")


def param_group_settings(engine) -> list[dict]:
    """Each optimizer group's settings but its parameters and scheduled LR (a snapshot)."""
    return [{k: v for k, v in g.items() if k not in _SCHEDULED_KEYS} for g in zero_basic_optimizer(engine).param_groups]


def repair_universal_load(engine, settings: list[dict]) -> None:
    """Undo two things DeepSpeed's universal load (load_hp_checkpoint_state_from_checkpoint_dir_stage3,
    stage3.py:3653-3691) does to the optimizer, both of which change the training from its first step:

    - it gives every param group group 0's hyperparameters ("Generally, the hyperparameters of
      each parameter should be the same", :3684-3691), so raytrain's no-decay group (biases,
      norms) would start decaying: `settings`, the snapshot taken before the load, is put back;
    - it hands every sub-group the same `step` tensor (`state[fp32_param]['step'] = state_step`,
      :3680), and torch's Adam increments it in place, once per sub-group per step: every group but
      the first then bias-corrects with a wrong step count (measured: the norms' update 5% off after
      one step, the loss 1e-3 off a fixed-size run after ten). Each sub-group gets its own copy.
    """
    optimizer = zero_basic_optimizer(engine)
    groups = optimizer.param_groups
    if len(groups) != len(settings):
        raise RuntimeError(f"the optimizer has {len(groups)} param groups after the universal load, "
                           f"{len(settings)} before")
    for group, saved in zip(groups, settings):
        group.update(saved)
    for state in optimizer.state.values():
        step = state.get("step")
        if hasattr(step, "clone"):
            state["step"] = step.clone()


def share_backup_optimizer_param_groups(zero_optimizer) -> bool:
    """Make the GPU side of a partial optimizer offload follow the LR schedule; True if there was one.

    DeepSpeed 0.19.8, runtime/zero/stage3.py:313-326: with `offload_optimizer.ratio < 1` the sub-groups
    that stay on the GPU are stepped by `self.backup_optimizer`, a torch AdamW built with a *copy* of
    the CPU optimizer's param_groups[0] hyper-parameters; groups 1+ are added with
    add_param_group(the CPU optimizer's own dict) and so are shared. Schedulers (raytrain's LambdaLR,
    or a JSON scheduler) update the CPU optimizer's groups only, so group 0 on the GPU stayed at the
    LR of construction (with raytrain's warmup: lr / warmup_steps, forever). Here every backup group
    becomes the CPU optimizer's dict, as groups 1+ already are, with AdamW's defaults (foreach,
    maximize, ...) added to it; `_optimizer_step` sets and clears ['params'] around each call, so a
    shared dict is safe. tests/unit/test_compat.py fails when DeepSpeed's construction changes.
    """
    backup = getattr(zero_optimizer, "backup_optimizer", None)
    if backup is None:
        return False
    groups = zero_optimizer.optimizer.param_groups
    if len(groups) != len(backup.param_groups):
        raise RuntimeError(f"DeepSpeed's backup optimizer has {len(backup.param_groups)} param groups for the "
                           f"CPU optimizer's {len(groups)}: its construction changed, re-check this workaround")
    for i, group in enumerate(groups):
        for key, value in backup.defaults.items():
            group.setdefault(key, value)
        backup.param_groups[i] = group  # its params list is DeepSpeed's (empty between steps), not the dummy's
    return True


def skip_host_overflow_scan(zero_optimizer) -> bool:
    """fp16 with optimizer offload: drop DeepSpeed's inf/nan scan of the host gradient buffer, whose
    finding the same step() makes again on the accelerator; True if it was dropped.

    DeepSpeed 0.19.8, runtime/zero/stage3.py: with fp16, step() first calls has_overflow(), which runs
    torch.isinf(...).any() and torch.isnan(...).any() over `grad_partitions_flat_buffer`, on the CPU
    when the optimizer is offloaded (every gradient element, twice, in host memory). Then, with no
    overflow found, it takes the gradient norm from `norm_for_param_grads`, which
    `_offload_grad_partition_at_boundary` computed on the accelerator (in fp64, so finite gradients never
    make it inf) from the very buffers the scan reads, all-reduces it over the ranks, and sets
    `self.overflow = True` when it is inf or nan (`is_invalid_grad_norm`): the same step is skipped, the
    loss scale lowered the same way. The scan only decides earlier, and before Muon (the raw gradients
    must be checked before Muon's update replaces them: not dropped then), and ZenFlow has its own step.
    Measured on an H200 host, 1.1B, 14 CPU Adam threads (docs/benchmarks.md): optimizer step 1.76 s with
    the scan, 0.78 s without (bf16, which never scans, 0.84 s); fp16 went from 78% to 99.7% of bf16's tokens/s.
    tests/unit/test_compat.py pins that order in step(); tests/unit/worker/test_engine_offload.py runs
    an fp16 overflow through it on real DeepSpeed (and benchmarks/gpu_checks.py on a GPU).
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    import torch

    if (not isinstance(zero_optimizer, DeepSpeedZeroOptimizer_Stage3) or not zero_optimizer.offload_optimizer
            or zero_optimizer.dtype != torch.float16 or zero_optimizer.use_muon or zero_optimizer.zenflow):
        return False
    scan = zero_optimizer.has_overflow  # the bound method: the un-partitioned path still uses it

    def has_overflow(partition_gradients=True):
        return False if partition_gradients else scan(partition_gradients)

    zero_optimizer.has_overflow = has_overflow  # this instance only: restore_host_overflow_scan removes it
    return True


def host_overflow_scan_dropped(zero_optimizer) -> bool:
    """Whether skip_host_overflow_scan replaced this optimizer's has_overflow."""
    return "has_overflow" in vars(zero_optimizer)


def restore_host_overflow_scan(zero_optimizer) -> None:
    """DeepSpeed's own has_overflow again (the class's method), for the comparisons that measure the scan."""
    vars(zero_optimizer).pop("has_overflow", None)


def parse_deepspeed_config(param_dict, world_size: int):
    """DeepSpeed's own parsing and checks of a config dict, for `world_size` ranks, on the driver.

    DeepSpeedConfig (deepspeed/runtime/config.py, 0.19.8) takes no world size: its __init__ asks
    deepspeed.comm, and without a process group (the driver has none) falls back to 1, so its batch
    assertion would check train_batch_size against one rank. This builds the object as __init__
    does after that point, in the same order: _reject_removed_config_keys, _initialize_params (every
    section's parsing: the pydantic models of zero_optimization, bf16, fp16, compile, ...),
    _configure_train_batch_size (DeepSpeed's batch rule and assertion) and _do_sanity_check.
    `param_dict` may be any dict subclass (raytrain.planning.deepspeed_check records the reads).
    Costs the deepspeed import (~2 s, once per process) and a few milliseconds.
    """
    deepspeed_config = import_deepspeed_quietly().runtime.config
    config = deepspeed_config.DeepSpeedConfig.__new__(deepspeed_config.DeepSpeedConfig)
    config._param_dict = param_dict
    config.global_rank, config.world_size = 0, world_size
    deepspeed_config._reject_removed_config_keys(param_dict)
    config._initialize_params(param_dict)
    config._configure_train_batch_size()
    config._do_sanity_check()
    return config


def import_deepspeed_quietly():
    """`import deepspeed` on the driver without its accelerator guess on stdout.

    Importing deepspeed picks an accelerator and, on a machine without a GPU (a laptop planning a
    GPU cluster), logs "Setting accelerator to CPU. If you have GPU ..." through its "DeepSpeed"
    logger, whose handler writes to stdout (deepspeed/utils/logging.py, accelerator/
    real_accelerator.py, 0.19.8): that line would land in `--dry-run`'s JSON. The driver only
    parses configs with it; the workers pick their own accelerator. Other messages pass."""
    import sys

    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]

    def not_the_guess(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")

    logger = logging.getLogger("DeepSpeed")  # the object deepspeed's LoggerFactory configures
    logger.addFilter(not_the_guess)
    try:
        deepspeed = import_deepspeed_without_mlflow()
        importlib.import_module("deepspeed.runtime.config")
    finally:
        logger.removeFilter(not_the_guess)
    return deepspeed


def import_deepspeed_without_mlflow():
    """`import deepspeed`, without the `import mlflow` it makes on the way.

    deepspeed/autotuning/autotuner.py (0.19.8) imports mlflow at module level when it is installed
    (`has_mlflow`, for the autotuner's own logging), and `import deepspeed` imports the autotuner:
    measured 1.4-1.8 CPU-s of a 3.7-4.2 s import on 2 cores, paid by the driver and by every worker at
    every start and restart. raytrain never runs DeepSpeed's autotuner; its own MLflow tracking
    (rank 0, tracking.mlflow_tracking_uri) imports mlflow itself, later, normally. `import mlflow`
    fails only during this import (sys.modules holds None for it); where mlflow is already imported
    nothing changes. tests/unit/test_compat.py pins `has_mlflow`."""
    import sys

    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    blocked = "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # the import system's "not importable" marker
    try:
        import deepspeed
    finally:
        if blocked and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed
