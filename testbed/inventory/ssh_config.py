"""How a node is reached over SSH: the inventory's settings over the lab's SSH config, as ``ssh``
itself would combine them.

The SSH config is OpenSSH's (``~/.ssh/config``, or the file ``ssh.config`` names; ``none`` reads
none). A node's ``address`` may be one of its ``Host`` aliases; from the matching blocks come
``HostName``, ``User``, ``Port``, ``IdentityFile``, ``UserKnownHostsFile``, ``ConnectTimeout`` and
``ProxyJump``. What the inventory writes (on the node, its groups, then ``defaults.ssh``) wins over the
config, as ``ssh``'s command line does; what neither says takes ssh's own default.

Emulated nodes read no SSH config unless the inventory names one: their addresses and keys are the
emulation's, and a user's ``Host *`` block must not send them elsewhere.

A jump (``ssh.jump`` or ``ProxyJump``: ``[user@]host[:port]``, several joined by commas, the first
hop first) is reached the same way: its name looked up in the same config; from the inventory it takes
only the known_hosts file and the timeouts, never the node's user or key (as ``ssh -l -i -J`` does).
``ProxyCommand`` is refused (a command we cannot bound or stop): write a ``ProxyJump`` instead.
"""

from __future__ import annotations

import getpass
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import paramiko

from foundation.errors import TestbedError
from testbed.inventory.schema import SshSettings

