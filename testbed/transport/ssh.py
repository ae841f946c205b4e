"""Commands on a node over SSH (fabric/paramiko), with host keys checked against known_hosts.

Unknown host keys are refused, never added: a researcher must verify a new node's key once
(``ssh-keyscan``) rather than have the testbed trust whatever answers at an address.

Every wait is bounded. A request the node must answer (a channel, a command, the SFTP subsystem,
each SFTP operation, the kill of a timed-out command) waits at most ``reply_timeout_s``; a transfer
as a whole at most :meth:`SshTransport.transfer_deadline_s` of its size; and the kernel gives a
connection up when the node stops acknowledging (``TCP_USER_TIMEOUT``, with keepalives so that an
idle connection has something to acknowledge). A connection that failed one of these is dropped,
and the next command opens a new one. A node that froze (its kernel still acknowledging) is noticed
by the first bound, a node that vanished by the last.

One concept over ~550 lines, the SSH transport: its connection, commands, streams and transfers share
the bounded-wait machinery above and are not useful apart.
"""

from __future__ import annotations

import math
import os
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import paramiko
from fabric import Config, Connection

from foundation.errors import NodeError
from testbed.inventory import SshTarget
from testbed.transport.base import (
    DRAIN_AFTER_EXIT_S,
    KILL_GRACE_S,
    LINE_SEND_S,
    LINE_SESSION_EXIT_S,
    CommandResult,
    LineSession,
    Transport,
    _starttime,
    copy_from,
)
from testbed.transport.host_keys import HostKeyRefused, KnownHosts, certificates_first, known_hosts_name
from testbed.transport.jump_hosts import JumpHosts, JumpStream

CONNECT_ATTEMPTS = 3
BACKOFF_S = 0.5
REPLY_TIMEOUT_CONNECTS = 3.0  # a node's answer to one request may take this many connect timeouts
TRANSFER_FLOOR_BYTES_PER_S = 256 << 10  # a transfer slower than this on average is given up
KEEPALIVE_MISSES = 3  # keepalive intervals without an acknowledgement before the kernel gives up
UNACKNOWLEDGED_S = 60.0  # ... or this long where keepalives are off (at least a connect timeout)
BROKEN = (EOFError, TimeoutError, paramiko.SSHException)  # what a failed request leaves the connection as
T = TypeVar("T")
_JUMP_HOSTS = JumpHosts()  # one connection per jump host, shared by every node behind it


def close_jump_hosts() -> None:
    """Close this process's connections to jump hosts (they live as long as the process: a long-lived
    caller that is done with a lab ends them here; the next node behind one opens it again)."""
    _JUMP_HOSTS.close()


def _refused_host_key(t: SshTarget, name: str, reason: str) -> str:
    if "not found in known_hosts" in reason:
        return (f"host key of {t.host}:{t.port} is not in {t.known_hosts}; refusing to connect. Verify the node's "
                f"key, then: ssh-keyscan -p {t.port} {t.host} >> {t.known_hosts} (or list the lab's CA there as "
                f"@cert-authority)")  # fmt: skip
    return f"refusing to connect to {t.host}:{t.port}: {reason}"


def _sftp_path(remote: str) -> str:
    return remote[2:] if remote.startswith("~/") else remote


class _LowLatencySocket(socket.socket):
    """TCP for a chatty protocol. No Nagle on our side (SSH sends an exec request and EOF back to
    back), and an immediate ACK after every read: most sshds keep Nagle on for non-interactive
    sessions, so without quick ACKs each small reply waits ~40 ms for our delayed ACK."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if hasattr(socket, "TCP_QUICKACK"):  # Linux
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return data


def unacknowledged_s(target: SshTarget) -> float:
    """How long sent data (or keepalive probes) may go unacknowledged before the kernel drops the
    connection: a node that vanished costs this, not the kernel's ~15 minutes of retransmissions."""
    if target.keepalive_s > 0:
        return max(target.connect_timeout_s, KEEPALIVE_MISSES * target.keepalive_s)
    return max(target.connect_timeout_s, UNACKNOWLEDGED_S)


def _give_up_when_unacknowledged(sock: socket.socket, target: SshTarget) -> None:
    """TCP keepalives every ``keepalive_s`` of silence, and ``TCP_USER_TIMEOUT`` (Linux)."""
    if target.keepalive_s > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        interval = max(1, round(target.keepalive_s))
        options = (("TCP_KEEPIDLE", interval), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", KEEPALIVE_MISSES))
        for option, value in options:
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(unacknowledged_s(target) * 1000))


