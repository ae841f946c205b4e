"""Where things are on a node, resolved once: its home directory, the Python that runs our code,
and how our code reaches it, so that every command sent to the node is written out in full by a
plan before it runs (no ``~`` left for a later command to expand).

Node code reaches a node one way, named by one hash (the digest of ``nodes/``'s sources, which is
also the local part of the node wheel's version): a provisioned node runs it from the wheel in its
venv (drivers, samplers and workers alike, with no ``PYTHONPATH``); a node that was never
provisioned runs it from the content-hashed bundle on ``PYTHONPATH`` with the inventory's Python.
A venv whose wheel is not this checkout's is refused: provision the node again.

``resolve_contexts`` asks each node for ``$HOME`` (one read-only command). A plan made without
reaching the nodes uses ``unresolved_context``: its paths keep ``~`` and are marked as depending
on live state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.errors import TestbedError
from testbed.inventory import Inventory, NodeSpec, host_of, kind_of
from testbed.provisioning.node_code import node_code, store_if_missing
from testbed.provisioning.node_wheel import node_wheel
from testbed.provisioning.provision import load_record, provisioned_python
from testbed.transport import Transport, open_transport, usb_host_transport
from testbed.transport.fanout import FanOutResult, fan_out

HOME_SCRIPT = 'echo "$HOME"'


@dataclass(frozen=True)
class NodeContext:
    """A node as its commands see it. ``host`` is the transport's node (a phone's USB host)."""

    node: str
    host: str
    home: str | None  # None: not read back, paths keep their "~"
    python: str  # the workers' Python: the provisioned venv's, else the node's python (inventory)
    base_python: str  # the drivers' and samplers': the venv's, else the node's python (standard library only)
    workdir: str  # as written in the inventory ("~/hil-testbed")
    code_via: str = "bundle"  # "venv": the provisioned wheel; "bundle": the zip on PYTHONPATH
    code_version: str = ""  # the digest of the node code that runs (the same for both ways)

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

    @property
    def uses_bundle(self) -> bool:
        return self.code_via == "bundle"

    def code_env(self) -> dict[str, str]:
        """The environment our code needs on the node: the bundle on PYTHONPATH, or nothing (venv)."""
        return {"PYTHONPATH": self.code_path} if self.uses_bundle else {}

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with the environment our code needs (``env PYTHONPATH=...`` for the bundle)."""
        env = self.code_env()
        return [*(["env", *(f"{k}={v}" for k, v in env.items())] if env else []), *argv]


def transport_for(inventory: Inventory, node: NodeSpec) -> Transport:
    """The transport that runs ``node``'s commands (a phone's are run on its USB host)."""
    return usb_host_transport(inventory, node) if kind_of(node).via_usb_host else open_transport(inventory, node)


class StaleNodeCode(TestbedError):
    """A provisioned node's venv holds another version of the node code than this checkout."""


def unresolved_context(inventory: Inventory, node: NodeSpec) -> NodeContext:
    """``node``'s context from the inventory and its provisioning record alone."""
    record = load_record(inventory, node.name)
    settings = inventory.settings_of(node)
    installed = record.get("installed_wheel")
    if kind_of(node).runs_ranks and installed:
        current = node_wheel().version
        if installed != current:
            raise StaleNodeCode(
                f"{node.name}: its venv has hil-testbed-nodes {installed}, and this checkout's node code is "
                f"{current}; provision it again (testbed provision -i {inventory.path} --nodes {node.name})"
            )
        python = provisioned_python(settings, record)
        return NodeContext(node.name, host_of(node), None, python, python, settings.workdir, "venv",
                           node_code().digest)  # fmt: skip
    return _bundle_context(inventory, node)


def _bundle_context(inventory: Inventory, node: NodeSpec) -> NodeContext:
    """The node code bundle on PYTHONPATH of the inventory's Python."""
    settings = inventory.settings_of(node)
    return NodeContext(node.name, host_of(node), None, settings.python, settings.python, settings.workdir, "bundle",
                       node_code().digest)  # fmt: skip


def restoring_context(inventory: Inventory, node: NodeSpec) -> NodeContext:
    """The context that undoes a change: the usual one, or, where the venv holds another checkout's
    code, the bundle with the inventory's Python (an undo never waits for provisioning)."""
    try:
        return unresolved_context(inventory, node)
    except StaleNodeCode:
        return _bundle_context(inventory, node)


def require_current_code(inventory: Inventory, names: Sequence[str]) -> None:
    """Raise :class:`StaleNodeCode` (a user error: nothing was touched) when a named node's venv holds
    node code other than this checkout's."""
    for name in names:
        unresolved_context(inventory, inventory.node(name))


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


def ensure_node_code(transport: Transport, context: NodeContext) -> None:
    """Store the bundle on the node when it uses the bundle and does not have it yet."""
    if context.uses_bundle:
        store_if_missing(transport, context.code_path)
