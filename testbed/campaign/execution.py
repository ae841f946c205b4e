"""One run of a campaign, phase by phase, with everything restored whatever happens.

    preflight -> (configure | telemetry | stage) -> services -> workers -> drain -> collect -> restore -> record

``preflight`` reaches every node of the run, checks their provisioning records agree, makes the
run plan with the nodes read back (``plan.json``, :mod:`testbed.campaign.plan`: every later phase
executes it) and writes the device schedules; ``configure`` sets the power modes and shapes the links
that do not hold the run's values already (read back; links measured with iperf3 when
``link.verify_s`` > 0); ``telemetry`` starts the samplers (probing the sensors and measuring clock
offsets); ``stage`` puts the run's files on its nodes and starts the warm worker pool of its shape
when none is up (:mod:`testbed.worker_pool`); these three touch different things and run side by
side. ``services`` starts the devices' LLM service daemons of a context-serving method and waits
until they answer (:mod:`testbed.context_service`). ``workers`` orders the run from the pool and
waits for it; ``drain`` keeps telemetry running for ``drain_s``; ``collect`` stops the samplers and
turns the rank files into parquet; ``restore`` stops the LLM services and the run's trace players and
undoes shaping and power modes from the nodes' journals, except on the nodes the next run sets again
(``keep``: they are restored after it, or by the campaign's end);
``record`` writes ``manifest.json``.

A phase that fails ends the run: what exists is still collected, everything is restored (nothing
kept), and the manifest says which phase failed, why and on which node. Restore runs whatever collect
does: collect is waited for at most :func:`collect_limit_s`, and a collect that fails or stalls fails
the run (naming the node) without holding restore back. Every process the run starts on a node is
named in ``processes.json`` before it starts, so a later ``--resume`` can end it after a crash.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundation.errors import NodeError, TestbedError
from foundation.jsonable import jsonable
from foundation.seeds import derive_seed
from nodes.contracts.durable import SyncedLines, write_json_atomic
from nodes.contracts.methods import method_named
from nodes.contracts.rank_dirs import device_glob
from testbed.campaign import manifest as manifest_mod
from testbed.campaign.carryover import Carryover
from testbed.campaign.plan import RunPlan, plan_run
from testbed.campaign.results import write_results
from testbed.campaign.spec import Campaign, PlannedRun, RunSettings, run_nodes
from testbed.inventory import Inventory
from testbed.provision import compare_records, load_record
from testbed.split_run import run_dir_on
from testbed.transport import open_transport
from testbed.transport.base import quote_path
from testbed.transport.fanout import fan_out
from testbed.worker_pool import PoolKeeper, PreparedRun, WorkerPool
from workloads.schedule import write_schedule

PHASES = ("preflight", "configure", "telemetry", "stage", "services", "workers", "drain", "collect", "restore",
          "record")
Report = Callable[[str, dict[str, Any]], None]  # (event, details) for the progress display
COLLECT_LIMIT_S = 300.0  # collect's steps but the telemetry transfers (see collect_limit_s)


class EventLog:
    """``events.jsonl``: one line per orchestration event, flushed and synced as it happens."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path, self.run_id = path, run_id
        self._file = SyncedLines(path)
        self._lock = threading.Lock()  # phases that run side by side write here too

    def write(self, event: str, **details: Any) -> None:
        row = {"ts_s": round(time.time(), 6), "run_id": self.run_id, "event": event, **details}
        with self._lock:
            self._file.write(json.dumps(row, default=str))

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class Kept:
    """What a run left configured for the next run (restored after it, or when the campaign ends)."""

    power: frozenset[str] = frozenset()  # nodes whose power mode stays set
    links: frozenset[str] = frozenset()  # nodes whose shaping stays in place
    contexts: dict[str, Any] = field(default_factory=dict)  # the run plan's node contexts

    def __bool__(self) -> bool:
        return bool(self.power or self.links)


@dataclass(frozen=True)
class RunOutcome:
    state: str  # done | failed
    reason: str | None
    failed_node: str | None
    requests_scheduled: int
    requests_completed: int
    kept: Kept = Kept()


