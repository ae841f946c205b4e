"""What a node looks like before its links are shaped, read in one round trip (:func:`probe_script`):
the interface of the SSH session and of the management address, whether the kernel has sch_netem and
whether the NFQUEUE delay path is ready, our iptables rules, the link journal, the running delay
handler's config and tc's state of the devices to shape. From it: why shaping must be refused on the
node (:func:`refusals`, :func:`chain_refusals`), and each plan's delay path (:func:`assign_delay_paths`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from foundation.errors import NodeError
from netem import nfqueue
from netem.plan import HTB_HANDLE, INGRESS_HANDLE, TcPlan, plan_devices, plans_by_node
from netem.tc_state import InterfaceState, parse_read, read_script, split_sections
from testbed.delay_handler import installed_test
from testbed.inventory import Inventory, NodeSpec
from testbed.links import node_journal
from testbed.links.handler_lifecycle import handler_read_script, json_or_none
from testbed.links.node_journal import LinkJournal
from testbed.planned_commands import PlanLines, sh
from testbed.sudo_rules import privileged
from testbed.transport import Transport, open_transport
from testbed.transport.fanout import FanOutResult, fan_out

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

    def chain_commands(self, chains: Sequence[nfqueue.NfqueueRules]) -> list[list[str]]:
        """The iptables commands that make this node hold ``chains``, given its table and journal as read."""
        journaled = self.journal.chains if self.journal else ()
        return nfqueue.iptables_commands_for(chains, self.iptables, journaled)

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
            return probe_node(t, node, devices, inventory.spec.defaults.workdir)

    return fan_out(names, probe, description="probing interfaces")


def plan_probe(
    lines: PlanLines, name: str, devices: Sequence[str], *, phase: str, what: str, when: str = "once"
) -> None:
    """The line of :func:`probe_node` reading ``devices`` on node ``name``."""
    defaults = lines.lab.spec.defaults
    lines.add(name, phase, what, sh(probe_script(devices, defaults.workdir, defaults.sudo)), when)
