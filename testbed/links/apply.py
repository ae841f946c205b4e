"""Applying a :class:`LinkPlan` to nodes as one transaction, reading it back, and undoing it.

``apply_link_plan`` (``apply_plans`` for tc plans compiled from links) first probes every node it
will touch that the plan's maker did not (reachable, data interface present, not the interface of
the SSH session, a delay path where a profile has delay, jitter or loss, no foreign qdiscs in the
way) and refuses, changing nothing, when any problem is found. The delay path is chosen per node
from the probe when the plan is made (``defaults.delay_path``; auto: netem where the kernel has it,
else the NFQUEUE path of :mod:`netem.nfqueue`). Then, on each node: the journal is written (snapshot
of the interfaces before the first apply, the iptables chains and the delay handler about to exist),
the plan's commands run (each with sudo, as one fixed program: :mod:`testbed.provisioning.sudo_rules`), the delay
handler installed root-owned starts (:mod:`testbed.provisioning.delay_handler`), and tc and iptables are read
back and compared with the plan. When any node fails, every node already touched is undone.
``clear_nodes`` undoes from the nodes' journals alone, so it also works after the controller was
killed. ``plan_shaping`` and ``plan_unshaping`` write a run plan's lines of the same steps.

One concept, the link transaction on the nodes (refuse, journal, apply, read back, undo) and what it
leaves (``show_nodes``, ``clear_nodes``). Its neighbours: :mod:`.plans` (the LinkPlan), :mod:`.probe`
(reading a node before), the delay handler's life (:mod:`.handler_lifecycle`), trace playback
(:mod:`.trace_playback`); the pure reconciliation of a plan with what a node holds is netem's
(``tc_state.commands_for``, ``nfqueue.iptables_commands_for``).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from foundation.errors import NodeError, TestbedError
from netem import nfqueue
from netem.delay_path import DelayPath, HeldRules, by_path, delay_path
from netem.plan import TcPlan, plan_devices
from netem.profile import DirectedLink
from netem.tc_state import InterfaceState, commands_for, differences, read_script
from testbed.commands.node_context import NodeContext
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory, kind_of
from testbed.links import node_journal
from testbed.links.handler_lifecycle import (
    handler_command,
    handler_files,
    json_or_none,
    node_directory,
    node_directory_script,
    start_delay_handler,
    stop_earlier_handler,
)
from testbed.links.node_journal import DeviceSnapshot, LinkJournal
from testbed.links.plans import LinkPlan, link_plan
from testbed.links.probe import (
    NodeProbe,
    held_refusals,
    listing_script,
    plan_probe,
    probe_nodes,
    read_states,
    refusals,
)
from testbed.provisioning.delay_handler import RUN_ROOT
from testbed.transport import Transport, open_transport
from testbed.transport.base import background_alive_test, command_line, quote_path
from testbed.transport.fanout import FanOutResult, fan_out

Say = Callable[[str], None]


def _journal_for(
    probe: NodeProbe, plans: Sequence[TcPlan], held: Sequence[HeldRules], handler_pidfile: str | None
) -> LinkJournal:
    devices = {}
    for dev in plan_devices(plans):
        state = probe.states.get(dev)
        qdiscs = state.qdiscs if state is not None and state.exists else ()
        devices[dev] = DeviceSnapshot(qdiscs, state.class_text if state is not None else "")
    new = LinkJournal(
        devices=devices,
        ingress_on=tuple(p.interface for p in plans if p.ifb),
        ifbs=tuple(p.ifb for p in plans if p.ifb),
        held={path: tuple(r.key for r in rules) for path, rules in by_path(held).items()},
        handler_pidfile=handler_pidfile,
        applied=node_journal.applied_entries(plans),
        extra={"written_unix_s": round(time.time(), 3), "by": "testbed link apply"},
    )
    return probe.journal.merged_with(new) if probe.journal else new


@dataclass(frozen=True)
class NodeApplied:
    node: str
    plans: tuple[TcPlan, ...]
    commands: int
    states: dict[str, InterfaceState]
    changed: bool = True  # False: the node already held the plans (ours, read back), nothing was sent
    held: tuple[HeldRules, ...] = ()  # the rules its delay paths hold outside tc (NFQUEUE's chains)


def holds_plans(probe: NodeProbe, plans: Sequence[TcPlan], held: Sequence[HeldRules] = (), seed: int = 0) -> bool:
    """Whether the node already holds ``plans`` and ``held`` as our shaping, exactly as read when
    probing, with no trace player running: then applying them would change nothing. That includes
    the held rules listed back and a delay handler running with the same queues and seed. (netem's
    delay and loss are not compared, so a plan on the netem delay path with them is always applied.)"""
    if probe.journal is None or probe.journal.trace_pidfile or any(p.uses_netem for p in plans):
        return False
    grouped, journaled = by_path(held), probe.journal.held
    for name in dict.fromkeys([*grouped, *journaled]):
        path, listing = delay_path(name), probe.listings.get(name, "")
        mine, ours = grouped.get(name, []), journaled.get(name, ())
        if any(r.key not in ours for r in mine) or any(path.differences(r, listing) for r in mine):
            return False  # planned rules missing, not ours, or other than planned
        if path.undo([k for k in ours if k not in {r.key for r in mine}], listing):
            return False  # an earlier apply's rules that are not planned now are still there
    if any(r.queues for r in held):
        running = probe.handler_config
        wanted = json.loads(json.dumps(nfqueue.handler_config(held, seed=seed)))
        drawn = any(q["jitter_s"] or "loss_pct" in q for q in wanted["queues"])
        keys = [k for k in wanted if k != "seed" or drawn]  # the seed matters only to jitter and loss draws
        if running is None or any(running.get(k) != wanted[k] for k in keys):
            return False
    return not any(differences(p, probe.states) for p in plans)


def read_listings(transport: Transport, paths: Sequence[str]) -> dict[str, str]:
    """What each of the delay ``paths`` holds on the node, listed (NFQUEUE: ``iptables -S``)."""
    out = {}
    for name in paths:
        path = delay_path(name)
        if path.listing_argv:
            script = listing_script(path, transport.use_sudo)
            out[name] = transport.run_script(script, timeout_s=30.0).check().stdout
    return out


def apply_on_node(
    transport: Transport, probe: NodeProbe, plans: Sequence[TcPlan], workdir: str, *,
    held: Sequence[HeldRules] = (), seed: int = 0,
) -> NodeApplied:
    """Journal first, then the commands, then the delay handler, then read back and compare.
    Raises :class:`NodeError` naming the interface and the difference when the read-back does not
    match. A node that already holds the plans is left alone (its journal keeps the snapshot from
    before the first apply)."""
    if holds_plans(probe, plans, held, seed):
        return NodeApplied(probe.node, tuple(plans), 0, probe.states, changed=False, held=tuple(held))
    queued = any(r.queues for r in held)
    earlier = probe.journal is not None and probe.journal.handler_pidfile is not None
    # the handler is named by the journal's directory as an absolute path
    directory = node_directory(transport, workdir) if queued or earlier else None
    files = handler_files(directory) if directory is not None and queued else None
    journal = _journal_for(probe, plans, held, files["pidfile"] if files else None)
    if journal.trace_pidfile:  # a trace still playing would overwrite the new rates
        transport.stop_background(journal.trace_pidfile)
        journal = journal.with_trace(None)
    if earlier and directory is not None:  # the new config starts a new one
        stop_earlier_handler(transport, directory, probe.journal.handler_pidfile if probe.journal else None)
    commands = [c for p in plans for c in commands_for(p, probe.states)] + probe.held_commands(held)
    node_journal.write(transport, workdir, journal)  # names the held rules and the handler before they exist
    transport.run_script(node_journal.commands_script(commands, transport.use_sudo),
                         timeout_s=node_journal.commands_timeout_s(commands)).check()  # fmt: skip
    if directory is not None and queued:
        start_delay_handler(transport, directory, nfqueue.handler_config(held, seed=seed))
    states = read_states(transport, plan_devices(plans)) if plans else {}
    problems = [d for p in plans for d in differences(p, states)]
    grouped = by_path(held)
    listings = read_listings(transport, list(grouped))
    problems += [d for name, rules in grouped.items() for r in rules
                 for d in delay_path(name).differences(r, listings.get(name, ""))]  # fmt: skip
    if problems:
        raise NodeError(probe.node, "read-back differs from the plan: " + "; ".join(problems))
    return NodeApplied(probe.node, tuple(plans), len(commands), states, held=tuple(held))


@dataclass(frozen=True)
class NodeCleared:
    node: str
    had_journal: bool
    commands: int
    trace_stopped: str | None
    leftovers: tuple[str, ...]  # differences from the snapshot after undo


def clear_on_node(transport: Transport, node: str, workdir: str) -> NodeCleared:
    """Undo from the node's journal: stop the trace player and the delay handler, remove what we own
    (qdiscs, ifbs, the rules the delay paths hold), compare with the snapshot, then drop the journal."""
    journal = node_journal.read(transport, workdir)
    if journal is None:
        return NodeCleared(node, False, 0, None, ())
    stopped = None
    if journal.trace_pidfile:
        stopped = transport.stop_background(journal.trace_pidfile)
    if journal.handler_pidfile:
        stop_earlier_handler(transport, node_directory(transport, workdir), journal.handler_pidfile)
    devices = list(dict.fromkeys([*journal.devices, *journal.ingress_on, *journal.ifbs]))
    held_paths = [name for name, keys in journal.held.items() if keys]
    states = read_states(transport, devices)
    commands = journal.held_undo_commands(read_listings(transport, held_paths)) + journal.undo_commands(states)
    if commands:
        transport.run_script(node_journal.commands_script(commands, transport.use_sudo),
                             timeout_s=node_journal.commands_timeout_s(commands)).check()  # fmt: skip
    after, listings = read_states(transport, devices), read_listings(transport, held_paths)
    leftovers = journal.snapshot_differences(after, listings)
    still_ours = journal.undo_commands(after) + journal.held_undo_commands(listings)
    if still_ours:
        raise NodeError(node, "after undo, still ours: " + "; ".join(" ".join(c) for c in still_ours))
    transport.run_script(node_journal.remove_script(workdir), timeout_s=30.0).check()
    return NodeCleared(node, True, len(commands), stopped, tuple(leftovers))


@dataclass(frozen=True)
class ApplyResult:
    applied: FanOutResult[NodeApplied]
    rolled_back: FanOutResult[NodeCleared] | None  # when a node failed, every touched node undone
    plan: LinkPlan | None = None  # what was applied (each tc plan on the delay path its node took)

    @property
    def ok(self) -> bool:
        return self.applied.ok


def _workdir(inventory: Inventory, name: str) -> str:
    return inventory.settings_of(name).workdir


def apply_plans(
    inventory: Inventory, plans: Sequence[TcPlan], *, say: Say = lambda _: None, seed: int = 0
) -> ApplyResult:
    """Apply ``plans`` (compiled from links, e.g. ``testbed link apply``): the :class:`LinkPlan` of
    them, made once their nodes are probed, applied by :func:`apply_link_plan`."""
    return apply_link_plan(inventory, LinkPlan(tuple(plans)), say=say, seed=seed)


def apply_link_plan(
    inventory: Inventory,
    plan: LinkPlan,
    *,
    say: Say = lambda _: None,
    probes: Mapping[str, NodeProbe] | None = None,
    seed: int = 0,
) -> ApplyResult:
    """Apply all of ``plan`` or none: refuse up front (TestbedError, nothing changed) when a node is
    unfit; when applying fails on any node, undo every node (NodeError outcomes say why). Nodes
    that carry shaping from an earlier apply but have no part in it now are cleared, so what is
    shaped afterwards is exactly the plan. ``probes``: what a run plan read from the nodes moments
    before (its plan and tc commands were made from them); where a node of the plan's tc plans has
    none, the nodes are probed now and the plan made again from what they hold (:func:`link_plan`).
    ``seed`` seeds the NFQUEUE handlers' jitter and loss draws."""
    probe_of = {name: probe for name, probe in (probes or {}).items() if name in plan.nodes}

    def probe_more(missing: Sequence[TcPlan], also: Sequence[str] = ()) -> None:
        fresh = probe_nodes(inventory, missing, also)
        if not fresh.ok:
            failed = "; ".join(f"{o.node}: {o.error}" for o in fresh.failed)
            raise NodeError("probe", f"cannot reach every node to shape, nothing changed: {failed}")
        probe_of.update(fresh.values())

    missing = [p for p in plan.tc_plans if p.node not in probe_of]
    if missing:  # the delay paths follow what the nodes hold now
        probe_more(missing)
        plan = link_plan(inventory, plan.tc_plans, probe_of, plan.driven, scope=plan.scope)
    holders = [name for name in plan.held if name not in probe_of]
    if holders:  # receivers that shape nothing themselves hold the rules of what they receive
        probe_more([], [name for name in holders if name not in (probes or {})])
        probe_of.update({name: (probes or {})[name] for name in holders if name in (probes or {})})
    by_node, held = plan.by_node, plan.held
    found = [r for name, probe in probe_of.items() for r in refusals(probe, by_node.get(name, []))]
    found += [r for name, rules in held.items() for r in held_refusals(probe_of[name], rules)]
    if found:
        raise TestbedError("refusing to shape links, nothing was changed:\n  " + "\n  ".join(found))
    touched = list(plan.nodes)
    # The plan says what is shaped: nodes shaped earlier that have no part in it now are cleared.
    others = plan.others(shapeable_nodes(inventory))
    for o in clear_nodes(inventory, others).outcomes:
        if not o.ok:
            say(f"{o.node}: could not clear its earlier shaping: {o.error}")
        elif o.value is not None and o.value.had_journal:
            say(f"{o.node}: earlier shaping removed (no link of this apply starts or ends there)")

    def apply(name: str) -> NodeApplied:
        with open_transport(inventory, inventory.node(name)) as t:
            return apply_on_node(
                t, probe_of[name], by_node.get(name, []), _workdir(inventory, name), held=held.get(name, ()), seed=seed,
            )  # fmt: skip

    applied = fan_out(touched, apply, description="shaping links")
    rolled_back = None
    if not applied.ok:
        say("shaping failed on " + ", ".join(o.node for o in applied.failed) + "; undoing every node")
        rolled_back = clear_nodes(inventory, touched)
    return ApplyResult(applied, rolled_back, plan)


