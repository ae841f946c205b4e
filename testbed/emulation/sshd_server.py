"""Real OpenSSH servers started by the testbed itself, with generated keys.

Used by the emulated testbed (one sshd per emulated node), by tests and by benchmarks: the SSH
transport always talks to a real sshd, never to a mock.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import NodeError, TestbedError
from nodes.emulated.cgroup import CpuCgroup

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd")


def find_sshd() -> str:
    """Absolute path of sshd (it refuses to re-exec itself from a relative path)."""
    for path in SSHD_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("sshd")
    if found:
        return found
    raise TestbedError("sshd not found; install OpenSSH's server (Debian: apt-get install openssh-server)")


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def accepts_connections(address: str, port: int, *, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``address:port``."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def generate_key(path: Path) -> Path:
    """An ed25519 key pair at ``path`` and ``path.pub`` (kept if it already exists)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hil-testbed", "-f", str(path)],
            check=True,
            stdin=subprocess.DEVNULL,
        )
    return path


@dataclass(frozen=True)
class SshKeys:
    """A host key, a client key, and the files that make them trusted by each other."""

    directory: Path
    host_key: Path
    client_key: Path
    authorized_keys: Path
    known_hosts: Path

    @classmethod
    def create(cls, directory: Path) -> SshKeys:
        directory.mkdir(parents=True, exist_ok=True)
        host_key = generate_key(directory / "host_ed25519")
        client_key = generate_key(directory / "client_ed25519")
        authorized = directory / "authorized_keys"
        authorized.write_text(client_key.with_suffix(".pub").read_text())
        known_hosts = directory / "known_hosts"
        known_hosts.touch()
        return cls(directory, host_key, client_key, authorized, known_hosts)

    def trust(self, address: str, port: int, host_key: Path | None = None) -> None:
        """Add a host key (this one by default) for ``address:port`` to known_hosts, as
        ``ssh-keyscan`` would."""
        name = address if port == 22 else f"[{address}]:{port}"
        key = " ".join((host_key or self.host_key).with_suffix(".pub").read_text().split()[:2])
        with self.known_hosts.open("a") as f:
            f.write(f"{name} {key}\n")


