"""The checks a run passes before Ray (raytrain.driver.checks), shared by --dry-run and real runs:
paths without creating anything, the config resolved before ray.init, the memory verdict; and the
driver's check that a local storage path is shared by the nodes (raytrain.driver.cluster), whose
decision is tested here without Ray (one machine, where it passes, runs in the integration tests)."""

import io
import json
import os
import pathlib
import socket

import pytest

from raytrain import hardware
from raytrain.checkpoint import layout
from raytrain.config import ConfigError, DataConfig, load_config
from raytrain.data.sources import inspect_sources
from raytrain.driver.checks import (_dir_bytes, _local_gpus, check_before_ray, check_dry_run_placement,
                                    check_export_outside_data, check_export_outside_run, check_local_placement,
                                    check_memory, check_placement, check_ray_address, check_storage_outside_data,
                                    check_writable_dir, dry_run_target, idle_settings, local_cluster_cpus,
                                    local_elastic_note, plans_local_cluster, resolve_before_ray, tightest,
                                    worker_bundle, zero_stage_note)
from raytrain.driver.cluster import (_plain_worker_prefixes, check_storage_shared, probe_node, runs_workers, sees_file,
                                     storage_marker, with_addable_nodes)
from raytrain.main import main


def test_a_storage_path_is_checked_without_being_created(tmp_path):
    check_writable_dir(str(tmp_path), "checkpoint.storage_path")
    check_writable_dir(str(tmp_path / "a" / "b"), "checkpoint.storage_path")
    assert list(tmp_path.iterdir()) == []  # nothing created
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint.storage_path=.*f: it is a file"):
        check_writable_dir(str(tmp_path / "f"), "checkpoint.storage_path")
    with pytest.raises(ConfigError, match=r"checkpoint.storage_path=.*f/runs: .*f, on its path, is a file"):
        check_writable_dir(str(tmp_path / "f" / "runs"), "checkpoint.storage_path")
    with pytest.raises(ConfigError, match=r"^checkpoint.storage_path=s3:/bucket/runs: a URI takes two slashes after "
                                          r"its scheme: write s3://bucket/runs \(or ./s3:/bucket/runs for a local"):
        check_writable_dir("s3:/bucket/runs", "checkpoint.storage_path")
    # /proc/1 refuses writes even to root (a chmod 555 directory would not: root writes anywhere)
    assert not os.access("/proc/1", os.W_OK)
    with pytest.raises(ConfigError, match=r"^k=/proc/1: it is not writable: choose a writable directory or a cloud"):
        check_writable_dir("/proc/1", "k")
    with pytest.raises(ConfigError, match=r"^k=/proc/1/runs: it cannot be created \(/proc/1 is not writable\): "):
        check_writable_dir("/proc/1/runs", "k")


def test_an_azure_scheme_pyarrow_cannot_open_is_refused_naming_abfs():
    # az:// (adlfs's spelling) is what Azure users type; the line offered s3://, gs://, hdfs:// but not abfs://,
    # the scheme README and cluster/ib.yaml recommend
    for uri in ("az://b/x", "wasbs://c@acct.blob.core.windows.net/runs"):
        with pytest.raises(ConfigError, match=r"use s3://, gs://, abfs://, hdfs:// or a local path \(Azure storage is "
                                              r"abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH"):
            check_writable_dir(uri, "checkpoint.storage_path")
    with pytest.raises(ConfigError, match=r"scheme nofs:// : use s3://, gs://, abfs://, hdfs:// or a local path "
                                          r"\(an S3-compatible"):  # no Azure hint for other schemes
        check_writable_dir("nofs://b/x", "checkpoint.storage_path")
    with pytest.raises(ConfigError, match=r"^checkpoint.storage_path=abfs://raytrain@acct.dfs.core.windows.net/runs: "
                                          r"cannot reach it \("):  # a scheme pyarrow knows: probed, not refused
        check_writable_dir("abfs://raytrain@acct.dfs.core.windows.net/runs", "checkpoint.storage_path")
    # local:// is pyarrow's too, though not in raytrain's list: its own complaint (a host name) is quoted
    with pytest.raises(ConfigError, match=r"^k=local://x: cannot reach it \(Unsupported hostname in non-Windows"):
        check_writable_dir("local://x", "k")


