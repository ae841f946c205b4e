"""Power modes of the inventory's nodes, set and read back through the node-side drivers
(``python -m nodes.power`` on the node; phones through their USB host), with each node's journal
at ``<workdir>/power/`` so that :func:`restore_power` puts back the state from before the first
change, also after the controller was killed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from foundation.errors import NodeError, TestbedError
from testbed.commands.node_context import (
    NodeContext,
    ensure_node_code,
    read_home,
    require_current_code,
    resolve_context,
    restoring_context,
    transport_for,
)
from testbed.commands.planned import PlanLines
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.transport.base import command_line
from testbed.transport.fanout import FanOutResult, fan_out


@dataclass(frozen=True)
class PowerReading:
    """A node's power state as its driver read it back."""

    node: str
    kind: str
    mode_id: str | None
    mode_name: str | None
    clocks_locked: bool | None
    warnings: tuple[str, ...] = ()
    modes: tuple[tuple[str, str], ...] = ()  # (id, name) of the modes it offers
    journal: bool = False  # a journal is on the node: it was changed and not yet restored
    details: dict[str, Any] = field(default_factory=dict)


def _journal_path(inventory: Inventory, node: NodeSpec) -> str:
    base = inventory.settings_of(node).workdir.rstrip("/") + "/power"
    if kind_of(node).via_usb_host:  # one USB host keeps a journal per phone
        assert node.adb is not None
        return f"{base}/journal-{node.adb.serial}.json"
    return f"{base}/journal.json"


def driver_command(inventory: Inventory, node: NodeSpec, context: NodeContext, action: Sequence[str]) -> list[str]:
    """The exact command line (environment included) that runs the node's power driver for ``action``."""
    argv = [context.base_python, "-m", "nodes.power", "--kind", kind_of(node).power_driver]
    argv += ["--journal", context.path(_journal_path(inventory, node))]
    if inventory.settings_of(node).sudo:
        argv.append("--sudo")
    if kind_of(node).via_usb_host:
        assert node.adb is not None
        argv += ["--serial", node.adb.serial]
    return context.command([*argv, *action])


def run_driver(
    inventory: Inventory,
    node: NodeSpec,
    action: list[str],
    *,
    timeout_s: float = 120.0,
    context: NodeContext | None = None,
) -> dict[str, Any]:
    """Run ``python -m nodes.power ... ACTION`` for ``node`` and return its JSON answer. With
    ``context`` (a run plan's), nothing is looked up on the node first."""
    with transport_for(inventory, node) as t:
        context = context or resolve_context(inventory, node, t)
        ensure_node_code(t, context)
        result = t.run(driver_command(inventory, node, context, action), timeout_s=timeout_s)
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        detail = (result.stderr.strip() or result.stdout.strip())[-400:]
        raise NodeError(node.name, f"power driver failed (exit status {result.exit_code}): {detail}") from None
    if "error" in answer:
        raise NodeError(node.name, str(answer["error"]))
    return dict(answer)


def set_action(mode: str, *, lock_clocks: bool = False, if_differs: bool = False) -> list[str]:
    """The driver's words that set ``mode`` (an id or a name); ``if_differs``: only when the node is
    not in it already (it reads the mode first, and back after setting)."""
    return ["set", mode, *(["--lock-clocks"] if lock_clocks else []), *(["--if-differs"] if if_differs else [])]


def _drive(
    inventory: Inventory, node: NodeSpec, action: list[str], contexts: Mapping[str, NodeContext] | None
) -> dict[str, Any]:
    return run_driver(inventory, node, action, context=contexts.get(node.name) if contexts else None)


def _reading(node: NodeSpec, answer: dict[str, Any], state_key: str = "state") -> PowerReading:
    state = answer.get(state_key) or {}
    return PowerReading(
        node=node.name,
        kind=str(answer.get("kind", "")),
        mode_id=state.get("mode_id"),
        mode_name=state.get("mode_name"),
        clocks_locked=state.get("clocks_locked"),
        warnings=tuple(state.get("warnings") or ()),
        modes=tuple((m["id"], m["name"]) for m in answer.get("modes") or ()),
        journal=bool(answer.get("journal")),
        details=dict(state.get("details") or {}),
    )


def show_power(
    inventory: Inventory, nodes: list[str] | None = None, *, contexts: Mapping[str, NodeContext] | None = None
) -> FanOutResult[PowerReading]:
    selected = inventory.select(nodes)
    by_name = {n.name: n for n in selected}
    require_current_code(inventory, list(by_name))
    return fan_out(
        list(by_name),
        lambda name: _reading(by_name[name], _drive(inventory, by_name[name], ["show"], contexts)),
        description="reading power modes",
    )


