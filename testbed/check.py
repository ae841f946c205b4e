"""``testbed inventory check``: reach every node in parallel and gather its facts."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from foundation.errors import NodeError
from testbed.inventory import Inventory, NodeSpec
from testbed.transport import open_transport, usb_host_transport
from testbed.transport.facts import NodeFacts, gather_facts, gather_phone_facts
from testbed.transport.fanout import DEFAULT_PARALLEL, FanOutResult, fan_out


def check_node(inventory: Inventory, node: NodeSpec) -> NodeFacts:
    if node.emulated is not None and node.address is None:
        raise NodeError(node.name, "the emulated testbed is not running; start it with `testbed emulate up`")
    if node.kind == "android":
        with usb_host_transport(inventory, node) as host:
            return gather_phone_facts(inventory, node, host)
    with open_transport(inventory, node) as transport:
        return gather_facts(inventory, node, transport)


def check_nodes(
    inventory: Inventory,
    nodes: Sequence[NodeSpec],
    *,
    max_parallel: int = DEFAULT_PARALLEL,
    console: Console | None = None,
) -> FanOutResult[NodeFacts]:
    by_name = {n.name: n for n in nodes}
    return fan_out(
        list(by_name),
        lambda name: check_node(inventory, by_name[name]),
        max_parallel=max_parallel,
        description="checking nodes",
        console=console,
    )
