"""Ray's Azure node provider, with every InfiniBand worker VM of a node type in one availability set.

Start at `AzureInfiniBandNodeProvider`. cluster/ib.yaml loads it through Ray's own loader
(ray/autoscaler/_private/providers.py, `_import_external`):

    provider:
      type: external
      module: raytrain.autoscaler.azure.AzureInfiniBandNodeProvider

and names the set in the GPU worker type's `node_config.infiniband_availability_set`.

Why: Azure connects InfiniBand only between VMs of one availability set or one Uniform scale set
with a single placement group (Azure's "Set up InfiniBand" article), and a VM joins a set only when
it is created. Ray 2.60's AzureNodeProvider deploys every VM from a fixed ARM template without an
availability set, so two autoscaled ND H100 v5 VMs may share no fabric, and NCCL then trains over
TCP without saying so.

What differs from Ray's AzureNodeProvider (ray==2.60.0, pinned in pyproject.toml):
  * `bootstrap_config` (`ray up`, `ray down`, on your machine) checks every node type's InfiniBand
    settings (`check_cluster_config`) before Ray's own bootstrap creates the resource group, VNet,
    NSG and identity;
  * `_create_node` deploys VMs of a node type that names a set from raytrain's copy of Ray's ARM
    template (azure-vm-ib-template.json: Ray's template plus `availabilitySetName`), creating the
    set first if it is missing and refusing a launch past Azure's 200 VMs per set; the head, and
    any type without a set, go through Ray's code and Ray's template unchanged;
  * `cleanup_cluster_resources` (`ray down`) also deletes this cluster's sets that hold no VM.
Listing, tags, IPs, stopped-node reuse, deallocation and deletion are Ray's code.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import threading
from importlib import resources
from typing import Any, Mapping
from uuid import uuid4

from azure.core.exceptions import ResourceNotFoundError
from azure.mgmt.compute.models import AvailabilitySet, Sku
from azure.mgmt.resource.resources.models import DeploymentMode
from ray.autoscaler._private._azure.config import get_azure_sdk_function
from ray.autoscaler._private._azure.node_provider import UNIQUE_ID_LEN, VM_NAME_MAX_LEN, AzureNodeProvider
from ray.autoscaler._private.constants import AUTOSCALER_NODE_START_WAIT_S
from ray.autoscaler.tags import TAG_RAY_CLUSTER_NAME, TAG_RAY_NODE_NAME, TAG_RAY_USER_NODE_TYPE

logger = logging.getLogger(__name__)

AVAILABILITY_SET_KEY = "infiniband_availability_set"
"""node_config key: the availability set every VM of this node type joins (one IB fabric, one p-key)."""
TEMPLATE_NAME = "azure-vm-ib-template.json"
# Azure's limit for one availability set ("Set up InfiniBand", cluster configuration options). A
# deallocated VM stays a member, so stopped nodes count too.
MAX_VMS_PER_AVAILABILITY_SET = 200
# Azure's rule for availability set names: 1-80 letters, digits, '_', '.', '-'; starting with a letter
# or digit and ending with a letter, digit or '_'.
_SET_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,78}[A-Za-z0-9_])?$")
# Azure size names: Standard_<family><vCPUs>[-<constrained vCPUs>]<features>[_<accelerator>][_<version>];
# the feature letter "r" marks RDMA (InfiniBand) sizes: ND96isr_H100_v5, HB176rs_v4, ND96amsr_A100_v4.
# Matched in any case, as are `priority` values below: we take Azure's compute API to accept size names
# and priorities case-insensitively (as ARM does its names; not found stated in Azure's docs), so
# standard_nd96isr_h100_v5 deploys the same RDMA VM and must meet the same checks.
_VM_SIZE = re.compile(r"^Standard_[A-Z]+\d+(?:-\d+)?(?P<features>[a-z]*)(?:_|$)", re.IGNORECASE)
# The address space Azure's RDMA network reserves; a VNet that overlaps it breaks IP over IB.
_AZURE_RDMA_NETWORK = ipaddress.ip_network("172.16.0.0/16")


def is_rdma_vm_size(vm_size: str) -> bool:
    """True for Azure sizes with InfiniBand (the "r" feature letter), e.g. Standard_ND96isr_H100_v5."""
    match = _VM_SIZE.match(vm_size)
    return bool(match) and "r" in match.group("features").lower()


# ---------------------------------------------------------------------------------------------
# Checks of the cluster file, run by `ray up` before anything is created.


def check_cluster_config(config: Mapping[str, Any]) -> None:
    """Raise ValueError (one line: the key, what is wrong, the fix) for InfiniBand settings Azure would
    refuse, or that would leave GPU workers without a shared fabric. `config` is a prepared cluster
    config (Ray's prepare_config has filled every node type's max_workers)."""
    provider = config["provider"]
    node_types = config["available_node_types"]
    head_type = config["head_node_type"]
    # Ray's top-level max_workers caps the workers of all types together (both autoscalers enforce it on
    # top of each type's own max_workers), so no type, and no set, can hold more VMs than it.
    cluster_max_workers = config.get("max_workers", float("inf"))
    _check_subnet(provider)
    vm_size_by_set: dict[str, tuple[str, str]] = {}
    workers_by_set: dict[str, int] = {}
    for name, node_type in node_types.items():
        key = f"available_node_types.{name}"
        node_config = node_type.get("node_config", {})
        set_name = node_config.get(AVAILABILITY_SET_KEY)
        vm_size = node_config.get("azure_arm_parameters", {}).get("vmSize", "")
        if set_name is None:
            max_workers = min(node_type.get("max_workers", 0), cluster_max_workers)
            if name != head_type and is_rdma_vm_size(vm_size) and max_workers > 1:
                raise ValueError(
                    f"{key}.node_config.{AVAILABILITY_SET_KEY} is missing: {max_workers} {vm_size} VMs deployed "
                    "one by one share no InfiniBand fabric, so NCCL would fall back to TCP between them; "
                    "name an availability set there (e.g. raytrain-ib-gpu)")
            continue
        if name == head_type:
            raise ValueError(
                f"{key}.node_config.{AVAILABILITY_SET_KEY}: the head must stay outside the InfiniBand "
                "availability set (a CPU VM would pin the set to a hardware cluster without the GPU SKU); "
                "remove the key from the head's node_config")
        check_member_node_config(key, node_config, provider)
        first = vm_size_by_set.setdefault(set_name, (name, vm_size))
        if first[1].lower() != vm_size.lower():
            raise ValueError(
                f"{key}.node_config.{AVAILABILITY_SET_KEY}: set {set_name} already holds {first[0]}'s "
                f"{first[1]}; one set is one hardware cluster, so give {vm_size} a set of its own")
        workers_by_set[set_name] = workers_by_set.get(set_name, 0) + node_type.get("max_workers", 0)
        num_vms = min(workers_by_set[set_name], cluster_max_workers)
        if num_vms > MAX_VMS_PER_AVAILABILITY_SET:
            raise ValueError(
                f"{key}.max_workers: node types in availability set {set_name} may reach {num_vms} VMs (their "
                "max_workers summed, capped by the top-level max_workers), Azure allows "
                f"{MAX_VMS_PER_AVAILABILITY_SET} per set; lower max_workers or split the workers over several sets "
                "(no InfiniBand between sets)")


def check_member_node_config(key: str, node_config: Mapping[str, Any], provider: Mapping[str, Any]) -> None:
    """The per-VM rules for a node type whose `node_config` names an availability set."""
    set_name = node_config[AVAILABILITY_SET_KEY]
    arm = node_config.get("azure_arm_parameters", {})
    vm_size = arm.get("vmSize", "")
    if not isinstance(set_name, str) or not _SET_NAME.fullmatch(set_name):
        raise ValueError(
            f"{key}.node_config.{AVAILABILITY_SET_KEY}: {set_name!r} is not an Azure availability set name; "
            "use 1-80 letters, digits, '_', '.', '-', starting with a letter or digit")
    if not is_rdma_vm_size(vm_size):
        raise ValueError(
            f"{key}.node_config.{AVAILABILITY_SET_KEY}: vmSize {vm_size!r} has no InfiniBand (no 'r' in its "
            "features), so a set buys nothing; use an RDMA size such as Standard_ND96isr_H100_v5 or remove the key")
    priority = arm.get("priority", "Regular")
    # Azure's VM priorities: Regular, Spot, SpotPlus (a Spot kind), Low ("will be deprecated, use Spot": its
    # older name). The ARM template sets an eviction policy for "Spot" alone, so Low went out as a Spot VM
    # without one; and any other value, Azure refuses at the first scale-up, not at `ray up`.
    if str(priority).lower() in ("spot", "low", "spotplus"):
        raise ValueError(
            f"{key}.node_config.azure_arm_parameters.priority: {priority!r} asks for Spot VMs, and Azure refuses "
            "Spot VMs in an availability set (AzureSpotVMNotSupportedInAvailabilitySet); set priority: Regular")
    if str(priority).lower() != "regular":
        raise ValueError(
            f"{key}.node_config.azure_arm_parameters.priority: {priority!r} is not an Azure VM priority (Regular, "
            "Spot, SpotPlus, Low), and VMs in an availability set must be Regular: set priority: Regular")
    # Ray's precedence: the node's availability_zone, else the provider's; unset means "auto", which
    # places VMs in zones, and Azure refuses a VM with both a zone and an availability set.
    where, zone = ((f"{key}.node_config.azure_arm_parameters.availability_zone", arm["availability_zone"])
                   if "availability_zone" in arm else ("provider.availability_zone", provider.get("availability_zone")))
    if str(zone).strip().lower() not in ("none", "null"):
        raise ValueError(
            f"{where}: {zone!r} places VMs in availability zones, and Azure refuses a VM in both a zone and an "
            'availability set; set it to "none"')


def _check_subnet(provider: Mapping[str, Any]) -> None:
    subnet_mask = provider.get("subnet_mask")
    if subnet_mask is None:
        return
    try:
        network = ipaddress.ip_network(subnet_mask, strict=False)
    except ValueError as e:
        raise ValueError(
            f"provider.subnet_mask: {subnet_mask!r} is not an address range ({e}); write it in CIDR form "
            "(e.g. 10.40.0.0/16) or leave it out") from None
    if network.overlaps(_AZURE_RDMA_NETWORK):
        raise ValueError(
            f"provider.subnet_mask: {subnet_mask} overlaps {_AZURE_RDMA_NETWORK}, which Azure's RDMA network "
            "reserves; pick another range (e.g. 10.40.0.0/16) or leave it out")


def load_template() -> dict[str, Any]:
    """raytrain's ARM template for VMs in an availability set (package data next to this module)."""
    return json.loads(resources.files(__package__).joinpath(TEMPLATE_NAME).read_text())


