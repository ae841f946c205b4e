"""Commands on a node over SSH (fabric/paramiko), with host keys checked against known_hosts.

Unknown host keys are refused, never added: a researcher must verify a new node's key once
(``ssh-keyscan``) rather than have the testbed trust whatever answers at an address.
"""

from __future__ import annotations

import math
import os
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import paramiko
from fabric import Config, Connection

from foundation.errors import NodeError
from testbed.inventory import SshTarget
from testbed.transport.base import (
    DRAIN_AFTER_EXIT_S,
    KILL_GRACE_S,
    LINE_SESSION_EXIT_S,
    CommandResult,
    LineSession,
    Transport,
    copy_from,
)

CONNECT_ATTEMPTS = 3
BACKOFF_S = 0.5


def _known_hosts_name(target: SshTarget) -> str:
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


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
        return sock
    raise error or OSError(f"no address for {target.host}")


def _reporting_pid(line: str) -> str:
    """Run ``line`` under a shell that first prints its pid: what a timeout or close ends, with its
    process group (sshd makes each session's shell a group leader)."""
    return "sh -c " + shlex.quote("echo $$; " + line)


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

    def __init__(self, node: str, target: SshTarget, *, use_sudo: bool) -> None:
        super().__init__(node, use_sudo=use_sudo and target.user != "root")
        self.target = target
        self._conn: Connection | None = None
        self._lock = threading.Lock()

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
            "look_for_keys": t.identity_file is None,
            "banner_timeout": t.connect_timeout_s,
            "auth_timeout": t.connect_timeout_s,
        }
        if t.identity_file:
            kwargs["key_filename"] = [os.path.expanduser(t.identity_file)]
        if t.password_env:
            if t.password_env not in os.environ:
                raise NodeError(self.node, f"environment variable {t.password_env} (password_env) is not set")
            kwargs["password"] = os.environ[t.password_env]
        known_hosts = os.path.expanduser(t.known_hosts)
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
            conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            if os.path.exists(known_hosts):
                conn.client.load_host_keys(known_hosts)
            try:
                try:
                    conn.connect_kwargs["sock"] = _connect_socket(t)
                    conn.open()
                except BaseException:
                    conn.close()  # whatever failed, leave no transport thread or socket behind
                    raise
            except paramiko.BadHostKeyException as exc:
                raise NodeError(
                    self.node,
                    (
                        f"host key of {t.host}:{t.port} CHANGED (expected {exc.expected_key.get_fingerprint().hex()}, "
                        f"got {exc.key.get_fingerprint().hex()}); a reinstalled node or a man in the middle. If the "
                        f"node was reinstalled: ssh-keygen -R '{_known_hosts_name(t)}' -f {t.known_hosts}"
                    ),
                ) from None
            except paramiko.AuthenticationException as exc:
                how = f"identity file {t.identity_file}" if t.identity_file else "the SSH agent and default keys"
                raise NodeError(
                    self.node, f"authentication failed for {t.user}@{t.host}:{t.port} with {how}: {exc}"
                ) from None
            except paramiko.SSHException as exc:
                if "not found in known_hosts" in str(exc):
                    raise NodeError(
                        self.node,
                        (
                            f"host key of {t.host}:{t.port} is not in {t.known_hosts}; refusing to connect. Verify "
                            f"the node's key, then: ssh-keyscan -p {t.port} {t.host} >> {t.known_hosts}"
                        ),
                    ) from None
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
            f"cannot connect to {t.host}:{t.port} after {CONNECT_ATTEMPTS} attempts: {type(error).__name__}: {error}",
        )

    def _channel(self) -> paramiko.Channel:
        transport = self.connection().client.get_transport()
        if transport is None:
            raise NodeError(self.node, "SSH connection lost")
        return transport.open_session(timeout=self.target.connect_timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- commands

    def _execute(self, line: str, *, timeout_s: float, stdin: bytes | None, privileged: bool) -> CommandResult:
        start = time.monotonic()
        chan = self._channel()
        chan.exec_command(_reporting_pid(line))
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
            if pid_line.strip().isdigit():
                self._kill_group(int(pid_line), privileged)
            chan.close()
        exit_code = None if timed_out else chan.recv_exit_status()
        chan.close()
        return CommandResult(
            node=self.node,
            command=line.removeprefix("exec "),
            exit_code=exit_code,
            stdout=rest.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            duration_s=time.monotonic() - start,
            timed_out=timed_out,
        )

    def _kill_group(self, pid: int, privileged: bool) -> None:
        """TERM, then KILL, the process group of the timed-out command's shell."""
        steps = int(KILL_GRACE_S / 0.1)
        script = (
            f"g=$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f3); [ -n \"$g\" ] || exit 0; "
            f'kill -TERM "-$g" 2>/dev/null; i=0; '
            f'while kill -0 "-$g" 2>/dev/null && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done; '
            f'kill -KILL "-$g" 2>/dev/null; exit 0'
        )
        command = ("sudo -n -- " if privileged else "") + "sh -c " + shlex.quote(script)
        try:
            chan = self._channel()
            chan.exec_command(command)
            chan.recv_exit_status()
            chan.close()
        except (paramiko.SSHException, OSError, NodeError):
            pass  # the connection is gone; the node's sshd will have closed the session

    # -- files

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
        try:
            sftp = self.connection().sftp()
            _sftp_makedirs(sftp, os.path.dirname(path))
            with open(local, "rb") as source, sftp.open(path, "r+b" if offset else "wb") as target:
                if mode is not None:
                    target.chmod(mode)  # before the content: never readable with default permissions
                target.set_pipelined(True)
                copy_from(source, target, offset, progress)
        except OSError as exc:
            raise NodeError(self.node, f"cannot copy {local} to {remote}: {exc}") from None

    def get(self, remote: str, local: str | Path) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.connection().sftp().get(_sftp_path(remote), str(local))
        except OSError as exc:
            raise NodeError(self.node, f"cannot copy {remote} from the node: {exc}") from None

    def _open_line_session(self, argv: Sequence[str]) -> LineSession:
        chan = self._channel()
        chan.exec_command(_reporting_pid("exec " + shlex.join(argv)))
        session = _SshLineSession(chan, lambda pid: self._kill_group(pid, privileged=False))
        try:
            session.pid = int(session.read_line(self.target.connect_timeout_s))
        except BaseException:
            chan.close()
            raise
        return session


class _SshLineSession(LineSession):
    def __init__(self, chan: paramiko.Channel, kill_group: Callable[[int], None]) -> None:
        super().__init__()
        self._chan = chan
        self._kill_group = kill_group
        self.pid: int | None = None

    def send_line(self, text: str) -> None:
        self._chan.sendall(text.encode() + b"\n")

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
                self._kill_group(self.pid)
        except (paramiko.SSHException, OSError):
            pass
        finally:
            self._chan.close()
