"""One driver per run (raytrain.driver.live): a second driver of a run that is training is refused in one
line before ray.init, in a dry run too; a driver that died stops counting; the heartbeat file is kept fresh
and removed at the end. Real files on a local storage path, and objects on a real S3 API (moto's server)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pyarrow.fs
import pytest

from raytrain.config import ConfigError
from raytrain.driver import live
from raytrain.main import main
from tests.helpers import S3Server, wait_until


def other_driver(storage, name, **changes):
    """The heartbeat file another driver, on another host, wrote a second ago."""
    driver = live.Driver(**{"token": "theirs", "host": "gpu-node-7", "pid": 4242, "started": "2026-12-05 09:00:00",
                            "beat": time.time() - 1, **changes})
    live._write(str(storage), name, driver)
    return driver


@pytest.mark.parametrize("job,named,stop", [
    ("raysubmit_abc", ", Ray job raysubmit_abc", "`ray job stop raysubmit_abc`"),
    (None, "", "Ctrl-C in its terminal, or `kill 4242` on gpu-node-7")])  # a driver started in a terminal
def test_a_run_another_driver_is_training_is_refused_naming_it_and_the_fix(job, named, stop, tmp_path):
    other_driver(tmp_path, "r1", job=job)
    with pytest.raises(ConfigError) as e, live.claimed(str(tmp_path), "r1"):
        pass
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"run 'r1' in {tmp_path} is in progress: its driver (pid 4242 on gpu-node-7{named}, "
                           f"started 2026-12-05 09:00:00) was seen 1 s ago; wait for it to end or stop it ({stop}), "
                           f"or set another checkpoint.name")
    assert live.read(str(tmp_path), "r1").token == "theirs"  # theirs is left as it is


@pytest.mark.parametrize("ago,seen", [(3 * live.BEAT_S + 1, "91 s"),  # three beats missed: a storage hiccup
                                      (-30, "0 s")])  # its host's clock runs ahead of this one's
def test_a_driver_that_missed_a_few_beats_or_whose_clock_runs_ahead_still_holds_the_run(ago, seen, tmp_path):
    other_driver(tmp_path, "r", beat=time.time() - ago)
    with pytest.raises(ConfigError, match=f"pid 4242 on gpu-node-7, started .*\\) was seen {seen} ago;"):
        live.check_not_live(str(tmp_path), "r")


def test_a_driver_that_stopped_beating_or_whose_pid_is_gone_here_does_not_hold_the_run(tmp_path):
    other_driver(tmp_path, "old", beat=time.time() - live.STALE_S - 1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live._write(str(tmp_path), "crashed", live.Driver(token="t", host=socket.gethostname(), pid=int(gone.stdout),
                                                      started="x", beat=time.time()))
    for name in ("old", "crashed"):
        assert live.live_driver(str(tmp_path), name) is None
        with live.claimed(str(tmp_path), name) as me:
            assert live.read(str(tmp_path), name) == me
        assert live.read(str(tmp_path), name) is None  # removed at the end


def test_a_heartbeat_whose_pid_now_belongs_to_a_later_process_does_not_hold_the_run(tmp_path):
    # A driver killed with its container comes back with the same pid on the same host name: its old
    # heartbeat file named a live pid (its own), and refused the run to it until STALE_S had passed.
    import psutil

    started = psutil.Process().create_time()  # this process stands for the later one with the pid
    for name, claimed, holds in (("reused", started - 60, False), ("this", started + 5, True),
                                 ("old-file", None, True)):
        live._write(str(tmp_path), name, live.Driver(token="t", host=socket.gethostname(), pid=os.getpid(),
                                                     started="x", beat=time.time(), claimed=claimed))
        assert (live.live_driver(str(tmp_path), name) is not None) is holds, name


def test_the_claim_is_written_while_the_block_runs_kept_fresh_and_removed_at_the_end_even_after_an_error(
        tmp_path, monkeypatch):
    monkeypatch.setattr(live, "BEAT_S", 0.05)
    with pytest.raises(RuntimeError), live.claimed(str(tmp_path), "r") as me:
        assert me.pid == os.getpid() and me.claimed is not None and live.live_driver(str(tmp_path), "r") == me
        held = live.read(str(tmp_path), "r")
        assert held.token == me.token and live.live_driver(str(tmp_path), "r") == held
        wait_until(lambda: live.read(str(tmp_path), "r").beat > me.beat, 10, "a second beat")
        with pytest.raises(ConfigError, match="in progress"):  # a second driver, same machine
            live.check_not_live(str(tmp_path), "r")
        raise RuntimeError("the run failed")
    assert not os.path.exists(live.marker_uri(str(tmp_path), "r"))


@pytest.mark.parametrize("uri", [True, False])
def test_a_claim_on_a_storage_uri_or_a_storage_path_not_made_yet_is_written_and_removed(uri, tmp_path):
    local = tmp_path if uri else tmp_path / "new" / "runs"
    storage = f"file://{tmp_path}/" if uri else str(local)
    with live.claimed(storage, "r") as me:
        assert live.live_driver(storage, "r") == me
        assert os.path.isfile(local / ".raytrain-live" / "r.json")
    assert not os.path.exists(local / ".raytrain-live" / "r.json")


def test_a_claim_on_s3_is_written_and_removed(tmp_path, monkeypatch):
    """Against a real S3 API (moto's server): an object store, where a PUT is whole and nothing is renamed."""
    server = S3Server(tmp_path)
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)  # what pyarrow's s3:// URIs read
        storage = f"s3://{server.bucket}/runs"
        with live.claimed(storage, "r") as me:
            assert live.live_driver(storage, "r") == me
        assert live.read(storage, "r") is None
        left = pyarrow.fs.FileSelector(f"{server.bucket}/runs", recursive=True, allow_not_found=True)
        assert [i.path for i in server.filesystem().get_file_info(left) if i.type == pyarrow.fs.FileType.File] == []
    finally:
        server.stop()


