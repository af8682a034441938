"""Helpers the tests share (imported as tests.helpers: pyproject's pytest pythonpath holds the root)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import pytest


def require(condition: bool, why: str) -> None:
    """A test's prerequisite (root, iproute2, libaio, ...): skip without it on a developer's machine,
    fail on CI, which installs every prerequisite (.ci/run sets RAYTRAIN_TEST_REQUIRE_ALL=1): there a
    missing one is a broken CI machine, and a skip would hide the tests it guards."""
    if condition:
        return
    if os.environ.get("RAYTRAIN_TEST_REQUIRE_ALL") == "1":
        pytest.fail(f"missing prerequisite on CI: {why}")
    pytest.skip(why)


@contextlib.contextmanager
def transformers_log():
    """The messages transformers logs while the block runs, as they would print (its loggers do not
    propagate to the root's, so pytest's caplog sees none of them)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def forget_said_warnings() -> None:
    """transformers' warning_once says each message once per process (an lru_cache over its text), and the
    tests share one process: forgotten, the next load or build says it again, as a new worker or export would.
    The token-id warning names the vocabulary, so a vocabulary of a test's own avoids this; the generation
    config's ("The following generation flags are not valid ...: ['pad_token_id']") is the same text for all."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()


def wait_until(predicate, timeout_s: float, what: str, alive=None, every_s: float = 0.2):
    """Poll `predicate` until true; fail naming `what` after `timeout_s`, or at once when `alive()`
    says the thing being waited on has ended (a run that exited cannot reach the state any more)."""
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and not alive():
            pytest.fail(f"ended before {what}")
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


def alive_nodes(address: str) -> int:
    """How many nodes the GCS at `address` counts as alive; 0 while it does not answer yet. Asked from
    this process through Ray's GcsClient (a test-only look, no driver connection: this process may be
    connected to another cluster already), not `ray status`, a process of ~1.5 CPU-seconds that a
    wait loop ran every second: on 2 cores, CPU taken from the cluster being waited for."""
    from ray._raylet import GcsClient

    try:
        return sum(info.state == 0 for info in GcsClient(address=address).get_all_node_info().values())  # 0: ALIVE
    except Exception:  # noqa: BLE001  (the head is still starting)
        return 0


def registered_step(run_dir: str) -> int | None:
    """The step of the run's latest checkpoint that Ray Train registered (what a restart or a rerun
    resumes from), None before the first. A checkpoint's files reach storage before Ray Train's
    controller registers it (once per poll, every 2 s by default): a test that waits for the files
    races the registration. Read from Ray Train's own bookkeeping (raytrain.checkpoint.layout)."""
    from raytrain.checkpoint import layout

    for _ in range(3):
        try:
            checkpoint = layout.latest_checkpoint(run_dir)
            return None if checkpoint is None else layout.read_metadata(checkpoint)["step"]
        except Exception:  # noqa: BLE001  Ray Train rewriting its snapshot file at this moment: seen as ValueError,
            # OSError and CheckpointManagerInitializationError (an empty file's JSONDecodeError); a real error
            # still fails the test, as the wait that polls this times out
            time.sleep(0.1)
    return None


def sample_groups(run_dir) -> list[dict]:
    """The worker groups of a run in the order they started, from the data audit (data.sample_log,
    raytrain.worker.samples): each with its size and, per step that all its ranks finished, the
    step's rows (rank by rank)."""
    files: dict[str, list[Path]] = {}
    for path in (Path(run_dir) / "samples").glob("*-rank*.jsonl"):
        files.setdefault(path.name.rsplit("-rank", 1)[0], []).append(path)
    out = []
    for name in sorted(files):  # names start with the group's start time
        records: dict[int, dict[int, dict]] = {}
        for path in files[name]:
            rank = int(path.stem.rsplit("-rank", 1)[1])
            for line in path.read_text().splitlines():
                if line.endswith("}"):  # a line being written right now is not read
                    record = json.loads(line)
                    records.setdefault(record["step"], {})[rank] = record
        world = int(name.rsplit("-w", 1)[1])
        steps = {step: {"rows": [r for rank in sorted(by_rank) for r in by_rank[rank]["rows"]],
                        "epoch": by_rank[0]["epoch"], "t": max(rec["t"] for rec in by_rank.values())}
                 for step, by_rank in sorted(records.items()) if len(by_rank) == world}
        out.append({"name": name, "world_size": world, "steps": steps})
    return out


