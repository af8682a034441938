"""A small in-memory Azure for the Azure node provider tests: fakes of the three management clients
Ray's Azure provider builds (compute, network, resource) and nothing else.

There is no Azure here, and a test must not reach one, so these stand in for the SDK clients; every
object they return is the SDK's own model (VirtualMachine, AvailabilitySet, NetworkInterface, ...),
so Ray's code reads the attributes it reads in production. An ARM deployment is recorded and then
applied the way Azure would apply the two templates involved (Ray's and raytrain's): one VM, NIC and
optional public IP per copy index, the VM in the availability set that the template's VM resource
names, and Azure's refusals that matter here: an undeclared or missing template parameter, a set
that does not exist, a 201st member, a Spot VM in a set, a zonal VM in a set.

Method names are the SDK's (azure-mgmt-compute 35, -network 29, -resource 24: `begin_*` for long
operations); tests/unit/test_autoscaler_azure.py checks each against the real client classes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from azure.mgmt.compute.models import (AvailabilitySet, HardwareProfile, InstanceViewStatus, NetworkInterfaceReference,
                                       NetworkProfile, OSDisk, StorageProfile, SubResource, VirtualMachine,
                                       VirtualMachineInstanceView)
from azure.mgmt.network.models import NetworkInterface, NetworkInterfaceIPConfiguration, PublicIPAddress

SUBSCRIPTION_ID = "00000000-0000-0000-0000-000000000000"
_SET_REFERENCE = re.compile(r"^\[resourceId\('Microsoft\.Compute/availabilitySets', parameters\('(\w+)'\)\)\]$")


class Poller:
    """An LROPoller that has already finished."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self._result


@dataclass
class FakeAzure:
    """One subscription's state: what the provider created, and every ARM deployment it asked for."""

    location: str = "eastus2"
    vms: dict[str, VirtualMachine] = field(default_factory=dict)
    power: dict[str, str] = field(default_factory=dict)
    """VM name -> "running" or "deallocated"."""
    nics: dict[str, NetworkInterface] = field(default_factory=dict)
    public_ips: dict[str, PublicIPAddress] = field(default_factory=dict)
    availability_sets: dict[str, AvailabilitySet] = field(default_factory=dict)
    deployments: list[dict[str, Any]] = field(default_factory=list)
    """{"name", "template", "parameters" (name -> value)} in call order."""
    calls: list[str] = field(default_factory=list)
    """Every SDK call by method name, for tests that check nothing was called."""

    def rid(self, kind: str, name: str) -> str:
        return f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/rg/providers/{kind}/{name}"

    def members(self, set_name: str) -> list[str]:
        return [ref.id.rsplit("/", 1)[-1] for ref in self.availability_sets[set_name].virtual_machines or []]

    def add_vm(self, name: str, tags: dict[str, str], vm_size: str, priority: str, set_name: str | None,
               public_ip: bool, power: str = "running") -> None:
        nic_name = f"{name}-nic"
        ip_config = NetworkInterfaceIPConfiguration(private_ip_address=f"10.1.0.{len(self.vms) + 4}")
        if public_ip:
            self.public_ips[f"{name}-ip"] = PublicIPAddress(ip_address=f"20.0.0.{len(self.public_ips) + 1}")
            ip_config.public_ip_address = PublicIPAddress(id=self.rid("Microsoft.Network/publicIPAddresses",
                                                                      f"{name}-ip"))
        self.nics[nic_name] = NetworkInterface(ip_configurations=[ip_config])
        vm = VirtualMachine(
            location=self.location, tags=dict(tags), priority=priority,
            hardware_profile=HardwareProfile(vm_size=vm_size),
            network_profile=NetworkProfile(network_interfaces=[NetworkInterfaceReference(
                id=self.rid("Microsoft.Network/networkInterfaces", nic_name))]),
            storage_profile=StorageProfile(os_disk=OSDisk(name=f"{name}-osdisk", create_option="FromImage"),
                                           data_disks=[]))
        vm.name = name
        if set_name is not None:
            vm.availability_set = SubResource(id=self.availability_sets[set_name].id)
            self.availability_sets[set_name].virtual_machines.append(
                SubResource(id=self.rid("Microsoft.Compute/virtualMachines", name)))
        self.vms[name] = vm
        self.power[name] = power

    def deploy(self, name: str, template: dict[str, Any], parameters: dict[str, Any]) -> None:
        """Apply a VM deployment the way ARM applies Ray's template (and raytrain's copy of it)."""
        declared = template["parameters"]
        undeclared = sorted(set(parameters) - set(declared))
        if undeclared:
            raise HttpResponseError(f"InvalidTemplate: parameters {undeclared} are not present in the template")
        missing = sorted(p for p, spec in declared.items() if "defaultValue" not in spec and p not in parameters)
        if missing:
            raise HttpResponseError(f"InvalidTemplate: the value for the template parameters {missing} is not provided")
        vm_resource = next(r for r in template["resources"] if r["type"] == "Microsoft.Compute/virtualMachines")
        set_name = None
        if "availabilitySet" in vm_resource["properties"]:
            reference = _SET_REFERENCE.match(vm_resource["properties"]["availabilitySet"]["id"])
            assert reference, "the fake only knows resourceId('...availabilitySets', parameters('x'))"
            set_name = parameters[reference.group(1)]
            if set_name not in self.availability_sets:
                raise HttpResponseError(f"NotFound: availability set {set_name} does not exist")
            if len(self.members(set_name)) + parameters["vmCount"] > 200:
                raise HttpResponseError(f"OperationNotAllowed: availability set {set_name} is full (200 VMs)")
            if parameters.get("priority") == "Spot":
                raise HttpResponseError("AzureSpotVMNotSupportedInAvailabilitySet")
            if parameters.get("zones"):
                raise HttpResponseError("a VM cannot use both an availability zone and an availability set")
        for i in range(parameters["vmCount"]):
            self.add_vm(f"{parameters['vmName']}{i}", parameters["vmTags"], parameters["vmSize"],
                        parameters.get("priority", "Regular"), set_name, parameters.get("provisionPublicIp", True))