def shapeable_nodes(inventory: Inventory) -> list[str]:
    """Nodes that can hold our qdiscs (phones cannot: they are shaped on the receiving side)."""
    return [n.name for n in inventory.nodes if kind_of(n).shapes_links]


def clear_nodes(inventory: Inventory, names: Sequence[str] | None = None) -> FanOutResult[NodeCleared]:
    names = list(names) if names is not None else shapeable_nodes(inventory)

    def clear(name: str) -> NodeCleared:
        with open_transport(inventory, inventory.node(name)) as t:
            return clear_on_node(t, name, _workdir(inventory, name))

    return fan_out(names, clear, description="clearing links")


@dataclass(frozen=True)
class NodeShaping:
    """What is shaped on one node, read back."""

    node: str
    journal: LinkJournal | None
    states: dict[str, InterfaceState]
    held: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # "path key" -> its rules, as listed
    handler: tuple[dict, ...] = ()  # the delay handler's latest stats line per queue (none: not running)


def show_nodes(inventory: Inventory, names: Sequence[str] | None = None) -> FanOutResult[NodeShaping]:
    names = list(names) if names is not None else shapeable_nodes(inventory)

    def show(name: str) -> NodeShaping:
        node = inventory.node(name)
        devices = [node.data.interface] if node.data else []
        with open_transport(inventory, node) as t:
            journal = node_journal.read(t, _workdir(inventory, name))
            if journal:
                devices += [*journal.devices, *journal.ifbs]
            states = read_states(t, list(dict.fromkeys(devices)))
            if journal is None or not any(journal.held.values()):
                return NodeShaping(name, journal, states)
            listings = read_listings(t, list(journal.held))
            held = {f"{path} {' '.join(key)}": delay_path(path).listed(key, listings.get(path, ""))
                    for path, keys in journal.held.items() for key in keys}  # fmt: skip
            handler: tuple[dict, ...] = ()
            if journal.handler_pidfile and journal.handler_pidfile.startswith(RUN_ROOT + "/"):
                pidfile = journal.handler_pidfile
                stats = pidfile.rsplit("/", 1)[0] + "/stats.jsonl"
                text = t.run_script(f"if {background_alive_test(pidfile)}; then tail -n 64 "
                                    f"{quote_path(stats)}; fi").stdout  # fmt: skip
                latest: dict[int, dict] = {}
                for line in text.splitlines():
                    record = json_or_none(line)
                    if record and record.get("event") == "stats":
                        latest[record["queue_num"]] = record
                handler = tuple(latest[k] for k in sorted(latest))
            return NodeShaping(name, journal, states, held, handler)

    return fan_out(names, show, description="reading tc and what the delay paths hold")



