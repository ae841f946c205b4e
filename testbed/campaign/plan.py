"""The run plan: everything one run of a campaign will do on every node, decided before anything is
touched. ``testbed run --dry-run`` prints it; the run executes it (its phases take their power
modes, tc plans, sampler command lines, node contexts and MPI launch from it) and writes it to
``plan.json`` in the run's directory.

A plan is made from the campaign alone, or, when the nodes can be reached (``live=True``), also
from what they report: their home directories (so every path is written out), tc state (the apply
reconciles against it: classes it no longer plans are removed), an earlier link journal, and the
``mpiexec`` beside the launch node's Python. What could not be read is marked as depending on live
state. Reading is all a plan does on a node.

``commands`` lists every shell line the run sends, in phase order, each tagged with when it is sent:
``once``; ``per-campaign`` (the nodes' facts, gathered when a campaign starts); ``if-missing`` (the
node code bundle, stored only when the node lacks it); ``polled`` (repeated while waiting);
``on-failure`` (rolling back, ending a launch that timed out); ``live`` (decided from what the node
reports at that moment). A stored file's line carries its byte count, shown as ``<N>`` (contents such
as a journal's timestamp are only known when written).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from foundation.errors import TestbedError
from netem.plan import TcPlan
from netem.trace import BandwidthTrace
from testbed.campaign.spec import Campaign, PlannedRun, RunSettings, device_names, run_nodes, workload_spec
from testbed.inventory import DirectedLink, Inventory, NodeSpec, links_from_file
from testbed.links import node_journal
from testbed.links.apply import commands_for, plan_devices, probe_nodes, probe_script, shapeable_nodes
from testbed.node_context import (
    HOME_SCRIPT,
    NodeContext,
    resolve_context,
    transport_for,
    unresolved_context,
)
from testbed.power import driver_command, set_action
from testbed.split_run import (
    MpiLaunchPlan,
    SplitRunSpec,
    find_mpiexec,
    launch_argv,
    launch_env,
    launch_files,
    launch_plan,
    launch_wait_script,
    mpiexec_pidfile,
    rank_listing_script,
    run_dir_on,
)
from testbed.telemetry import SamplerPlan, sampler_command, sampler_paths, sampler_plan, sampler_start_command
from testbed.transport.base import background_start_script, background_stop_script, command_line, prefix_words
from testbed.transport.clock import echo_script
from testbed.transport.facts import facts_script
from testbed.transport.fanout import fan_out

TELEMETRY_MARGIN_S = 60.0  # samplers stop themselves this long after the run's timeout at the latest
WHEN = ("once", "per-campaign", "if-missing", "polled", "on-failure", "live")
STORED_SIZE = re.compile(r"(-eq |of )\d+( bytes)?")


def node_run_id(run: PlannedRun, attempt: int) -> str:
    """The run's directory name on the nodes: one per attempt, so attempts never share files."""
    return f"{run.run_id}-a{attempt}"


def run_trace(campaign: Campaign, settings: RunSettings) -> BandwidthTrace:
    """The run's bandwidth trace, its rates multiplied by ``link.rate_scale``."""
    from netem.trace import load_trace, scale_trace

    return scale_trace(load_trace(campaign.resolve(settings.link.trace)), settings.link.rate_scale)


def run_links(campaign: Campaign, settings: RunSettings) -> tuple[DirectedLink, ...]:
    """The directed links a run shapes: a trace's first row on every device's links, a links file,
    one profile on every link of the inventory, or the inventory's own links; every rate multiplied
    by ``link.rate_scale`` (the traced links come scaled with the trace)."""
    from testbed.links.plans import traced_links

    lab, link = campaign.inventory, settings.link
    driven: dict = {}
    if link.trace:
        links, driven = traced_links(lab, {d: run_trace(campaign, settings) for d in device_names(lab, settings)})
    elif link.links:
        links = links_from_file(lab, campaign.resolve(link.links))
    elif link.profile:
        profile = lab.spec.link_profiles[link.profile]
        links = tuple(dataclasses.replace(lk, profile_name=link.profile, profile=profile) for lk in lab.links)
    else:
        links = lab.links
    if link.rate_scale == 1.0:
        return links
    scale = link.rate_scale
    return tuple(
        dataclasses.replace(lk, profile=lk.profile.model_copy(update={"rate_bit_s": lk.profile.rate_bit_s * scale}))
        if lk.profile.rate_bit_s and (lk.source, lk.destination) not in driven else lk
        for lk in links
    )  # fmt: skip


