"""raytrain.autoscaler.azure under Ray's real autoscaler code: cluster/ib.yaml goes through Ray's
`ray up` config path (`_bootstrap_config`: prepare_config, validate_config, the provider's
bootstrap, which runs Ray's own Azure bootstrap), the provider is built by Ray's external-provider
loader, the head is launched as `ray up` launches it, and GPU workers come and go through autoscaler
v2's NodeProviderAdapter reading the bootstrapped file with Ray's FileConfigReader.

Faked, and only these: the Azure SDK's management clients and credentials (azure_sdk_fake.py: an
in-memory subscription that records ARM deployments and returns the SDK's own model objects), the
Azure CLI profile lookup, and Ray's cloud probe `get_cloud_from_metadata_requests`. There is no Azure
subscription here, and the probe would send HTTP requests to the instance metadata address
169.254.169.254. Everything between those clients and Ray's autoscaler is the real code.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import jsonschema
import pytest
import yaml
from azure.mgmt.compute.models import AvailabilitySet, Sku
from ray.autoscaler._private import providers
from ray.autoscaler._private._azure import config as ray_azure_config
from ray.autoscaler._private._azure import node_provider as ray_azure_node_provider
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import hash_launch_conf, prepare_config
from ray.autoscaler.tags import (NODE_KIND_HEAD, NODE_KIND_WORKER, STATUS_UNINITIALIZED, TAG_RAY_CLUSTER_NAME,
                                 TAG_RAY_LAUNCH_CONFIG, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME, TAG_RAY_NODE_STATUS,
                                 TAG_RAY_USER_NODE_TYPE)
from ray.autoscaler.v2.instance_manager.config import FileConfigReader
from ray.autoscaler.v2.instance_manager.node_provider import LaunchNodeError, NodeProviderAdapter
from ray.core.generated.instance_manager_pb2 import NodeKind

from tests.unit.autoscaler import azure_sdk_fake
from tests.unit.autoscaler.azure_sdk_fake import SUBSCRIPTION_ID, FakeAzure
from raytrain.autoscaler import azure as ib_azure
from raytrain.autoscaler.azure import TEMPLATE_NAME, AzureInfiniBandNodeProvider, load_template

REPO = Path(__file__).resolve().parents[3]
IB_YAML = REPO / "cluster" / "ib.yaml"
GPU = "ray.worker.gpu"
SET = "raytrain-ib-gpu"
RAY_VM_TEMPLATE = Path(ray_azure_node_provider.__file__).parent / "azure-vm-template.json"


@pytest.fixture
def cloud(monkeypatch, tmp_path) -> FakeAzure:
    cloud = FakeAzure()
    profile = SimpleNamespace(get_subscription_id=lambda: SUBSCRIPTION_ID)
    for module in (ray_azure_node_provider, ray_azure_config):
        for name, constructor in azure_sdk_fake.clients(cloud).items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, constructor)
        monkeypatch.setattr(module, "get_cli_profile", lambda: profile)
    monkeypatch.setattr(ray_azure_node_provider, "DefaultAzureCredential", lambda **kwargs: object())
    monkeypatch.setattr(ray_azure_config, "AzureCliCredential", lambda: object())
    monkeypatch.setattr(ray_azure_node_provider, "get_cloud_from_metadata_requests", lambda: "unknown")
    monkeypatch.setenv("HOME", str(tmp_path))  # Ray's bootstrap writes its SSH key pair to ~/.ssh
    providers._clear_provider_cache()
    yield cloud
    providers._clear_provider_cache()


def ib_config(**provider_overrides: Any) -> dict[str, Any]:
    config = yaml.safe_load(IB_YAML.read_text())
    config["provider"].update(provider_overrides)
    return config


def bootstrap(tmp_path: Path, config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """What `ray up` does before it launches the head, and the file the head's autoscaler reads."""
    resolved = _bootstrap_config(config, no_config_cache=True)
    path = tmp_path / "ray_bootstrap_config.yaml"
    path.write_text(yaml.safe_dump(resolved))
    return resolved, str(path)


