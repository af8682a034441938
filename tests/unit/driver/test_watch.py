"""How the driver stops a run and what it says (raytrain.driver.watch): the command that continues a
run, the Ctrl-C line, the worker-failure line. The stops themselves (Ctrl-C, a bad record) run for
real in tests/integration/test_quickstart.py and test_user_path.py."""

import shlex

from raytrain.driver.watch import Interrupted, RunWatch, continue_command


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


def test_a_worker_failure_is_one_raytrain_line_saying_what_happens_next(capfd):
    watch = RunWatch(max_failures=1)
    watch.after_exception(None, {1: RuntimeError("first line\nthe error itself")})
    watch.after_exception(None, {0: ValueError("again")})
    lines = capfd.readouterr().out.splitlines()
    assert lines == ["raytrain: worker failure 1 (checkpoint.max_failures=1) on rank 1: RuntimeError: the error itself; "
                     "Ray Train restarts the workers from the latest checkpoint",
                     "raytrain: worker failure 2 (checkpoint.max_failures=1) on rank 0: ValueError: again; "
                     "the run fails"]


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
