"""How the driver runs `trainer.fit()` so that it can stop it: Ctrl-C and bad records in the data.

Start at `run_trainer`. `trainer.fit()` runs in a thread of the driver and the main thread waits
for it, so Ctrl-C reaches raytrain's code rather than Ray Train's SIGINT handler (which Ray Train
installs only when fit() runs in the main thread). Either way the run is stopped the same way, by
Ray Train's own abort of the run's controller (raytrain.compat.abort_train_run: the workers are
killed, never restarted); the controller's handle reaches the run's counter
(raytrain.data.progress.Counter) as the controller starts (`watch_run`).

- Ctrl-C: the driver aborts the run, then raises `Interrupted`: `raytrain.main` prints one line
  with the step reached, the latest checkpoint and the command that continues, and exits 130.
- A bad record (raytrain.data.bad_records): the counter aborts the run itself, the moment the first
  task reports one; the driver raises it, with the count of the others found meanwhile: one line,
  exit 2, never a retried worker failure. Meanwhile the driver does not print what the dying
  workers and tasks print; it does again once the run has ended (a notebook's next fit()).

On the controller, `RunWatch` (a Ray Train UserCallback) says in one raytrain line when a worker
failure is retried, or a preemption (which Ray Train does not count against max_failures); Ray Train's own
decision line is INFO, which raytrain's logging config leaves out of the console.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import ray.train
from ray.exceptions import GetTimeoutError

from raytrain import compat
from raytrain.checkpoint import layout
from raytrain.config import ConfigError
from raytrain.console import emit, say
from raytrain.data.progress import DataProgress, RunSummary


def stopped_by_bad_record(progress: DataProgress, timeout_s: float = 60) -> bool:
    """The driver's poll of the counter, every 0.5 s while the run trains: whether a bad record has stopped
    the run. A counter that does not answer in time (a starved machine: a 2-core CI box under load left it
    silent for over 60 s) counts as "not yet": the poll only decides when to quiet the workers' logs, and
    the run's outcome, the bad record included, is read from the counter once fit() returns."""
    try:
        return progress.stopped_by_bad_record(timeout_s=timeout_s)
    except GetTimeoutError:
        return False


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped the run; its controller and workers are gone. str(): the line to print;
    `exit_code`: the shell's for the signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, step: int | None, max_steps: int, checkpoint: str | None, command: str,
                 signum: int = signal.SIGINT, unregistered: str | None = None):
        self.step, self.checkpoint, self.command = step, checkpoint, command
        self.exit_code = 128 + int(signum)
        reached, latest = _where(step, max_steps, checkpoint)
        by = " by SIGTERM" if signum == signal.SIGTERM else ""
        # a newer save, whole in storage, that Ray Train never took: the command would not continue from it. The
        # command stays the line's end, where a user (or a script) takes it from.
        newer = (f"; {unregistered} is complete in storage but Ray Train had not registered it (its workers were "
                 f"stopped first): --resume-from it with a new checkpoint.name to continue from there instead"
                 if unregistered else "")
        super().__init__(f"interrupted{by} {reached}; {latest}{newer}; to continue: {command}")


def _where(step: int | None, max_steps: int, checkpoint: str | None) -> tuple[str, str]:
    """A stopped run's step and latest checkpoint, in the words of its stop line (Interrupted, RunFailed)."""
    return (f"at step {step} of {max_steps}" if step is not None else "before its first step was reported",
            f"latest checkpoint {checkpoint}" if checkpoint else "no checkpoint yet")


class ExportInterrupted(Exception):
    """Ctrl-C (or SIGTERM) during the export at the end of a finished run (minutes for a large model): str() the line
    to print, with the command that exports the checkpoint; the export leaves nothing in its directory."""

    def __init__(self, step: int, checkpoint: str, export_dir: str, signum: int = signal.SIGINT):
        self.exit_code = 128 + int(signum)
        by = " by SIGTERM" if signum == signal.SIGTERM else ""
        super().__init__(f"interrupted{by} while exporting to {export_dir} (nothing left there); the run is done at "
                         f"step {step}, checkpoint {checkpoint}; to export it: "
                         f"{shlex.join(['python', '-m', 'raytrain.tools.export', checkpoint, export_dir])}")