def draft_config(campaign: Campaign, settings: RunSettings) -> dict[str, Any]:
    """The run config's ``draft`` mapping, the adapter's path resolved against the campaign file (by
    default the checkpoint's ``draft/``, where the model is, also when devices run a placed part)."""
    draft = settings.draft.model_dump()
    draft["adapter"] = str(campaign.resolve(draft["adapter"] or f"{settings.model}/draft"))
    return draft


@dataclass(frozen=True)
class PlannedCommand:
    """One shell line the run sends to a node, exactly as the transport runs it."""

    node: str  # the inventory node it concerns
    host: str  # the node whose transport runs it (a phone's USB host)
    phase: str
    what: str
    line: str
    when: str = "once"
    short: str = ""  # the same for a reader: what a detached process runs, which file is stored

    @property
    def shown(self) -> str:
        return self.short or self.line.removeprefix("exec ")


@dataclass(frozen=True)
class PowerStep:
    node: str
    mode: str


@dataclass(frozen=True)
class TelemetryStep:
    session: str
    interval_s: float
    max_seconds: float
    jetson_source: str
    samplers: tuple[SamplerPlan, ...]


@dataclass(frozen=True)
class RunPlan:
    run_id: str
    attempt: int
    node_run_id: str
    nodes: tuple[str, ...]
    devices: tuple[str, ...]
    contexts: dict[str, NodeContext]
    live: bool  # the nodes were read when planning
    unresolved: tuple[str, ...]  # what could not be read, and why
    power: tuple[PowerStep, ...]
    links: tuple[DirectedLink, ...]
    tc_plans: tuple[TcPlan, ...]
    trace: BandwidthTrace | None
    telemetry: TelemetryStep | None
    split: SplitRunSpec
    mpiexec: str
    launch: MpiLaunchPlan
    commands: tuple[PlannedCommand, ...] = field(default=())

    def by_node(self) -> dict[str, list[PlannedCommand]]:
        out: dict[str, list[PlannedCommand]] = {}
        for c in self.commands:
            out.setdefault(c.node, []).append(c)
        return out

    def actions(self) -> dict[str, list[str]]:
        """Per node, what the run changes or starts there, in order (the lines that matter to a
        reader: power driver, tc, samplers, the MPI launch, and the restore), without the reads."""
        keep = ("set the power mode", "shape the links", "start the sampler (detached)",
                "start the trace player (detached)", "undo the shaping (only what the journal says is ours)",
                "restore the power mode from the node's journal")  # fmt: skip
        out: dict[str, list[str]] = {name: [] for name in self.nodes}
        for c in self.commands:
            if c.what == "launch the ranks with mpiexec (detached)":
                out.setdefault(c.node, []).append(self.launch.apply_commands()[0])
            elif c.what in keep:
                out.setdefault(c.node, []).append(c.line)
        return out

    def render(self) -> str:
        """The plan as a person reads it: per node, phase by phase, each line with when it is sent."""
        lines = [f"run {self.run_id} attempt {self.attempt} (on the nodes: runs/{self.node_run_id})",
                 "  nodes read back: " + ("yes" if self.live else "no")]  # fmt: skip
        lines += [f"  depends on live state: {u}" for u in self.unresolved]
        for node, commands in self.by_node().items():
            lines.append(f"  {node}")
            phase = None
            for c in commands:
                if c.phase != phase:
                    phase = c.phase
                    lines.append(f"    [{phase}]")
                via = f" (on {c.host})" if c.host != c.node else ""
                tag = "" if c.when == "once" else f" [{c.when}]"
                lines.append(f"      # {c.what}{via}{tag}")
                lines.append("      " + c.shown.replace("\n", "\n        "))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "attempt": self.attempt, "node_run_id": self.node_run_id,
            "nodes": list(self.nodes), "live": self.live, "unresolved": list(self.unresolved),
            "contexts": {n: dataclasses.asdict(c) for n, c in self.contexts.items()},
            "power": [dataclasses.asdict(p) for p in self.power],
            "mpiexec": self.mpiexec, "launch": self.launch.apply_commands()[0],
            "commands": [dataclasses.asdict(c) for c in self.commands],
        }  # fmt: skip


