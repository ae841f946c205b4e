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
``on-failure`` (rolling back, ending a pool that failed or timed out); ``live`` (decided from what
the node reports at that moment, or from what the run before found); ``if-cold`` (starting the warm
worker pool, only when none of the run's shape is up); ``if-differs`` (a power mode or tc classes the
node does not hold already); ``at-release`` (stopping the pool and restoring the nodes: after the last
run in a row that needs them, when a run fails, and when the campaign ends). A stored file's line
carries its byte count, shown as ``<N>`` (contents such as a journal's timestamp are only known when
written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from foundation.errors import TestbedError
from netem.plan import TcPlan, plan_devices, plans_by_node
from netem.profile import LinkProfile
from netem.trace import BandwidthTrace
from nodes.contracts.methods import method_named
from testbed.campaign.run_spec import dilation_of, node_run_id, split_spec
from testbed.campaign.spec import Campaign, PlannedRun, RunSettings, device_names, run_nodes
from testbed.commands.node_context import (
    HOME_SCRIPT,
    NodeContext,
    resolve_context,
    transport_for,
    unresolved_context,
)
from testbed.commands.planned import PlanLines, PlannedCommand, normalised_line, sh
from testbed.energy.power_modes import PowerStep, plan_power_restore, plan_power_set
from testbed.energy.telemetry import TelemetryStep, plan_recording_start, plan_recording_stop, sampler_plan
from testbed.inventory import DirectedLink, Inventory, links_from_file
from testbed.leases.keeper import lease_machines
from testbed.leases.lease_file import lease_script
from testbed.links.apply import plan_shaping, plan_unshaping
from testbed.links.handler_lifecycle import plan_handler_reports
from testbed.links.plans import Driven, LinkPlan, link_plan
from testbed.links.probe import NodeProbe, plan_probe, probe_nodes
from testbed.links.trace_playback import plan_trace_players, plan_trace_stop
from testbed.links.verify import plan_verification
from testbed.target.emulation import paceable, plan_pacing
from testbed.transport.base import command_line
from testbed.transport.facts import facts_script
from testbed.transport.fanout import fan_out
from testbed.workers.context_service import (
    LIFETIME_MARGIN_S,
    ServicePlan,
    plan_services_start,
    plan_services_stop,
    run_scales,
    service_plans,
)
from testbed.workers.mpi_launch import MpiLaunchPlan, find_mpiexec, launch_plan, plan_mpiexec_search
from testbed.workers.pool import (
    IDLE_TIMEOUT_S,
    plan_pool_release,
    plan_pool_serve,
    plan_pool_up,
    pool_files,
    pool_launch,
    pool_name,
)
from testbed.workers.split_run import plan_stage
from testbed.workers.split_spec import SplitRunSpec

TELEMETRY_MARGIN_S = 60.0  # samplers stop themselves this long after the run's timeout at the latest


def run_trace(campaign: Campaign, settings: RunSettings) -> BandwidthTrace:
    """The run's bandwidth trace, its rates multiplied by ``link.rate_scale``."""
    from netem.trace import load_trace, scale_trace

    dilation = dilation_of(settings)
    return scale_trace(load_trace(campaign.resolve(settings.link.trace)), settings.link.rate_scale / dilation, dilation)


def run_links(
    campaign: Campaign, settings: RunSettings, trace: BandwidthTrace | None = None
) -> tuple[DirectedLink, ...]:
    """The directed links a run shapes (:func:`run_links_driven` without the traced directions)."""
    return run_links_driven(campaign, settings, trace)[0]


def run_links_driven(
    campaign: Campaign, settings: RunSettings, trace: BandwidthTrace | None = None
) -> tuple[tuple[DirectedLink, ...], Driven]:
    """The directed links a run shapes: a trace's first row on every device's links, a links file,
    one profile on every link of the inventory, or the inventory's own links; of those, the ones
    between machines the run uses (the rest of the lab may be another campaign's, which holds its
    leases); every rate multiplied by ``link.rate_scale`` (the traced links come scaled with the trace;
    ``trace``: the run's, when the caller has loaded it already). With them, the directions a trace
    drives."""
    from testbed.links.plans import traced_links

    lab, link = campaign.inventory, settings.link
    driven: Driven = {}
    if link.trace:
        trace = trace or run_trace(campaign, settings)
        links, driven = traced_links(lab, {d: trace for d in device_names(lab, settings)})
    elif link.links:
        links = links_from_file(lab, campaign.resolve(link.links))
    elif link.profile:
        profile = lab.spec.link_profiles[link.profile]
        links = tuple(dataclasses.replace(lk, profile_name=link.profile, profile=profile) for lk in lab.links)
    else:
        links = lab.links
    used = {node.name for node in run_nodes(lab, settings)}
    links = tuple(lk for lk in links if lk.source in used and lk.destination in used)
    driven = {pair: value for pair, value in driven.items() if pair[0] in used and pair[1] in used}
    dilation = dilation_of(settings)
    scale = link.rate_scale / dilation
    if scale == 1.0 and dilation == 1.0:
        return links, driven
    return tuple(
        dataclasses.replace(lk, profile=dilated_profile(lk.profile, scale, dilation))
        if (lk.source, lk.destination) not in driven else lk
        for lk in links
    ), driven  # fmt: skip


def dilated_profile(profile: LinkProfile, rate_scale: float, dilation: float) -> LinkProfile:
    """A link profile with its rate multiplied by ``rate_scale`` and its delay and jitter by ``dilation``."""
    update: dict[str, float] = {}
    if profile.rate_bit_s:
        update["rate_bit_s"] = profile.rate_bit_s * rate_scale
    for name in ("delay_s", "jitter_s"):
        if getattr(profile, name):
            update[name] = getattr(profile, name) * dilation
    return profile.model_copy(update=update)


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
    shaping: LinkPlan  # the links' tc plans on their delay paths, NFQUEUE rules, trace players
    trace: BandwidthTrace | None
    telemetry: TelemetryStep | None
    split: SplitRunSpec
    mpiexec: str | None  # beside the workers' Python on the launch node; None: looked up at launch
    launch: MpiLaunchPlan  # the warm pool's mpiexec (testbed.workers.pool), started when none of its shape is up
    commands: tuple[PlannedCommand, ...] = field(default=())
    probes: dict[str, NodeProbe] = field(default_factory=dict)  # tc state read when planning; apply reuses it
    services: tuple[ServicePlan, ...] = ()  # the devices' LLM service daemons (a context-serving method)
    verify_s: float = 0.0  # iperf3 per shaped direction after shaping (link.verify_s); 0: none

    @property
    def tc_plans(self) -> tuple[TcPlan, ...]:
        return self.shaping.tc_plans

    def by_node(self) -> dict[str, list[PlannedCommand]]:
        out: dict[str, list[PlannedCommand]] = {}
        for c in self.commands:
            out.setdefault(c.node, []).append(c)
        return out

    def actions(self) -> dict[str, list[str]]:
        """Per node, what the run changes or starts there, in order (the lines that matter to a
        reader: power driver, tc, samplers, the MPI launch, and the restore), without the reads."""
        keep = ("set the power mode where it differs", "shape the links", "start the sampler (detached)",
                "start the trace player (detached)", "start the LLM service (detached)", "stop the LLM service",
                "undo the shaping (only what the journal says is ours)",
                "restore the power mode from the node's journal")  # fmt: skip
        out: dict[str, list[str]] = {name: [] for name in self.nodes}
        for c in self.commands:
            if c.what == "start the warm worker pool with mpiexec (detached)":
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
            "services": [{"node": p.node, "argv": list(p.argv), "memory": p.memory, "scale": p.scale.to_json()}
                         for p in self.services],
            "mpiexec": self.mpiexec, "launch": self.launch.apply_commands()[0],
            "commands": [dataclasses.asdict(c) for c in self.commands],
        }  # fmt: skip


