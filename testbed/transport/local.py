"""Commands on the controller itself, through the same interface as SSH."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from foundation.errors import NodeError
from testbed.transport.base import (
    DRAIN_AFTER_EXIT_S,
    KILL_GRACE_S,
    LINE_SEND_S,
    LINE_SESSION_EXIT_S,
    CommandResult,
    LineSession,
    Transport,
    copy_from,
)


def _expand(path: str) -> str:
    return os.path.expanduser(path)


class LocalTransport(Transport):
    """Runs commands with ``sh -c`` in a new session, so a timeout kills the whole group."""

    def __init__(self, node: str = "controller", *, use_sudo: bool = False) -> None:
        super().__init__(node, use_sudo=use_sudo)

    def _execute(self, line: str, *, timeout_s: float, stdin: bytes | None, privileged: bool) -> CommandResult:
        """As over SSH: output is read until the command exits (then a short drain, so a leftover
        child holding stdout cannot hang us), stdin is fed without blocking, and a timeout ends
        the whole process group."""
        start = time.monotonic()
        proc = subprocess.Popen(
            ["sh", "-c", line],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        output = {out_fd: bytearray(), err_fd: bytearray()}
        pending = memoryview(stdin or b"")
        selector = selectors.DefaultSelector()
        for fd in output:
            selector.register(fd, selectors.EVENT_READ)
        if pending and proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        deadline = start + timeout_s
        exited_at: float | None = None
        timed_out = False
        with selector:
            while True:
                now = time.monotonic()
                if proc.poll() is not None:
                    exited_at = exited_at or now
                    still_open = any(fd in output for fd in selector.get_map())
                    if not still_open or now - exited_at > DRAIN_AFTER_EXIT_S:
                        break
                elif now >= deadline:
                    timed_out = True
                    break
                for key, _ in selector.select(max(0.0, min(deadline - now, 0.2))):
                    if key.fd in output:
                        chunk = os.read(key.fd, 65536)
                        output[key.fd] += chunk
                        if not chunk:
                            selector.unregister(key.fd)
                        continue
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BrokenPipeError:  # the command ended without reading all of it
                        pending = memoryview(b"")
                    if not pending:
                        selector.unregister(key.fd)
                        assert proc.stdin is not None
                        proc.stdin.close()
        if timed_out:
            self._kill_group(proc, privileged)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        try:
            proc.wait(KILL_GRACE_S)  # it has exited or been killed: at once, unless it cannot be killed
        except subprocess.TimeoutExpired:
            output[err_fd] += f"\n[process group {proc.pid} still there after SIGKILL: left as it is]".encode()
        return CommandResult(
            node=self.node,
            command=line.removeprefix("exec "),
            exit_code=None if timed_out else proc.returncode,
            stdout=output[out_fd].decode(errors="replace"),
            stderr=output[err_fd].decode(errors="replace"),
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
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        subprocess.run(["sudo", "-n", "kill", f"-{sig.name[3:]}", "--", f"-{proc.pid}"], check=False,
                                       timeout=KILL_GRACE_S)  # fmt: skip
            try:
                proc.wait(KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    def put(
        self,
        local: str | Path,
        remote: str,
        *,
        mode: int | None = None,
        offset: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        target = _expand(remote)
        try:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | (0 if offset else os.O_TRUNC), 0o600)
            with open(local, "rb") as source, os.fdopen(fd, "wb") as sink:
                if mode is not None:
                    os.fchmod(sink.fileno(), mode)  # before the content, as over SSH
                copy_from(source, sink, offset, progress)
        except OSError as exc:
            raise NodeError(self.node, f"cannot copy {local} to {remote}: {exc}") from None

    def get(self, remote: str, local: str | Path) -> None:
        try:
            Path(local).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(_expand(remote), local)
        except OSError as exc:
            raise NodeError(self.node, f"cannot copy {remote} from the node: {exc}") from None

    def _open_line_session(self, argv: Sequence[str]) -> LineSession:
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
        assert self._proc.stdin is not None
        os.set_blocking(self._proc.stdin.fileno(), False)  # a command that stops reading cannot block us

    def send_line(self, text: str) -> None:
        assert self._proc.stdin is not None
        fd, pending = self._proc.stdin.fileno(), memoryview(text.encode() + b"\n")
        deadline = time.monotonic() + LINE_SEND_S
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the command took no input for {LINE_SEND_S:g} s")
            if select.select([], [fd], [], remaining)[1]:
                with contextlib.suppress(BlockingIOError):
                    pending = pending[os.write(fd, pending) :]

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
