"""One run of a campaign, phase by phase, with everything restored whatever happens.

    preflight -> (configure | telemetry | stage) -> services -> workers -> drain -> collect -> restore -> record

``preflight`` reaches every node of the run, checks their provisioning records agree, makes the
run plan with the nodes read back (``plan.json``, :mod:`testbed.campaign.plan`: every later phase
executes it) and writes the device schedules; ``configure`` sets the power modes and shapes the links
that do not hold the run's values already (read back; links measured with iperf3 when
``link.verify_s`` > 0); ``telemetry`` starts the samplers (probing the sensors and measuring clock
offsets); ``stage`` puts the run's files on its nodes and starts the warm worker pool of its shape
when none is up (:mod:`testbed.workers.pool`); these three touch different things and run side by
side. ``services`` starts the devices' LLM service daemons of a context-serving method and waits
until they answer (:mod:`testbed.workers.context_service`). ``workers`` orders the run from the pool and
waits for it; ``drain`` keeps telemetry running for ``drain_s``; ``collect`` stops the samplers and
turns the rank files into parquet; ``restore`` stops the LLM services and the run's trace players and
undoes shaping and power modes from the nodes' journals, except on the nodes the next run sets again
(``keep``: they are restored after it, or by the campaign's end);
``record`` writes ``manifest.json``. The configure and restore phases have modules of their own
(:mod:`.configure_phase`, :mod:`.restore_phase`), and what the phases share is :mod:`.run_state`.

A phase that fails ends the run: what exists is still collected, everything is restored (nothing
kept), and the manifest says which phase failed, why and on which node. Restore runs whatever collect
does: collect is waited for at most :func:`collect_limit_s`, and a collect that fails or stalls fails
the run (naming the node) without holding restore back. Every process the run starts on a node is
named in ``processes.json`` before it starts, so a later ``--resume`` can end it after a crash.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from foundation.errors import NodeError, TestbedError
from foundation.jsonable import jsonable
from nodes.contracts.durable import write_json_atomic
from nodes.contracts.methods import method_named
from nodes.contracts.paced_steps import ENDPOINT_OPS
from nodes.contracts.rank_dirs import device_glob
from testbed.campaign import manifest as manifest_mod
from testbed.campaign.carryover import Carryover
from testbed.campaign.configure_phase import configure
from testbed.campaign.plan import RunPlan, plan_run
from testbed.campaign.restore_phase import restore_run
from testbed.campaign.results import write_results
from testbed.campaign.run_state import (
    EventLog,
    RunOutcome,
    RunState,
    note_processes,
    plan_of,
    require,
    side_by_side,
)
from testbed.campaign.spec import Campaign, PlannedRun, run_nodes
from testbed.inventory import Inventory
from testbed.provisioning.provision import compare_records, load_record
from testbed.transport import open_transport
from testbed.transport.fanout import fan_out
from testbed.workers.pool import PoolKeeper, WorkerPool
from testbed.workers.split_run import served_count_script
from workloads.schedule import write_schedule

PHASES = ("preflight", "configure", "telemetry", "stage", "services", "workers", "drain", "collect", "restore",
          "record")
Report = Callable[[str, dict[str, Any]], None]  # (event, details) for the progress display
COLLECT_LIMIT_S = 300.0  # collect's steps but the telemetry transfers (see collect_limit_s)


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
    state = RunState()
    lab, settings = campaign.inventory, run.settings
    started_unix = time.time()
    events.write("run_start", attempt=attempt, label=run.label())
    Step = tuple[str, Callable[[], None]]
    steps: list[list[Step]] = [  # the phases of one entry run side by side
        [("preflight", lambda: _preflight(campaign, run, attempt, directory, state, carry))],
        [("configure", lambda: configure(campaign, settings, state, events)),
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
            side_by_side([lambda p=phase, s=step: _phase(p, s, state, events, report) for phase, step in together])
        _phase("collect", lambda: _within(collect_limit_s(campaign), "collect",
                                          lambda: _collect(campaign, run, directory, state, carry)),
               state, events, report)  # fmt: skip
    except BaseException as exc:  # Ctrl-C, SIGTERM: the run failed, so nothing is kept for a next run
        state.fail("interrupted", f"the controller was interrupted ({type(exc).__name__})", None)
        raise
    finally:
        kept = keep if state.failure is None else (frozenset(), frozenset())
        _phase("restore", lambda: restore_run(lab, state, kept), state, events, report)
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


def _phase(name: str, step: Callable[[], None], state: RunState, events: EventLog, report: Report) -> None:
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
    campaign: Campaign, run: PlannedRun, attempt: int, directory: Path, state: RunState, carry: Carryover
) -> None:
    """Reach the nodes, check their provisioning agrees, make the run plan with the nodes read back
    (``plan.json``), and write the device schedules it carries."""
    lab, settings = campaign.inventory, run.settings
    names = [n.name for n in run_nodes(lab, settings)]

    def reach(name: str) -> None:
        with open_transport(lab, lab.node(name)) as t:
            t.run(["true"], timeout_s=30.0).check()

    require(fan_out(names, reach, description="reaching the run's nodes"), "reaching the node")
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


def _start_telemetry(campaign: Campaign, directory: Path, state: RunState, carry: Carryover) -> None:
    plan = plan_of(state)
    if plan.telemetry is None:
        return
    from testbed.energy.telemetry import start_recording

    tel = plan.telemetry
    proven = carry.proven_probes(tel.jetson_source)
    recording = start_recording(
        campaign.inventory, [s.node for s in tel.samplers], interval_s=tel.interval_s, max_seconds=tel.max_seconds,
        jetson_source=tel.jetson_source, session=tel.session, contexts=plan.contexts, proven=proven,
        before_start=lambda r: note_processes(directory, [{"node": r.node, "host": r.host, "pidfile": r.pidfile}]),
    )  # fmt: skip
    state.telemetry["probes_borne_out_by"] = {n.node: carry.proven_by(n.node) for n in recording.nodes
                                              if n.node in proven}  # fmt: skip
    state.recording = recording


def _stage(directory: Path, state: RunState, pools: PoolKeeper) -> None:
    """The run's files on its nodes, and the pool of its shape up (started now, cold, if none is)."""
    plan = plan_of(state)
    if plan.mpiexec is None:
        raise NodeError(plan.split.server, "no mpiexec beside its Python or on PATH (pip install mpich mpi4py)")

    def started(pool: WorkerPool, warm: bool) -> None:
        state.workers = {"pool": pool.pool_id, "start": "warm" if warm else "cold", "runs_before": pool.served}
        note_processes(directory, [{"node": pool.server, "host": pool.server, "pidfile": pool.files.pidfile}])

    state.prepared = pools.prepare(plan.split, plan.contexts, plan.launch, on_started=started)


