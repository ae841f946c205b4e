"""The NFQUEUE delay path, for kernels without sch_netem: iptables chains of ours that drop
(``-m statistic``) and queue (NFQUEUE) the packets of each direction with delay, jitter or loss, and
the config of each node's delay handler (``nodes/link_delay_handler.py``) that releases queued
packets when they are due.

Where the rules sit: on the *receiving* node, in mangle PREROUTING for its data interface, matching
the sender's address. The packet has then left the sender's HTB class (rate -> delay, as a real link
serialises and then propagates), and the sender's TCP counts it as sent: a packet held on the sending
host would count against TCP small queues (which allow about 1 ms of pacing in the host, not a
link's delay; netem orphans its packets for this reason, NFQUEUE cannot) and a packet dropped there
is retried by the sender instead of lost. Only a receiver that cannot run iptables (a phone) has its
rules on the sender, in mangle POSTROUTING, matching the receiver's address, with those limits.
Loss is decided in the kernel before the queue, so a dropped packet costs the handler nothing: random
loss with ``-m statistic``, correlated loss as a Gilbert chain whose bad state is the other end's
address in an ``xt_recent`` list (three rules, no user space). Only a trace's loss, whose rows change
it, is drawn by the handler. Every NFQUEUE rule carries ``--queue-bypass``: with no handler bound,
packets pass undelayed, never blackholed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar

from netem.plan import MTU_BYTES, TcPlan
from netem.profile import LinkProfile
from netem.topology import LinkTopology
from nodes.contracts.journal_values import INTERFACE

TABLE = "mangle"
FIRST_QUEUE = 8100  # a node's NFQUEUE numbers: FIRST_QUEUE + 0, 1, ... over its delayed directions
MIN_QUEUE_PACKETS = 1024  # the kernel's default queue length
MAX_QUEUE_PACKETS = 1 << 20
UNSHAPED_RATE_BIT_S = 1e9  # what a delay-only link is assumed to carry when sizing its queue
QUEUE_HEADROOM_S = 0.02


def chain_name(interface: str, hook_side: str) -> str:
    """Our chain for one interface and side (iptables allows 28 characters; interfaces 15)."""
    return f"TB-{'IN' if hook_side == 'ingress' else 'EG'}-{interface}"


def hook(hook_side: str) -> str:
    return "PREROUTING" if hook_side == "ingress" else "POSTROUTING"


def _interface_flag(hook_side: str) -> str:
    return "-i" if hook_side == "ingress" else "-o"


def queue_length_packets(profile: LinkProfile) -> int:
    """NFQUEUE's length: 1.5 x the packets the link carries in delay + 4 x jitter + 20 ms (a full
    queue drops: the binding cannot set fail-open), at least the kernel's default 1024."""
    rate = profile.rate_bit_s or UNSHAPED_RATE_BIT_S
    held_s = (profile.delay_s or 0.0) + 4 * (profile.jitter_s or 0.0) + QUEUE_HEADROOM_S
    return min(MAX_QUEUE_PACKETS, max(MIN_QUEUE_PACKETS, math.ceil(1.5 * rate / 8 / MTU_BYTES * held_s)))


