"""Applying tc plans to nodes as one transaction, reading them back, and undoing them.

``apply_plans`` first probes every node it will touch (reachable, data interface present, not the
interface of the SSH session, a delay path where a profile has delay, jitter or loss, no foreign
qdiscs in the way) and refuses, changing nothing, when any problem is found. The delay path is
chosen per node from the probe (``defaults.delay_path``; auto: netem where the kernel has it, else
the NFQUEUE path of :mod:`netem.nfqueue`). Then, on each node: the journal is written (snapshot of
the interfaces before the first apply, the iptables chains and the delay handler about to exist),
the plan's commands run (each with sudo, as one fixed program: :mod:`testbed.sudo_rules`), the delay
handler installed root-owned starts (:mod:`testbed.delay_handler`), and tc and iptables are
read back and compared with the plan. When any node fails, every node already touched is undone. ``clear_nodes``
undoes from the nodes' journals alone, so it also works after the controller was killed.

One concept, the link transaction on the nodes (probe, refuse, journal, apply, read back, undo).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import shlex
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import NodeError, TestbedError
from netem import nfqueue
from netem.plan import HTB_HANDLE, INGRESS_HANDLE, TcPlan
from netem.tc_state import InterfaceState, differences, parse_read, read_script, split_sections
from netem.trace import BandwidthTrace, NodeSchedule, delay_timelines, schedules
from testbed.delay_handler import RUN_ROOT, installed_test, launcher_path, run_dir, run_dir_script
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.links import node_journal
from testbed.links.node_journal import DeviceSnapshot, LinkJournal
from testbed.links.plans import compile_plan, link_topology, traced_links
from testbed.sudo_rules import privileged
from testbed.transport import Transport, open_transport
from testbed.transport.base import background_alive_test, quote_path
from testbed.transport.fanout import FanOutResult, NodeOutcome, fan_out

Say = Callable[[str], None]

# Prints "loaded", "builtin", "module" or "missing": whether tc can create a netem qdisc here.
NETEM_PROBE = (
    "if [ -d /sys/module/sch_netem ]; then echo loaded; "
    'elif grep -qs "/sch_netem.ko" "/lib/modules/$(uname -r)/modules.builtin"; then echo builtin; '
    "elif modprobe -n -q sch_netem 2>/dev/null; then echo module; "
    "else echo missing; fi"
)


def nfqueue_probe() -> str:
    """sh that prints ``ready`` when the NFQUEUE delay path can run on the node, else ``missing:``
    and what is missing (iptables, the kernel's nfnetlink_queue, this checkout's handler installed)."""
    return (
        "why=''; { [ -x /usr/sbin/iptables ] || [ -x /sbin/iptables ]; } || why=\"$why iptables\"; "
        "{ [ -e /proc/net/netfilter/nfnetlink_queue ] || [ -d /sys/module/nfnetlink_queue ] "
        "|| grep -qs /nfnetlink_queue.ko \"/lib/modules/$(uname -r)/modules.builtin\" "
        "|| /sbin/modprobe -n -q nfnetlink_queue 2>/dev/null; } || why=\"$why nfnetlink_queue\"; "
        f"{installed_test()} || why=\"$why delay-handler\"; "
        'if [ -z "$why" ]; then echo ready; else echo "missing:$why"; fi'
    )


def iptables_read_script(sudo: bool) -> str:
    """sh that prints our table's rules (``iptables -S``, through the installed delay handler), empty
    where the handler is not installed."""
    words = shlex.join(privileged(["iptables", "-w", "-t", nfqueue.TABLE, "-S"], sudo=sudo))
    return f"{installed_test()} && {words} 2>/dev/null; true"


@dataclass(frozen=True)
class NodeProbe:
    """What one node looks like before we touch it."""

    node: str
    ssh_interface: str | None  # the interface the controller's SSH session arrives on
    management_interface: str | None  # the interface holding the node's inventory address
    netem: str  # loaded, builtin, module or missing
    journal: LinkJournal | None
    states: dict[str, InterfaceState]
    nfqueue: str = "missing: not probed"  # ready, or what the NFQUEUE delay path lacks
    iptables: str = ""  # iptables -t mangle -S
    handler_config: dict | None = None  # the config of the delay handler running there, if one runs

    def delay_path(self, preference: str) -> str:
        """The delay path of the classes this node shapes (``defaults.delay_path``): netem where asked,
        or asked for auto and the kernel has sch_netem, else nfqueue."""
        if preference == "netem" or (preference == "auto" and self.netem != "missing"):
            return "netem"
        return "nfqueue"


def _interface_of(addr_json: str, address: str | None) -> str | None:
    if not address:
        return None
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None  # a host name: the SSH session's interface covers it
    try:
        links = json.loads(addr_json or "[]")
    except json.JSONDecodeError:
        return None
    for link in links:
        for info in link.get("addr_info", ()):
            if info.get("local") and ipaddress.ip_address(info["local"]) == wanted:
                return link.get("ifname")
    return None


def probe_script(devices: Sequence[str], workdir: str, sudo: bool = False) -> str:
    """sh that reads, in sections, everything :func:`refusals` and the apply need to know of a node."""
    return "\n".join(
        [
            'echo "#### ssh"; echo "${SSH_CONNECTION:-}"',
            'echo "#### addr"; ip -j addr show 2>/dev/null || echo "[]"',
            f'echo "#### netem"; {NETEM_PROBE}',
            f'echo "#### nfqueue"; {nfqueue_probe()}',
            f'echo "#### iptables"; {iptables_read_script(sudo)}',
            node_journal.read_script(workdir),
            handler_read_script(workdir),
            read_script(devices),
        ]
    )


def handler_read_script(workdir: str) -> str:
    """sh that prints, in a ``#### handler`` section, the running delay handler's config (nothing when
    none runs): a re-apply with the same queues leaves it alone."""
    rundir = f"$({run_dir_script(quote_path(node_journal.journal_dir(workdir)))})"
    return f'echo "#### handler"; r={rundir}; if {_alive_in("$r")}; then cat "$r/config.json"; fi; echo'


def _alive_in(rundir_word: str) -> str:
    """A shell test that succeeds while the handler whose run directory ``rundir_word`` names runs."""
    pidfile = f"{rundir_word}/handler.pid"
    return (f'{{ [ -s {pidfile} ] && read pid start < {pidfile} && [ -n "$pid" ] && '
            f'[ "$(sed \'s/.*) //\' /proc/$pid/stat 2>/dev/null | cut -d\' \' -f20)" = "$start" ]; }}')  # fmt: skip


def probe_node(transport: Transport, node: NodeSpec, devices: Sequence[str], workdir: str) -> NodeProbe:
    script = probe_script(devices, workdir, transport.use_sudo)
    output = transport.run_script(script, timeout_s=30.0).check().stdout
    sections = split_sections(output)
    ssh = sections.get("ssh", "").split()
    addr_json = sections.get("addr", "")
    try:
        journal = node_journal.parse_read(output)
    except (ValueError, KeyError) as exc:
        raise NodeError(node.name, f"its link journal cannot be read ({exc}); fix or remove it by hand") from None
    return NodeProbe(
        node=node.name,
        ssh_interface=_interface_of(addr_json, ssh[2]) if len(ssh) >= 3 else None,
        management_interface=_interface_of(addr_json, node.address),
        netem=sections.get("netem", "").strip() or "missing",
        journal=journal,
        states=parse_read(output),
        nfqueue=sections.get("nfqueue", "").strip() or "missing: not probed",
        iptables=sections.get("iptables", ""),
        handler_config=_json_or_none(sections.get("handler", "")),
    )


def _json_or_none(text: str) -> dict | None:
    try:
        value = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None  # half written: a new handler is started
    return value if isinstance(value, dict) else None


def read_states(transport: Transport, devices: Sequence[str]) -> dict[str, InterfaceState]:
    return parse_read(transport.run_script(read_script(devices), timeout_s=30.0).check().stdout)


def plan_devices(plans: Sequence[TcPlan]) -> list[str]:
    """Every device the plans put a qdisc on or create."""
    devices: list[str] = []
    for p in plans:
        devices += [p.interface] + ([p.ifb] if p.ifb else [])
    return list(dict.fromkeys(devices))


def refusals(probe: NodeProbe, plans: Sequence[TcPlan]) -> list[str]:
    """Why the plans must not be applied on this node (empty: go ahead)."""
    problems = []
    owned = probe.journal or LinkJournal(devices={})
    for p in plans:
        where = f"{probe.node}: {p.interface}"
        state = probe.states.get(p.interface)
        if state is None or not state.exists:
            problems.append(f"{where} does not exist on the node (check data.interface in the inventory)")
            continue
        for what, iface in (("SSH session", probe.ssh_interface), ("management address", probe.management_interface)):
            if iface == p.interface:
                problems.append(
                    f"{where} carries the node's {what}: shaping it could cut the controller off; "
                    "give the node a separate data interface"
                )
        if p.has_delay_or_loss and p.delay_path == "netem" and probe.netem == "missing":
            problems.append(
                f"{where}: a profile has delay, jitter or loss and defaults.delay_path is netem, but the kernel "
                "has no sch_netem; set delay_path to auto (the NFQUEUE path) or drop delay/jitter/loss"
            )
        root = state.root_qdisc
        if root is not None and root.get("handle") not in ("0:", f"{HTB_HANDLE}:") and not p.ifb:
            problems.append(
                f"{where} has a root qdisc {root.get('kind')} {root.get('handle')} that is not ours; remove it "
                f"(tc qdisc del dev {p.interface} root) or find out who set it"
            )
        if p.ifb:
            if state.qdisc(f"{INGRESS_HANDLE}:") is not None and p.interface not in owned.ingress_on:
                problems.append(f"{where} already has an ingress qdisc that is not ours")
            if any(q.get("kind") == "clsact" for q in state.qdiscs):
                problems.append(f"{where} has a clsact qdisc; ingress shaping needs the ingress hook")
            ifb = probe.states.get(p.ifb)
            if ifb is not None and ifb.exists and p.ifb not in owned.ifbs:
                problems.append(f"{probe.node}: device {p.ifb} exists and is not ours")
    return problems


def chain_refusals(probe: NodeProbe, chains: Sequence[nfqueue.NfqueueRules]) -> list[str]:
    """Why this node cannot hold the NFQUEUE chains of the directions it receives (empty: go ahead)."""
    if not chains or probe.nfqueue == "ready":
        return []
    directions = ", ".join(f"{d.sender} -> {d.receiver}" for c in chains for d in c.directions)
    return [
        f"{probe.node}: the NFQUEUE delay path is not ready ({probe.nfqueue}) for {directions} (the kernel has no "
        "sch_netem); install iptables, and the delay handler root-owned (`testbed provision` does, or says the one "
        "command to run as root; its Python needs NetfilterQueue, which needs libnetfilter-queue), or drop "
        "delay/jitter/loss from the profile"
    ]


def assign_delay_paths(
    plans: Sequence[TcPlan], probes: Mapping[str, NodeProbe], preference: str
) -> tuple[TcPlan, ...]:
    """The plans, each on its node's delay path (:meth:`NodeProbe.delay_path`; a node not probed takes
    the path named by ``preference``, netem for auto)."""
    out = []
    for p in plans:
        probe = probes.get(p.node)
        path = probe.delay_path(preference) if probe is not None else preference.replace("auto", "netem")
        out.append(dataclasses.replace(p, delay_path=path))
    return tuple(out)


def chains_by_node(chains: Sequence[nfqueue.NfqueueRules]) -> dict[str, tuple[nfqueue.NfqueueRules, ...]]:
    by_node: dict[str, list[nfqueue.NfqueueRules]] = {}
    for c in chains:
        by_node.setdefault(c.node, []).append(c)
    return {name: tuple(cs) for name, cs in by_node.items()}


def handler_files(directory: str) -> dict[str, str]:
    """Where the delay handler named by ``directory`` (the journal's, absolute) keeps its config,
    pidfile, log and stats: root's run directory of it, which the user reads."""
    rundir = run_dir(directory)
    return {"dir": rundir, "config": f"{rundir}/config.json", "pidfile": f"{rundir}/handler.pid",
            "log": f"{rundir}/log", "stats": f"{rundir}/stats.jsonl"}  # fmt: skip


def handler_command(action: str, directory: str, *, sudo: bool) -> list[str]:
    """The installed delay handler's ``start``, ``stop`` or ``retime`` of the handler for ``directory``."""
    return privileged([launcher_path(), action, directory], sudo=sudo)


def _journal_for(
    probe: NodeProbe, plans: Sequence[TcPlan], chains: Sequence[nfqueue.NfqueueRules], handler_pidfile: str | None
) -> LinkJournal:
    devices = {}
    for dev in plan_devices(plans):
        state = probe.states.get(dev)
        qdiscs = state.qdiscs if state is not None and state.exists else ()
        devices[dev] = DeviceSnapshot(qdiscs, state.class_text if state is not None else "")
    new = LinkJournal(
        devices=devices,
        ingress_on=tuple(p.interface for p in plans if p.ifb),
        ifbs=tuple(p.ifb for p in plans if p.ifb),
        chains=tuple((c.interface, c.hook_side) for c in chains),
        handler_pidfile=handler_pidfile,
        extra={"written_unix_s": round(time.time(), 3), "by": "testbed link apply"},
    )
    return probe.journal.merged_with(new) if probe.journal else new


def commands_for(plan: TcPlan, states: dict[str, InterfaceState]) -> list[list[str]]:
    """The plan's commands, taking what is already there into account: our root is kept (HTB's
    root cannot be replaced in place) and classes it no longer plans are removed."""
    dev = plan.shaped_device
    state = states.get(dev)
    root = state.root_qdisc if state is not None and state.exists else None
    iface = states.get(plan.interface)
    ours = root is not None and root.get("handle") == f"{HTB_HANDLE}:"
    if plan.ifb:
        ours = ours and iface is not None and iface.qdisc(f"{INGRESS_HANDLE}:") is not None
    commands: list[list[str]] = []
    if plan.ifb and not ours and state is not None and state.exists:
        commands.append(["ip", "link", "del", plan.ifb])  # ours but half made: start over
    if ours:
        planned = {f"{HTB_HANDLE}:{p.minor:x}" for p in plan.peers}
        for c in state.classes if state is not None else ():
            if c.classid not in planned:
                minor = c.classid.split(":")[1]
                commands += [
                    ["tc", "filter", "del", "dev", dev, "parent", f"{HTB_HANDLE}:", "protocol", "ip", "prio", "1",
                     "handle", f"800::{minor}", "u32"],
                    ["tc", "class", "del", "dev", dev, "classid", c.classid],
                ]  # fmt: skip
                if plan.ifb:
                    commands.append(
                        ["tc", "filter", "del", "dev", plan.interface, "parent", f"{INGRESS_HANDLE}:", "protocol",
                         "ip", "prio", "1", "handle", f"800::{minor}", "u32"]
                    )  # fmt: skip
    return commands + plan.apply_commands(ours_in_place=ours)


def iptables_commands_for(chains: Sequence[nfqueue.NfqueueRules], probe: NodeProbe) -> list[list[str]]:
    """The iptables commands of a node's chains, given what its mangle table holds now: our chains
    are flushed and refilled in place, chains of an earlier apply that are no longer planned go."""
    planned = {(c.interface, c.hook_side) for c in chains}
    listing = probe.iptables
    commands: list[list[str]] = []
    stale = [c for c in (probe.journal.chains if probe.journal else ()) if c not in planned]
    if stale:
        commands += nfqueue.undo_present_chains(stale, listing)
    present = nfqueue.chains_in(listing)
    for c in chains:
        commands += c.apply_commands(
            chain_exists=c.chain in present, jump_exists=nfqueue.has_jump(listing, c.interface, c.hook_side)
        )
    return commands


@dataclass(frozen=True)
class NodeApplied:
    node: str
    plans: tuple[TcPlan, ...]
    commands: int
    states: dict[str, InterfaceState]
    changed: bool = True  # False: the node already held the plans (ours, read back), nothing was sent
    chains: tuple[nfqueue.NfqueueRules, ...] = ()  # the NFQUEUE delay path's chains it holds


def holds_plans(
    probe: NodeProbe, plans: Sequence[TcPlan], chains: Sequence[nfqueue.NfqueueRules] = (), seed: int = 0
) -> bool:
    """Whether the node already holds ``plans`` and ``chains`` as our shaping, exactly as read when
    probing, with no trace player running: then applying them would change nothing. That includes
    the rules read back and a delay handler running with the same queues and seed. (netem's delay
    and loss are not compared, so a plan on the netem delay path with them is always applied.)"""
    if probe.journal is None or probe.journal.trace_pidfile or any(p.uses_netem for p in plans):
        return False
    present = nfqueue.chains_in(probe.iptables)
    ours_there = {c for c in probe.journal.chains if nfqueue.chain_name(*c) in present}
    if ours_there != {(c.interface, c.hook_side) for c in chains}:
        return False  # an earlier apply's chains that are not planned now, or planned ones missing
    if any(nfqueue.rule_differences(c, probe.iptables) for c in chains):
        return False
    if any(c.queues for c in chains):
        running = probe.handler_config
        wanted = json.loads(json.dumps(nfqueue.handler_config(chains, seed=seed)))
        drawn = any(q["jitter_s"] or "loss_pct" in q for q in wanted["queues"])
        keys = [k for k in wanted if k != "seed" or drawn]  # the seed matters only to jitter and loss draws
        if running is None or any(running.get(k) != wanted[k] for k in keys):
            return False
    return not any(differences(p, probe.states) for p in plans)


def node_directory(transport: Transport, workdir: str) -> str:
    """The journal's directory on the node, as an absolute path (argv words are not expanded by a
    shell, so what a detached process is given must be absolute)."""
    return transport.run_script("echo " + quote_path(node_journal.journal_dir(workdir))).check().stdout.strip()


HANDLER_READY_S = 10.0  # nodes/link_delay_handler.py READY_S: its start returns within this
HANDLER_WAIT_S = HANDLER_READY_S + 20.0  # its stop (TERM, 5 s, KILL) and the SSH round trips besides


def start_delay_handler(transport: Transport, directory: str, config: dict) -> None:
    """Start the installed handler for ``directory`` (with sudo: binding a queue needs CAP_NET_ADMIN)
    with ``config``; it returns once every queue is bound."""
    result = transport.run(handler_command("start", directory, sudo=False), sudo=True, timeout_s=HANDLER_WAIT_S,
                           stdin=json.dumps(config).encode())  # fmt: skip
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip())[-600:] or f"exit status {result.exit_code}"
        raise NodeError(transport.node, f"the NFQUEUE delay handler did not start: {detail}")