def test_a_claim_taken_over_or_removed_while_the_block_ran_is_left_alone_at_the_end(tmp_path):
    with live.claimed(str(tmp_path), "r"):
        theirs = other_driver(tmp_path, "r")  # this driver was stale long enough for another to take the run
    assert live.read(str(tmp_path), "r") == theirs
    with live.claimed(str(tmp_path), "gone"):
        os.remove(live.marker_uri(str(tmp_path), "gone"))  # the storage's directory was cleaned up under it
    assert live.read(str(tmp_path), "gone") is None


def test_a_second_driver_reading_the_heartbeat_while_it_is_rewritten_still_finds_the_first(tmp_path, monkeypatch):
    """A file rewritten in place is empty for an instant: read then, the run looked free to a second driver."""
    monkeypatch.setattr(live, "BEAT_S", 0.0005)
    with live.claimed(str(tmp_path), "r") as me:
        seen = [live.live_driver(str(tmp_path), "r") for _ in range(300)]
    assert [d for d in seen if d is None or d.token != me.token] == []
    assert os.listdir(tmp_path / ".raytrain-live") == []  # removed at the end, nothing written beside it left


def test_of_two_drivers_claiming_in_the_same_instant_only_the_one_whose_claim_stayed_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(live.CLAIM_SETTLE_S, False, 1.0)
    outcome = {}

    def first():
        try:
            with live.claimed(str(tmp_path), "r"):
                outcome["first"] = "trained"
        except ConfigError as e:
            outcome["first"] = str(e)

    thread = threading.Thread(target=first)
    thread.start()
    path = live.marker_uri(str(tmp_path), "r")
    wait_until(lambda: os.path.exists(path), 10, "the first claim")
    other_driver(tmp_path, "r")  # the second driver writes its claim while the first waits to read its own back
    thread.join()
    assert outcome["first"].startswith("run 'r' in ") and "pid 4242 on gpu-node-7" in outcome["first"]
    assert live.read(str(tmp_path), "r").token == "theirs"  # the first leaves the winner's claim alone


def test_a_driver_under_ray_job_submit_names_its_job(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_x"}}))
    with live.claimed(str(tmp_path), "r") as me:
        assert me.job == "raysubmit_x" and me.how_to_stop() == "`ray job stop raysubmit_x`"


@pytest.mark.parametrize("flags", [["--dry-run"], [], ["--fresh"]])
def test_the_command_line_refuses_a_run_in_progress_before_ray_in_a_dry_run_too(flags, tmp_path, capsys):
    other_driver(tmp_path, "mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "summary.md").write_text("the other driver's run")
    rc = main([f"checkpoint.storage_path={tmp_path}", "checkpoint.name=mine", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"raytrain: error: run 'mine' in {tmp_path} is in progress: its driver (pid 4242")
    assert sorted(os.listdir(tmp_path)) == [".raytrain-live", "mine"]
    assert (tmp_path / "mine" / "summary.md").read_text() == "the other driver's run"  # not set aside by --fresh