@dataclass(frozen=True)
class DelayedDirection:
    """One shaped direction on the NFQUEUE path, and where its rules sit."""

    sender: str
    receiver: str
    profile: LinkProfile
    holder: str  # the node whose chain holds the rules: the receiver, or the sender for a phone
    hook_side: str  # ingress (PREROUTING on the receiver) or egress (POSTROUTING on the sender)
    interface: str  # the holder's data interface
    match_address: str  # the sender's address (ingress) or the receiver's (egress)
    queue_num: int | None  # None: kernel loss only, no packet goes through the handler
    loss_in_handler: bool  # a trace's loss (its rows change it)

    @property
    def kernel_drop_probability(self) -> float | None:
        """Independent loss, dropped by ``-m statistic`` (None: no loss, or drawn elsewhere)."""
        if self.loss_in_handler or not self.profile.loss_pct or self.profile.loss_correlation_pct:
            return None
        return self.profile.loss_pct / 100

    @property
    def gilbert(self) -> tuple[float, float] | None:
        """Correlated loss as a two-state Gilbert chain in the kernel: (P(kept -> lost), P(lost -> kept)).
        With stationary loss p and lag-1 correlation rho: p (1 - rho) and (1 - p)(1 - rho), so that
        P(lost | lost) = p + rho (1 - p) (the handler's model, nodes/link_delay_handler.GilbertLoss)."""
        if self.loss_in_handler or not self.profile.loss_pct or not self.profile.loss_correlation_pct:
            return None
        p, rho = self.profile.loss_pct / 100, self.profile.loss_correlation_pct / 100
        return p * (1 - rho), (1 - p) * (1 - rho)

    @property
    def recent_list(self) -> str:
        """The xt_recent list that holds this direction's Gilbert state (its sender, or receiver)."""
        return "tbge_" + self.match_address.replace(".", "_")

    def rule_words(self) -> list[list[str]]:
        """This direction's rules in the holder's chain: loss (a statistic DROP, or the three rules of a
        Gilbert chain whose bad state is the other end's address in an xt_recent list), then the NFQUEUE.
        Words are as ``iptables -S`` prints them, so that the read-back compares them as they are."""
        match = ["-s" if self.hook_side == "ingress" else "-d", f"{self.match_address}/32"]
        rules = []
        probability = self.kernel_drop_probability
        if probability is not None:
            rules.append([*match, "-m", "statistic", "--mode", "random", "--probability", f"{probability:.11f}",
                          "-j", "DROP"])  # fmt: skip
        if self.gilbert is not None:
            to_bad, to_good = self.gilbert
            side = "--rsource" if self.hook_side == "ingress" else "--rdest"
            listed = ["--name", self.recent_list, "--mask", "255.255.255.255", side]
            rules += [
                [*match, "-m", "recent", "!", "--rcheck", *listed, "-m", "statistic", "--mode", "random",
                 "--probability", f"{to_bad:.11f}", "-m", "recent", "--set", *listed, "-j", "DROP"],
                [*match, "-m", "recent", "--rcheck", *listed, "-m", "statistic", "--mode", "random",
                 "--probability", f"{to_good:.11f}", "-m", "recent", "--remove", *listed],
                [*match, "-m", "recent", "--rcheck", *listed, "-j", "DROP"],
            ]  # fmt: skip
        if self.queue_num is not None:
            rules.append([*match, "-j", "NFQUEUE", "--queue-num", str(self.queue_num), "--queue-bypass"])
        return rules

    def handler_queue(self) -> dict:
        """This direction's queue in the handler's config (see nodes/link_delay_handler.py)."""
        p = self.profile
        spec: dict = {
            "queue_num": self.queue_num, "from": self.sender, "to": self.receiver,
            "delay_s": p.delay_s or 0.0, "jitter_s": p.jitter_s or 0.0, "distribution": p.distribution,
            "reorder": bool(p.reorder), "queue_length": queue_length_packets(p),
        }  # fmt: skip
        if self.loss_in_handler:
            spec.update(loss_pct=p.loss_pct or 0.0, loss_correlation_pct=p.loss_correlation_pct or 0.0)
        return spec


@dataclass(frozen=True)
class NfqueueRules:
    """Our chain on one interface and side of one node: its rules, the jump into it, its queues."""

    delay_path: ClassVar[str] = "nfqueue"
    node: str
    interface: str
    hook_side: str
    directions: tuple[DelayedDirection, ...]

    @property
    def chain(self) -> str:
        return chain_name(self.interface, self.hook_side)

    @property
    def key(self) -> tuple[str, ...]:
        """Its identity in the node's link journal."""
        return (self.interface, self.hook_side)

    @property
    def queues(self) -> tuple[dict, ...]:
        return tuple(d.handler_queue() for d in self.directions if d.queue_num is not None)

    @property
    def description(self) -> str:
        return ", ".join(f"{d.sender} -> {d.receiver}" for d in self.directions)

    def jump_words(self) -> list[str]:
        return [hook(self.hook_side), _interface_flag(self.hook_side), self.interface, "-j", self.chain]

    def apply_commands(self, *, chain_exists: bool = False, jump_exists: bool = False) -> list[list[str]]:
        """Create (or flush) the chain, fill it, and jump into it first thing in the hook."""
        ipt = ["iptables", "-w", "-t", TABLE]
        commands = [[*ipt, "-F" if chain_exists else "-N", self.chain]]
        commands += [[*ipt, "-A", self.chain, *words] for d in self.directions for words in d.rule_words()]
        if not jump_exists:
            hook_name, *rest = self.jump_words()
            commands.append([*ipt, "-I", hook_name, "1", *rest])
        return commands

    def undo_commands(self) -> list[list[str]]:
        return undo_chain_commands(self.interface, self.hook_side)

    def rule_lines(self) -> list[str]:
        """The chain as ``iptables -S`` prints it."""
        rules = [f"-A {self.chain} " + " ".join(words) for d in self.directions for words in d.rule_words()]
        return [f"-N {self.chain}", *rules]


