"""--fresh sets the old run aside under another name (raytrain.checkpoint.layout.set_aside): a local
directory is renamed; on S3, which has no directories, every object of the run moves, against a real
S3 API (moto's server). And a checkpoint on S3 is printed with its scheme. A real run on S3 storage,
set aside and read back through Ray Train's record: tests/integration/test_object_storage.py."""

import os

import pyarrow.fs
import pytest
import ray.train

from raytrain.checkpoint import layout
from tests.helpers import S3Server


@pytest.fixture(scope="module")
def s3(tmp_path_factory, monkeypatch_module):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    for key, value in server.env.items():
        monkeypatch_module.setenv(key, value)  # what pyarrow's s3:// URIs read
    yield server
    server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


# A run as Ray Train and raytrain leave it: checkpoints (nested), Ray Train's record at the top.
RUN = {"checkpoint_step_00000003/raytrain.json": b'{"step": 3}',
       "checkpoint_step_00000003/step_00000003/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"x" * 1000,
       "model/config.json": b"{}",
       "checkpoint_manager_snapshot.json": b"{}"}


def write_run(fs, root):
    for name, data in RUN.items():
        fs.create_dir(f"{root}/{name}".rsplit("/", 1)[0])  # local disk needs it; S3 has no directories
        with fs.open_output_stream(f"{root}/{name}") as f:
            f.write(data)


def files(fs, root):
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True, allow_not_found=True))
    out = {}
    for i in infos:
        if i.type == pyarrow.fs.FileType.File:
            with fs.open_input_stream(i.path) as f:
                out[i.path[len(root) + 1:]] = f.read()
    return out


def test_a_local_run_is_renamed(tmp_path):
    fs = pyarrow.fs.LocalFileSystem()
    write_run(fs, str(tmp_path / "r1"))
    aside = layout.set_aside(str(tmp_path / "r1"), ".replaced-1")
    assert aside == str(tmp_path / "r1.replaced-1")
    assert files(fs, aside) == RUN and not (tmp_path / "r1").exists()


@pytest.mark.parametrize("streamed", [False, True])
def test_every_object_of_an_s3_run_moves_and_nothing_stays(s3, monkeypatch, streamed):
    fs, run = s3.filesystem(), f"{s3.bucket}/runs/r-{streamed}"
    write_run(fs, run)
    if streamed:  # objects over S3's 5 GiB CopyObject limit are streamed: the limit lowered to exercise it here
        monkeypatch.setattr(layout, "S3_COPY_LIMIT_BYTES", 100)
    aside = layout.set_aside(f"s3://{run}/", ".replaced-1")
    assert aside == f"s3://{run}.replaced-1"
    assert files(fs, f"{run}.replaced-1") == RUN
    assert files(fs, run) == {}


class Recorded:
    """A real pyarrow filesystem that notes which objects it moved (a server-side copy) and which it read."""

    def __init__(self, fs):
        self.fs, self.moved, self.read = fs, [], []

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def move(self, src, dest):
        self.moved.append(src)
        self.fs.move(src, dest)

    def open_input_stream(self, path):
        self.read.append(path)
        return self.fs.open_input_stream(path)


def test_only_objects_over_s3s_copy_limit_are_streamed_and_the_runs_record_moves_last(s3, monkeypatch):
    fs, run = s3.filesystem(), f"{s3.bucket}/runs/r-order"
    write_run(fs, run)
    recorded = Recorded(fs)
    monkeypatch.setattr(layout, "filesystem", lambda uri: (recorded, uri.partition("://")[2]))
    monkeypatch.setattr(layout, "S3_COPY_LIMIT_BYTES", 11)  # raytrain.json's size: at the limit is copied
    layout.set_aside(f"s3://{run}", ".replaced-1")
    optim = "checkpoint_step_00000003/step_00000003/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert recorded.read == [f"{run}/{optim}"]  # streamed, the only one over the limit
    assert recorded.moved[-1] == f"{run}/checkpoint_manager_snapshot.json"  # Ray Train's record: a cut leaves it
    assert sorted(recorded.moved[:-1]) == [f"{run}/checkpoint_step_00000003/raytrain.json", f"{run}/model/config.json"]
    assert files(fs, f"{run}.replaced-1") == RUN and files(fs, run) == {}


def test_a_checkpoint_on_s3_is_named_with_its_scheme(s3):
    # Ray's Checkpoint keeps the path on its filesystem: printed as it is, "bucket/runs/..." reads as a
    # local path (--resume-from and the export given it would look on local disk)
    run = f"s3://{s3.bucket}/runs/named"
    checkpoint = ray.train.Checkpoint(f"{run}/checkpoint_step_00000003")
    assert checkpoint.path == f"{s3.bucket}/runs/named/checkpoint_step_00000003"
    assert layout.checkpoint_uri(run, checkpoint) == f"{run}/checkpoint_step_00000003"
    assert layout.checkpoint_uri("/data/runs/named", ray.train.Checkpoint("/data/runs/named/checkpoint_step_00000003")) \
        == "/data/runs/named/checkpoint_step_00000003"


def test_the_model_files_of_an_s3_run_are_kept_when_equal_and_set_aside_when_not(s3):
    from raytrain.checkpoint.model_files import local_model_files, write_model_files
    from raytrain.config import ModelConfig, RunConfig
    from raytrain.planning.resolve import resolve_run, shape_from_config

    cfg = RunConfig()
    facts = resolve_run(cfg, shape_from_config(cfg)).model
    fs, run = s3.filesystem(), f"{s3.bucket}/runs/m"
    assert write_model_files(f"s3://{run}", ModelConfig(), facts) is None
    written = files(fs, f"{run}/model")
    assert write_model_files(f"s3://{run}", ModelConfig(), facts) is None  # compared object by object: equal
    with fs.open_output_stream(f"{run}/model/config.json") as f:
        f.write(b'{"edited": true}')
    note = write_model_files(f"s3://{run}", ModelConfig(), facts)
    assert note.startswith(f"s3://{run}/model held files other than this run's model files (config.json): moved to "
                           f"s3://{run}/model.replaced-"), note
    [aside] = {i.path for i in fs.get_file_info(pyarrow.fs.FileSelector(f"{s3.bucket}/runs/m"))} - {f"{run}/model"}
    assert files(fs, aside)["config.json"] == b'{"edited": true}'  # nothing lost
    assert files(fs, f"{run}/model") == written
    # the export reads them from a local copy, removed after
    with local_model_files(f"s3://{run}") as copy:
        local = pyarrow.fs.LocalFileSystem()
        assert copy.startswith("/") and files(local, copy) == written
    assert not os.path.exists(copy)


def test_a_single_object_on_s3_is_set_aside_as_it_is(s3):
    fs = s3.filesystem()
    with fs.open_output_stream(f"{s3.bucket}/runs/f/model") as f:  # a file where a directory would be
        f.write(b"notes")
    assert layout.set_aside(f"s3://{s3.bucket}/runs/f/model", ".replaced-1") == f"s3://{s3.bucket}/runs/f/model.replaced-1"
    assert files(fs, f"{s3.bucket}/runs/f") == {"model.replaced-1": b"notes"}
