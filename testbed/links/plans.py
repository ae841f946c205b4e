"""netem's link plans for an inventory: the inventory's nodes as netem's :class:`LinkTopology`, and
:func:`compile_plan` / :func:`traced_links` that take an :class:`Inventory`.

netem compiles plans from a topology and never reads an inventory; this is the one place that
translates between the two.
"""

from __future__ import annotations

from netem import plan as netem_plan
from netem import trace as netem_trace
from netem.plan import TcPlan
from netem.profile import DirectedLink
from netem.topology import LinkNode, LinkTopology
from netem.trace import BandwidthTrace
from testbed.inventory import Inventory, kind_of


def link_topology(inventory: Inventory) -> LinkTopology:
    """The inventory's nodes (in its order), their data planes and roles, and its links."""
    nodes = tuple(
        LinkNode(
            name=node.name,
            data_interface=None if node.data is None else node.data.interface,
            data_address=None if node.data is None else node.data.address,
            runs_tc=kind_of(node).shapes_links,  # a phone shapes nothing: its receivers shape its traffic
            roles=tuple(node.roles),
        )
        for node in inventory.nodes
    )
    return LinkTopology(str(inventory.path), nodes, inventory.links)


def compile_plan(inventory: Inventory, links: tuple[DirectedLink, ...] | None = None) -> tuple[TcPlan, ...]:
    """:func:`netem.plan.compile_plan` for the inventory's nodes; ``links`` default to its links."""
    return netem_plan.compile_plan(link_topology(inventory), links)


def traced_links(
    inventory: Inventory, traces: dict[str, BandwidthTrace]
) -> tuple[tuple[DirectedLink, ...], dict[tuple[str, str], tuple[BandwidthTrace, str]]]:
    """:func:`netem.trace.traced_links` for the inventory's links and server-role nodes."""
    return netem_trace.traced_links(link_topology(inventory), traces)