def launch_head(provider: Any, config: dict[str, Any]) -> str:
    """As ray.autoscaler._private.commands.get_or_create_head_node launches the head."""
    head_type = config["head_node_type"]
    node_config = config["available_node_types"][head_type]["node_config"]
    provider.create_node(node_config, {
        TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: head_type,
        TAG_RAY_LAUNCH_CONFIG: hash_launch_conf(node_config, config["auth"]),
        TAG_RAY_NODE_NAME: f"ray-{config['cluster_name']}-head", TAG_RAY_NODE_STATUS: STATUS_UNINITIALIZED}, 1)
    (head,) = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD})
    return head


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """The adapter launches and terminates on its own threads; poll as the reconciler would."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := probe():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def workers(adapter: NodeProviderAdapter) -> list[str]:
    return sorted(i for i, c in adapter.get_non_terminated().items() if c.node_kind == NodeKind.WORKER)


def vm_deployments(cloud: FakeAzure) -> list[dict[str, Any]]:
    return [d for d in cloud.deployments if d["name"] != "ray-config"]


def vm_resource(template: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in template["resources"] if r["type"] == "Microsoft.Compute/virtualMachines")


def start_cluster(tmp_path: Path, config: dict[str, Any]) -> SimpleNamespace:
    """`ray up` with `config`: the head launched, and the head's autoscaler adapter over the bootstrapped file."""
    config, path = bootstrap(tmp_path, config)
    provider = providers._get_node_provider(config["provider"], config["cluster_name"])
    head = launch_head(provider, config)
    adapter = NodeProviderAdapter(v1_provider=provider, config_reader=FileConfigReader(path, skip_content_hash=True))
    return SimpleNamespace(config=config, provider=provider, head=head, adapter=adapter)


@pytest.fixture
def cluster(cloud, tmp_path):
    return start_cluster(tmp_path, ib_config())


def test_rays_external_provider_loader_builds_raytrains_provider(cloud):
    provider_config = ib_config()["provider"]
    assert providers._get_node_provider_cls(provider_config) is AzureInfiniBandNodeProvider
    provider = providers._get_node_provider(provider_config, "raytrain-ib")
    assert isinstance(provider, ray_azure_node_provider.AzureNodeProvider)


def test_bootstrap_is_rays_azure_bootstrap_after_the_ib_checks(cloud, tmp_path):
    config, _ = bootstrap(tmp_path, ib_config())
    (ray_config,) = cloud.deployments
    # Ray's own template for the resource group's shared resources, unchanged.
    resource_types = {r["type"] for r in ray_config["template"]["resources"]}
    assert {"Microsoft.Network/virtualNetworks", "Microsoft.Network/networkSecurityGroups"} <= resource_types
    assert {"msi", "nsg", "subnet", "unique_id", "subscription_id"} <= set(config["provider"])
    assert Path(config["auth"]["ssh_private_key"]).is_file()
    assert config["available_node_types"][GPU]["node_config"]["azure_arm_parameters"]["publicKey"]
    assert not cloud.availability_sets, "the set is made on the first scale-up, not by ray up"


def test_gpu_workers_join_one_availability_set_and_the_head_does_not(cloud, cluster):
    cluster.adapter.launch({GPU: 2}, request_id="scale-up-1")
    wait_for("2 workers", lambda: len(workers(cluster.adapter)) == 2)
    cluster.adapter.launch({GPU: 1}, request_id="scale-up-2")
    gpu_vms = wait_for("3 workers", lambda: len(workers(cluster.adapter)) == 3 and workers(cluster.adapter))
    assert not cluster.adapter.poll_errors()

    head_deployment, *worker_deployments = vm_deployments(cloud)
    assert len(worker_deployments) == 2  # one per launch request
    assert "availabilitySetName" not in head_deployment["parameters"]
    assert "availabilitySet" not in vm_resource(head_deployment["template"])["properties"]
    assert cloud.vms[cluster.head].availability_set is None
    assert {d["parameters"]["availabilitySetName"] for d in worker_deployments} == {SET}
    assert all(d["parameters"]["zones"] == [] and not d["parameters"]["provisionPublicIp"] for d in worker_deployments)
    assert sorted(cloud.members(SET)) == gpu_vms

    availability_set = cloud.availability_sets[SET]
    assert (availability_set.sku.name, availability_set.platform_fault_domain_count,
            availability_set.platform_update_domain_count) == ("Aligned", 1, 1)
    assert availability_set.location == cluster.config["provider"]["location"]
    assert availability_set.tags == {TAG_RAY_CLUSTER_NAME: "raytrain-ib"}
    instances = cluster.adapter.get_non_terminated()
    assert instances[cluster.head].node_kind == NodeKind.HEAD
    assert {instances[vm].node_type for vm in gpu_vms} == {GPU}
    assert {instances[vm].request_id for vm in gpu_vms} == {"scale-up-1", "scale-up-2"}