class RunFailed(Exception):
    """Ray Train gave up on the run: a worker failure past checkpoint.max_failures, or its controller failed
    (ray.train.TrainingFailedError). str(): the line to print, with the step reached, the run's latest checkpoint
    (kept) and the command that continues from it; main exits 1. Without it the command ended on Ray Train's
    WorkerGroupError traceback (~40 lines, after the workers' own, which Ray Train logs) and never said that
    the checkpoint was there or how to go on from it. The original error is its __cause__ (raytrain.fit())."""

    def __init__(self, error: BaseException, step: int | None, max_steps: int, max_failures: int,
                 checkpoint: str | None, command: str):
        if isinstance(error, ray.train.WorkerGroupError) and error.worker_failures:
            rank = min(error.worker_failures)
            failure = error.worker_failures[rank]
            why = (f"worker failure past checkpoint.max_failures={max_failures} on rank {rank}: "
                   f"{type(failure).__name__}: {last_line(failure)}")
        else:
            cause = getattr(error, "controller_failure", None) or error
            why = f"{type(cause).__name__}: {last_line(cause)}"
        reached, latest = _where(step, max_steps, checkpoint)
        super().__init__(f"the run failed {reached} ({why}; the tracebacks are above); {latest}; to continue "
                         f"{'from it' if checkpoint else 'it'}: {command}")


def last_line(error: BaseException) -> str:
    """The last line of `error`'s message, cut at 300 characters ("..." says so): where a worker's traceback ends."""
    line = (str(error).strip().splitlines() or [""])[-1]
    return line if len(line) <= 300 else line[:300] + "..."


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread to take Ctrl-C's path (`signals_stop_the_run`); main exits 143 for it."""


@contextlib.contextmanager
def signals_stop_the_run():
    """While the block runs, Ctrl-C raises KeyboardInterrupt and SIGTERM (`kill`, `timeout`, a batch scheduler's or
    Kubernetes' stop) raises Terminated, one of its kind: the run aborted through Ray Train, one line with the
    continue command, exit 130 or 143.
    - SIGTERM: without this, Ray's driver core handles it (installed at ray.init): a 6-line "*** SIGTERM received"
      stack dump, exit 134, no line of raytrain's. Ray's C++ handler is not a Python one, so the block ends with
      SIGTERM's default (terminate) in its place.
    - Ctrl-C: Python's own handler, which a plain Ray Train fit() run earlier in this process's main thread (a
      notebook's cell, a test) replaced for good with one bound to that run's controller (ray 2.60's
      DataParallelTrainer._register_sigint_handler never restores the old one): Ctrl-C then tried to abort that
      dead controller and raised "Can't find actor ..." out of the wait, and this run trained on. The caller's
      handler is restored after the block.
    Only in the main thread, where Python runs signal handlers (a notebook's fit() runs there too)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class _Stopping:
    """While the driver stops a run after Ctrl-C (or SIGTERM). Users press Ctrl-C again when the first does not end
    the command at once; that second KeyboardInterrupt escaped the stop: main printed "interrupted before training
    started", without the step or the command that continues, and a third one broke Ray's shutdown at exit with a
    traceback. Now a further Ctrl-C only sets `hurried`: the stop's waits (for Ray Train's abort, up to 2 minutes
    while the controller winds down; what is left goes with this process's Ray at exit) end at their next 0.5 s
    slice, and the line with the continue command is always said. The handler raises nothing: an exception raised
    while Ray's C code waits came out as "SystemError: ... returned a result with an exception set". Main thread
    only (where Python runs handlers)."""

    def __enter__(self) -> "_Stopping":
        self.hurried = False
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            self._previous = signal.signal(signal.SIGINT, self._again)
        return self

    def __exit__(self, *exc) -> None:
        if self._main:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)

    def _again(self, signum, frame) -> None:
        self.hurried = True


def callbacks(progress: DataProgress, max_failures: int) -> list:
    """RunConfig(callbacks=...) of a run whose counter is `progress`."""
    return [compat.OnControllerStart(functools.partial(watch_run, progress.name)),
            compat.OneLineAutoscalingWarning(), RunWatch(max_failures)]


def watch_run(counter: str, controller) -> None:
    """In the controller's process, as it starts: the counter keeps the controller to stop it."""
    ray.get_actor(counter).watch_run.remote(controller)


