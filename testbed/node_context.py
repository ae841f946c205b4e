"""Where things are on a node, resolved once: its home directory, the Python that runs our code,
and the path of the node code bundle, so that every command sent to the node is written out in
full by a plan before it runs (no ``~`` left for a later command to expand).

``resolve_contexts`` asks each node for ``$HOME`` (one read-only command). A plan made without
reaching the nodes uses ``unresolved_context``: its paths keep ``~`` and are marked as depending
on live state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from testbed.inventory import Inventory, NodeSpec
from testbed.node_code import node_code
from testbed.provision import load_record, provisioned_python
from testbed.transport import Transport, open_transport, usb_host_transport
from testbed.transport.fanout import FanOutResult, fan_out

HOME_SCRIPT = 'echo "$HOME"'


@dataclass(frozen=True)
class NodeContext:
    """A node as its commands see it. ``host`` is the transport's node (a phone's USB host)."""

    node: str
    host: str
    home: str | None  # None: not read back, paths keep their "~"
    python: str  # the workers' Python: the provisioned venv's, else the inventory's defaults.python
    base_python: str  # the drivers' and samplers' Python: defaults.python (standard library only)
    workdir: str  # as written in the inventory ("~/hil-testbed")

    @property
    def resolved(self) -> bool:
        return self.home is not None

    def path(self, path: str) -> str:
        """``path`` with a leading ``~`` replaced by the node's home, when it was read back."""
        if self.home is None or not (path == "~" or path.startswith("~/")):
            return path
        return self.home.rstrip("/") + path[1:]

    def under_workdir(self, *parts: str) -> str:
        return self.path("/".join([self.workdir.rstrip("/"), *parts]))

    @property
    def code_path(self) -> str:
        """The node code bundle of this checkout, as the node names it."""
        return self.path(node_code().path_on(self.workdir))


def transport_for(inventory: Inventory, node: NodeSpec) -> Transport:
    """The transport that runs ``node``'s commands (a phone's are run on its USB host)."""
    return usb_host_transport(inventory, node) if node.kind == "android" else open_transport(inventory, node)


def host_of(node: NodeSpec) -> str:
    if node.kind == "android":
        assert node.adb is not None
        return node.adb.usb_host
    return node.name


def unresolved_context(inventory: Inventory, node: NodeSpec) -> NodeContext:
    python = provisioned_python(inventory, load_record(inventory, node.name))
    defaults = inventory.spec.defaults
    return NodeContext(node.name, host_of(node), None, python, defaults.python, defaults.workdir)


def read_home(transport: Transport) -> str:
    return transport.run_script(HOME_SCRIPT, timeout_s=30.0).check().stdout.strip()


def resolve_context(inventory: Inventory, node: NodeSpec, transport: Transport | None = None) -> NodeContext:
    """``node``'s context with its home read from the node (through ``transport`` when given)."""
    base = unresolved_context(inventory, node)
    if transport is not None:
        home = read_home(transport)
    else:
        with transport_for(inventory, node) as t:
            home = read_home(t)
    return dataclasses.replace(base, home=home)


def resolve_contexts(inventory: Inventory, names: Sequence[str]) -> FanOutResult[NodeContext]:
    """Every named node's context, read in parallel (a node that cannot be reached is a failed outcome)."""
    return fan_out(list(names), lambda name: resolve_context(inventory, inventory.node(name)),
                   description="reading the nodes' home directories")  # fmt: skip


def ensure_node_code(transport: Transport, context: NodeContext) -> str:
    """The bundle's path on the node, stored first when the node does not have it yet."""
    path = context.code_path
    if not transport.run(["test", "-s", path], timeout_s=30.0).ok:
        transport.store(path, node_code().data)
    return path