def test_scale_to_zero_deallocates_and_scale_up_restarts_the_same_members(cloud, cluster):
    cluster.adapter.launch({GPU: 2}, request_id="up")
    first = wait_for("2 workers", lambda: len(workers(cluster.adapter)) == 2 and workers(cluster.adapter))
    cluster.adapter.terminate(first, request_id="down")
    wait_for("scale to zero", lambda: not workers(cluster.adapter))
    assert {cloud.power[vm] for vm in first} == {"deallocated"}
    assert sorted(cloud.members(SET)) == first, "deallocated VMs stay in the set"

    cluster.adapter.launch({GPU: 2}, request_id="up-again")
    again = wait_for("2 workers again", lambda: len(workers(cluster.adapter)) == 2 and workers(cluster.adapter))
    assert again == first
    assert cloud.calls.count("VirtualMachines.begin_start") == 2
    assert len(vm_deployments(cloud)) == 2, "restarted, not redeployed (head + one worker deployment)"
    assert not cluster.adapter.poll_errors()


def test_deleted_workers_leave_the_set_and_ray_down_removes_it_once_empty(cloud, tmp_path):
    config, path = bootstrap(tmp_path, ib_config(cache_stopped_nodes=False))
    provider = providers._get_node_provider(config["provider"], config["cluster_name"])
    head = launch_head(provider, config)
    adapter = NodeProviderAdapter(v1_provider=provider, config_reader=FileConfigReader(path, skip_content_hash=True))
    adapter.launch({GPU: 2}, request_id="up")
    gpu_vms = wait_for("2 workers", lambda: len(workers(adapter)) == 2 and workers(adapter))
    adapter.terminate(gpu_vms, request_id="down")
    wait_for("workers deleted", lambda: not (set(gpu_vms) & set(cloud.vms)))
    assert cloud.members(SET) == [], "the empty set outlives scale-to-zero, with its p-key"

    provider.terminate_node(head)
    wait_for("head deleted", lambda: head not in cloud.vms)
    provider.cleanup_cluster_resources()
    assert SET not in cloud.availability_sets


def test_ray_down_keeps_a_set_that_still_holds_deallocated_workers(cloud, cluster):
    cluster.adapter.launch({GPU: 1}, request_id="up")
    wait_for("1 worker", lambda: workers(cluster.adapter))
    # Listed after SET: this cluster's empty set (deleted), another cluster's and an untagged one (kept).
    for name, tags in (("raytrain-ib-h200", {TAG_RAY_CLUSTER_NAME: "raytrain-ib"}),
                       ("other-cluster-ib", {TAG_RAY_CLUSTER_NAME: "other-cluster"}), ("made-by-hand", None)):
        existing_set(cloud, name, Sku(name="Aligned"), tags)
    cluster.provider.terminate_nodes(workers(cluster.adapter) + [cluster.head])
    cluster.provider.cleanup_cluster_resources()
    assert len(cloud.members(SET)) == 1
    assert set(cloud.availability_sets) == {SET, "other-cluster-ib", "made-by-hand"}


