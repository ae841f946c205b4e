"""A run's configure phase: power modes, CPU pacing of emulated nodes in a target run, and the links
(side by side), each changed only where the node does not hold the run's value already, as the run
plan says (:mod:`testbed.campaign.plan`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from foundation.errors import NodeError
from foundation.jsonable import jsonable
from foundation.seeds import derive_seed
from testbed.campaign.run_state import EventLog, RunState, note_processes, plan_of, require, side_by_side
from testbed.campaign.spec import Campaign, RunSettings


def configure(campaign: Campaign, settings: RunSettings, state: RunState, events: EventLog) -> None:
    """Power modes and links (side by side), each changed only where the node does not hold the run's
    value already."""
    errors: list[BaseException] = []

    def collecting(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                call()
            except BaseException as exc:  # raised again below, in the phase's own thread
                errors.append(exc)

        return run

    calls = [collecting(lambda: set_power(campaign, state, events))]
    if settings.target is not None:
        calls.append(collecting(lambda: pace_cpus(campaign, state, events)))
    if settings.link.shaped:
        calls.append(collecting(lambda: shape(campaign, settings, state, events)))
    side_by_side(calls)
    for extra in errors[1:]:  # the phase fails with the first; the others are recorded too
        events.write("phase_error", phase="configure", node=getattr(extra, "node", None), error=str(extra))
    if errors:
        raise errors[0]


def pace_cpus(campaign: Campaign, state: RunState, events: EventLog) -> None:
    """Emulated nodes of a target run: a quota that never holds the real work back, in 10 ms periods
    (the profile decides the steps' times; power modes' 100 ms periods make them bimodal)."""
    from testbed.target.emulation import pace_nodes, paceable

    plan = plan_of(state)
    names = paceable(campaign.inventory, plan.nodes)
    state.paced_nodes = tuple(names)  # before the change: restore ends pacing also after a failure
    result = pace_nodes(campaign.inventory, names, True, plan.contexts)
    require(result, "pacing CPUs")
    if names:
        events.write("cpu_paced", nodes=names)


def set_power(campaign: Campaign, state: RunState, events: EventLog) -> None:
    from testbed.energy.power_modes import converge_power

    plan = plan_of(state)
    if not plan.power:
        return
    wanted = {step.node: step.mode for step in plan.power}
    result = converge_power(campaign.inventory, wanted, contexts=plan.contexts)
    for name, converged in result.values().items():
        (state.power_set if converged.changed else state.power_unchanged)[name] = wanted[name]
        state.power_read_back[name] = dataclasses.asdict(converged.reading)
    require(result, "setting power modes")
    if state.power_set:
        events.write("power_set", modes=state.power_set, unchanged=sorted(state.power_unchanged))


def shape(campaign: Campaign, settings: RunSettings, state: RunState, events: EventLog) -> None:
    from testbed.links.apply import apply_link_plan
    from testbed.links.trace_playback import apply_traced_plan
    from testbed.links.verify import verify_links

    lab, link, plan = campaign.inventory, settings.link, plan_of(state)
    started = None
    state.shaped_nodes = tuple(dict.fromkeys(p.node for p in plan.tc_plans))
    seed = derive_seed(plan.run_id, "links")  # the delay handlers' jitter and loss draws
    if plan.trace is not None:
        result, started = apply_traced_plan(lab, plan.shaping, probes=plan.probes, seed=seed)
    else:
        result = apply_link_plan(lab, plan.shaping, probes=plan.probes, seed=seed)
    state.links["applied"] = [
        {"node": p.node, "device": p.shaped_device, "direction": p.direction, "delay_path": p.delay_path,
         "peers": [{"peer": x.peer, "profile": x.profile_name, "rate_bit_s": x.profile.rate_bit_s} for x in p.peers],
         "commands": [" ".join(c) for c in p.apply_commands()], "changed": o.value.changed}
        for o in result.applied.outcomes if o.value for p in o.value.plans
    ]  # fmt: skip
    # the rules the delay paths hold outside tc (NFQUEUE: each receiver's chain), and the handler's queues
    state.links["delay_rules"] = [
        {"node": r.node, "delay_path": r.delay_path, "key": list(r.key), "delays": r.description, "seed": seed,
         "queues": list(r.queues), "rules": r.rule_lines()}
        for o in result.applied.outcomes if o.value for r in o.value.held
    ]  # fmt: skip
    if started is not None:
        state.links["trace"] = {"file": link.trace, "duration_s": started.duration_s, "logfiles": started.logfiles}
    require(result.applied, "shaping links")
    state.links["shaped_unix_s"] = time.time()
    events.write("links_shaped", nodes=list(state.shaped_nodes))
    # what tc read back right after applying (or, where nothing was applied, what the node held then)
    state.links["read_back"] = {o.node: jsonable(o.value.states) for o in result.applied.outcomes if o.value}
    if link.verify_s > 0:

        def note(node: str, pidfile: str) -> None:  # verify's iperf3 servers, noted before they start
            note_processes(events.path.parent, [{"node": node, "host": node, "pidfile": pidfile}])

        rows = verify_links(lab, plan.links, duration_s=link.verify_s, before_start=note)
        state.links["verification"] = [jsonable(r) for r in rows]
        off = [r for r in rows if not r.within_tolerance]
        if off:
            worst = off[0]
            raise NodeError(worst.source, f"link {worst.source} -> {worst.destination} measured off its profile "
                            f"({jsonable(worst)})")  # fmt: skip