@dataclass(frozen=True)
class AppliedLinks:
    """What the nodes' link journals say is shaped now (``link apply``, a run's shaping, a trace)."""

    links: tuple[DirectedLink, ...]  # each shaped direction once, in the order of the inventory's nodes
    traced: tuple[str, ...]  # nodes whose journal names a trace player: their rates change as it plays


def applied_links(inventory: Inventory) -> AppliedLinks:
    """Read every shapeable node's journal (a node that cannot be read is a NodeError naming it)."""
    names = shapeable_nodes(inventory)

    def read(name: str) -> LinkJournal | None:
        with open_transport(inventory, inventory.node(name)) as t:
            return node_journal.read(t, _workdir(inventory, name))

    journals = {n: j for n, j in fan_out(names, read, description="reading the link journals")
                .require("reading the link journals").items() if j is not None}  # fmt: skip
    by_direction: dict[tuple[str, str], DirectedLink] = {}
    for name, journal in journals.items():
        try:
            found = journal.applied_links()
        except ValueError as exc:
            raise NodeError(name, str(exc)) from None
        for link in found:
            by_direction.setdefault((link.source, link.destination), link)
    order = {n.name: i for i, n in enumerate(inventory.nodes)}
    ordered = sorted(by_direction.values(), key=lambda lk: (order.get(lk.source, len(order)),
                                                            order.get(lk.destination, len(order))))  # fmt: skip
    return AppliedLinks(tuple(ordered), tuple(n for n, j in journals.items() if j.trace_pidfile))