def stop_delay_handler(transport: Transport, directory: str) -> str:
    """Stop the handler for ``directory``: ``stopped``, ``killed``, ``stale`` or ``absent``."""
    result = transport.run(handler_command("stop", directory, sudo=False), sudo=True, timeout_s=HANDLER_WAIT_S)
    return result.check().stdout.strip().splitlines()[-1]


def retime_delay_handler(
    transport: Transport, directory: str, start_unix_s: float, timelines: Mapping[int, list]
) -> None:
    """Give the running delay handler a trace's delay rows per queue, reckoned from ``start_unix_s``
    (it rewrites its config, then SIGHUP makes it read the rows again)."""
    update = {"start_unix_s": start_unix_s, "timelines": {str(q): rows for q, rows in timelines.items()}}
    result = transport.run(handler_command("retime", directory, sudo=False), sudo=True, timeout_s=HANDLER_WAIT_S,
                           stdin=json.dumps(update).encode())  # fmt: skip
    if not result.ok:
        detail = (result.stdout.strip() + " " + result.stderr.strip()).strip()[-300:]
        raise NodeError(transport.node, f"the NFQUEUE delay handler is not running ({detail}): the trace's delays")


def stop_earlier_handler(transport: Transport, directory: str, pidfile: str | None) -> str:
    """Stop the handler a journal names: the installed one's (root's run directory), or one a journal
    of an earlier version names in the user's directory (stopped as the user: no sudo'd shell)."""
    if pidfile is not None and not pidfile.startswith(RUN_ROOT + "/"):
        return transport.stop_background(pidfile)
    return stop_delay_handler(transport, directory)


