"""The quick start as a new user runs it: `python -m raytrain.main` without RAY_ADDRESS (raytrain
starts its own local Ray cluster), with a few small overrides. Ctrl-C in the middle (pressed three
times): one line with the step reached, the latest checkpoint and the command that continues, exit 130,
no traceback, and the local cluster gone. That command, run as printed, continues the run to its end.
In both, at most 5 lines are not raytrain's own."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from raytrain.checkpoint import layout
from raytrain.config import ConfigError
from raytrain.console import parse_progress

pytestmark = pytest.mark.integration

ARGS = ["training.max_steps=20", "training.log_every_n_steps=2", "checkpoint.every_n_steps=2",
        "data.num_builtin_documents=400"]
RAY_PREFIX = re.compile(r"^(\x1b\[\d+m)?\([^)]*pid=\d+[^)]*\)(\x1b\[0m)? ?")


def foreign(output: str) -> list[str]:
    """The lines that are neither raytrain's own nor its progress line (behind Ray's prefix)."""
    lines = [RAY_PREFIX.sub("", line) for line in output.splitlines()]
    return [line for line in lines if not line.startswith("raytrain") and parse_progress(line) is None]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    storage = tmp_path_factory.mktemp("quickstart")
    # as a user's shell has it: no RAY_ADDRESS, and Ray's usage statistics at Ray's default (the conftest
    # turns them off for the other tests; Ray prints a line about them when it starts a local cluster)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED")}
    env["PYTHONUNBUFFERED"] = "1"
    argv = [*ARGS, f"checkpoint.storage_path={storage}"]
    # its own session: Ctrl-C in a terminal signals the whole foreground process group
    first = subprocess.Popen([sys.executable, "-m", "raytrain.main", *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in first.stdout:  # until the run has a checkpoint that Ray Train registered
        lines.append(line)
        name = re.search(r"^raytrain: run (\S+) in ", "".join(lines), re.M)
        if name and os.path.exists(storage / name.group(1) / "checkpoint_manager_snapshot.json"):
            break
        if parse_progress(line) and parse_progress(line)["step"] >= 20:
            pytest.fail("the run ended before it could be interrupted:\n" + "".join(lines))
    os.killpg(first.pid, signal.SIGINT)
    # an impatient user presses it again while the run is being stopped, and once more as the process ends
    for wait_s in (0.3, 1.5):
        time.sleep(wait_s)
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGINT)
    rest, _ = first.communicate(timeout=300)
    interrupted = "".join(lines) + rest
    started = re.search(r"dashboard http://127.0.0.1:(\d+)", interrupted)
    assert started, interrupted[-4000:]  # what the run said instead (a slow machine's dashboard may not start)
    dashboard = int(started.group(1))
    command = re.search(r"^raytrain: interrupted .*; to continue: (.*)$", interrupted, re.M).group(1)
    continuable = unfinished(storage, argv)
    # which checkpoints were whole as the run stopped: the continued run's retention deletes the early ones
    whole = {str(c): _is_whole(str(c)) for c in (storage / name.group(1)).glob("checkpoint_step_*")}
    cmd = shlex.split(command)
    assert cmd[:3] == ["python", "-m", "raytrain.main"], command
    second = subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True, text=True, timeout=900)
    return {"storage": storage, "name": name.group(1), "first": first, "interrupted": interrupted,
            "dashboard": dashboard, "command": command, "second": second, "argv": argv, "unfinished": continuable,
            "whole": whole}


def _is_whole(checkpoint: str) -> bool:
    try:
        layout.check_is_checkpoint(checkpoint, "checkpoint")
    except ConfigError:
        return False
    return True


def unfinished(storage, argv):
    """What running the quick start's command again (a new run) names as continuable."""
    from raytrain.config import load_config
    from raytrain.driver.run import unfinished_runs
    from raytrain.planning.resolve import resolve_run, shape_from_config

    cfg = load_config(None, argv)
    return unfinished_runs(str(storage), resolve_run(cfg, shape_from_config(cfg)), "raytrain-20990101-000000")