def normalised_line(line: str) -> str:
    """A command line with stored files' byte counts replaced by ``<N>`` (for comparing runs with plans)."""
    return STORED_SIZE.sub(lambda m: m.group(1) + "<N>" + (m.group(2) or ""), line)


# --------------------------------------------------------------------------------------------
# Making the plan


def plan_run(campaign: Campaign, run: PlannedRun, attempt: int, *, live: bool) -> RunPlan:
    """The plan of ``run``'s attempt. With ``live``, the nodes are read (never changed) to resolve
    paths, the launch node's ``mpiexec`` and the tc commands that depend on what is there now; a
    node that cannot be read leaves its part marked as depending on live state."""
    lab, settings = campaign.inventory, run.settings
    names = tuple(n.name for n in run_nodes(lab, settings))
    devices = device_names(lab, settings)
    unresolved: list[str] = []
    power = tuple(
        PowerStep(node.name, mode) for target, mode in settings.power.items() for node in lab.select([target])
    )
    links: tuple[DirectedLink, ...] = ()
    tc_plans: tuple[TcPlan, ...] = ()
    trace = run_trace(campaign, settings) if settings.link.shaped and settings.link.trace else None
    if settings.link.shaped:
        from testbed.links.plans import compile_plan

        links = run_links(campaign, settings)
        try:
            tc_plans = compile_plan(lab, links)
        except TestbedError as exc:  # e.g. an emulated testbed that is not up has no data interfaces yet
            unresolved.append(f"link shaping cannot be planned now: {exc}")
    touched = tuple(dict.fromkeys([*names, *(p.node for p in tc_plans)]))  # shaping reaches beyond the run's nodes
    contexts = {name: unresolved_context(lab, lab.node(name)) for name in touched}
    if live:
        read = fan_out(list(touched), lambda name: resolve_context(lab, lab.node(name)), description="reading nodes")
        contexts.update(read.values())
        unresolved += [f"{o.node}: not reachable when planning ({o.error})" for o in read.failed]
    else:
        unresolved.append("the nodes were not read: paths keep '~', tc commands assume no earlier shaping")
    telemetry = None
    if settings.telemetry.enabled:
        telemetry = TelemetryStep(
            node_run_id(run, attempt), settings.telemetry.interval_ms / 1000.0,
            campaign.spec.run_timeout_s + settings.drain_s + TELEMETRY_MARGIN_S, settings.telemetry.jetson_source,
            tuple(sampler_plan(lab.node(name), settings.telemetry.jetson_source) for name in names),
        )  # fmt: skip
    split = split_spec(campaign, run, attempt)
    mpiexec = "mpiexec"
    server_context = contexts[settings.server]
    if live and server_context.resolved:
        try:
            with transport_for(lab, lab.node(settings.server)) as t:
                mpiexec = find_mpiexec(t, server_context.python)
        except Exception as exc:  # reported, and the run finds it again when it launches
            unresolved.append(f"{settings.server}: mpiexec not found when planning ({exc})")
    else:
        unresolved.append(f"{settings.server}: mpiexec is looked up beside {server_context.python} at launch")
    try:
        launch = launch_plan(lab, split, contexts, mpiexec)
    except TestbedError as exc:  # an emulated testbed that is not up has no data interfaces or addresses yet
        unresolved.append(f"the MPI launch's hosts and data-plane environment: {exc}")
        launch = _launch_without_data_plane(lab, split, contexts, mpiexec)
    plan = RunPlan(
        run.run_id, attempt, node_run_id(run, attempt), names, devices, contexts, live, (), power, links,
        tc_plans, trace, telemetry, split, mpiexec, launch,
    )  # fmt: skip
    states: dict[str, Any] = {}
    if live and tc_plans:
        probes = probe_nodes(lab, tc_plans)
        states = {name: probe for name, probe in probes.values().items()}
        unresolved += [f"{o.node}: tc state not read ({o.error})" for o in probes.failed]
    commands = _commands(campaign, plan, states)
    return dataclasses.replace(plan, unresolved=tuple(unresolved), commands=tuple(commands))