class _Recorder:
    def __init__(self, cloud: FakeAzure) -> None:
        self.cloud = cloud

    def _call(self, name: str) -> None:
        self.cloud.calls.append(f"{type(self).__name__}.{name}")


class VirtualMachines(_Recorder):
    def list(self, resource_group_name: str) -> list[VirtualMachine]:
        self._call("list")
        return list(self.cloud.vms.values())

    def get(self, resource_group_name: str, vm_name: str) -> VirtualMachine:
        self._call("get")
        if vm_name not in self.cloud.vms:
            raise ResourceNotFoundError(f"VM {vm_name} not found")
        return self.cloud.vms[vm_name]

    def instance_view(self, resource_group_name: str, vm_name: str) -> VirtualMachineInstanceView:
        self._call("instance_view")
        if vm_name not in self.cloud.vms:
            raise ResourceNotFoundError(f"VM {vm_name} not found")
        return VirtualMachineInstanceView(statuses=[InstanceViewStatus(code="ProvisioningState/succeeded"),
                                                    InstanceViewStatus(code=f"PowerState/{self.cloud.power[vm_name]}")])

    def begin_start(self, resource_group_name: str, vm_name: str) -> Poller:
        self._call("begin_start")
        self.cloud.power[vm_name] = "running"
        return Poller()

    def begin_deallocate(self, resource_group_name: str, vm_name: str) -> Poller:
        self._call("begin_deallocate")
        self.cloud.power[vm_name] = "deallocated"  # still a member of its availability set
        return Poller()

    def begin_update(self, resource_group_name: str, vm_name: str, parameters: dict[str, Any]) -> Poller:
        self._call("begin_update")
        self.cloud.vms[vm_name].tags = dict(parameters["tags"])
        return Poller()

    def begin_delete(self, resource_group_name: str, vm_name: str) -> Poller:
        self._call("begin_delete")
        vm = self.cloud.vms.pop(vm_name)
        self.cloud.power.pop(vm_name)
        if vm.availability_set is not None:
            set_name = vm.availability_set.id.rsplit("/", 1)[-1]
            members = self.cloud.availability_sets[set_name].virtual_machines
            members[:] = [ref for ref in members if not ref.id.endswith(f"/{vm_name}")]
        return Poller()


class AvailabilitySets(_Recorder):
    def get(self, resource_group_name: str, availability_set_name: str) -> AvailabilitySet:
        self._call("get")
        if availability_set_name not in self.cloud.availability_sets:
            raise ResourceNotFoundError(f"availability set {availability_set_name} not found")
        return self.cloud.availability_sets[availability_set_name]

    def create_or_update(self, resource_group_name: str, availability_set_name: str,
                         parameters: AvailabilitySet) -> AvailabilitySet:
        self._call("create_or_update")
        parameters.name = availability_set_name
        parameters.id = self.cloud.rid("Microsoft.Compute/availabilitySets", availability_set_name)
        parameters.virtual_machines = []
        self.cloud.availability_sets[availability_set_name] = parameters
        return parameters

    def list(self, resource_group_name: str) -> list[AvailabilitySet]:
        self._call("list")
        return list(self.cloud.availability_sets.values())

    def delete(self, resource_group_name: str, availability_set_name: str) -> None:
        self._call("delete")
        if self.cloud.availability_sets[availability_set_name].virtual_machines:
            raise HttpResponseError("InUse: the availability set holds VMs")
        del self.cloud.availability_sets[availability_set_name]