def undo_chain_commands(interface: str, hook_side: str, *, jump: bool = True, chain: bool = True) -> list[list[str]]:
    """Remove the jump into our chain, then the chain: nothing else in the table is touched."""
    ipt = ["iptables", "-w", "-t", TABLE]
    name = chain_name(interface, hook_side)
    commands = []
    if jump:
        commands.append([*ipt, "-D", hook(hook_side), _interface_flag(hook_side), interface, "-j", name])
    if chain:
        commands += [[*ipt, "-F", name], [*ipt, "-X", name]]
    return commands


def undo_present_chains(chains: Sequence[tuple[str, str]], listing: str) -> list[list[str]]:
    """Remove those of ``chains`` ((interface, hook side) pairs) still in ``listing`` (``iptables -S``):
    each jump into one, then the chain. Rules of others are never touched."""
    commands: list[list[str]] = []
    present = chains_in(listing)
    for interface, hook_side in chains:
        jump = has_jump(listing, interface, hook_side)
        chain = chain_name(interface, hook_side) in present
        if jump or chain:
            commands += undo_chain_commands(interface, hook_side, jump=jump, chain=chain)
    return commands


def compile_chains(
    topology: LinkTopology, plans: Sequence[TcPlan], traced: Collection[tuple[str, str]] = ()
) -> tuple[NfqueueRules, ...]:
    """The chains the plans on the NFQUEUE delay path need, one per holder node, interface and side.
    ``traced``: (sender, receiver) pairs a trace drives, whose loss the handler draws row by row."""
    directions: list[tuple[str, str, LinkProfile]] = []
    for plan in plans:
        if plan.delay_path != "nfqueue":
            continue
        for peer in plan.peers:
            if peer.profile.has_delay_or_loss:
                pair = (plan.node, peer.peer) if plan.direction == "egress" else (peer.peer, plan.node)
                directions.append((*pair, peer.profile))
    by_holder: dict[tuple[str, str, str], list[DelayedDirection]] = {}
    next_queue: dict[str, int] = {}
    for sender, receiver, profile in directions:
        on_receiver = topology.node(receiver).runs_tc
        holder = topology.node(receiver if on_receiver else sender)
        other = topology.node(sender if on_receiver else receiver)
        if holder.data_interface is None or other.data_address is None:
            raise ValueError(f"{holder.name} or {other.name} has no data interface and address")
        in_handler = (sender, receiver) in traced
        queued = in_handler or bool(profile.delay_s or profile.jitter_s)
        queue_num = None
        if queued:
            queue_num = FIRST_QUEUE + next_queue.get(holder.name, 0)
            next_queue[holder.name] = next_queue.get(holder.name, 0) + 1
        side = "ingress" if on_receiver else "egress"
        direction = DelayedDirection(sender, receiver, profile, holder.name, side, holder.data_interface,
                                     other.data_address, queue_num, in_handler)  # fmt: skip
        by_holder.setdefault((holder.name, holder.data_interface, side), []).append(direction)
    return tuple(NfqueueRules(node, iface, side, tuple(ds)) for (node, iface, side), ds in by_holder.items())


def handler_config(chains: Sequence[NfqueueRules], *, seed: int, start_unix_s: float | None = None) -> dict:
    """The handler's config for every chain of one node."""
    return {"seed": seed, "start_unix_s": start_unix_s, "queues": [q for c in chains for q in c.queues]}


# ---- read-back: ``iptables -w -t mangle -S`` ----

_PROBABILITY = re.compile(r"--probability (\S+)")


def chains_in(listing: str) -> set[str]:
    """The chains an ``iptables -S`` listing defines (``-N NAME`` lines)."""
    return {line.split()[1] for line in listing.splitlines() if line.startswith("-N ")}


def has_jump(listing: str, interface: str, hook_side: str) -> bool:
    words = ["-A", hook(hook_side), _interface_flag(hook_side), interface, "-j", chain_name(interface, hook_side)]
    return any(line.split() == words for line in listing.splitlines())


def chain_lines(listing: str, chain: str) -> list[str]:
    return [line for line in listing.splitlines() if line.split()[:2] in (["-N", chain], ["-A", chain])]


def rule_differences(rules: NfqueueRules, listing: str) -> list[str]:
    """How the node's mangle table differs from the chain we planned; empty when it matches.
    Probabilities compare as numbers (iptables prints them with its own precision)."""
    problems = []
    if not has_jump(listing, rules.interface, rules.hook_side):
        problems.append(f"iptables: no jump from {hook(rules.hook_side)} on {rules.interface} into {rules.chain}")
    got, want = chain_lines(listing, rules.chain), rules.rule_lines()
    if len(got) != len(want) or any(not _same_rule(g, w) for g, w in zip(got, want, strict=False)):
        problems.append(f"iptables: chain {rules.chain} is {got}, expected {want}")
    return problems