def _launch_without_data_plane(
    lab: Inventory, split: SplitRunSpec, contexts: dict[str, NodeContext], mpiexec: str
) -> MpiLaunchPlan:
    from testbed.split_run import RankGroup

    groups = []
    for name, ranks in [(split.server, split.stages), *[(d, 1) for d in split.devices]]:
        node, context = lab.node(name), contexts[name]
        env = (("PYTHONPATH", context.code_path),)
        argv = (context.python, "-m", "nodes.workers", f"{run_dir_on(context, split.run_id)}/run.json")
        groups.append(RankGroup(name, node.address or name, ranks, argv, env))
    return MpiLaunchPlan(split.server, mpiexec, tuple(groups), split.timeout_s)


def split_spec(campaign: Campaign, run: PlannedRun, attempt: int, schedules: dict[str, list[dict]] | None = None):
    """The workers' part of the run: method, model, partition, per-device schedules, run id."""
    from workloads.schedule import build_schedules

    lab, settings = campaign.inventory, run.settings
    devices = device_names(lab, settings)
    if schedules is None:
        schedules = build_schedules(
            workload_spec(settings), devices, seed=run.seed, model_dir=campaign.resolve(settings.model),
            base_dir=campaign.base_dir,
        )  # fmt: skip
    return SplitRunSpec(
        method=settings.method, model=str(campaign.resolve(settings.model)), server=settings.server,
        devices=devices, stages=settings.partition.stages, device_layers=settings.partition.device_layers,
        chunk_tokens=settings.chunk_tokens, dtype=settings.dtype,
        schedules=tuple((d, tuple(schedules[d])) for d in devices), run_id=node_run_id(run, attempt),
        timeout_s=campaign.spec.run_timeout_s, threads_per_rank=settings.threads_per_rank,
        extra={"draft": draft_config(campaign, settings)},
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The command lines, built by the same functions the actions use


def _sh(script: str) -> str:
    return command_line(["sh", "-c", script])


def _store(path: str) -> str:
    from testbed.transport.base import store_script

    return normalised_line(_sh(store_script(path, 0)))


class _Lines:
    def __init__(self, lab: Inventory) -> None:
        self.lab = lab
        self.out: list[PlannedCommand] = []

    def add(self, node: NodeSpec | str, phase: str, what: str, line: str, when: str = "once", short: str = "") -> None:
        spec = self.lab.node(node) if isinstance(node, str) else node
        host = spec.adb.usb_host if spec.kind == "android" and spec.adb else spec.name
        self.out.append(PlannedCommand(spec.name, host, phase, what, line, when, short))

    def store(self, node: str, phase: str, what: str, path: str, when: str = "once") -> None:
        self.add(node, phase, what, _store(path), when, f"(store) {path}")

    def detached(self, node: str, phase: str, what: str, argv: Sequence[str], pidfile: str, logfile: str) -> None:
        self.add(node, phase, what, _sh(background_start_script(argv, pidfile, logfile, None)), "once",
                 f"(detached, pid in {pidfile}) {shlex.join(argv)}")  # fmt: skip

    def node_code(self, node: str, phase: str, context: NodeContext) -> None:
        self.add(node, phase, "is the node code bundle there?", command_line(["test", "-s", context.code_path]))
        self.store(node, phase, "store the node code bundle", context.code_path, "if-missing")


def _commands(campaign: Campaign, plan: RunPlan, states: dict[str, Any]) -> list[PlannedCommand]:
    lab, settings = campaign.inventory, plan.split
    ctx = plan.contexts
    lines = _Lines(lab)
    for name in plan.nodes:
        lines.add(name, "campaign", "gather the node's facts for the manifests (once per campaign)",
                  command_line(["sh", "-c", facts_script(lab.spec.defaults.python)]), "per-campaign")  # fmt: skip
    for name in plan.contexts:
        lines.add(name, "plan", "read the node's home directory", _sh(HOME_SCRIPT))
    lines.add(settings.server, "plan", "find mpiexec beside the workers' Python",
              _sh(_mpiexec_script(ctx[settings.server].python)))  # fmt: skip
    for name, plans in _by_node(plan.tc_plans).items():
        lines.add(name, "plan", "read the interfaces, journal and kernel",
                  _sh(probe_script(plan_devices(plans), lab.spec.defaults.workdir)))  # fmt: skip
    for name in plan.nodes:
        lines.add(name, "preflight", "reach the node", command_line(["true"]))
    # configure: power modes, set and read back
    for step in plan.power:
        node = lab.node(step.node)
        for what, action in (("read the power mode", ["show"]), ("set the power mode", set_action(step.mode)),
                             ("read the power mode back", ["show"])):  # fmt: skip
            lines.node_code(step.node, "configure", ctx[step.node])
            lines.add(node, "configure", what, command_line(driver_command(lab, node, ctx[step.node], action)))
    # configure: links
    _link_lines(lines, plan, states)
    # telemetry
    if plan.telemetry is not None:
        tel = plan.telemetry
        for sampler in tel.samplers:
            c = ctx[sampler.node]
            lines.node_code(sampler.node, "telemetry", c)
            lines.add(sampler.node, "telemetry", "probe the sensors",
                      command_line([*sampler_command(sampler, c), "--probe"]))  # fmt: skip
        for sampler in tel.samplers:
            lines.add(sampler.node, "telemetry", "measure the clock offset",
                      command_line(["sh", "-c", echo_script(lab.spec.defaults.python)]))  # fmt: skip
        for sampler in tel.samplers:
            c = ctx[sampler.node]
            argv = sampler_start_command(
                sampler, c, tel.session, interval_s=tel.interval_s, max_seconds=tel.max_seconds
            )
            _datafile, pidfile, logfile = sampler_paths(c, tel.session)
            lines.node_code(sampler.node, "telemetry", c)
            lines.detached(sampler.node, "telemetry", "start the sampler (detached)", argv, pidfile, logfile)
    # workers
    server = settings.server
    for name in (server, *settings.devices):
        c = ctx[name]
        run_dir = run_dir_on(c, settings.run_id)
        lines.node_code(name, "workers", c)
        lines.add(name, "workers", "clear the run's output", command_line(["rm", "-rf", f"{run_dir}/out"]))
        if name in settings.devices:
            lines.store(name, "workers", "store the device's schedule", f"{run_dir}/schedule-{name}.jsonl")
        lines.store(name, "workers", "store the run config", f"{run_dir}/run.json")
    server_dir = run_dir_on(ctx[server], settings.run_id)
    status, log = launch_files(server_dir)
    lines.add(server, "workers", "clear the last exit status", command_line(["rm", "-f", status]))
    words = prefix_words(sudo=False, env=launch_env(settings.timeout_s))
    lines.detached(server, "workers", "launch the ranks with mpiexec (detached)",
                   [*words, *launch_argv(plan.launch, status)], mpiexec_pidfile(server_dir), log)  # fmt: skip
    lines.add(server, "workers", "wait for mpiexec's exit status", _sh(launch_wait_script(status)), "polled")
    for device in settings.devices:
        pattern = f"{_quote_path(run_dir_on(ctx[device], settings.run_id) + '/out')}/device-*-{shlex.quote(device)}"
        lines.add(device, "workers", "count the requests served so far",
                  _sh(f"cat {pattern}/requests.jsonl 2>/dev/null | grep -c request_id || true"), "polled")  # fmt: skip
    lines.add(server, "workers", "end mpiexec (timed out or interrupted)",
              _sh(background_stop_script(mpiexec_pidfile(server_dir), 5.0)), "on-failure")  # fmt: skip
    lines.add(server, "workers", "read mpiexec's output", command_line(["tail", "-c", "200000", log]))
    for name in (server, *settings.devices):
        out = run_dir_on(ctx[name], settings.run_id) + "/out"
        lines.add(name, "workers", "list the ranks' files to collect", _sh(rank_listing_script(out)))
    # collect: telemetry ends
    if plan.telemetry is not None:
        for sampler in plan.telemetry.samplers:
            lines.add(sampler.node, "collect", "measure the clock offset again",
                      command_line(["sh", "-c", echo_script(lab.spec.defaults.python)]))  # fmt: skip
        for sampler in plan.telemetry.samplers:
            pidfile = sampler_paths(ctx[sampler.node], plan.telemetry.session)[1]
            lines.add(sampler.node, "collect", "stop the sampler", _sh(background_stop_script(pidfile, 5.0)))
    # restore
    _link_restore_lines(lines, plan)
    for step in plan.power:
        node = lab.node(step.node)
        lines.node_code(step.node, "restore", ctx[step.node])
        lines.add(node, "restore", "restore the power mode from the node's journal",
                  command_line(driver_command(lab, node, ctx[step.node], ["restore"])))  # fmt: skip
    return lines.out


def _quote_path(path: str) -> str:
    from testbed.transport.base import quote_path

    return quote_path(path)


def _mpiexec_script(python: str) -> str:
    from testbed.split_run import mpiexec_search_script

    return mpiexec_search_script(python)


def _by_node(plans: Sequence[TcPlan]) -> dict[str, list[TcPlan]]:
    out: dict[str, list[TcPlan]] = {}
    for p in plans:
        out.setdefault(p.node, []).append(p)
    return out


def _link_lines(lines: _Lines, plan: RunPlan, probes: dict[str, Any]) -> None:
    if not plan.tc_plans:
        return
    lab = lines.lab
    workdir = lab.spec.defaults.workdir
    by_node = _by_node(plan.tc_plans)
    sudo_words = prefix_words(sudo=lab.spec.defaults.sudo, env=None)
    for name, plans in by_node.items():
        lines.add(name, "configure", "read the interfaces, journal and kernel before shaping",
                  _sh(probe_script(plan_devices(plans), workdir)))  # fmt: skip
    for name in shapeable_nodes(lab):
        if name not in by_node:
            lines.add(name, "configure", "clear earlier shaping of a node this run does not shape",
                      _sh(node_journal.read_script(workdir)))  # fmt: skip
    for name, plans in by_node.items():
        probe = probes.get(name)
        when = "once" if probe is not None else "live"
        commands = [c for p in plans for c in (commands_for(p, probe.states) if probe else p.apply_commands())]
        lines.store(name, "configure", "write the link journal (the interfaces as they were)",
                    node_journal.journal_path(workdir))  # fmt: skip
        lines.add(name, "configure", "shape the links", _sh(node_journal.commands_script(commands, sudo_words)), when)
        lines.add(name, "configure", "read tc back", _sh(_read_script(plan_devices(plans))))
    if plan.trace is not None:
        _trace_lines(lines, plan)
    for name, plans in by_node.items():
        lines.add(name, "configure", "read the journal back", _sh(node_journal.read_script(workdir)))
        node = lab.node(name)
        devices = [node.data.interface] if node.data else []
        lines.add(name, "configure", "read tc back for the manifest",
                  _sh(_read_script(list(dict.fromkeys(devices + plan_devices(plans))))))  # fmt: skip


def _trace_lines(lines: _Lines, plan: RunPlan) -> None:
    """A trace's later rows, played on each node whose classes it drives (see ``apply_trace``)."""
    from netem.trace import schedules
    from testbed.links.plans import traced_links

    lab = lines.lab
    workdir = lab.spec.defaults.workdir
    assert plan.trace is not None
    _links, driven = traced_links(lab, {d: plan.trace for d in plan.devices})
    sudo_words = prefix_words(sudo=lab.spec.defaults.sudo, env=None)
    for schedule in schedules(plan.tc_plans, driven, sudo_words):
        name = schedule.node
        directory_tilde = node_journal.journal_dir(workdir)
        context = plan.contexts.get(name) or unresolved_context(lab, lab.node(name))
        directory = context.path(directory_tilde)
        pidfile, logfile = f"{directory}/trace-player.pid", f"{directory}/trace.jsonl"
        argv = [lab.spec.defaults.python, f"{directory}/link_trace_player.py", f"{directory}/trace-schedule.json",
                logfile]  # fmt: skip
        lines.add(name, "configure", "where the trace player lives", _sh("echo " + _quote_path(directory_tilde)))
        lines.add(name, "configure", "read the link journal", _sh(node_journal.read_script(workdir)))
        lines.store(name, "configure", "name the trace player in the journal", node_journal.journal_path(workdir))
        lines.store(name, "configure", "store the trace player", f"{directory}/link_trace_player.py")
        lines.store(name, "configure", "store the trace's schedule", f"{directory}/trace-schedule.json")
        lines.detached(name, "configure", "start the trace player (detached)", argv, pidfile,
                       f"{directory}/trace-player.log")  # fmt: skip


def _read_script(devices: Sequence[str]) -> str:
    from netem.tc_state import read_script

    return read_script(devices)


def _undo_for(plans: Sequence[TcPlan]) -> list[list[str]]:
    """What the journal of a fresh apply of ``plans`` undoes: ingress redirects, ifbs, then our roots."""
    ingress = [c for p in plans if p.ifb for c in p.undo_commands()[:1]]
    ifbs = [c for p in plans if p.ifb for c in p.undo_commands()[1:]]
    roots = [c for p in plans if not p.ifb for c in p.undo_commands()]
    return ingress + ifbs + roots


def _link_restore_lines(lines: _Lines, plan: RunPlan) -> None:
    if not plan.tc_plans:
        return
    lab = lines.lab
    workdir = lab.spec.defaults.workdir
    sudo_words = prefix_words(sudo=lab.spec.defaults.sudo, env=None)
    for name, plans in _by_node(plan.tc_plans).items():
        journal_devices = list(dict.fromkeys(plan_devices(plans) + [p.interface for p in plans if p.ifb]))
        lines.add(name, "restore", "read the link journal", _sh(node_journal.read_script(workdir)))
        if plan.trace is not None:
            pidfile = plan.contexts[name].path(node_journal.journal_dir(workdir)) + "/trace-player.pid"
            lines.add(name, "restore", "stop the trace player", _sh(background_stop_script(pidfile, 5.0)), "live")
        lines.add(name, "restore", "read tc before undoing", _sh(_read_script(journal_devices)))
        lines.add(name, "restore", "undo the shaping (only what the journal says is ours)",
                  _sh(node_journal.commands_script(_undo_for(plans), sudo_words)))  # fmt: skip
        lines.add(name, "restore", "read tc after undoing", _sh(_read_script(journal_devices)))
        lines.add(name, "restore", "drop the link journal", _sh(node_journal.remove_script(workdir)))


__all__ = ["HOME_SCRIPT", "PlannedCommand", "RunPlan", "TelemetryStep", "node_run_id", "plan_run", "run_links"]
