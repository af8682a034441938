"""Every Ray cluster launcher YAML in cluster/ passes Ray's own validation and keeps the
properties raytrain relies on: GPU workers scale from zero, InfiniBand (or EFA) reaches the
containers, Ray's ports stay private, token authentication is on, each file opens with its command,
and an `external` provider's module is installed on the head before its autoscaler starts.

Validation follows `ray up` (ray.autoscaler._private.commands._bootstrap_config): `prepare_config`
merges the provider's defaults.yaml, merges setup commands, checks the docker section and fills
per-type worker limits; `validate_config` then checks ray-schema.json and the cross-field rules.
The provider bootstrap that follows in `ray up` needs cloud credentials and is not run here.
"""

from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.autoscaler._private.aws.config import _configure_from_network_interfaces
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "cluster"
CLUSTER_YAMLS = sorted(CLUSTER_DIR.glob("*.yaml"))

# Options a GPU container needs for RDMA (InfiniBand verbs, or EFA's): the device nodes, and
# permission to pin memory (see cluster/ib.yaml).
RDMA_RUN_OPTIONS = ("/dev/infiniband", "IPC_LOCK", "memlock=-1")
# InfiniBand hosts (Azure HPC images, on-prem) also hand the container their NCCL settings.
IB_RUN_OPTIONS = RDMA_RUN_OPTIONS + ("/etc/nccl.conf",)


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _prepare_like_ray_up(config: dict[str, Any]) -> dict[str, Any]:
    if config["provider"]["type"] == "fake_multinode":
        # The fake provider's defaults file (ray/autoscaler/_private/fake_multi_node/example.yaml)
        # is missing from the Ray wheel, so prepare_config, and `ray up` with this provider, fail
        # with FileNotFoundError. The file never goes through that step in use either:
        # `ray start --autoscaling-config` hands it to the monitor as is, which validates it
        # unprepared, exactly as below (and only logs a failure, hence this test).
        return config
    return prepare_config(config)


def _uses_docker(config: dict[str, Any]) -> bool:
    return bool(config.get("docker", {}).get("image"))


def _cloud(config: dict[str, Any]) -> str:
    """azure for Ray's Azure provider and raytrain's extension of it, else the provider type."""
    provider = config["provider"]
    if provider["type"] == "external" and provider["module"].startswith("raytrain.autoscaler.azure."):
        return "azure"
    return provider["type"]


def _gpu_node_run_options(config: dict[str, Any]) -> dict[str, list[str]]:
    """The `docker run` options each GPU-bearing node role gets, keyed by role."""
    docker = config["docker"]
    head = docker.get("run_options", []) + docker.get("head_run_options", [])
    worker = docker.get("run_options", []) + docker.get("worker_run_options", [])
    if config["provider"]["type"] == "local":
        # No node types on the local provider: every listed host, head included, trains.
        return {"head": head, "worker": worker}
    roles = {}
    for name, node_type in config["available_node_types"].items():
        if node_type["resources"].get("GPU", 0) == 0:
            continue
        if name == config["head_node_type"]:
            roles[name] = head
        else:
            roles[name] = worker + node_type.get("docker", {}).get("worker_run_options", [])
    return roles


def test_cluster_dir_holds_the_shipped_configs():
    names = {path.name for path in CLUSTER_YAMLS}
    assert {"ib.yaml", "onprem-ib.yaml", "fake-multinode.yaml", "aws-efa.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda path: path.name)
def test_validates_like_ray_up(path):
    prepared = _prepare_like_ray_up(_load(path))
    validate_config(prepared)  # raises on anything `ray up` would refuse
    # ...and what `ray up` then launches from is complete: every node type has its resources and limits
    if prepared["provider"]["type"] == "local":
        assert prepared["provider"]["head_ip"] and prepared["provider"]["worker_ips"], path.name
    else:
        for name, node_type in prepared["available_node_types"].items():
            assert "resources" in node_type and "max_workers" in node_type and "node_config" in node_type, name


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda path: path.name)
def test_opens_with_the_command_that_uses_it(path):
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#"), f"{path.name}: start with a comment that shows its command"
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    header_text = "\n".join(header)
    assert f"cluster/{path.name}" in header_text, f"{path.name}: header must name the file"
    assert "ray up" in header_text or "ray start" in header_text, path.name


