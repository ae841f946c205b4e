"""Telemetry of the inventory's nodes: probe the sensors, record with detached samplers on the
nodes, pull their files and turn them into ``telemetry/<node>.parquet`` on aligned time.

Each node's sampler (``python -m nodes.telemetry.sampler``) runs in its own session on the node
(on a phone's USB host for a phone), appends rows to a file and flushes them as it samples, so a
dropped SSH connection or a killed controller loses nothing: the file is pulled when the recording
ends, and a sampler left behind stops by itself after its time limit. A caller that keeps a journal
of what it starts (a campaign's ``processes.json``) is told each sampler's pidfile before the sampler
starts (``before_start``), so that a controller killed in between leaves nothing it cannot stop.

Clocks: each row keeps the node's own timestamp (``node_ts_s``); ``ts_s`` is that time on the
controller's clock, corrected by the node's offset measured at the start and the end of the
recording and interpolated linearly between them (so drift is corrected too).

One concept, a recording (probe, start, stop, collect, align), over ~450 lines.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from foundation.clock_alignment import ClockAlignment
from foundation.errors import NodeError
from nodes.contracts.tool_answers import SensorStatus
from testbed.commands.node_context import (
    NodeContext,
    ensure_node_code,
    require_current_code,
    resolve_context,
    transport_for,
)
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.inventory.schema import MeterSpec
from testbed.provisioning.node_code import node_code
from testbed.transport.base import background_stop_script, command_line
from testbed.transport.clock import ClockOffset, echo_script, measure_clock_offset
from testbed.transport.fanout import FanOutResult, fan_out

Say = Callable[[str], None]
STOP_MARGIN_S = 120.0  # a sampler outlives its recording by at most this, then stops itself
COLUMNS = ["ts_s", "node_ts_s", "node", "metric", "value", "unit", "sensor", "kind", "period_s"]


@dataclass(frozen=True)
class SamplerPlan:
    """Where a node's sampler runs and what it reads."""

    node: str
    host: str  # the node itself, or a phone's USB host ("controller" for the controller)
    sources: tuple[str, ...]
    serial: str | None = None
    meter: MeterSpec | None = None  # the node's supply meter, read instead of its own sensors

    def argv(self, python: str) -> list[str]:
        words = [python, "-m", "nodes.telemetry.sampler"]
        for source in self.sources:
            words += ["--source", source]
        if self.serial:
            words += ["--serial", self.serial]
        if self.meter is not None:
            words += ["--meter-channel", self.meter.channel, "--meter-vout-v", f"{self.meter.vout_v:g}"]
        return [*words, "--node", self.node]


def sampler_plan(node: NodeSpec, jetson_source: str = "tegrastats") -> SamplerPlan:
    """The node kind's sources (:mod:`testbed.inventory.node_kinds`), or its supply meter where it has one
    (then the meter is what measures it); a phone's are sampled on its USB host, with its serial."""
    kind = kind_of(node)
    serial = node.adb.serial if kind.via_usb_host and node.adb is not None else None
    sources = (node.meter.kind,) if node.meter is not None else kind.telemetry(node, jetson_source)
    if kind.via_usb_host:
        assert node.adb is not None
        return SamplerPlan(node.name, node.adb.usb_host, sources, serial, node.meter)
    return SamplerPlan(node.name, node.name, sources, meter=node.meter)


# -- probe ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    node: str
    source: str
    sensors: tuple[SensorStatus, ...]
    header: dict[str, Any]

    @property
    def energy_sensors(self) -> tuple[SensorStatus, ...]:
        return tuple(s for s in self.sensors if s.energy and s.ok)

    @property
    def problems(self) -> tuple[SensorStatus, ...]:
        return tuple(s for s in self.sensors if not s.ok)


def sampler_command(plan: SamplerPlan, context: NodeContext) -> list[str]:
    """The sampler's command line on the node (with the node code bundle on PYTHONPATH where it needs one)."""
    return context.command(plan.argv(context.base_python))


def sampler_paths(context: NodeContext, session: str) -> tuple[str, str, str]:
    """(data file, pidfile, logfile) of ``context``'s sampler in recording ``session``."""
    base = context.under_workdir("telemetry", session, context.node)
    return base + ".csv", base + ".pid", base + ".log"


def sampler_start_command(
    plan: SamplerPlan, context: NodeContext, session: str, *, interval_s: float, max_seconds: float
) -> list[str]:
    """The detached sampler's command line for a recording (its files under ``telemetry/<session>/``)."""
    datafile = sampler_paths(context, session)[0]
    meter_log = ["--meter-log", meter_log_path(datafile)] if plan.meter is not None else []
    return [*sampler_command(plan, context), "--interval-ms", str(round(interval_s * 1000)), "--out", datafile,
            "--max-seconds", f"{max_seconds + STOP_MARGIN_S:g}", *meter_log]  # fmt: skip


