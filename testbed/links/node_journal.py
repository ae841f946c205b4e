"""The link journal kept on each shaped node: what its interfaces looked like before we touched
them, and what we own there (root qdiscs, ingress qdiscs, ifb devices, the rules a delay path holds
outside tc, such as the NFQUEUE path's iptables chains, its delay handler, a trace player). It is
written before the first tc or iptables command runs and before a handler starts, so ``testbed link
clear`` can undo from it alone, also after the controller was killed halfway through an apply.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from netem.delay_path import Key, delay_path
from netem.delay_path import names as delay_path_names
from netem.plan import HTB_HANDLE, INGRESS_HANDLE, TcPlan
from netem.profile import DirectedLink, LinkProfile
from netem.tc_state import InterfaceState, split_sections
from nodes.contracts.journal_values import INTERFACE, JournalValueError, checked, checked_path
from testbed.provisioning.sudo_rules import privileged
from testbed.transport.base import Transport, quote_path

JOURNAL_FORMAT = 2  # 2: ``held`` per delay path; 1 (read too) named the NFQUEUE chains as ``chains``
JOURNAL_NAME = "netem/journal.json"  # under the node's workdir


def journal_dir(workdir: str) -> str:
    """Where the journal and trace files live on the node (under the inventory's workdir)."""
    return workdir.rstrip("/") + "/netem"


def journal_path(workdir: str) -> str:
    return workdir.rstrip("/") + "/" + JOURNAL_NAME


@dataclass(frozen=True)
class DeviceSnapshot:
    """One device as it was before the first apply: ``tc -j qdisc show`` and ``tc -s class show``."""

    qdiscs: tuple[dict, ...]
    class_text: str


@dataclass(frozen=True)
class LinkJournal:
    devices: dict[str, DeviceSnapshot]  # every device we put a root qdisc on
    ingress_on: tuple[str, ...] = ()  # devices we put an ingress qdisc on
    ifbs: tuple[str, ...] = ()  # ifb devices we created
    trace_pidfile: str | None = None  # the trace player running on the node, if any
    held: dict[str, tuple[Key, ...]] = field(default_factory=dict)  # delay path -> keys of the rules it holds
    handler_pidfile: str | None = None  # the NFQUEUE delay handler, if any
    # the directions this node's plans shape, as applied: source, destination, profile_name, profile (its
    # fields); what ``link verify`` and ``link show`` take as applied (empty in a journal before format 2's)
    applied: tuple[dict, ...] = ()
    extra: dict = field(default_factory=dict)  # written_unix_s, by

    def merged_with(self, newer: LinkJournal) -> LinkJournal:
        """Re-applying keeps the first snapshot of each device: that is the state to return to."""
        devices = {**newer.devices, **self.devices}
        return LinkJournal(
            devices=devices,
            ingress_on=tuple(dict.fromkeys(self.ingress_on + newer.ingress_on)),
            ifbs=tuple(dict.fromkeys(self.ifbs + newer.ifbs)),
            trace_pidfile=newer.trace_pidfile or self.trace_pidfile,
            held={path: tuple(dict.fromkeys([*self.held.get(path, ()), *newer.held.get(path, ())]))
                  for path in dict.fromkeys([*self.held, *newer.held])},
            handler_pidfile=newer.handler_pidfile or self.handler_pidfile,
            applied=newer.applied,  # applying again replaces the shaping in place
            extra=newer.extra,
        )

    def with_trace(self, pidfile: str | None) -> LinkJournal:
        return replace(self, trace_pidfile=pidfile)

    def applied_links(self) -> tuple[DirectedLink, ...]:
        """The directions this node's journal says are shaped, as links (a profile that no longer
        parses raises ValueError naming the direction)."""
        links = []
        for entry in self.applied:
            try:
                profile = LinkProfile.model_validate(entry["profile"])
                links.append(DirectedLink(str(entry["source"]), str(entry["destination"]), str(entry["profile_name"]),
                                          profile))  # fmt: skip
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"the link journal {JOURNAL_NAME}: applied entry {entry!r} is not as the testbed "
                                 f"writes it ({type(exc).__name__})") from None  # fmt: skip
        return tuple(links)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": JOURNAL_FORMAT,
                "devices": {d: {"qdiscs": list(s.qdiscs), "class_text": s.class_text} for d, s in self.devices.items()},
                "ingress_on": list(self.ingress_on),
                "ifbs": list(self.ifbs),
                "trace_pidfile": self.trace_pidfile,
                "held": {path: [list(k) for k in keys] for path, keys in self.held.items()},
                "handler_pidfile": self.handler_pidfile,
                "applied": list(self.applied),
                **self.extra,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> LinkJournal:
        """The journal as written, its names and pidfiles checked again before they reach tc, ip,
        iptables or kill (:mod:`nodes.contracts.journal_values`); ValueError names the field."""
        data = json.loads(text)
        if data.get("format") not in (1, JOURNAL_FORMAT):
            raise ValueError(f"link journal format {data.get('format')!r} is not {JOURNAL_FORMAT}")
        if data["format"] == 1:  # an earlier version's: the NFQUEUE chains were its only held rules
            data = {**data, "held": {"nfqueue": data.pop("chains", [])}}
        _check_values(data)
        known = {"format", "devices", "ingress_on", "ifbs", "trace_pidfile", "held", "handler_pidfile", "applied"}
        return cls(
            devices={d: DeviceSnapshot(tuple(s["qdiscs"]), s["class_text"]) for d, s in data["devices"].items()},
            ingress_on=tuple(data["ingress_on"]),
            ifbs=tuple(data["ifbs"]),
            trace_pidfile=data.get("trace_pidfile"),
            held={path: tuple(tuple(k) for k in keys) for path, keys in data.get("held", {}).items()},
            handler_pidfile=data.get("handler_pidfile"),
            applied=tuple(data.get("applied", ())),
            extra={k: v for k, v in data.items() if k not in known},
        )

    def undo_commands(self, states: dict[str, InterfaceState]) -> list[list[str]]:
        """Remove only what we own and what is still there: ingress redirects first (so no packet
        is sent to a vanishing ifb), then ifb devices, then our root qdiscs."""
        commands: list[list[str]] = []
        for dev in self.ingress_on:
            s = states.get(dev)
            if s is not None and s.qdisc(f"{INGRESS_HANDLE}:") is not None:
                commands.append(["tc", "qdisc", "del", "dev", dev, "handle", f"{INGRESS_HANDLE}:", "ingress"])
        for ifb in self.ifbs:
            s = states.get(ifb)
            if s is not None and s.exists:
                commands.append(["ip", "link", "del", ifb])
        for dev in self.devices:
            if dev in self.ifbs:
                continue  # deleting the ifb took its qdiscs with it
            s = states.get(dev)
            root = s.root_qdisc if s is not None else None
            if root is not None and root.get("handle") == f"{HTB_HANDLE}:":
                commands.append(["tc", "qdisc", "del", "dev", dev, "root", "handle", f"{HTB_HANDLE}:", "htb"])
        return commands

    def held_undo_commands(self, listings: Mapping[str, str]) -> list[list[str]]:
        """Remove the rules our delay paths hold that are still there (``listings``: each path's listing,
        e.g. ``iptables -t mangle -S``)."""
        return [c for path, keys in self.held.items() for c in delay_path(path).undo(keys, listings.get(path, ""))]

    def snapshot_differences(
        self, states: dict[str, InterfaceState], listings: Mapping[str, str] | None = None
    ) -> list[str]:
        """Where the devices differ from the snapshot, and which of our held rules are left (after undo
        this should be empty)."""
        problems = [f"still held: {' '.join(c)}" for c in self.held_undo_commands(listings or {})]
        for dev, snap in self.devices.items():
            s = states.get(dev)
            now = s.qdiscs if s is not None else ()
            if list(now) != list(snap.qdiscs):
                problems.append(
                    f"{dev}: qdiscs are {json.dumps(now)}, before apply they were {json.dumps(snap.qdiscs)}"
                )
        for ifb in self.ifbs:
            s = states.get(ifb)
            if s is not None and s.exists:
                problems.append(f"{ifb}: still exists")
        return problems


