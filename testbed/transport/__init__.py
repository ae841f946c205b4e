"""Transports: how the controller runs commands on a node (SSH, or locally for the controller)."""

from __future__ import annotations

from foundation.errors import TestbedError
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.transport.base import BackgroundProcess, CommandFailed, CommandResult, LineSession, Transport
from testbed.transport.local import LocalTransport
from testbed.transport.ssh import SshTransport

__all__ = [
    "BackgroundProcess",
    "CommandFailed",
    "CommandResult",
    "LineSession",
    "LocalTransport",
    "SshTransport",
    "Transport",
    "open_transport",
    "usb_host_transport",
]


def open_transport(inventory: Inventory, node: NodeSpec) -> Transport:
    """The transport that reaches ``node`` (phones are reached through their USB host instead)."""
    if kind_of(node).via_usb_host:
        raise TestbedError(f"{node.name} (kind {node.kind}) is reached with adb on its USB host, not directly")
    use_sudo = inventory.settings_of(node).sudo
    if node.transport == "local":
        return LocalTransport(node.name, use_sudo=use_sudo)
    return SshTransport(node.name, inventory.ssh_target(node), use_sudo=use_sudo)


def usb_host_transport(inventory: Inventory, phone: NodeSpec) -> Transport:
    """The transport of the machine a phone is plugged into."""
    assert phone.adb is not None
    if phone.adb.usb_host == "controller":
        return LocalTransport("controller", use_sudo=inventory.spec.defaults.sudo)
    return open_transport(inventory, inventory.node(phone.adb.usb_host))
