"""The resolved inventory: its validated spec, groups expanded to nodes, links expanded to directed
links, and what it takes to reach a node over SSH."""

from __future__ import annotations

import getpass
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from netem.profile import DirectedLink
from testbed.inventory.schema import InventorySpec, NodeSpec, SshSettings


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to open one SSH connection, defaults applied."""

    host: str
    port: int
    user: str
    identity_file: str | None
    known_hosts: str
    password_env: str | None
    connect_timeout_s: float
    keepalive_s: float


@dataclass(frozen=True)
class Inventory:
    path: Path
    spec: InventorySpec
    groups: dict[str, tuple[str, ...]]
    links: tuple[DirectedLink, ...]

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        return self.spec.nodes

    def node(self, name: str) -> NodeSpec:
        for node in self.spec.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def select(self, names: Sequence[str] | None) -> tuple[NodeSpec, ...]:
        """Nodes named directly or through groups (``all`` for every node); all when empty."""
        if not names:
            return self.spec.nodes
        wanted: set[str] = set()
        for name in names:
            if name == "all":
                wanted.update(n.name for n in self.spec.nodes)
            elif name in self.groups:
                wanted.update(self.groups[name])
            elif any(n.name == name for n in self.spec.nodes):
                wanted.add(name)
            else:
                known = ", ".join([n.name for n in self.spec.nodes] + list(self.groups))
                raise TestbedError(f"{self.path}: no node or group named {name!r}; known: {known}")
        return tuple(n for n in self.spec.nodes if n.name in wanted)

    @property
    def state_dir(self) -> Path:
        """Where the controller keeps what it learned about this inventory's nodes (provisioning
        records): the emulated testbed's state directory, else ``.testbed/<stem>/`` beside the file."""
        if self.spec.emulation.instance is not None:
            return self.path.parent
        return self.path.parent / ".testbed" / self.path.stem

    def ssh_target(self, node: NodeSpec) -> SshTarget:
        if node.address is None:
            raise TestbedError(f"{self.path}: node {node.name!r} has no address to reach it at")
        d = self.spec.defaults.ssh
        o = node.ssh or SshSettings()

        def pick(field: str, fallback: Any) -> Any:
            for source in (o, d):
                value = getattr(source, field)
                if value is not None:
                    return value
            return fallback

        return SshTarget(
            host=node.address,
            port=pick("port", 22),
            user=pick("user", getpass.getuser()),
            identity_file=pick("identity_file", None),
            known_hosts=pick("known_hosts", "~/.ssh/known_hosts"),
            password_env=pick("password_env", None),
            connect_timeout_s=pick("connect_timeout_s", 10.0),
            keepalive_s=pick("keepalive_s", 15.0),
        )