def apply_on_node(
    transport: Transport, probe: NodeProbe, plans: Sequence[TcPlan], workdir: str, *,
    chains: Sequence[nfqueue.NfqueueRules] = (), seed: int = 0,
) -> NodeApplied:
    """Journal first, then the commands, then the delay handler, then read back and compare.
    Raises :class:`NodeError` naming the interface and the difference when the read-back does not
    match. A node that already holds the plans is left alone (its journal keeps the snapshot from
    before the first apply)."""
    if holds_plans(probe, plans, chains, seed):
        return NodeApplied(probe.node, tuple(plans), 0, probe.states, changed=False, chains=tuple(chains))
    queued = any(c.queues for c in chains)
    earlier = probe.journal is not None and probe.journal.handler_pidfile is not None
    # the handler is named by the journal's directory as an absolute path
    directory = node_directory(transport, workdir) if queued or earlier else None
    files = handler_files(directory) if directory is not None and queued else None
    journal = _journal_for(probe, plans, chains, files["pidfile"] if files else None)
    if journal.trace_pidfile:  # a trace still playing would overwrite the new rates
        transport.stop_background(journal.trace_pidfile)
        journal = journal.with_trace(None)
    if earlier and directory is not None:  # the new config starts a new one
        stop_earlier_handler(transport, directory, probe.journal.handler_pidfile if probe.journal else None)
    commands = [c for p in plans for c in commands_for(p, probe.states)] + iptables_commands_for(chains, probe)
    node_journal.write(transport, workdir, journal)  # names the chains and the handler before they exist
    transport.run_script(node_journal.commands_script(commands, transport.use_sudo), timeout_s=60.0).check()
    if directory is not None and queued:
        start_delay_handler(transport, directory, nfqueue.handler_config(chains, seed=seed))
    states = read_states(transport, plan_devices(plans)) if plans else {}
    problems = [d for p in plans for d in differences(p, states)]
    if chains:
        listing = transport.run_script(iptables_read_script(transport.use_sudo), timeout_s=30.0).check().stdout
        problems += [d for c in chains for d in nfqueue.rule_differences(c, listing)]
    if problems:
        raise NodeError(probe.node, "read-back differs from the plan: " + "; ".join(problems))
    return NodeApplied(probe.node, tuple(plans), len(commands), states, chains=tuple(chains))