class Disks(_Recorder):
    def begin_delete(self, resource_group_name: str, disk_name: str) -> Poller:
        self._call("begin_delete")
        return Poller()


class NetworkInterfaces(_Recorder):
    def get(self, resource_group_name: str, network_interface_name: str) -> NetworkInterface:
        self._call("get")
        return self.cloud.nics[network_interface_name]

    def begin_delete(self, resource_group_name: str, network_interface_name: str) -> Poller:
        self._call("begin_delete")
        self.cloud.nics.pop(network_interface_name, None)
        return Poller()


class PublicIPAddresses(_Recorder):
    def get(self, resource_group_name: str, public_ip_address_name: str) -> PublicIPAddress:
        self._call("get")
        return self.cloud.public_ips[public_ip_address_name]

    def begin_delete(self, resource_group_name: str, public_ip_address_name: str) -> Poller:
        self._call("begin_delete")
        self.cloud.public_ips.pop(public_ip_address_name, None)
        return Poller()


class NetworkCleanup(_Recorder):
    """subnets / network_security_groups / virtual_networks: `ray down` deletes them (Ray's cleanup)."""

    def begin_delete(self, resource_group_name: str, **names: str) -> Poller:
        self._call("begin_delete")
        return Poller()


class Deployments(_Recorder):
    def begin_create_or_update(self, resource_group_name: str, deployment_name: str,
                               parameters: dict[str, Any]) -> Poller:
        self._call("begin_create_or_update")
        properties = parameters["properties"]
        values = {key: spec["value"] for key, spec in properties["parameters"].items()}
        self.cloud.deployments.append({"name": deployment_name, "template": properties["template"],
                                       "parameters": values})
        if deployment_name == "ray-config":  # Ray's bootstrap: VNet, NSG and identity
            outputs = {key: {"value": self.cloud.rid(kind, f"{values['clusterId']}-{key}")} for key, kind in
                       (("msi", "Microsoft.ManagedIdentity/userAssignedIdentities"),
                        ("nsg", "Microsoft.Network/networkSecurityGroups"),
                        ("subnet", "Microsoft.Network/virtualNetworks/vnet/subnets"))}
            return Poller(SimpleNamespace(properties=SimpleNamespace(outputs=outputs)))
        self.cloud.deploy(deployment_name, properties["template"], values)
        return Poller()


class ResourceGroups(_Recorder):
    def create_or_update(self, resource_group_name: str, parameters: dict[str, Any]) -> None:
        self._call("create_or_update")


class GenericResources(_Recorder):
    def list_by_resource_group(self, resource_group_name: str, filter: str | None = None) -> list[Any]:
        self._call("list_by_resource_group")
        return []  # no VNet from an earlier `ray up`, no role assignments to remove

    def get_by_id(self, resource_id: str, api_version: str) -> Any:
        self._call("get_by_id")
        raise ResourceNotFoundError(f"{resource_id} not found")

    def begin_delete_by_id(self, resource_id: str, api_version: str) -> Poller:
        self._call("begin_delete_by_id")
        return Poller()


def clients(cloud: FakeAzure) -> dict[str, Any]:
    """Constructors to put in place of the SDK's: the same signature, clients bound to `cloud`."""

    def compute(credential: Any, subscription_id: str) -> Any:
        return SimpleNamespace(virtual_machines=VirtualMachines(cloud), availability_sets=AvailabilitySets(cloud),
                               disks=Disks(cloud))

    def network(credential: Any, subscription_id: str) -> Any:
        return SimpleNamespace(network_interfaces=NetworkInterfaces(cloud),
                               public_ip_addresses=PublicIPAddresses(cloud), subnets=NetworkCleanup(cloud),
                               network_security_groups=NetworkCleanup(cloud), virtual_networks=NetworkCleanup(cloud))

    def resource(credential: Any, subscription_id: str) -> Any:
        return SimpleNamespace(deployments=Deployments(cloud), resource_groups=ResourceGroups(cloud),
                               resources=GenericResources(cloud))

    return {"ComputeManagementClient": compute, "NetworkManagementClient": network,
            "ResourceManagementClient": resource}
