"""The transport interface: run commands, move files, keep background processes on one node.

Commands are argument lists; every argument is quoted here, once, so nothing from a user file is
ever interpreted by a shell. A command that outlives its timeout is killed with its whole process
group and reported as timed out (``exit_code is None``), never left running.
"""

from __future__ import annotations

import re
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from foundation.errors import NodeError
from testbed.transport import command_log

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KILL_GRACE_S = 2.0
DRAIN_AFTER_EXIT_S = 0.5  # after a command exits, how long a leftover child may hold its output
LINE_SESSION_EXIT_S = 1.0
LINE_SEND_S = 10.0  # how long a line may wait for the command to take it (one that stopped reading)


@dataclass(frozen=True)
class CommandResult:
    """What one command did on one node."""

    node: str
    command: str
    exit_code: int | None  # None when the command was killed after its timeout
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> CommandResult:
        """Return self if the command succeeded, else raise :class:`CommandFailed`."""
        if not self.ok:
            raise CommandFailed(self)
        return self


class CommandFailed(NodeError):
    def __init__(self, result: CommandResult) -> None:
        self.result = result
        if result.timed_out:
            what = f"timed out after {result.duration_s:.1f} s and was killed"
        else:
            what = f"exited with status {result.exit_code}"
        detail = (result.stderr.strip() or result.stdout.strip())[-500:]
        command = " ".join(result.command.split())
        command = command if len(command) <= 120 else command[:117] + "..."
        super().__init__(result.node, f"`{command}` {what}" + (f": {detail}" if detail else ""))


@dataclass(frozen=True)
class BackgroundProcess:
    """A detached process on a node, identified by its pidfile (``PID STARTTIME``)."""

    node: str
    pid: int
    pidfile: str
    logfile: str


def quote_path(path: str) -> str:
    """Quote a node-side path, keeping a leading ``~/`` meaningful (expanded by the node's shell)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def prefix_words(*, sudo: bool, env: Mapping[str, str] | None) -> list[str]:
    """``sudo -n --`` and ``env K=V ...`` words to put before a command."""
    words: list[str] = ["sudo", "-n", "--"] if sudo else []
    if env:
        bad = [k for k in env if not ENV_NAME.fullmatch(k)]
        if bad:
            raise ValueError(f"invalid environment variable names: {bad}")
        words += ["env", *(f"{k}={v}" for k, v in env.items())]
    return words


def command_line(
    argv: Sequence[str],
    *,
    sudo: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> str:
    """The one shell line that runs ``argv`` (quoted) with optional sudo, environment and cwd."""
    if not argv:
        raise ValueError("empty command")
    line = "exec " + shlex.join([*prefix_words(sudo=sudo, env=env), *argv])
    if cwd:
        line = f"cd {quote_path(cwd)} || exit 125; {line}"
    return line


def _starttime(pid_expr: str) -> str:
    """Shell that prints a process's start time (field 22 of /proc/PID/stat, robust to odd comm)."""
    return f"sed 's/.*) //' /proc/{pid_expr}/stat 2>/dev/null | cut -d' ' -f20"


# The detached child records "PID STARTTIME" in its pidfile before exec'ing the command; the
# start time makes sure we never signal an unrelated process that later got the same pid.
_CHILD = 'echo "$$ $(' + _starttime("$$") + ')" > "$0.tmp" && mv "$0.tmp" "$0" && exec "$@"'

_ALIVE = 'alive() { s=$(sed "s/.*) //" /proc/$pid/stat 2>/dev/null | cut -d" " -f1); [ -n "$s" ] && [ "$s" != Z ]; }'


def _node_path(path: str, what: str) -> str:
    if not (path.startswith("/") or path == "~" or path.startswith("~/")):
        raise ValueError(f"{what} must be an absolute path or start with ~/, got {path!r}")
    return quote_path(path)


def store_script(path: str, size: int) -> str:
    """sh that stores stdin at ``path`` (absolute or ``~/``), atomically and synced, and only if all
    ``size`` bytes arrived: a controller killed mid-transfer leaves no truncated file under ``path``."""
    d = _node_path(path.rsplit("/", 1)[0] or "/", "directory")
    f = _node_path(path, "path")
    t = f"{f}.tmp$$"  # one per storing shell: two stores of the same file at once do not share it
    return (
        f"mkdir -p {d} && cat > {t} && n=$(wc -c < {t}) && "
        f'{{ [ "$n" -eq {size:d} ] || {{ rm -f {t}; echo "incomplete: $n of {size:d} bytes" >&2; exit 1; }}; }} && '
        f"(sync {t} 2>/dev/null || sync) && mv {t} {f} && (sync {d} 2>/dev/null || true)"
    )