def _same_rule(got: str, want: str) -> bool:
    g, w = _PROBABILITY.search(got), _PROBABILITY.search(want)
    if (g is None) != (w is None):
        return False
    if g is not None and w is not None:
        if abs(float(g.group(1)) - float(w.group(1))) > 1e-6:
            return False
        got, want = _PROBABILITY.sub("", got), _PROBABILITY.sub("", want)
    return got.split() == want.split()


def iptables_commands_for(
    chains: Sequence[NfqueueRules], listing: str, journaled: Sequence[tuple[str, str]] = ()
) -> list[list[str]]:
    """The iptables commands of a node's chains, given what its table holds now (``listing``, as
    ``iptables -S`` prints it) and the (interface, hook side) chains its journal names: our chains
    are flushed and refilled in place, chains of an earlier apply that are no longer planned go."""
    planned = {(c.interface, c.hook_side) for c in chains}
    commands: list[list[str]] = []
    stale = [c for c in journaled if c not in planned]
    if stale:
        commands += undo_present_chains(stale, listing)
    present = chains_in(listing)
    for c in chains:
        commands += c.apply_commands(chain_exists=c.chain in present,
                                     jump_exists=has_jump(listing, c.interface, c.hook_side))  # fmt: skip
    return commands



class NfqueuePath:
    """The NFQUEUE delay path as a :class:`netem.delay_path.DelayPath`: iptables chains of ours and a
    user-space delay handler (see the module's docstring)."""

    name = "nfqueue"
    auto = True
    listing_argv = ("iptables", "-w", "-t", TABLE, "-S")
    listing_name = "iptables"

    def readiness_probe(self, installed: Callable[[str], str]) -> str:
        """``ready``, else ``missing:`` and what is missing: iptables, the kernel's nfnetlink_queue, the
        suite's delay handler installed."""
        return (
            "why=''; { [ -x /usr/sbin/iptables ] || [ -x /sbin/iptables ]; } || why=\"$why iptables\"; "
            "{ [ -e /proc/net/netfilter/nfnetlink_queue ] || [ -d /sys/module/nfnetlink_queue ] "
            "|| grep -qs /nfnetlink_queue.ko \"/lib/modules/$(uname -r)/modules.builtin\" "
            "|| /sbin/modprobe -n -q nfnetlink_queue 2>/dev/null; } || why=\"$why nfnetlink_queue\"; "
            f"{installed('delay-handler')} || why=\"$why delay-handler\"; "
            'if [ -z "$why" ]; then echo ready; else echo "missing:$why"; fi'
        )

    def ready(self, answer: str) -> bool:
        return answer == "ready"

    def not_ready(self, node: str, answer: str, what: str) -> str:
        return (
            f"{node}: the NFQUEUE delay path is not ready ({answer}) for {what} (the kernel has no "
            "sch_netem); install iptables, and the delay handler root-owned (`testbed provision` does, or says the one "
            "command to run as root; its Python needs NetfilterQueue, which needs libnetfilter-queue), or drop "
            "delay/jitter/loss from the profile"
        )

    def compile(
        self, topology: LinkTopology, plans: Sequence[TcPlan], traced: Collection[tuple[str, str]]
    ) -> tuple[NfqueueRules, ...]:
        return compile_chains(topology, plans, traced)

    def commands(
        self, held: Sequence[NfqueueRules], listing: str, journaled: Sequence[tuple[str, ...]]
    ) -> list[list[str]]:
        return iptables_commands_for(held, listing, [(k[0], k[1]) for k in journaled])

    def differences(self, held: NfqueueRules, listing: str) -> list[str]:
        return rule_differences(held, listing)

    def undo(self, journaled: Sequence[tuple[str, ...]], listing: str) -> list[list[str]]:
        return undo_present_chains([(k[0], k[1]) for k in journaled], listing)

    def key_problem(self, key: tuple[str, ...]) -> str | None:
        if (len(key) != 2 or not all(isinstance(k, str) for k in key) or INTERFACE.fullmatch(key[0]) is None
                or key[1] not in ("ingress", "egress")):  # fmt: skip
            return f"{list(key)} is not an (interface name, ingress or egress) pair"
        return None

    def listed(self, key: tuple[str, ...], listing: str) -> list[str]:
        return chain_lines(listing, chain_name(key[0], key[1]))