# --------------------------------------------------------------------------------------------
# Making the plan


class NodeReads:
    """What planning read from the nodes, kept for the next plan made from the same reads: a dry run
    plans every run of a campaign and reads each node once, not once per run."""

    def __init__(self) -> None:
        self.contexts: dict[str, NodeContext] = {}
        self.unreachable: dict[str, str] = {}
        self.mpiexec: dict[tuple[str, str], str | None] = {}
        self.probes: dict[tuple[str, tuple[str, ...]], NodeProbe] = {}

    def forget_per_run(self) -> None:
        """Drop what may change between runs (tc state, nodes that could not be reached), keeping home
        directories and ``mpiexec``: a campaign's next run reads only those again."""
        self.probes.clear()
        self.unreachable.clear()

    def read_contexts(self, lab: Inventory, names: Sequence[str]) -> None:
        todo = [n for n in names if n not in self.contexts and n not in self.unreachable]
        read = fan_out(todo, lambda name: resolve_context(lab, lab.node(name)), description="reading nodes")
        self.contexts.update(read.values())
        self.unreachable.update({o.node: str(o.error) for o in read.failed})

    def read_probes(self, lab: Inventory, plans: Sequence[TcPlan]) -> dict[str, str]:
        """Probe the nodes the plans shape (those not probed for these devices yet); the failures."""
        key = {name: (name, tuple(plan_devices(ps))) for name, ps in plans_by_node(plans).items()}
        todo = [p for p in plans if key[p.node] not in self.probes]
        read = probe_nodes(lab, todo) if todo else None
        if read is not None:
            self.probes.update({key[name]: probe for name, probe in read.values().items()})
        return {o.node: str(o.error) for o in read.failed} if read is not None else {}

    def probes_for(self, plans: Sequence[TcPlan]) -> dict[str, NodeProbe]:
        out = {}
        for name, ps in plans_by_node(plans).items():
            probe = self.probes.get((name, tuple(plan_devices(ps))))
            if probe is not None:
                out[name] = probe
        return out


