"""Link profiles compiled to tc plans: per node and interface, the exact commands that shape it and
the commands that undo it.

Egress shaping, on the sending node's data interface: an HTB root with our handle, one class per
destination (u32 filter on the destination address), and under each class either a netem qdisc
(when the profile asks for delay, jitter or loss and the plan's delay path is netem) or a pfifo whose
limit is derived from the bandwidth-delay product. On the NFQUEUE delay path (kernels without
sch_netem) the leaf stays a pfifo and :mod:`netem.nfqueue` adds the delay and loss. Traffic to
unshaped destinations bypasses HTB's classes.

Ingress shaping, for a direction whose sender cannot run tc (a phone): the receiver redirects the
sender's packets from its data interface's ingress to an ifb device and shapes them there the same
way, with one class per source (u32 on the source address).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.errors import TestbedError
from netem.profile import DirectedLink, LinkProfile
from netem.topology import LinkTopology

HTB_HANDLE = "1f7b"  # major handle of every qdisc we own (hex); tc shows it as 1f7b:
INGRESS_HANDLE = "ffff"
MTU_BYTES = 1500
MIN_QUEUE_PACKETS = 64
BASE_RTT_S = 0.02  # queueing headroom for rate-only links (no configured delay)
HTB_QUANTUM_MIN_BYTES = 2 * MTU_BYTES


def queue_limit_packets(profile: LinkProfile) -> int:
    """The profile's queue limit, else 1.5 x the bandwidth-delay product in MTU-sized packets
    (delay + 4 x jitter + a 20 ms base RTT), at least 64: never netem's bare 1000 at high BDP."""
    if profile.queue_limit_packets is not None:
        return profile.queue_limit_packets
    if profile.rate_bit_s is None:
        return 1000
    rtt_s = (profile.delay_s or 0.0) + 4 * (profile.jitter_s or 0.0) + BASE_RTT_S
    bdp_packets = profile.rate_bit_s / 8 * rtt_s / MTU_BYTES
    return max(MIN_QUEUE_PACKETS, math.ceil(1.5 * bdp_packets))


def burst_bytes(rate_bit_s: float) -> int:
    """HTB burst: what the rate sends in 5 ms, at least two full packets."""
    return max(HTB_QUANTUM_MIN_BYTES, math.ceil(rate_bit_s / 8 * 0.005))


def quantum_bytes(rate_bit_s: float) -> int:
    """HTB quantum (bytes a class sends per round): what the rate sends in 10 ms, within what HTB
    accepts without warning (one MTU to 200000; its default, rate/10, warns above 16 mbit)."""
    return min(200_000, max(MTU_BYTES, math.ceil(rate_bit_s / 8 * 0.01)))


def netem_args(profile: LinkProfile) -> list[str]:
    """netem's words for the profile's delay, jitter and loss (empty when it has none)."""
    args = []
    if profile.delay_s or profile.jitter_s:
        args += ["delay", f"{round((profile.delay_s or 0) * 1e6)}us"]
        if profile.jitter_s:
            args += [f"{round(profile.jitter_s * 1e6)}us"]
            if profile.distribution:
                args += ["distribution", profile.distribution]
    if profile.loss_pct:
        args += ["loss", f"{profile.loss_pct:g}%"]
        if profile.loss_correlation_pct:
            args += [f"{profile.loss_correlation_pct:g}%"]
    return args


@dataclass(frozen=True)
class ShapedPeer:
    """One class: traffic to (egress) or from (ingress) one peer address, shaped by one profile."""

    peer: str  # node name
    peer_address: str
    profile_name: str
    profile: LinkProfile
    minor: int  # class 1f7b:<minor>, leaf qdisc <minor>:


