"""Commands on the controller itself, through the same interface as SSH."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from testbed.transport.base import KILL_GRACE_S, LINE_SESSION_EXIT_S, CommandResult, LineSession, Transport


def _expand(path: str) -> str:
    return os.path.expanduser(path)


class LocalTransport(Transport):
    """Runs commands with ``sh -c`` in a new session, so a timeout kills the whole group."""

    def __init__(self, node: str = "controller", *, use_sudo: bool = False) -> None:
        super().__init__(node, use_sudo=use_sudo)

    def _execute(self, line: str, *, timeout_s: float, stdin: bytes | None, privileged: bool) -> CommandResult:
        start = time.monotonic()
        proc = subprocess.Popen(
            ["sh", "-c", line],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill_group(proc, privileged)
            out, err = proc.communicate()
        return CommandResult(
            node=self.node,
            command=line.removeprefix("exec "),
            exit_code=None if timed_out else proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            duration_s=time.monotonic() - start,
            timed_out=timed_out,
        )

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes], privileged: bool) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            except PermissionError:
                if privileged:
                    subprocess.run(["sudo", "-n", "kill", f"-{sig.name[3:]}", "--", f"-{proc.pid}"], check=False)
            try:
                proc.wait(KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    def put(self, local: str | Path, remote: str, *, mode: int | None = None) -> None:
        target = _expand(remote)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)
        if mode is not None:
            os.chmod(target, mode)

    def get(self, remote: str, local: str | Path) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_expand(remote), local)

    def open_line_session(self, argv: Sequence[str]) -> LineSession:
        return _LocalLineSession(argv)


class _LocalLineSession(LineSession):
    def __init__(self, argv: Sequence[str]) -> None:
        super().__init__()
        self._proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            bufsize=0,
        )

    def send_line(self, text: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(text.encode() + b"\n")

    def _receive(self, timeout_s: float) -> bytes | None:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return os.read(self._proc.stdout.fileno(), 65536) if ready else None

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(LINE_SESSION_EXIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
