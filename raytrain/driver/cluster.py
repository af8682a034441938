"""The Ray cluster a run goes to (driver side): connect, read its shape and memory, check its fabric.

Start at `connect`: `cluster.address`, else RAY_ADDRESS (set under `ray job submit`), else a new
local cluster sized for the workers plus Ray Data (`start_local_cluster`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence

import ray

from raytrain import compat, hardware
from raytrain.config import ClusterConfig, ConfigError, RunConfig, ScalingConfig
from raytrain.console import say
from raytrain.driver.checks import check_placement, check_ray_address, local_cluster_cpus, starts_local_cluster
from raytrain.network.preflight import run_preflight
from raytrain.network.preflight_report import PreflightReport
from raytrain.planning.resolve import shape_from_cluster
from raytrain.run_spec import ClusterShape


def connect(cluster: ClusterConfig, scaling: ScalingConfig) -> None:
    """Join the cluster this runs on (cluster.address, or RAY_ADDRESS under `ray job submit`), else start one.

    A process already connected (a notebook's second fit(), the user's own ray.init()) stays on its
    cluster: Ray joins one per process. An address that is not that cluster is refused (it would be
    ignored). "local" is Ray's "a new local cluster": raytrain's own, sized by cluster.num_cpus."""
    _plain_worker_prefixes()
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    key = f"cluster.address={cluster.address}" if cluster.address else f"the environment's RAY_ADDRESS={address}"
    if ray.is_initialized():
        check_connected_to(address, key)
        note_unused_local_settings(cluster)
        return
    check_ray_address(cluster.address)  # plan and preflight connect without raytrain.main's check_before_ray
    if starts_local_cluster(cluster):
        start_local_cluster(local_cluster_cpus(cluster, scaling))
        return
    probe_address(address, key)
    try:
        # logging_level: the driver's own "ray" logger; INFO is "Connecting to existing Ray cluster".
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
    except ConnectionError as e:  # "auto" with no cluster on this machine; a refused token (Ray's own words)
        raise ConfigError(f"{key}: Ray cannot connect ({str(e).strip().splitlines()[0][:300]}): start the cluster, "
                          f"fix the address, or unset it for a local cluster") from None


def note_unused_local_settings(cluster: ClusterConfig) -> None:
    """This process is connected already: a note for a cluster.num_cpus, which sizes only a local cluster that
    raytrain starts, that the connected cluster does not have (a notebook's second fit() asking for 6 CPUs
    ran on the first fit's 4 without a word). Only a value the user set, and only where the run would
    otherwise start a local cluster: with an address, raytrain.driver.checks.idle_settings says it."""
    if cluster.num_cpus is None or not starts_local_cluster(cluster):
        return
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if cpus != cluster.num_cpus:
        say(f"raytrain: note: cluster.num_cpus={cluster.num_cpus} has no effect: Ray is already initialized in this "
            f"process with {cpus:g} CPUs (an earlier fit() or your own ray.init()), and a running cluster keeps its "
            f"CPUs: call ray.shutdown() first, or run in a new process")


# How long the driver waits for the cluster's port to accept a connection before ray.init: a head on
# the same network answers in milliseconds. Without the probe, ray.init on a closed or unroutable port
# retried in Ray's C++ client for minutes, with no line of raytrain's.
PROBE_CONNECT_TIMEOUT_S = 5.0


def probe_address(address: str, key: str, timeout_s: float = PROBE_CONNECT_TIMEOUT_S) -> None:
    """Refuse, in one line naming `key`, a HOST:PORT (or ray://HOST:PORT) address nothing answers at.
    "auto" and "local" are found by Ray on this machine (nothing to probe)."""
    if address in ("auto", "local"):
        return
    host, _, port = address.rpartition("://")[2].rpartition(":")
    host = host.strip("[]")  # an IPv6 literal, [::1]:6379
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        if isinstance(e, socket.gaierror):
            why = f"the host name {host} does not resolve"
        elif isinstance(e, TimeoutError):
            why = f"no answer within {timeout_s:g} s"
        else:
            why = e.strerror or type(e).__name__
        raise ConfigError(f"{key}: nothing answers at {host}:{port} ({why}): start the cluster (ray start --head) "
                          f"or fix the address (the head's GCS port, 6379 by default; ray://HOST:10001 for Ray "
                          f"Client), or unset it for a local cluster") from None


def check_connected_to(address: str | None, key: str) -> None:
    """This process is connected to a Ray cluster already: refuse an `address` that is another one (Ray keeps
    the first connection, so the run would silently go to the wrong cluster). "auto", "local" and no address
    mean whatever this process holds; a ray:// address (Ray Client) is not compared."""
    if not address or address in ("auto", "local") or "://" in address:
        return
    try:
        connected = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001  (a Ray Client session has no GCS address here: not judged)
        return
    if not connected or _same_endpoint(address, connected):
        return
    raise ConfigError(f"{key} is not the Ray cluster this process is connected to ({connected}, by an earlier "
                      f"fit() or your own ray.init(); Ray joins one cluster per process): call ray.shutdown() "
                      f"first, or leave the address out to use the connected cluster")


def _same_endpoint(a: str, b: str) -> bool:
    """Whether HOST:PORT `a` and `b` are one endpoint: the same port, and hosts that resolve to the same
    address or are both this machine (a notebook connected to 127.0.0.1:6379 reports its node's IP)."""
    (host_a, _, port_a), (host_b, _, port_b) = a.rpartition(":"), b.rpartition(":")
    if port_a != port_b:
        return False
    ips = [_resolve(host_a.strip("[]")), _resolve(host_b.strip("[]"))]
    if ips[0] == ips[1]:
        return True
    here = {ray.util.get_node_ip_address(), _resolve(socket.gethostname())}
    return all(ip.startswith("127.") or ip == "::1" or ip in here for ip in ips)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _plain_worker_prefixes() -> None:
    """Worker lines without colour where the output is not a terminal (a log file, `ray job logs`, a pipe).

    Ray's driver prints each worker line with its "(RayTrainWorker pid=...)" prefix in ANSI colour unless
    RAY_COLOR_PREFIX=0, read at each line (ray/_private/worker.py, print_worker_logs, ray 2.60.0); in a file
    the codes are noise. A value the user set wins; a notebook (ipykernel, whose streams are not terminals)
    renders the colours, so it keeps them."""
    if "RAY_COLOR_PREFIX" in os.environ or _in_notebook():
        return
    try:
        terminal = sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        terminal = False
    if not terminal:
        os.environ["RAY_COLOR_PREFIX"] = "0"


def _in_notebook() -> bool:
    """Whether this process is a Jupyter kernel: IPython's running shell, not merely ipykernel imported (a
    test process or a library may import it without being one)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def start_local_cluster(num_cpus: int) -> None:
    """A new Ray cluster on this machine, which stops when this process ends, announced in one line.

    What it is started with, and why (each an environment variable its processes inherit; Ray's
    own logs keep every line at DEBUG in /tmp/ray/session_*/logs):
    - the dashboard, on a free port: Ray Train's PlacementGroupCleaner asks Ray's state API,
      served by the dashboard, every second whether the controller is alive. Without it every
      answer failed ("Failed to query Ray Train Controller actor state", ~50 lines a run) and its
      stop timed out at the end of a run that succeeded (a GetTimeoutError traceback).
    - RAY_API_SERVER_ADDRESS, that dashboard: the state API otherwise finds "the latest cluster on
      this machine", another user's whenever two clusters run here ("Found multiple active Ray
      instances"), and would ask it whether this run's controller is alive.
    - RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0: nothing preempts the nodes of a local cluster, and
      creating the watcher logs a core_worker error (ray-project/ray#53727) in every run.
    - RAY_DATA_LOG_LEVEL=WARNING: Ray Data's INFO lines ("Execution plan of Dataset ...",
      "execution finished in ...") on the console; its warnings and errors still show.
    - SIGINT ignored by every process it starts: Ctrl-C in a terminal signals the whole process
      group. Ray blocks SIGINT in the processes it starts, but the dashboard's module processes
      unblock it, so Ctrl-C stopped the state API in the middle of the run's abort, which then
      waited 12 s for Ray Train's PlacementGroupCleaner. Ctrl-C is the driver's alone
      (raytrain.driver.watch), as Ray means it to be.
    """
    missing = compat.dashboard_dependency_error()
    if missing:  # a minimal ray (no ray[default]): train without the dashboard rather than not at all
        say(f"raytrain: note: Ray's dashboard cannot start here ({missing}); the local cluster runs without it, "
            f"so Ray Train's cleaner logs 'Failed to query Ray Train Controller actor state' each second: "
            f"pip install 'ray[default]' to have it")
    for attempt in range(2):
        port = _free_port()
        env = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_DATA_LOG_LEVEL": "WARNING"}
        if not missing:
            env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        try:
            # Ray warns that token authentication is on by default for a new local cluster: said
            # below in raytrain's own line instead. address="local": always a new cluster; plain
            # ray.init() would join any other one on this machine.
            with environ_defaults(env), _level("ray._private.authentication.authentication_token_setup", logging.ERROR), \
                    _sigint_ignored():
                context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=not missing,
                                   dashboard_host="127.0.0.1", dashboard_port=port, log_to_driver=True,
                                   logging_level=logging.WARNING)
            break
        except ValueError as e:  # the free port was taken between the probe and the start
            if attempt or "already occupied" not in str(e):
                raise
    auth = "on" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else "off"
    dashboard = "no dashboard" if missing else f"dashboard http://{context.dashboard_url}"
    say(f"raytrain: started a local Ray cluster ({num_cpus} CPUs, {dashboard}, "
        f"token authentication {auth}); it stops when this process ends")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environ_defaults(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ meanwhile (for the processes started, and libraries that read it per call);
    a variable the user set wins. Restored afterwards."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile: processes started meanwhile keep ignoring it (an ignored signal
    stays ignored across exec, and Python then installs no KeyboardInterrupt handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; a notebook's cells run there
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _level(logger: str, level: int) -> Iterator[None]:
    log = logging.getLogger(logger)
    previous = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(previous)


def live_shape(cfg: RunConfig) -> ClusterShape:
    """The run's shape on the connected cluster (GPUs per node: the largest alive GPU node's)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpus_per_node = max((int(n["Resources"].get("GPU", 0)) for n in alive), default=0)
    shape = shape_from_cluster(cfg, ray.cluster_resources(), gpus_per_node or None)
    return dataclasses.replace(shape, driver_on_worker_node=runs_workers(alive, _driver_node_id(), shape.use_gpu))


def runs_workers(alive: list[dict], node_id: str | None, use_gpu: bool) -> bool:
    """Whether node `node_id` (None: none of the cluster's) is one the run's workers may run on: alive, with a GPU
    for a GPU run (a CPU head node is not), with a CPU for a CPU run. `alive`: ray.nodes()' alive entries."""
    need = "GPU" if use_gpu else "CPU"
    return any(n["NodeID"] == node_id and n["Resources"].get(need, 0) > 0 for n in alive)


def _driver_node_id() -> str | None:
    """The node this driver runs on; None for a Ray Client session (ray://: the driver runs on a machine of its
    own, a laptop or a notebook, and the node Ray names is the client server's)."""
    from ray.util.client import ray as client  # ray 2.60.0: Ray Client's handle, connected only under ray://

    return None if client.is_connected() else ray.get_runtime_context().get_node_id()


def check_live_placement(cfg: RunConfig) -> None:
    """Refuse (raytrain.driver.checks.check_placement) a worker group the connected cluster can never hold,
    judged against what it has and can add. A cluster that can add nodes it does not say (a `ray up`
    cluster's autoscaler keeps its node types to itself) is not judged: the autoscaler may add what the
    workers ask for, as the rest of the driver assumes (shape_from_cluster, cluster_target)."""
    alive = [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]
    scaling = cfg.scaling
    use_gpu = scaling.use_gpu if scaling.use_gpu is not None else any(n.get("GPU", 0) > 0 for n in alive)
    size = max(scaling.num_workers) if isinstance(scaling.num_workers, list) else scaling.num_workers or 1
    types = autoscaler_node_types()
    if types is not None and scaling.num_workers is None:
        return  # a worker per GPU the cluster has now: nothing to judge
    if types is not None:
        nodes, grows = with_addable_nodes(alive, types, size), "with the nodes its autoscaler can add"
    elif fixed_cluster():
        nodes, grows = alive, "no autoscaler adds nodes to it"
    else:
        return
    cpus, gpus = (sum(n.get(k, 0.0) for n in alive) for k in ("CPU", "GPU"))
    try:
        at = f" at {ray.get_runtime_context().gcs_address}"
    except Exception:  # noqa: BLE001  (a Ray Client session)
        at = ""
    where = f"the Ray cluster{at} ({len(alive)} node(s), {cpus:g} CPUs, {gpus:g} GPUs; {grows})"
    check_placement(scaling, use_gpu, nodes, where, more_cpus="add nodes", more_nodes="add nodes")


def with_addable_nodes(alive: list[dict[str, float]], types: list[tuple[dict[str, float], int]],
                       size: int) -> list[dict[str, float]]:
    """The alive nodes and those the autoscaler can add (autoscaler_node_types: resources, max count, -1
    unbounded), as many of each type as could matter to a group of `size` workers (each holds at least one)."""
    return alive + [dict(res) for res, count in types for _ in range(size if count < 0 else min(count, size))]


# What the driver can learn of a cluster's autoscaler (ray 2.60.0; private reads, each pinned here).


def autoscaler_node_types() -> list[tuple[dict[str, float], int]] | None:
    """(resources, max count; -1 unbounded) of each node type the cluster's autoscaler can add, where the
    cluster reports them to the GCS (ray._private.state.GlobalState.get_cluster_config, which Ray Data's
    autoscaler reads too); None where it does not (an open-source `ray up` or `ray start` cluster)."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001  (a Ray Client session, an older GCS: not known)
        return None
    if config is None or not config.node_group_configs:
        return None
    return [({k: float(v) for k, v in group.resources.items()}, group.max_count)
            for group in config.node_group_configs if group.resources]


def fixed_cluster() -> bool:
    """Whether the connected cluster is known to have no autoscaler that could add nodes: its head was
    started without an autoscaling config (`ray start --head` by hand, or ray.init's local cluster), so
    Ray's monitor runs its read-only provider, whose node types are the live nodes themselves, named
    `node_<node id>` (ray/autoscaler/_private/monitor.py and util.format_readonly_node_type). Read from the
    status the monitor writes to the GCS every few seconds (what `ray status` prints). False when not known:
    no status yet, autoscaler v2 (which writes none), or a Ray Client session."""
    import json

    try:
        from ray.experimental.internal_kv import _internal_kv_get

        status = _internal_kv_get("__autoscaling_status")  # ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS
        report = (json.loads(status).get("autoscaler_report") if status else None) or {}
    except Exception:  # noqa: BLE001
        return False
    types = set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {})
    return bool(types) and all(re.fullmatch(r"node_[0-9a-f]+", name) for name in types)


# The memory probe's first wait, after which the driver says what it is waiting for. A job's first task on a
# node needs a new worker process, started with the job's runtime environment: seconds on an idle node, but
# minutes where that environment installs packages (runtime_env pip/conda) or the node is starved (seen:
# over 120 s on a 2-core test machine under load, a probe that imported torch at Ray workers' niceness 15).
PROBE_FIRST_WAIT_S = 60
PROBE_TIMEOUT_S = 600


def cluster_target(use_gpu: bool, timeout_s: float = PROBE_TIMEOUT_S,
                   storage_path: str | None = None) -> hardware.Target:
    """GPU memory per GPU, host RAM per node and GPUs per node of the connected cluster.

    Each is the smallest over the alive nodes that would run workers (GPU nodes for a GPU run),
    read on the node itself by a zero-CPU probe task. All None when there is no such node yet (an
    autoscaling cluster whose GPU nodes start at zero): plan with stated sizes then. Nodes that have not
    answered after `timeout_s` are left out, with a note (their probe is cancelled): the probe only
    informs the memory check and "auto" settings, and the run's own workers wait for the same nodes.

    `storage_path` (checkpoint.storage_path, for a run): the same probe also answers whether the node
    sees a local storage path (`check_storage_shared`); raises ConfigError when a node does not.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU" if use_gpu else "CPU", 0) > 0]
    local = storage_path is not None and "://" not in storage_path
    if local and use_gpu and not nodes:
        # Nothing to ask: the GPU nodes of an autoscaling cluster start at zero (and an elastic run's later
        # nodes are never asked either). The workers will run on nodes other than this GPU-less one, so say it.
        say(f"raytrain: note: checkpoint.storage_path={storage_path} is a local path and no GPU node is up yet to "
            f"check that it sees it: unless it is a filesystem mounted at the same path on every node, the first "
            f"checkpoint save fails on the GPU nodes; use s3://... or gs://... there")
    if not nodes:
        return hardware.Target()
    # A node other than the driver's runs workers: a local path must be visible there too. One machine
    # (the driver's node alone) needs no marker, and no file is written.
    here = ray.get_runtime_context().get_node_id()
    with storage_marker(storage_path if local and any(n["NodeID"] != here for n in nodes) else None) as marker:
        probe = ray.remote(num_cpus=0)(probe_node)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(use_gpu, marker) for n in nodes]
        targets, sees = _wait_for_probes(refs, timeout_s)
    if marker is not None:
        check_storage_shared(storage_path, {n["NodeManagerAddress"]: seen for n, seen in zip(nodes, sees)})
    targets = [t for t in targets if t is not None]
    if not targets:
        return hardware.Target()
    gpu_sizes = [t.gpu_memory_bytes for t in targets if t.gpu_memory_bytes]
    return hardware.Target(gpu_memory_bytes=min(gpu_sizes) if gpu_sizes else None,
                           host_memory_bytes=min(t.host_memory_bytes for t in targets),
                           gpus_per_node=min(int(n["Resources"].get("GPU", 0)) for n in nodes) if use_gpu else None)


def _wait_for_probes(refs: list, timeout_s: float) -> tuple[list[hardware.Target | None], list[bool | None]]:
    """Each probe's (target, sees the marker), in the order of `refs`; None for a node that did not answer."""
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=min(PROBE_FIRST_WAIT_S, timeout_s))
    if pending and timeout_s > PROBE_FIRST_WAIT_S:
        say(f"raytrain: waiting for {len(pending)} of {len(refs)} node(s) to read their memory (a job's first task "
            f"on a node starts a worker with the job's runtime environment; up to {timeout_s:g} s)")
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout_s - PROBE_FIRST_WAIT_S)
        ready += more
    if pending:
        for ref in pending:
            ray.cancel(ref)
        checked = "the nodes that did" if ready else "none: not checked"
        say(f"raytrain: note: {len(pending)} of {len(refs)} node(s) did not report their memory within {timeout_s:g} s; "
            f"the run's memory is checked against {checked}")  # a local storage path likewise
    answers = dict(zip(ready, ray.get(ready)))
    found = [answers.get(ref, (None, None)) for ref in refs]
    return [t for t, _ in found], [seen for _, seen in found]


