"""Changes to this host made by the emulated testbed, each journaled before it is made, and their undo.

Everything goes through the ``ip`` command (iproute2), so the commands are the ones a user would
type and appear verbatim in errors.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from foundation.errors import NodeError, TestbedError
from nodes.emulated.cgroup import CpuCgroup, process_stat
from testbed.emulation.journal import Journal, JournalEntry

HOST = "emulation host"  # what a failure of this machine's own commands is reported against (exit status 1)
STOP_GRACE_S = 3.0
GONE_WAIT_S = 10.0
# down removes processes first, then what they live in, then the links between nodes, then puts back
# the host settings it raised, then the SSH user's sudo rules and the user (emulation.ssh_user).
UNDO_PHASES = ("process", "cgroup", "veth", "netns", "bridge", "route", "sysctl", "sudoers", "user")
# The kernel's IPv4 neighbour (ARP) table is one table for every network namespace, limited by these
# two host-wide settings (soft and hard); past the hard one, connect() fails with "No route to host".
NEIGHBOUR_TABLE_SOFT = "net.ipv4.neigh.default.gc_thresh2"
NEIGHBOUR_TABLE_HARD = "net.ipv4.neigh.default.gc_thresh3"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_checked(["ip", *args], check=check)


def run_checked(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one of this machine's commands; a failure is the emulation host's (NodeError)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise NodeError(HOST, f"`{argv[0]}` is not installed (make system-packages installs it)") from None
    if check and proc.returncode != 0:
        raise NodeError(HOST, f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctl(key: str) -> int:
    return int(_sysctl_path(key).read_text().split()[0])


def neighbour_entries_needed(nodes: int) -> int:
    """ARP entries a lab of ``nodes`` namespaces can hold at once: on each of its two networks
    (management and data) every namespace may know every other one and the host, as an MPI launch
    over all nodes makes it (every rank connects to every other)."""
    return 2 * nodes * (nodes + 1)


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def netns_pids(name: str) -> list[int]:
    if not netns_exists(name):
        return []
    proc = ip("netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def accepts_connections_in(netns: str, address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether ``address:port`` accepts a TCP connection from inside the namespace ``netns``."""
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])).close()"
    done = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe, address, str(port),
                           str(timeout_s)], capture_output=True, timeout=timeout_s + 10, check=False)  # fmt: skip
    return done.returncode == 0