def meter_log_path(datafile: str) -> str:
    """Where a node's meter writes its own file, beside the sampler's rows (collected with them)."""
    return datafile.removesuffix(".csv") + ".meter.csv"


def probe_node(
    inventory: Inventory, node: NodeSpec, jetson_source: str = "tegrastats", *, context: NodeContext | None = None
) -> ProbeResult:
    plan = sampler_plan(node, jetson_source)
    with transport_for(inventory, node) as t:
        context = context or resolve_context(inventory, node, t)
        ensure_node_code(t, context)
        result = t.run([*sampler_command(plan, context), "--probe"], timeout_s=60.0)
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        detail = (result.stderr.strip() or result.stdout.strip())[-400:]
        raise NodeError(node.name, f"telemetry probe failed (exit status {result.exit_code}): {detail}") from None
    if "error" in answer:
        raise NodeError(node.name, f"telemetry source {'+'.join(plan.sources)} cannot start: {answer['error']}")
    sensors = tuple(SensorStatus(**s) for s in answer["sensors"])
    return ProbeResult(node.name, str(answer["source"]), sensors, dict(answer.get("header") or {}))


def probe_telemetry(
    inventory: Inventory,
    nodes: list[str] | None = None,
    *,
    require_energy: bool = False,
    jetson_source: str = "tegrastats",
    contexts: Mapping[str, NodeContext] | None = None,
) -> FanOutResult[ProbeResult]:
    """Probe every selected node's sensors. With ``require_energy``, a node without a working power
    or energy sensor becomes that node's error, naming the sensors and why they gave nothing."""
    selected = {n.name: n for n in inventory.select(nodes)}
    require_current_code(inventory, list(selected))

    def probe(name: str) -> ProbeResult:
        found = probe_node(inventory, selected[name], jetson_source, context=(contexts or {}).get(name))
        if require_energy and not found.energy_sensors:
            missing = [f"{s.sensor} {s.metric}: {s.problem or 'no reading'}" for s in found.sensors if s.energy]
            raise NodeError(
                name,
                f"no working energy sensor in source {found.source}"
                + (" (" + "; ".join(missing) + ")" if missing else " (it has no power or energy sensor at all)"),
            )
        return found

    return fan_out(list(selected), probe, description="probing telemetry")


# -- record --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRecording:
    node: str
    host: str
    pidfile: str
    datafile: str
    logfile: str


@dataclass(frozen=True)
class Recording:
    """Samplers running on the nodes, started by :func:`start_recording`."""

    session: str
    interval_s: float
    started_unix_s: float
    nodes: tuple[NodeRecording, ...]
    clock_start: dict[str, tuple[float, ClockOffset]]  # node -> (controller time, offset)
    probes: dict[str, ProbeResult]
    node_code: str


def _clock(inventory: Inventory, node: NodeSpec) -> tuple[float, ClockOffset]:
    with transport_for(inventory, node) as t:
        offset = measure_clock_offset(t, python=inventory.settings_of(node).python)
        return time.time(), offset


def _all_or_raise(result: FanOutResult[Any], what: str) -> dict[str, Any]:
    if not result.ok:
        raise NodeError(result.failed[0].node,
                        f"{what} failed on " + "; ".join(f"{o.node}: {o.error}" for o in result.failed))  # fmt: skip
    return {o.node: o.value for o in result.outcomes}


