"""The plan of one shaping of an inventory's links (:class:`LinkPlan`, made by :func:`link_plan`),
and netem's compilers for an inventory: its nodes as netem's :class:`LinkTopology`, :func:`compile_plan`
and :func:`traced_links` that take an :class:`Inventory`.

netem compiles plans from a topology and never reads an inventory; this is the one place that
translates between the two. A run plan makes its :class:`LinkPlan` once; the link actions
(:mod:`.apply`, :mod:`.trace_playback`) execute it and plan their command lines from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from netem import plan as netem_plan
from netem import trace as netem_trace
from netem.delay_path import HeldRules, delay_path
from netem.delay_path import names as delay_path_names
from netem.plan import TcPlan, plans_by_node
from netem.profile import DirectedLink
from netem.topology import LinkNode, LinkTopology
from netem.trace import BandwidthTrace, NodeSchedule, schedules
from testbed.inventory import Inventory, kind_of
from testbed.links.probe import NodeProbe, assign_delay_paths
from testbed.provisioning.sudo_rules import privileged

Driven = Mapping[tuple[str, str], tuple[BandwidthTrace, str]]  # (sender, receiver) -> (trace, its rate column)


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


@dataclass(frozen=True)
class LinkPlan:
    """One shaping of the links, decided once: the tc plans, each on its node's delay path; the rules
    the delay paths hold outside tc, per node (the NFQUEUE path's chains, on the receivers); the
    directions a trace drives and its players' later rows. Executed by
    :func:`testbed.links.apply.apply_link_plan` (and :func:`testbed.links.trace_playback.apply_traced_plan`)."""

    tc_plans: tuple[TcPlan, ...]
    held: Mapping[str, tuple[HeldRules, ...]] = field(default_factory=dict)
    driven: Driven = field(default_factory=dict)
    players: tuple[NodeSchedule, ...] = ()  # each step's tc commands as the player runs them (sudo included)
    # the nodes this shaping may clear of earlier shaping besides its own: a campaign's (it holds their
    # leases, and another campaign may shape the rest of the lab); None: every node of the lab
    scope: tuple[str, ...] | None = None

    def others(self, shapeable: Sequence[str]) -> list[str]:
        """The ``shapeable`` nodes in scope that this plan does not shape: earlier shaping is cleared there."""
        return [n for n in shapeable if n not in self.nodes and (self.scope is None or n in self.scope)]

    @property
    def by_node(self) -> dict[str, list[TcPlan]]:
        return plans_by_node(self.tc_plans)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the shaping touches: the senders of its classes, then the holders of its rules."""
        return tuple(dict.fromkeys([*self.by_node, *self.held]))

    def queued(self, name: str) -> bool:
        """Whether ``name`` runs a delay handler (it holds a rule that queues packets)."""
        return any(r.queues for r in self.held.get(name, ()))


def link_plan(
    inventory: Inventory,
    tc_plans: Sequence[TcPlan],
    probes: Mapping[str, NodeProbe],
    driven: Driven | None = None,
    *,
    preference: str | None = None,
    scope: Sequence[str] | None = None,
) -> LinkPlan:
    """The :class:`LinkPlan` of ``tc_plans``: each put on its node's delay path as ``probes`` show it
    (a node not probed takes ``preference``, by default ``defaults.delay_path``, netem for auto), the
    rules each delay path compiles for the plans on it, and the trace players' schedules of the
    ``driven`` directions."""
    driven = dict(driven or {})
    on_paths = assign_delay_paths(tc_plans, probes, preference or inventory.spec.defaults.delay_path)
    topology = link_topology(inventory)
    held: dict[str, list[HeldRules]] = {}
    for name in delay_path_names():
        for rules in delay_path(name).compile(topology, [p for p in on_paths if p.delay_path == name], tuple(driven)):
            held.setdefault(rules.node, []).append(rules)
    players = player_schedules(on_paths, driven, lambda node: inventory.settings_of(node).sudo) if driven else ()
    return LinkPlan(on_paths, {node: tuple(rules) for node, rules in held.items()}, driven, players,
                    tuple(scope) if scope is not None else None)  # fmt: skip


def player_schedules(
    plans: Sequence[TcPlan], driven: Driven, sudo: Callable[[str], bool]
) -> tuple[NodeSchedule, ...]:
    """The trace players' schedules, each step's tc commands as the player runs them (as the user,
    each tc with sudo where the node's ``sudo`` says: :func:`testbed.provisioning.sudo_rules.privileged`)."""
    return tuple(
        dataclasses.replace(s, steps=tuple({**step, "commands": [privileged(c, sudo=sudo(s.node))
                                                                    for c in step["commands"]]}
                                           for step in s.steps))
        for s in schedules(plans, dict(driven), ())
    )  # fmt: skip
