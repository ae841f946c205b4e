"""Jump hosts (OpenSSH's ProxyJump): a node behind a bastion is reached through a channel the bastion's
sshd opens to it (``direct-tcpip``), and the node's own SSH session runs inside that channel, end to end:
the bastion forwards bytes and never sees the node's keys or commands.

One connection per jump host serves every node behind it (30 boards behind one bastion are 30 channels
on one connection, not 30 logins), opened on first use and again after it broke. A chain of hops is a
hop whose own target has jumps: each is reached through the one before it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import paramiko

from foundation.errors import NodeError
from testbed.inventory import SshTarget

if TYPE_CHECKING:
    from testbed.transport.ssh import SshTransport


CLOSE_WAIT_S = 5.0  # how long a close waits for a write in progress on the same stream


class JumpStream:
    """The channel through a jump host that a node's SSH connection runs in, used as its socket, with
    each write and the close in one order. paramiko's channel releases its lock before it sends a
    write's packet, so a close from another thread (the node's connection closing while its transport
    thread still writes) could send CLOSE before that DATA; OpenSSH then drops the jump host's whole
    connection ("data packet referred to nonexistent channel"), and every node behind it with it."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()

    def send(self, data: bytes) -> int:
        with self._lock:
            return self._channel.send(data)  # (a full window times out within the channel's timeout)

    def sendall(self, data: bytes) -> None:
        with self._lock:
            self._channel.sendall(data)

    def close(self) -> None:
        taken = self._lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            self._channel.close()
        finally:
            if taken:
                self._lock.release()

    def __getattr__(self, name: str) -> object:  # recv, settimeout, fileno, getpeername, ...: the channel's
        return getattr(self._channel, name)


class JumpHost:
    """One jump host's connection, shared; :meth:`forward` opens a stream through it."""

    def __init__(self, transport: SshTransport) -> None:
        self.transport = transport

    def forward(self, host: str, port: int) -> JumpStream:
        """A channel from the jump host to ``host:port``, opened within the hop's connect timeout. A
        connection that broke is opened again once; a refusal by the jump host is said as its own."""
        t = self.transport.target
        for attempt in (1, 2):
            conn = self.transport.connection()
            link = conn.client.get_transport()
            try:
                if link is None or not link.is_active():
                    raise EOFError("connection closed")
                return JumpStream(link.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0),
                                                    timeout=t.connect_timeout_s))  # fmt: skip
            except paramiko.ChannelException as exc:
                raise NodeError(self.transport.node, f"jump host {t.user}@{t.host}:{t.port} cannot open a channel to "
                                f"{host}:{port}: {exc.text} (is AllowTcpForwarding on there, and {host}:{port} "
                                "reachable from it?)") from None  # fmt: skip
            except (EOFError, OSError, paramiko.SSHException) as exc:
                self.transport._drop(conn)
                if attempt == 2:
                    raise NodeError(self.transport.node, f"jump host {t.user}@{t.host}:{t.port}: {exc}") from None
        raise AssertionError("unreachable")


class JumpHosts:
    """The jump hosts this controller process has reached, by target."""

    def __init__(self) -> None:
        self._hosts: dict[SshTarget, JumpHost] = {}
        self._lock = threading.Lock()

    def transport(self, hop: SshTarget, node: str, make: Callable[[str, SshTarget], SshTransport]) -> JumpHost:
        """The shared connection to ``hop`` (made with ``make(name, target)`` the first time; its errors
        name ``node``'s jump host)."""
        with self._lock:
            if hop not in self._hosts:
                self._hosts[hop] = JumpHost(make(f"{node} (jump host {hop.host})", hop))
            return self._hosts[hop]

    def close(self) -> None:
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            host.transport.close()