def test_without_use_internal_ips_set_members_get_public_ips_as_rays_workers_do(cloud, tmp_path):
    config = ib_config()
    config["provider"].pop("use_internal_ips")
    cluster = start_cluster(tmp_path, config)
    cluster.adapter.launch({GPU: 1}, request_id="one")
    wait_for("1 worker", lambda: workers(cluster.adapter))
    (_, worker_deployment) = vm_deployments(cloud)
    assert worker_deployment["parameters"]["provisionPublicIp"] is True


def test_the_201st_vm_is_refused_before_any_deployment(cloud, cluster):
    # 199 stopped members left from an earlier launch config: never reused, still counted by Azure.
    cluster.provider._ensure_availability_set(SET)
    stale = {TAG_RAY_CLUSTER_NAME: "raytrain-ib", TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: GPU,
             TAG_RAY_LAUNCH_CONFIG: "an-older-node-config"}
    for i in range(199):
        cloud.add_vm(f"stale-{i}", stale, "Standard_ND96isr_H100_v5", "Regular", SET, public_ip=False,
                     power="deallocated")
    deployments_before = len(cloud.deployments)

    cluster.adapter.launch({GPU: 2}, request_id="over")
    (error,) = wait_for("the launch error", cluster.adapter.poll_errors)
    assert isinstance(error, LaunchNodeError)
    assert re.search(rf"availability set {SET} holds 199 VMs .* allows 200", str(error.__cause__))
    assert len(cloud.deployments) == deployments_before

    cluster.adapter.launch({GPU: 1}, request_id="the-200th")
    wait_for("the 200th member", lambda: workers(cluster.adapter))
    assert len(cloud.members(SET)) == 200


def existing_set(cloud: FakeAzure, name: str, sku: Sku | None, tags: dict[str, str] | None) -> None:
    """An empty availability set that raytrain did not create for this cluster."""
    availability_set = AvailabilitySet(location="westus2", sku=sku, tags=tags, virtual_machines=[])
    availability_set.name, availability_set.id = name, cloud.rid("Microsoft.Compute/availabilitySets", name)
    cloud.availability_sets[name] = availability_set


@pytest.mark.parametrize("sku", [Sku(name="Classic"), None], ids=["Classic", "no SKU"])
def test_an_existing_set_that_cannot_hold_managed_disks_is_refused_before_any_deployment(cloud, cluster, sku):
    """A set made outside raytrain (Azure reports a Classic set's SKU as Classic, or none) is not reused."""
    existing_set(cloud, SET, sku, tags=None)
    deployments_before = len(cloud.deployments)
    cluster.adapter.launch({GPU: 1}, request_id="into-classic")
    (error,) = wait_for("the launch error", cluster.adapter.poll_errors)
    assert re.fullmatch(rf"availability set {SET} in \S+ has SKU Classic, which cannot hold VMs with managed disks; "
                        r"delete it, or name another set in node_config\.infiniband_availability_set",
                        str(error.__cause__))
    assert len(cloud.deployments) == deployments_before


def _gpu(config: dict[str, Any]) -> dict[str, Any]:
    return config["available_node_types"][GPU]


def _arm(config: dict[str, Any]) -> dict[str, Any]:
    return _gpu(config)["node_config"]["azure_arm_parameters"]


def _h200_sharing_the_set(config: dict[str, Any]) -> None:
    h200 = copy.deepcopy(_gpu(config))
    h200["node_config"]["azure_arm_parameters"]["vmSize"] = "Standard_ND96isr_H200_v5"
    config["available_node_types"]["ray.worker.h200"] = h200


