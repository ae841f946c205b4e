"""The shell lines of a run plan, built by the same functions the actions use to run them (power
driver, samplers, tc apply and undo, trace player, the MPI launch), so that what ``--dry-run``
prints is what the run sends. See :mod:`testbed.campaign.plan` for what each ``when`` means.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from netem.nfqueue import chains_by_node
from netem.plan import TcPlan, plan_devices, plans_by_node
from netem.tc_state import commands_for
from nodes.contracts.rank_dirs import device_glob
from testbed.campaign.spec import Campaign
from testbed.context_service import STOP_GRACE_S
from testbed.inventory import Inventory, NodeSpec
from testbed.links import node_journal
from testbed.links.apply import shapeable_nodes
from testbed.links.handler_lifecycle import handler_command, handler_files, handler_report_script
from testbed.links.probe import iptables_read_script, probe_script
from testbed.node_context import HOME_SCRIPT, NodeContext, host_of, unresolved_context
from testbed.power import driver_command, set_action
from testbed.split_run import (
    PER_RUN_KEY,
    launch_argv,
    launch_env,
    mpiexec_search_script,
    private_store_script,
    rank_listing_script,
    run_dir_on,
    run_key_path,
)
from testbed.target_emulation import paceable, pacing_command
from testbed.telemetry import sampler_command, sampler_paths, sampler_start_command
from testbed.transport.base import (
    background_start_script,
    background_stop_script,
    command_line,
    prefix_words,
    quote_path,
    store_script,
)
from testbed.transport.clock import echo_script
from testbed.transport.facts import facts_script
from testbed.worker_pool import (
    POOL_RECORD,
    alive_check,
    pool_files,
    pool_name,
    run_wait_script,
    start_script,
    stop_wait_script,
)

if TYPE_CHECKING:
    from netem.nfqueue import NfqueueRules
    from testbed.campaign.plan import RunPlan

WHEN = ("once", "per-campaign", "if-missing", "polled", "on-failure", "live", "if-cold", "if-differs", "at-release")
STORED_SIZE = re.compile(r"(-eq |of )\d+( bytes)?")


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


def normalised_line(line: str) -> str:
    """A command line with stored files' byte counts replaced by ``<N>`` (for comparing runs with plans)."""
    return STORED_SIZE.sub(lambda m: m.group(1) + "<N>" + (m.group(2) or ""), line)


def _sh(script: str) -> str:
    return command_line(["sh", "-c", script])


def _store(path: str) -> str:
    return normalised_line(_sh(store_script(path, 0)))


class _Lines:
    def __init__(self, lab: Inventory) -> None:
        self.lab = lab
        self.out: list[PlannedCommand] = []

    def add(self, node: NodeSpec | str, phase: str, what: str, line: str, when: str = "once", short: str = "") -> None:
        spec = self.lab.node(node) if isinstance(node, str) else node
        host = host_of(spec)
        self.out.append(PlannedCommand(spec.name, host, phase, what, line, when, short))

    def store(self, node: str, phase: str, what: str, path: str, when: str = "once") -> None:
        self.add(node, phase, what, _store(path), when, f"(store) {path}")

    def detached(
        self, node: str, phase: str, what: str, argv: Sequence[str], pidfile: str, logfile: str, when: str = "once"
    ) -> None:
        self.add(node, phase, what, _sh(background_start_script(argv, pidfile, logfile, None)), when,
                 f"(detached, pid in {pidfile}) {shlex.join(argv)}")  # fmt: skip

    def node_code(self, node: str, phase: str, context: NodeContext) -> None:
        if not context.uses_bundle:
            return
        self.add(node, phase, "is the node code bundle there?", command_line(["test", "-s", context.code_path]))
        self.store(node, phase, "store the node code bundle", context.code_path, "if-missing")


