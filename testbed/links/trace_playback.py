"""A bandwidth trace replayed on the links: its first row applied as a plan (a transaction, as
:func:`testbed.links.apply.apply_plans`), then a player on every shaped node for the later rows
(``nodes/link_trace_player.py``, named in the node's journal before it starts, so ``testbed link clear``
stops it), and the delay handlers given the trace's delay rows; stopped when its run ends.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import NodeError
from netem.plan import TcPlan
from netem.trace import BandwidthTrace, NodeSchedule, delay_timelines, schedules
from testbed.inventory import Inventory
from testbed.links import node_journal
from testbed.links.apply import ApplyResult, apply_plans, clear_nodes
from testbed.links.handler_lifecycle import node_directory, retime_delay_handler
from testbed.links.plans import compile_plan, traced_links
from testbed.links.probe import NodeProbe
from testbed.sudo_rules import privileged
from testbed.transport import open_transport
from testbed.transport.fanout import FanOutResult, NodeOutcome, fan_out

Say = Callable[[str], None]


PLAYER_SOURCE = Path(__file__).resolve().parents[2] / "nodes" / "link_trace_player.py"


def player_schedules(
    plans: Sequence[TcPlan], driven: dict[tuple[str, str], tuple[BandwidthTrace, str]], *, sudo: bool
) -> tuple[NodeSchedule, ...]:
    """The trace players' schedules, each step's tc commands as the player runs them (as the user,
    each tc with sudo: :func:`testbed.sudo_rules.privileged`)."""
    return tuple(
        dataclasses.replace(s, steps=tuple({**step, "commands": [privileged(c, sudo=sudo) for c in step["commands"]]}
                                           for step in s.steps))
        for s in schedules(plans, driven, ())
    )  # fmt: skip


@dataclass(frozen=True)
class TraceStarted:
    """A trace being replayed: t = 0 was ``start_unix_s`` (controller clock), when the first row
    was in place on every node; each node's player logs its steps to ``logfiles[node]``."""

    start_unix_s: float
    duration_s: float
    logfiles: dict[str, str]
    schedules: tuple[NodeSchedule, ...]


def apply_trace(
    inventory: Inventory,
    traces: dict[str, BandwidthTrace],
    *,
    say: Say = lambda _: None,
    plans: Sequence[TcPlan] | None = None,
    probes: Mapping[str, NodeProbe] | None = None,
    seed: int = 0,
) -> tuple[ApplyResult, TraceStarted | None]:
    """Apply the traces' first rows as a plan (a transaction, as :func:`apply_plans`), then start a
    player on every shaped node for the later rows. The journal names each player before it starts,
    so ``testbed link clear`` stops it. ``plans`` (a run plan's, e.g. with links the trace does not
    drive scaled) replace the plans compiled from the inventory's links and the traces' first rows."""
    links, driven = traced_links(inventory, traces)
    plans = tuple(plans) if plans is not None else compile_plan(inventory, links)
    result = apply_plans(inventory, plans, say=say, probes=probes, seed=seed, traced=tuple(driven))
    if not result.ok:
        return result, None
    start_unix_s = time.time()
    applied = [o.value for o in result.applied.outcomes if o.value]
    plans = tuple(p for a in applied for p in a.plans)  # on their delay paths
    node_schedules = player_schedules(plans, driven, sudo=inventory.spec.defaults.sudo)
    timelines = delay_timelines([c for a in applied for c in a.chains], driven)
    workdir = inventory.spec.defaults.workdir
    player = PLAYER_SOURCE.read_bytes()

    def retime(name: str) -> None:
        with open_transport(inventory, inventory.node(name)) as t:
            retime_delay_handler(t, node_directory(t, workdir), start_unix_s, timelines[name])

    def start(schedule: NodeSchedule) -> str:
        with open_transport(inventory, inventory.node(schedule.node)) as t:
            directory = node_directory(t, workdir)
            journal = node_journal.read(t, workdir)
            if journal is None:
                raise NodeError(schedule.node, "its link journal vanished after apply")
            pidfile, logfile = f"{directory}/trace-player.pid", f"{directory}/trace.jsonl"
            document = {"start_unix_s": start_unix_s, "steps": list(schedule.steps)}
            node_journal.write(t, workdir, journal.with_trace(pidfile))  # named before it starts
            node_journal.store(t, f"{directory}/link_trace_player.py", player)
            node_journal.store(t, f"{directory}/trace-schedule.json", json.dumps(document).encode())
            python = inventory.spec.defaults.python
            t.start_background(
                [python, f"{directory}/link_trace_player.py", f"{directory}/trace-schedule.json", logfile],
                pidfile=pidfile,
                logfile=f"{directory}/trace-player.log",
            )
            return logfile

    by_node = {s.node: s for s in node_schedules}
    started = fan_out(list(by_node), lambda name: start(by_node[name]), description="starting trace players")
    if started.ok and timelines:
        retimed = fan_out(list(timelines), retime, description="giving delay handlers the trace")
        started = started if retimed.ok else FanOutResult(retimed.failed, retimed.wall_s)
    if not started.ok:
        say("starting the trace failed on " + ", ".join(o.node for o in started.failed) + "; undoing every node")
        rolled_back = clear_nodes(inventory, list(dict.fromkeys(p.node for p in plans)))
        failed = FanOutResult(
            tuple(NodeOutcome(o.node, None, o.error, o.duration_s) for o in started.failed), started.wall_s
        )
        return ApplyResult(failed, rolled_back), None
    duration = max(tr.duration_s for tr in traces.values())
    return result, TraceStarted(start_unix_s, duration, started.values(), node_schedules)


def stop_trace_players(inventory: Inventory, names: Sequence[str]) -> FanOutResult[str | None]:
    """Stop the trace players on ``names`` and drop them from the journals (the shaping stays, as the
    last row left it): a run's trace ends with the run, also when the next run keeps the links."""
    workdir = inventory.spec.defaults.workdir

    def stop(name: str) -> str | None:
        with open_transport(inventory, inventory.node(name)) as t:
            journal = node_journal.read(t, workdir)
            if journal is None or not journal.trace_pidfile:
                return None
            how = t.stop_background(journal.trace_pidfile)  # it runs as the user; its tc commands with sudo
            node_journal.write(t, workdir, journal.with_trace(None))
            return how

    return fan_out(list(names), stop, description="stopping trace players")
