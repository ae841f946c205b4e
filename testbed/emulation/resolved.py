"""The resolved inventory: the user's inventory with the addresses, keys and data interfaces that
``testbed emulate up`` gave its emulated nodes, written into the state directory. Every command
that loads an inventory through :func:`load_lab` uses it while the emulated testbed runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML

from foundation.errors import TestbedError
from foundation.user_files import YamlSource
from nodes.contracts.durable import write_atomic
from testbed.emulation.plan import state_dir_of
from testbed.inventory import Inventory, load_inventory
from testbed.inventory.host_ranges import expand_ranges

RESOLVED_NAME = "inventory.yaml"
HEADER = (
    "# Written by `testbed emulate up` from {source}; do not edit (it is rewritten at every `up`).\n"
    "# The emulated nodes' addresses, SSH keys and data interfaces are filled in.\n"
)


@dataclass(frozen=True)
class NodeAccess:
    """How the controller reaches one emulated node, and its data-plane interface."""

    address: str
    port: int
    user: str
    data_interface: str
    data_address: str


def source_digest(inventory: Inventory) -> str:
    """A digest of what ``up`` builds from (nodes and emulation settings, not links, profiles or the
    delay path they take)."""
    spec = inventory.spec
    payload = {
        "nodes": [n.model_dump(mode="json") for n in spec.nodes],
        "emulation": spec.emulation.model_dump(mode="json", exclude={"instance"}),
        "defaults": spec.defaults.model_dump(mode="json", exclude={"delay_path"}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def write_resolved_inventory(
    inventory: Inventory,
    state_dir: Path,
    *,
    mode: str,
    access: dict[str, NodeAccess],
    identity_file: Path,
    known_hosts: Path,
    node_config: Path,
    jump: str | None = None,
    ssh_config: Path | None = None,
) -> Path:
    """Write the resolved inventory atomically (its presence means ``up`` finished). ``jump``: every
    emulated node is reached through this bastion, whose key ``ssh_config`` names."""
    data = expand_ranges(YamlSource.load(inventory.path))[0].data  # one entry a node, ranges written out
    emulation = data.setdefault("emulation", {})
    emulation["state_dir"] = str(state_dir)
    emulation["instance"] = {
        "mode": mode,
        "source": str(inventory.path.resolve()),
        "source_digest": source_digest(inventory),
    }
    if mode == "local":
        data.setdefault("defaults", {})["sudo"] = False  # local nodes run as the user, never via sudo
    if inventory.spec.emulation.ssh_user:
        data.setdefault("defaults", {})["sudo"] = True  # the nodes' user has only the printed sudo rules
    for node in data["nodes"]:
        a = access.get(str(node["name"]))
        if a is None:
            continue
        node["address"] = a.address
        node["ssh"] = {
            "user": a.user,
            "port": a.port,
            "identity_file": str(identity_file),
            "known_hosts": str(known_hosts),
            "node_config": str(node_config),
        }
        if jump is not None:
            node["ssh"].update(jump=jump, config=str(ssh_config))
        node["data"] = {"interface": a.data_interface, "address": a.data_address}
    yaml = YAML(typ="rt")
    yaml.width = 120
    text = io.StringIO()
    yaml.dump(data, text)
    path = state_dir / RESOLVED_NAME
    write_atomic(path, HEADER.format(source=inventory.path) + text.getvalue())
    return path


def resolved_path(inventory: Inventory) -> Path:
    return state_dir_of(inventory) / RESOLVED_NAME


def load_lab(path: str | Path) -> Inventory:
    """Load an inventory for use: while the emulated testbed built from it runs, its resolved form.

    Raises :class:`TestbedError` (exit status 2) when the inventory's nodes changed since ``up``.
    """
    inventory = load_inventory(path)
    if inventory.spec.emulation.instance is not None or not any(n.emulated for n in inventory.nodes):
        return inventory
    resolved = resolved_path(inventory)
    if not resolved.exists():
        return inventory  # not running: commands that need the nodes say so
    running = load_inventory(resolved)
    instance = running.spec.emulation.instance
    if instance is None or Path(instance.source) != inventory.path.resolve():
        raise TestbedError(
            f"{resolved} belongs to another inventory ({instance.source if instance else 'unknown'}); "
            f"give that one with -i, or set emulation.name_prefix or emulation.state_dir in {inventory.path}"
        )
    if instance.source_digest != source_digest(inventory):
        raise TestbedError(
            f"{inventory.path} changed (nodes, defaults or emulation) since `testbed emulate up`; "
            f"run `testbed emulate down -i {inventory.path}` and `up` again"
        )
    # Groups, profiles, links and their delay path are not built into the testbed: the user's file is
    # the truth for them even when edited after `up`.
    shaping = {k: getattr(inventory.spec, k) for k in ("groups", "link_profiles", "links")}
    shaping["defaults"] = running.spec.defaults.model_copy(update={"delay_path": inventory.spec.defaults.delay_path})
    return dataclasses.replace(
        running, spec=running.spec.model_copy(update=shaping), groups=inventory.groups, links=inventory.links
    )


def as_real_lab(source: Path, destination: Path, *, delay_path: str, user: str | None = None) -> Path:
    """``source`` written to ``destination`` as a real lab would write it: each emulated node gets a
    documentation address (192.0.2.0/24) and, unless it is a phone, a data interface ``data0`` with
    one (198.51.100.0/24) instead of its ``emulated:`` section; sudo on, ``defaults.delay_path`` and
    the SSH ``user`` as given. For planning offline what a real lab would run: nothing is reached."""
    yaml = YAML(typ="rt")
    data = expand_ranges(YamlSource.load(source))[0].data
    defaults = data.setdefault("defaults", {})
    defaults.update(sudo=True, delay_path=delay_path)
    if user is not None:
        defaults.setdefault("ssh", {})["user"] = user
    for i, node in enumerate(data["nodes"]):
        if node.pop("emulated", None) is not None:
            node["address"] = f"192.0.2.{i + 1}"
            if node["kind"] != "android":
                node["data"] = {"interface": "data0", "address": f"198.51.100.{i + 1}"}
    data.pop("emulation", None)
    text = io.StringIO()
    yaml.dump(data, text)
    destination.write_text(text.getvalue())
    return destination