def probe_node(use_gpu: bool, marker: str | None) -> tuple[hardware.Target, bool | None]:
    """On a node: its memory (hardware.this_machine) and whether it sees `marker` (None: not asked)."""
    return hardware.this_machine(use_gpu), None if marker is None else sees_file(marker)


def sees_file(path: str, retry_after_s: float = 2.0) -> bool:
    """Whether this node sees `path`, asked twice: an NFS client may serve a directory listing from its
    attribute cache for a few seconds. The second look costs `retry_after_s` on a node that does not see
    it, where the run stops anyway."""
    if os.path.exists(path):
        return True
    time.sleep(retry_after_s)
    return os.path.exists(path)


@contextlib.contextmanager
def storage_marker(storage_path: str | None) -> Iterator[str | None]:
    """A new empty file where a local `storage_path` lives, removed afterwards; None for None or a URI.

    Written in the storage directory, or where the run will create it (its nearest existing parent, on the
    same filesystem), so that checking creates no directory. None as well when it cannot be written: the
    run's own first write reports that."""
    if storage_path is None or "://" in storage_path:
        yield None
        return
    existing = os.path.abspath(os.path.expanduser(storage_path))  # what the run's workers are given
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    marker = os.path.join(existing, f".raytrain-shared-{uuid.uuid4().hex}")
    try:
        open(marker, "x").close()
    except OSError:
        yield None
        return
    try:
        yield marker
    finally:
        with contextlib.suppress(OSError):
            os.remove(marker)