def background_start_script(argv: Sequence[str], pidfile: str, logfile: str, cwd: str | None) -> str:
    p, log = _node_path(pidfile, "pidfile"), _node_path(logfile, "logfile")
    cd = f"cd {quote_path(cwd)} || exit 125\n" if cwd else ""
    # mkdir is atomic: it makes two starts on the same pidfile take turns (a lock older than a
    # minute is left over from a start that was killed, and is taken over).
    return f"""set -u
P={p}
mkdir -p "$(dirname "$P")" "$(dirname {log})"
if ! mkdir "$P.lock" 2>/dev/null; then
  if [ -n "$(find "$P.lock" -maxdepth 0 -mmin +1 2>/dev/null)" ]; then rmdir "$P.lock"; fi
  mkdir "$P.lock" 2>/dev/null || {{ echo "another start of $P is in progress" >&2; exit 3; }}
fi
trap 'rmdir "$P.lock" 2>/dev/null' EXIT
if [ -s "$P" ]; then
  read pid start < "$P"
  if [ "$({_starttime("$pid")})" = "$start" ]; then echo "already running as pid $pid ($P)" >&2; exit 3; fi
  rm -f "$P"
fi
{cd}setsid sh -c {shlex.quote(_CHILD)} "$P" {shlex.join(argv)} > {log} 2>&1 < /dev/null &
i=0
while [ ! -s "$P" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
[ -s "$P" ] || {{ echo "the process did not start" >&2; exit 4; }}
cat "$P"
"""


def background_running_script(pidfile: str) -> str:
    """sh that succeeds while the process ``pidfile`` names is running (the same pid and start time)."""
    return f"""P={_node_path(pidfile, "pidfile")}
[ -s "$P" ] || exit 1
read pid start < "$P"
{_ALIVE}
alive && [ "$({_starttime("$pid")})" = "$start" ]"""


def background_stop_script(pidfile: str, grace_s: float) -> str:
    steps = max(1, int(grace_s / 0.1))
    return f"""P={_node_path(pidfile, "pidfile")}
[ -s "$P" ] || {{ echo absent; exit 0; }}
read pid start < "$P"
{_ALIVE}
if [ "$({_starttime("$pid")})" != "$start" ]; then rm -f "$P"; echo stale; exit 0; fi
kill -TERM "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
i=0
while alive && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done
if alive; then state=killed; else state=stopped; fi
# what is left of its process group, unless the pid (and so the group id) is another process's now:
# a group id is free again once its leader and members are gone, and a recycled one may be a new
# session's (an SSH command's, a detached handler's)
now=$({_starttime("$pid")})
if [ -z "$now" ] || [ "$now" = "$start" ]; then kill -KILL "-$pid" 2>/dev/null; fi
i=0
while alive && [ $i -lt 20 ]; do sleep 0.1; i=$((i+1)); done
if alive; then
  echo "pid $pid is still running (not ours to signal? it may have been started with sudo)" >&2
  exit 5
fi
rm -f "$P"
echo $state
"""


def background_alive_test(pidfile: str) -> str:
    """A shell test that succeeds while the process a pidfile names is still that process."""
    p = _node_path(pidfile, "pidfile")
    return (f'{{ [ -s {p} ] && read pid start < {p} && [ -n "$pid" ] && '
            f'[ "$({_starttime("$pid")})" = "$start" ]; }}')  # fmt: skip


def background_signal_script(pidfile: str, signal_name: str) -> str:
    """sh that sends ``signal_name`` (e.g. HUP) to the process a pidfile names, if it is still that
    process; prints ``signalled``, ``stale`` or ``absent``."""
    if not signal_name.isalnum():
        raise ValueError(f"not a signal name: {signal_name!r}")
    return f"""P={_node_path(pidfile, "pidfile")}
[ -s "$P" ] || {{ echo absent; exit 0; }}
read pid start < "$P"
if [ "$({_starttime("$pid")})" != "$start" ]; then echo stale; exit 0; fi
kill -{signal_name} "$pid" && echo signalled
"""


def copy_from(source: BinaryIO, sink: Any, offset: int, progress: Callable[[int], None] | None) -> None:
    """Copy ``source`` from byte ``offset`` on to the same place in ``sink``, 1 MiB at a time,
    telling ``progress`` the bytes written so far after each chunk."""
    source.seek(offset)
    sink.seek(offset)
    written = offset
    while chunk := source.read(1 << 20):
        sink.write(chunk)
        written += len(chunk)
        if progress is not None:
            progress(written)


