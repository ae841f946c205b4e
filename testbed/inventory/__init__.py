"""``inventory.yaml``: the lab's nodes, groups, link profiles and links, validated before any node
is touched.

Loading is two passes over a :class:`~foundation.user_files.YamlSource`: pydantic checks shapes,
types and units (:mod:`.schema`); :mod:`.validation` translates its errors and checks what spans
fields (names, references, kinds). Every problem is reported as ``FILE:LINE: field: what is wrong;
hint`` and raised as one :class:`~foundation.errors.InputError`. :mod:`.resolution` then expands
groups and links (:mod:`.expansion`) into the resolved :class:`~.model.Inventory`.

- ``schema``: the pydantic models of the file (link profiles are netem's).
- ``validation``: error translation, secrets, cross-checks.
- ``expansion``: groups to nodes, links to directed links.
- ``model``: the resolved :class:`Inventory` and :class:`SshTarget`.
- ``resolution``: :func:`load_inventory`, :func:`inventory_from_source`, :func:`links_from_file`.
- ``node_kinds``: the kinds of node, one row each (how a kind is reached, its power driver and modes,
  its telemetry sources, its board family); the controller asks them instead of testing ``kind``.
- ``ansible_export``: the same hosts as an Ansible inventory.
"""

from netem.profile import DirectedLink, LinkProfile
from testbed.inventory.model import Inventory, NodeSettings
from testbed.inventory.node_kinds import NodeKind, host_of, kind_of, node_kind
from testbed.inventory.resolution import inventory_from_source, links_from_file, load_inventory
from testbed.inventory.schema import (
    AdbAttachment,
    DataPlane,
    Defaults,
    EmulatedPowerMode,
    EmulatedSpec,
    EmulationInstance,
    EmulationSettings,
    InventorySpec,
    LinksFileSpec,
    LinkSpec,
    Name,
    NodeSpec,
    SafePath,
    SshSettings,
)
from testbed.inventory.ssh_config import SshTarget
from testbed.inventory.validation import pydantic_problem

__all__ = [
    "AdbAttachment",
    "DataPlane",
    "Defaults",
    "DirectedLink",
    "EmulatedPowerMode",
    "EmulatedSpec",
    "EmulationInstance",
    "EmulationSettings",
    "Inventory",
    "InventorySpec",
    "LinkProfile",
    "LinkSpec",
    "LinksFileSpec",
    "Name",
    "NodeKind",
    "NodeSettings",
    "NodeSpec",
    "SafePath",
    "SshSettings",
    "SshTarget",
    "host_of",
    "inventory_from_source",
    "kind_of",
    "links_from_file",
    "load_inventory",
    "node_kind",
    "pydantic_problem",
]
