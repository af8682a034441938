"""How the driver stops a run and what it says (raytrain.driver.watch): the command that continues a
run, the Ctrl-C line, the worker-failure line. The stops themselves (Ctrl-C, a bad record) run for
real in tests/integration/test_quickstart.py and test_user_path.py."""

import json
import os
import shlex
import signal
import threading
import time

import pytest

from raytrain.checkpoint import layout
from raytrain.driver.watch import Interrupted, RunWatch, Terminated, _Stopping, continue_command, signals_stop_the_run


def test_the_continue_command_is_the_users_argv_with_the_run_name_and_nothing_that_restarts():
    argv = ["--config", "my run.yaml", "--fresh", "training.max_steps=20", "--resume-from", "r/ckpt",
            "checkpoint.name=old", "checkpoint.resume_from=/x", "--resume-from=/y", "data.path=/d"]
    command = continue_command(argv, "raytrain-20261201-094250")
    # --fresh would set the run aside
    assert shlex.split(command) == ["python", "-m", "raytrain.main", "--config", "my run.yaml",
                                    "training.max_steps=20", "data.path=/d", "checkpoint.name=raytrain-20261201-094250"]
    # a run started from a checkpoint keeps it, as the driver resolved it (absolute): stopped before its
    # own first checkpoint, the run must start from it again, not from scratch
    command = continue_command(argv, "ft", "/abs/r/ckpt dir")
    assert shlex.split(command) == ["python", "-m", "raytrain.main", "--config", "my run.yaml", "training.max_steps=20",
                                    "data.path=/d", "--resume-from", "/abs/r/ckpt dir", "checkpoint.name=ft"]
    assert continue_command([], "r") == "python -m raytrain.main checkpoint.name=r"
    assert continue_command(None, "r") == "the same config with checkpoint.name=r"  # raytrain.fit() from Python


def test_the_ctrl_c_line_names_the_step_the_checkpoint_and_the_command():
    assert str(Interrupted(12, 80, "/runs/r/checkpoint_step_00000010", "python -m raytrain.main checkpoint.name=r")) == (
        "interrupted at step 12 of 80; latest checkpoint /runs/r/checkpoint_step_00000010; "
        "to continue: python -m raytrain.main checkpoint.name=r")
    assert str(Interrupted(None, 80, None, "C")) == (
        "interrupted before its first step was reported; no checkpoint yet; to continue: C")