# --------------------------------------------------------------------------------------------
# A run plan's lines of the link transaction


def plan_shaping(
    lines: PlanLines, plan: LinkPlan, probes: Mapping[str, NodeProbe], contexts: Mapping[str, NodeContext]
) -> None:
    """The configure phase's lines of :func:`apply_link_plan`: with a node's probe from planning, the
    tc commands and the delay paths' rules reconciled against it (sent ``if-differs``); without,
    decided live."""
    lab = lines.lab
    by_node = plan.by_node
    for name in plan.nodes:
        if name not in probes:  # the plan's own read is reused when it has one
            plan_probe(lines, name, plan_devices(by_node.get(name, [])), phase="configure",
                       what="read the interfaces, journal and kernel before shaping", when="live")  # fmt: skip
    for name in plan.others(shapeable_nodes(lab)):
        lines.add(name, "configure", "clear earlier shaping of a node this run does not shape",
                  sh(node_journal.read_script(_workdir(lab, name))))  # fmt: skip
    for name in plan.nodes:
        workdir, sudo = _workdir(lab, name), lab.settings_of(name).sudo
        plans, held = by_node.get(name, []), plan.held.get(name, ())
        probe = probes.get(name)
        when = "if-differs" if probe is not None else "live"
        commands = [c for p in plans for c in (commands_for(p, probe.states) if probe else p.apply_commands())]
        commands += probe.held_commands(held) if probe else [c for r in held for c in r.apply_commands()]
        directory = contexts[name].path(node_journal.journal_dir(workdir)) if name in contexts else None
        if plan.queued(name):
            lines.add(name, "configure", "where the delay handler lives", sh(node_directory_script(workdir)), when)
            lines.add(name, "configure", "stop the delay handler of an earlier apply",
                      command_line(handler_command("stop", directory or node_journal.journal_dir(workdir), sudo=sudo)),
                      "live")  # fmt: skip
        lines.store(name, "configure", "write the link journal (the interfaces, rules and handler as they were)",
                    node_journal.journal_path(workdir), "if-differs")  # fmt: skip
        lines.add(name, "configure", "shape the links", sh(node_journal.commands_script(commands, sudo)), when)
        if plan.queued(name) and directory is not None:
            start = handler_command("start", directory, sudo=sudo)
            lines.add(name, "configure", "start the delay handler (root-owned, detached; returns once its queues are "
                      "bound)", command_line(start), when, f"(its queues on stdin) {shlex.join(start)}")  # fmt: skip
        if plans:
            lines.add(name, "configure", "read tc back", sh(read_script(plan_devices(plans))), "if-differs")
        for path in _listed(held):
            lines.add(name, "configure", f"read {path.listing_name} back", sh(listing_script(path, sudo)), when)