class LineSession(ABC):
    """A long-running command spoken to line by line (used for clock-offset exchanges).

    Closing it sends EOF to the command's stdin and, if the command has not ended within
    ``LINE_SESSION_EXIT_S``, ends its process group.
    """

    def __init__(self) -> None:
        self._buffer = b""

    @abstractmethod
    def send_line(self, text: str) -> None:
        """Send one line; TimeoutError if the command has not taken it within ``LINE_SEND_S``."""

    @abstractmethod
    def _receive(self, timeout_s: float) -> bytes | None:
        """What arrived within ``timeout_s``: None if nothing yet, ``b""`` once the command ended."""

    @abstractmethod
    def close(self) -> None: ...

    def read_line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no reply line in time")
            chunk = self._receive(remaining)
            if chunk == b"":
                raise EOFError("the command ended")
            self._buffer += chunk or b""
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def __enter__(self) -> LineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport(ABC):
    """Runs commands on one node. ``sudo=True`` on a call means the command needs privileges;
    the transport adds ``sudo -n`` only when the node is set up to use it."""

    def __init__(self, node: str, *, use_sudo: bool) -> None:
        self.node = node
        self.use_sudo = use_sudo

    # -- what each transport implements

    @abstractmethod
    def _execute(self, line: str, *, timeout_s: float, stdin: bytes | None, privileged: bool) -> CommandResult:
        """Run one shell line; on timeout kill its process group and report ``timed_out``."""

    @abstractmethod
    def put(
        self,
        local: str | Path,
        remote: str,
        *,
        mode: int | None = None,
        offset: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Copy ``local`` to ``remote``. With ``offset`` > 0 the node's file keeps its first ``offset``
        bytes and the rest is written after them (resuming a transfer); ``progress`` is called with
        the bytes written so far after every chunk (it may raise to abort the transfer)."""

    @abstractmethod
    def get(self, remote: str, local: str | Path) -> None: ...

    @abstractmethod
    def _open_line_session(self, argv: Sequence[str]) -> LineSession: ...

    def close(self) -> None:  # noqa: B027 - optional for transports without a connection
        """Release the connection, if any."""

    # -- built on top

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float = 60.0,
        sudo: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> CommandResult:
        """Run ``argv`` and return its result (a non-zero exit is a result, not an exception)."""
        privileged = sudo and self.use_sudo
        line = command_line(argv, sudo=privileged, env=env, cwd=cwd)
        command_log.record(self.node, line)
        return self._execute(line, timeout_s=timeout_s, stdin=stdin, privileged=privileged)

    def open_line_session(self, argv: Sequence[str]) -> LineSession:
        """Start ``argv`` with its stdin and stdout kept open for an exchange of lines."""
        command_log.record(self.node, command_line(argv))
        return self._open_line_session(argv)

    def run_script(self, script: str, *, timeout_s: float = 60.0, sudo: bool = False) -> CommandResult:
        """Run a POSIX sh script (passed as one quoted argument)."""
        return self.run(["sh", "-c", script], timeout_s=timeout_s, sudo=sudo)

    def store(self, path: str, data: bytes, *, timeout_s: float = 60.0) -> None:
        """Write ``data`` to ``path`` (absolute or ``~/``) on the node, atomically and synced."""
        self.run(["sh", "-c", store_script(path, len(data))], stdin=data, timeout_s=timeout_s).check()

    def expand_path(self, path: str) -> str:
        """``path`` with a leading ``~`` expanded by the node (argv words are not expanded)."""
        if not path.startswith("~"):
            return path
        return self.run_script("echo " + quote_path(path), timeout_s=30.0).check().stdout.strip()

    def start_background(
        self,
        argv: Sequence[str],
        *,
        pidfile: str,
        logfile: str,
        sudo: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> BackgroundProcess:
        """Start ``argv`` detached in its own session; refuse if the pidfile names a live process."""
        words = prefix_words(sudo=sudo and self.use_sudo, env=env)
        script = background_start_script([*words, *argv], pidfile, logfile, cwd)
        result = self.run_script(script, timeout_s=30.0).check()
        pid = int(result.stdout.split()[0])
        return BackgroundProcess(self.node, pid, pidfile, logfile)

    def stop_background(self, pidfile: str, *, grace_s: float = 5.0, sudo: bool = False) -> str:
        """Stop the process group named by ``pidfile``: TERM, then KILL after ``grace_s``.

        Returns ``stopped``, ``killed`` (needed KILL), ``stale`` (pidfile named a dead or reused
        pid, nothing signalled) or ``absent`` (no pidfile). Raises :class:`CommandFailed`, keeping
        the pidfile, if the process survives (e.g. started with sudo, stopped without).
        """
        script = background_stop_script(pidfile, grace_s)
        result = self.run_script(script, timeout_s=grace_s + 30.0, sudo=sudo).check()
        return result.stdout.strip().splitlines()[-1]

    def signal_background(self, pidfile: str, signal_name: str, *, sudo: bool = False) -> str:
        """Send a signal to the process named by ``pidfile`` (``signalled``, ``stale`` or ``absent``)."""
        result = self.run_script(background_signal_script(pidfile, signal_name), timeout_s=30.0, sudo=sudo).check()
        return result.stdout.strip().splitlines()[-1]

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