# The local provider (onprem-ib.yaml) has a fixed host list and no node types: nothing scales there.
@pytest.mark.parametrize("path", [p for p in CLUSTER_YAMLS if _load(p)["provider"]["type"] != "local"],
                         ids=lambda path: path.name)
def test_workers_scale_from_zero(path):
    config = _load(path)
    assert "idle_timeout_minutes" in config, f"{path.name}: say when idle workers go away"
    worker_types = {
        name: node_type
        for name, node_type in config["available_node_types"].items()
        if name != config["head_node_type"]
    }
    assert worker_types, f"{path.name}: no worker node type"
    for name, node_type in worker_types.items():
        # Spelled out rather than left to Ray's default, so the intent is visible in the file.
        assert node_type.get("min_workers") == 0, f"{path.name}: {name}.min_workers must be 0"
        assert node_type.get("max_workers", 0) >= 1, f"{path.name}: {name} can never start"


def test_ib_head_takes_no_work():
    config = _load(CLUSTER_DIR / "ib.yaml")
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    gpu_workers = [
        node_type
        for name, node_type in config["available_node_types"].items()
        if name != config["head_node_type"] and node_type["resources"].get("GPU", 0) > 0
    ]
    assert gpu_workers, "ib.yaml needs a GPU worker type"


@pytest.mark.parametrize(
    "path", [p for p in CLUSTER_YAMLS if _uses_docker(_load(p))], ids=lambda path: path.name
)
def test_gpu_containers_get_infiniband(path):
    config = _load(path)
    roles = _gpu_node_run_options(config)
    assert roles, f"{path.name}: runs Docker but has no GPU node"
    needed_options = RDMA_RUN_OPTIONS if _cloud(config) == "aws" else IB_RUN_OPTIONS
    for role, options in roles.items():
        joined = " ".join(options)
        missing = [needed for needed in needed_options if needed not in joined]
        assert not missing, f"{path.name}: {role} containers lack {missing}"
    if _cloud(config) == "azure":
        # The NCCL topology file that the HPC image's /etc/nccl.conf names lives here.
        for role, options in roles.items():
            assert "-v /opt/microsoft:/opt/microsoft:ro" in options, f"{path.name}: {role}"
        # The CPU head has no /dev/infiniband; passing it would make its `docker run` fail.
        docker = config["docker"]
        head_options = " ".join(docker.get("run_options", []) + docker.get("head_run_options", []))
        assert "/dev/infiniband" not in head_options


@pytest.mark.parametrize(
    "path", [p for p in CLUSTER_YAMLS if _uses_docker(_load(p))], ids=lambda path: path.name
)
def test_token_auth_is_on(path):
    config = _load(path)
    assert "--env=RAY_AUTH_MODE=token" in config["docker"]["run_options"], path.name
    # The token made by `ray get-auth-token --generate` must reach every node.
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token", path.name


def _internet_rules(node: Any):
    """Yield (ports, rule) for every firewall rule in a provider section open to any address."""
    if isinstance(node, dict):
        # AWS security group: {"FromPort", "ToPort", "IpRanges": [{"CidrIp": ...}]}.
        if any(r.get("CidrIp") == "0.0.0.0/0" for r in node.get("IpRanges", [])):
            yield {node.get("FromPort"), node.get("ToPort")}, node
        # Azure network security rule: {"sourceAddressPrefix", "destinationPortRange"}.
        if node.get("sourceAddressPrefix") in ("*", "0.0.0.0/0", "Internet"):
            yield {node.get("destinationPortRange")}, node
        for value in node.values():
            yield from _internet_rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from _internet_rules(value)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda path: path.name)