def start_recording(
    inventory: Inventory,
    nodes: list[str] | None,
    *,
    interval_s: float = 0.1,
    max_seconds: float,
    require_energy: bool = False,
    jetson_source: str = "tegrastats",
    session: str | None = None,
    say: Say = lambda _: None,
    contexts: Mapping[str, NodeContext] | None = None,
    proven: Mapping[str, ProbeResult] | None = None,
    before_start: Callable[[NodeRecording], None] | None = None,
) -> Recording:
    """Probe, measure clock offsets, and start a detached sampler for every selected node. The
    samplers' files go under ``<workdir>/telemetry/<session>/`` (default: a new timestamped name).
    ``proven``: probes that a sampler of the same kind has just borne out on those nodes (it delivered
    samples without a long gap: ``testbed.campaign.carryover``), taken as they are instead of probing again.
    ``before_start``: called with each sampler's files before it starts (to journal it durably)."""
    selected = {n.name: n for n in inventory.select(nodes)}
    known = {name: probe for name, probe in (proven or {}).items() if name in selected}
    to_probe = [name for name in selected if name not in known]
    say(f"probing telemetry on {len(to_probe)} nodes")
    probes = dict(known)
    if to_probe:
        probed = probe_telemetry(
            inventory, to_probe, require_energy=require_energy, jetson_source=jetson_source, contexts=contexts
        )
        probes.update(_all_or_raise(probed, "probe"))
    probes = {name: probes[name] for name in selected}
    for probe in probes.values():
        for s in probe.problems:
            say(f"  {probe.node}: {s.sensor} {s.metric}: {s.problem or 'no reading'}")
    clock_start = _all_or_raise(fan_out(list(selected), lambda n: _clock(inventory, selected[n])), "clock offset")
    session = session or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]

    def start(name: str) -> NodeRecording:
        node = selected[name]
        plan = sampler_plan(node, jetson_source)
        with transport_for(inventory, node) as t:
            context = (contexts or {}).get(name) or resolve_context(inventory, node, t)
            ensure_node_code(t, context)
            argv = sampler_start_command(plan, context, session, interval_s=interval_s, max_seconds=max_seconds)
            datafile, pidfile, logfile = sampler_paths(context, session)
            recording = NodeRecording(name, plan.host, pidfile, datafile, logfile)
            if before_start is not None:
                before_start(recording)
            t.start_background(argv, pidfile=pidfile, logfile=logfile)
            return recording

    started = fan_out(list(selected), start, description="starting samplers")
    if not started.ok:
        for o in started.outcomes:
            if o.ok and o.value is not None:
                stop_sampler(inventory, selected[o.node], o.value)
        _all_or_raise(started, "starting samplers")
    say(f"recording telemetry (session {session})")
    return Recording(
        session, interval_s, time.time(), tuple(started.values().values()), clock_start, probes, node_code().digest
    )


def stop_sampler(inventory: Inventory, node: NodeSpec, rec: NodeRecording) -> str:
    with transport_for(inventory, node) as t:
        return t.stop_background(rec.pidfile)


@dataclass(frozen=True)
class NodeTelemetry:
    node: str
    rows: int
    path: Path
    stopped: str  # how the sampler ended: stopped, killed, absent (it had ended by itself)
    max_gap_s: float | None  # the longest gap between consecutive samples
    clock_start: ClockOffset
    clock_end: ClockOffset
    drift_ppm: float
    clock_start_unix_s: float = 0.0  # the controller's time of each offset measurement
    clock_end_unix_s: float = 0.0


@dataclass(frozen=True)
class RecordResult:
    directory: Path
    session: str
    nodes: tuple[NodeTelemetry, ...]
    errors: dict[str, str]

    @property
    def ok(self) -> bool:
        return not self.errors


def read_sampler_file(path: Path) -> pd.DataFrame:
    """A sampler's CSV file (comment lines and a torn last line skipped)."""
    frame = pd.read_csv(path, comment="#", on_bad_lines="skip", dtype={"sensor": str, "unit": str})
    frame = frame.dropna(subset=["ts_s", "metric", "value"])
    frame["unit"] = frame["unit"].fillna("")
    return frame


def align(frame: pd.DataFrame, start: tuple[float, ClockOffset], end: tuple[float, ClockOffset]) -> pd.DataFrame:
    """Add ``ts_s`` on the controller's clock: node time minus the offset, interpolated between the
    offsets measured at the start and the end (a constant offset when both are at one instant)."""
    out = frame.rename(columns={"ts_s": "node_ts_s"})
    out["ts_s"] = alignment_of(start, end).to_controller(frame["ts_s"].astype(float))
    return out


def alignment_of(start: tuple[float, ClockOffset], end: tuple[float, ClockOffset]) -> ClockAlignment:
    (c0, o0), (c1, o1) = start, end
    return ClockAlignment(c0, o0.offset_s, c1, o1.offset_s)


def max_gap_s(frame: pd.DataFrame) -> float | None:
    stamps = sorted(set(frame["node_ts_s"] if "node_ts_s" in frame else frame["ts_s"]))
    if len(stamps) < 2:
        return None
    return max(b - a for a, b in itertools.pairwise(stamps))