@dataclass(frozen=True)
class NodeCleared:
    node: str
    had_journal: bool
    commands: int
    trace_stopped: str | None
    leftovers: tuple[str, ...]  # differences from the snapshot after undo


def clear_on_node(transport: Transport, node: str, workdir: str) -> NodeCleared:
    """Undo from the node's journal: stop the trace player and the delay handler, remove what we own
    (qdiscs, ifbs, iptables chains), compare with the snapshot, then drop the journal."""
    journal = node_journal.read(transport, workdir)
    if journal is None:
        return NodeCleared(node, False, 0, None, ())
    stopped = None
    if journal.trace_pidfile:
        stopped = transport.stop_background(journal.trace_pidfile)
    if journal.handler_pidfile:
        stop_earlier_handler(transport, node_directory(transport, workdir), journal.handler_pidfile)
    devices = list(dict.fromkeys([*journal.devices, *journal.ingress_on, *journal.ifbs]))

    def read_listing() -> str:
        if not journal.chains:
            return ""
        return transport.run_script(iptables_read_script(transport.use_sudo), timeout_s=30.0).check().stdout

    states = read_states(transport, devices)
    commands = journal.chain_undo_commands(read_listing()) + journal.undo_commands(states)
    if commands:
        transport.run_script(node_journal.commands_script(commands, transport.use_sudo), timeout_s=60.0).check()
    after, listing = read_states(transport, devices), read_listing()
    leftovers = journal.snapshot_differences(after, listing)
    still_ours = journal.undo_commands(after) + journal.chain_undo_commands(listing)
    if still_ours:
        raise NodeError(node, "after undo, still ours: " + "; ".join(" ".join(c) for c in still_ours))
    transport.run_script(node_journal.remove_script(workdir), timeout_s=30.0).check()
    return NodeCleared(node, True, len(commands), stopped, tuple(leftovers))