def plan_commands(campaign: Campaign, plan: RunPlan, states: dict[str, Any]) -> list[PlannedCommand]:
    """Every line the run sends, in phase order (``states``: the tc probes read when planning)."""
    lab, settings = campaign.inventory, plan.split
    ctx = plan.contexts
    lines = _Lines(lab)
    for name in plan.nodes:
        lines.add(name, "campaign", "gather the node's facts for the manifests (once per campaign)",
                  command_line(["sh", "-c", facts_script(lab.spec.defaults.python)]), "per-campaign")  # fmt: skip
    for name in plan.contexts:
        lines.add(name, "plan", "read the node's home directory", _sh(HOME_SCRIPT))
    lines.add(settings.server, "plan", "find mpiexec beside the workers' Python",
              _sh(mpiexec_search_script(ctx[settings.server].python)))  # fmt: skip
    for name, plans in plans_by_node(plan.tc_plans).items():
        lines.add(name, "plan", "read the interfaces, journal and kernel",
                  _sh(_probe_script(lab, plan_devices(plans))))  # fmt: skip
    for name in plan.nodes:
        lines.add(name, "preflight", "reach the node", command_line(["true"]))
    # configure: power modes, each set (journaled, read back) only where the node is not in it already
    for step in plan.power:
        lines.node_code(step.node, "configure", ctx[step.node])
        lines.add(step.node, "configure", "set the power mode where it differs",
                  command_line(driver_command(lab, lab.node(step.node), ctx[step.node],
                                              set_action(step.mode, if_differs=True))))  # fmt: skip
    # configure: emulated nodes of a target run get a CPU quota that never holds their paced steps back
    paced = paceable(lab, plan.nodes) if plan.split.extra.get("target") else []
    for name in paced:
        lines.node_code(name, "configure", ctx[name])
        lines.add(name, "configure", "pace the CPU: 10 ms CFS periods, a quota of every CPU",
                  command_line(pacing_command(ctx[name], True)))  # fmt: skip
    # configure: links
    _link_lines(lines, plan, states)
    # telemetry
    if plan.telemetry is not None:
        tel = plan.telemetry
        for sampler in tel.samplers:
            c = ctx[sampler.node]
            lines.node_code(sampler.node, "telemetry", c)
            lines.add(sampler.node, "telemetry", "probe the sensors (unless the last run's sampler bore them out)",
                      command_line([*sampler_command(sampler, c), "--probe"]), "live")  # fmt: skip
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
    # stage (beside configure and telemetry): the run staged on its nodes, the warm pool of its shape started
    # if none is up; workers: the run ordered from the pool
    server = settings.server
    for name in (server, *settings.devices):
        c = ctx[name]
        run_dir = run_dir_on(c, settings.run_id)
        lines.node_code(name, "stage", c)
        lines.add(name, "stage", "remove what an earlier run with this id left", command_line(["rm", "-rf", run_dir]))
        if name in settings.devices:
            lines.store(name, "stage", "store the device's schedule", f"{run_dir}/schedule-{name}.jsonl")
        key_path = run_key_path(settings.extra.get("dispatch"), run_dir)
        if key_path is not None:  # the value comes on stdin: never in this plan, a manifest or a command line
            stored = normalised_line(_sh(private_store_script(key_path, 0)))
            lines.add(name, "stage", f"store the run's endpoint key, its user's alone (0600): {PER_RUN_KEY}", stored,
                      short=f"(store, 0600) {key_path}")  # fmt: skip
        lines.store(name, "stage", "store the run config", f"{run_dir}/run.json")
    files = pool_files(ctx[server], pool_name(settings))
    lines.add(server, "stage", "has the warm pool ended since the last run?", _sh(alive_check(files)), "live")
    lines.add(server, "stage", "clear what an earlier pool of this shape left", command_line(start_script(files)),
              "if-cold")  # fmt: skip
    words = prefix_words(sudo=False, env=launch_env(plan.launch.timeout_s))
    lines.detached(server, "stage", "start the warm worker pool with mpiexec (detached)",
                   [*words, *launch_argv(plan.launch, files.status)], files.pidfile, files.log, "if-cold")  # fmt: skip
    _service_lines(lines, plan)
    lines.store(server, "workers", "order the run from the pool", files.order)
    record = f"{run_dir_on(ctx[server], settings.run_id)}/{POOL_RECORD}"
    lines.add(server, "workers", "wait for the run to finish (or the pool to end)",
              _sh(run_wait_script(record, files.status)), "polled")  # fmt: skip
    for device in settings.devices:
        pattern = f"{quote_path(run_dir_on(ctx[device], settings.run_id) + '/out')}/{device_glob(shlex.quote(device))}"
        lines.add(device, "workers", "count the requests served so far",
                  _sh(f"cat {pattern}/requests.jsonl 2>/dev/null | grep -c request_id || true"), "polled")  # fmt: skip
    lines.add(server, "workers", "end the pool (the run failed or timed out)",
              _sh(background_stop_script(files.pidfile, 5.0)), "on-failure")  # fmt: skip
    lines.add(server, "workers", "read the pool's output", command_line(["tail", "-c", "200000", files.log]))
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
    for name, held in run_chains(lab, plan).items():
        if any(r.queues for r in held):
            handler = handler_files(ctx[name].path(node_journal.journal_dir(lab.spec.defaults.workdir)))
            lines.add(name, "collect", "read the delay handler's record of the run",
                      _sh(handler_report_script(handler)))  # fmt: skip
    for service in plan.services:
        lines.add(service.node, "restore", "stop the LLM service",
                  _sh(background_stop_script(service.files.pidfile, STOP_GRACE_S)))  # fmt: skip
    # restore: the trace ends with the run; shaping, power modes and the pool stay while the next runs
    # need them, and are released after the last of them (or when a run fails, or the campaign ends)
    _trace_stop_lines(lines, plan)
    _link_restore_lines(lines, plan)
    for name in paced:
        lines.add(name, "restore", "end the CPU pacing (the power mode's quota again)",
                  command_line(pacing_command(ctx[name], False)))  # fmt: skip
    for step in plan.power:
        node = lab.node(step.node)
        lines.node_code(step.node, "restore", ctx[step.node])
        lines.add(node, "restore", "restore the power mode from the node's journal",
                  command_line(driver_command(lab, node, ctx[step.node], ["restore"])), "at-release")  # fmt: skip
    lines.store(server, "restore", "order the pool to stop", files.order, "at-release")
    lines.add(server, "restore", "wait for the pool to end", _sh(stop_wait_script(files.status)), "at-release")
    lines.add(server, "restore", "end the pool if it has not", _sh(background_stop_script(files.pidfile, 5.0)),
              "at-release")  # fmt: skip
    return lines.out


