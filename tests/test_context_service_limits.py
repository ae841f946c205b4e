"""The LLM service daemon tried as a careless or hostile app would: a client that stops reading its
tokens, half a request, fields of the wrong type, a ``new`` whose system prompt fails, a socket
directory others can enter, and a socket path too long for a Unix socket. A real daemon process, raw
Unix sockets and the client library. Every wait is bounded and fails only on a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.context_service.client import ContextClient, ServiceRefused
from nodes.contracts.service_files import service_files, socket_problem

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
HANG_S = 90.0  # a wait this long means the daemon hangs
CLIENT_TIMEOUT_S = 2.0


class Daemon:
    """A daemon process on a socket in its own directory; its stderr kept for the traceback check."""

    def __init__(self, tmp_path: Path, *extra: str, socket_dir: Path | None = None, umask: int | None = None) -> None:
        self.directory = socket_dir or tmp_path / "service"
        self.socket = str(self.directory / "llm.sock")
        self.stderr = tmp_path / "daemon.stderr"
        argv = [sys.executable, "-m", "nodes.context_service", "--model", str(TINY), "--socket", self.socket,
                "--state-dir", str(tmp_path / "state"), "--budget-mib", "4", "--contexts-per-app", "2",
                "--context-tokens", "3000", "--client-timeout-s", str(CLIENT_TIMEOUT_S), *extra]  # fmt: skip
        with open(self.stderr, "w") as errors:
            self.process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True,
                                            preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)  # fmt: skip
        assert self.process.stdout is not None
        self.ready = json.loads(self.process.stdout.readline() or "{}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
                raise AssertionError(f"the daemon did not end within {HANG_S:.0f} s of SIGTERM") from None
        return self.process.returncode

    def errors(self) -> str:
        return self.stderr.read_text()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    started = Daemon(tmp_path)
    assert started.ready.get("serving") == started.socket, started.errors()
    yield started
    started.stop()
    assert "Traceback" not in started.errors(), started.errors()


def raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANG_S)
    sock.connect(path)
    return sock


def answer(path: str, request: dict | bytes) -> dict:
    """The first reply line to one request sent on a raw socket."""
    with raw(path) as sock:
        sock.sendall(request if isinstance(request, bytes) else json.dumps(request).encode() + b"\n")
        with sock.makefile("rb") as reader:
            line = reader.readline()
    assert line, "the daemon closed the connection without a reply"
    return json.loads(line)


def bounded(call, what: str):
    """``call()`` on a thread; its result, or a failure if it takes longer than HANG_S (a hang)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # (handed to the test)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{what}: no answer within {HANG_S:.0f} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def eof_within(sock: socket.socket) -> bytes:
    """Everything the daemon sends until it closes ``sock``; fails on a hang."""
    data = b""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            more = sock.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not more:
            return data
        data += more
    raise AssertionError(f"the daemon kept the connection open for {HANG_S:.0f} s")