@dataclass(frozen=True)
class ApplyResult:
    applied: FanOutResult[NodeApplied]
    rolled_back: FanOutResult[NodeCleared] | None  # when a node failed, every touched node undone

    @property
    def ok(self) -> bool:
        return self.applied.ok


def _workdir(inventory: Inventory) -> str:
    return inventory.spec.defaults.workdir


def plans_by_node(plans: Sequence[TcPlan]) -> dict[str, list[TcPlan]]:
    by_node: dict[str, list[TcPlan]] = {}
    for p in plans:
        by_node.setdefault(p.node, []).append(p)
    return by_node


def probe_nodes(
    inventory: Inventory, plans: Sequence[TcPlan], also: Sequence[str] = ()
) -> FanOutResult[NodeProbe]:
    """Probe the nodes of ``plans`` (reading their plans' devices) and the nodes ``also`` (chain
    holders without a tc plan: their journal, kernel and iptables)."""
    by_node = plans_by_node(plans)
    names = list(dict.fromkeys([*by_node, *also]))

    def probe(name: str) -> NodeProbe:
        with open_transport(inventory, inventory.node(name)) as t:
            node, devices = inventory.node(name), plan_devices(by_node.get(name, []))
            return probe_node(t, node, devices, _workdir(inventory))

    return fan_out(names, probe, description="probing interfaces")