def _service_lines(lines: _Lines, plan: RunPlan) -> None:
    """The devices' LLM service daemons, started once the run is staged (``start_services``)."""
    for service in plan.services:
        context = plan.contexts[service.node]
        lines.add(service.node, "services", "make the LLM service's directory (0700: its user's alone)",
                  command_line(service.directory_argv()))  # fmt: skip
        lines.detached(service.node, "services", "start the LLM service (detached)", service.argv,
                       service.files.pidfile, service.files.logfile)  # fmt: skip
        lines.add(service.node, "services", "wait until the LLM service answers",
                  command_line(context.command(service.check_argv(context.python))), "polled")  # fmt: skip


def _probe_script(lab: Inventory, devices: Sequence[str]) -> str:
    return probe_script(devices, lab.spec.defaults.workdir, lab.spec.defaults.sudo)


def run_chains(lab: Inventory, plan: RunPlan) -> dict[str, tuple[NfqueueRules, ...]]:
    """The NFQUEUE delay path's chains of the run's shaping, per node that holds them."""
    from netem.nfqueue import compile_chains
    from testbed.links.plans import link_topology, traced_links

    traced = traced_links(lab, {d: plan.trace for d in plan.devices})[1] if plan.trace is not None else {}
    return chains_by_node(compile_chains(link_topology(lab), plan.tc_plans, tuple(traced)))


def _link_lines(lines: _Lines, plan: RunPlan, probes: dict[str, Any]) -> None:
    if not plan.tc_plans:
        return
    lab = lines.lab
    workdir = lab.spec.defaults.workdir
    by_node = plans_by_node(plan.tc_plans)
    chains = run_chains(lab, plan)
    sudo = lab.spec.defaults.sudo
    touched = list(dict.fromkeys([*by_node, *chains]))
    for name in touched:
        if name not in probes:  # the plan's own read is reused when it has one
            lines.add(name, "configure", "read the interfaces, journal and kernel before shaping",
                      _sh(_probe_script(lab, plan_devices(by_node.get(name, [])))), "live")  # fmt: skip
    for name in shapeable_nodes(lab):
        if name not in touched:
            lines.add(name, "configure", "clear earlier shaping of a node this run does not shape",
                      _sh(node_journal.read_script(workdir)))  # fmt: skip
    for name in touched:
        plans, held = by_node.get(name, []), chains.get(name, ())
        probe = probes.get(name)
        when = "if-differs" if probe is not None else "live"
        commands = [c for p in plans for c in (commands_for(p, probe.states) if probe else p.apply_commands())]
        commands += probe.chain_commands(held) if probe else [c for r in held for c in r.apply_commands()]
        queued = any(r.queues for r in held)
        directory = plan.contexts[name].path(node_journal.journal_dir(workdir)) if name in plan.contexts else None
        if queued:
            lines.add(name, "configure", "where the delay handler lives", _where_handler_lives(workdir), when)
            lines.add(name, "configure", "stop the delay handler of an earlier apply",
                      command_line(handler_command("stop", directory or node_journal.journal_dir(workdir), sudo=sudo)),
                      "live")  # fmt: skip
        lines.store(name, "configure", "write the link journal (the interfaces, rules and handler as they were)",
                    node_journal.journal_path(workdir), "if-differs")  # fmt: skip
        lines.add(name, "configure", "shape the links", _sh(node_journal.commands_script(commands, sudo)), when)
        if queued and directory is not None:
            start = handler_command("start", directory, sudo=sudo)
            lines.add(name, "configure", "start the delay handler (root-owned, detached; returns once its queues are "
                      "bound)", command_line(start), when, f"(its queues on stdin) {shlex.join(start)}")  # fmt: skip
        if plans:
            lines.add(name, "configure", "read tc back", _sh(_read_script(plan_devices(plans))), "if-differs")
        if held:
            lines.add(name, "configure", "read iptables back", _sh(iptables_read_script(sudo)), when)
    if plan.trace is not None:
        _trace_lines(lines, plan)


