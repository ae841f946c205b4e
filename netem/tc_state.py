"""What tc says is on a node's interfaces, and how that compares with a :class:`TcPlan`.

Qdiscs and filters are read as JSON (``tc -j``). HTB classes are read as text (``tc -s class
show``): iproute2 up to at least 6.1 prints HTB classes without JSON even under ``-j``. One shell
script reads every device at once so that a read-back costs one round trip.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from netem.plan import HTB_HANDLE, INGRESS_HANDLE, TcPlan, queue_limit_packets

SECTION_MARK = "#### "  # every section of a combined script's output starts with this
SECTION = SECTION_MARK + "tc-state "
RATE_TOLERANCE = 0.005  # tc prints rates rounded (e.g. 1234567Kbit -> 1234Mbit); HTB keeps bytes/s

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)bit$")
_MULTIPLIER = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_CLASS = re.compile(r"^class htb (\S+) (?:root|parent (\S+))(?: leaf (\S+))?.* rate (\S+) ceil (\S+)")
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")


def parse_tc_rate_bit_s(text: str) -> float:
    """``8Mbit`` -> 8e6 (tc prints SI multipliers of bit/s)."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"not a tc rate: {text!r}")
    return float(m.group(1)) * _MULTIPLIER[m.group(2)]


@dataclass(frozen=True)
class HtbClass:
    """One HTB class and its counters since it was created."""

    classid: str
    parent: str | None  # None: directly under the root qdisc
    leaf: str | None
    rate_bit_s: float
    ceil_bit_s: float
    sent_bytes: int
    sent_packets: int
    dropped_packets: int
    overlimits: int


def parse_htb_classes(text: str) -> tuple[HtbClass, ...]:
    """Parse ``tc -s class show dev D`` (HTB classes; other kinds are skipped)."""
    classes = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _CLASS.match(line.strip())
        if not m:
            continue
        sent = _SENT.search(lines[i + 1]) if i + 1 < len(lines) else None
        counts = [int(v) for v in sent.groups()] if sent else [0, 0, 0, 0]
        classes.append(
            HtbClass(
                classid=m.group(1),
                parent=m.group(2),
                leaf=m.group(3),
                rate_bit_s=parse_tc_rate_bit_s(m.group(4)),
                ceil_bit_s=parse_tc_rate_bit_s(m.group(5)),
                sent_bytes=counts[0],
                sent_packets=counts[1],
                dropped_packets=counts[2],
                overlimits=counts[3],
            )
        )
    return tuple(classes)


@dataclass(frozen=True)
class InterfaceState:
    """One device as tc and ip show it."""

    device: str
    exists: bool
    qdiscs: tuple[dict, ...]  # tc -j qdisc show, as printed
    class_text: str  # tc -s class show, as printed
    filters: tuple[dict, ...]  # tc -j filter show parent <ours>:
    ingress_filters: tuple[dict, ...]  # tc -j filter show ingress

    @property
    def classes(self) -> tuple[HtbClass, ...]:
        return parse_htb_classes(self.class_text)

    def qdisc(self, handle: str) -> dict | None:
        return next((q for q in self.qdiscs if q.get("handle") == handle), None)

    @property
    def root_qdisc(self) -> dict | None:
        return next((q for q in self.qdiscs if q.get("root")), None)


def read_script(devices: Sequence[str]) -> str:
    """A sh script that prints every device's state in sections :func:`parse_read` understands."""
    parts = []
    for dev in devices:
        d = shlex.quote(dev)
        parts += [
            f'echo "{SECTION}link {dev}"; ip -j link show dev {d} 2>/dev/null || echo "[]"',
            f'echo "{SECTION}qdisc {dev}"; tc -j qdisc show dev {d} 2>/dev/null || echo "[]"',
            f'echo "{SECTION}class {dev}"; tc -s class show dev {d} 2>/dev/null',
            f'echo "{SECTION}filter {dev}"; tc -j filter show dev {d} parent {HTB_HANDLE}: 2>/dev/null || echo "[]"',
            f'echo "{SECTION}ingress {dev}"; tc -j filter show dev {d} ingress 2>/dev/null || echo "[]"',
        ]
    return "\n".join(parts) + "\n"


def _json_list(text: str) -> tuple[dict, ...]:
    text = text.strip()
    if not text:
        return ()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return ()
    return tuple(v for v in value if isinstance(v, dict)) if isinstance(value, list) else ()


