"""What netem needs to know of a lab to compile link plans: its nodes' data-plane interfaces and
addresses, whether a node can run tc, its roles, and the shaped directions between nodes.

The controller builds one from its inventory (``testbed.links.plans.link_topology``); netem never
reads an inventory itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from netem.profile import DirectedLink


@dataclass(frozen=True)
class LinkNode:
    """One node as the data plane sees it."""

    name: str
    data_interface: str | None  # None: the node has no shaped interface (yet)
    data_address: str | None
    runs_tc: bool  # False for a phone: what it sends is shaped on the receiver's ingress
    roles: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinkTopology:
    """The nodes in the lab's order (which names ifb devices), and its shaped directions."""

    source: str  # where the topology was described (the inventory file), for messages
    nodes: tuple[LinkNode, ...]
    links: tuple[DirectedLink, ...]

    def node(self, name: str) -> LinkNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def index(self, name: str) -> int:
        return [n.name for n in self.nodes].index(name)

    @property
    def servers(self) -> set[str]:
        """Names of the nodes with the server role."""
        return {n.name for n in self.nodes if "server" in n.roles}