def finish_recording(
    inventory: Inventory, recording: Recording, out_dir: Path, *, say: Say = lambda _: None
) -> RecordResult:
    """Measure clock offsets again, stop the samplers, pull their files and write
    ``out_dir/<node>.parquet`` (plus the raw CSVs under ``raw/`` and ``recording.json``)."""
    by_name = {n.node: n for n in recording.nodes}
    specs = {name: inventory.node(name) for name in by_name}
    clock_end = fan_out(list(by_name), lambda n: _clock(inventory, specs[n]), description="clock offsets")
    stopped = fan_out(
        list(by_name), lambda n: stop_sampler(inventory, specs[n], by_name[n]), description="stopping samplers"
    )
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def pull(name: str) -> Path:
        local = raw / f"{name}.csv"
        with transport_for(inventory, specs[name]) as t:
            t.get(by_name[name].datafile, local)
            if specs[name].meter is not None:  # the meter's own file, in its own format
                t.get(meter_log_path(by_name[name].datafile), raw / f"{name}.{specs[name].meter.kind}.csv")
        return local

    pulled = fan_out(list(by_name), pull, description="collecting telemetry")
    errors = {o.node: o.error or "" for o in (*clock_end.failed, *stopped.failed, *pulled.failed)}
    ends = clock_end.values()
    results = []
    for name, local in pulled.values().items():
        start = recording.clock_start[name]
        end = ends.get(name, start)
        frame = align(read_sampler_file(local), start, end)
        frame["node"] = name
        frame = frame[COLUMNS].sort_values(["ts_s", "metric", "sensor"], kind="stable")
        path = out_dir / f"{name}.parquet"
        frame.to_parquet(path, index=False)
        drift = alignment_of(start, end).drift_ppm
        results.append(
            NodeTelemetry(
                name,
                len(frame),
                path,
                stopped.values().get(name, "?"),
                max_gap_s(frame),
                start[1],
                end[1],
                drift,
                start[0],
                end[0],
            )
        )
        say(f"  {name}: {len(frame)} rows -> {path}")
    document = {
        "session": recording.session,
        "interval_s": recording.interval_s,
        "started_unix_s": recording.started_unix_s,
        "node_code": recording.node_code,
        "nodes": {
            t.node: {
                "rows": t.rows,
                "sampler": t.stopped,
                "max_gap_s": t.max_gap_s,
                "clock_start": asdict(t.clock_start),
                "clock_end": asdict(t.clock_end),
                "drift_ppm": t.drift_ppm,
                "source": recording.probes[t.node].source,
                "source_header": recording.probes[t.node].header,
            }
            for t in results
        },
        "errors": errors,
    }
    (out_dir / "recording.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    return RecordResult(out_dir, recording.session, tuple(results), errors)


def record_telemetry(
    inventory: Inventory,
    nodes: list[str] | None,
    seconds: float,
    out_dir: Path,
    *,
    interval_s: float = 0.1,
    require_energy: bool = False,
    jetson_source: str = "tegrastats",
    during: Callable[[], None] | None = None,
    say: Say = lambda _: None,
) -> RecordResult:
    """Record ``seconds`` of telemetry (``during`` runs meanwhile, e.g. a workload), then collect."""
    recording = start_recording(
        inventory,
        nodes,
        interval_s=interval_s,
        max_seconds=seconds,
        require_energy=require_energy,
        jetson_source=jetson_source,
        say=say,
    )
    deadline = time.monotonic() + seconds
    try:
        if during is not None:
            during()
        time.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        result = finish_recording(inventory, recording, out_dir, say=say)
    return result


# -- import --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TelemetryStep:
    """A run's recording: one detached sampler per node, stopped when the run is collected."""

    session: str
    interval_s: float
    max_seconds: float
    jetson_source: str
    samplers: tuple[SamplerPlan, ...]


def _echo(lines: PlanLines, node: str) -> str:
    return sh(echo_script(lines.lab.settings_of(node).python))


def plan_recording_start(lines: PlanLines, step: TelemetryStep, contexts: Mapping[str, NodeContext]) -> None:
    """The telemetry phase's lines of :func:`start_recording`: probe, clock offset, detached sampler."""
    for sampler in step.samplers:
        context = contexts[sampler.node]
        lines.node_code(sampler.node, "telemetry", context)
        lines.add(sampler.node, "telemetry", "probe the sensors (unless the last run's sampler bore them out)",
                  command_line([*sampler_command(sampler, context), "--probe"]), "live")  # fmt: skip
    for sampler in step.samplers:
        lines.add(sampler.node, "telemetry", "measure the clock offset", _echo(lines, sampler.node))
    for sampler in step.samplers:
        context = contexts[sampler.node]
        argv = sampler_start_command(sampler, context, step.session, interval_s=step.interval_s,
                                     max_seconds=step.max_seconds)  # fmt: skip
        _datafile, pidfile, logfile = sampler_paths(context, step.session)
        lines.node_code(sampler.node, "telemetry", context)
        lines.detached(sampler.node, "telemetry", "start the sampler (detached)", argv, pidfile, logfile)


def plan_recording_stop(lines: PlanLines, step: TelemetryStep, contexts: Mapping[str, NodeContext]) -> None:
    """The collect phase's lines of :func:`finish_recording`: the clock offset again, the samplers stopped."""
    for sampler in step.samplers:
        lines.add(sampler.node, "collect", "measure the clock offset again", _echo(lines, sampler.node))
    for sampler in step.samplers:
        pidfile = sampler_paths(contexts[sampler.node], step.session)[1]
        lines.add(sampler.node, "collect", "stop the sampler", sh(background_stop_script(pidfile, 5.0)))