def split_sections(output: str) -> dict[str, str]:
    """The text under each ``#### NAME`` marker line of a combined script's output, by NAME."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in output.splitlines():
        if line.startswith(SECTION_MARK):
            current = sections.setdefault(line[len(SECTION_MARK) :], [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def parse_read(output: str) -> dict[str, InterfaceState]:
    """The states printed by :func:`read_script`, by device."""
    prefix = SECTION[len(SECTION_MARK) :]
    text: dict[str, dict[str, str]] = {}
    for name, body in split_sections(output).items():
        if name.startswith(prefix):
            kind, _, dev = name[len(prefix) :].partition(" ")
            text.setdefault(dev, {})[kind] = body
    return {
        dev: InterfaceState(
            device=dev,
            exists=bool(_json_list(t.get("link", ""))),
            qdiscs=_json_list(t.get("qdisc", "")),
            class_text=t.get("class", ""),
            filters=_json_list(t.get("filter", "")),
            ingress_filters=_json_list(t.get("ingress", "")),
        )
        for dev, t in text.items()
    }


def _u32_matches(filters: Sequence[dict], address: str, offset: int) -> list[dict]:
    """u32 filters (their options) that match ``address`` at ``offset`` (16: dst, 12: src)."""
    value = f"{int(ipaddress.IPv4Address(address)):x}"
    found = []
    for f in filters:
        opts = f.get("options") or {}
        match = opts.get("match") or {}
        if match.get("value") == value and match.get("mask") == "ffffffff" and match.get("off") == offset:
            found.append(opts)
    return found


def differences(plan: TcPlan, states: dict[str, InterfaceState]) -> list[str]:
    """How what is on the node differs from the plan; empty when it matches."""
    problems: list[str] = []
    dev = plan.shaped_device
    state = states.get(dev)
    if state is None or not state.exists:
        return [f"device {dev} does not exist"]
    root = state.root_qdisc
    if root is None or root.get("kind") != "htb" or root.get("handle") != f"{HTB_HANDLE}:":
        seen = f"{root.get('kind')} {root.get('handle')}" if root else "none"
        problems.append(f"{dev}: root qdisc is {seen}, expected htb {HTB_HANDLE}:")
    classes = {c.classid: c for c in state.classes}
    offset = 16 if plan.direction == "egress" else 12
    for p in plan.peers:
        classid = f"{HTB_HANDLE}:{p.minor:x}"
        c = classes.pop(classid, None)
        want = p.profile.rate_bit_s or 1e11
        if c is None:
            problems.append(f"{dev}: class {classid} (to {p.peer}) is missing")
        else:
            for what, got in (("rate", c.rate_bit_s), ("ceil", c.ceil_bit_s)):
                if abs(got - want) > RATE_TOLERANCE * want:
                    problems.append(
                        f"{dev}: class {classid} (to {p.peer}) {what} is {got:.0f} bit/s, expected {want:.0f}"
                    )
        leaf = state.qdisc(f"{p.minor:x}:")
        kind = plan.leaf_kind(p)
        if leaf is None or leaf.get("parent") != classid or leaf.get("kind") != kind:
            problems.append(f"{dev}: leaf qdisc {p.minor:x}: under {classid} should be {kind}, found {leaf}")
        elif (leaf.get("options") or {}).get("limit") != queue_limit_packets(p.profile):
            problems.append(
                f"{dev}: leaf {p.minor:x}: limit is {(leaf.get('options') or {}).get('limit')}, "
                f"expected {queue_limit_packets(p.profile)}"
            )
        if not any(f.get("flowid") == classid for f in _u32_matches(state.filters, p.peer_address, offset)):
            problems.append(f"{dev}: no u32 filter sends {p.peer_address} to {classid}")
        if plan.ifb:
            iface = states.get(plan.interface)
            redirects = [
                a
                for f in _u32_matches(iface.ingress_filters if iface else (), p.peer_address, 12)
                for a in f.get("actions", ())
                if a.get("kind") == "mirred" and a.get("to_dev") == plan.ifb
            ]
            if not redirects:
                problems.append(f"{plan.interface}: ingress from {p.peer_address} is not redirected to {plan.ifb}")
    for extra in classes:
        problems.append(f"{dev}: class {extra} is not in the plan")
    if plan.ifb:
        iface = states.get(plan.interface)
        if iface is None or iface.qdisc(f"{INGRESS_HANDLE}:") is None:
            problems.append(f"{plan.interface}: ingress qdisc is missing")
    return problems


def u32_destination(tc_filter: dict) -> str | None:
    """The IPv4 destination a u32 filter of ``tc -j filter show`` matches (its match value is the
    address in hex, e.g. ``0a0e0003`` for 10.14.0.3), or None for a filter without one."""
    value = (tc_filter.get("options") or {}).get("match", {}).get("value")
    if not value:
        return None
    return str(ipaddress.IPv4Address(int(value, 16)))


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
