"""A bandwidth trace replayed on the links: its first row applied as a plan (a transaction, as
:func:`testbed.links.apply.apply_link_plan`), then a player on every shaped node for the later rows
(``nodes/link_trace_player.py``, named in the node's journal before it starts, so ``testbed link clear``
stops it), and the delay handlers given the trace's delay rows; stopped when its run ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import NodeError
from netem.nfqueue import NfqueueRules
from netem.trace import BandwidthTrace, NodeSchedule, delay_timelines
from testbed.commands.node_context import NodeContext, unresolved_context
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory
from testbed.links import node_journal
from testbed.links.apply import ApplyResult, apply_link_plan, clear_nodes
from testbed.links.handler_lifecycle import node_directory, node_directory_script, retime_delay_handler
from testbed.links.plans import LinkPlan, compile_plan, traced_links
from testbed.links.probe import NodeProbe
from testbed.transport import open_transport
from testbed.transport.base import background_stop_script
from testbed.transport.fanout import FanOutResult, NodeOutcome, fan_out

Say = Callable[[str], None]


PLAYER_SOURCE = Path(__file__).resolve().parents[2] / "nodes" / "link_trace_player.py"


@dataclass(frozen=True)
class TraceStarted:
    """A trace being replayed: t = 0 was ``start_unix_s`` (controller clock), when the first row
    was in place on every node; each node's player logs its steps to ``logfiles[node]``."""

    start_unix_s: float
    duration_s: float
    logfiles: dict[str, str]
    schedules: tuple[NodeSchedule, ...]


def apply_trace(
    inventory: Inventory, traces: dict[str, BandwidthTrace], *, say: Say = lambda _: None
) -> tuple[ApplyResult, TraceStarted | None]:
    """Replay ``traces`` (device -> trace, ``testbed link trace``) on the inventory's links:
    :func:`apply_traced_plan` of the plan compiled from their first rows."""
    links, driven = traced_links(inventory, traces)
    return apply_traced_plan(inventory, LinkPlan(compile_plan(inventory, links), driven=driven), say=say)


def apply_traced_plan(
    inventory: Inventory,
    plan: LinkPlan,
    *,
    say: Say = lambda _: None,
    probes: Mapping[str, NodeProbe] | None = None,
    seed: int = 0,
) -> tuple[ApplyResult, TraceStarted | None]:
    """Apply ``plan`` (its traces' first rows; a transaction, as :func:`apply_link_plan`), then start
    a player on every node whose classes a trace drives, for the later rows, and give the delay
    handlers the traces' delay rows. The journal names each player before it starts, so ``testbed
    link clear`` stops it."""
    result = apply_link_plan(inventory, plan, say=say, probes=probes, seed=seed)
    if not result.ok or result.plan is None:
        return result, None
    plan = result.plan  # each tc plan on the delay path its node took
    start_unix_s = time.time()
    node_schedules = plan.players
    # the delay handler plays the traced directions' delay rows itself (the NFQUEUE path's queues)
    queued = [r for rules in plan.held.values() for r in rules if isinstance(r, NfqueueRules)]
    timelines = delay_timelines(queued, dict(plan.driven))
    player = PLAYER_SOURCE.read_bytes()

    def retime(name: str) -> None:
        with open_transport(inventory, inventory.node(name)) as t:
            workdir = inventory.settings_of(name).workdir
            retime_delay_handler(t, node_directory(t, workdir), start_unix_s, timelines[name])

    def start(schedule: NodeSchedule) -> str:
        settings = inventory.settings_of(schedule.node)
        workdir = settings.workdir
        with open_transport(inventory, inventory.node(schedule.node)) as t:
            directory = node_directory(t, workdir)
            journal = node_journal.read(t, workdir)
            if journal is None:
                raise NodeError(schedule.node, "its link journal vanished after apply")
            player_path, schedule_file, pidfile, logfile = player_files(directory)
            document = {"start_unix_s": start_unix_s, "steps": list(schedule.steps)}
            node_journal.write(t, workdir, journal.with_trace(pidfile))  # named before it starts
            node_journal.store(t, player_path, player)
            node_journal.store(t, schedule_file, json.dumps(document).encode())
            t.start_background([settings.python, player_path, schedule_file, logfile], pidfile=pidfile,
                               logfile=f"{directory}/trace-player.log")  # fmt: skip
            return logfile

    by_node = {s.node: s for s in node_schedules}
    started = fan_out(list(by_node), lambda name: start(by_node[name]), description="starting trace players")
    if started.ok and timelines:
        retimed = fan_out(list(timelines), retime, description="giving delay handlers the trace")
        started = started if retimed.ok else FanOutResult(retimed.failed, retimed.wall_s)
    if not started.ok:
        say("starting the trace failed on " + ", ".join(o.node for o in started.failed) + "; undoing every node")
        rolled_back = clear_nodes(inventory, list(plan.nodes))
        failed = FanOutResult(
            tuple(NodeOutcome(o.node, None, o.error, o.duration_s) for o in started.failed), started.wall_s
        )
        return ApplyResult(failed, rolled_back, plan), None
    duration = max((trace.duration_s for trace, _column in plan.driven.values()), default=0.0)
    return result, TraceStarted(start_unix_s, duration, started.values(), node_schedules)