@pytest.fixture
def closed_s3_endpoint(monkeypatch):
    """An S3 endpoint nothing answers on (a local port just closed), with dummy credentials: what pyarrow's
    s3:// URIs then reach, refused at once, and retried for ~6 s of Arrow's own (no network needed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return port


UNREACHABLE_FIX = ("): check the URI, the driver's AWS credentials (AWS_ACCESS_KEY_ID, a profile or an instance "
                   "profile), the bucket's region and endpoint (AWS_ENDPOINT_URL for an S3-compatible store), and "
                   "this machine's network")


@pytest.mark.usefixtures("no_ray_driver")
def test_storage_the_driver_cannot_reach_is_one_line_before_ray_in_a_dry_run_too(closed_s3_endpoint, capsys):
    # was: the dry run passed (exit 0), and the real run died after ray.init in resume_checkpoint with a
    # 32-line pyarrow OSError traceback (layout.latest_checkpoint's first look at the run directory)
    rc = main(["--dry-run", "--host-memory-gib", "64", "checkpoint.storage_path=s3://bucket/runs"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("raytrain: error: checkpoint.storage_path=s3://bucket/runs: cannot reach it (When "
                             "getting information for key 'runs' in bucket 'bucket': AWS Error NETWORK_CONNECTION"), err
    assert f"Failed to connect to 127.0.0.1:{closed_s3_endpoint} " in err[0] and err[0].endswith(UNREACHABLE_FIX), err
    # the run's own look at its directory (resume_checkpoint, after ray.init): the same line, naming the run
    with pytest.raises(ConfigError) as e:
        layout.latest_checkpoint("s3://bucket/runs/r1")
    assert str(e.value).startswith("checkpoint.storage_path=s3://bucket/runs (run 'r1'): cannot reach it (When "
                                   "getting information for key 'runs/r1' in bucket 'bucket'"), str(e.value)
    assert str(e.value).endswith(UNREACHABLE_FIX)  # Arrow's own retries end in ~6 s each here


def test_a_storage_scheme_pyarrow_reaches_through_fsspec_is_one_line_when_unreachable(tmp_path):
    """hf:// is not one of pyarrow's schemes, but pyarrow opens it through fsspec (huggingface_hub's filesystem),
    whose probe raised huggingface_hub's own error (an httpx ConnectError): a 100-line traceback and exit 1, in a dry
    run too (found by session 52's mutation run of checks.py). A process of its own: huggingface_hub reads
    HF_ENDPOINT (here a closed local port: nothing leaves the machine) when it is first imported."""
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "RAY_ADDRESS": ""}
    env.pop("HF_HUB_OFFLINE", None)  # offline, huggingface_hub raises an OSError subclass, which was caught before
    proc = subprocess.run([sys.executable, "-m", "raytrain.main", "--dry-run", "--host-memory-gib", "64",
                           "checkpoint.storage_path=hf://org/runs"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, (proc.returncode, err[-3:])
    assert err[0].startswith("raytrain: error: checkpoint.storage_path=hf://org/runs: cannot reach it ("), err
    assert err[0].endswith(", and this machine's network"), err


@pytest.mark.usefixtures("no_ray_driver")
def test_a_storage_path_inside_the_data_is_refused_before_ray(tmp_path, capsys, monkeypatch):
    # was: data.format=text trained on the run's own checkpoint shards, PNGs and events once a run had written
    # them (exit 0, a note about invalid UTF-8); under auto the continued run stopped at "mixes formats"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dtx").mkdir()
    (tmp_path / "dtx" / "a.txt").write_text("a document\n")
    rc = main(["--dry-run", "--host-memory-gib", "64", f"checkpoint.storage_path={tmp_path / 'dtx' / 'runs'}",
               "data.path=dtx", "data.format=text"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"raytrain: error: checkpoint.storage_path={tmp_path / 'dtx' / 'runs'} is inside data.path=dtx "
        f"({tmp_path / 'dtx'}): the run's checkpoints, logs and summaries would be read as training data: move "
        f"checkpoint.storage_path out of the data, or point data.path at a subdirectory holding only the data"], err
    assert list(tmp_path.iterdir()) == [tmp_path / "dtx"]  # refused before anything was created
    (tmp_path / "dtx" / "text").mkdir()  # the fix: the data in a subdirectory of its own
    (tmp_path / "dtx" / "a.txt").rename(tmp_path / "dtx" / "text" / "a.txt")
    check_storage_outside_data("dtx/runs", None, DataConfig(path="dtx/text", format="text"))


@pytest.mark.usefixtures("no_ray_driver")
def test_an_export_dir_inside_the_data_is_refused_before_ray(tmp_path, capsys, monkeypatch):
    # was: exit 0 and the export (config.json, tokenizer.json, model.safetensors) written into the data after the
    # run: the next run on it under data.format=text trained on the weights' bytes, under auto stopped at config.json
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dtx").mkdir()
    (tmp_path / "dtx" / "a.txt").write_text("a document\n")
    argv = ["--dry-run", "--host-memory-gib", "64", f"checkpoint.storage_path={tmp_path / 'runs'}", "data.path=dtx",
            "data.format=text"]
    assert main([*argv, "checkpoint.export_dir=dtx/export"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"raytrain: error: checkpoint.export_dir={tmp_path / 'dtx' / 'export'} is inside data.path=dtx "
        f"({tmp_path / 'dtx'}): the "
        f"exported model's files would be read as data by the next run on it: export outside the data, or point "
        f"data.path at a subdirectory holding only the data"]
    with pytest.raises(ConfigError, match="^checkpoint.export_dir=s3://b/data is data.eval_path=s3://b/data/: "):
        check_export_outside_data("s3://b/data", DataConfig(path="x.jsonl", eval_path="s3://b/data/"))
    check_export_outside_data("s3://b/database", DataConfig(path="s3://b/data"))  # a sibling
    assert main([*argv, "checkpoint.export_dir=export"]) == 0  # beside the data
    assert not (tmp_path / "export").exists() and not (tmp_path / "dtx" / "export").exists()


@pytest.mark.usefixtures("no_ray_driver")
def test_an_export_dir_that_holds_the_run_is_refused_before_ray(tmp_path, capsys):
    # was: a 2-step run trained and saved, then ended on "OUT_DIR STORAGE/r1 exists and is not empty" (its own
    # checkpoints): export_dir=STORAGE/NAME, or STORAGE itself, holds the run's directory once training starts
    argv = ["--dry-run", "--host-memory-gib", "64", f"checkpoint.storage_path={tmp_path / 's'}", "checkpoint.name=r1"]
    assert main([*argv, f"checkpoint.export_dir={tmp_path / 's' / 'r1'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"raytrain: error: checkpoint.export_dir={tmp_path / 's' / 'r1'} is the run's directory "
        f"(checkpoint.storage_path={tmp_path / 's'}, checkpoint.name='r1'): the export never writes into a directory "
        f"that is not empty, and after training it would hold the run's checkpoints: export elsewhere, e.g. "
        f"checkpoint.export_dir={tmp_path / 's' / 'r1'}-export"]
    assert main([*argv, f"checkpoint.export_dir={tmp_path}"]) == 2
    assert f"checkpoint.export_dir={tmp_path} holds the run's directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^checkpoint.export_dir=s3://b/runs/ is "
                                          r"checkpoint.storage_path=s3://b/runs: "):
        check_export_outside_run("s3://b/runs/", "s3://b/runs", None)  # the new run's directory goes under it
    check_export_outside_run("s3://b/runs/hf", "s3://b/runs", None)  # beside the new run's directory
    check_export_outside_run("gs://b/runs/r1-export", "gcs://b/runs", "r1")
    for fine in (tmp_path / "s" / "r1-export", tmp_path / "s" / "r1" / "export"):  # beside or inside the run's own
        assert main([*argv, f"checkpoint.export_dir={fine}"]) == 0
    assert not (tmp_path / "s").exists()
    # inside a directory the run writes itself: the model's files at its start, a checkpoint, TensorBoard's events
    for own in ("model", "checkpoint_step_00000080/hf", "tensorboard"):
        with pytest.raises(ConfigError, match=rf"^checkpoint.export_dir=s3://b/runs/r1/{own} is inside "
                                              rf"{own.split('/')[0]}/ of the run's directory, which the run writes "
                                              rf"itself: .* e.g. checkpoint.export_dir=s3://b/runs/r1/export$"):
            check_export_outside_run(f"s3://b/runs/r1/{own}", "s3://b/runs", "r1")
    check_export_outside_run("s3://b/runs/r1/models", "s3://b/runs", "r1")  # a name the run does not use


def test_storage_inside_data_is_compared_resolved_and_by_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "runs" / "r1" / "corpus").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    refused = [("s3://bucket/data/runs", None, DataConfig(path="s3://bucket/data/")),
               ("gcs://bucket/data/runs", None, DataConfig(path=["gs://bucket/data"])),
               ("./data/../data", None, DataConfig(path="link")),  # the same directory, through a link
               ("data/runs", "r1", DataConfig(path="data/runs/r1")),  # the run's own directory
               (f"file://{tmp_path}/data/runs", None, DataConfig(path="data"))]  # file:// is a local path
    for storage, name, data in refused:
        with pytest.raises(ConfigError, match="^checkpoint.storage_path=.*: the run's checkpoints, logs and summaries "
                                              "would be read as (training|eval) data: move checkpoint.storage_path "
                                              "out of the data"):
            check_storage_outside_data(storage, name, data)
    with pytest.raises(ConfigError, match=f"^checkpoint.storage_path={tmp_path / 'data' / 'runs'} with "
                                          f"checkpoint.name='r1' puts the run's directory at data.path=data/runs/r1 "
                                          f"\\({tmp_path / 'data' / 'runs' / 'r1'}\\): "):
        check_storage_outside_data("data/runs", "r1", DataConfig(path="data/runs/r1"))
    with pytest.raises(ConfigError) as e:  # a URI is named as written, not as its normalized key
        check_storage_outside_data("s3://bucket/data/runs", None, DataConfig(path="s3://bucket/data/"))
    assert str(e.value).startswith("checkpoint.storage_path=s3://bucket/data/runs is inside data.path=s3://bucket/"
                                   "data/: "), str(e.value)
    data = os.path.realpath(tmp_path / "data")  # a path given resolved is not repeated in parentheses
    with pytest.raises(ConfigError, match=f"^checkpoint.storage_path={data}/runs is inside data.path={data}: "):
        check_storage_outside_data(f"{data}/runs", None, DataConfig(path=data))
    elsewhere = os.path.realpath(os.path.expanduser("~/elsewhere"))
    with pytest.raises(ConfigError, match=f"^checkpoint.storage_path={elsewhere} is inside data.eval_path=.*: .* read "
                                          f"as eval data"):
        check_storage_outside_data("~/elsewhere", None, DataConfig(path="x.jsonl", eval_path=str(pathlib.Path.home())))
    allowed = [("s3://bucket/database", None, DataConfig(path="s3://bucket/data")),  # a sibling, not inside
               ("data/runs", "r1", DataConfig(path="data/runs/r1/corpus")),  # the run writes beside it
               ("data/runs", "r2", DataConfig(path="data/runs/r1")),  # another run's directory
               ("org/name/runs", None, DataConfig(path="org/name", format="hf")),  # a hub id, not a directory here
               ("s3://bucket/data/runs", None, DataConfig(path="data"))]  # another filesystem
    for storage, name, data in allowed:
        check_storage_outside_data(storage, name, data)


def test_the_config_is_resolved_before_ray_unless_only_the_cluster_knows_the_shape(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the local cluster's GPUs, as Ray counts them
    cfg = load_config(None, ["training.max_steps=3", "scaling.use_gpu=false"])
    resolved = resolve_before_ray(cfg, inspect_sources(cfg.data))
    assert resolved is not None and resolved.cluster.num_workers == 2  # a local cluster: this machine's shape
    # the local cluster's CPUs: 2 workers x 1 CPU + 2 for Ray Data, or this machine's where it has more
    assert resolved.cluster.cpus_total == max(os.cpu_count(), 4) and resolved.cluster.gpus_per_node == 2
    on_gpus = load_config(None, ["scaling.use_gpu=true"])  # a worker per visible GPU
    assert resolve_before_ray(on_gpus, inspect_sources(on_gpus.data)).cluster.num_workers == 2
    for unstated in ([], ["scaling.num_workers=16"], ["scaling.use_gpu=true"]):
        joining = load_config(None, ["cluster.address=10.0.0.1:6379", *unstated])
        assert resolve_before_ray(joining, inspect_sources(joining.data)) is None  # the cluster's GPUs tell
    stated = ["cluster.address=10.0.0.1:6379", "scaling.num_workers=16", "scaling.use_gpu=true"]
    joined = resolve_before_ray(load_config(None, stated), inspect_sources(load_config(None, stated).data)).cluster
    # the nodes it joins are unknown here: not this machine's GPUs or CPUs
    assert (joined.num_workers, joined.gpus_per_node, joined.cpus_total) == (16, None, None)
    auto = load_config(None, [*stated, "training.micro_batch_size_per_gpu=auto"])
    assert resolve_before_ray(auto, inspect_sources(auto.data)) is None  # chosen for the cluster's memory
    # a local run's "auto" is chosen for this machine's RAM: a 70B-shaped model fits no micro-batch on CPU
    # (~1.7 TB a node for 2 workers; chosen for no target, it took micro-batch 128)
    big = load_config(None, ["training.micro_batch_size_per_gpu=auto", "scaling.use_gpu=false",
                             "model.config.hidden_size=8192", "model.config.num_hidden_layers=80",
                             "model.config.intermediate_size=28672", "model.config.num_attention_heads=64",
                             "model.config.num_key_value_heads=8"])
    with pytest.raises(ConfigError, match=r"^no setting of training.micro_batch_size_per_gpu fits: the closest, "
                                          r"micro-batch 1, .* host RAM per node"):
        resolve_before_ray(big, inspect_sources(big.data))
    # and the local cluster's worker placement, after the config's own errors: refused before ray.init
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    no_gpu = load_config(None, ["scaling.num_workers=2", "scaling.use_gpu=true"])
    with pytest.raises(ConfigError, match=r"^scaling.use_gpu=true, and the local Ray cluster this run starts \(one "
                                          r"node: \d+ CPUs, no GPU\) has no GPU: "):
        resolve_before_ray(no_gpu, inspect_sources(no_gpu.data))


def test_a_dry_run_prints_the_planners_verdict_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "runs"
    rc = main(["--dry-run", f"checkpoint.storage_path={storage}", "--host-memory-gib", "64", "scaling.num_workers=2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["cluster"]["num_workers"] == 2  # stdout stays the JSON
    lines = err.splitlines()  # what a real run would do with the storage, then the memory verdict
    assert lines[0].startswith(f"raytrain: note: a real run now starts a new run in {storage}, named "), lines
    assert lines[1].startswith("raytrain: memory: fits: this run needs ") and "the nodes have 64.0 GiB RAM" in err
    assert len(lines) == 2, lines
    assert list(tmp_path.iterdir()) == []
    if not hardware.gpus(use_torch=False):  # a GPU run planned on a machine without GPUs, no sizes stated
        assert main(["--dry-run", f"checkpoint.storage_path={storage}", "scaling.use_gpu=true",
                     "scaling.num_workers=8"]) == 0
        assert "raytrain: memory: not checked: this machine has no GPU" in capsys.readouterr().err


def test_a_local_storage_path_some_node_cannot_see_is_refused_naming_the_nodes(tmp_path):
    storage = tmp_path / "runs"  # not there yet: the marker goes where the run will create it
    with storage_marker(str(storage)) as marker:
        assert marker is not None and os.path.dirname(marker) == str(tmp_path) and not storage.exists()
        assert probe_node(False, marker)[1] is True  # the probe's answer on a node that shares the path
        assert sees_file(str(tmp_path / "elsewhere" / os.path.basename(marker)), retry_after_s=0) is False
    assert os.listdir(tmp_path) == []  # the marker is removed, no directory created
    with storage_marker("s3://bucket/runs") as marker:
        assert marker is None  # object storage is every node's
    assert probe_node(False, None)[1] is None  # not asked: one machine
    check_storage_shared(str(storage), {"10.0.0.1": True, "10.0.0.2": None})  # None: did not answer, not judged
    with pytest.raises(ConfigError) as e:
        check_storage_shared("/home/u/raytrain_runs", {"10.0.0.1": True, "10.0.0.3": False, "10.0.0.2": False})
    assert str(e.value) == (
        "checkpoint.storage_path=/home/u/raytrain_runs is not shared: node(s) 10.0.0.2, 10.0.0.3 cannot see it "
        "(a directory on the head's disk): set checkpoint.storage_path to s3://..., gs://..., or a filesystem "
        "mounted at the same path on every node")


def test_gpus_per_node_plans_a_gpu_target():
    cfg, shape, target = dry_run_target(load_config(None, ["scaling.num_workers=16"]), gpu_memory_gib=None,
                                        host_memory_gib=None, gpus_per_node=8)
    assert cfg.scaling.use_gpu is True and shape.use_gpu and shape.gpus_per_node == 8 and target.gpus_per_node == 8
    with pytest.raises(ConfigError, match="--gpus-per-node plans a GPU cluster but scaling.use_gpu=false"):
        dry_run_target(load_config(None, ["scaling.use_gpu=false"]), gpu_memory_gib=None, host_memory_gib=None,
                       gpus_per_node=8)


def refused(scaling: list[str], nodes: list[dict], use_gpu: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        check_placement(load_config(None, scaling).scaling, use_gpu, nodes, "the cluster", more_cpus="add CPUs",
                        more_nodes="add nodes")
    return str(e.value)


def test_a_placement_the_cluster_can_never_make_is_refused_naming_the_setting():
    """Ray Train would wait for it forever (a 40-line traceback every 60 s); checked against the nodes' totals."""
    h200 = {"CPU": 16.0, "GPU": 2.0, "accelerator_type:H200": 1.0}
    fits = load_config(None, ["scaling.num_workers=4", "scaling.accelerator_type=H200"]).scaling
    check_placement(fits, True, [h200, h200], "the cluster", more_cpus="", more_nodes="")
    assert "(Ray's names are case-sensitive: its nodes have 'H200')" in refused(
        ["scaling.num_workers=2", "scaling.accelerator_type=h200"], [h200], use_gpu=True)
    assert refused(["scaling.num_workers=6"], [h200, h200], use_gpu=True) == (
        "6 workers need a GPU each, and the cluster has 4: lower scaling.num_workers, or run on a cluster with more "
        "GPUs")
    assert refused(["scaling.num_workers=3", "scaling.placement_strategy=STRICT_SPREAD"], [h200, h200]).startswith(
        "scaling.placement_strategy=STRICT_SPREAD puts each of 3 workers on a node of its own, and the cluster has 2 "
        "node(s) that can hold one")
    # a worker's CPUs are on one node: 2 nodes of 3 CPUs hold 2 workers of 2 CPUs, not 3
    three = {"CPU": 3.0}
    assert "need 6 CPUs, and the cluster has 6; a worker's CPUs must be on one node, and its nodes hold 2" in refused(
        ["scaling.num_workers=3", "scaling.cpus_per_worker=2"], [three, three])
    # an elastic range must place its minimum only: Ray Train starts it with as many as it can
    check_placement(load_config(None, ["scaling.num_workers=[2, 8]"]).scaling, False, [three], "the cluster",
                    more_cpus="", more_nodes="")
    no_cpus = {"memory": 8e9}  # a head started with --num-cpus=0: Ray lists no CPU key
    assert refused(["scaling.num_workers=[4, 8]"], [three, no_cpus]) == (
        "the elastic range's minimum of 4 workers (scaling.num_workers=[4, 8]) x scaling.cpus_per_worker=1 need 4 "
        "CPUs, and the cluster has 3: lower scaling.cpus_per_worker (fractions work) or scaling.num_workers, or add "
        "CPUs")


def test_a_cluster_whose_autoscaler_says_its_node_types_is_judged_with_the_nodes_it_can_add():
    """Where the GCS holds the autoscaler's node types (raytrain.driver.cluster.autoscaler_node_types; no local
    cluster reports them), the nodes it can add count, up to each type's max count; -1 is unbounded."""
    head = {"CPU": 8.0}
    gpu_node = {"CPU": 32.0, "GPU": 8.0}
    two = with_addable_nodes([head], [(gpu_node, 2)], 24)
    assert two == [head, gpu_node, gpu_node]
    check_placement(load_config(None, ["scaling.num_workers=16"]).scaling, True, two, "the cluster",
                    more_cpus="", more_nodes="")
    assert refused(["scaling.num_workers=24"], two, use_gpu=True).startswith(
        "24 workers need a GPU each, and the cluster has 16")
    unbounded = with_addable_nodes([head], [(gpu_node, -1), ({"CPU": 4.0}, 0)], 24)
    assert len(unbounded) == 25  # as many as a group of 24 could use; a type of max 0 adds none
    check_placement(load_config(None, ["scaling.num_workers=24"]).scaling, True, unbounded, "the cluster",
                    more_cpus="", more_nodes="")


@pytest.mark.usefixtures("no_ray_driver")  # connected, resolve_before_ray leaves the judgement to the live cluster
def test_flash_attention_the_driver_lacks_is_refused_only_where_the_driver_runs_on_a_workers_node(
        monkeypatch, capsys, tmp_path):
    """The driver's packages stand for the workers' only where it runs on one of their nodes (a local cluster, a GPU
    node of the cluster it joined). A CPU head node, a laptop or a Ray Client has an environment of its own: the run
    goes on with a note, and a worker whose node lacks the package says so (test_model)."""
    from raytrain import model

    monkeypatch.setattr(model, "flash_attention_missing", lambda version: "the flash-attn package")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    flash = ["model.attn_implementation=flash_attention_2", "scaling.use_gpu=true", "scaling.num_workers=2",
             f"checkpoint.storage_path={tmp_path}"]
    # on a live cluster (raytrain.driver.cluster.live_shape): the driver's node among ray.nodes()' alive ones
    head, gpu = {"NodeID": "h", "Resources": {"CPU": 8.0}}, {"NodeID": "g", "Resources": {"CPU": 32.0, "GPU": 8.0}}
    assert runs_workers([head, gpu], "g", use_gpu=True)  # a driver on a GPU node: its image is the workers'
    assert not runs_workers([head, gpu], "h", use_gpu=True)  # the CPU head node
    assert not runs_workers([head, gpu], None, use_gpu=True)  # a Ray Client: the driver is on no node
    assert runs_workers([head, gpu], "h", use_gpu=False)  # a CPU run's workers may run on the head
    assert runs_workers([{"NodeID": "g", "Resources": {"CPU": 1.0, "GPU": 1.0}}], "g", use_gpu=True)  # one is a GPU
    # before ray.init: a local cluster is this machine, refused; a cluster joined is judged once connected
    local = load_config(None, flash)
    with pytest.raises(ConfigError, match=r"flash_attention_2 needs the flash-attn package, which is not installed "
                                          r"here: install it on the cluster's nodes, or set model.attn_implementation"):
        resolve_before_ray(local, inspect_sources(local.data))
    joined = load_config(None, [*flash, "cluster.address=10.0.0.1:6379"])
    assert resolve_before_ray(joined, inspect_sources(joined.data)).cluster.driver_on_worker_node is False
    # a dry run for stated sizes plans another cluster's nodes: it passes, with the note
    assert main(["--dry-run", *flash, "--gpu-memory-gib", "80", "--host-memory-gib", "64"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["cluster"]["driver_on_worker_node"] is False
    assert ("raytrain: note: model.attn_implementation=flash_attention_2 needs the flash-attn package, which this "
            "driver's node lacks; the workers run on other nodes") in err


@pytest.mark.usefixtures("no_ray_driver")
def test_a_gpu_run_on_this_machine_without_gpus_is_refused_before_ray(monkeypatch, capsys, tmp_path):
    """A real run without cluster.address starts a local cluster, whose GPUs would never come. (Its dry run
    plans for the shape asked, a GPU cluster elsewhere, unless the config says it is local: test_bad_input.)"""
    import ray

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for Ray's local cluster, whatever this machine has
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main([f"checkpoint.storage_path={tmp_path}", "scaling.use_gpu=true", "scaling.num_workers=2"]) == 2
    assert not ray.is_initialized() and os.listdir(tmp_path) == []
    assert capsys.readouterr().err == (
        "raytrain: error: scaling.use_gpu=true, and the local Ray cluster this run starts (one node: "
        f"{max(os.cpu_count(), 4)} CPUs, no GPU) has no GPU: set scaling.use_gpu=false to train on CPU, or run on a "
        "cluster with GPUs (cluster.address)\n")


def test_settings_that_do_nothing_get_a_note_each(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, ["scaling.gpu_memory_fraction=0.5", "scaling.replacement_timeout_s=5",
                             "cluster.num_cpus=8", "cluster.address=10.0.0.1:6379"])
    assert idle_settings(cfg, use_gpu=False) == [
        "scaling.gpu_memory_fraction=0.5 has no effect: it caps each worker's share of its GPU, and this run has no "
        "GPU (scaling.use_gpu=false)",
        "scaling.replacement_timeout_s=5 has no effect: it applies to an elastic run (scaling.num_workers=[min, max]), "
        "and this run has a fixed number of workers",
        "cluster.num_cpus=8 has no effect: it sizes the local cluster raytrain starts, and this run joins "
        "cluster.address=10.0.0.1:6379, whose nodes have the CPUs they were started with"]
    assert idle_settings(load_config(None, ["scaling.num_workers=[2, 4]", "scaling.resize_interval_s=5",
                                            "cluster.num_cpus=8"]), use_gpu=True) == []
    # and a dry run prints them (a real run too, after connecting)
    assert main(["--dry-run", f"checkpoint.storage_path={tmp_path}", "scaling.use_gpu=false", "scaling.num_workers=2",
                 "scaling.resize_interval_s=5"]) == 0
    assert "raytrain: note: scaling.resize_interval_s=5 has no effect" in capsys.readouterr().err


def test_a_deepspeed_config_that_turns_zero_off_on_several_workers_gets_a_note():
    # README's elastic example had `deepspeed: {train_batch_size: 24}`: DeepSpeed's stage 0 (and fp32), no word
    def zero_notes(*overrides, num_workers=None):
        return [n for n in idle_settings(load_config(None, list(overrides)), True, num_workers) if "zero_opt" in n]

    assert zero_notes('deepspeed={"train_batch_size": 24}', "scaling.num_workers=[2, 4]", "data.num_shards=12") == [
        "deepspeed.zero_optimization.stage is 0 (absent: DeepSpeed's default; a deepspeed section replaces raytrain's "
        "ZeRO-3 default whole) on 2 to 4 workers: every worker holds the whole model's parameters, gradients and "
        "optimizer states; set deepspeed.zero_optimization.stage=3 to partition them"]
    assert zero_notes("deepspeed.zero_optimization.stage=1", num_workers=8) == [
        "deepspeed.zero_optimization.stage=1 on 8 workers: every worker holds the whole model's parameters and "
        "gradients (stage 1 partitions only the optimizer states); set deepspeed.zero_optimization.stage=3 to "
        "partition them"]
    assert zero_notes("deepspeed.zero_optimization.stage=0", "scaling.num_workers=1") == []  # nothing to partition
    assert zero_notes("deepspeed.zero_optimization.stage=0") == []  # workers unknown (one per GPU of the cluster)
    assert zero_notes("deepspeed.zero_optimization.stage=2", "scaling.num_workers=8") == []
    assert zero_notes("scaling.num_workers=8") == []  # the default: ZeRO-3
    assert zero_notes("deepspeed.zero_optimization=null", "scaling.num_workers=2") == [  # read as no section: stage 0
        "deepspeed.zero_optimization.stage is 0 (deepspeed.zero_optimization is null: no ZeRO section, so DeepSpeed's "
        "default) on 2 workers: every worker holds the whole model's parameters, gradients and optimizer states; set "
        "deepspeed.zero_optimization.stage=3 to partition them"]


def test_data_training_and_offload_settings_that_do_nothing_get_a_note_each():
    # each ran without a word: no held-out data to evaluate, no column in the built-in corpus, a warmup longer
    # than the run, an offload share with nothing offloaded
    cfg = load_config(None, ["data.eval_every_n_steps=10", "data.text_column=body", "training.warmup_steps=100",
                             "training.max_steps=50",
                             "deepspeed.zero_optimization.offload_optimizer={device: none, ratio: 0.5}"])
    assert idle_settings(cfg, use_gpu=False) == [
        "data.eval_every_n_steps=10 has no effect: it sets how often the held-out data is evaluated, and this run "
        "has none: set data.eval_path or data.eval_fraction",
        "data.text_column='body' has no effect: it names the documents' column in data.path's files, and this run "
        "trains on the built-in corpus (data.path is null)",
        "training.warmup_steps=100 is more than training.max_steps=50: the learning rate is still warming up when "
        "the run ends, so it never reaches its peak (training.learning_rate) and never decays; set "
        "training.warmup_steps below 50",
        "deepspeed.zero_optimization.offload_optimizer.ratio=0.5 has no effect: it is the share of the optimizer "
        "states offloaded, and offload_optimizer.device is none: set the device to cpu to offload that share, or "
        "drop ratio"]
    # held-out data is read by data.text_column beside the built-in corpus: the column takes effect there (the
    # note said "no effect", and removing the key made the eval file's first record an error)
    assert idle_settings(load_config(None, ["data.text_column=body", "data.eval_path=held.jsonl"]),
                         use_gpu=False) == []
    # only what the user set: the default warmup (10) beyond a short run, and settings that take effect, are not named
    assert idle_settings(load_config(None, [
        "training.max_steps=3", "data.eval_fraction=0.1", "data.eval_every_n_steps=2", "training.warmup_steps=3",
        "deepspeed.zero_optimization.offload_optimizer={device: cpu, ratio: 0.5}"]), use_gpu=False) == []


def test_deepspeed_keys_that_only_parts_of_deepspeed_raytrain_never_runs_read_get_a_note():
    # each passed without a word: DeepSpeed's data loader, autotuner and pipeline engine never run in raytrain
    def notes(extra):
        return idle_settings(load_config(None, ['deepspeed={"zero_optimization": {"stage": 3}, %s}' % extra]),
                             use_gpu=False)

    assert notes('"dataloader_drop_last": true') == [
        "deepspeed.dataloader_drop_last has no effect: only DeepSpeed's data loader reads it, and raytrain's data "
        "comes from Ray Data (each tokenize batch's tail shorter than data.seq_len is dropped): remove it"]
    assert [n.split(":")[0] for n in notes('"data_efficiency": {"enabled": true}, "autotuning": {"enabled": true}, '
                                           '"pipeline": {"stages": "auto"}')] == [
        "deepspeed.data_efficiency has no effect", "deepspeed.autotuning has no effect",
        "deepspeed.pipeline has no effect"]
    assert notes('"data_efficiency": {"enabled": false}, "autotuning": {"enabled": false}') == []  # off already


def test_a_users_model_on_the_built_in_corpus_gets_a_note(tmp_path):
    # `data.path:` left empty in a YAML (null) trained the user's model on generated stories without a word
    (tmp_path / "run.yaml").write_text(f"model:\n  name_or_path: {tmp_path}/my-model\ndata:\n  path:\n")
    assert idle_settings(load_config(str(tmp_path / "run.yaml"), []), use_gpu=False) == [
        f"data.path is null: this run trains model.name_or_path={tmp_path}/my-model on raytrain's built-in corpus "
        f"(generated short stories, for trying a setup out); set data.path to your data"]
    assert idle_settings(load_config(None, []), use_gpu=False) == []  # the built-in model: the demo, as meant
    # a corpus sized on purpose (raytrain.tools.bench --model-dir): meant too
    assert idle_settings(load_config(str(tmp_path / "run.yaml"), ["data.num_builtin_documents=64"]),
                         use_gpu=False) == []


def test_zero_3_keys_at_a_lower_stage_get_one_note_and_auto_ones_none():
    # a stage-3 JSON turned to stage 2 kept its tuning without a word: DeepSpeed reads none of it there
    def notes(*overrides):
        return idle_settings(load_config(None, list(overrides)), use_gpu=False)

    assert notes("deepspeed.zero_optimization.stage=2", "deepspeed.zero_optimization.stage3_max_live_parameters=1e8",
                 "deepspeed.zero_optimization.max_reuse_distance=100") == [
        "deepspeed.zero_optimization.stage3_max_live_parameters, deepspeed.zero_optimization.max_reuse_distance have "
        "no effect: DeepSpeed reads them at ZeRO stage 3 only, and deepspeed.zero_optimization.stage is 2: remove "
        "them, or set the stage to 3"]
    # the default's "auto" stage3_ keys (raytrain fills them) under a stage override alone: nothing to say
    assert notes("deepspeed.zero_optimization.stage=2") == []
    assert notes("deepspeed.zero_optimization.stage3_max_live_parameters=100") == []  # stage 3: it takes effect


def test_an_optimizer_lr_that_the_scheduler_replaces_with_its_own_peak_gets_a_note(tmp_path):
    # WarmupDecayLR without warmup_max_lr warms up to DeepSpeed's 0.001, ten times this optimizer's lr, without a word
    # (DeepSpeed's documented default, so a note rather than a refusal; test_config pins the 0.001)
    def ds(**params):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {
            "lr": 1e-4}}, "scheduler": {"type": "WarmupDecayLR", "params": {
                "warmup_num_steps": 10, "total_num_steps": 100, **params}}}))
        return load_config(None, [f"deepspeed={path}"])

    assert idle_settings(ds(), use_gpu=False) == [
        f"deepspeed.optimizer.params.lr=0.0001 (in {tmp_path / 'ds.json'}) has no effect on the peak learning rate: "
        f"deepspeed.scheduler (WarmupDecayLR) has no params.warmup_max_lr, so DeepSpeed warms up to its own 0.001; "
        f"write \"warmup_max_lr\": 0.0001 there"]
    assert idle_settings(ds(warmup_max_lr=1e-4), use_gpu=False) == []