def sample_lineage(all_groups: list[dict]) -> dict[int, dict]:
    """Each step as the last group that ran it trained it (a restart redoes the steps after its checkpoint)."""
    steps: dict[int, dict] = {}
    for group in all_groups:
        for step, record in group["steps"].items():
            steps[step] = {**record, "world_size": group["world_size"]}
    return dict(sorted(steps.items()))


def init_gloo(rank: int, world: int, rendezvous: str) -> None:
    """A gloo process group of `world` spawned ranks over a file rendezvous (a path no other group
    uses): a free port found first can be taken by another process before rank 0 binds it. The env
    variables are for DeepSpeed, whose init_distributed looks for them even when the group exists
    (without them it tries MPI discovery); nothing binds MASTER_PORT."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def stop_tree(proc, grace_s: float = 10.0) -> None:
    """Stop a `ray start --block` process and everything it started (GCS, raylet, dashboard, workers)
    at once: SIGTERM to all, SIGKILL to what is left after `grace_s`. Its own graceful shutdown stops
    them one by one (~30 s); `ray stop` would stop every Ray cluster on the machine."""
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        family = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    proc.wait(timeout=grace_s)


class S3Server:
    """A local S3 API (moto's server, a real HTTP endpoint speaking S3's protocol) for tests of cloud
    storage: pyarrow's S3 filesystem and everything on top of it talk to it as to AWS. `env` points a
    process at it (AWS_ENDPOINT_URL, which pyarrow reads, and dummy credentials); `bucket` exists."""

    def __init__(self, tmp_dir, bucket: str = "raytrain-test"):
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.port, self.bucket = port, bucket
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        self._log = open(os.path.join(tmp_dir, "moto.log"), "w")
        server = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self._proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=self._log,
                                      stderr=subprocess.STDOUT)
        wait_until(self._answers, 60, f"moto_server on port {port}", lambda: self._proc.poll() is None)
        self.filesystem().create_dir(bucket)

    def _answers(self) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def filesystem(self):
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(endpoint_override=self.endpoint, access_key="testing", secret_key="testing",
                                       region="us-east-1", allow_bucket_creation=True)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)
        self._log.close()


def code_model(path, config: dict, model_type: str = "mine", tokenizer_classes: bool = False) -> str:
    """A model directory whose config.json names its own classes (cfg.MyConfig, mdl.MyModel: Llama's, renamed),
    with `config`'s shape and the byte tokenizer; `tokenizer_classes`: auto_map names a tokenizer class pair too,
    as hub configs of such models do."""
    from raytrain.model import byte_tokenizer

    path.mkdir()
    (path / "cfg.py").write_text("from transformers import LlamaConfig\n\n\nclass MyConfig(LlamaConfig):\n"
                                 "    model_type = 'mine'\n")
    (path / "mdl.py").write_text("from transformers import LlamaForCausalLM\n\nfrom .cfg import MyConfig\n\n\n"
                                 "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")
    auto_map = {"AutoConfig": "cfg.MyConfig", "AutoModelForCausalLM": "mdl.MyModel"}
    if tokenizer_classes:
        auto_map["AutoTokenizer"] = ["tok.MyTokenizer", None]
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type, "auto_map": auto_map}))
    byte_tokenizer().save_pretrained(path)
    return str(path)


def remote_local_filesystem(opened: list[str], max_file_bytes: int | None = None):
    """This machine's disk through fsspec behind pyarrow's PyFileSystem: a real filesystem that Ray's Checkpoint
    treats as remote, as it treats S3, and that appends the path of every file read to `opened`. A file over
    `max_file_bytes` is refused instead of read (a test's sparse terabytes must never be downloaded)."""
    import fsspec
    import pyarrow.fs

    class Recording(pyarrow.fs.FSSpecHandler):
        def _opened(self, path):
            opened.append(path)
            if max_file_bytes is not None:
                assert os.path.getsize(path) <= max_file_bytes, f"{path}: a read of {os.path.getsize(path)} bytes"

        def open_input_stream(self, path):
            self._opened(path)
            return super().open_input_stream(path)

        def open_input_file(self, path):
            self._opened(path)
            return super().open_input_file(path)

    return pyarrow.fs.PyFileSystem(Recording(fsspec.filesystem("file")))


def attention_within(query, key, value, bounds: list[int], scaling=None):
    """What flash attention's varlen kernel computes for one row: causal attention within each segment
    [bounds[i], bounds[i+1]), k and v repeated to the query heads (query: batch 1, heads, tokens, head_dim, as
    transformers gives an attention function); returned as transformers' attention functions return it."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
        for a, b in zip(bounds, bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None
