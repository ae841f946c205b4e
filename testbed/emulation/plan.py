"""Names and addresses of everything the emulated testbed creates, derived from the inventory alone.

Kernel names carry the inventory's ``emulation.name_prefix`` so that ``down`` can tell ours from
the host's; interface names stay within Linux's 15 characters by using the node's index.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import TestbedError
from testbed.inventory import EmulatedPowerMode, Inventory, kind_of

NODE_MGMT_INTERFACE = "mgmt0"
NODE_DATA_INTERFACE = "data0"
RUN_ROOT = Path("/run/hil-testbed")


@dataclass(frozen=True)
class EmulatedNodePlan:
    name: str
    kind: str
    model: str
    index: int
    netns: str
    cgroup: str
    host_mgmt_veth: str
    host_data_veth: str
    mgmt_address: str
    data_address: str
    power_modes: tuple[EmulatedPowerMode, ...]
    initial_mode: int | None
    serial: str | None = None  # a phone's adb serial
    usb_host: str | None = None  # a phone's USB host (an emulated node), where its stand-in adb runs
    hosts_phones: bool = False  # the USB host of emulated phones: the stand-in adb is on its PATH

    @property
    def initial_power_mode(self) -> EmulatedPowerMode | None:
        """The mode the node starts in: ``initial_mode``, else the first listed."""
        for mode in self.power_modes:
            if mode.id == self.initial_mode:
                return mode
        return self.power_modes[0] if self.power_modes else None


@dataclass(frozen=True)
class BastionPlan:
    """The lab's only way in (``emulation.bastion``): a namespace whose sshd listens on ``address``, held
    both on the management bridge (where the nodes are) and on a point-to-point link from this machine,
    which keeps no other route into the lab."""

    netns: str
    mgmt_veth: str  # this machine's end of its veth on the management bridge
    outside_veth: str  # this machine's end of the point-to-point link to it
    address: str
    name: str = "bastion"  # its host name, and what its files are named by


@dataclass(frozen=True)
class EmulationPlan:
    prefix: str
    state_dir: Path
    mgmt_bridge: str
    data_bridge: str
    mgmt_network: ipaddress.IPv4Network
    data_network: ipaddress.IPv4Network
    host_mgmt_address: str
    nodes: tuple[EmulatedNodePlan, ...]
    ssh_user: str | None = None  # the nodes' SSH user, made by `up` with only the printed sudo rules
    bastion: BastionPlan | None = None

    def node(self, name: str) -> EmulatedNodePlan:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def default_state_dir(prefix: str) -> Path:
    """``/run/hil-testbed/<prefix>`` for root (gone at reboot, like the namespaces); else per user."""
    if os.geteuid() == 0:
        return RUN_ROOT / prefix
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/hil-testbed-{os.geteuid()}"
    return Path(runtime) / "hil-testbed" / prefix


def state_dir_of(inventory: Inventory) -> Path:
    configured = inventory.spec.emulation.state_dir
    if configured is None:
        return default_state_dir(inventory.spec.emulation.name_prefix)
    path = Path(configured).expanduser()
    return path if path.is_absolute() else (inventory.path.parent / path).resolve()


def plan_emulation(inventory: Inventory) -> EmulationPlan:
    emulation = inventory.spec.emulation
    prefix = emulation.name_prefix
    emulated = [n for n in inventory.nodes if n.emulated is not None]
    if not emulated:
        raise TestbedError(f"{inventory.path}: no node has an 'emulated:' section; nothing to emulate")
    mgmt_hosts = list(emulation.management_subnet.hosts())
    data_hosts = list(emulation.data_subnet.hosts())
    nodes = []
    usb_hosts = {n.adb.usb_host for n in emulated if kind_of(n).via_usb_host and n.adb is not None}
    for index, node in enumerate(emulated):
        assert node.emulated is not None
        nodes.append(
            EmulatedNodePlan(
                name=node.name,
                kind=node.kind,
                model=node.model,
                index=index,
                netns=f"{prefix}-{node.name}",
                cgroup=f"{prefix}-{node.name}",
                host_mgmt_veth=f"{prefix}{index}m",
                host_data_veth=f"{prefix}{index}d",
                mgmt_address=str(mgmt_hosts[index + 1]),
                data_address=str(data_hosts[index + 1]),
                power_modes=node.emulated.power_modes,
                initial_mode=node.emulated.initial_mode,
                serial=node.adb.serial if node.adb is not None else None,
                usb_host=node.adb.usb_host if node.adb is not None else None,
                hosts_phones=node.name in usb_hosts,
            )
        )
    return EmulationPlan(
        prefix=prefix,
        state_dir=state_dir_of(inventory),
        mgmt_bridge=f"{prefix}-mgmt",
        data_bridge=f"{prefix}-data",
        mgmt_network=emulation.management_subnet,
        data_network=emulation.data_subnet,
        host_mgmt_address=str(mgmt_hosts[0]),
        nodes=tuple(nodes),
        ssh_user=emulation.ssh_user,
        bastion=_bastion(inventory, prefix, mgmt_hosts, len(nodes)) if emulation.bastion else None,
    )


def _bastion(inventory: Inventory, prefix: str, mgmt_hosts: list, nodes: int) -> BastionPlan:
    """The bastion takes the management subnet's last address (the nodes count up from its first)."""
    if any(n.name == BastionPlan.name for n in inventory.nodes):
        raise TestbedError(f"{inventory.path}: a node is named {BastionPlan.name!r}, the name emulation.bastion "
                           "gives the lab's jump host; rename the node")  # fmt: skip
    if nodes + 2 >= len(mgmt_hosts):
        raise TestbedError(f"{inventory.path}: emulation.management_subnet has no address left for the bastion "
                           f"({nodes} nodes); choose a larger subnet")  # fmt: skip
    return BastionPlan(netns=f"{prefix}-{BastionPlan.name}", mgmt_veth=f"{prefix}bm", outside_veth=f"{prefix}bo",
                       address=str(mgmt_hosts[-1]))  # fmt: skip