BAD_CLUSTER_FILES = {
    "set on a non-RDMA size": (lambda c: _arm(c).update(vmSize="Standard_NC96ads_A100_v4"),
                               r"vmSize 'Standard_NC96ads_A100_v4' has no InfiniBand"),
    "201 workers for one set": (lambda c: (_gpu(c).update(max_workers=201), c.update(max_workers=201)),
                                r"ray\.worker\.gpu\.max_workers: .* 201 VMs .*Azure allows 200"),
    "Spot in a set": (lambda c: _arm(c).update(priority="Spot"),
                      r"priority: .*AzureSpotVMNotSupportedInAvailabilitySet"),
    "head in the set": (lambda c: c["available_node_types"]["ray.head.default"]["node_config"].update(
        infiniband_availability_set=SET), r"head must stay outside"),
    "zones from the provider": (lambda c: c["provider"].update(availability_zone="1"),
                                r'^provider\.availability_zone: .* set it to "none"'),
    "zones on the node": (lambda c: _arm(c).update(availability_zone="auto"),
                          r"azure_arm_parameters\.availability_zone: 'auto'"),
    "RDMA workers without a set": (lambda c: _gpu(c)["node_config"].pop("infiniband_availability_set"),
                                   r"infiniband_availability_set is missing: 4 Standard_ND96isr_H100_v5 VMs"),
    "VNet on Azure's RDMA range": (lambda c: c["provider"].update(subnet_mask="172.16.0.0/16"),
                                   r"^provider\.subnet_mask: 172\.16\.0\.0/16 overlaps"),
    "two sizes in one set": (_h200_sharing_the_set, r"give Standard_ND96isr_H200_v5 a set of its own"),
    "not a set name": (lambda c: _gpu(c)["node_config"].update(infiniband_availability_set="-ib"),
                       r"'-ib' is not an Azure availability set name"),
    # YAML's block scalar (`key: |`) keeps the line's newline; Azure would refuse the name at the first scale-up.
    "a set name ending in a newline": (lambda c: _gpu(c)["node_config"].update(infiniband_availability_set=SET + "\n"),
                                       rf"'{SET}\\n' is not an Azure availability set name"),
    # Azure takes size names and priorities in any case, so the checks do too.
    "lowercase RDMA size without a set": (
        lambda c: (_arm(c).update(vmSize="standard_nd96isr_h100_v5"),
                   _gpu(c)["node_config"].pop("infiniband_availability_set")),
        r"infiniband_availability_set is missing: 4 standard_nd96isr_h100_v5 VMs"),
    "lowercase Spot in a set": (lambda c: _arm(c).update(priority="spot"),
                                r"priority: 'spot' asks for Spot VMs, .*AzureSpotVMNotSupportedInAvailabilitySet"),
    # Low is Azure's older name for Spot (the template gave it no eviction policy); a typo is not a priority.
    "Low (Spot's older name) in a set": (lambda c: _arm(c).update(priority="Low"),
                                         r"priority: 'Low' asks for Spot VMs, .*AzureSpotVMNotSupported"),
    "SpotPlus in a set": (lambda c: _arm(c).update(priority="SpotPlus"), r"priority: 'SpotPlus' asks for Spot VMs"),
    "a priority Azure does not have": (lambda c: _arm(c).update(priority="Reguar"),
                                       r"priority: 'Reguar' is not an Azure VM priority \(Regular, Spot, SpotPlus, "
                                       r"Low\), .* set priority: Regular$"),
    "subnet_mask not a network": (lambda c: c["provider"].update(subnet_mask="10.0.0.0/33"),
                                  r"^provider\.subnet_mask: '10\.0\.0\.0/33' is not an address range .*; write it "
                                  r"in CIDR form"),
    # The top-level max_workers caps what a type or a set can reach, and the message counts that.
    "RDMA workers without a set, top-level cap 2": (
        lambda c: (_gpu(c)["node_config"].pop("infiniband_availability_set"), c.update(max_workers=2)),
        r"infiniband_availability_set is missing: 2 Standard_ND96isr_H100_v5 VMs"),
    "300 per type, top-level cap 201": (lambda c: (_gpu(c).update(max_workers=300), c.update(max_workers=201)),
                                        r"ray\.worker\.gpu\.max_workers: .* 201 VMs .* Azure allows 200"),
}


@pytest.mark.parametrize("case", BAD_CLUSTER_FILES, ids=list(BAD_CLUSTER_FILES))
def test_bad_cluster_files_fail_ray_up_before_anything_is_created(cloud, tmp_path, case):
    edit, message = BAD_CLUSTER_FILES[case]
    config = ib_config()
    edit(config)
    with pytest.raises(ValueError, match=message) as raised:
        _bootstrap_config(config, no_config_cache=True)
    assert "\n" not in str(raised.value), "one line: the key, the problem, the fix"
    assert not cloud.calls, "nothing reached Azure"