@dataclass
class _RunState:
    """What a run has done so far: what restore must undo and what the manifest records."""

    phases_s: dict[str, float] = field(default_factory=dict)
    power_set: dict[str, str] = field(default_factory=dict)  # node -> mode, set by this run
    power_unchanged: dict[str, str] = field(default_factory=dict)  # node -> mode it held already
    power_read_back: dict[str, Any] = field(default_factory=dict)
    shaped_nodes: tuple[str, ...] = ()
    links: dict[str, Any] = field(default_factory=dict)
    recording: Any = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    schedules: dict[str, list[dict]] = field(default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=dict)
    completed: int = 0
    failure: tuple[str, str, str | None] | None = None  # phase, reason, node
    plan: RunPlan | None = None  # made in preflight, with the nodes read back
    workers: dict[str, Any] = field(default_factory=dict)  # which pool served the run, warm or cold
    kept: Kept = Kept()
    prepared: PreparedRun | None = None  # staged, with its pool up
    fidelity: dict[str, Any] = field(default_factory=dict)  # per node: paced steps that overran their target
    paced_nodes: tuple[str, ...] = ()  # emulated nodes whose CPU quota is paced for this run
    flag: str | None = None  # said of a run that is done but not faithful (over the violation limit)
    services: tuple[Any, ...] = ()  # LLM service daemons started (testbed.context_service.ServicePlan)
    _failing: threading.Lock = field(default_factory=threading.Lock)  # phases side by side may fail at once

    def fail(self, phase: str, reason: str, node: str | None) -> None:
        """Record the run's failure: the first one to happen (the others are in events.jsonl)."""
        with self._failing:
            if self.failure is None:
                self.failure = (phase, reason, node)


def execute_run(
    campaign: Campaign,
    run: PlannedRun,
    attempt: int,
    directory: Path,
    *,
    facts: dict[str, Any],
    carry: Carryover,
    keep: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
    report: Report = lambda _event, _details: None,
) -> RunOutcome:
    """Run ``run`` into ``directory`` (the attempt's own directory) and return how it ended.
    ``carry``: what it takes over from the run before (its warm pool serves it); ``keep``: (power
    nodes, shaped nodes) the next run sets again, left configured if this run succeeds."""
    carry.start_run()
    pools = carry.pools
    directory.mkdir(parents=True, exist_ok=True)
    events = EventLog(directory / "events.jsonl", run.run_id)
    state = _RunState()
    lab, settings = campaign.inventory, run.settings
    started_unix = time.time()
    events.write("run_start", attempt=attempt, label=run.label())
    Step = tuple[str, Callable[[], None]]
    steps: list[list[Step]] = [  # the phases of one entry run side by side
        [("preflight", lambda: _preflight(campaign, run, attempt, directory, state, carry))],
        [("configure", lambda: _configure(campaign, settings, state, events)),
         ("telemetry", lambda: _start_telemetry(campaign, directory, state, carry)),
         ("stage", lambda: _stage(directory, state, pools))],
        *([[("services", lambda: _start_services(campaign, directory, state))]]
          if method_named(settings.method).serves_contexts else []),
        [("workers", lambda: _workers(campaign, directory, state, report, pools))],
        [("drain", lambda: time.sleep(settings.drain_s))],
    ]  # fmt: skip
    try:
        for together in steps:
            if state.failure is not None:
                break
            _side_by_side([lambda p=phase, s=step: _phase(p, s, state, events, report) for phase, step in together])
        _phase("collect", lambda: _within(collect_limit_s(campaign), "collect",
                                          lambda: _collect(campaign, run, directory, state, carry)),
               state, events, report)  # fmt: skip
    except BaseException as exc:  # Ctrl-C, SIGTERM: the run failed, so nothing is kept for a next run
        state.fail("interrupted", f"the controller was interrupted ({type(exc).__name__})", None)
        raise
    finally:
        kept = keep if state.failure is None else (frozenset(), frozenset())
        _phase("restore", lambda: _restore(lab, state, kept), state, events, report)
        scheduled = sum(len(rows) for rows in state.schedules.values())
        if state.completed < scheduled:
            state.fail("collect", f"only {state.completed} of {scheduled} requests completed", None)
        outcome = RunOutcome(
            "failed" if state.failure else "done",
            f"{state.failure[0]}: {state.failure[1]}" if state.failure else state.flag,
            state.failure[2] if state.failure else None,
            scheduled,
            state.completed,
            state.kept,
        )
        _phase(
            "record",
            lambda: manifest_mod.write_manifest(
                directory / "manifest.json",
                manifest_mod.build_manifest(campaign, run, attempt, outcome, state, facts, started_unix,
                                            directory),
            ),
            state, events, report,
        )  # fmt: skip
        events.write("run_end", state=outcome.state, reason=outcome.reason, node=outcome.failed_node)
        events.close()
    return outcome