@pytest.mark.parametrize("signum, by, exit_code", [(signal.SIGINT, "", 130), (signal.SIGTERM, " by SIGTERM", 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_the_stop_line_says_which_signal_and_exits_with_the_shells_code_for_it(signum, by, exit_code):
    e = Interrupted(3, 80, None, "C", signum)
    assert str(e) == f"interrupted{by} at step 3 of 80; no checkpoint yet; to continue: C"
    assert e.exit_code == exit_code


def test_a_worker_failure_is_one_raytrain_line_saying_what_happens_next(capfd):
    watch = RunWatch(max_failures=1)
    watch.after_exception(None, {1: RuntimeError("first line\nthe error itself")})
    watch.after_exception(None, {0: ValueError("again")})
    lines = capfd.readouterr().out.splitlines()
    assert lines == ["raytrain: worker failure 1 (checkpoint.max_failures=1) on rank 1: RuntimeError: the error itself; "
                     "Ray Train restarts the workers from the latest checkpoint",
                     "raytrain: worker failure 2 (checkpoint.max_failures=1) on rank 0: ValueError: again; "
                     "the run fails"]


@pytest.mark.parametrize("max_failures, then", [
    (0, ["the run fails"] * 2),
    (-1, ["Ray Train restarts the workers from the latest checkpoint"] * 2),  # no limit
])
def test_the_failure_line_follows_the_limit_of_failures(max_failures, then, capfd):
    watch = RunWatch(max_failures)
    for _ in then:
        watch.after_exception(None, {0: RuntimeError("boom")})
    assert [line.rsplit("; ", 1)[1] for line in capfd.readouterr().out.splitlines()] == then


def test_the_failure_line_names_the_lowest_failed_rank_and_stays_short(capfd):
    """Several workers fail at once: the line is about rank 0's failure; a huge last line of an error is cut, and
    says so (a cut mid-sentence read as the whole message)."""
    RunWatch(max_failures=3).after_exception(None, {2: ValueError("other"), 0: OSError("x" * 1000),
                                                    1: KeyError("k")})
    assert capfd.readouterr().out == ("raytrain: worker failure 1 (checkpoint.max_failures=3) on rank 0: OSError: "
                                      f"{'x' * 300}...; Ray Train restarts the workers from the latest checkpoint\n")


def test_a_preemption_is_not_counted_as_a_worker_failure(capfd):
    """Ray Train charges a group failure in which any worker was preempted to max_preemption_failures (no limit by
    default), not max_failures: the line said "worker failure 1 ... the run fails" while Ray restarted it."""
    from ray.exceptions import RayActorError

    watch = RunWatch(max_failures=0)
    watch.after_exception(None, {1: RayActorError(), 2: RayActorError(preempted=True), 3: RuntimeError("gloo")})
    watch.after_exception(None, {0: RuntimeError("boom")})
    assert capfd.readouterr().out.splitlines() == [
        "raytrain: preemption 1 (not counted against checkpoint.max_failures): rank 2's node was preempted; "
        "Ray Train restarts the workers from the latest checkpoint",
        "raytrain: worker failure 1 (checkpoint.max_failures=0) on rank 0: RuntimeError: boom; the run fails"]


def test_a_preemption_is_said_once_however_many_polls_see_it(capfd):
    """Ray Train calls after_exception after every poll that sees errors; while it waits out a preemption's grace
    window each poll sees the same dead worker, and more as they die. One line for it (Ray restarts once); a later
    group's preemption is a second."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    def dead(actor_id):  # as a poll reports a preempted worker: a fresh error each time
        return WorkerHealthCheckFailedError("health check failed", RayActorError(actor_id=actor_id, preempted=True))

    watch = RunWatch(max_failures=0)
    for _ in range(3):
        watch.after_exception(None, {1: dead("a1"), 0: RuntimeError("gloo")})
    watch.after_exception(None, {1: dead("a1"), 2: dead("a2")})  # another rank dead in the same window
    watch.after_exception(None, {2: dead("a2")})
    watch.after_exception(None, {0: dead("b0")})  # the next group's
    said = capfd.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in said] == [f"raytrain: preemption {n}" for n in (1, 2)], said
    assert [line.split("): ")[1].split(";")[0] for line in said] == [f"rank {r}'s node was preempted" for r in (1, 0)]


def test_a_stopped_runs_silence_is_undone_once_whoever_ends_it_first():
    """After a bad record stopped a run, its workers' output stays unprinted until LATE_OUTPUT_S later or the
    process's next run, whichever comes first (raytrain.driver.watch.run_trainer): both call this, and the
    undo (compat.stop_printing_worker_logs') must run once."""
    from raytrain.driver import watch

    undone = []
    watch._silenced.append(lambda: undone.append(1))
    watch.print_worker_output_again()  # the timer
    watch.print_worker_output_again()  # the next fit()
    assert undone == [1] and watch._silenced == []
    assert watch.LATE_OUTPUT_S >= 5  # Ray's killed tasks' last lines arrive within seconds of the run's end


def test_sigterm_takes_the_ctrl_c_path_inside_the_block_and_its_handler_is_restored_after():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a handler of the caller's, not the default
    try:
        with pytest.raises(Terminated):
            with signals_stop_the_run():
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert issubclass(Terminated, KeyboardInterrupt)  # Ctrl-C's path: main's `except KeyboardInterrupt`


def test_ctrl_c_inside_the_block_is_python_s_even_where_a_plain_ray_train_run_left_its_handler():
    """ray 2.60's TrainController-bound SIGINT handler, left behind by a plain TorchTrainer.fit() run earlier in the
    main thread (a notebook cell, a test), never restored: Ctrl-C raised "Can't find actor ..." from the wait for a
    later run, which trained on. Inside the block Ctrl-C is KeyboardInterrupt; the caller's handler comes back."""
    def stale(signum, frame):  # what Ray's does once its controller is gone
        raise RuntimeError("Failed to submit task to actor ...: Can't find actor")

    previous = signal.signal(signal.SIGINT, stale)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_stop_the_run():
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is stale
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_while_stopping_only_hurries_the_stop():
    before = signal.getsignal(signal.SIGINT)
    with _Stopping() as stopping:
        assert not stopping.hurried
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pytest.fail("a second Ctrl-C escaped the stop: its line with the continue command would be lost")
        assert stopping.hurried
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_signal_handlers_are_left_alone():
    """A notebook kernel's or a library's thread: Python runs handlers in the main thread only (and refuses to set
    them elsewhere), so neither block touches them there."""
    before, done = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)), []

    def in_a_thread():
        with signals_stop_the_run(), _Stopping() as stopping:
            inside = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), stopping.hurried
        done.append(inside)  # leaving the blocks raised nothing

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert done == [(*before, False)]


def test_ctrl_c_between_a_saves_upload_and_its_registration_waits_for_ray_train_to_take_it(ray_cluster, tmp_path):
    """ray.train.report uploads a checkpoint, then queues its report for the controller's next poll (every 2 s;
    one more behind a queued metrics report). Ctrl-C in that window aborted the run at once, and the checkpoint,
    whole in storage, was never registered: the run continued from the one before. A real TorchTrainer on the
    test cluster whose worker reports metrics, then a checkpoint, then keeps training; SIGINT to this process
    the moment the checkpoint is whole in storage (here the workers are not signalled, as on a real cluster)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.config import DataConfig
    from raytrain.data.progress import DataProgress
    from raytrain.driver.watch import callbacks, run_trainer

    saved = tmp_path / "saved"  # what DeepSpeed and raytrain write, as check_is_checkpoint reads it (files empty)
    (saved / layout.tag_for(3)).mkdir(parents=True)
    for kind in ("model", "optim"):
        (saved / layout.tag_for(3) / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt").touch()
    (saved / "latest").write_text(layout.tag_for(3))
    (saved / layout.METADATA).write_text(json.dumps({"step": 3, "world_size": 1, "spec": {
        "model": {}, "config": {"data": {}}}}))

    def train(config):
        import time

        import ray.train

        ray.train.report({"step": 2})  # queued: the checkpoint's report waits behind it for a poll
        ray.train.report({"step": 3}, checkpoint=ray.train.Checkpoint.from_directory(config["saved"]),
                         checkpoint_dir_name="checkpoint_step_00000003")
        time.sleep(120)  # training on; the abort ends it

    run = f"{tmp_path}/stopped"
    progress = DataProgress(DataConfig(), "stopped")

    def interrupt_once_saved():
        deadline = time.monotonic() + 120
        while layout.latest_complete_checkpoint(run) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    trainer = TorchTrainer(train, train_loop_config={"saved": str(saved)},
                           scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
                           run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="stopped",
                                                          callbacks=callbacks(progress, 0)))
    with progress, pytest.raises(Interrupted) as raised:
        threading.Thread(target=interrupt_once_saved, daemon=True).start()
        run_trainer(trainer, progress, run, 10, "python -m raytrain.main checkpoint.name=stopped")
    assert raised.value.checkpoint == f"{run}/checkpoint_step_00000003", str(raised.value)
    assert "not registered" not in str(raised.value)


def test_a_checkpoint_whole_in_storage_but_never_registered_is_named_at_ctrl_c():
    """Where the wait ends first (the workers were signalled too), the line names the newer checkpoint."""
    line = str(Interrupted(7, 12, "/runs/r/checkpoint_step_00000003", "python -m raytrain.main checkpoint.name=r",
                           unregistered="/runs/r/checkpoint_step_00000006"))
    assert line == ("interrupted at step 7 of 12; latest checkpoint /runs/r/checkpoint_step_00000003; "
                    "/runs/r/checkpoint_step_00000006 is complete in storage but Ray Train had not registered it (its "
                    "workers were stopped first): --resume-from it with a new checkpoint.name to continue from there "
                    "instead; to continue: python -m raytrain.main checkpoint.name=r")