class RunWatch(ray.train.UserCallback):
    """Ray Train calls this on the run's controller after each worker failure."""

    def __init__(self, max_failures: int):
        self._max_failures, self._failures, self._preemptions = max_failures, 0, 0
        self._preempted_actors: set[str] = set()

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        restart = "Ray Train restarts the workers from the latest checkpoint"
        preempted = [rank for rank, e in worker_exceptions.items() if compat.preempted(e)]
        if preempted:  # Ray Train's rule: any preempted worker makes the group's failure a preemption
            # Once per group: Ray Train calls this after every poll that sees errors, and while it waits out a
            # preemption's grace window (its PreemptingState, ray 2.60) each poll sees the dead workers again, and
            # more of them as they die (other ranks of the node, another node), but restarts, and charges its
            # max_preemption_failures, once. A poll with a dead worker already said is that group's; a restarted
            # group's workers are new actors (Ray Train's workers are never restarted in place).
            actors = {compat.dead_actor_id(worker_exceptions[rank]) for rank in preempted} - {None}
            said = bool(actors & self._preempted_actors)
            self._preempted_actors |= actors
            if said:
                return
            self._preemptions += 1  # raytrain sets no max_preemption_failures: Ray's default, no limit
            emit(f"raytrain: preemption {self._preemptions} (not counted against checkpoint.max_failures): "
                 f"rank {min(preempted)}'s node was preempted; {restart}")
            return
        self._failures += 1
        rank = min(worker_exceptions)
        error = last_line(worker_exceptions[rank])  # a worker's traceback (logged above by Ray Train) ends there
        limit = self._max_failures
        then = restart if limit < 0 or self._failures <= limit else "the run fails"
        emit(f"raytrain: worker failure {self._failures} (checkpoint.max_failures={limit}) on rank {rank}: "
             f"{type(worker_exceptions[rank]).__name__}: {error}; {then}")


LATE_OUTPUT_S = 10.0
"""How long the driver keeps its workers' output unprinted after a run that a bad record or Ctrl-C stopped has ended.
Ray kills the run's Ray Data tasks as it ends, and a task killed inside a finalizer printed `Exception ignored
in ... KeyboardInterrupt` with a traceback that reached the driver after fit() had returned, so after the
user's one-line error (session 43's suite: printing had been put back as fit() returned). A command line has
exited by then; a notebook's next fit() prints again at once."""

_silenced: list[Callable[[], None]] = []  # the undo of a stopped run's compat.stop_printing_worker_logs, until called


def print_worker_output_again() -> None:
    """Undo the last stopped run's silence, once (the timer and the next run both call this)."""
    while True:
        try:
            undo = _silenced.pop()
        except IndexError:
            return
        undo()