def plan_run(
    campaign: Campaign, run: PlannedRun, attempt: int, *, live: bool, reads: NodeReads | None = None
) -> RunPlan:
    """The plan of ``run``'s attempt. With ``live``, the nodes are read (never changed) to resolve
    paths, the launch node's ``mpiexec`` and the tc commands that depend on what is there now; a
    node that cannot be read leaves its part marked as depending on live state. ``reads`` carries
    what earlier plans read (a fresh one reads everything)."""
    lab, settings = campaign.inventory, run.settings
    names = tuple(n.name for n in run_nodes(lab, settings))
    devices = device_names(lab, settings)
    unresolved: list[str] = []
    power = tuple(
        PowerStep(node.name, mode) for target, mode in settings.power.items() for node in lab.select([target])
    )
    links: tuple[DirectedLink, ...] = ()
    tc_plans: tuple[TcPlan, ...] = ()
    driven: Driven = {}
    trace = run_trace(campaign, settings) if settings.link.shaped and settings.link.trace else None
    if settings.link.shaped:
        from testbed.links.plans import compile_plan

        links, driven = run_links_driven(campaign, settings, trace)
        try:
            tc_plans = compile_plan(lab, links)
        except TestbedError as exc:  # e.g. an emulated testbed that is not up has no data interfaces yet
            unresolved.append(f"link shaping cannot be planned now: {exc}")
    # shaping reaches beyond the run's nodes: to the senders of its classes and, on the NFQUEUE delay
    # path, to the receivers that hold the delayed directions' rules
    touched = tuple(dict.fromkeys([*names, *(p.node for p in tc_plans), *delay_holders(lab, tc_plans)]))
    contexts = {name: unresolved_context(lab, lab.node(name)) for name in touched}
    reads = reads if reads is not None else NodeReads()
    if live:
        reads.read_contexts(lab, touched)
        contexts.update({name: reads.contexts[name] for name in touched if name in reads.contexts})
        unresolved += [f"{name}: not reachable when planning ({reads.unreachable[name]})"
                       for name in touched if name in reads.unreachable]  # fmt: skip
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
    mpiexec = None
    server_context = contexts[settings.server]
    if live and server_context.resolved:
        key = (settings.server, server_context.python)
        if key not in reads.mpiexec:
            try:
                with transport_for(lab, lab.node(settings.server)) as t:
                    reads.mpiexec[key] = find_mpiexec(t, server_context.python)
            except Exception as exc:  # reported, and the run finds it again when it launches
                reads.mpiexec[key] = None
                unresolved.append(f"{settings.server}: mpiexec not found when planning ({exc})")
        mpiexec = reads.mpiexec[key]
    else:
        unresolved.append(f"{settings.server}: mpiexec is looked up beside {server_context.python} at launch")
    try:
        single = launch_plan(lab, split, contexts, mpiexec)
    except TestbedError as exc:  # an emulated testbed that is not up has no data interfaces or addresses yet
        unresolved.append(f"the MPI launch's hosts and data-plane environment: {exc}")
        single = launch_plan(lab, split, contexts, mpiexec, data_plane=False)
    launch = pool_launch(single, contexts, pool_name(split), lifetime_s=pool_lifetime_s(campaign))
    services: tuple[ServicePlan, ...] = ()
    if method_named(settings.method).serves_contexts:
        scales = run_scales(lab, campaign.base_dir, settings, devices, campaign.resolve(settings.model))
        services = service_plans(lab, settings, contexts, devices, split.run_id, split.model, scales,
                                 campaign.spec.run_timeout_s + LIFETIME_MARGIN_S)  # fmt: skip
    probes: dict[str, NodeProbe] = {}
    if live and tc_plans:
        failed = reads.read_probes(lab, tc_plans)
        unresolved += [f"{node}: tc state not read ({error})" for node, error in failed.items()]
        probes = reads.probes_for(tc_plans)
    elif any(p.has_delay_or_loss for p in tc_plans) and lab.spec.defaults.delay_path == "auto":
        unresolved.append("the delay path (netem, or NFQUEUE without sch_netem) is chosen when the nodes are read")
    # each shaping node's delay path (netem, or NFQUEUE rules on the receivers) as the apply will take it
    shaping = link_plan(lab, tc_plans, probes, driven if trace is not None else None, scope=campaign.nodes())
    plan = RunPlan(
        run.run_id, attempt, node_run_id(run, attempt), names, devices, contexts, live, tuple(unresolved), power,
        links, shaping, trace, telemetry, split, mpiexec, launch, probes=probes, services=services,
        verify_s=settings.link.verify_s if settings.link.shaped else 0.0,
    )  # fmt: skip
    leased = lease_machines(lab, campaign.nodes())
    return dataclasses.replace(plan, commands=tuple(plan_commands(lab, plan, leased)))


