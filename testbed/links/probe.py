"""What a node looks like before its links are shaped, read in one round trip (:func:`probe_script`):
the interface of the SSH session and of the management address, whether each delay path is ready
there (:mod:`netem.delay_path`: sch_netem in the kernel, the NFQUEUE path's iptables, kernel module
and installed handler), what the paths hold there (our iptables rules), the link journal, the running
delay handler's config and tc's state of the devices to shape. From it: why shaping must be refused
on the node (:func:`refusals`, :func:`held_refusals`), and each plan's delay path
(:func:`assign_delay_paths`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from foundation.errors import NodeError
from netem.delay_path import DelayPath, HeldRules, by_path, choose, delay_path
from netem.delay_path import names as delay_path_names
from netem.plan import HTB_HANDLE, INGRESS_HANDLE, TcPlan, plan_devices, plans_by_node
from netem.tc_state import InterfaceState, parse_read, read_script, split_sections
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory, NodeSpec
from testbed.links import node_journal
from testbed.links.handler_lifecycle import handler_read_script, json_or_none
from testbed.links.node_journal import LinkJournal
from testbed.provisioning.delay_handler import installed_test, launcher_path
from testbed.provisioning.sudo_rules import privileged
from testbed.transport import Transport, open_transport
from testbed.transport.fanout import FanOutResult, fan_out


def installed(program: str) -> str:
    """An sh test that ``program`` of the suite is installed on the node (what a delay path may need)."""
    if program == "delay-handler":
        return installed_test()
    raise ValueError(f"{program!r} is not a program the suite installs on a node")


def listing_script(path: DelayPath, sudo: bool) -> str:
    """sh that prints what ``path`` holds on the node (``iptables -S`` for NFQUEUE, through the installed
    delay handler), empty where it cannot be read (the handler not installed)."""
    argv = privileged(list(path.listing_argv), sudo=sudo)
    guard = f"{installed_test()} && " if launcher_path() in argv else ""
    return f"{guard}{shlex.join(argv)} 2>/dev/null; true"


def listed_paths() -> list[DelayPath]:
    """The delay paths that hold rules outside tc (read back with a listing)."""
    return [p for p in map(delay_path, delay_path_names()) if p.listing_argv]


@dataclass(frozen=True)
class NodeProbe:
    """What one node looks like before we touch it."""

    node: str
    ssh_interface: str | None  # the interface the controller's SSH session arrives on
    management_interface: str | None  # the interface holding the node's inventory address
    journal: LinkJournal | None
    states: dict[str, InterfaceState]
    readiness: dict[str, str] = dataclasses.field(default_factory=dict)  # delay path -> its probe's answer
    listings: dict[str, str] = dataclasses.field(default_factory=dict)  # delay path -> what it holds, listed
    handler_config: dict | None = None  # the config of the delay handler running there, if one runs

    def held_commands(self, held: Sequence[HeldRules]) -> list[list[str]]:
        """The commands that make this node hold ``held`` (rules outside tc), given what each delay path
        lists there and what the journal names: an earlier apply's rules that are not held now go."""
        journaled = self.journal.held if self.journal else {}
        grouped = by_path(held)
        commands: list[list[str]] = []
        for name in dict.fromkeys([*grouped, *journaled]):
            path = delay_path(name)
            commands += path.commands(grouped.get(name, []), self.listings.get(name, ""), journaled.get(name, ()))
        return commands

    def delay_path(self, preference: str) -> str:
        """The delay path of the classes this node shapes (``defaults.delay_path``; auto: netem where the
        kernel has sch_netem, else nfqueue): :func:`netem.delay_path.choose`."""
        return choose(preference, self.readiness)


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
            *(f'echo "#### {name}"; {delay_path(name).readiness_probe(installed)}' for name in delay_path_names()),
            *(f'echo "#### {p.listing_name}"; {listing_script(p, sudo)}' for p in listed_paths()),
            node_journal.read_script(workdir),
            handler_read_script(workdir),
            read_script(devices),
        ]
    )


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
        journal=journal,
        states=parse_read(output),
        readiness={name: sections.get(name, "").strip() or "missing: not probed" for name in delay_path_names()},
        listings={p.name: sections.get(p.listing_name, "") for p in listed_paths()},
        handler_config=json_or_none(sections.get("handler", "")),
    )


def read_states(transport: Transport, devices: Sequence[str]) -> dict[str, InterfaceState]:
    return parse_read(transport.run_script(read_script(devices), timeout_s=30.0).check().stdout)


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
        netem = delay_path("netem")
        if p.has_delay_or_loss and p.delay_path == netem.name and not netem.ready(probe.readiness.get("netem", "")):
            problems.append(netem.not_ready(probe.node, probe.readiness.get("netem", ""), p.interface))
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


def held_refusals(probe: NodeProbe, held: Sequence[HeldRules]) -> list[str]:
    """Why this node cannot hold the rules its delay paths need outside tc (empty: go ahead)."""
    problems = []
    for name, rules in by_path(held).items():
        path, answer = delay_path(name), probe.readiness.get(name, "")
        if not path.ready(answer):
            problems.append(path.not_ready(probe.node, answer, ", ".join(r.description for r in rules)))
    return problems


def assign_delay_paths(
    plans: Sequence[TcPlan], probes: Mapping[str, NodeProbe], preference: str
) -> tuple[TcPlan, ...]:
    """The plans, each on its node's delay path (:meth:`NodeProbe.delay_path`; a node not probed takes
    the path named by ``preference``, netem for auto)."""
    out = []
    for p in plans:
        probe = probes.get(p.node)
        path = choose(preference, probe.readiness if probe is not None else None)
        out.append(dataclasses.replace(p, delay_path=path))
    return tuple(out)


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
            return probe_node(t, node, devices, inventory.settings_of(node).workdir)

    return fan_out(names, probe, description="probing interfaces")


def plan_probe(
    lines: PlanLines, name: str, devices: Sequence[str], *, phase: str, what: str, when: str = "once"
) -> None:
    """The line of :func:`probe_node` reading ``devices`` on node ``name``."""
    settings = lines.lab.settings_of(name)
    lines.add(name, phase, what, sh(probe_script(devices, settings.workdir, settings.sudo)), when)