def _check_values(data: dict) -> None:
    where = f"the link journal {JOURNAL_NAME}"
    try:
        for field in ("ingress_on", "ifbs"):
            for name in data[field]:
                checked(name, INTERFACE, field, "an interface name")
        for name in data["devices"]:
            checked(name, INTERFACE, "devices", "an interface name")
        for path, keys in data.get("held", {}).items():
            if path not in delay_path_names():
                raise JournalValueError(f"held: {path!r} is not a delay path (known: {', '.join(delay_path_names())})")
            for key in keys:
                problem = delay_path(path).key_problem(tuple(key))
                if problem is not None:
                    raise JournalValueError(f"held.{path}: {problem}")
        for field in ("trace_pidfile", "handler_pidfile"):
            if data.get(field) is not None:
                checked_path(data[field], field, suffix=".pid")
    except JournalValueError as exc:
        raise JournalValueError(f"{where}: {exc}; mend it (or undo by hand and remove it)") from None
    except (KeyError, TypeError, IndexError) as exc:
        raise JournalValueError(f"{where}: not as the testbed writes it ({type(exc).__name__}: {exc})") from None


def store(transport: Transport, path: str, data: bytes) -> None:
    """Store ``data`` at ``path`` on the node (atomically, synced)."""
    transport.store(path, data, timeout_s=30.0)