class SshdServer:
    """One sshd in the foreground (``-D``) on ``address:port``: a child process of ours, or, with
    ``detached``, one that outlives us (the emulated testbed's nodes). With ``netns`` it runs in that
    network namespace, and with ``cgroup`` every session it starts inherits that CPU quota."""

    def __init__(
        self,
        keys: SshKeys,
        *,
        address: str = "127.0.0.1",
        port: int | None = None,
        name: str = "sshd",
        environment: dict[str, str] | None = None,
        host_key: Path | None = None,
        files_dir: Path | None = None,
        netns: str | None = None,
        hostname: str | None = None,
        cgroup: CpuCgroup | None = None,
        detached: bool = False,
        mounts: str = "",
        extra_config: tuple[str, ...] = (),
    ) -> None:
        self.keys = keys
        self.address = address
        self.port = port or (22 if netns else free_port(address))
        self.name = name
        self.host_key = host_key or keys.host_key
        self.netns = netns
        self.hostname = hostname
        self.cgroup = cgroup
        self.detached = detached
        self.mounts = mounts  # sh run in the node's mount namespace before sshd starts (netns only)
        self.extra_config = extra_config  # sshd_config lines of its own (a jump host's, a host certificate)
        # Set in every session: stand-in tools on PATH, or a HOME of the node's own (which also keeps
        # the controller user's shell start-up files, such as a slow pyenv init, out of node commands).
        self.environment = dict(environment or {})
        if "HOME" in self.environment:
            Path(self.environment["HOME"]).mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        files_dir = files_dir or keys.directory
        self.config_path = files_dir / f"{name}.sshd_config"
        self.log_path = files_dir / f"{name}.sshd.log"
        self.pid_path = files_dir / f"{name}.sshd.pid"

    def config_text(self) -> str:
        root_login = "prohibit-password" if os.geteuid() == 0 else "no"
        return "\n".join(
            [
                f"Port {self.port}",
                f"ListenAddress {self.address}",
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.keys.authorized_keys}",
                f"PidFile {self.pid_path}",
                "StrictModes no",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                f"PermitRootLogin {root_login}",
                "UsePAM no",
                "PrintMotd no",
                "X11Forwarding no",
                "MaxSessions 100",
                "MaxStartups 200",
                "LogLevel ERROR",
                "Subsystem sftp internal-sftp",
                *self._setenv_lines(),
                *self.extra_config,
                "",
            ]
        )

    def _setenv_lines(self) -> list[str]:
        # sshd keeps only the first SetEnv line, so every variable goes on one.
        if not self.environment:
            return []
        return ["SetEnv " + " ".join(f'"{k}={v}"' for k, v in self.environment.items())]

    def start(self, timeout_s: float = 10.0) -> SshdServer:
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def launch(self) -> int:
        """Start sshd without waiting for it to listen; return its pid."""
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # Debian's privilege separation dir
        self.config_path.write_text(self.config_text())
        argv = [find_sshd(), "-D", "-e", "-f", str(self.config_path)]
        if self.netns:
            argv = self._in_namespaces(argv)
        cgroup = self.cgroup
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=self.detached,
            preexec_fn=(lambda: cgroup.attach(os.getpid())) if cgroup else None,
        )
        log.close()
        self.keys.trust(self.address, self.port, self.host_key)
        return self.process.pid

    def _in_namespaces(self, argv: list[str]) -> list[str]:
        """Run ``argv`` in the node's network namespace, with a UTS and a mount namespace of its own.

        The host name is the node's: MPI tells nodes apart by it (ranks on one host name talk through
        shared memory, not the network). /sys is mounted anew so that it shows the namespace's own
        interfaces (UCX, for one, finds devices there), with the host's cgroup file systems moved
        onto it so that the node's tools still reach its cgroup. None of this touches the host.
        """
        scratch = self.config_path.parent / f".{self.name}.cgroupfs"
        scratch.mkdir(exist_ok=True)
        setup = (
            'hostname "$0" && mount --rbind /sys/fs/cgroup "$1" && mount -t sysfs sysfs /sys '
            '&& mount --move "$1" /sys/fs/cgroup && ' + (f"{{ {self.mounts}; }} && " if self.mounts else "")
            + 'shift && exec "$@"'
        )
        return [
            "nsenter", f"--net=/run/netns/{self.netns}", "--",
            "unshare", "--uts", "--mount", "--propagation", "slave", "--",
            "sh", "-c", setup, self.hostname or self.name, str(scratch), *argv,
        ]  # fmt: skip

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until sshd accepts connections; raise with its log if it exits or never listens."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NodeError(
                    self.name,
                    f"sshd exited with {self.process.returncode}: "
                    f"{self.log_path.read_text(errors='replace')[-500:]}"
                )
            if accepts_connections(self.address, self.port, timeout_s=0.2):
                return
            time.sleep(0.02)
        self.stop()
        raise NodeError(self.name, f"sshd did not listen on {self.address}:{self.port} in {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def __enter__(self) -> SshdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def reach_script(paths: list[Path], scratch: Path) -> str:
    """sh (for a node's own mount namespace) that lets any user reach ``paths``: each directory on the
    way that others may not pass through (a Python under /root, 0700) is covered by a tmpfs that others
    may pass, with the one entry on the way put back into it by a bind mount. The host is untouched."""
    blocked: dict[Path, set[str]] = {}
    for path in paths:
        parts = path.resolve().parts
        for depth in range(2, len(parts)):
            here = Path(*parts[:depth])
            if not here.stat().st_mode & 0o001:
                blocked.setdefault(here, set()).add(parts[depth])
                break
    lines = []
    for i, (directory, names) in enumerate(sorted(blocked.items())):
        kept = [(f"{scratch}/{i}-{n}", directory / n) for n in sorted(names)]
        lines += [f"mkdir -p {shlex.quote(k)} && mount --rbind {shlex.quote(str(d))} {shlex.quote(k)}" for k, d in kept]
        lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(str(directory))}")
        lines += [f"mkdir {shlex.quote(str(d))} && mount --move {shlex.quote(k)} {shlex.quote(str(d))}"
                  for k, d in kept]  # fmt: skip
    return " && ".join(lines)


def login_user() -> str:
    """The user that the started sshd lets in (the one running it)."""
    return getpass.getuser()


def loopback_inventory_yaml(keys: SshKeys, nodes: list[tuple[str, int]], *, python: str, extra_nodes: str = "") -> str:
    """Inventory text for server nodes that are sshd processes on 127.0.0.1 at the given ports."""
    lines = [
        "defaults:",
        "  ssh:",
        f"    user: {login_user()}",
        f"    identity_file: {keys.client_key}",
        f"    known_hosts: {keys.known_hosts}",
        "    connect_timeout: 3s",
        f"  python: {python}",
        "  sudo: false",
        "nodes:",
    ]
    for name, port in nodes:
        lines.append(f"  - {{name: {name}, kind: server, model: loopback, address: 127.0.0.1, ssh: {{port: {port}}}}}")
    return "\n".join(lines) + "\n" + extra_nodes
