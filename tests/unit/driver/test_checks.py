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
from raytrain.driver.checks import (check_placement, check_storage_outside_data, check_writable_dir, dry_run_target,
                                    idle_settings, resolve_before_ray)
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


def test_storage_inside_data_is_compared_resolved_and_by_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "runs" / "r1" / "corpus").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    refused = [("s3://bucket/data/runs", None, DataConfig(path="s3://bucket/data/")),
               ("gcs://bucket/data/runs", None, DataConfig(path=["gs://bucket/data"])),
               ("./data/../data", None, DataConfig(path="link")),  # the same directory, through a link
               ("data/runs", "r1", DataConfig(path="data/runs/r1"))]  # the run's own directory
    for storage, name, data in refused:
        with pytest.raises(ConfigError, match="^checkpoint.storage_path=.*: the run's checkpoints, logs and summaries "
                                              "would be read as (training|eval) data: move checkpoint.storage_path "
                                              "out of the data"):
            check_storage_outside_data(storage, name, data)
    with pytest.raises(ConfigError, match=f"^checkpoint.storage_path={tmp_path / 'data' / 'runs'} with "
                                          f"checkpoint.name='r1' puts the run's directory at data.path=data/runs/r1 "
                                          f"\\({tmp_path / 'data' / 'runs' / 'r1'}\\): "):
        check_storage_outside_data("data/runs", "r1", DataConfig(path="data/runs/r1"))
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
    cfg = load_config(None, ["training.max_steps=3"])
    resolved = resolve_before_ray(cfg, inspect_sources(cfg.data))
    assert resolved is not None and resolved.cluster.num_workers == 2  # a local cluster: this machine's shape
    joining = load_config(None, ["cluster.address=10.0.0.1:6379"])
    assert resolve_before_ray(joining, inspect_sources(joining.data)) is None  # its GPUs are the cluster's to tell
    stated = load_config(None, ["cluster.address=10.0.0.1:6379", "scaling.num_workers=16", "scaling.use_gpu=true"])
    assert resolve_before_ray(stated, inspect_sources(stated.data)).cluster.num_workers == 16


def test_a_dry_run_prints_the_planners_verdict_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "runs"
    rc = main(["--dry-run", f"checkpoint.storage_path={storage}", "--host-memory-gib", "64", "scaling.num_workers=2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["cluster"]["num_workers"] == 2  # stdout stays the JSON
    assert err.startswith("raytrain: memory: fits: this run needs ") and "the nodes have 64.0 GiB RAM" in err
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
    assert refused(["scaling.num_workers=[4, 8]"], [three]).startswith(
        "the elastic range's minimum of 4 workers (scaling.num_workers=[4, 8]) x scaling.cpus_per_worker=1 need 4 CPUs")


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
    # only what the user set: the default warmup (10) beyond a short run, and settings that take effect, are not named
    assert idle_settings(load_config(None, [
        "training.max_steps=3", "data.eval_fraction=0.1", "data.eval_every_n_steps=2", "training.warmup_steps=3",
        "deepspeed.zero_optimization.offload_optimizer={device: cpu, ratio: 0.5}"]), use_gpu=False) == []


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
