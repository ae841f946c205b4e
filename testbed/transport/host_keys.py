"""Which host keys the controller trusts: a known_hosts file as OpenSSH reads it, markers included.

Plain lines (``host[,host...] type key``, hashed names too) name a node's own key. ``@cert-authority
PATTERNS type key`` trusts every host certificate that CA signed for a host the patterns match: a lab
that signs its boards' host keys lists one line for all of them, and a reinstalled board needs no new
line. ``@revoked`` refuses a key (a plain key, a certificate's key, or a CA) whatever else trusts it.

A certificate is checked as OpenSSH checks it (PROTOCOL.certkeys): a host certificate (type 2), signed by
a trusted CA whose patterns match the host, valid now, and naming the host among its principals.
Where a CA may vouch for the host, certificate host key algorithms are offered first (as OpenSSH does),
so that a node that has both a plain key and a certificate shows the certificate.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko
from paramiko.message import Message

CERT_SUFFIX = "-cert-v01@openssh.com"
HOST_CERTIFICATE = 2  # a certificate's type: 1 user, 2 host


class HostKeyRefused(paramiko.SSHException):
    """The node's key is not trusted: unknown, revoked, or a certificate that does not hold."""


@dataclass(frozen=True)
class Authority:
    """One ``@cert-authority`` line."""

    patterns: tuple[str, ...]
    key_blob: bytes
    line: int


def known_hosts_name(host: str, port: int) -> str:
    """How known_hosts names ``host:port`` (``[host]:port`` off port 22)."""
    return host if port == 22 else f"[{host}]:{port}"


def _host_matches(patterns: tuple[str, ...], name: str) -> bool:
    """OpenSSH's pattern lists: ``*`` and ``?`` wildcards, a ``!`` pattern that matches excludes, and
    hashed names (``|1|salt|hash``) compared by hash."""
    matched = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if pattern.startswith("|1|"):
            hit = paramiko.HostKeys.hash_host(name, pattern) == pattern
        else:  # only * and ? are special ("[host]:port" is literal, not a character class)
            wild = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
            hit = re.fullmatch(wild, name.lower()) is not None
        if hit and negated:
            return False
        matched = matched or hit
    return matched