def apply_plans(
    inventory: Inventory,
    plans: Sequence[TcPlan],
    *,
    say: Say = lambda _: None,
    probes: Mapping[str, NodeProbe] | None = None,
    seed: int = 0,
    traced: Collection[tuple[str, str]] = (),
) -> ApplyResult:
    """Apply all plans or none: refuse up front (TestbedError, nothing changed) when a node is
    unfit; when applying fails on any node, undo every node (NodeError outcomes say why). Nodes
    that carry shaping from an earlier apply but have no plan now are cleared, so what is shaped
    afterwards is exactly the plans. ``probes``: what a run plan read from the nodes moments before
    (its tc commands were reconciled against them); nodes without one are probed now. Each plan
    goes on its node's delay path; ``seed`` seeds the NFQUEUE handlers' jitter and loss draws;
    ``traced``: the (sender, receiver) pairs a trace drives (their handlers draw the rows' loss)."""
    by_node = plans_by_node(plans)
    probe_of = {name: probe for name, probe in (probes or {}).items() if name in by_node}

    def probe_more(missing: Sequence[TcPlan], also: Sequence[str] = ()) -> None:
        fresh = probe_nodes(inventory, missing, also)
        if not fresh.ok:
            failed = "; ".join(f"{o.node}: {o.error}" for o in fresh.failed)
            raise NodeError("probe", f"cannot reach every node to shape, nothing changed: {failed}")
        probe_of.update(fresh.values())

    missing = [p for p in plans if p.node not in probe_of]
    if missing:
        probe_more(missing)
    plans = assign_delay_paths(plans, probe_of, inventory.spec.defaults.delay_path)
    by_node = plans_by_node(plans)
    chains = chains_by_node(nfqueue.compile_chains(link_topology(inventory), plans, traced))
    holders = [name for name in chains if name not in probe_of]
    if holders:  # receivers that shape nothing themselves hold the rules of what they receive
        probe_more([], [name for name in holders if name not in (probes or {})])
        probe_of.update({name: (probes or {})[name] for name in holders if name in (probes or {})})
    found = [r for name, probe in probe_of.items() for r in refusals(probe, by_node.get(name, []))]
    found += [r for name, cs in chains.items() for r in chain_refusals(probe_of[name], cs)]
    if found:
        raise TestbedError("refusing to shape links, nothing was changed:\n  " + "\n  ".join(found))
    touched = list(dict.fromkeys([*by_node, *chains]))
    # The plans say what is shaped: nodes shaped earlier that have no plan now are cleared.
    others = [n for n in shapeable_nodes(inventory) if n not in touched]
    for o in clear_nodes(inventory, others).outcomes:
        if not o.ok:
            say(f"{o.node}: could not clear its earlier shaping: {o.error}")
        elif o.value is not None and o.value.had_journal:
            say(f"{o.node}: earlier shaping removed (no link of this apply starts or ends there)")

    def apply(name: str) -> NodeApplied:
        with open_transport(inventory, inventory.node(name)) as t:
            return apply_on_node(
                t, probe_of[name], by_node.get(name, []), _workdir(inventory), chains=chains.get(name, ()), seed=seed,
            )  # fmt: skip

    applied = fan_out(touched, apply, description="shaping links")
    rolled_back = None
    if not applied.ok:
        say("shaping failed on " + ", ".join(o.node for o in applied.failed) + "; undoing every node")
        rolled_back = clear_nodes(inventory, touched)
    return ApplyResult(applied, rolled_back)