def _connect_socket(target: SshTarget) -> socket.socket:
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM):
        sock = _LowLatencySocket(family, kind, proto)
        try:
            sock.settimeout(target.connect_timeout_s)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _give_up_when_unacknowledged(sock, target)
        return sock
    raise error or OSError(f"no address for {target.host}")


def _reporting_pid(line: str) -> str:
    """Run ``line`` under a shell that first prints its pid and start time (``/proc/<pid>/stat``
    field 22, no fork): what a timeout or close ends, with its process group (sshd makes each
    session's shell a group leader); the start time tells that pid apart from a later process that
    reuses it."""
    report = '{ read -r s < /proc/$$/stat; } 2>/dev/null; set -- ${s##*) }; echo "$$ ${20}"; '
    return "sh -c " + shlex.quote(report + line)


def _reported_pid(line: bytes | str) -> tuple[int, str] | None:
    """(pid, start time) from the first line :func:`_reporting_pid` prints; None if it is not one."""
    words = (line.decode(errors="replace") if isinstance(line, bytes) else line).split()
    if not words or not words[0].isdigit() or len(words) > 2 or not all(w.isdigit() for w in words):
        return None
    return int(words[0]), words[1] if len(words) == 2 else ""


class _Deadline:
    """Calls ``expire`` once, from a timer thread, if the ``with`` block is still running after
    ``seconds``; ``expired`` says whether it did."""

    def __init__(self, seconds: float, expire: Callable[[], None]) -> None:
        self.seconds = seconds
        self.expired = False
        self._ended = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire, args=(expire,))
        self._timer.daemon = True

    def _fire(self, expire: Callable[[], None]) -> None:
        with self._lock:
            if self._ended:
                return
            self.expired = True
        expire()

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._ended = True
        self._timer.cancel()


@contextmanager
def _remote_file(sftp: paramiko.SFTPClient, path: str, mode: str) -> Iterator[paramiko.SFTPFile]:
    """``path`` opened on the node, closed (the node confirming the writes) if all went well. After
    a failure it is not closed here: its SFTP session ends next, and the handle with it."""
    remote = sftp.open(path, mode)
    try:
        yield remote
    except BaseException:
        remote._closed = True  # else paramiko closes it from __del__, on a session that is gone
        raise
    remote.close()


def _sftp_makedirs(sftp: paramiko.SFTPClient, directory: str) -> None:
    """``mkdir -p`` over SFTP."""
    if directory in ("", "/", "."):
        return
    try:
        sftp.stat(directory)
    except OSError:
        _sftp_makedirs(sftp, os.path.dirname(directory))
        sftp.mkdir(directory)


