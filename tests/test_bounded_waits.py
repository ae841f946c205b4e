"""Every wait on a node is bounded: a node whose sshd freezes (SIGSTOP: the kernel still ACKs, so
only our own timeouts can notice) or that vanishes from the network (packets dropped: only TCP can
notice) costs a bounded time, its broken connection is dropped, and the next command reconnects.

The freezes are real: the sshd process that serves the transport's session is stopped (never the
listening sshd, so a fresh connection still works), at a chosen point of the exchange. Each call
under test runs in a daemon thread joined with ``HANG_S``: a generous bound that fails only on
a hang, never on a slow machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import paramiko
import pytest

from foundation.errors import NodeError
from testbed.emulation.sshd_server import SshdServer
from testbed.transport import LocalTransport, SshTransport, Transport
from testbed.transport.fanout import fan_out
from tests.conftest import REPO, emulated_inventory, emulated_lab
from tests.test_transports import ssh_target
from tests.waiting import HANG_S, wait_until

CONNECT_S = 2.0  # the test targets' connect timeout (their reply timeout is a multiple of it)


# --------------------------------------------------------------------------------------------
# Helpers: which sshd serves a connection, freezing it, calls with a hang limit


def _hex_address(address: str, port: int) -> str:
    """``address:port`` as /proc/net/tcp writes it (IPv4, the address's bytes in host order)."""
    return f"{socket.inet_aton(address)[::-1].hex().upper()}:{port:04X}"


def serving_sshd(t: SshTransport, net_tcp: Path = Path("/proc/net/tcp")) -> list[int]:
    """pids of the sshd processes that hold the server's end of ``t``'s connection."""
    transport = t.connection().client.get_transport()
    assert transport is not None
    ours, theirs = transport.sock.getsockname()[:2], transport.sock.getpeername()[:2]
    server_end = (_hex_address(*theirs), _hex_address(*ours))
    inodes = {
        f[9] for f in (line.split() for line in net_tcp.read_text().splitlines()[1:]) if (f[1], f[2]) == server_end
    }
    assert len(inodes) == 1, f"the server's end of {ours} -> {theirs} not found"
    return _holders(f"socket:[{inodes.pop()}]")


def _holders(link: str) -> list[int]:
    """sshd processes with an open file descriptor whose link reads ``link`` (a socket or a path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "sshd":
                continue
            if any(os.readlink(fd) == link for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@contextmanager
def freezer() -> Iterator[Callable[[list[int]], None]]:
    """``freeze(pids)`` SIGSTOPs processes; every one of them is SIGCONTed when the block ends."""
    stopped: list[int] = []

    def freeze(pids: list[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    try:
        yield freeze
    finally:
        for pid in stopped:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class Call:
    """``call()`` in a daemon thread (a hang must not keep the test session from ending)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.elapsed_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # handed to the test
            self.error = exc
        self.elapsed_s = time.monotonic() - self.started

    def finish(self, limit_s: float = HANG_S) -> Call:
        self._thread.join(limit_s)
        assert not self._thread.is_alive(), f"still waiting after {limit_s:.0f} s: an unbounded wait"
        return self


@pytest.fixture
def node(sshd: SshdServer, ssh_keys) -> Iterator[SshTransport]:
    t = SshTransport("node-a", ssh_target(ssh_keys, sshd.port, connect_timeout_s=CONNECT_S), use_sudo=False)
    t.run(["true"]).check()
    yield t
    t.close()


def assert_reconnects_beside(t: SshTransport, frozen: list[int]) -> None:
    """The next command runs on a fresh connection while the frozen session stays frozen."""
    assert t.run(["echo", "again"]).check().stdout == "again\n"
    assert not set(serving_sshd(t)) & set(frozen)
    assert {process_state(p) for p in frozen} == {"T"}


# --------------------------------------------------------------------------------------------
# Transfers


def test_a_put_whose_node_freezes_mid_transfer_fails_in_bounded_time_and_the_next_command_reconnects(node, tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(32 << 20))  # far more than the channel's window and the sockets' buffers
    frozen = serving_sshd(node)
    chunks = []
    with freezer() as freeze:

        def progress(written: int) -> None:
            if not chunks:
                freeze(frozen)  # after the first MiB went out
            chunks.append(written)

        put = Call(lambda: node.put(source, str(tmp_path / "on-node" / "weights.bin"), progress=progress)).finish()
        assert isinstance(put.error, NodeError) and put.error.node == "node-a", put.error
        assert "weights.bin" in str(put.error) and chunks[0] < source.stat().st_size
        assert_reconnects_beside(node, frozen)


def test_a_get_whose_node_freezes_mid_transfer_fails_in_bounded_time_and_leaves_no_partial_file(
    node, tmp_path, monkeypatch
):
    remote = tmp_path / "on-node" / "telemetry.csv"
    remote.parent.mkdir()
    remote.write_bytes(os.urandom(32 << 20))
    local = tmp_path / "back" / "telemetry.csv"
    frozen = serving_sshd(node)
    original = paramiko.SFTPFile.read
    reads: list[int] = []
    with freezer() as freeze:

        def read_then_freeze(self: paramiko.SFTPFile, size: int | None = None) -> bytes:
            data = original(self, size)
            if not reads:  # the node froze once the first bytes had come
                freeze(frozen)
            reads.append(len(data))
            return data

        monkeypatch.setattr(paramiko.SFTPFile, "read", read_then_freeze)
        get = Call(lambda: node.get(str(remote), local)).finish()
        assert isinstance(get.error, NodeError) and get.error.node == "node-a", get.error
        assert 0 < sum(reads) < remote.stat().st_size
        assert not local.exists() and not list(local.parent.iterdir()), "a partial file was left"
        monkeypatch.undo()
        assert_reconnects_beside(node, frozen)


def test_a_trickling_get_ends_at_its_size_scaled_deadline(sshd, ssh_keys, tmp_path):
    # the node answers every request, slowly (its sshd runs 5 ms a second), so no reply times out:
    # only the transfer's deadline, scaled to the file's size at a floor rate, can end it
    remote = tmp_path / "slow.csv"
    remote.write_bytes(b"x" * (64 << 20))
    target = ssh_target(ssh_keys, sshd.port, connect_timeout_s=CONNECT_S)
    t = SshTransport("node-a", target, use_sudo=False, transfer_floor_bytes_per_s=1 << 30)
    t.run(["true"]).check()
    slowed = serving_sshd(t)
    stop = threading.Event()

    def throttle() -> None:
        for _ in range(int(HANG_S)):  # bounded: a second per turn
            with freezer() as freeze:
                try:
                    freeze(slowed)
                except ProcessLookupError:  # the session ended: its connection was dropped
                    return
                if stop.wait(1.0):
                    return
            time.sleep(0.005)

    throttler = threading.Thread(target=throttle, daemon=True)
    throttler.start()
    try:
        get = Call(lambda: t.get(str(remote), tmp_path / "back.csv")).finish()
        assert isinstance(get.error, NodeError) and "deadline" in str(get.error), get.error
    finally:
        stop.set()
        throttler.join(10)
        t.close()


# --------------------------------------------------------------------------------------------
# Commands


def test_an_exec_request_the_node_never_answers_fails_in_bounded_time(node, monkeypatch):
    frozen = serving_sshd(node)
    original = paramiko.Transport.open_session
    armed = [True]
    with freezer() as freeze:

        def open_then_freeze(self: paramiko.Transport, *args: Any, **kwargs: Any) -> paramiko.Channel:
            channel = original(self, *args, **kwargs)
            if armed:  # the node freezes right after it opened the command's channel
                armed.clear()
                freeze(frozen)
            return channel

        monkeypatch.setattr(paramiko.Transport, "open_session", open_then_freeze)
        run = Call(lambda: node.run(["echo", "hello"], timeout_s=600)).finish()
        assert isinstance(run.error, NodeError) and run.error.node == "node-a", run.error or run.value
        assert not armed
        assert_reconnects_beside(node, frozen)


def test_the_kill_of_a_timed_out_command_is_bounded_when_the_node_freezes(node, monkeypatch, tmp_path):
    frozen = serving_sshd(node)
    original = paramiko.Channel.exec_command
    pidfile = tmp_path / "sleeper.pid"
    with freezer() as freeze:

        def exec_then_freeze(self: paramiko.Channel, command: str) -> None:
            original(self, command)
            if "kill -TERM" in command:  # the node took the kill, then froze before saying how it went
                freeze(frozen)

        monkeypatch.setattr(paramiko.Channel, "exec_command", exec_then_freeze)
        # (a timeout long enough for the command to have started, and said its pid, on a loaded machine)
        run = Call(lambda: node.run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"], timeout_s=5.0)).finish()
        assert run.error is None and run.value.timed_out and run.value.exit_code is None, run.error
        assert frozen and {process_state(p) for p in frozen} == {"T"}
        sleeper = int(pidfile.read_text())
        wait_until(lambda: process_state(sleeper) in ("gone", "Z"), "the timed-out command ended by the kill")
        assert_reconnects_beside(node, frozen)


@pytest.fixture(params=["ssh", "local"])
def any_transport(request, sshd, ssh_keys) -> Iterator[Transport]:
    if request.param == "ssh":
        t: Transport = SshTransport("node-a", ssh_target(ssh_keys, sshd.port, connect_timeout_s=CONNECT_S),
                                    use_sudo=False)  # fmt: skip
    else:
        t = LocalTransport("node-a")
    yield t
    t.close()


def test_a_line_session_whose_command_stops_reading_fails_in_bounded_time(any_transport):
    session = any_transport.open_line_session(["sleep", "300"])  # never reads what it is sent
    try:
        flood = Call(lambda: [session.send_line("t" * 4095) for _ in range(4096)]).finish()  # 16 MiB
        assert isinstance(flood.error, (TimeoutError, NodeError)), flood.error or "every line was taken"
    finally:
        session.close()


# --------------------------------------------------------------------------------------------
# fan-out


def test_fan_out_gives_a_node_past_its_deadline_an_error_and_the_others_their_values(sshd, ssh_keys, tmp_path):
    names = ["n0", "n1", "n2", "n3"]
    nodes = {n: SshTransport(n, ssh_target(ssh_keys, sshd.port, connect_timeout_s=CONNECT_S), use_sudo=False)
             for n in names}  # fmt: skip
    pidfile = tmp_path / "stuck.pid"
    deadline_s = 3.0

    def operation(name: str) -> str:
        stuck = f"echo $$ > {pidfile}; exec sleep 300"
        return nodes[name].run(["sh", "-c", stuck if name == "n1" else f"echo {name}"], timeout_s=600).check().stdout

    try:
        for t in nodes.values():  # connected first: the deadline is the operation's, not a handshake's under load
            t.run(["true"]).check()
        result = Call(lambda: fan_out(names, operation, max_parallel=2, deadline_s=deadline_s)).finish().value
        assert result is not None
        assert {n: v.strip() for n, v in result.values().items()} == {"n0": "n0", "n2": "n2", "n3": "n3"}
        (late,) = result.failed
        assert late.node == "n1" and "deadline" in (late.error or "") and late.duration_s >= deadline_s
    finally:
        if pidfile.exists():
            with suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
        for t in nodes.values():
            t.close()


def test_a_node_stuck_past_its_deadline_does_not_keep_the_controller_from_exiting():
    script = (
        "import threading\n"
        "from testbed.transport.fanout import fan_out\n"
        "result = fan_out(['ok', 'stuck'], lambda n: threading.Event().wait() if n == 'stuck' else n, deadline_s=1.0)\n"
        "print(sorted(result.values()), [o.node for o in result.failed])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_S, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['ok'] ['stuck']"


# --------------------------------------------------------------------------------------------
# On an emulated lab: a run whose node freezes mid-collect, and a node that vanishes


def emulated(test: Callable[..., None]) -> Callable[..., None]:
    """A test on the emulated lab: root, slow."""
    test = pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")(test)
    return pytest.mark.root(pytest.mark.slow(test))


PREFIX = "hc"
TINY = REPO / "examples" / "models" / "tiny"
RUN_LIMIT_S = 300.0  # a whole campaign of one run, frozen node included; fails only on a hang


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = emulated_inventory(tmp_path_factory.mktemp("bounded"), PREFIX, 160)
    # rate shaping (HTB) only: what is under test is restore, not the delay path's handler
    text = path.read_text()
    for profile in ("wifi-up: {rate: 8MBps, delay: 2ms}", "wifi-down: {rate: 12MBps, delay: 2ms}"):
        assert profile in text
        text = text.replace(profile, profile.replace(", delay: 2ms", ""))
    path.write_text(text)
    with emulated_lab(path):
        yield path


def in_node(node: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{node}", *argv], capture_output=True, text=True,
                          check=True, timeout=30).stdout  # fmt: skip


def node_state(lab: Path) -> dict[str, Any]:
    """Per node: the qdiscs of every interface, our iptables rules, the power mode and whether a
    journal (links or power) is there; what a run must leave as it found it."""
    from testbed.emulation.resolved import load_lab
    from testbed.energy.power_modes import show_power

    inventory = load_lab(lab)
    power = show_power(inventory).require("reading power modes")
    state: dict[str, Any] = {}
    for node in inventory.nodes:
        qdiscs = {}
        for link in json.loads(in_node(node.name, "ip", "-j", "link", "show")):
            shown = json.loads(in_node(node.name, "tc", "-j", "qdisc", "show", "dev", link["ifname"]) or "[]")
            qdiscs[link["ifname"]] = sorted((q["kind"], q.get("handle", ""), q.get("parent", "")) for q in shown)
        rules = [line for line in in_node(node.name, "iptables-save").splitlines() if line.startswith("-")]
        state[node.name] = {"qdiscs": qdiscs, "iptables": rules, "power": power[node.name].mode_name,
                            "power_journal": power[node.name].journal}  # fmt: skip
    state["link_journals"] = sorted(
        str(p) for p in (lab.parent / "state" / "nodes").glob("*/home/hil-testbed/netem/journal.json")
    )
    return state


def events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted((out / "runs").glob("*/events.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]  # fmt: skip


@emulated
@pytest.mark.timeout(RUN_LIMIT_S + 300)  # the lab's start, the run, reading the nodes back
def test_a_node_frozen_mid_collect_fails_the_run_in_bounded_time_with_links_and_power_restored(lab, tmp_path):
    # During drain, orin's sampler file grows by 96 MiB of comment lines (a long recording), so that
    # collect's transfer of it lasts long enough to be caught: the session sshd that holds the file
    # open (collect's own connection) is frozen mid-transfer, while orin's listening sshd still
    # accepts the fresh connections restore needs.
    before = node_state(lab)
    campaign = tmp_path / "frozen.yaml"
    campaign.write_text(f"""name: frozen
inventory: {lab}
base:
  model: {TINY}
  partition: {{device_layers: 2, stages: 1}}
  devices: [orin]
  workload: {{arrival: constant, rate_per_s: 2.0, requests_per_device: 2, max_new_tokens: 8}}
  link: {{profile: wifi-up}}
  power: {{orin: MODE_50W}}
  telemetry: {{interval_ms: 100}}
  drain_s: 3
matrix:
  method: [ushape]
seed: 5
run_timeout_s: 120
""")
    out = tmp_path / "out"
    home = lab.parent / "state" / "nodes" / "orin" / "home"
    log = (tmp_path / "controller.log").open("ab")
    started = time.monotonic()
    controller = subprocess.Popen([sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out)],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def phase_started(phase: str) -> bool:
        assert controller.poll() is None, f"the campaign ended before {phase}: {events(out)[-3:]}"
        return any(e["event"] == "phase_start" and e["phase"] == phase for e in events(out))

    try:
        with freezer() as freeze:
            wait_until(lambda: phase_started("drain"), "the run reaching its drain phase", RUN_LIMIT_S)
            (datafile,) = home.glob("hil-testbed/telemetry/*/orin.csv")
            with datafile.open("ab") as grown:
                grown.write((b"#" + b"x" * 1022 + b"\n") * (96 << 10))
            holders: list[int] = []
            wait_until(lambda: bool(holders.extend(_holders(str(datafile))) or holders), "collect opening the file",
                     RUN_LIMIT_S, interval_s=0.0)  # fmt: skip
            freeze(holders)
            assert phase_started("collect")
            assert controller.wait(timeout=RUN_LIMIT_S - (time.monotonic() - started)) == 1
            assert {process_state(p) for p in holders} == {"T"}, "the frozen session was not left frozen"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(30)
        log.close()
    with sqlite3.connect(out / "ledger.sqlite", timeout=30) as db:
        rows = db.execute("SELECT state, reason, failed_node FROM runs").fetchall()
    assert len(rows) == 1 and rows[0][0] == "failed" and rows[0][2] == "orin", rows
    assert rows[0][1].startswith("collect") and "orin" in rows[0][1], rows
    phases = [e["phase"] for e in events(out) if e["event"] == "phase_start"]
    assert phases[-3:] == ["collect", "restore", "record"], phases
    assert node_state(lab) == before


@emulated
def test_a_node_that_vanishes_is_given_up_by_tcp_in_bounded_time(lab, tmp_path):
    # the node's packets are dropped in its namespace: no ACK comes back, so only TCP_USER_TIMEOUT
    # (with keepalives to have something unacknowledged) can end a command that prints nothing
    import dataclasses

    from testbed.emulation.resolved import load_lab

    inventory = load_lab(lab)
    target = dataclasses.replace(inventory.ssh_target(inventory.node("xavier")), keepalive_s=1.0)
    t = SshTransport("xavier", target, use_sudo=False)
    pidfile = tmp_path / "quiet.pid"
    rule = ["INPUT", "-p", "tcp", "--dport", "22", "-j", "DROP"]
    try:
        quiet = Call(lambda: t.run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"], timeout_s=600))
        wait_until(pidfile.exists, "the quiet command starting")
        in_node("xavier", "iptables", "-w", "-I", *rule)
        quiet.finish()
        assert isinstance(quiet.error, NodeError) and quiet.error.node == "xavier", quiet.error or quiet.value
    finally:
        subprocess.run(["ip", "netns", "exec", f"{PREFIX}-xavier", "iptables", "-w", "-D", *rule],
                       capture_output=True, check=False, timeout=30)  # fmt: skip
        if pidfile.exists():
            with suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
        t.close()
