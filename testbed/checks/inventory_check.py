"""``testbed inventory check``: reach every node in parallel and gather its facts (and, where sudo is
used, whether it allows the suite's commands: else the sudoers rules to install; on a server, whether
its mpiexec reaches every device: testbed.checks.launch_reach). ``--deep`` adds what runs need of each
node and between nodes (testbed.checks.deep_check)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rich.console import Console

from foundation.errors import NodeError
from testbed.checks.deep_check import node_problems, port_problems, power_problems
from testbed.checks.launch_reach import launch_reach_problems
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.provisioning.sudo_rules import install_hint, lacking_rules, sudo_probe_script
from testbed.transport import Transport, open_transport, usb_host_transport
from testbed.transport.facts import NodeFacts, gather_facts, gather_phone_facts, parse_key_values
from testbed.transport.fanout import DEFAULT_PARALLEL, FanOutResult, fan_out


def check_node(inventory: Inventory, node: NodeSpec, *, deep_need_gib: float | None = None) -> NodeFacts:
    """``node``'s facts and problems; with ``deep_need_gib`` (the free space its workdir needs) the deep
    per-node checks too."""
    if node.emulated is not None and node.address is None:
        raise NodeError(node.name, "the emulated testbed is not running; start it with `testbed emulate up`")
    if kind_of(node).via_usb_host:
        with usb_host_transport(inventory, node) as host:
            return gather_phone_facts(inventory, node, host)
    with open_transport(inventory, node) as transport:
        facts = gather_facts(inventory, node, transport)
        if inventory.settings_of(node).sudo and facts.sudo != "root":
            facts = _with_sudo_rules(facts, transport)
        if "server" in node.roles and kind_of(node).runs_ranks:
            unreached = launch_reach_problems(inventory, node, transport)
            facts = dataclasses.replace(facts, problems=(*facts.problems, *unreached))
        if deep_need_gib is not None:
            deeper = node_problems(inventory, node, transport, facts, deep_need_gib)
            facts = dataclasses.replace(facts, problems=(*facts.problems, *deeper))
        return facts


def _with_sudo_rules(facts: NodeFacts, transport: Transport) -> NodeFacts:
    """``facts`` with a problem, and the sudoers text to install, where the login's sudo lacks rules the
    suite needs on this node (:mod:`testbed.provisioning.sudo_rules`)."""
    values = parse_key_values(transport.run_script(sudo_probe_script(), timeout_s=30.0).stdout)
    lacking = lacking_rules(values)
    if not lacking:
        return facts
    problem = f"sudo does not allow {', '.join(lacking)} without a password; " + install_hint(facts.user, values)
    return dataclasses.replace(facts, problems=(*facts.problems, problem))


def check_nodes(
    inventory: Inventory,
    nodes: Sequence[NodeSpec],
    *,
    max_parallel: int = DEFAULT_PARALLEL,
    console: Console | None = None,
    deep_need_gib: float | None = None,
) -> FanOutResult[NodeFacts]:
    """Every node checked in parallel; ``deep_need_gib``: deeply (per node, then between the nodes that
    answered: ports, endpoints, power drivers)."""
    by_name = {n.name: n for n in nodes}
    result = fan_out(
        list(by_name),
        lambda name: check_node(inventory, by_name[name], deep_need_gib=deep_need_gib),
        max_parallel=max_parallel,
        description="checking nodes",
        console=console,
    )
    if deep_need_gib is None:
        return result
    reached = [by_name[o.node] for o in result.outcomes if o.ok and o.value is not None]
    found: dict[str, list[str]] = {}
    for more in (port_problems(inventory, reached), power_problems(inventory, reached)):
        for name, problems in more.items():
            found.setdefault(name, []).extend(problems)
    outcomes = tuple(
        dataclasses.replace(o, value=dataclasses.replace(o.value, problems=(*o.value.problems, *found[o.node])))
        if o.value is not None and o.node in found else o
        for o in result.outcomes
    )
    return dataclasses.replace(result, outcomes=outcomes)