def shapeable_nodes(inventory: Inventory) -> list[str]:
    """Nodes that can hold our qdiscs (phones cannot: they are shaped on the receiving side)."""
    return [n.name for n in inventory.nodes if kind_of(n).shapes_links]


def clear_nodes(inventory: Inventory, names: Sequence[str] | None = None) -> FanOutResult[NodeCleared]:
    names = list(names) if names is not None else shapeable_nodes(inventory)

    def clear(name: str) -> NodeCleared:
        with open_transport(inventory, inventory.node(name)) as t:
            return clear_on_node(t, name, _workdir(inventory))

    return fan_out(names, clear, description="clearing links")


def stop_trace_players(inventory: Inventory, names: Sequence[str]) -> FanOutResult[str | None]:
    """Stop the trace players on ``names`` and drop them from the journals (the shaping stays, as the
    last row left it): a run's trace ends with the run, also when the next run keeps the links."""
    workdir = _workdir(inventory)

    def stop(name: str) -> str | None:
        with open_transport(inventory, inventory.node(name)) as t:
            journal = node_journal.read(t, workdir)
            if journal is None or not journal.trace_pidfile:
                return None
            how = t.stop_background(journal.trace_pidfile)  # it runs as the user; its tc commands with sudo
            node_journal.write(t, workdir, journal.with_trace(None))
            return how

    return fan_out(list(names), stop, description="stopping trace players")


