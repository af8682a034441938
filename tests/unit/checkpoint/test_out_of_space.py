"""A full disk, told apart from other write errors (raytrain.checkpoint.shards.out_of_space), as the real
writers raise it: Python's files, pyarrow's copy (Ray Train's upload to checkpoint.storage_path) and
torch.save (DeepSpeed's shards), each writing into /dev/full. The run it stops: tests/integration/
test_user_path.py. And a restore from object storage that this node's TMPDIR cannot hold (shards._rank_files)."""

import errno
import os
import shutil
from types import SimpleNamespace

import pyarrow.fs
import pytest
import torch

from raytrain.checkpoint import shards
from raytrain.checkpoint.shards import out_of_space
from tests.helpers import remote_local_filesystem


def raised(write) -> BaseException:
    with pytest.raises(BaseException) as e:
        write()
    return e.value


def test_pythons_and_pyarrows_no_space_errors_are_out_of_space(tmp_path):
    def python_write():
        with open("/dev/full", "w") as f:
            f.write("x" * 10_000)

    assert out_of_space(raised(python_write))
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "raytrain.json").write_text("{}" * 10_000)
    (tmp_path / "storage").mkdir()
    os.symlink("/dev/full", tmp_path / "storage" / "raytrain.json")  # the upload writes through it

    def upload():  # what Ray Train's persist_current_checkpoint calls
        pyarrow.fs.copy_files(str(tmp_path / "local"), str(tmp_path / "storage"))

    error = raised(upload)
    assert isinstance(error, OSError) and out_of_space(error)


def test_torchs_full_disk_error_is_out_of_space_only_where_the_disk_is_nearly_full(tmp_path, monkeypatch):
    error = raised(lambda: torch.save({"w": torch.zeros(100_000)}, "/dev/full"))
    assert isinstance(error, RuntimeError) and getattr(error, "errno", None) is None  # no errno, no text to go by
    assert not out_of_space(error)
    assert not out_of_space(error, str(tmp_path))  # this disk has room: another failure
    monkeypatch.setattr(shards, "_FULL_BYTES", 2**62)  # every disk counts as nearly full
    assert out_of_space(error, str(tmp_path))


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "Auf dem Ger\u00e4t ist kein Speicherplatz mehr verf\u00fcgbar"),  # another locale's message
    OSError(errno.EDQUOT, "Kontingent \u00fcberschritten"),
    OSError("When uploading part 3: IOError: No space left on device"),  # the text, no errno
    RuntimeError("write of shard 7 failed: Disk quota exceeded")])
def test_an_errno_or_a_message_that_says_the_disk_is_full_is_out_of_space_without_looking_at_a_disk(error):
    assert out_of_space(error)


