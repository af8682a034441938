"""A full disk, told apart from other write errors (raytrain.checkpoint.shards.out_of_space), as the real
writers raise it: Python's files, pyarrow's copy (Ray Train's upload to checkpoint.storage_path) and
torch.save (DeepSpeed's shards), each writing into /dev/full. The run it stops: tests/integration/
test_user_path.py."""

import os

import pyarrow.fs
import pytest
import torch

from raytrain.checkpoint import shards
from raytrain.checkpoint.shards import out_of_space


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


def test_other_write_errors_are_not_out_of_space(tmp_path):
    assert not out_of_space(raised(lambda: open("/nonexistent-dir/x", "w")), str(tmp_path))
    assert not out_of_space(raised(lambda: open(tmp_path, "w")), str(tmp_path))  # a directory