def check_storage_shared(storage_path: str, sees: dict[str, bool | None]) -> None:
    """Refuse a local checkpoint.storage_path that some node running workers cannot see (`sees`: node IP
    -> whether it saw the driver's marker file there; None: the node did not answer, not judged).

    Ray Train persists each checkpoint from the workers' nodes into the storage path: a directory on the
    head's own disk fails there at the first save ("Unable to set up cluster storage"), after the run's
    start-up and up to every_n_steps steps, then again for each of max_failures retries."""
    blind = sorted(node for node, seen in sees.items() if seen is False)
    if blind:
        raise ConfigError(f"checkpoint.storage_path={storage_path} is not shared: node(s) {', '.join(blind)} cannot "
                          f"see it (a directory on the head's disk): set checkpoint.storage_path to s3://..., "
                          f"gs://..., or a filesystem mounted at the same path on every node")


def preflight_cluster(cfg: RunConfig, sizes: Sequence[int] | None = None, **options) -> PreflightReport:
    """Connect and run the preflight (raytrain.network.preflight) on the workers' placement.

    `options`: run_preflight's iters, warmup_iters, min_*_busbw_gbs, timeout_s.
    """
    connect(cfg.cluster, cfg.scaling)
    check_live_placement(cfg)
    return _preflight_connected(cfg, sizes, **options)


def _preflight_connected(cfg: RunConfig, sizes: Sequence[int] | None = None, **options) -> PreflightReport:
    """`preflight_cluster` once connected and the placement checked."""
    shape = live_shape(cfg)
    scaling = cfg.scaling
    return run_preflight(cfg.network, shape.num_workers, shape.use_gpu, sizes, cpus_per_worker=scaling.cpus_per_worker,
                         accelerator_type=scaling.accelerator_type, placement_strategy=scaling.placement_strategy,
                         **options)


def check_preflight(cfg: RunConfig) -> None:
    """network.preflight=true: the preflight before training; a failure stops the run with one line. After the
    run's own connect and check_live_placement (a second connect would repeat its notes)."""
    report = _preflight_connected(cfg)
    say(report.render())
    if not report.passed:
        raise ConfigError("network.preflight failed (" + "; ".join(report.failures) + "): fix the fabric, "
                          f"or {report.train_anyway}")