# ---------------------------------------------------------------------------------------------
# The provider.


class AzureInfiniBandNodeProvider(AzureNodeProvider):
    """Ray's AzureNodeProvider; VMs of node types naming `infiniband_availability_set` join that set.

    Ray's autoscaler v2 drives it through NodeProviderAdapter (create_node_with_resources_and_labels,
    terminate_nodes, non_terminated_nodes, node_tags, is_running), exactly as it drives Ray's own.
    """

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        # Serialises get-or-create of a set and the member count; the deployment itself (minutes for
        # an ND VM) runs outside it, so two launches may still race past 200 and Azure refuses one.
        self._availability_set_lock = threading.Lock()

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        check_cluster_config(cluster_config)
        return AzureNodeProvider.bootstrap_config(cluster_config)

    def _create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> None:
        set_name = node_config.get(AVAILABILITY_SET_KEY)
        if set_name is None:
            return super()._create_node(node_config, tags, count)
        # Checked at `ray up` already; again here because the head runs from the bootstrapped file,
        # which a user may have edited.
        check_member_node_config(f"available_node_types.{tags.get(TAG_RAY_USER_NODE_TYPE, '?')}", node_config,
                                 self.provider_config)
        with self._availability_set_lock:
            num_members = self._ensure_availability_set(set_name)
            if num_members + count > MAX_VMS_PER_AVAILABILITY_SET:
                raise ValueError(
                    f"availability set {set_name} holds {num_members} VMs (deallocated ones included) and Azure "
                    f"allows {MAX_VMS_PER_AVAILABILITY_SET}, so {count} more cannot join it; delete stopped VMs "
                    "(cache_stopped_nodes: false deletes them on scale-down) or lower max_workers")
        self._deploy_into_set(node_config, tags, count, set_name)

    def _ensure_availability_set(self, set_name: str) -> int:
        """Create the set if it is missing; return how many VMs it holds."""
        resource_group = self.provider_config["resource_group"]
        sets = self.compute_client.availability_sets
        try:
            existing = sets.get(resource_group_name=resource_group, availability_set_name=set_name)
        except ResourceNotFoundError:
            logger.info("Creating availability set %s in %s for InfiniBand", set_name, resource_group)
            existing = sets.create_or_update(
                resource_group_name=resource_group, availability_set_name=set_name,
                parameters=AvailabilitySet(
                    # Ray's bootstrap created the resource group in this location (its VM template
                    # deploys into resourceGroup().location), so the set and the VMs agree.
                    location=self.provider_config["location"],
                    # Aligned: the only SKU that takes managed disks, which the template's VMs use.
                    sku=Sku(name="Aligned"),
                    # One fault and one update domain: a training gang stops when any VM goes, so
                    # spreading VMs over racks and maintenance waves buys nothing and narrows where
                    # Azure can place the next one.
                    platform_fault_domain_count=1,
                    platform_update_domain_count=1,
                    # How `cleanup_cluster_resources` finds this cluster's sets.
                    tags={TAG_RAY_CLUSTER_NAME: self.cluster_name}))
        sku = existing.sku.name if existing.sku is not None else "Classic"
        if sku != "Aligned":
            raise ValueError(
                f"availability set {set_name} in {resource_group} has SKU {sku}, which cannot hold VMs with managed "
                f"disks; delete it, or name another set in node_config.{AVAILABILITY_SET_KEY}")
        return len(existing.virtual_machines or [])

    def _deploy_into_set(self, node_config: dict[str, Any], tags: dict[str, str], count: int,
                         set_name: str) -> None:
        """Ray's `_create_node` (Ray 2.60) for VMs of one set: raytrain's template, no zones."""
        resource_group = self.provider_config["resource_group"]
        config_tags = {**node_config.get("tags", {}), **tags, TAG_RAY_CLUSTER_NAME: self.cluster_name}
        deployment_name = "{node}-{unique_id}-{vm_id}".format(
            node=config_tags.get(TAG_RAY_NODE_NAME, "node"), unique_id=self.provider_config["unique_id"],
            vm_id=uuid4().hex[:UNIQUE_ID_LEN])[:VM_NAME_MAX_LEN]
        template_params = dict(node_config["azure_arm_parameters"])
        template_params.pop("availability_zone", None)  # checked "none" above; the template takes "zones"
        template_params.update(
            # The template appends copyIndex() to each VM's name.
            vmName=deployment_name,
            # The head is never in a set, so only use_internal_ips decides (Ray's rule for workers).
            provisionPublicIp=not self.provider_config.get("use_internal_ips", False),
            vmTags=config_tags, vmCount=count,
            msi=self.provider_config["msi"], nsg=self.provider_config["nsg"],
            subnet=self.provider_config["subnet"],
            zones=[], availabilitySetName=set_name)
        logger.info("Creating %d VMs in availability set %s (deployment %s)", count, set_name, deployment_name)
        create_or_update = get_azure_sdk_function(client=self.resource_client.deployments,
                                                  function_name="create_or_update")
        create_or_update(
            resource_group_name=resource_group, deployment_name=deployment_name,
            parameters={"properties": {
                "mode": DeploymentMode.incremental, "template": load_template(),
                "parameters": {key: {"value": value} for key, value in template_params.items()}}},
        ).wait(timeout=AUTOSCALER_NODE_START_WAIT_S)

    def cleanup_cluster_resources(self) -> None:
        """`ray down`: this cluster's empty availability sets, then Ray's MSI/NSG/subnet/VNet cleanup.

        A set that still holds VMs (deallocated by cache_stopped_nodes) stays, and keeps its p-key.
        """
        resource_group = self.provider_config["resource_group"]
        try:
            for availability_set in self.compute_client.availability_sets.list(resource_group_name=resource_group):
                if (availability_set.tags or {}).get(TAG_RAY_CLUSTER_NAME) != self.cluster_name:
                    continue
                if availability_set.virtual_machines:
                    logger.info("Keeping availability set %s: it still holds %d VMs", availability_set.name,
                                len(availability_set.virtual_machines))
                    continue
                logger.info("Deleting availability set %s", availability_set.name)
                self.compute_client.availability_sets.delete(resource_group_name=resource_group,
                                                             availability_set_name=availability_set.name)
        except Exception as e:  # noqa: BLE001 - as Ray's own cleanup steps: warn, go on with the rest
            logger.warning("Failed to delete availability sets in %s: %s", resource_group, e)
        super().cleanup_cluster_resources()