def _where_handler_lives(workdir: str) -> str:
    """The journal's directory as an absolute path (the delay handler is named by it): ``node_directory``."""
    return _sh("echo " + quote_path(node_journal.journal_dir(workdir)))


def _trace_lines(lines: _Lines, plan: RunPlan) -> None:
    """A trace's later rows, played on each node whose classes it drives (see ``apply_trace``)."""
    from netem.trace import schedules
    from testbed.links.plans import traced_links

    lab = lines.lab
    workdir = lab.spec.defaults.workdir
    assert plan.trace is not None
    _links, driven = traced_links(lab, {d: plan.trace for d in plan.devices})
    for schedule in schedules(plan.tc_plans, driven, ()):
        name = schedule.node
        directory_tilde = node_journal.journal_dir(workdir)
        context = plan.contexts.get(name) or unresolved_context(lab, lab.node(name))
        directory = context.path(directory_tilde)
        pidfile, logfile = f"{directory}/trace-player.pid", f"{directory}/trace.jsonl"
        argv = [lab.spec.defaults.python, f"{directory}/link_trace_player.py", f"{directory}/trace-schedule.json",
                logfile]  # fmt: skip
        lines.add(name, "configure", "where the trace player lives", _sh("echo " + quote_path(directory_tilde)))
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
    sudo = lab.spec.defaults.sudo
    by_node, chains = plans_by_node(plan.tc_plans), run_chains(lab, plan)
    for name in dict.fromkeys([*by_node, *chains]):
        plans, held = by_node.get(name, []), chains.get(name, ())
        journal_devices = list(dict.fromkeys(plan_devices(plans) + [p.interface for p in plans if p.ifb]))
        undo = [c for r in held for c in r.undo_commands()] + _undo_for(plans)
        steps = [("read the link journal", _sh(node_journal.read_script(workdir)))]
        if any(r.queues for r in held) and name in plan.contexts:
            directory = plan.contexts[name].path(node_journal.journal_dir(workdir))
            steps.append(("where the delay handler lives", _where_handler_lives(workdir)))
            steps.append(("stop the delay handler", command_line(handler_command("stop", directory, sudo=sudo))))
        steps.append(("read tc before undoing", _sh(_read_script(journal_devices))))
        if held:
            steps.append(("read iptables before undoing", _sh(iptables_read_script(sudo))))
        undo_line = _sh(node_journal.commands_script(undo, sudo))
        steps += [
            ("undo the shaping (only what the journal says is ours)", undo_line),
            ("read tc after undoing", _sh(_read_script(journal_devices))),
        ]
        if held:
            steps.append(("read iptables after undoing", _sh(iptables_read_script(sudo))))
        steps.append(("drop the link journal", _sh(node_journal.remove_script(workdir))))
        for what, line in steps:
            lines.add(name, "restore", what, line, "at-release")


def _trace_stop_lines(lines: _Lines, plan: RunPlan) -> None:
    """A run's trace players stop when it ends (``stop_trace_players``), also where shaping stays."""
    if plan.trace is None or not plan.tc_plans:
        return
    workdir = lines.lab.spec.defaults.workdir
    for name in sorted(plans_by_node(plan.tc_plans)):
        pidfile = plan.contexts[name].path(node_journal.journal_dir(workdir)) + "/trace-player.pid"
        lines.add(name, "restore", "read the link journal", _sh(node_journal.read_script(workdir)))
        lines.add(name, "restore", "stop the trace player", _sh(background_stop_script(pidfile, 5.0)), "live")
        lines.store(name, "restore", "drop the trace player from the journal", node_journal.journal_path(workdir),
                    "live")  # fmt: skip