def process_start_ticks(pid: int) -> int | None:
    """When a live process started (field 22 of /proc/PID/stat): tells a pid from a recycled one.
    None when there is no such process, or only its zombie (ended, waiting for its parent)."""
    fields = process_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(alive: Callable[[], object], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def end_processes(pids_now: Callable[[], list[int]]) -> None:
    """TERM what ``pids_now()`` lists, then KILL what is left after a grace period."""
    pids = pids_now()
    if not pids:
        return
    _signal(pids, signal.SIGTERM)
    if not _wait_gone(pids_now, STOP_GRACE_S):
        _signal(pids_now(), signal.SIGKILL)
        _wait_gone(pids_now, GONE_WAIT_S)


class HostChanges:
    """Makes changes under one name prefix, journaling each before making it."""

    def __init__(self, journal: Journal, prefix: str) -> None:
        self.journal = journal
        self.prefix = prefix

    def _ours(self, name: str) -> None:
        if not name.startswith(self.prefix):
            raise TestbedError(f"refusing to touch {name!r}: it does not carry the testbed prefix {self.prefix!r}")

    def bridge(self, name: str) -> None:
        self._ours(name)
        self.journal.record("bridge", name)
        ip("link", "add", name, "type", "bridge")
        ip("link", "set", name, "up")

    def netns(self, name: str) -> None:
        self._ours(name)
        self.journal.record("netns", name)
        ip("netns", "add", name)
        ip("-n", name, "link", "set", "lo", "up")

    def veth_into(
        self, host_name: str, bridge: str, netns: str, inner_name: str, address: str, prefixlen: int,
        *, per_packet: bool = False,
    ) -> None:
        """A veth pair: ``host_name`` on ``bridge``, ``inner_name`` with ``address`` inside ``netns``.
        ``per_packet``: segmentation and receive offloads off at both ends, so that tc and the NFQUEUE
        delay path see wire-sized packets, not 64 KB GSO bursts (needs ethtool)."""
        self._ours(host_name)
        self.journal.record("veth", host_name, netns=netns)
        ip("link", "add", host_name, "type", "veth", "peer", "name", inner_name, "netns", netns)
        if per_packet:
            offloads = ["tso", "off", "gso", "off", "gro", "off"]
            run_checked(["ethtool", "-K", host_name, *offloads])
            run_checked(["ip", "netns", "exec", netns, "ethtool", "-K", inner_name, *offloads])
        ip("link", "set", host_name, "master", bridge, "up")
        ip("-n", netns, "addr", "add", f"{address}/{prefixlen}", "dev", inner_name)
        ip("-n", netns, "link", "set", inner_name, "up")

    def point_to_point(
        self, host_name: str, netns: str, inner_name: str, host_address: str, inner_address: str
    ) -> None:
        """A veth pair as a point-to-point link: ``host_name`` here with ``host_address``, ``inner_name`` in
        ``netns`` with ``inner_address``, each with a route to the other's address alone."""
        self._ours(host_name)
        self.journal.record("veth", host_name, netns=netns)
        ip("link", "add", host_name, "type", "veth", "peer", "name", inner_name, "netns", netns)
        ip("addr", "add", host_address, "peer", f"{inner_address}/32", "dev", host_name)
        ip("-n", netns, "addr", "add", inner_address, "peer", f"{host_address}/32", "dev", inner_name)
        ip("link", "set", host_name, "up")
        ip("-n", netns, "link", "set", inner_name, "up")

    def unreachable_route(self, subnet: str) -> None:
        """Make ``subnet`` unreachable from this machine ("No route to host", as a lab's internal network
        is from outside it) instead of sending its packets to the default route."""
        self.journal.record("route", f"{self.prefix}-unreachable", subnet=subnet)
        ip("route", "add", "unreachable", subnet)

    def cgroup(self, name: str, cpus: float | None) -> CpuCgroup:
        self._ours(name)
        self.journal.record("cgroup", name)
        group = CpuCgroup(name)
        group.create()
        if cpus is not None:
            group.set_quota_cpus(cpus)
        return group

    def sysctl_at_least(self, key: str, value: int) -> None:
        """Raise the host setting ``key`` to ``value`` if it is lower; ``down`` puts the old value
        back unless someone has changed it since (another lab that raised it further keeps it)."""
        before = read_sysctl(key)
        if before >= value:
            return
        self.journal.record("sysctl", key, before=before, set=value)
        _sysctl_path(key).write_text(f"{value}\n")

    def neighbour_table_room(self, nodes: int) -> None:
        """Make room in the host-wide ARP table for a lab of ``nodes`` namespaces (a 31-node lab
        overflowed the default 1024 entries while its ranks connected, and MPI_Init failed)."""
        needed = neighbour_entries_needed(nodes)
        self.sysctl_at_least(NEIGHBOUR_TABLE_SOFT, needed)
        self.sysctl_at_least(NEIGHBOUR_TABLE_HARD, 2 * needed)

    def process(self, pid: int, label: str) -> None:
        """Record a process that was just started (a pid is only known after the start)."""
        self.journal.record("process", label, pid=pid, start_ticks=process_start_ticks(pid))

    def user(self, name: str, home: Path) -> pwd.struct_passwd:
        """A user of the lab's own (the nodes' SSH user), with ``home`` as its home; refused when
        ``name`` exists (it would not be ours to remove)."""
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            raise TestbedError(f"user {name} exists already on this host; emulation.ssh_user names a user that "
                               "`testbed emulate up` makes and `down` removes: choose a name no one uses")  # fmt: skip
        self.journal.record("user", f"{self.prefix}-user", user=name, comment=self._comment())
        # password "*": none to log in with, yet not locked ("!"), which sshd without PAM refuses
        run_checked(["useradd", "--no-create-home", "--user-group", "--home-dir", str(home), "--shell", "/bin/sh",
                     "--comment", self._comment(), "--password", "*", name])  # fmt: skip
        account = pwd.getpwnam(name)
        home.mkdir(parents=True, exist_ok=True)
        os.chown(home, account.pw_uid, account.pw_gid)
        home.chmod(0o700)
        return account

    def _comment(self) -> str:
        return f"hil-testbed emulated lab {self.prefix}"

    def sudoers(self, path: Path, text: str) -> None:
        """Install ``text`` as the sudoers file ``path`` (checked by visudo first; sudo skips the
        temporary file: its name has a dot)."""
        self.journal.record("sudoers", f"{self.prefix}-sudoers", path=str(path))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o440)
        checked = run_checked(["visudo", "-cf", str(tmp)], check=False)
        if checked.returncode != 0:
            tmp.unlink()
            raise NodeError(HOST, f"visudo refused the rules for {path}: {checked.stdout}{checked.stderr}")
        os.rename(tmp, path)