def _listed(held: Sequence[HeldRules]) -> list[DelayPath]:
    """The delay paths of ``held`` that list what they hold."""
    return [p for p in map(delay_path, by_path(held)) if p.listing_argv]


def _fresh_undo(plans: Sequence[TcPlan]) -> list[list[str]]:
    """What the journal of a fresh apply of ``plans`` undoes: ingress redirects, ifbs, then our roots."""
    ingress = [c for p in plans if p.ifb for c in p.undo_commands()[:1]]
    ifbs = [c for p in plans if p.ifb for c in p.undo_commands()[1:]]
    roots = [c for p in plans if not p.ifb for c in p.undo_commands()]
    return ingress + ifbs + roots


def plan_unshaping(lines: PlanLines, plan: LinkPlan, contexts: Mapping[str, NodeContext]) -> None:
    """The restore phase's lines of :func:`clear_nodes` on the plan's nodes (after the last run that
    keeps the links), as the journal of a fresh apply would have them undone."""
    lab = lines.lab
    by_node = plan.by_node
    for name in plan.nodes:
        workdir, sudo = _workdir(lab, name), lab.settings_of(name).sudo
        plans, held = by_node.get(name, []), plan.held.get(name, ())
        journal_devices = list(dict.fromkeys(plan_devices(plans) + [p.interface for p in plans if p.ifb]))
        undo = [c for r in held for c in r.undo_commands()] + _fresh_undo(plans)
        steps = [("read the link journal", sh(node_journal.read_script(workdir)))]
        if plan.queued(name) and name in contexts:
            directory = contexts[name].path(node_journal.journal_dir(workdir))
            steps.append(("where the delay handler lives", sh(node_directory_script(workdir))))
            steps.append(("stop the delay handler", command_line(handler_command("stop", directory, sudo=sudo))))
        steps.append(("read tc before undoing", sh(read_script(journal_devices))))
        steps += [(f"read {p.listing_name} before undoing", sh(listing_script(p, sudo))) for p in _listed(held)]
        steps += [
            ("undo the shaping (only what the journal says is ours)", sh(node_journal.commands_script(undo, sudo))),
            ("read tc after undoing", sh(read_script(journal_devices))),
        ]
        steps += [(f"read {p.listing_name} after undoing", sh(listing_script(p, sudo))) for p in _listed(held)]
        steps.append(("drop the link journal", sh(node_journal.remove_script(workdir))))
        for what, line in steps:
            lines.add(name, "restore", what, line, "at-release")