def _side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` at once (each in a thread but the first) and wait for all of them."""
    threads = [threading.Thread(target=call, daemon=True) for call in calls[1:]]
    for thread in threads:
        thread.start()
    try:
        calls[0]()
    finally:
        for thread in threads:
            thread.join()


def _within(limit_s: float, what: str, call: Callable[[], None]) -> None:
    """``call()`` in a daemon thread, waited for at most ``limit_s``. Past it a TestbedError is raised
    and the call is left to end by itself (every wait on a node is bounded by its transport); the
    controller's exit does not wait for it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # raised again below, in the phase's own thread
            errors.append(exc)

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise TestbedError(f"{what} did not finish within {limit_s:.0f} s; restoring the nodes without waiting for it")
    if errors:
        raise errors[0]


def _phase(name: str, step: Callable[[], None], state: _RunState, events: EventLog, report: Report) -> None:
    report("phase", {"phase": name})
    events.write("phase_start", phase=name)
    started = time.monotonic()
    try:
        step()
    except Exception as exc:  # a failed phase ends the run, never the campaign
        node = exc.node if isinstance(exc, NodeError) else None
        reason = str(exc) if isinstance(exc, (NodeError, TestbedError)) else f"{type(exc).__name__}: {exc}"
        events.write(
            "phase_error",
            phase=name,
            node=node,
            error=reason,
            traceback=None if isinstance(exc, (NodeError, TestbedError)) else traceback.format_exc(),
        )
        state.fail(name, reason, node)
    finally:
        state.phases_s[name] = round(time.monotonic() - started, 3)
        events.write("phase_end", phase=name, seconds=state.phases_s[name])


# --------------------------------------------------------------------------------------------
# Phases


def _preflight(
    campaign: Campaign, run: PlannedRun, attempt: int, directory: Path, state: _RunState, carry: Carryover
) -> None:
    """Reach the nodes, check their provisioning agrees, make the run plan with the nodes read back
    (``plan.json``), and write the device schedules it carries."""
    lab, settings = campaign.inventory, run.settings
    names = [n.name for n in run_nodes(lab, settings)]

    def reach(name: str) -> None:
        with open_transport(lab, lab.node(name)) as t:
            t.run(["true"], timeout_s=30.0).check()

    _require(fan_out(names, reach, description="reaching the run's nodes"), "reaching the node")
    state.records = {name: load_record(lab, name) for name in names}
    differences = compare_records({name: r for name, r in state.records.items() if r})
    if differences:
        raise TestbedError("the run's nodes cannot run together: " + "; ".join(differences))
    plan = plan_run(campaign, run, attempt, live=True, reads=carry.reads)
    state.plan = plan
    write_json_atomic(directory / "plan.json", plan.to_json())
    state.schedules = {device: [dict(r) for r in rows] for device, rows in plan.split.schedules}
    for device, rows in state.schedules.items():
        write_schedule(rows, directory / "schedules" / f"{device}.jsonl")


def _configure(campaign: Campaign, settings: RunSettings, state: _RunState, events: EventLog) -> None:
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

    calls = [collecting(lambda: _set_power(campaign, state, events))]
    if settings.target is not None:
        calls.append(collecting(lambda: _pace_cpus(campaign, state, events)))
    if settings.link.shaped:
        calls.append(collecting(lambda: _shape(campaign, settings, state, events)))
    _side_by_side(calls)
    for extra in errors[1:]:  # the phase fails with the first; the others are recorded too
        events.write("phase_error", phase="configure", node=getattr(extra, "node", None), error=str(extra))
    if errors:
        raise errors[0]


def _pace_cpus(campaign: Campaign, state: _RunState, events: EventLog) -> None:
    """Emulated nodes of a target run: a quota that never holds the real work back, in 10 ms periods
    (the profile decides the steps' times; power modes' 100 ms periods make them bimodal)."""
    from testbed.target_emulation import pace_nodes, paceable

    plan = _plan(state)
    names = paceable(campaign.inventory, plan.nodes)
    state.paced_nodes = tuple(names)  # before the change: restore ends pacing also after a failure
    result = pace_nodes(campaign.inventory, names, True, plan.contexts)
    _require(result, "pacing CPUs")
    if names:
        events.write("cpu_paced", nodes=names)


def _set_power(campaign: Campaign, state: _RunState, events: EventLog) -> None:
    from testbed.power import converge_power

    plan = _plan(state)
    if not plan.power:
        return
    wanted = {step.node: step.mode for step in plan.power}
    result = converge_power(campaign.inventory, wanted, contexts=plan.contexts)
    for name, converged in result.values().items():
        (state.power_set if converged.changed else state.power_unchanged)[name] = wanted[name]
        state.power_read_back[name] = dataclasses.asdict(converged.reading)
    _require(result, "setting power modes")
    if state.power_set:
        events.write("power_set", modes=state.power_set, unchanged=sorted(state.power_unchanged))


def _shape(campaign: Campaign, settings: RunSettings, state: _RunState, events: EventLog) -> None:
    from testbed.links.apply import apply_link_plan
    from testbed.links.trace_playback import apply_traced_plan
    from testbed.links.verify import verify_links

    lab, link, plan = campaign.inventory, settings.link, _plan(state)
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
    _require(result.applied, "shaping links")
    state.links["shaped_unix_s"] = time.time()
    events.write("links_shaped", nodes=list(state.shaped_nodes))
    # what tc read back right after applying (or, where nothing was applied, what the node held then)
    state.links["read_back"] = {o.node: jsonable(o.value.states) for o in result.applied.outcomes if o.value}
    if link.verify_s > 0:

        def note(node: str, pidfile: str) -> None:  # verify's iperf3 servers, noted before they start
            _note_processes(events.path.parent, [{"node": node, "host": node, "pidfile": pidfile}])

        rows = verify_links(lab, plan.links, duration_s=link.verify_s, before_start=note)
        state.links["verification"] = [jsonable(r) for r in rows]
        off = [r for r in rows if not r.within_tolerance]
        if off:
            worst = off[0]
            raise NodeError(worst.source, f"link {worst.source} -> {worst.destination} measured off its profile "
                            f"({jsonable(worst)})")  # fmt: skip


def _start_telemetry(campaign: Campaign, directory: Path, state: _RunState, carry: Carryover) -> None:
    plan = _plan(state)
    if plan.telemetry is None:
        return
    from testbed.telemetry import start_recording

    tel = plan.telemetry
    proven = carry.proven_probes(tel.jetson_source)
    recording = start_recording(
        campaign.inventory, [s.node for s in tel.samplers], interval_s=tel.interval_s, max_seconds=tel.max_seconds,
        jetson_source=tel.jetson_source, session=tel.session, contexts=plan.contexts, proven=proven,
        before_start=lambda r: _note_processes(directory, [{"node": r.node, "host": r.host, "pidfile": r.pidfile}]),
    )  # fmt: skip
    state.telemetry["probes_borne_out_by"] = {n.node: carry.proven_by(n.node) for n in recording.nodes
                                              if n.node in proven}  # fmt: skip
    state.recording = recording


def _stage(directory: Path, state: _RunState, pools: PoolKeeper) -> None:
    """The run's files on its nodes, and the pool of its shape up (started now, cold, if none is)."""
    plan = _plan(state)
    if plan.mpiexec is None:
        raise NodeError(plan.split.server, "no mpiexec beside its Python or on PATH (pip install mpich mpi4py)")

    def started(pool: WorkerPool, warm: bool) -> None:
        state.workers = {"pool": pool.pool_id, "start": "warm" if warm else "cold", "runs_before": pool.served}
        _note_processes(directory, [{"node": pool.server, "host": pool.server, "pidfile": pool.files.pidfile}])

    state.prepared = pools.prepare(plan.split, plan.contexts, plan.launch, on_started=started)


def _start_services(campaign: Campaign, directory: Path, state: _RunState) -> None:
    """The devices' LLM service daemons (a context-serving method): named in processes.json, started
    detached, and waited for until each answers on its socket."""
    plan = _plan(state)
    if not plan.services:
        return
    from testbed.context_service import start_services

    _note_processes(directory, [{"node": p.node, "host": p.node, "pidfile": p.files.pidfile} for p in plan.services])
    state.services = plan.services  # before they start: restore stops whatever did
    _require(start_services(campaign.inventory, plan.services, plan.contexts), "starting the LLM service")


def _workers(campaign: Campaign, directory: Path, state: _RunState, report: Report, pools: PoolKeeper) -> None:
    lab, plan = campaign.inventory, _plan(state)
    if state.prepared is None:
        raise TestbedError("the run was not staged")
    scheduled = sum(len(rows) for rows in state.schedules.values())

    def served(_elapsed_s: float) -> None:
        report("served", {"served": _count_served(lab, plan), "scheduled": scheduled})

    try:
        done = pools.serve(state.prepared, directory / "workers", on_wait=served)
        state.workers["ranks"] = done.record.get("ranks", [])
        # a pool that had stopped by itself before taking the order was started anew: cold, another pool
        state.workers.update(pool=done.pool_id, start="warm" if done.warm else "cold", runs_before=done.runs_before)
        if "release_error" in done.record:
            state.workers["release_error"] = done.record["release_error"]
    finally:
        state.completed = _count_rows(directory / "workers" / "ranks")
        report("served", {"served": state.completed, "scheduled": scheduled})


def collect_limit_s(campaign: Campaign) -> float:
    """How long collect may take before the run fails and is restored without it: its fixed steps,
    plus the run's longest duration for the telemetry recorded over it (at the smallest sampling
    interval a run records far less than a run's length of transfer at the transports' floor rate)."""
    return COLLECT_LIMIT_S + campaign.spec.run_timeout_s


def _collect(campaign: Campaign, run: PlannedRun, directory: Path, state: _RunState, carry: Carryover) -> None:
    """Stop the samplers and pull their files, turn the rank files into tables, read the delay
    handlers' records. Before restore, not after it: the samplers stop while the run's power modes
    hold (after restore their tail would measure the restored modes) and the delay handlers are
    read while their links are still shaped (clearing the links ends them, which would read as a
    handler that died during the run). Restoring first would save little: collect's transfers are
    the telemetry files only (the ranks' files came with the workers phase), over the unshaped
    management plane, each bounded by its transport (a reply timeout per operation, a deadline
    scaled to its size), and the whole phase by :func:`collect_limit_s`. A node that fails any of
    it fails the run, named, and restore runs all the same."""
    errors = []
    failed_nodes: list[str] = []
    if state.recording is not None:
        from testbed.telemetry import finish_recording

        try:
            result = finish_recording(campaign.inventory, state.recording, directory / "telemetry")
            carry.note_samplers(run.run_id, state.recording, result, run.settings.telemetry.jetson_source)
            state.telemetry = {**state.telemetry,
                "nodes": {n.node: {"rows": n.rows, "sampler": n.stopped, "max_gap_s": n.max_gap_s,
                                   "clock_start": dataclasses.asdict(n.clock_start),
                                   "clock_end": dataclasses.asdict(n.clock_end), "drift_ppm": n.drift_ppm,
                                   "clock_start_unix_s": n.clock_start_unix_s, "clock_end_unix_s": n.clock_end_unix_s}
                          for n in result.nodes},
                "errors": result.errors,
                "probes": {name: jsonable(p) for name, p in state.recording.probes.items()},
            }  # fmt: skip
            errors += [f"telemetry on {n}: {e}" for n, e in result.errors.items()]
            failed_nodes += list(result.errors)
        finally:
            state.recording = None
    write_results(directory / "workers" / "ranks", state.schedules, directory)
    _fidelity(directory, state)
    _delay_fidelity(campaign, state)
    if errors:
        raise NodeError(failed_nodes[0], "; ".join(errors)) if failed_nodes else TestbedError("; ".join(errors))


def _fidelity(directory: Path, state: _RunState) -> None:
    """Per node, the share of paced steps that overran the target's time (by computing too long or
    by waking late); a node above the limit flags the run (its reason says so in the ledger)."""
    if not (directory / "steps.parquet").is_file():
        return
    import pandas as pd

    from analysis.fidelity import VIOLATION_LIMIT, violation_shares

    shares = violation_shares(pd.read_parquet(directory / "steps.parquet"))
    state.fidelity = {
        row.node: {"steps": int(row.steps), "overruns": int(row.overruns), "computed_over": int(row.computed_over),
                   "woke_late": int(row.woke_late), "violation_share": round(float(row.violation_share), 4),
                   "flagged": bool(row.flagged)}
        for row in shares.itertuples()
    }  # fmt: skip
    flagged = {n: f["violation_share"] for n, f in state.fidelity.items() if f["flagged"]}
    if flagged:
        worst = max(flagged, key=lambda n: flagged[n])
        state.flag = (f"fidelity: {flagged[worst]:.1%} of {worst}'s paced steps overran their target (limit "
                      f"{VIOLATION_LIMIT:.0%}); raise target.dilation")  # fmt: skip


def _delay_fidelity(campaign: Campaign, state: _RunState) -> None:
    """The NFQUEUE delay handlers' record of the run (how late their releases were) into the manifest;
    a handler that stopped flags the run: its directions went undelayed (--queue-bypass)."""
    from testbed.links.handler_lifecycle import read_delay_handlers
    from testbed.links.node_journal import journal_dir

    held = {r["node"] for r in state.links.get("delay_rules", ()) if r["queues"]}
    if not held or "shaped_unix_s" not in state.links:
        return
    plan = _plan(state)
    workdir = campaign.inventory.spec.defaults.workdir
    directories = {name: plan.contexts[name].path(journal_dir(workdir)) for name in sorted(held)}
    read = read_delay_handlers(campaign.inventory, directories, state.links["shaped_unix_s"])
    state.links["delay_handlers"] = {o.node: jsonable(o.value) if o.value else {"error": o.error}
                                     for o in read.outcomes}  # fmt: skip
    stopped = [o.node for o in read.outcomes if o.value is not None and not o.value.alive]
    if stopped:
        state.flag = (f"fidelity: the NFQUEUE delay handler on {', '.join(stopped)} was not running at the end of "
                      "the run: what it delays may have passed undelayed; see the node's delay-handler.log")


def _plan(state: _RunState) -> RunPlan:
    if state.plan is None:
        raise TestbedError("the run has no plan (preflight did not finish)")
    return state.plan


def _restore(lab: Inventory, state: _RunState, keep: tuple[frozenset[str], frozenset[str]]) -> None:
    """Undo what the run changed, from the nodes' journals: samplers, trace players, then shaping and
    power modes except where ``keep`` says the next run sets them again."""
    problems = []
    if state.recording is not None:  # a run that failed before collect: stop its samplers
        from testbed.telemetry import stop_sampler

        for rec in state.recording.nodes:
            try:
                stop_sampler(lab, lab.node(rec.node), rec)
            except Exception as exc:
                problems.append(f"{rec.node}: sampler: {exc}")
        state.recording = None
    if state.services:  # the devices' LLM services end with their run
        from testbed.context_service import stop_services

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
        from testbed.target_emulation import pace_nodes

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
    from testbed.links.apply import clear_nodes
    from testbed.power import restore_power

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


# --------------------------------------------------------------------------------------------
# Helpers


def _require(result: Any, what: str) -> None:
    if not result.ok:
        first = result.failed[0]
        raise NodeError(first.node, f"{what}: {first.error}")


_PROCESSES_LOCK = threading.Lock()  # telemetry and staging note their processes side by side


def _note_processes(directory: Path, entries: list[dict[str, str]]) -> None:
    """Add processes about to be started on nodes to ``processes.json`` (synced before they start)."""
    path = directory / "processes.json"
    with _PROCESSES_LOCK:
        known = json.loads(path.read_text()) if path.exists() else []
        write_json_atomic(path, known + entries)


def _count_served(lab: Inventory, plan: RunPlan) -> int:
    """Requests the devices have finished so far (lines in their requests.jsonl on the nodes)."""

    def count(name: str) -> int:
        out_dir = run_dir_on(plan.contexts[name], plan.split.run_id) + "/out"
        pattern = f"{quote_path(out_dir)}/{device_glob(shlex.quote(name))}/requests.jsonl"
        with open_transport(lab, lab.node(name)) as t:
            out = t.run_script(f"cat {pattern} 2>/dev/null | grep -c request_id || true", timeout_s=20.0).stdout
        return int(out.strip() or 0)

    return sum(v for v in fan_out(list(plan.devices), count).values().values() if isinstance(v, int))


def _count_rows(ranks: Path) -> int:
    total = 0
    for path in ranks.glob(device_glob() + "/requests.jsonl"):
        total += sum(1 for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return total