class KnownHosts:
    """A known_hosts file read once: the plain keys (for paramiko), the CAs and the revoked keys."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.keys = paramiko.HostKeys()
        self.authorities: list[Authority] = []
        self.revoked: set[bytes] = set()
        if not self.path.exists():
            return
        for number, raw in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            marker = line.split(None, 1)[0] if line.startswith("@") else None
            fields = line.split()[1:] if marker else line.split()
            if len(fields) < 3:
                continue
            try:
                blob = base64.b64decode(fields[2], validate=True)
            except ValueError:
                continue
            if marker == "@cert-authority":
                self.authorities.append(Authority(tuple(fields[0].split(",")), blob, number))
            elif marker == "@revoked":
                self.revoked.add(blob)
            elif marker is None:
                try:
                    entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), number)
                except (paramiko.SSHException, ValueError, TypeError):
                    entry = None  # a key type paramiko does not know: OpenSSH skips it too
                if entry is not None:
                    for name in entry.hostnames:
                        self.keys.add(name, entry.key.get_name(), entry.key)

    def authorities_for(self, name: str) -> list[Authority]:
        return [a for a in self.authorities if _host_matches(a.patterns, name)]

    def prefers_certificates(self, name: str) -> bool:
        """Whether a CA may vouch for ``name`` and no plain key is known for it (OpenSSH's order)."""
        return bool(self.authorities_for(name)) and self.keys.lookup(name) is None

    def install(self, client: paramiko.SSHClient) -> None:
        """Make ``client`` trust this file: its plain keys, and the policy below for the rest."""
        for name in self.keys:
            for key_type, key in self.keys[name].items():
                client.get_host_keys().add(name, key_type, key)
        client.set_missing_host_key_policy(_CertificateOrRefuse(self))

    def check_revoked(self, name: str, key: paramiko.PKey) -> None:
        if key.asbytes() in self.revoked:
            raise HostKeyRefused(f"the host key of {name} is marked @revoked in {self.path}")


class _CertificateOrRefuse(paramiko.MissingHostKeyPolicy):
    """No plain key is known for the host: accept a valid certificate from a trusted CA, else refuse."""

    def __init__(self, known: KnownHosts) -> None:
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        self.known.check_revoked(hostname, key)
        blob = getattr(key, "public_blob", None)
        if blob is None or not blob.key_type.endswith(CERT_SUFFIX):
            raise HostKeyRefused(f"{hostname} not found in known_hosts")
        problem = certificate_problem(self.known, hostname, blob.key_blob)
        if problem is not None:
            raise HostKeyRefused(f"the host certificate of {hostname} {problem}")


def _skip_public_key(message: Message, key_type: str) -> None:
    base = key_type[: -len(CERT_SUFFIX)]
    if base.startswith("ssh-rsa") or base.startswith("rsa-"):
        message.get_mpint()
        message.get_mpint()
    elif base.startswith("ecdsa-"):
        message.get_string()
        message.get_string()
    else:  # ssh-ed25519
        message.get_string()


def certificate_problem(known: KnownHosts, name: str, certificate: bytes, now_s: float | None = None) -> str | None:
    """What is wrong with ``certificate`` (an OpenSSH host certificate's wire form) for host ``name``
    (as known_hosts names it), or None if a CA of ``known`` vouches for it."""
    message = Message(certificate)
    try:
        key_type = message.get_text()
        message.get_string()  # nonce
        _skip_public_key(message, key_type)
        message.get_int64()  # serial
        kind = message.get_int()
        key_id = message.get_text()
        principals_field = Message(message.get_string())
        valid_after, valid_before = message.get_int64(), message.get_int64()
        message.get_string()  # critical options
        message.get_string()  # extensions
        message.get_string()  # reserved
        signer = message.get_string()
        signed = certificate[: len(message.get_so_far())]
        signature = message.get_string()
    except (paramiko.SSHException, IndexError, ValueError, TypeError):
        return "cannot be read"
    if kind != HOST_CERTIFICATE:
        return f"({key_id!r}) is a user certificate, not a host certificate"
    principals = []
    while principals_field.get_remainder():
        principals.append(principals_field.get_text())
    host = name[1:].split("]:", 1)[0] if name.startswith("[") else name
    if principals and host not in principals:
        return f"({key_id!r}) is for {', '.join(principals)}, not {host}"
    now = int(time.time() if now_s is None else now_s)
    if not valid_after <= now < valid_before:
        return f"({key_id!r}) is not valid now (valid from {valid_after} to {valid_before}, epoch seconds)"
    if signer in known.revoked:
        return f"({key_id!r}) is signed by a CA marked @revoked in {known.path}"
    authorities = [a for a in known.authorities_for(name) if a.key_blob == signer]
    if not authorities:
        return f"({key_id!r}) is signed by a CA that {known.path} does not list as @cert-authority for {name}"
    try:
        ca_key = paramiko.PKey.from_type_string(Message(signer).get_text(), signer)
        valid = ca_key.verify_ssh_sig(signed, Message(signature))
    except (paramiko.SSHException, ValueError, TypeError):
        valid = False
    return None if valid else f"({key_id!r}) carries a signature its CA did not make"


def certificates_first(known: KnownHosts, name: str) -> type[paramiko.Transport]:
    """The transport class to connect to ``name`` with: certificate host key algorithms offered first
    where a CA may vouch for it (paramiko offers plain keys first), else paramiko's own."""
    if not known.prefers_certificates(name):
        return paramiko.Transport
    return _CertificateFirstTransport


class _CertificateFirstTransport(paramiko.Transport):
    @property
    def preferred_keys(self) -> tuple[str, ...]:
        plain = tuple(k for k in self._filter_algorithm("keys") if not k.endswith(CERT_SUFFIX))
        return tuple(k + CERT_SUFFIX for k in plain) + plain