def plan_leases(lines: PlanLines, machines: Sequence[str]) -> None:
    """A campaign's lines of :class:`testbed.leases.keeper.LeaseKeeper`: each lease taken before anything
    else, renewed while the campaign runs, given back at its end (who asks goes on stdin)."""
    steps = (("take", "take the machine's lease (before anything else)", "per-campaign"),
             ("renew", "renew the lease (every third of its ttl)", "polled"),
             ("release", "give the lease back (at the campaign's end)", "at-release"))  # fmt: skip
    for action, what, when in steps:
        for machine in machines:
            lines.add(machine, "campaign", what, sh(lease_script(action)), when)


def plan_commands(lab: Inventory, plan: RunPlan, leased: Sequence[str] = ()) -> list[PlannedCommand]:
    """Every line the run sends, in phase order, each planned by the action that sends it; ``leased``:
    the machines whose leases the campaign takes, renews and gives back."""
    ctx, settings, shaping = plan.contexts, plan.split, plan.shaping
    lines = PlanLines(lab)
    plan_leases(lines, leased)
    for name in plan.nodes:
        lines.add(name, "campaign", "gather the node's facts for the manifests (once per campaign)",
                  sh(facts_script(lab.settings_of(name).python)), "per-campaign")  # fmt: skip
    for name in plan.contexts:
        lines.add(name, "plan", "read the node's home directory", sh(HOME_SCRIPT))
    plan_mpiexec_search(lines, settings.server, ctx[settings.server])
    for name, plans in plans_by_node(plan.tc_plans).items():
        plan_probe(lines, name, plan_devices(plans), phase="plan", what="read the interfaces, journal and kernel")
    for name in plan.nodes:
        lines.add(name, "preflight", "reach the node", command_line(["true"]))
    # configure: power modes (each set where the node is not in it already), CPU pacing of emulated
    # nodes in a target run (a quota that never holds their paced steps back), links
    plan_power_set(lines, plan.power, ctx)
    paced = paceable(lab, plan.nodes) if settings.sections.target else []
    plan_pacing(lines, paced, ctx, on=True)
    if shaping.tc_plans:
        plan_shaping(lines, shaping, plan.probes, ctx)
        plan_trace_players(lines, shaping, ctx)
        if plan.verify_s > 0:
            plan_verification(lines, plan.links, plan.verify_s)
    if plan.telemetry is not None:
        plan_recording_start(lines, plan.telemetry, ctx)
    # stage (beside configure and telemetry): the run staged on its nodes, the warm pool of its shape
    # started if none is up; services; workers: the run ordered from the pool
    plan_stage(lines, settings, ctx)
    files = pool_files(ctx[settings.server], pool_name(settings))
    plan_pool_up(lines, plan.launch, files)
    plan_services_start(lines, plan.services, ctx)
    plan_pool_serve(lines, settings, ctx, files)
    if plan.telemetry is not None:
        plan_recording_stop(lines, plan.telemetry, ctx)
    plan_handler_reports(lines, [name for name in shaping.held if shaping.queued(name)], ctx)
    # restore: the services and the trace end with the run; shaping, power modes and the pool stay
    # while the next runs need them, and are released after the last of them (or when a run fails,
    # or the campaign ends)
    plan_services_stop(lines, plan.services)
    if shaping.tc_plans:
        if plan.trace is not None:
            plan_trace_stop(lines, shaping, ctx)
        plan_unshaping(lines, shaping, ctx)
    plan_pacing(lines, paced, ctx, on=False)
    plan_power_restore(lines, plan.power, ctx)
    plan_pool_release(lines, settings.server, files)
    return lines.out