def test_ctrl_c_prints_one_line_with_the_step_checkpoint_and_command_and_exits_130(quickstart):
    out, storage, name = quickstart["interrupted"], quickstart["storage"], quickstart["name"]
    assert quickstart["first"].returncode == 130, out[-3000:]
    last = out.strip().splitlines()[-1]  # the last line: nothing of Ray's after it
    # Ctrl-C to the process group stops the local cluster's workers too: a save uploaded but not yet registered by
    # Ray Train (its controller polls every 2 s) is gone with them, and the line names it (watch._await_registration)
    m = re.fullmatch(r"raytrain: interrupted at step (\d+) of 20; latest checkpoint (\S+); (?:(\S+) is complete in "
                     r"storage but Ray Train had not registered it \(its workers were stopped first\): --resume-from "
                     r"it with a new checkpoint.name to continue from there instead; )?to continue: (.*)", last)
    assert m, out[-3000:]
    step, checkpoint, unregistered = int(m.group(1)), m.group(2), m.group(3)
    assert re.fullmatch(rf"{storage}/{name}/checkpoint_step_0000000(\d)", checkpoint), checkpoint
    assert 2 <= int(checkpoint[-1]) <= step < 20
    if unregistered:  # newer, and whole: --resume-from would take it
        assert re.fullmatch(rf"{storage}/{name}/checkpoint_step_\d{{8}}", unregistered), unregistered
        assert int(checkpoint[-1]) < int(unregistered.rsplit("_", 1)[1]) <= step
        assert quickstart["whole"][unregistered], quickstart["whole"]  # as the run stopped, not after the second
    # the same command as announced at the start, with the run's name
    assert f"to continue it after a stop: {quickstart['command']}" in out
    assert quickstart["command"] == shlex.join(["python", "-m", "raytrain.main", *ARGS,
                                                f"checkpoint.storage_path={storage}", f"checkpoint.name={name}"])
    assert not re.search(r"Traceback|KeyboardInterrupt", out), out[-3000:]
    # the same quick start command again (a new run) would name this one and its step: the latest checkpoint the line
    # named, or the unregistered one, where Ray Train's controller registered it after the line, as the run ended
    # (seen once under load, session 63: the continued run then resumes from that newer, whole checkpoint)
    steps = [int(checkpoint[-1])] + ([int(unregistered.rsplit("_", 1)[1])] if unregistered else [])
    assert quickstart["unfinished"] in [[(name, s)] for s in steps], (quickstart["unfinished"], steps)
    assert not (storage / ".raytrain-live" / f"{name}.json").exists()  # the driver let go of the run as it stopped


def test_ctrl_c_stops_the_local_cluster(quickstart):
    def dashboard_answers():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", quickstart["dashboard"])) == 0

    wait_for(lambda: not dashboard_answers(), 60, "the local cluster's dashboard to stop")


def test_the_printed_command_continues_the_run_to_its_end(quickstart):
    p = quickstart["second"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert f"raytrain: run '{quickstart['name']}' exists in {quickstart['storage']}: continuing" in out
    start = int(re.search(r"starting at step (\d+)", out).group(1))
    assert start >= 2 and "raytrain: done at step 20" in out
    assert unfinished(quickstart["storage"], quickstart["argv"]) == []  # finished: nothing to continue
    # the continued run found its own model files from the first session, equal: left as they were
    assert "held files other than" not in out
    assert not list((quickstart["storage"] / quickstart["name"]).glob("model.replaced-*"))


@pytest.mark.parametrize("run", ["interrupted", "second"])
def test_at_most_five_lines_are_not_raytrains(quickstart, run):
    out = quickstart[run] if run == "interrupted" else quickstart[run].stdout + quickstart[run].stderr
    assert len(foreign(out)) <= 5, "\n".join(foreign(out))