def stalled_call(path: str, ctx: str) -> socket.socket:
    """A call that asks for many tokens from a client that never reads them (its socket is returned)."""
    sock = raw(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.sendall(json.dumps({"op": "call", "ctx": ctx, "prompt": "Once upon a time", "max_tokens": 2900}).encode()
                 + b"\n")  # fmt: skip
    return sock


# -- a client that stops reading --------------------------------------------------------------------


def test_a_client_that_stops_reading_holds_up_no_other_app(daemon: Daemon) -> None:
    client = ContextClient(daemon.socket, timeout_s=HANG_S)
    stalled_ctx = client.new_context("stalled")
    before = {c["ctx"]: c["tokens"] for c in client.contexts()}
    sock = stalled_call(daemon.socket, stalled_ctx)
    try:
        time.sleep(0.5)  # (its call has begun)
        other = bounded(lambda: client.new_context("other"), "another app's newLLMCtx")
        record = bounded(lambda: client.call(other, "Hello", 3), "another app's callLLM")
        assert len(record["output_ids"]) == 3
        sent = eof_within(sock)  # dropped by the daemon, without the call's record
        assert b'"done"' not in sent
    finally:
        sock.close()
    after = {c["ctx"]: c["tokens"] for c in client.contexts()}
    assert after[stalled_ctx] == before[stalled_ctx]  # its call was rolled back


def test_a_client_that_stops_reading_does_not_hold_up_shutdown(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path)
    try:
        ctx = ContextClient(daemon.socket, timeout_s=HANG_S).new_context("stalled")
        sock = stalled_call(daemon.socket, ctx)
        time.sleep(1.0)
        assert daemon.stop() == 0  # within HANG_S of SIGTERM, whatever the client does
        sock.close()
    finally:
        daemon.process.kill()
    assert not os.path.exists(daemon.socket)


# -- half a request ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b'{"op": "li'], ids=["nothing", "half a line"])
def test_a_client_that_sends_half_a_request_is_dropped(daemon: Daemon, sent: bytes) -> None:
    with raw(daemon.socket) as sock:
        sock.sendall(sent)
        eof_within(sock)
    assert bounded(lambda: ContextClient(daemon.socket).contexts(), "list") == []


# -- fields of the wrong type ------------------------------------------------------------------------

BAD_REQUESTS = [
    ({"op": ["new"]}, "op"),
    ({"op": 5}, "op"),
    ({"op": "new", "app": 5}, "app"),
    ({"op": "new", "app": "a", "system_prompt": 5}, "system_prompt"),
    ({"op": "new", "app": "a", "system_prompt": ["x"]}, "system_prompt"),
    ({"op": "call", "ctx": 5, "prompt": "x"}, "ctx"),
    ({"op": "call", "ctx": "CTX", "prompt": 5}, "prompt"),
    ({"op": "call", "ctx": "CTX", "prompt": {"text": "x"}}, "prompt"),
    ({"op": "call", "ctx": "CTX", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"op": "call", "ctx": "CTX", "prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"op": "call", "ctx": "CTX", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"op": "call", "ctx": "CTX", "prompt": "x", "teacher_forced": 5}, "teacher_forced"),
    ({"op": "call", "ctx": "CTX", "prompt_ids": "abc", "teacher_forced_ids": []}, "prompt_ids"),
    ({"op": "call", "ctx": "CTX", "prompt_ids": [1, True], "teacher_forced_ids": []}, "prompt_ids"),
    ({"op": "call", "ctx": "CTX", "prompt_ids": [1], "teacher_forced_ids": [2.0]}, "teacher_forced_ids"),
    ({"op": "call", "ctx": "CTX", "prompt": "a\ud800b"}, "prompt"),
    ({"op": "delete", "ctx": ["CTX"]}, "ctx"),
    ({"op": "delete"}, "ctx"),
]


def test_a_field_of_the_wrong_type_is_a_bad_request_never_an_internal_error(daemon: Daemon) -> None:
    client = ContextClient(daemon.socket)
    ctx = client.new_context("kept")
    client.call(ctx, "A list of things:", 3)
    before = client.contexts()
    for request, field in BAD_REQUESTS:
        request = {k: (ctx if v == "CTX" else v) for k, v in request.items()}
        reply = bounded(lambda request=request: answer(daemon.socket, request), repr(request))
        assert reply["ok"] is False and reply["code"] == "bad_request" and reply["field"] == field, (request, reply)
    for line in (b"[1, 2]\n", b"\xff\xfe\n", b'{"op": "list", "x": NaN}\n', b"[" * 100_000 + b"\n"):
        reply = bounded(lambda line=line: answer(daemon.socket, line), repr(line[:20]))
        assert reply["code"] == "bad_request", reply
    assert client.contexts() == before  # nothing changed, nothing was left behind


# -- a failed new ------------------------------------------------------------------------------------


def test_a_new_context_whose_system_prompt_fails_is_rolled_back(daemon: Daemon) -> None:
    client = ContextClient(daemon.socket)
    with pytest.raises(ServiceRefused, match="over the limit") as refused:
        client.new_context("mail", "word " * 4000)  # the system prompt alone exceeds the context limit
    assert refused.value.code == "limit"
    assert client.contexts() == []  # no context left behind
    kept = [client.new_context("mail", "You answer mail.") for _ in range(2)]  # its app may still make K = 2
    assert sorted(c["ctx"] for c in client.contexts()) == sorted(kept)
    assert not [p for p in (Path(daemon.socket).parent.parent / "state" / "contexts").iterdir()
                if not any(k in p.name for k in kept)]  # fmt: skip


# -- the socket's directory --------------------------------------------------------------------------


def test_the_socket_directory_is_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, umask=0)
    try:
        assert daemon.ready.get("serving") == daemon.socket, daemon.errors()
        assert stat.S_IMODE(os.lstat(daemon.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(daemon.socket).st_mode) & 0o077 == 0
        assert ContextClient(daemon.socket).contexts() == []
    finally:
        daemon.stop()


@pytest.mark.parametrize("wrong", ["mode", "owner", "symlink"])
def test_a_socket_directory_others_can_enter_is_refused(tmp_path: Path, wrong: str) -> None:
    directory = tmp_path / "service"
    if wrong == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        directory.symlink_to(tmp_path / "elsewhere")
    else:
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o755 if wrong == "mode" else 0o700)
        if wrong == "owner":
            if os.geteuid() != 0:
                pytest.skip("giving a directory to another user needs root")
            os.chown(directory, 65534, 65534)
    daemon = Daemon(tmp_path, socket_dir=directory)
    try:
        assert daemon.process.wait(timeout=HANG_S) == 2
    finally:
        daemon.process.kill()
    assert not daemon.ready and "0700" in daemon.errors() and "Traceback" not in daemon.errors()
    assert not os.path.exists(directory / "llm.sock")


def test_a_socket_path_too_long_for_sun_path_stays_in_its_directory_not_in_tmp(tmp_path: Path) -> None:
    deep = "/home/lab/" + "a-rather-long-directory-name/" * 4 + "runs/run-0123456789abcdef-a1"
    assert service_files(deep).socket.startswith(deep + "/")  # no shared /tmp name
    directory = tmp_path / ("d" * 120)
    daemon = Daemon(tmp_path, socket_dir=directory)
    try:
        assert daemon.ready.get("serving") == daemon.socket and len(daemon.socket) > 107, daemon.errors()
        assert not socket_problem(daemon.socket)  # reached through its directory (Linux: /proc/self/fd)
        assert stat.S_ISSOCK(os.lstat(daemon.socket).st_mode) and stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
        client = ContextClient(daemon.socket)
        assert client.call(client.new_context("deep"), "Hello", 2)["output_ids"]
    finally:
        daemon.stop()
    assert not os.path.exists(daemon.socket)