def run_trainer(trainer, progress: DataProgress, run_uri: str, max_steps: int, command: str, max_failures: int = 0):
    """trainer.fit()'s Result, or raise: the run's first bad record, `Interrupted` (Ctrl-C), `RunFailed`
    (Ray Train gave up: past `max_failures`, checkpoint.max_failures), or whatever else fit() raised. Inside
    `with progress:`; says what the data policies skipped."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # handed to the main thread
            outcome["error"] = e

    print_worker_output_again()  # a notebook's next fit() after a stopped one prints its workers' lines
    thread = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
    thread.start()
    printing_back = None  # set once the workers' output is no longer printed: the undo, whatever way the run ends
    try:
        try:
            with signals_stop_the_run():
                while thread.is_alive():
                    thread.join(timeout=0.5)  # a timed wait: Ctrl-C interrupts it at once
                    if printing_back is None and stopped_by_bad_record(progress):
                        # The counter has stopped the run; what its workers and tasks print while Ray kills
                        # them is consequence, not news (a task killed in a finalizer prints a traceback): the
                        # user's one line is the error. One actor call per 0.5 s until then.
                        printing_back = compat.stop_printing_worker_logs()
        except KeyboardInterrupt as e:
            with _Stopping() as stopping:  # an impatient second Ctrl-C hurries the stop, never loses its line
                # Ctrl-C in a terminal signals every process of the foreground group, Ray's workers too: what they
                # print as they die is consequence, not news (a Ray Data task's worker aborted on a corrupt absl
                # mutex, 15 lines of stack dump before raytrain's one line, in one .ci/run under load).
                if printing_back is None:
                    printing_back = compat.stop_printing_worker_logs()
                saved = _await_registration(run_uri, hurried=lambda: stopping.hurried)
                # Once aborted, fit() returns within seconds; without a controller yet, this process's end
                # takes the run with it (its actors are this driver's).
                deadline = time.monotonic() + (120 if _abort(progress, hurried=lambda: stopping.hurried) else 0)
                while thread.is_alive() and not stopping.hurried and time.monotonic() < deadline:
                    thread.join(timeout=0.5)
                summary = progress.summary()
                _say_skipped(summary)
                latest = layout.latest_checkpoint_uri(run_uri)
            raise Interrupted(summary.step, max_steps, latest, command,
                              signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT,
                              unregistered=saved if saved and _step_of(saved) > _step_of(latest) else None) from None
        summary = progress.summary()
        if summary.bad_record is not None:
            raise summary.bad_record  # the counter stopped the run: whatever fit() says is its consequence
        _say_skipped(summary)
        error = outcome.get("error")
        if isinstance(error, ray.train.TrainingFailedError):  # the run's checkpoints are kept: say how to go on
            raise RunFailed(error, summary.step, max_steps, max_failures, layout.latest_checkpoint_uri(run_uri),
                            command) from error
        if error is not None:
            raise error
        return outcome["result"]
    finally:
        if printing_back is not None:  # printed again LATE_OUTPUT_S from now, or when this process runs again
            _silenced.append(printing_back)
            timer = threading.Timer(LATE_OUTPUT_S, print_worker_output_again)
            timer.daemon = True  # a command line's exit does not wait for it
            timer.start()


def continue_command(argv: Sequence[str] | None, run_name: str, resume_from: str | None = None) -> str:
    """The command that continues run `run_name`: `argv` without --fresh (it would set the run
    aside), with checkpoint.name, and with the checkpoint the run was started from (`resume_from`,
    as the driver normalised it) in place of the user's spelling of it. The run's own latest
    checkpoint wins once it has one (raytrain.driver.run); before its first, dropping resume_from
    would start the model from scratch."""
    if argv is None:  # raytrain.fit() from Python: its config still holds resume_from
        return f"the same config with checkpoint.name={run_name}"
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--resume-from":
            skip_next = True
        elif arg != "--fresh" and not arg.startswith(("--resume-from=", "checkpoint.name=", "checkpoint.resume_from=")):
            kept.append(arg)
    resume = ["--resume-from", resume_from] if resume_from else []
    return shlex.join(["python", "-m", "raytrain.main", *kept, *resume, f"checkpoint.name={run_name}"])


def _await_registration(run_uri: str, hurried: Callable[[], bool]) -> str | None:
    """Before Ctrl-C's abort: the newest complete checkpoint of the run in storage (a URI, or None), waited for
    until Ray Train has registered it, up to two of its controller's polls. A worker's ray.train.report uploads
    the checkpoint first and then queues the report, which the controller takes at its next poll (every 2 s;
    a queued metrics report ahead of it costs one more): an abort inside that window dropped a checkpoint
    already whole in storage, and the run continued from the one before (a whole checkpoint interval lost;
    seen at Ctrl-C as "checkpoint step 6" printed: "latest checkpoint .../checkpoint_step_00000003"). Where
    the workers are gone already (Ctrl-C in the terminal of raytrain's own local cluster signals them too)
    the report is lost with them: the wait ends at its limit and Interrupted names the checkpoint. Costs a
    listing and the newest checkpoint's checks (layout.latest_complete_checkpoint), then reads of Ray
    Train's record every 0.5 s while it waits."""
    try:
        newest = layout.latest_complete_checkpoint(run_uri)
        if newest is None:
            return None
        deadline = time.monotonic() + 2 * compat.ray_train_poll_interval_s() + 1.0
        while (not hurried() and _step_of(layout.latest_checkpoint_uri(run_uri)) < _step_of(newest)
               and time.monotonic() < deadline):
            time.sleep(0.5)
        return newest
    except ConfigError:  # storage unreachable, a broken record: the line after the abort says so, as before
        return None


def _step_of(checkpoint: str | None) -> int:
    """The step of a checkpoint_step_* URI; -1 for None."""
    return -1 if checkpoint is None else int(checkpoint.rstrip("/").rsplit("_", 1)[-1])


ABORT_WAIT_S = 15.0
"""How long Ctrl-C waits for Ray Train's own abort (it kills the workers in about a second) before killing the
run's controller."""


def _abort(progress: DataProgress, wait_s: float = 10.0, hurried: Callable[[], bool] = lambda: False) -> bool:
    """Stop the run through its controller (it kills the workers), once it has said where it is;
    False when it has not within `wait_s` (Ctrl-C while Ray Train starts), or when `hurried` (a second Ctrl-C)
    ends the wait first."""
    deadline = time.monotonic() + wait_s
    controller = None
    while controller is None and time.monotonic() < deadline and not hurried():  # Ctrl-C while it starts
        try:
            controller = _get(progress.actor.controller.remote(), wait_s, hurried)
        except GetTimeoutError:
            return False
        if controller is None:
            time.sleep(0.2)
    if controller is None:
        return False
    try:
        _get(compat.abort_train_run(controller), ABORT_WAIT_S, hurried)
    except ray.exceptions.RayActorError:
        pass  # the controller ended itself: the abort's normal end
    except ray.exceptions.GetTimeoutError:
        # The controller never runs abort() while it waits for its workers' placement group (a run waiting
        # for resources: an autoscaler's node, CPUs held by another job). Its loop awaits steps that do
        # not suspend while it schedules, so the abort waits for the whole wait, and Ray Train retries
        # that wait every 60 s (ray 2.60.0's TrainController.run; measured: not run after 120 s; Ray's
        # own SIGINT handler waits the same; ray-project/ray#54181, which made the wait abortable, was
        # closed unmerged). Killed instead, its workers go with it; what that skips is
        # Ray Train's record of the run as aborted (the dashboard shows it failed) and callbacks' abort
        # hooks, which raytrain does not use. Its placement group belongs to this driver's job, not to
        # the controller: left, it would stay pending and take the CPUs when they free up, from a
        # notebook's next fit(). Removed here, the groups the controller created.
        ray.kill(controller, no_restart=True)
        compat.remove_placement_groups_of(controller)
    return True


def _get(ref, timeout_s: float, hurried: Callable[[], bool]):
    """ray.get(ref, timeout=timeout_s), waited for in 0.5 s slices that `hurried` can end early (GetTimeoutError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _ = ray.wait([ref], timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        if ready:
            return ray.get(ready[0])
        if hurried() or time.monotonic() >= deadline:
            raise GetTimeoutError(f"not ready in {timeout_s:g} s")


def _say_skipped(summary: RunSummary) -> None:
    line = summary.skipped_line()
    if line:
        say(line)
