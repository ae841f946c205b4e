"""Leases taken, kept and given back by a controller: a campaign takes a lease on every machine it
touches before it touches any, renews them while it runs, and gives them back when it ends. A machine
another controller holds refuses the whole take: what was taken is given back, nothing else is
touched, and the error names the holder.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from foundation.errors import NodeError
from testbed.inventory import Inventory, NodeSpec, host_of
from testbed.leases.lease_file import LeaseAnswer, lease_request, lease_script, parse_answer, plain_word
from testbed.transport import open_transport
from testbed.transport.fanout import FanOutResult, fan_out

LEASE_TTL_S = 120.0  # a holder that stops renewing loses its leases this long after its last renewal
RENEW_FRACTION = 1 / 3  # renewed every third of the ttl: two renewals may fail before one expires
COMMANDS_HOLDER = "testbed-commands"  # the "campaign" of single commands (command_leases)
TTL_ENV = "TESTBED_LEASE_TTL_S"  # for a test (or a lab on a slow network) to change the ttl


def lease_ttl_s() -> float:
    value = os.environ.get(TTL_ENV)
    try:
        return max(2.0, float(value)) if value else LEASE_TTL_S
    except ValueError:
        return LEASE_TTL_S


@dataclass(frozen=True)
class Holder:
    """Who takes a lease: a user on a controller, for a campaign (its directory), in a process."""

    user: str
    host: str
    campaign: str
    pid: int

    @property
    def key(self) -> str:
        """The same for every invocation on one campaign by one user on one controller (``--resume``)."""
        return hashlib.sha256(f"{self.user}@{self.host}:{self.campaign}".encode()).hexdigest()[:24]

    @property
    def name(self) -> str:
        return f"{self.user}@{self.host}"

    def fields(self) -> dict[str, str]:
        return {"holder": plain_word(self.name), "campaign": plain_word(self.campaign), "pid": str(self.pid)}


def holder_for(campaign: str | Path) -> Holder:
    """This process as the holder of leases for ``campaign`` (a campaign's directory)."""
    text = str(Path(campaign).resolve()) if isinstance(campaign, Path) else campaign
    return Holder(getpass.getuser(), socket.gethostname(), text, os.getpid())


def lease_machines(inventory: Inventory, nodes: Iterable[NodeSpec | str]) -> list[str]:
    """The machines a lease is taken on for ``nodes``: where each node's commands run (a phone's USB host)
    when that is a node reached over SSH (not this machine); in the inventory's order, each once."""
    hosts = {host_of(inventory.node(n) if isinstance(n, str) else n) for n in nodes}
    return [n.name for n in inventory.nodes if n.name in hosts and n.transport == "ssh"]


def lease_action(inventory: Inventory, machine: str, action: str, request: bytes = b"") -> LeaseAnswer:
    """``action`` (lease_file.lease_script) on ``machine``'s lease, ``request`` on its stdin."""
    with open_transport(inventory, inventory.node(machine)) as t:  # (a machine: never a phone, lease_machines)
        result = t.run(["sh", "-c", lease_script(action)], stdin=request, timeout_s=30.0)
    try:
        return parse_answer(result.stdout)
    except ValueError:
        said = (result.stderr or result.stdout).strip()[-300:]
        raise NodeError(machine, f"cannot read or write its lease: {said}") from None


def leases_on(inventory: Inventory, machines: Sequence[str]) -> FanOutResult[LeaseAnswer]:
    """Every machine's lease, as it is (``testbed lab leases``)."""
    return fan_out(list(machines), lambda m: lease_action(inventory, m, "show"), description="reading leases")


def release_on(inventory: Inventory, machines: Sequence[str], holder: Holder | None,
               *, force: bool = False) -> FanOutResult[LeaseAnswer]:  # fmt: skip
    """Give ``holder``'s leases on ``machines`` back (``force``: whoever holds them)."""
    action, request = ("force", b"") if force else ("release", f"key={holder.key if holder else ''}\n".encode())
    return fan_out(list(machines), lambda m: lease_action(inventory, m, action, request),
                   description="releasing leases")  # fmt: skip


def _ours(answer: LeaseAnswer | None) -> bool:
    return answer is not None and answer.state in ("taken", "renewed")


class LeaseRefused(NodeError):
    """A machine is leased to another holder (the first such machine is the error's node)."""


@dataclass
class LeaseKeeper:
    """Leases held on ``machines`` for ``holder``: :meth:`take` them all or none, renewed from a thread
    every third of the ttl, given back by :meth:`release` (a ``with`` block does both)."""

    inventory: Inventory
    machines: list[str]
    holder: Holder
    ttl_s: float = field(default_factory=lease_ttl_s)
    lost: dict[str, str] = field(default_factory=dict)  # machine -> who took it after ours expired
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def take(self) -> None:
        request = lease_request(self.holder.key, self.holder.fields(), self.ttl_s)
        taken = fan_out(self.machines, lambda m: lease_action(self.inventory, m, "take", request),
                        description="taking leases")  # fmt: skip
        ours = [o.node for o in taken.outcomes if _ours(o.value)]
        refused = [o for o in taken.outcomes if not _ours(o.value)]
        if not refused:
            self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
            self._thread.start()
            return
        release_on(self.inventory, ours, self.holder)
        said: dict[str, list[str]] = {}  # what stands in the way -> the machines it holds
        for o in refused:
            answer = o.value
            if answer is not None and answer.state == "held" and answer.lease is not None:
                why = f"leased to {answer.lease.describe(answer.node_now_s)}"
            elif answer is not None and answer.state == "busy":
                why = "its lease file is locked by another controller right now"
            else:
                why = str(o.error)
            said.setdefault(why, []).append(o.node)
        first = refused[0].node
        parts = []
        for why, machines in said.items():
            others = ", ".join(m for m in machines if m != first)
            if first not in machines:
                parts.append(f"{others}: {why}")
            else:
                parts.append(f"{why} (so are {others})" if others else why)
        raise LeaseRefused(first, "; ".join(parts) + ". Nothing was changed. Wait for it to end, or, if its "
                           "holder is gone, for the lease to expire (or: testbed lab release --force)")

    def _renew(self) -> None:
        request = lease_request(self.holder.key, self.holder.fields(), self.ttl_s)
        while not self._stop.wait(self.ttl_s * RENEW_FRACTION):
            kept = [m for m in self.machines if m not in self.lost]
            renewed = fan_out(kept, lambda m: lease_action(self.inventory, m, "renew", request),
                              description="renewing leases")  # fmt: skip
            for o in renewed.outcomes:
                if o.ok and o.value is not None and o.value.state == "lost":
                    lease = o.value.lease
                    self.lost[o.node] = lease.describe(o.value.node_now_s) if lease else "released by someone"

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        release_on(self.inventory, [m for m in self.machines if m not in self.lost], self.holder)

    def __enter__(self) -> LeaseKeeper:
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def command_leases(inventory: Inventory, nodes: Iterable[NodeSpec | str]) -> Iterator[None]:
    """Leases for one command that changes nodes (``testbed link apply``, ``power set``, ``provision``):
    taken on the machines of ``nodes`` before anything changes, renewed while it runs, given back when
    it ends. A machine that another holder has (a campaign, another person's commands) refuses the
    command, naming the holder, before anything changes (:class:`LeaseRefused`, exit 1). One person's
    commands on one controller share a holder: ``link clear`` after a ``link apply`` that was killed
    takes its lease over instead of waiting for it to expire."""
    machines = lease_machines(inventory, nodes)
    if not machines:
        yield
        return
    with LeaseKeeper(inventory, machines, holder_for(COMMANDS_HOLDER)):
        yield