def test_no_ray_port_open_to_the_internet(path):
    config = _load(path)
    for ports, rule in _internet_rules(config["provider"]):
        assert ports <= {22, "22"}, f"{path.name}: only SSH may be open to 0.0.0.0/0: {rule}"
    # The dashboard (and the job API behind it) stays on localhost; users come in over SSH.
    for command in config.get("head_start_ray_commands", []):
        assert "--dashboard-host=0.0.0.0" not in command, path.name
    options = " ".join(config.get("docker", {}).get("run_options", []))
    assert "--publish" not in options and " -p " not in f" {options} ", path.name


@pytest.mark.parametrize(
    "path", [p for p in CLUSTER_YAMLS if _uses_docker(_load(p))], ids=lambda path: path.name
)
def test_image_carries_the_installed_ray(path):
    # `ray up` from a laptop whose Ray differs from the cluster's fails in confusing ways.
    image = _load(path)["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray.__version__}-"), f"{path.name}: {image}"


@pytest.mark.parametrize(
    "path", [p for p in CLUSTER_YAMLS if _load(p)["provider"]["type"] == "external"], ids=lambda path: path.name
)
def test_the_head_installs_an_external_providers_module_before_ray_starts(path):
    # The head's autoscaler imports provider.module when `ray start --head` runs; Ray runs
    # setup_commands + head_setup_commands before head_start_ray_commands, on the head only.
    config = prepare_config(_load(path))
    package = config["provider"]["module"].split(".")[0]
    assert config["file_mounts"].get(f"~/{package}") == ".", f"{path.name}: the checkout must reach the head"
    installs = [c for c in config["head_setup_commands"] if "pip install" in c and package in c]
    assert installs, f"{path.name}: head_setup_commands must pip install ~/{package}"
    if _cloud(config) == "azure":
        assert any(f"{package}[azure]" in c for c in installs), f"{path.name}: the head needs the Azure SDK extra"
    assert all("ray start" not in c for c in config["head_setup_commands"])


def test_aws_efa_workers_get_an_efa_interface_on_every_network_card_and_one_placement_group():
    config = prepare_config(_load(CLUSTER_DIR / "aws-efa.yaml"))
    node_config = config["available_node_types"]["ray.worker.gpu"]["node_config"]
    interfaces = node_config["NetworkInterfaces"]
    efa_cards = [i["NetworkCardIndex"] for i in interfaces if i["InterfaceType"] in ("efa", "efa-only")]
    assert sorted(efa_cards) == list(range(32)), "p5.48xlarge: one EFA interface on each of its 32 network cards"
    slots = [(i["NetworkCardIndex"], i["DeviceIndex"]) for i in interfaces]
    assert len(set(slots)) == len(slots), "two interfaces on one network card and device index"
    primary = next(i for i in interfaces if (i["NetworkCardIndex"], i["DeviceIndex"]) == (0, 0))
    assert primary["InterfaceType"] != "efa-only", "EC2 refuses an EFA-only primary interface"
    # EFA traffic is not routed between subnets.
    assert len({i["SubnetId"] for i in interfaces}) == 1
    assert node_config["Placement"]["GroupName"]
    assert "InstanceMarketOptions" not in node_config, "no Spot: an interruption stops the whole gang"
    # What Ray's AWS bootstrap does with NetworkInterfaces (ray up): one subnet and security
    # group per interface, and neither given next to them.
    resolved = _configure_from_network_interfaces(config)["available_node_types"]["ray.worker.gpu"]["node_config"]
    assert set(resolved["SubnetIds"]) == {primary["SubnetId"]}
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert set(resolved["SecurityGroupIds"]) == set(head["SecurityGroupIds"]), "head and workers share the EFA group"
    # EFA's user space (libfabric, aws-ofi-nccl) in the container, without touching the host's kernel.
    setup = " ".join(config["worker_setup_commands"])
    assert "efa_installer.sh" in setup and "--skip-kmod" in setup