@dataclass(frozen=True)
class NodeShaping:
    """What is shaped on one node, read back."""

    node: str
    journal: LinkJournal | None
    states: dict[str, InterfaceState]
    chains: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # our iptables chains, as -S prints
    handler: tuple[dict, ...] = ()  # the delay handler's latest stats line per queue (none: not running)


def show_nodes(inventory: Inventory, names: Sequence[str] | None = None) -> FanOutResult[NodeShaping]:
    names = list(names) if names is not None else shapeable_nodes(inventory)

    def show(name: str) -> NodeShaping:
        node = inventory.node(name)
        devices = [node.data.interface] if node.data else []
        with open_transport(inventory, node) as t:
            journal = node_journal.read(t, _workdir(inventory))
            if journal:
                devices += [*journal.devices, *journal.ifbs]
            states = read_states(t, list(dict.fromkeys(devices)))
            if journal is None or not journal.chains:
                return NodeShaping(name, journal, states)
            listing = t.run_script(iptables_read_script(t.use_sudo), timeout_s=30.0).check().stdout
            chains = {nfqueue.chain_name(i, side): nfqueue.chain_lines(listing, nfqueue.chain_name(i, side))
                      for i, side in journal.chains}  # fmt: skip
            handler: tuple[dict, ...] = ()
            if journal.handler_pidfile and journal.handler_pidfile.startswith(RUN_ROOT + "/"):
                pidfile = journal.handler_pidfile
                stats = pidfile.rsplit("/", 1)[0] + "/stats.jsonl"
                text = t.run_script(f"if {background_alive_test(pidfile)}; then tail -n 64 "
                                    f"{quote_path(stats)}; fi").stdout  # fmt: skip
                latest: dict[int, dict] = {}
                for line in text.splitlines():
                    record = _json_or_none(line)
                    if record and record.get("event") == "stats":
                        latest[record["queue_num"]] = record
                handler = tuple(latest[k] for k in sorted(latest))
            return NodeShaping(name, journal, states, chains, handler)

    return fan_out(names, show, description="reading tc and iptables")


def handler_report_script(files: Mapping[str, str]) -> str:
    """sh that prints ``alive`` while the delay handler runs, then its latest stats lines."""
    return (f"if {background_alive_test(files['pidfile'])}; then echo alive; fi; "
            f"tail -n {HANDLER_REPORT_LINES} {quote_path(files['stats'])} 2>/dev/null; true")  # fmt: skip


HANDLER_REPORT_LINES = 20_000  # a queue's line a second: hours of a few queues


@dataclass(frozen=True)
class DelayHandlerReport:
    """What one node's delay handler did since a time: per second and queue, how late its releases
    were (the NFQUEUE path's own delay error), and whether it still runs."""

    node: str
    alive: bool
    seconds: int  # stats lines (one per queue and second)
    packets: int
    late_mean_ms_worst_second: float | None
    late_max_ms: float | None
    dropped: int  # drawn by the handler (correlated or trace loss)


def parse_handler_report(node: str, output: str, since_unix_s: float) -> DelayHandlerReport:
    lines = output.splitlines()
    alive = bool(lines) and lines[0] == "alive"
    stats = [r for r in (_json_or_none(line) for line in lines[1 if alive else 0:])
             if r and r.get("event") == "stats" and r.get("unix_s", 0) >= since_unix_s]  # fmt: skip
    means = [r["late_mean_ms"] for r in stats if r.get("late_mean_ms") is not None]
    return DelayHandlerReport(
        node, alive, len(stats), sum(r["packets"] for r in stats), max(means) if means else None,
        max((r["late_max_ms"] for r in stats), default=None), sum(r["dropped"] for r in stats),
    )


def read_delay_handlers(
    inventory: Inventory, directories: Mapping[str, str], since_unix_s: float
) -> FanOutResult[DelayHandlerReport]:
    """Each node's delay handler record since ``since_unix_s`` (``directories``: node -> the journal's
    directory there, as a path)."""

    def read(name: str) -> DelayHandlerReport:
        with open_transport(inventory, inventory.node(name)) as t:
            output = t.run_script(handler_report_script(handler_files(directories[name])), timeout_s=30.0).stdout
            return parse_handler_report(name, output, since_unix_s)

    return fan_out(list(directories), read, description="reading delay handlers")


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
    workdir = _workdir(inventory)
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