class SshTransport(Transport):
    """One SSH connection per node, opened on first use and shared by concurrent commands."""

    def __init__(
        self,
        node: str,
        target: SshTarget,
        *,
        use_sudo: bool,
        reply_timeout_s: float | None = None,
        transfer_floor_bytes_per_s: float = TRANSFER_FLOOR_BYTES_PER_S,
    ) -> None:
        super().__init__(node, use_sudo=use_sudo and target.user != "root")
        self.target = target
        self.reply_timeout_s = reply_timeout_s or REPLY_TIMEOUT_CONNECTS * target.connect_timeout_s
        self.transfer_floor_bytes_per_s = transfer_floor_bytes_per_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def transfer_deadline_s(self, size_bytes: int) -> float:
        """How long a transfer of ``size_bytes`` may take in all: a connection and a reply's time,
        plus its bytes at the floor rate."""
        return self.target.connect_timeout_s + self.reply_timeout_s + size_bytes / self.transfer_floor_bytes_per_s

    # -- connection

    def connection(self) -> Connection:
        with self._lock:
            if self._conn is None or not self._conn.is_connected:
                self._conn = self._connect()
            return self._conn

    def _connect(self) -> Connection:
        t = self.target
        kwargs: dict[str, object] = {
            "allow_agent": True,
            "look_for_keys": not t.identity_files,
            "banner_timeout": t.connect_timeout_s,
            "auth_timeout": t.connect_timeout_s,
        }
        if t.identity_files:
            kwargs["key_filename"] = [os.path.expanduser(f) for f in t.identity_files]
        if t.password_env:
            if t.password_env not in os.environ:
                raise NodeError(self.node, f"environment variable {t.password_env} (password_env) is not set")
            kwargs["password"] = os.environ[t.password_env]
        known = KnownHosts(t.known_hosts)
        name = known_hosts_name(t.host, t.port)
        kwargs["transport_factory"] = certificates_first(known, name)
        delay = BACKOFF_S
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            conn = Connection(
                t.host,
                user=t.user,
                port=t.port,
                connect_timeout=max(1, math.ceil(t.connect_timeout_s)),
                connect_kwargs=dict(kwargs),
                config=Config(overrides={"load_ssh_configs": False}),
            )
            known.install(conn.client)
            try:
                try:
                    conn.connect_kwargs["sock"] = self._socket()
                    conn.open()
                    known.check_revoked(name, conn.client.get_transport().get_remote_server_key())
                except BaseException:
                    conn.close()  # whatever failed, leave no transport thread or socket behind
                    raise
            except paramiko.BadHostKeyException as exc:
                raise NodeError(
                    self.node,
                    (
                        f"host key of {t.host}:{t.port} CHANGED (expected {exc.expected_key.get_fingerprint().hex()}, "
                        f"got {exc.key.get_fingerprint().hex()}); a reinstalled node or a man in the middle. If the "
                        f"node was reinstalled: ssh-keygen -R '{name}' -f {t.known_hosts}"
                    ),
                ) from None
            except HostKeyRefused as exc:
                raise NodeError(self.node, _refused_host_key(t, name, str(exc))) from None
            except paramiko.AuthenticationException as exc:
                how = f"identity file {', '.join(t.identity_files)}" if t.identity_files else \
                    "the SSH agent and default keys"  # fmt: skip
                raise NodeError(
                    self.node, f"authentication failed for {t.describe()} with {how}: {exc}"
                ) from None
            except NodeError:
                raise  # a jump host that refused us: said by its own transport
            except paramiko.SSHException as exc:
                error: Exception = exc
            except (TimeoutError, OSError, EOFError) as exc:
                error = exc
            else:
                transport = conn.client.get_transport()
                if transport is not None and t.keepalive_s > 0:
                    transport.set_keepalive(max(1, int(t.keepalive_s)))
                return conn
            if attempt < CONNECT_ATTEMPTS:
                time.sleep(delay)
                delay *= 2
        raise NodeError(
            self.node,
            f"cannot connect to {t.describe()} after {CONNECT_ATTEMPTS} attempts: {type(error).__name__}: {error}",
        )

    def _socket(self) -> socket.socket | JumpStream:
        """A stream to the node's sshd: a TCP connection, or a channel through the last jump host."""
        t = self.target
        if not t.jumps:
            return _connect_socket(t)
        hop = _JUMP_HOSTS.transport(t.jumps[-1], self.node, lambda name, target: SshTransport(name, target,
                                                                                              use_sudo=False))
        return hop.forward(t.host, t.port)

    def _drop(self, conn: Connection) -> None:
        """Forget a broken connection (the next command opens a new one) and close it. Closing ends
        whatever waits on it, from any thread: paramiko's writes give up once it is closed."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
        with suppress(Exception):
            conn.close()

    def _channel(self, conn: Connection) -> paramiko.Channel:
        """A session channel on ``conn``, opened within the connect timeout (else ``conn`` is dropped)."""
        transport = conn.client.get_transport()
        if transport is None or not transport.is_active():
            self._drop(conn)
            raise NodeError(self.node, "SSH connection lost")
        try:
            chan = transport.open_session(timeout=self.target.connect_timeout_s)
        except (*BROKEN, OSError) as exc:
            self._drop(conn)
            raise NodeError(self.node, f"no channel within {self.target.connect_timeout_s:g} s: {exc}") from None
        chan.settimeout(self.reply_timeout_s)
        return chan

    def _request(self, conn: Connection, request: Callable[[], T], what: str) -> T:
        """``request()`` (one the node must answer, such as exec), bounded by the reply timeout:
        past it ``conn`` is dropped, which ends the wait, and a NodeError is raised."""
        with _Deadline(self.reply_timeout_s, lambda: self._drop(conn)) as deadline:
            try:
                return request()
            except (*BROKEN, OSError) as exc:
                if not deadline.expired:
                    self._drop(conn)
                    raise NodeError(self.node, f"{what}: {type(exc).__name__}: {exc}") from None
        raise NodeError(self.node, f"no answer to {what} within {self.reply_timeout_s:g} s; the connection was dropped")

    def _start(self, conn: Connection, chan: paramiko.Channel, command: str) -> None:
        self._request(conn, lambda: chan.exec_command(command), "a command request")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- commands

    def _execute(self, line: str, *, timeout_s: float, stdin: bytes | None, privileged: bool) -> CommandResult:
        start = time.monotonic()
        conn = self.connection()
        chan = self._channel(conn)
        self._start(conn, chan, _reporting_pid(line))
        pending = memoryview(stdin or b"")
        if not pending:
            chan.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = start + timeout_s
        exited_at: float | None = None
        timed_out = False
        while True:
            # stdin goes in pieces between reads, so a command that does not read it cannot block us
            while pending and chan.send_ready():
                try:
                    pending = pending[chan.send(pending[:32768]) :]
                except OSError:  # the command ended without reading all of it
                    pending = memoryview(b"")
                if not pending:
                    chan.shutdown_write()
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            now = time.monotonic()
            if chan.exit_status_ready():
                exited_at = exited_at or now
                # Wait briefly for the rest of the output; a leftover child holding stdout must not hang us.
                drained = chan.eof_received or now - exited_at > DRAIN_AFTER_EXIT_S
                if drained and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
            elif now >= deadline:
                timed_out = True
                break
            select.select([chan], [], [], max(0.0, min(deadline - now, 0.01 if pending else 0.2)))
        pid_line, _, rest = bytes(out).partition(b"\n")
        if timed_out:
            if (reported := _reported_pid(pid_line)) is not None:
                self._kill_group(*reported)
            chan.close()
        exit_code = None if timed_out else chan.recv_exit_status()  # ready: the loop ended on it
        chan.close()
        transport = conn.client.get_transport()
        if exit_code == -1 and (transport is None or not transport.is_active()):
            self._drop(conn)  # the channel closed with the connection: how the command ended is unknown
            raise NodeError(self.node, f"SSH connection lost while running `{line.removeprefix('exec ')[:120]}`")
        return CommandResult(
            node=self.node,
            command=line.removeprefix("exec "),
            exit_code=exit_code,
            stdout=rest.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            duration_s=time.monotonic() - start,
            timed_out=timed_out,
        )

    def _kill_group(self, pid: int, started: str) -> None:
        """TERM, then KILL, the process group of the timed-out command's shell, as the SSH user even
        for a privileged command: its ``sudo`` runs with the user's real uid, so the user may signal
        it, and sudo relays the TERM to the command it runs as root. No shell runs under sudo, which the
        printed sudoers rules would refuse (testbed/provisioning/sudo_rules.py). Nothing is signalled when ``pid``
        is no longer the shell that started at ``started`` (it ended, and its pid may be another's)."""
        steps = int(KILL_GRACE_S / 0.1)
        stat = f"sed 's/.*) //' /proc/{pid}/stat 2>/dev/null"
        same = f'[ "$({_starttime(str(pid))})" = {started} ] || exit 0; ' if started else ""
        script = (
            f"{same}g=$({stat} | cut -d' ' -f3); [ -n \"$g\" ] || exit 0; "
            f'kill -TERM "-$g" 2>/dev/null; i=0; '
            f'while kill -0 "-$g" 2>/dev/null && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done; '
            f'kill -KILL "-$g" 2>/dev/null; exit 0'
        )
        command = "sh -c " + shlex.quote(script)
        # A connection that does not carry the kill is dropped and the kill tried once more on a new
        # one: a frozen session leaves the node's sshd itself able to take it.
        for _ in range(2):
            try:
                conn = self.connection()
                chan = self._channel(conn)
                self._start(conn, chan, command)
                ended = chan.status_event.wait(KILL_GRACE_S + self.reply_timeout_s)
                chan.close()
                if ended:
                    return
                self._drop(conn)  # it took the kill and never said how it went: kill was sent
                return
            except (*BROKEN, OSError, NodeError):
                continue  # the connection is dropped

    # -- files

    def _sftp(self, conn: Connection) -> paramiko.SFTPClient:
        """An SFTP session of its own on ``conn``; every operation on it waits at most the reply timeout."""
        chan = self._channel(conn)
        self._request(conn, lambda: chan.invoke_subsystem("sftp"), "the SFTP subsystem request")
        return paramiko.SFTPClient(chan)  # its version exchange under the channel's timeout

    @contextmanager
    def _transfer(self, what: str) -> Iterator[tuple[paramiko.SFTPClient, Callable[[int], _Deadline]]]:
        """An SFTP session for one transfer, and ``within(size_bytes)`` that bounds what follows by
        the transfer's deadline. A transfer that fails leaves its connection dropped, except on an
        error the node answered (a missing file): NodeError, saying whether the node stopped
        answering or the deadline passed."""
        conn = self.connection()
        deadlines: list[_Deadline] = []

        def within(size_bytes: int) -> _Deadline:
            deadlines.append(_Deadline(self.transfer_deadline_s(size_bytes), lambda: self._drop(conn)))
            return deadlines[-1]

        try:
            sftp = self._sftp(conn)
            try:
                yield sftp, within
            except BaseException as exc:
                if not isinstance(exc, OSError) or isinstance(exc, TimeoutError) or sftp.sock.closed:
                    self._drop(conn)  # whatever it was doing midway is unknown: never reused
                raise
            finally:
                with suppress(*BROKEN, OSError):
                    sftp.close()
        except (*BROKEN, OSError) as exc:
            if deadlines and deadlines[-1].expired:
                why = (f"it was not done by its deadline ({deadlines[-1].seconds:.0f} s, at least "
                       f"{self.transfer_floor_bytes_per_s / 1024:g} KiB/s); the connection was dropped")  # fmt: skip
            elif isinstance(exc, TimeoutError):
                why = f"the node did not answer within {self.reply_timeout_s:g} s; the connection was dropped"
            else:
                why = f"{exc}" or type(exc).__name__
            raise NodeError(self.node, f"cannot {what}: {why}") from None

    def put(
        self,
        local: str | Path,
        remote: str,
        *,
        mode: int | None = None,
        offset: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        path = _sftp_path(remote)
        with self._transfer(f"copy {local} to {remote}") as (sftp, within), open(local, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            with within(max(0, size - offset)):
                _sftp_makedirs(sftp, os.path.dirname(path))
                with _remote_file(sftp, path, "r+b" if offset else "wb") as target:
                    if mode is not None:
                        target.chmod(mode)  # before the content: never readable with default permissions
                    target.set_pipelined(True)
                    copy_from(source, target, offset, progress)

    def get(self, remote: str, local: str | Path) -> None:
        """Copy ``remote`` to ``local``, which appears only once all of it arrived."""
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.{os.getpid()}-{threading.get_ident()}.partial")
        path = _sftp_path(remote)
        try:
            with self._transfer(f"copy {remote} from the node") as (sftp, within):
                size = sftp.stat(path).st_size or 0
                with within(size), _remote_file(sftp, path, "rb") as source, open(partial, "wb") as sink:
                    source.prefetch(size)
                    while chunk := source.read(1 << 20):
                        sink.write(chunk)
            os.replace(partial, local)
        finally:
            partial.unlink(missing_ok=True)

    def _open_line_session(self, argv: Sequence[str]) -> LineSession:
        conn = self.connection()
        chan = self._channel(conn)
        self._start(conn, chan, _reporting_pid("exec " + shlex.join(argv)))
        session = _SshLineSession(chan, self._kill_group)
        try:
            reported = _reported_pid(session.read_line(self.target.connect_timeout_s))
            if reported is None:
                raise NodeError(self.node, f"`{shlex.join(argv)[:120]}` did not start as a command of ours")
            session.pid, session.started = reported
        except BaseException:
            chan.close()
            raise
        return session


class _SshLineSession(LineSession):
    def __init__(self, chan: paramiko.Channel, kill_group: Callable[[int, str], None]) -> None:
        super().__init__()
        self._chan = chan
        self._kill_group = kill_group
        self.pid: int | None = None
        self.started = ""

    def send_line(self, text: str) -> None:
        self._chan.settimeout(LINE_SEND_S)
        try:
            self._chan.sendall(text.encode() + b"\n")
        except TimeoutError:
            raise TimeoutError(f"the command took no input for {LINE_SEND_S:g} s") from None

    def _receive(self, timeout_s: float) -> bytes | None:
        self._chan.settimeout(timeout_s)
        try:
            return self._chan.recv(65536)
        except TimeoutError:
            return None

    def close(self) -> None:
        try:
            self._chan.shutdown_write()
            self._chan.status_event.wait(LINE_SESSION_EXIT_S)
            if not self._chan.exit_status_ready() and self.pid is not None:
                self._kill_group(self.pid, self.started)
        except (*BROKEN, OSError):
            pass
        finally:
            self._chan.close()