def write(transport: Transport, workdir: str, journal: LinkJournal) -> None:
    store(transport, journal_path(workdir), journal.to_json().encode())


def read_script(workdir: str) -> str:
    """sh that prints the journal in a ``#### journal`` section (empty when there is none)."""
    return f'echo "#### journal"; cat {quote_path(journal_path(workdir))} 2>/dev/null; echo'


def parse_read(output: str) -> LinkJournal | None:
    """The journal printed by :func:`read_script` (alone or inside a combined script's output)."""
    text = split_sections(output).get("journal", "").strip()
    return LinkJournal.from_json(text) if text else None


def read(transport: Transport, workdir: str) -> LinkJournal | None:
    return parse_read(transport.run_script(read_script(workdir), timeout_s=30.0).check().stdout)


def remove_script(workdir: str) -> str:
    return f"rm -f {quote_path(journal_path(workdir))}"


COMMANDS_BASE_S = 60.0
PER_COMMAND_S = 2.0  # each under its own sudo, which may ask PAM (a server's 30 peers: about 250 commands)


def commands_timeout_s(commands: Sequence[Sequence[str]]) -> float:
    """How long :func:`commands_script` may take for ``commands``."""
    return COMMANDS_BASE_S + PER_COMMAND_S * len(commands)


def commands_script(commands: Sequence[Sequence[str]], sudo: bool) -> str:
    """sh that runs tc, ip and iptables commands in order (each with sudo, as the one fixed program
    :func:`testbed.provisioning.sudo_rules.privileged` makes it) and stops at the first failure, saying which."""
    lines = []
    for i, cmd in enumerate(commands):
        line = shlex.join(privileged(cmd, sudo=sudo))
        lines.append(f"{line} || {{ echo {shlex.quote(f'failed command {i + 1}: ' + shlex.join(cmd))} >&2; exit 3; }}")
    return "\n".join(lines) + "\n"


def applied_entries(plans: Sequence[TcPlan]) -> tuple[dict, ...]:
    """What a node's journal records as applied for its ``plans``: each shaped direction (an egress class
    shapes node -> peer, an ingress class peer -> node) with its profile's fields."""
    return tuple(
        {"source": plan.node if plan.direction == "egress" else peer.peer,
         "destination": peer.peer if plan.direction == "egress" else plan.node,
         "profile_name": peer.profile_name, "profile": peer.profile.as_written()}
        for plan in plans for peer in plan.peers
    )  # fmt: skip