DEFAULT_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
MAX_JUMPS = 8
HOP = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9_.-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(?P<port>[0-9]{1,5}))?$"
)


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to open one SSH connection, defaults applied: where (``host``, ``port``),
    as whom (``user``, keys), which host keys to trust, and the hops to go through first."""

    host: str
    port: int
    user: str
    identity_file: str | None
    known_hosts: str
    password_env: str | None
    connect_timeout_s: float
    keepalive_s: float
    jumps: tuple[SshTarget, ...] = ()  # the first hop first
    more_identity_files: tuple[str, ...] = ()  # further IdentityFile lines of the SSH config
    alias: str | None = None  # the name the inventory gave, where the SSH config mapped it to ``host``
    node_config: str = DEFAULT_CONFIG  # the SSH config the node's own ssh reads (on the node)

    @property
    def identity_files(self) -> tuple[str, ...]:
        return ((self.identity_file,) if self.identity_file else ()) + self.more_identity_files

    def describe(self) -> str:
        via = "".join(f" via {hop.user}@{hop.host}:{hop.port}" for hop in reversed(self.jumps))
        return f"{self.user}@{self.host}:{self.port}{via}"


def _pick(layers: Sequence[SshSettings], field: str) -> object:
    for layer in layers:
        value = getattr(layer, field)
        if value is not None:
            return value
    return None


@lru_cache(maxsize=32)
def _read_config(path: str, mtime_ns: int) -> paramiko.SSHConfig:
    try:
        return paramiko.SSHConfig.from_path(path)
    except (OSError, ValueError, paramiko.ConfigParseError) as exc:
        raise TestbedError(f"{path}: cannot read this SSH config: {exc}") from None


def ssh_config(path: str | None) -> paramiko.SSHConfig | None:
    """The SSH config at ``path`` (None or ``none``: no config; a missing default file: none)."""
    if path is None or path == "none":
        return None
    full = os.path.expanduser(path)
    try:
        mtime_ns = os.stat(full).st_mtime_ns
    except FileNotFoundError:
        if path == DEFAULT_CONFIG:
            return None
        raise TestbedError(f"{path}: the SSH config named by ssh.config does not exist") from None
    return _read_config(full, mtime_ns)


def config_path(layers: Sequence[SshSettings], emulated: bool) -> str | None:
    named = _pick(layers, "config")
    if named is not None:
        return None if named == "none" else str(named)
    return None if emulated else DEFAULT_CONFIG


def _lookup(config: paramiko.SSHConfig | None, name: str, where: str) -> dict:
    if config is None:
        return {}
    found = dict(config.lookup(name))
    if "proxycommand" in found and found["proxycommand"].lower() != "none":
        raise TestbedError(f"{where}: Host {name} has a ProxyCommand, which the testbed does not run (it could not "
                           "bound or stop it); write ProxyJump instead")  # fmt: skip
    return found


def _number(value: object, what: str, where: str) -> float:
    try:
        return float(str(value))
    except ValueError:
        raise TestbedError(f"{where}: {what} {value!r} is not a number") from None


def resolve_target(name: str, layers: Sequence[SshSettings], *, emulated: bool) -> SshTarget:
    """The target for the node at ``name`` (its address or a Host alias), the inventory's ``layers``
    (most specific first) over the SSH config."""
    path = config_path(layers, emulated)
    config = ssh_config(path)
    where = path or "the inventory"
    found = _lookup(config, name, where)
    jump = _pick(layers, "jump") or found.get("proxyjump")
    jumps = () if jump in (None, "none") else _hops(str(jump), _hop_layers(layers), config, where)
    return _target(name, layers, found, jumps, where)


def _target(name: str, layers: Sequence[SshSettings], found: dict, jumps: tuple[SshTarget, ...], where: str,
            *, user: str | None = None, port: int | None = None) -> SshTarget:  # fmt: skip
    files = [os.path.expanduser(f) for f in found.get("identityfile", [])]
    explicit = _pick(layers, "identity_file")
    known = _pick(layers, "known_hosts") or (found.get("userknownhostsfile", "").split() or [DEFAULT_KNOWN_HOSTS])[0]
    timeout = _pick(layers, "connect_timeout_s")
    if timeout is None and "connecttimeout" in found:
        timeout = _number(found["connecttimeout"], "ConnectTimeout", where)
    host = found.get("hostname", name)
    return SshTarget(
        host=host,
        port=int(port or _pick(layers, "port") or _number(found.get("port", 22), "Port", where)),
        user=str(user or _pick(layers, "user") or found.get("user") or getpass.getuser()),
        identity_file=str(explicit) if explicit else (files[0] if files else None),
        known_hosts=str(known),
        password_env=_pick(layers, "password_env"),  # type: ignore[arg-type]
        connect_timeout_s=float(timeout if timeout is not None else 10.0),  # type: ignore[arg-type]
        keepalive_s=float(_pick(layers, "keepalive_s") or 15.0),  # type: ignore[arg-type]
        jumps=jumps,
        more_identity_files=tuple(files[1:] if not explicit else files),
        alias=name if host != name else None,
        node_config=str(_pick(layers, "node_config") or DEFAULT_CONFIG),
    )


def _hop_layers(layers: Sequence[SshSettings]) -> list[SshSettings]:
    """What a hop takes from the inventory: how to trust and wait, never the node's user, port or key (as
    ``ssh -l user -i key -J hop`` uses neither for the hop): those come from the hop's word and the config."""
    fields = ("known_hosts", "connect_timeout_s", "keepalive_s")
    return [SshSettings.model_construct(**{field: _pick(layers, field) for field in fields})]


def _hops(
    jump: str, layers: Sequence[SshSettings], config: paramiko.SSHConfig | None, where: str
) -> tuple[SshTarget, ...]:
    words = [w.strip() for w in jump.split(",")]
    if len(words) > MAX_JUMPS:
        raise TestbedError(f"{where}: jump {jump!r} has {len(words)} hops; at most {MAX_JUMPS}")
    hops: list[SshTarget] = []
    for word in words:
        match = HOP.match(word)
        if match is None:
            raise TestbedError(f"{where}: jump hop {word!r} is not [user@]host[:port]")
        host = match["host"].strip("[]")
        found = _lookup(config, host, where)
        port = int(match["port"]) if match["port"] else None
        if port is not None and not 1 <= port <= 65535:
            raise TestbedError(f"{where}: jump hop {word!r}: port {port} is not 1-65535")
        hops.append(_target(host, layers, found, tuple(hops), where, user=match["user"], port=port))
    return tuple(hops)