def _start_services(campaign: Campaign, directory: Path, state: RunState) -> None:
    """The devices' LLM service daemons (a context-serving method): named in processes.json, started
    detached, and waited for until each answers on its socket."""
    plan = plan_of(state)
    if not plan.services:
        return
    from testbed.workers.context_service import start_services

    note_processes(directory, [{"node": p.node, "host": p.node, "pidfile": p.files.pidfile} for p in plan.services])
    state.services = plan.services  # before they start: restore stops whatever did
    require(start_services(campaign.inventory, plan.services, plan.contexts), "starting the LLM service")


def _workers(campaign: Campaign, directory: Path, state: RunState, report: Report, pools: PoolKeeper) -> None:
    lab, plan = campaign.inventory, plan_of(state)
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


def _collect(campaign: Campaign, run: PlannedRun, directory: Path, state: RunState, carry: Carryover) -> None:
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
        from testbed.energy.telemetry import finish_recording

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


def _fidelity(directory: Path, state: RunState) -> None:
    """Per node, the share of paced steps that overran the target's time (by computing too long or
    by waking late); a node above the limit flags the run (its reason says so in the ledger)."""
    if not (directory / "steps.parquet").is_file():
        return
    import pandas as pd

    from analysis.fidelity import VIOLATION_LIMIT, violation_shares

    steps = pd.read_parquet(directory / "steps.parquet")
    shares = violation_shares(steps)
    state.fidelity = {
        row.node: {"steps": int(row.steps), "overruns": int(row.overruns), "computed_over": int(row.computed_over),
                   "woke_late": int(row.woke_late), "violation_share": round(float(row.violation_share), 4),
                   "flagged": bool(row.flagged)}
        for row in shares.itertuples()
    }  # fmt: skip
    flagged = {n: f["violation_share"] for n, f in state.fidelity.items() if f["flagged"]}
    if flagged:
        worst = max(flagged, key=lambda n: flagged[n])
        # a DiSCo endpoint's tokens keep a trace's or a phone's pace, which no dilation stretches
        endpoint = set(steps.loc[steps["node"] == worst, "op"]) <= set(ENDPOINT_OPS)
        remedy = "fewer devices or streams at once" if endpoint else "raise target.dilation"
        state.flag = (f"fidelity: {flagged[worst]:.1%} of {worst}'s paced steps overran their target (limit "
                      f"{VIOLATION_LIMIT:.0%}); {remedy}")  # fmt: skip


def _delay_fidelity(campaign: Campaign, state: RunState) -> None:
    """The NFQUEUE delay handlers' record of the run (how late their releases were) into the manifest;
    a handler that stopped flags the run: its directions went undelayed (--queue-bypass)."""
    from testbed.links.handler_lifecycle import read_delay_handlers
    from testbed.links.node_journal import journal_dir

    held = {r["node"] for r in state.links.get("delay_rules", ()) if r["queues"]}
    if not held or "shaped_unix_s" not in state.links:
        return
    plan = plan_of(state)
    lab = campaign.inventory
    directories = {name: plan.contexts[name].path(journal_dir(lab.settings_of(name).workdir)) for name in sorted(held)}
    read = read_delay_handlers(campaign.inventory, directories, state.links["shaped_unix_s"])
    state.links["delay_handlers"] = {o.node: jsonable(o.value) if o.value else {"error": o.error}
                                     for o in read.outcomes}  # fmt: skip
    stopped = [o.node for o in read.outcomes if o.value is not None and not o.value.alive]
    if stopped:
        state.flag = (f"fidelity: the NFQUEUE delay handler on {', '.join(stopped)} was not running at the end of "
                      "the run: what it delays may have passed undelayed; see the node's delay-handler.log")




def _count_served(lab: Inventory, plan: RunPlan) -> int:
    """Requests the devices have finished so far (lines in their requests.jsonl on the nodes)."""

    def count(name: str) -> int:
        script = served_count_script(plan.contexts[name], plan.split.run_id, name)
        with open_transport(lab, lab.node(name)) as t:
            out = t.run_script(script, timeout_s=20.0).stdout
        return int(out.strip() or 0)

    return sum(v for v in fan_out(list(plan.devices), count).values().values() if isinstance(v, int))


def _count_rows(ranks: Path) -> int:
    total = 0
    for path in ranks.glob(device_glob() + "/requests.jsonl"):
        total += sum(1 for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return total