def test_the_readmes_elastic_example_trains_zero_3_in_bf16_on_gpus(tmp_path):
    from raytrain.deepspeed_config import resolve_deepspeed

    readme = (pathlib.Path(__file__).parents[3] / "README.md").read_text()
    section = readme[readme.index("## Elastic training"):]
    example = section[section.index("```yaml\n") + 8:section.index("```\n", section.index("```yaml"))]
    (tmp_path / "elastic.yaml").write_text(example)
    cfg = load_config(str(tmp_path / "elastic.yaml"))
    for world_size in (2, 3, 4):
        ds = resolve_deepspeed(cfg.deepspeed, cfg.training, world_size=world_size, use_gpu=True, hidden_size=64)
        assert (ds["zero_optimization"]["stage"], ds["bf16"]["enabled"], ds["train_batch_size"]) == (3, True, 24), ds
    assert idle_settings(cfg, use_gpu=True) == []


@pytest.mark.usefixtures("no_ray_driver")
def test_an_address_nothing_answers_at_is_one_line_before_ray_init(capsys, tmp_path, monkeypatch):
    """Without the probe, ray.init retried in Ray's C++ client for minutes, with no line of raytrain's."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # connect() would set it for the rest of this process
    with socket.socket() as s:  # a port nothing listens on: bound, never listened, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main([f"checkpoint.storage_path={tmp_path}", f"cluster.address=127.0.0.1:{port}"]) == 2
    out, err = capsys.readouterr()
    assert err == (f"raytrain: error: cluster.address=127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} "
                   f"(Connection refused): start the cluster (ray start --head) or fix the address (the head's GCS "
                   f"port, 6379 by default; ray://HOST:10001 for Ray Client), or unset it for a local cluster\n"), err
    assert not ray.is_initialized()


def test_worker_lines_have_no_colour_codes_in_redirected_output(monkeypatch):
    """Ray colours each worker line's prefix unless RAY_COLOR_PREFIX=0, which the driver sets when its output
    is not a terminal (under pytest it is captured), and leaves alone when the user set it."""
    from ray._private.worker import print_worker_logs

    import ipykernel  # noqa: F401  (imported, as some test of the suite does, in a process that is no notebook)

    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    _plain_worker_prefixes()
    assert os.environ["RAY_COLOR_PREFIX"] == "1"  # the user's
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    _plain_worker_prefixes()
    out = io.StringIO()
    print_worker_logs({"pid": 4242, "ip": "10.0.0.2", "localhost": "10.0.0.1", "lines": ["step 1/80"]}, out)
    assert out.getvalue() == "(pid=4242, ip=10.0.0.2) step 1/80\n"


def test_a_storage_path_without_room_for_the_checkpoints_the_run_keeps_gets_a_note_with_the_sizes(tmp_path):
    import shutil

    from raytrain.driver.checks import checkpoint_space_note
    from raytrain.driver.run import dry_run

    # Llama-70B-shaped: 70.6B parameters x 12 bytes (fp32 master + Adam) = 788.5 GiB a checkpoint, 3 at once
    storage = tmp_path / "runs"
    args = [f"checkpoint.storage_path={storage}", "checkpoint.name=big"]
    big, notes = dry_run(load_config("configs/llama-70b-ib.yaml", args), gpu_memory_gib=80, host_memory_gib=1500,
                         gpus_per_node=8)
    free = shutil.disk_usage(tmp_path).free
    assert free < 3 * 788.5 * 2**30  # this machine's disk: what the note is about
    note = checkpoint_space_note(big)
    assert note.startswith(f"checkpoint.storage_path={storage} has ") and not storage.exists()  # nothing created
    assert ("free, and this run keeps up to 3 checkpoints of about 788.5 GiB there at once (12 bytes a parameter: "
            "master weights and optimizer states; checkpoint.num_to_keep=2, and the next is written before the oldest "
            "is deleted)") in note
    assert f"note: {note}" in notes  # the dry run says it too
    # a continued run's own checkpoints are freed as new ones come: they count as room
    (storage / "big" / "checkpoint_step_00000100").mkdir(parents=True)
    with open(storage / "big" / "checkpoint_step_00000100" / "shard.pt", "wb") as f:
        f.truncate(3 * 789 * 2**30)  # sparse: its size, not its blocks
    assert checkpoint_space_note(big) is None
    tiny, _ = dry_run(load_config(None, [f"checkpoint.storage_path={tmp_path}"]))
    assert checkpoint_space_note(tiny) is None  # 820,352 parameters: room


def test_the_paths_and_the_environments_address_are_checked_before_ray(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    storage = f"checkpoint.storage_path={tmp_path / 'runs'}"
    with pytest.raises(ConfigError, match=r"^checkpoint.resume_from=.*missing is not a raytrain checkpoint"):
        check_before_ray(load_config(None, [storage, f"checkpoint.resume_from={tmp_path / 'missing'}"]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("x")
    with pytest.raises(ConfigError, match=r"^checkpoint.export_dir .*out exists and is not empty"):
        check_before_ray(load_config(None, [storage, f"checkpoint.export_dir={tmp_path / 'out'}"]))
    # the dashboard's address in RAY_ADDRESS is refused where cluster.address does not override it
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(ConfigError, match=r"^the environment's RAY_ADDRESS='http://127.0.0.1:8265' is the dashboard's"):
        check_ray_address(None)
    check_ray_address("10.0.0.1:6379")


def test_the_local_clusters_cpus_and_gpus(monkeypatch):
    # this machine as 3 CPUs, so that each rule's own count shows
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")

    def cpus(*overrides):
        cfg = load_config(None, list(overrides))
        return local_cluster_cpus(cfg.cluster, cfg.scaling)

    assert cpus("cluster.num_cpus=5", "scaling.num_workers=8") == 5  # the user's number, as given
    assert cpus("scaling.num_workers=[2, 8]") == 10  # an elastic range's maximum, 8, + 2 for Ray Data
    assert cpus("scaling.num_workers=6", "scaling.cpus_per_worker=2") == 14  # 6 x 2 + 2
    assert cpus() == 8  # a worker per visible GPU: 6 + 2
    assert cpus("scaling.use_gpu=false") == 4  # 2 CPU workers + 2
    assert cpus("scaling.num_workers=1", "scaling.cpus_per_worker=0.5") == 3  # int(0.5) + 2 < this machine's 3
    assert _local_gpus() == 6
    for visible, count in (("0,2", 2), ("-1", 0), ("", 0)):  # Ray counts CUDA_VISIBLE_DEVICES, "-1" is none
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert _local_gpus() == count, visible


def test_the_local_placement_counts_this_machines_visible_gpus(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    # scaling.use_gpu unset: a GPU run, as there is a GPU here (Ray's local cluster gets 1)
    with pytest.raises(ConfigError, match=r"^2 workers need a GPU each, and the local Ray cluster this run starts "
                                          r"\(one node: 4 CPUs, 1 GPUs\) has 1: "):
        check_local_placement(load_config(None, ["scaling.num_workers=2"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"^2 workers x scaling.cpus_per_worker=1 need 2 CPUs, and the local Ray "
                                          r"cluster this run starts \(one node: cluster.num_cpus=1, no GPU\) has 1: "):
        check_local_placement(load_config(None, ["scaling.num_workers=2", "cluster.num_cpus=1"]))
    # the local node's accelerator type is the one Ray reads from this machine's GPU (pynvml; None without one),
    # and only where Ray's local cluster gets a GPU
    kind = hardware.ray_accelerator_type()
    for visible, has in (("0", f" (its nodes have {kind})" if kind else ", nor any other"), ("", ", nor any other")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with pytest.raises(ConfigError) as e:
            check_local_placement(load_config(None, ["scaling.num_workers=1", "scaling.use_gpu=true",
                                                     "scaling.accelerator_type=TPU-V4"]))
        assert str(e.value).startswith(f"scaling.accelerator_type='TPU-V4': no node of the local Ray cluster this run "
                                       f"starts (one node: 3 CPUs, {'1 GPUs' if visible else 'no GPU'}) has that "
                                       f"accelerator type{has}"), (visible, str(e.value))
    # scaling.use_gpu given wins over the GPUs here: CPU workers on a machine with a GPU, a GPU run on one without
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    check_local_placement(load_config(None, ["scaling.num_workers=2", "scaling.use_gpu=false"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"^scaling.use_gpu=true, and the local Ray cluster this run starts \(one "
                                          r"node: 4 CPUs, no GPU\) has no GPU: set scaling.use_gpu=false"):
        check_local_placement(load_config(None, ["scaling.num_workers=2", "scaling.use_gpu=true"]))


@pytest.mark.parametrize("visible, error", [
    ("0", None),  # the type of this machine's GPU, as Ray names it: the worker is placed
    ("", ", nor any other"),  # no GPU for Ray's local cluster: Ray gives its node no accelerator type
], ids=["a GPU", "no GPU"])
def test_the_local_nodes_accelerator_type_is_this_machines_where_ray_gives_it_a_gpu(visible, error, monkeypatch):
    """scaling.accelerator_type on the local cluster: its node has the type Ray reads from this machine's GPU (here
    H100, raytrain.hardware.ray_accelerator_type's answer on an H100 machine), and only where Ray gets a GPU."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(hardware, "ray_accelerator_type", lambda: "H100")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = load_config(None, ["scaling.num_workers=1", "scaling.use_gpu=true", "scaling.accelerator_type=H100"])
    if error is None:
        check_local_placement(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_local_placement(cfg)
    assert str(e.value).startswith("scaling.accelerator_type='H100': no node of the local Ray cluster this run "
                                   f"starts (one node: {max(os.cpu_count(), 3)} CPUs, no GPU) has that accelerator "
                                   f"type{error}"), str(e.value)


def test_a_dry_run_checks_the_local_placement_only_where_the_config_says_the_run_is_local(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def local(*overrides):
        return plans_local_cluster(load_config(None, list(overrides)).cluster)

    assert local("cluster.address=local") and local("cluster.num_cpus=4")
    assert not local() and not local("cluster.address=10.0.0.1:6379", "cluster.num_cpus=4")
    cramped = load_config(None, ["cluster.num_cpus=1", "scaling.num_workers=2", "scaling.use_gpu=false"])
    with pytest.raises(ConfigError, match=r"^2 workers x scaling.cpus_per_worker=1 need 2 CPUs"):
        check_dry_run_placement(cramped, None, None, None)
    check_dry_run_placement(cramped, 64, None, None)  # sizes stated: another cluster's nodes


def test_a_dry_runs_target_is_the_stated_sizes_else_this_machine(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, ["scaling.num_workers=2"])
    with pytest.raises(ConfigError, match=r"^--host-memory-gib must be positive, got 0$"):
        dry_run_target(cfg, gpu_memory_gib=None, host_memory_gib=0, gpus_per_node=None)
    # RAM alone plans CPU workers (use_gpu stays unset)
    planned, shape, target = dry_run_target(cfg, gpu_memory_gib=None, host_memory_gib=0.5, gpus_per_node=None)
    assert planned.scaling.use_gpu is None and not shape.use_gpu and target == hardware.Target(None, 2**29, None)
    planned, shape, target = dry_run_target(cfg, gpu_memory_gib=80, host_memory_gib=None, gpus_per_node=None)
    assert planned.scaling.use_gpu is True and target == hardware.Target(80 * 2**30, None, None)
    with pytest.raises(ConfigError, match=r"^--gpu-memory-gib plans a GPU cluster but scaling.use_gpu=false"):
        dry_run_target(load_config(None, ["scaling.use_gpu=false"]), gpu_memory_gib=80, host_memory_gib=None,
                       gpus_per_node=None)
    # no sizes: this machine, whose RAM is a CPU run's target and whose node runs the local cluster's workers
    here = hardware.this_machine()
    _, shape, target = dry_run_target(load_config(None, ["scaling.use_gpu=false"]), gpu_memory_gib=None,
                                      host_memory_gib=None, gpus_per_node=None)
    assert target == hardware.Target(None, here.host_memory_bytes, None) and shape.driver_on_worker_node
    assert shape.cpus_total is None and shape.gpus_per_node == here.gpus_per_node  # no local cluster stated
    _, shape, _ = dry_run_target(load_config(None, ["scaling.use_gpu=false", "cluster.num_cpus=6"]),
                                 gpu_memory_gib=None, host_memory_gib=None, gpus_per_node=None)
    assert shape.cpus_total == 6
    _, shape, _ = dry_run_target(load_config(None, ["scaling.use_gpu=false", "cluster.address=10.0.0.1:6379"]),
                                 gpu_memory_gib=None, host_memory_gib=None, gpus_per_node=None)
    assert not shape.driver_on_worker_node  # a cluster elsewhere
    # a GPU run planned here: this machine's GPUs, or nothing to plan against without one
    _, _, target = dry_run_target(load_config(None, ["scaling.use_gpu=true", "scaling.num_workers=2"]),
                                  gpu_memory_gib=None, host_memory_gib=None, gpus_per_node=None)
    assert target == (here if here.gpu_memory_bytes else None)
    # on a machine with GPUs (here 8 x 80 GiB, what hardware.this_machine reads there): they are the target
    node = hardware.Target(80 * 2**30, 512 * 2**30, 8)
    monkeypatch.setattr(hardware, "this_machine", lambda: node)
    _, shape, target = dry_run_target(load_config(None, ["scaling.use_gpu=true", "scaling.num_workers=2"]),
                                      gpu_memory_gib=None, host_memory_gib=None, gpus_per_node=None)
    assert target == node and shape.gpus_per_node == 8 and shape.driver_on_worker_node


def test_placements_at_the_edges_of_each_rule():
    two = {"CPU": 2.0}
    # STRICT_PACK: all on one node; 5 workers on nodes of 2 and 3 CPUs fit anywhere (5), on one node 3
    assert refused(["scaling.num_workers=5", "scaling.placement_strategy=STRICT_PACK"], [two, {"CPU": 3.0}]) == (
        "scaling.placement_strategy=STRICT_PACK puts all of 5 workers on one node, and a node of the cluster holds at "
        "most 3: use PACK or SPREAD, or fewer workers")
    assert refused(["scaling.num_workers=1", "scaling.placement_strategy=STRICT_PACK"], []).startswith(
        "1 workers x scaling.cpus_per_worker=1 need 1 CPUs, and the cluster has 0")  # no node: none holds one
    check_placement(load_config(None, ["scaling.num_workers=2", "scaling.placement_strategy=STRICT_PACK"]).scaling,
                    False, [two, two], "the cluster", more_cpus="", more_nodes="")
    assert refused(["scaling.num_workers=4", "scaling.placement_strategy=STRICT_SPREAD"], [two, two]).startswith(
        "scaling.placement_strategy=STRICT_SPREAD puts each of 4 workers on a node of its own, and the cluster has 2 "
        "node(s) that can hold one")
    one = {"CPU": 1.0}  # STRICT_SPREAD: a node that holds exactly one worker counts
    check_placement(load_config(None, ["scaling.num_workers=2", "scaling.placement_strategy=STRICT_SPREAD"]).scaling,
                    False, [one, one], "the cluster", more_cpus="", more_nodes="")
    check_placement(load_config(None, ["scaling.num_workers=1"]).scaling, False, [one], "the cluster", more_cpus="",
                    more_nodes="")
    # all CPUs on one node, but too few: no note about splitting (3 < 2 x 2)
    assert refused(["scaling.num_workers=2", "scaling.cpus_per_worker=2"], [{"CPU": 3.0}]) == (
        "2 workers x scaling.cpus_per_worker=2 need 4 CPUs, and the cluster has 3: lower scaling.cpus_per_worker "
        "(fractions work) or scaling.num_workers, or add CPUs")
    # scaling.num_workers unset: 2 CPU workers, or one per GPU (3 here, one node having no GPU key)
    assert refused([], [one]).startswith("2 workers x scaling.cpus_per_worker=1 need 2 CPUs, and the cluster has 1")
    gpus = [{"CPU": 2.0, "GPU": 3.0}, {"CPU": 8.0}]
    # every resource is there (3 GPUs, 10 CPUs), but a GPU node holds 2 workers' CPUs
    assert refused([], gpus, use_gpu=True) == (
        "3 workers need CPU 1, GPU 1 each, and the cluster can place 2: lower scaling.num_workers or "
        "scaling.cpus_per_worker, or add nodes")
    # the accelerator type's node holds one worker; 2 GPUs and 2 CPUs, exactly enough, are on two nodes
    h200 = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:H200": 1.0}
    assert refused(["scaling.num_workers=2", "scaling.accelerator_type=H200"], [h200, {"CPU": 1.0, "GPU": 1.0}],
                   use_gpu=True) == (
        "2 workers need CPU 1, GPU 1, accelerator_type:H200 0.001 each, and the cluster can place 1: lower "
        "scaling.num_workers or scaling.cpus_per_worker, or add nodes")
    # an accelerator type no node has: the types they have (0 of one: none), or none at all
    assert refused(["scaling.accelerator_type=L4"], [h200, {"CPU": 4.0, "accelerator_type:A100": 0.0}],
                   use_gpu=True) == (
        "scaling.accelerator_type='L4': no node of the cluster has that accelerator type (its nodes have H200): set "
        "it to one they have, or unset it (null)")
    assert refused(["scaling.accelerator_type=L4"], [two]).startswith(
        "scaling.accelerator_type='L4': no node of the cluster has that accelerator type, nor any other (Ray gives")
    # a GPU run on CPU nodes: the fix is use_gpu=false or a cluster with GPUs, not fewer workers
    assert refused(["scaling.num_workers=1"], [{"CPU": 8.0}], use_gpu=True) == (
        "scaling.use_gpu=true, and the cluster has no GPU: set scaling.use_gpu=false to train on CPU, or run on a "
        "cluster with GPUs (cluster.address)")
    # Ray Train's share of the accelerator resource per worker (ray/air/config.py, ray 2.60.0)
    scaling = load_config(None, ["scaling.accelerator_type=H200"]).scaling
    assert worker_bundle(scaling, True) == {"CPU": 1.0, "GPU": 1.0, "accelerator_type:H200": 0.001}


def test_the_memory_verdict_of_an_elastic_range_is_its_tightest_size():
    """GPU bytes per worker are largest at the fewest workers (ZeRO-3), host RAM per node at the most (a worker
    process's own: ~4 GiB with a GPU, ~1 GiB on CPU, for this tiny model): the verdict is the size closest to
    either limit. The sizes quoted are the planner's for each world size."""
    from raytrain.hardware import Target
    from raytrain.planning.memory import DoesNotFit
    from raytrain.planning.resolve import resolve_run, shape_from_config

    def elastic(use_gpu):
        cfg = load_config(None, ["scaling.num_workers=[2, 4]", f"scaling.use_gpu={use_gpu}", "data.num_shards=12",
                                 "deepspeed.train_batch_size=24", "training.micro_batch_size_per_gpu=2"])
        return resolve_run(cfg, shape_from_config(cfg))

    gpu, cpu = elastic("true"), elastic("false")
    assert tightest(gpu).cluster.num_workers == 2
    gib = 2**30
    # 64 MiB GPUs: 13 MiB a GPU at 2 workers is the tightest (20%); the host's 8 GiB of 500 are far
    assert check_memory(gpu, Target(64 * 2**20, 500 * gib, 8)).startswith(
        "memory: fits: this run needs 13 MiB per GPU and 8.0 GiB host RAM per node")
    # 64 GiB nodes: 4 workers' 16 GiB is the tightest (25%), the GPUs' 80 GiB far; so too with the GPUs unknown
    for target in (Target(80 * gib, 64 * gib, 8), Target(None, 64 * gib, 8)):
        assert "needs 10 MiB per GPU and 16.0 GiB host RAM per node" in check_memory(gpu, target), target
    # RAM unknown: the GPU's share decides (2 workers)
    assert "13 MiB per GPU and 8.0 GiB" in check_memory(gpu, Target(80 * gib, None, 8))
    # CPU workers: host RAM alone, also where the target has GPUs (4 workers: 4.1 GiB, 26% of 16)
    for target in (Target(None, 16 * gib, None), Target(64 * 2**20, 16 * gib, None)):
        assert check_memory(cpu, target).startswith("memory: fits: this run needs 4.1 GiB host RAM per node (4 "
                                                    "workers x 16 MiB)"), target
    with pytest.raises(DoesNotFit, match=r"^scaling.num_workers=\[2, 4\], at world size 2: this run needs 13 MiB per "
                                         r"GPU and 8.0 GiB host RAM per node"):
        check_memory(gpu, Target(80 * gib, 8 * gib, 8))
    fixed = load_config(None, ["scaling.num_workers=2", "scaling.use_gpu=true"])
    with pytest.raises(DoesNotFit, match=r"^this run needs "):
        check_memory(resolve_run(fixed, shape_from_config(fixed)), Target(80 * gib, 1 * gib, 8))


def test_idle_settings_name_the_source_and_pass_what_they_cannot_read(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert idle_settings(load_config(None, ["cluster.num_cpus=8", "scaling.num_workers=2"]), use_gpu=False) == [
        "cluster.num_cpus=8 has no effect: it sizes the local cluster raytrain starts, and this run joins the "
        "environment's RAY_ADDRESS=10.0.0.1:6379, whose nodes have the CPUs they were started with"]
    monkeypatch.delenv("RAY_ADDRESS")
    sched = '"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}'
    # an inline section: no file to name
    assert idle_settings(load_config(None, [f'deepspeed={{"optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4}}}}, '
                                            f'{sched}}}']), use_gpu=False) == [
        "deepspeed.optimizer.params.lr=0.0001 has no effect on the peak learning rate: deepspeed.scheduler "
        "(WarmupDecayLR) has no params.warmup_max_lr, so DeepSpeed warms up to its own 0.001; write "
        "\"warmup_max_lr\": 0.0001 there"]
    # no lr to compare, no scheduler, an offload ratio of 1 (DeepSpeed's default), a malformed ZeRO section
    for section in (f'deepspeed={{"optimizer": {{"type": "AdamW"}}, {sched}}}',
                    'deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}',
                    "deepspeed.zero_optimization.offload_optimizer={device: none, ratio: 1}"):
        assert idle_settings(load_config(None, [section]), use_gpu=False) == [], section
    assert zero_stage_note(load_config(None, ["deepspeed.zero_optimization=3"]), 8) is None


def test_the_checkpoints_a_run_keeps_are_counted_by_their_bytes(tmp_path):
    import dataclasses
    import shutil

    from raytrain.driver.checks import checkpoint_space_note
    from raytrain.driver.run import dry_run

    def note(*overrides):
        big, _ = dry_run(load_config("configs/llama-70b-ib.yaml", [
            f"checkpoint.storage_path={tmp_path / 'runs'}", "checkpoint.name=big", *overrides]), gpu_memory_gib=80,
            host_memory_gib=1500, gpus_per_node=8)
        return big, checkpoint_space_note(big)

    assert shutil.disk_usage(tmp_path).free < 788 * 2**30  # this machine's disk: less than either note asks
    # bf16 master weights and moments: 2 + 4 bytes a parameter, 70,553,706,496 x 6 = 394.2 GiB
    _, six = note("deepspeed.bf16.bf16_master_weights_and_grads=true", "deepspeed.bf16.bf16_optimizer_states=true")
    assert "keeps up to 3 checkpoints of about 394.2 GiB there at once (6 bytes a parameter: " in six
    big, final = note("checkpoint.every_n_steps=0")  # the final checkpoint only
    assert "keeps up to 1 checkpoints of about 788.5 GiB" in final
    remote = big.config.with_overrides(["checkpoint.storage_path=s3://bucket/runs"])
    assert checkpoint_space_note(dataclasses.replace(big, config=remote)) is None  # no free space to ask
    # a run's own checkpoints: the files of its checkpoint_* directories, not a link's or another directory's
    for name, size in (("checkpoint_step_00000010", 10), ("checkpoint_step_00000020/sub", 5), ("other", 100)):
        (tmp_path / "run" / name).mkdir(parents=True)
        (tmp_path / "run" / name / "shard").write_bytes(b"x" * size)
    (tmp_path / "run" / "checkpoint_link").symlink_to(tmp_path / "run" / "other")
    (tmp_path / "run" / "checkpoint_file").write_bytes(b"x" * 1000)
    assert _dir_bytes(str(tmp_path / "run"), "checkpoint_") == 15


@pytest.mark.usefixtures("no_ray_driver")
def test_an_elastic_range_on_the_local_cluster_is_noted_as_never_resizing(tmp_path, capsys, monkeypatch):
    # was: a [1, 2] range on raytrain's own one-node cluster trained at one size, and nothing said it never resizes
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = ["--dry-run", "--host-memory-gib", "64", f"checkpoint.storage_path={tmp_path}", "data.num_shards=2"]
    note = ("raytrain: note: scaling.num_workers=[1, 2] runs on the one-node local cluster raytrain starts here, "
            "which loses and gains no node: the run keeps the size it starts at and never resizes; an elastic run "
            "needs a cluster of several nodes (cluster.address, or ray job submit)")
    assert main([*argv, "scaling.num_workers=[1, 2]", "cluster.address=local"]) == 0
    assert note in capsys.readouterr().err.splitlines()
    # a dry run without cluster.address may plan what `ray job submit` runs elsewhere; a fixed size never resizes
    for given in (["scaling.num_workers=[1, 2]"], ["scaling.num_workers=2", "cluster.address=local"]):
        assert main([*argv, *given]) == 0
        assert "one-node local cluster" not in capsys.readouterr().err
    scaling = {"scaling": {"num_workers": [1, 2]}, "data": {"num_shards": 2}}
    assert local_elastic_note(load_config(None, values={**scaling, "cluster": {"address": "h:6379"}})) == []
    assert len(local_elastic_note(load_config(None, values=scaling))) == 1  # the real run, not yet connected