@dataclass(frozen=True)
class TcPlan:
    """Everything shaped on one interface of one node, and how to apply and undo it."""

    node: str
    interface: str  # the data interface
    direction: str  # egress or ingress
    peers: tuple[ShapedPeer, ...]
    ifb: str | None = None  # the ifb device ingress shaping happens on
    delay_path: str = "netem"  # netem (a leaf qdisc) or nfqueue (netem.nfqueue: iptables + a handler)

    @property
    def shaped_device(self) -> str:
        return self.ifb or self.interface

    @property
    def has_delay_or_loss(self) -> bool:
        return any(p.profile.has_delay_or_loss for p in self.peers)

    @property
    def uses_netem(self) -> bool:
        """Whether a peer's leaf is a netem qdisc (delay or loss, on the netem delay path)."""
        return self.delay_path == "netem" and self.has_delay_or_loss

    def leaf_kind(self, peer: ShapedPeer) -> str:
        return "netem" if self.delay_path == "netem" and peer.profile.has_delay_or_loss else "pfifo"

    def apply_commands(self, *, ours_in_place: bool = False) -> list[list[str]]:
        """The commands that shape the interface. With ``ours_in_place`` (read back: our root qdisc,
        and ifb, are there already) the root is kept and only classes, leaves and filters are
        replaced: HTB's root cannot be changed in place, everything under it can."""
        dev = self.shaped_device
        commands: list[list[str]] = []
        if self.ifb and not ours_in_place:
            commands += [
                ["ip", "link", "add", self.ifb, "type", "ifb"],
                ["ip", "link", "set", self.ifb, "up"],
                ["tc", "qdisc", "replace", "dev", self.interface, "handle", f"{INGRESS_HANDLE}:", "ingress"],
            ]
        if not ours_in_place:
            commands.append(["tc", "qdisc", "replace", "dev", dev, "root", "handle", f"{HTB_HANDLE}:", "htb"])
        match = "dst" if self.direction == "egress" else "src"
        for p in self.peers:
            classid = f"{HTB_HANDLE}:{p.minor:x}"
            rate = f"{round(p.profile.rate_bit_s)}bit" if p.profile.rate_bit_s else "100gbit"
            burst = f"{burst_bytes(p.profile.rate_bit_s or 1e11)}b"
            commands.append(
                ["tc", "class", "replace", "dev", dev, "parent", f"{HTB_HANDLE}:", "classid", classid,
                 "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
                 "quantum", str(quantum_bytes(p.profile.rate_bit_s or 1e11))]
            )  # fmt: skip
            limit = str(queue_limit_packets(p.profile))
            leaf = (
                ["netem", *netem_args(p.profile), "limit", limit]
                if self.leaf_kind(p) == "netem"
                else ["pfifo", "limit", limit]
            )
            commands.append(["tc", "qdisc", "replace", "dev", dev, "parent", classid, "handle", f"{p.minor:x}:", *leaf])
            commands.append(
                ["tc", "filter", "replace", "dev", dev, "parent", f"{HTB_HANDLE}:", "protocol", "ip", "prio", "1",
                 "handle", f"800::{p.minor:x}", "u32", "match", "ip", match, f"{p.peer_address}/32", "flowid", classid]
            )  # fmt: skip
            if self.ifb:
                commands.append(
                    ["tc", "filter", "replace", "dev", self.interface, "parent", f"{INGRESS_HANDLE}:", "protocol", "ip",
                     "prio", "1", "handle", f"800::{p.minor:x}", "u32", "match", "ip", "src", f"{p.peer_address}/32",
                     "action", "mirred", "egress", "redirect", "dev", self.ifb]
                )  # fmt: skip
        return commands

    def undo_commands(self) -> list[list[str]]:
        """Remove only what we own: our root qdisc (and its classes), our ingress qdisc, our ifb."""
        if self.ifb:
            return [
                ["tc", "qdisc", "del", "dev", self.interface, "handle", f"{INGRESS_HANDLE}:", "ingress"],
                ["ip", "link", "del", self.ifb],
            ]
        return [["tc", "qdisc", "del", "dev", self.interface, "root", "handle", f"{HTB_HANDLE}:", "htb"]]


def ifb_name(node_index: int) -> str:
    return f"ifbtb{node_index}"


def compile_plan(topology: LinkTopology, links: tuple[DirectedLink, ...] | None = None) -> tuple[TcPlan, ...]:
    """One plan per shaped interface: egress on the sender, or ingress (ifb) on the receiver when
    the sender cannot run tc (a phone). Nodes need a data interface and address (the emulated
    testbed's resolved inventory has them). ``links`` default to the topology's."""
    links = topology.links if links is None else links
    egress: dict[str, list[DirectedLink]] = {}
    ingress: dict[str, list[DirectedLink]] = {}
    for link in links:
        sender = topology.node(link.source)
        if not sender.runs_tc:
            ingress.setdefault(link.destination, []).append(link)
        else:
            egress.setdefault(link.source, []).append(link)
    plans = []
    for direction, table in (("egress", egress), ("ingress", ingress)):
        for node_name in sorted(table, key=topology.index):
            node = topology.node(node_name)
            if node.data_interface is None or node.data_address is None:
                raise TestbedError(
                    f"{topology.source}: node {node_name!r} has no data interface to shape "
                    "(give data: {interface, address}, or start the emulated testbed)"
                )
            peers = []
            for minor, link in enumerate(table[node_name], start=1):
                peer = topology.node(link.source if direction == "ingress" else link.destination)
                if peer.data_address is None:
                    raise TestbedError(f"{topology.source}: node {peer.name!r} has no data address to shape traffic to")
                peers.append(ShapedPeer(peer.name, peer.data_address, link.profile_name, link.profile, minor))
            plans.append(
                TcPlan(
                    node=node_name,
                    interface=node.data_interface,
                    direction=direction,
                    peers=tuple(peers),
                    ifb=ifb_name(topology.index(node_name)) if direction == "ingress" else None,
                )
            )
    return tuple(plans)


def plan_devices(plans: Sequence[TcPlan]) -> list[str]:
    """Every device the plans put a qdisc on or create."""
    devices: list[str] = []
    for p in plans:
        devices += [p.interface] + ([p.ifb] if p.ifb else [])
    return list(dict.fromkeys(devices))


def plans_by_node(plans: Sequence[TcPlan]) -> dict[str, list[TcPlan]]:
    by_node: dict[str, list[TcPlan]] = {}
    for p in plans:
        by_node.setdefault(p.node, []).append(p)
    return by_node