def _lowercase_size_sharing_the_set(config: dict[str, Any]) -> None:
    _h200_sharing_the_set(config)
    _arm(config).update(vmSize="standard_nd96isr_h100_v5")
    config["available_node_types"]["ray.worker.h200"]["node_config"]["azure_arm_parameters"].update(
        vmSize="STANDARD_ND96ISR_H100_V5")


GOOD_CLUSTER_FILES = {
    "lowercase RDMA size in a set": lambda c: _arm(c).update(vmSize="standard_nd96isr_h100_v5"),
    "one size in two spellings in one set": _lowercase_size_sharing_the_set,
    # Ray launches at most the top-level max_workers workers of all types together.
    "300 per type, top-level cap 4": lambda c: _gpu(c).update(max_workers=300),
    "RDMA workers without a set, top-level cap 1": lambda c: (
        _gpu(c)["node_config"].pop("infiniband_availability_set"), c.update(max_workers=1)),
    "VNet off Azure's RDMA range": lambda c: c["provider"].update(subnet_mask="10.40.0.0/16"),
}


@pytest.mark.parametrize("case", GOOD_CLUSTER_FILES, ids=list(GOOD_CLUSTER_FILES))
def test_cluster_files_azure_and_ray_would_run_pass_ray_up(cloud, tmp_path, case):
    config = ib_config()
    GOOD_CLUSTER_FILES[case](config)
    resolved, _ = bootstrap(tmp_path, config)
    assert resolved["max_workers"] <= ib_azure.MAX_VMS_PER_AVAILABILITY_SET
    assert [d["name"] for d in cloud.deployments] == ["ray-config"], "Ray's own bootstrap ran"


def test_a_set_may_reach_azures_limit_exactly_under_a_higher_top_level_cap():
    config = ib_config()
    _gpu(config).update(max_workers=ib_azure.MAX_VMS_PER_AVAILABILITY_SET)
    config.update(max_workers=ib_azure.MAX_VMS_PER_AVAILABILITY_SET + 10)
    ib_azure.check_cluster_config(prepare_config(config))  # raises past 200


@pytest.mark.parametrize("vm_size, rdma", [
    ("standard_nd96isr_h100_v5", True), ("STANDARD_HB120-96RS_V3", True), ("standard_nc96ads_a100_v4", False),
    ("Standard_ND96isr_H100_v5", True), ("Standard_ND96isr_H200_v5", True), ("Standard_ND96amsr_A100_v4", True),
    ("Standard_HB120-96rs_v3", True), ("Standard_HC44rs", True), ("Standard_NC80adis_H100_v5", False),
    ("Standard_NC96ads_A100_v4", False), ("Standard_D16s_v5", False), ("", False)])
def test_rdma_sizes_are_the_ones_with_r_in_their_features(vm_size, rdma):
    assert ib_azure.is_rdma_vm_size(vm_size) is rdma


# A JSON schema for what the ARM template must be, from Azure's template reference
# (learn.microsoft.com/azure/azure-resource-manager/templates/syntax): typed parameters, resources
# with type, apiVersion and name, and a VM resource whose availability set is the parameter's.
ARM_TEMPLATE_SCHEMA = {
    "type": "object", "required": ["$schema", "contentVersion", "parameters", "resources"],
    "properties": {
        "$schema": {"const": "https://schema.management.azure.com/schemas/2019-04-01/deploymentTemplate.json#"},
        "contentVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+\.\d+$"},
        "metadata": {"type": "object"},
        "parameters": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["string", "securestring", "int", "bool", "object", "secureObject",
                                             "array"]}}}},
        "variables": {"type": "object"},
        "resources": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type", "apiVersion", "name"],
            "properties": {"type": {"type": "string", "pattern": r"^Microsoft\.\w+/\w+"},
                           "apiVersion": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}(-preview)?$"}},
            "if": {"properties": {"type": {"const": "Microsoft.Compute/virtualMachines"}}},
            "then": {"required": ["properties"], "properties": {"properties": {
                "required": ["availabilitySet"], "properties": {"availabilitySet": {
                    "required": ["id"], "properties": {"id": {"const": "[resourceId('Microsoft.Compute/"
                                                                      "availabilitySets', parameters("
                                                                      "'availabilitySetName'))]"}}}}}}}}},
        "outputs": {"type": "object"},
    },
    "additionalProperties": False,
}