def set_power(
    inventory: Inventory,
    targets: list[str],
    mode: str,
    *,
    lock_clocks: bool = False,
    contexts: Mapping[str, NodeContext] | None = None,
) -> FanOutResult[PowerReading]:
    """Set ``mode`` (an id or name) on every selected node and read it back; each node's journal
    records its state before the first change. Nothing is changed anywhere when a node cannot be
    read first, and a mode that a selected Jetson does not offer is a user error."""
    selected = inventory.select(targets)
    if not selected:
        raise TestbedError("no node selected")
    by_name = {n.name: n for n in selected}
    shown = show_power(inventory, list(by_name), contexts=contexts)
    if not shown.ok:
        return FanOutResult(shown.failed, shown.wall_s)
    lacking = {
        name: reading
        for name, reading in shown.values().items()
        if kind_of(by_name[name]).power_modes.listed_by_driver
        and not any(mode in (i, n) or mode.lower() == n.lower() for i, n in reading.modes)
    }
    if lacking:
        listing = "; ".join(
            f"{name} has {', '.join(f'{i} {n}' for i, n in r.modes)}" for name, r in lacking.items()
        )
        names = ", ".join(lacking)
        raise TestbedError(f"power mode {mode!r} is not a mode of {names} ({listing}); nothing was changed")
    action = set_action(mode, lock_clocks=lock_clocks)
    return fan_out(
        list(by_name),
        lambda name: _reading(by_name[name], _drive(inventory, by_name[name], action, contexts)),
        description=f"setting power mode {mode}",
    )


@dataclass(frozen=True)
class ModeConverged:
    reading: PowerReading  # read back after setting, or as found
    changed: bool  # False: the node was in the mode already, and was left alone


def converge_power(
    inventory: Inventory, modes: Mapping[str, str], *, contexts: Mapping[str, NodeContext] | None = None
) -> FanOutResult[ModeConverged]:
    """Put every node of ``modes`` (node -> mode) in its mode with one driver call per node, which reads
    the mode first and changes (journaled, read back) only a node that is not in it already. A campaign
    run's configuration; the modes were checked against the inventory when the campaign was loaded."""
    require_current_code(inventory, list(modes))

    def converge(name: str) -> ModeConverged:
        node = inventory.node(name)
        answer = _drive(inventory, node, set_action(modes[name], if_differs=True), contexts)
        return ModeConverged(_reading(node, answer), bool(answer.get("changed", True)))

    return fan_out(list(modes), converge, description="setting power modes where they differ")


def restore_power(
    inventory: Inventory, nodes: list[str] | None = None, *, contexts: Mapping[str, NodeContext] | None = None
) -> FanOutResult[PowerReading | None]:
    """Put every selected node back as its journal recorded it (None where there was no journal)."""
    selected = inventory.select(nodes)
    by_name = {n.name: n for n in selected}

    def restore(name: str) -> PowerReading | None:
        node = by_name[name]
        context = contexts.get(name) if contexts else None
        if context is None:  # restoring must work also where the venv is stale: the bundle then
            with transport_for(inventory, node) as t:
                context = dataclasses.replace(restoring_context(inventory, node), home=read_home(t))
        answer = run_driver(inventory, node, ["restore"], context=context)
        return _reading(by_name[name], answer, "restored") if answer.get("restored") else None

    return fan_out(list(by_name), restore, description="restoring power modes")


@dataclass(frozen=True)
class PowerStep:
    """A run's power mode for one node (set where it differs, restored from the node's journal)."""

    node: str
    mode: str


def plan_power_set(lines: PlanLines, steps: Sequence[PowerStep], contexts: Mapping[str, NodeContext]) -> None:
    """The configure phase's lines of :func:`converge_power`."""
    lab = lines.lab
    for step in steps:
        lines.node_code(step.node, "configure", contexts[step.node])
        lines.add(step.node, "configure", "set the power mode where it differs",
                  command_line(driver_command(lab, lab.node(step.node), contexts[step.node],
                                              set_action(step.mode, if_differs=True))))  # fmt: skip


def plan_power_restore(lines: PlanLines, steps: Sequence[PowerStep], contexts: Mapping[str, NodeContext]) -> None:
    """The restore phase's lines of :func:`restore_power` (after the last run that needs the modes)."""
    lab = lines.lab
    for step in steps:
        node = lab.node(step.node)
        lines.node_code(step.node, "restore", contexts[step.node])
        lines.add(node, "restore", "restore the power mode from the node's journal",
                  command_line(driver_command(lab, node, contexts[step.node], ["restore"])), "at-release")  # fmt: skip