def free_disk(monkeypatch, free):
    """Every disk as having `free` bytes free (no test here can fill a disk without a mount)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**50, used=2**50 - free, free=free))


@pytest.mark.parametrize("free_mib, full", [(40, True), (100, False)])
def test_a_write_error_that_does_not_say_why_is_out_of_space_where_under_64_mib_are_free(free_mib, full, tmp_path,
                                                                                         monkeypatch):
    error = raised(lambda: torch.save({"w": torch.zeros(100_000)}, "/dev/full"))
    free_disk(monkeypatch, free_mib * 2**20)
    assert out_of_space(error, str(tmp_path)) == full
    assert not out_of_space(error)  # no directory: nothing to go by


def test_other_write_errors_are_not_out_of_space(tmp_path):
    assert not out_of_space(raised(lambda: open("/nonexistent-dir/x", "w")), str(tmp_path))
    assert not out_of_space(raised(lambda: open(tmp_path, "w")), str(tmp_path))  # a directory


def remote_checkpoint(path, shard_bytes, opened):
    """A 2-rank ZeRO-3 checkpoint at `path` whose shard files hold `shard_bytes` each (sparse: no disk
    used), as Ray hands it to a worker from object storage."""
    from ray.train import Checkpoint  # a plain class: no Ray cluster is started

    tag = path / "step_00000004"
    tag.mkdir(parents=True)
    for rank in (0, 1):
        for kind in ("model", "optim"):
            with open(tag / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt", "wb") as f:
                f.truncate(shard_bytes)
    (path / "latest").write_text("step_00000004")
    (path / "raytrain.json").write_text("{}")
    return Checkpoint(str(path), filesystem=remote_local_filesystem(opened, max_file_bytes=2**30))


def test_a_restore_download_this_disk_cannot_hold_is_one_line_before_any_byte(tmp_path, monkeypatch):
    # A checkpoint on s3://, gs:// or abfs:// is downloaded to TMPDIR. A disk too small for it failed
    # inside DeepSpeed's load or pyarrow's copy, as a worker failure: each of checkpoint.max_failures
    # restarts downloaded again and failed the same way.
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    opened = []
    big = 4 * 2**40  # 4 TiB a shard file: more than this machine's disk (sparse files, no space used)
    checkpoint = remote_checkpoint(tmp_path / "ckpt", big, opened)
    # before the engine build (the worker loop's call), and again at the download itself
    resume = shards.ResumePoint(checkpoint, step=4, written_by=2)
    with pytest.raises(shards.SetupMistake) as early:  # no run's counter: stop_run raises the record
        shards.check_restore_space(resume, shards.Rank(world=1, world_size=2, local_size=8), counter=None)
    with pytest.raises(shards.SetupMistake) as e:
        with shards._rank_files(checkpoint, rank=1, ranks_on_node=8):
            pass
    line = e.value.line()
    assert early.value.line() == line
    assert line.startswith(f"node {os.uname().nodename}: no space left in {tmp_path / 'tmp'} to restore checkpoint "
                           f"{tmp_path / 'ckpt'}: this node's 8 workers download 65536.00 GiB of its files there "
                           f"(each worker its own shards) and "), line
    assert line.endswith(" GiB are free: free space there, or start the Ray nodes with TMPDIR on a larger disk; then "
                         "the same command continues from the same checkpoint"), line
    assert opened == [] and os.listdir(tmp_path / "tmp") == []  # nothing read, nothing left behind
    # a universal copy is read whole (as_directory), and a local one in place: neither is checked here
    shards.check_restore_space(shards.ResumePoint(checkpoint, 4, 3, universal=str(tmp_path / "u")),
                               shards.Rank(world=1, world_size=2, local_size=8), counter=None)
    from ray.train import Checkpoint

    local = remote_checkpoint(tmp_path / "local", big, [])
    shards.check_restore_space(shards.ResumePoint(Checkpoint(local.path), 4, 2),
                               shards.Rank(world=1, world_size=2, local_size=8), counter=None)
    # this rank's own files fit: downloaded, the other rank's not
    small = remote_checkpoint(tmp_path / "small", 1000, opened)
    with shards._rank_files(small, rank=1, ranks_on_node=8) as local:
        got = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, files in os.walk(local) for f in files)
    assert got == ["latest", "raytrain.json", "step_00000004/zero_pp_rank_1_mp_rank_00_model_states.pt",
                   "step_00000004/zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert os.listdir(tmp_path / "tmp") == []


def test_a_disk_that_fills_during_the_restore_download_is_the_same_line(tmp_path, monkeypatch):
    # Room at the check, none at the write (another process, a quota): pyarrow's copy raises the OSError
    # a full disk gives (monkeypatched: no test here can fill a disk without a mount).
    import errno

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pyarrow.fs, "copy_files", full)
    with pytest.raises(shards.SetupMistake, match=r"no space left in .* to restore checkpoint .*: this worker "
                                                  r"downloads 0\.00 GiB"):
        with shards._rank_files(remote_checkpoint(tmp_path / "ckpt", 1000, []), rank=0):
            pass
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("rank, workers", [(shards.Rank(world=1, world_size=2), "this worker downloads 0.00 GiB"),
                                           (shards.Rank(world=1, world_size=2, local_size=2),
                                            "this node's 2 workers download 0.00 GiB")])
def test_a_restore_download_leaving_under_64_mib_free_is_the_same_line(rank, workers, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    opened = []
    resume = shards.ResumePoint(remote_checkpoint(tmp_path / "ckpt", 1000, opened), step=4, written_by=2)
    free_disk(monkeypatch, 32 * 2**20)  # room for a few KiB of shards, not for them and the 64 MiB margin
    with pytest.raises(shards.SetupMistake) as e:
        shards.check_restore_space(resume, rank, counter=None)
    assert f": {workers} of its files there (each worker its own shards) and 0.03 GiB are free: " in e.value.line()
    free_disk(monkeypatch, 100 * 2**20)
    shards.check_restore_space(resume, rank, counter=None)
    assert opened == []


def test_a_download_error_other_than_a_full_disk_is_raised_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    free_disk(monkeypatch, 2**40)

    def reset(*args, **kwargs):
        raise OSError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(pyarrow.fs, "copy_files", reset)
    with pytest.raises(OSError, match="Connection reset by peer"):
        with shards._rank_files(remote_checkpoint(tmp_path / "ckpt", 1000, []), rank=0):
            pass
    assert os.listdir(tmp_path / "tmp") == []


def test_a_checkpoint_on_a_local_or_shared_filesystem_is_read_in_place(tmp_path, monkeypatch):
    from ray.train import Checkpoint

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = remote_checkpoint(tmp_path / "ckpt", 1000, []).path
    with shards._rank_files(Checkpoint(path), rank=0) as local:
        assert local == path
    assert os.listdir(tmp_path / "tmp") == [] and len(os.listdir(f"{path}/step_00000004")) == 4
