"""A run's restore phase: the samplers, LLM services and trace players it started are stopped, and
the shaping and power modes it set are undone from the nodes' journals, except where the next run
sets them again (kept: released after it, or when the campaign ends)."""

from __future__ import annotations

from typing import Any

from foundation.errors import NodeError
from testbed.campaign.run_state import Kept, RunState
from testbed.inventory import Inventory


def restore_run(lab: Inventory, state: RunState, keep: tuple[frozenset[str], frozenset[str]]) -> None:
    """Undo what the run changed, from the nodes' journals: samplers, trace players, then shaping and
    power modes except where ``keep`` says the next run sets them again."""
    problems = []
    if state.recording is not None:  # a run that failed before collect: stop its samplers
        from testbed.energy.telemetry import stop_sampler

        for rec in state.recording.nodes:
            try:
                stop_sampler(lab, lab.node(rec.node), rec)
            except Exception as exc:
                problems.append(f"{rec.node}: sampler: {exc}")
        state.recording = None
    if state.services:  # the devices' LLM services end with their run
        from testbed.workers.context_service import stop_services

        stopped = stop_services(lab, state.services)
        state.restore["llm_services"] = {o.node: o.value if o.ok else f"failed: {o.error}" for o in stopped.outcomes}
        problems += [f"{o.node}: LLM service: {o.error}" for o in stopped.failed]
        state.services = ()
    plan = state.plan
    power = {step.node for step in plan.power} if plan else set(state.power_set)
    shaped = set(state.shaped_nodes)
    kept = Kept(frozenset(power & keep[0]), frozenset(shaped & keep[1]), dict(plan.contexts) if plan else {})
    if plan is not None and plan.trace is not None and shaped:
        from testbed.links.trace_playback import stop_trace_players

        stopped = stop_trace_players(lab, sorted(shaped))
        problems += [f"{o.node}: trace player: {o.error}" for o in stopped.failed]
    problems += release_nodes(lab, Kept(frozenset(power - kept.power), frozenset(shaped - kept.links),
                                        kept.contexts), state.restore)  # fmt: skip
    if state.paced_nodes:  # every run paces its own nodes: never kept
        from testbed.target.emulation import pace_nodes

        ended = pace_nodes(lab, state.paced_nodes, False, kept.contexts)
        state.restore["cpu_pacing_ended"] = sorted(o.node for o in ended.outcomes if o.ok)
        problems += [f"{o.node}: cpu pacing: {o.error}" for o in ended.failed]
        state.paced_nodes = ()
    state.kept = kept
    if kept:
        state.restore["kept_for_next_run"] = {"power": sorted(kept.power), "links": sorted(kept.links)}
    if problems:
        first = problems[0].split(":", 1)[0]
        raise NodeError(first, "restore failed: " + "; ".join(problems))


def release_nodes(lab: Inventory, nodes: Kept, into: dict[str, Any]) -> list[str]:
    """Undo the shaping and power modes of ``nodes`` from their journals (what a run or the runs
    before it set); the outcomes go into ``into``; returns the problems."""
    from testbed.energy.power_modes import restore_power
    from testbed.links.apply import clear_nodes

    problems = []
    if nodes.links:
        cleared = clear_nodes(lab, sorted(nodes.links))
        into["links"] = {
            o.node: {"ok": o.ok, "error": o.error, "leftovers": list(o.value.leftovers) if o.value else []}
            for o in cleared.outcomes
        }
        problems += [f"{o.node}: link clear: {o.error}" for o in cleared.failed]
        problems += [f"{o.node}: not as before: {'; '.join(o.value.leftovers)}"
                     for o in cleared.outcomes if o.value and o.value.leftovers]  # fmt: skip
    if nodes.power:
        restored = restore_power(lab, sorted(nodes.power), contexts=nodes.contexts or None)
        into["power"] = {
            o.node: {"ok": o.ok, "error": o.error, "mode": (o.value.mode_name if o.value else None)}
            for o in restored.outcomes
        }
        problems += [f"{o.node}: power restore: {o.error}" for o in restored.failed]
    return problems
