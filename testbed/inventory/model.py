"""The resolved inventory: its validated spec, groups expanded to nodes, links expanded to directed
links, and what it takes to reach a node over SSH."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from netem.profile import DirectedLink
from testbed.inventory.node_kinds import host_of
from testbed.inventory.schema import InventorySpec, NodeSpec, SshSettings
from testbed.inventory.ssh_config import SshTarget, resolve_target


@dataclass(frozen=True)
class NodeSettings:
    """What ``defaults`` sets for every node, resolved for one: the node's own value, else its groups',
    else the default."""

    python: str  # the node's Python (a command or a path)
    sudo: bool
    workdir: str
    venv_path: str
    registry_access: bool


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

    def _layers(self, node: NodeSpec) -> list[Any]:
        """Where a node's settings are written, most specific first: the node, its groups, defaults."""
        groups = self.spec.group_settings()
        return [node, *(groups[g] for g in groups if node.name in self.groups.get(g, ())), self.spec.defaults]

    def settings_of(self, node: NodeSpec | str) -> NodeSettings:
        """The node's Python, sudo, working directory, venv and registry access (validation refused two
        groups that set one of them differently for a node that does not set it itself). A phone's are
        its USB host's, where its commands run (the controller's defaults for ``usb_host: controller``)."""
        known = self._settings
        name = node if isinstance(node, str) else node.name
        if name in known:
            return known[name]
        spec = self.node(node) if isinstance(node, str) else node
        if spec.name not in known:  # worked out once a node (plans ask for them line by line)
            host = host_of(spec)
            if host == spec.name:
                known[spec.name] = self._resolve_settings(self._layers(spec))
            else:
                known[spec.name] = self.settings_of(host) if host != "controller" else \
                    self._resolve_settings([self.spec.defaults])  # fmt: skip
        return known[spec.name]

    @functools.cached_property
    def _settings(self) -> dict[str, NodeSettings]:
        return {}

    @staticmethod
    def _resolve_settings(layers: list[Any]) -> NodeSettings:
        def pick(field: str) -> Any:
            return next(v for v in (getattr(layer, field) for layer in layers) if v is not None)

        workdir = pick("workdir")
        venv = next((layer.venv for layer in layers if layer.venv is not None), None)
        return NodeSettings(pick("python"), pick("sudo"), workdir, venv or f"{workdir.rstrip('/')}/venv",
                            pick("registry_access"))  # fmt: skip

    def ssh_target(self, node: NodeSpec) -> SshTarget:
        """How the controller reaches ``node``: the inventory's SSH settings over the SSH config."""
        if node.address is None:
            raise TestbedError(f"{self.path}: node {node.name!r} has no address to reach it at")
        layers = [layer.ssh or SshSettings() for layer in self._layers(node)]
        try:
            return resolve_target(node.address, layers, emulated=node.emulated is not None)
        except TestbedError as exc:
            raise TestbedError(f"node {node.name}: {exc}") from None