def test_the_arm_template_passes_its_schema_and_declares_what_it_uses():
    template = load_template()
    jsonschema.validate(template, ARM_TEMPLATE_SCHEMA)
    # ARM matches parameter and variable names case-insensitively (Ray's template declares
    # publicIpAddressName and also uses it as publicIPAddressName).
    text = json.dumps(template).lower()
    used_parameters = set(re.findall(r"parameters\('(\w+)'\)", text))
    used_variables = set(re.findall(r"variables\('(\w+)'\)", text))
    declared_parameters = {name.lower() for name in template["parameters"]}
    declared_variables = {name.lower() for name in template["variables"]}
    assert used_parameters <= declared_parameters, used_parameters - declared_parameters
    assert used_variables <= declared_variables, used_variables - declared_variables
    assert declared_parameters <= used_parameters, declared_parameters - used_parameters


def test_the_arm_template_is_rays_plus_the_availability_set():
    """On a Ray upgrade this fails if Ray's template changed: carry the change over to ours."""
    ours, rays = load_template(), json.loads(RAY_VM_TEMPLATE.read_text())
    ours.pop("metadata")
    added = ours["parameters"].pop("availabilitySetName")
    assert added["type"] == "string" and "defaultValue" not in added, "required: the template is only for set members"
    assert vm_resource(ours)["properties"].pop("availabilitySet")
    assert ours == rays


def test_every_parameter_the_provider_passes_is_declared_and_every_required_one_passed(cloud, cluster):
    cluster.adapter.launch({GPU: 1}, request_id="one")
    wait_for("1 worker", lambda: workers(cluster.adapter))
    (_, worker_deployment) = vm_deployments(cloud)
    declared = load_template()["parameters"]
    passed = set(worker_deployment["parameters"])
    assert passed <= set(declared)
    assert {name for name, spec in declared.items() if "defaultValue" not in spec} <= passed


def test_the_template_ships_as_package_data():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch(TEMPLATE_NAME, pattern) for pattern in package_data["raytrain.autoscaler"])
    assert load_template()["parameters"]["availabilitySetName"]["type"] == "string"


def test_the_fake_speaks_the_real_sdks_method_names_and_arguments():
    from azure.mgmt.compute import ComputeManagementClient
    from azure.mgmt.network import NetworkManagementClient
    from azure.mgmt.resource import ResourceManagementClient

    class Credential:  # building a client sends nothing; no call is made below
        def get_token(self, *scopes, **kwargs):
            raise AssertionError("no request expected")

    real = {"ComputeManagementClient": ComputeManagementClient, "NetworkManagementClient": NetworkManagementClient,
            "ResourceManagementClient": ResourceManagementClient}
    fakes = azure_sdk_fake.clients(FakeAzure())
    for client_name, fake_constructor in fakes.items():
        real_client = real[client_name](Credential(), SUBSCRIPTION_ID)
        for group, fake_operations in vars(fake_constructor(None, SUBSCRIPTION_ID)).items():
            real_operations = getattr(real_client, group)
            for method_name, method in inspect.getmembers(fake_operations, inspect.ismethod):
                if method_name.startswith("_"):
                    continue
                real_method = getattr(real_operations, method_name)
                real_parameters = inspect.signature(real_method).parameters
                for parameter in inspect.signature(method).parameters.values():
                    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                        continue
                    assert parameter.name in real_parameters, f"{client_name}.{group}.{method_name}({parameter.name})"