def stop_trace_players(inventory: Inventory, names: Sequence[str]) -> FanOutResult[str | None]:
    """Stop the trace players on ``names`` and drop them from the journals (the shaping stays, as the
    last row left it): a run's trace ends with the run, also when the next run keeps the links."""
    def stop(name: str) -> str | None:
        workdir = inventory.settings_of(name).workdir
        with open_transport(inventory, inventory.node(name)) as t:
            journal = node_journal.read(t, workdir)
            if journal is None or not journal.trace_pidfile:
                return None
            how = t.stop_background(journal.trace_pidfile)  # it runs as the user; its tc commands with sudo
            node_journal.write(t, workdir, journal.with_trace(None))
            return how

    return fan_out(list(names), stop, description="stopping trace players")


# --------------------------------------------------------------------------------------------
# A run plan's lines of trace playback


def player_files(directory: str) -> tuple[str, str, str, str]:
    """(player, schedule, pidfile, log of its steps) in the journal's ``directory`` on a node."""
    return (f"{directory}/link_trace_player.py", f"{directory}/trace-schedule.json", f"{directory}/trace-player.pid",
            f"{directory}/trace.jsonl")  # fmt: skip


def plan_trace_players(lines: PlanLines, plan: LinkPlan, contexts: Mapping[str, NodeContext]) -> None:
    """The configure phase's lines of :func:`apply_traced_plan` that start the players (after shaping)."""
    lab = lines.lab
    for schedule in plan.players:
        name = schedule.node
        workdir = lab.settings_of(name).workdir
        tilde = node_journal.journal_dir(workdir)
        context = contexts.get(name) or unresolved_context(lab, lab.node(name))
        directory = context.path(tilde)
        player, schedule_file, pidfile, logfile = player_files(directory)
        lines.add(name, "configure", "where the trace player lives", sh(node_directory_script(workdir)))
        lines.add(name, "configure", "read the link journal", sh(node_journal.read_script(workdir)))
        lines.store(name, "configure", "name the trace player in the journal", node_journal.journal_path(workdir))
        lines.store(name, "configure", "store the trace player", player)
        lines.store(name, "configure", "store the trace's schedule", schedule_file)
        lines.detached(name, "configure", "start the trace player (detached)",
                       [lab.settings_of(name).python, player, schedule_file, logfile], pidfile,
                       f"{directory}/trace-player.log")  # fmt: skip


def plan_trace_stop(lines: PlanLines, plan: LinkPlan, contexts: Mapping[str, NodeContext]) -> None:
    """The restore phase's lines of :func:`stop_trace_players` (a run's trace ends with it, also where
    the shaping stays for the next run), on every node the plan shapes."""
    for name in sorted(plan.by_node):
        workdir = lines.lab.settings_of(name).workdir
        pidfile = player_files(contexts[name].path(node_journal.journal_dir(workdir)))[2]
        lines.add(name, "restore", "read the link journal", sh(node_journal.read_script(workdir)))
        lines.add(name, "restore", "stop the trace player", sh(background_stop_script(pidfile, 5.0)), "live")
        lines.store(name, "restore", "drop the trace player from the journal", node_journal.journal_path(workdir),
                    "live")  # fmt: skip
