"""Elastic runs (scaling.num_workers: [min, max]): raytrain's scaling policy for Ray Train's controller.

Ray Train V2 resizes an elastic worker group itself (ScalingConfig(num_workers=(min, max))): while
no group runs it starts one of as many workers as the cluster can place (at least min), and a
running group is resized every elastic_resize_monitor_interval_s (raytrain's
scaling.resize_interval_s) when that number changes. Every resize is a full restart from the latest
checkpoint; the workers re-partition it (raytrain.checkpoint.reshard) and each group reads the
DeepSpeed plan of its own size (RunSpec.at_world_size).

What Ray 2.60 lacks, and `ReplacementPolicy` adds (docs/elastic-research.md §1.3, §2.5):

- A replacement timeout. After a node loss Ray restarts at whatever it can place at once, and what
  looked like a wait was an accident of a stale view of the cluster (60 s of the 83 s from loss to
  training, measured). Here, after a failure the group is retried once at its previous size: its
  placement group waits up to scaling.replacement_timeout_s for a replacement node (Ray's
  RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), and if none comes, Ray's retryable startup timeout
  leads to the next decision, which continues on what the cluster holds. A replacement in time
  means one restart at the old size instead of a shrink and a grow (two restarts, two conversions).
- A fresh view of the cluster for every decision (compat.ElasticPolicyBase: recompute=True), so
  a lost node is not counted and a returned one is seen at the next check.
- No busy loop below the minimum: the controller calls the decision again at once, with no await
  on that path, when it decides nothing (measured: 50% of a core); here it pauses 0.5 s.

This runs in Ray Train's controller actor (on the driver's node): the policy object is built in
the driver's `fit` and pickled there.

What a node loss costs against checkpoint.max_failures is Ray's rule, kept (README "Elastic
training"): a node lost without notice fails the group (a WorkerGroupError, one of max_failures);
a drained node (a preemption notice) counts against Ray's max_preemption_failures (unlimited by
default); a grow and a placement-group timeout count against neither.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from raytrain import compat
from raytrain.console import emit
from raytrain.run_spec import RunSpec

# The shortest wait a placement group gets: Ray's wait with a timeout of 0 fails even with the
# resources free (the group is created asynchronously), so "shrink at once" still waits this long
# when Ray tries a size whose node just went away.
MIN_PLACEMENT_WAIT_S = 5.0
IDLE_PAUSE_S = 0.5


def placement_wait_s(replacement_timeout_s: float) -> float:
    """How long a worker group's placement group waits (`policy_installed` sets it; the policy's line says it)."""
    return max(replacement_timeout_s, MIN_PLACEMENT_WAIT_S)


def next_group_size(placeable: int, min_workers: int, previous: int | None, retried: bool,
                    wait_for_replacement: bool) -> tuple[int | None, bool]:
    """(size of the group to start, or None to wait; whether the retry at the previous size is used).

    `previous`: the size of the last group that ran (None before the first); `retried`: the one
    retry at that size since it stopped has been made. Any attempt at >= the previous size counts
    as that retry: right after a loss Ray's view may still count the lost node, and that attempt
    waits for a replacement already (its placement group cannot be placed without one).
    """
    if previous is not None and not retried and placeable < previous and wait_for_replacement:
        return previous, True
    if placeable < min_workers:
        return None, retried
    return placeable, retried or (previous is not None and placeable >= previous)


class ReplacementPolicy(compat.ElasticPolicyBase):
    """Ray's elastic policy with a replacement timeout; see the module docstring."""

    def __init__(self, scaling_config, replacement_timeout_s: float):
        super().__init__(scaling_config)
        self.replacement_timeout_s = replacement_timeout_s
        self._previous: int | None = None
        self._retried = False

    def group_started(self, num_workers: int) -> None:
        self._previous, self._retried = num_workers, False

    def group_resizing(self, running: int, num_workers: int) -> None:
        # A grow stops a healthy group and discards its steps since the latest checkpoint: said as a shrink is
        # (Ray's own line is INFO, below the run's LoggingConfig level).
        emit(f"raytrain: resizing from {running} to {num_workers} workers (range {self.scaling_config.min_workers}-"
             f"{self.scaling_config.max_workers}): every worker restarts from the latest checkpoint")

    def make_decision_for_non_running_worker_group(self):
        self.request_resources()
        placeable = self.placeable_workers()
        if placeable is None:
            time.sleep(IDLE_PAUSE_S)
            return self.no_decision()
        size, self._retried = next_group_size(placeable, self.scaling_config.min_workers, self._previous,
                                              self._retried, self.replacement_timeout_s > 0)
        if size is None:
            # Blocks the controller's event loop on purpose: this path has no await, and it would
            # otherwise be called again at once, forever, until capacity returns.
            time.sleep(IDLE_PAUSE_S)
            return self.no_decision()
        if self._previous is not None and size == self._previous and placeable < size:
            emit(f"raytrain: {placeable} of {size} workers can be placed now: waiting up to "
                 f"{placement_wait_s(self.replacement_timeout_s):g} s (scaling.replacement_timeout_s="
                 f"{self.replacement_timeout_s:g}) for a replacement")
        elif self._previous is not None and size != self._previous:
            emit(f"raytrain: resizing from {self._previous} to {size} workers (the cluster holds {placeable}, "
                 f"range {self.scaling_config.min_workers}-{self.scaling_config.max_workers})")
        return self.start_group(size)


@contextlib.contextmanager
def policy_installed(spec: RunSpec) -> Iterator[None]:
    """While a `TorchTrainer.fit` of `spec` runs in this process: raytrain's policy for elastic
    runs, and the placement group wait set to the replacement timeout. Both undone afterwards
    (a notebook may fit again, with another config)."""
    if not spec.cluster.elastic:
        yield
        return
    timeout = spec.config.scaling.replacement_timeout_s
    undo = compat.install_scaling_policy(
        lambda scaling_config: ReplacementPolicy(scaling_config, timeout) if scaling_config.elasticity_enabled else None)
    key = compat.WORKER_GROUP_START_TIMEOUT_ENV
    before = os.environ.get(key)
    # Also bounds every other group start (the first, a grow), whose nodes are there: a few seconds.
    os.environ[key] = str(placement_wait_s(timeout))
    try:
        yield
    finally:
        undo()
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