def delay_holders(lab: Inventory, tc_plans: Sequence[TcPlan]) -> list[str]:
    """The nodes that would hold the NFQUEUE rules of the plans' delayed directions, were they all on
    that path (their home directories are read before the delay paths are known)."""
    if not any(p.has_delay_or_loss for p in tc_plans):
        return []
    return list(link_plan(lab, tc_plans, {}, preference="nfqueue").held)


def pool_lifetime_s(campaign: Campaign) -> float:
    """How long ``mpiexec`` lets a warm pool live: every run of the campaign at its timeout, and the
    idle timeout (a bound, never reached in a campaign that works; the controller times runs out)."""
    return campaign.spec.run_timeout_s * len(campaign.runs) + IDLE_TIMEOUT_S


def configured_nodes(campaign: Campaign, settings: RunSettings) -> tuple[frozenset[str], frozenset[str]]:
    """(nodes whose power mode ``settings`` set, nodes whose links it shapes), without reading a node:
    what a run may leave configured for the next one to find in place."""
    from testbed.links.plans import compile_plan

    lab = campaign.inventory
    power = frozenset(node.name for target in settings.power for node in lab.select([target]))
    shaped: frozenset[str] = frozenset()
    if settings.link.shaped:
        try:
            shaped = frozenset(p.node for p in compile_plan(lab, run_links(campaign, settings)))
        except TestbedError:  # cannot be planned now: keep nothing shaped for it
            shaped = frozenset()
    return power, shaped



__all__ = ["PlannedCommand", "RunPlan", "TelemetryStep", "node_run_id", "normalised_line", "plan_run", "run_links"]