def undo(entries: list[JournalEntry], prefix: str) -> list[str]:
    """Remove everything in ``entries`` that still exists; return what could not be removed."""
    problems: list[str] = []
    _undo_processes([e for e in entries if e.kind == "process"])
    for phase in UNDO_PHASES[1:]:
        for entry in reversed([e for e in entries if e.kind == phase]):
            if phase not in ("process", "sysctl") and not entry.name.startswith(prefix):
                problems.append(f"skipped {entry.kind} {entry.name!r}: not under the prefix {prefix!r}")
                continue
            try:
                _UNDO[phase](entry)
            except (OSError, TestbedError) as exc:
                problems.append(f"{entry.kind} {entry.name}: {exc}")
    return problems


def _undo_processes(entries: list[JournalEntry]) -> None:
    """End the recorded processes that still run as the same process (same pid and start time)."""
    recorded = [(e.details.get("pid"), e.details.get("start_ticks")) for e in entries]

    def still_ours() -> list[int]:
        return [
            pid
            for pid, ticks in recorded
            if isinstance(pid, int) and ticks is not None and process_start_ticks(pid) == ticks
        ]

    end_processes(still_ours)


def _undo_cgroup(entry: JournalEntry) -> None:
    group = CpuCgroup(entry.name)
    if not any(os.path.isdir(d) for d in group.directories):
        return
    end_processes(group.pids)  # processes started over SSH on the node
    deadline = time.monotonic() + GONE_WAIT_S
    while True:
        try:
            group.remove()
            return
        except OSError:  # busy until the last task has been reaped
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _undo_link(entry: JournalEntry) -> None:
    if link_exists(entry.name):
        ip("link", "del", entry.name, check=False)
    if not _wait_gone(lambda: link_exists(entry.name), GONE_WAIT_S):
        raise NodeError(HOST, f"interface {entry.name} is still there after `ip link del`")


def _undo_netns(entry: JournalEntry) -> None:
    end_processes(lambda: netns_pids(entry.name))
    if netns_exists(entry.name):
        ip("netns", "del", entry.name)


def _undo_route(entry: JournalEntry) -> None:
    subnet = entry.details["subnet"]
    if ip("route", "show", "type", "unreachable", subnet, check=False).stdout.strip():
        ip("route", "del", "unreachable", subnet)


def _undo_sudoers(entry: JournalEntry) -> None:
    Path(entry.details["path"]).unlink(missing_ok=True)


def _undo_user(entry: JournalEntry) -> None:
    try:
        account = pwd.getpwnam(entry.details["user"])
    except KeyError:
        return
    if account.pw_gecos != entry.details.get("comment"):
        raise TestbedError(f"user {account.pw_name} is not the one `up` made ({account.pw_gecos!r}); left alone")
    end_processes(lambda: _pids_of(account.pw_uid))
    run_checked(["userdel", account.pw_name])


def _pids_of(uid: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and proc.stat().st_uid == uid and process_start_ticks(int(proc.name)) is not None:
                pids.append(int(proc.name))
    return pids


def _undo_sysctl(entry: JournalEntry) -> None:
    if read_sysctl(entry.name) == entry.details.get("set"):
        _sysctl_path(entry.name).write_text(f"{entry.details['before']}\n")


_UNDO = {
    "sysctl": _undo_sysctl,
    "sudoers": _undo_sudoers,
    "user": _undo_user,
    "cgroup": _undo_cgroup,
    "veth": _undo_link,
    "netns": _undo_netns,
    "bridge": _undo_link,
    "route": _undo_route,
}
