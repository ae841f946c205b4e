"""The OpenAI-compatible endpoint's limits, tried as a careless or hostile client would: a body over the
cap, a bad ``Content-Length``, half a request, a client that stops reading its stream, more requests
than the endpoint takes at once, fields of the wrong type, and a key on every route. Real endpoints
(the tiny checkpoint behind the real HTTP server), the official ``openai`` client and raw sockets.
Every wait is bounded and fails only on a hang."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from nodes.endpoints.generator import PacedGenerator
from nodes.endpoints.openai_api import Endpoint, EndpointLimits, make_server
from nodes.endpoints.pace import Pace
from tests.conftest import json_log_rows
from tests.waiting import HANG_S, wait_until

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "models" / "tiny")


class PromptPace(Pace):
    """Requests whose prompt has more than ``hold_tokens`` tokens wait ``hold_s`` for their first token
    (they hold a slot); others are answered at once, a token every ``gap_s``."""

    label = "prompt-pace"

    def __init__(self, hold_tokens: int = 1000, hold_s: float = 600.0, gap_s: float = 0.0) -> None:
        self.hold_tokens, self.hold_s, self.gap = hold_tokens, hold_s, gap_s

    def first_token_s(self, prompt_tokens: int) -> float:
        return self.hold_s if prompt_tokens > self.hold_tokens else 0.0

    def gap_s(self) -> float:
        return self.gap


@pytest.fixture(scope="module")
def generator() -> PacedGenerator:
    return PacedGenerator(TINY)


@pytest.fixture
def serve(generator: PacedGenerator, tmp_path: Path) -> Iterator[Callable[..., tuple[Endpoint, int]]]:
    """Start endpoints (in this process, on loopback); all are stopped at the end."""
    started = []

    def start(pace: Pace | None = None, key: str | None = None, **limits: float) -> tuple[Endpoint, int]:
        log = tmp_path / f"api-{len(started)}.jsonl"
        endpoint = Endpoint(generator, pace or PromptPace(), "tiny", str(log), api_key=key,
                            limits=EndpointLimits(**limits))  # fmt: skip
        server, port = make_server(endpoint, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append((server, endpoint))
        return endpoint, port

    yield start
    for server, endpoint in started:
        server.shutdown()
        server.server_close()
        endpoint.close(wait_s=HANG_S)


def logged(endpoint: Endpoint) -> list[dict]:
    return json_log_rows(Path(endpoint.log_path))


def post(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` on a new connection; the response's status, headers and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        sock.sendall(request)
        return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the connection closed before a response: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "the connection closed inside the body"
        body += more
    return int(lines[0].split()[1]), headers, body


def error_of(body: bytes) -> dict:
    """The OpenAI-style error object of a refusal."""
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the endpoint closed ``sock`` (reading what it may have sent first); fails on a hang."""
    sock.settimeout(HANG_S)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def completion(port: int) -> tuple[int, dict]:
    """A small, well-formed completion: the endpoint still serves."""
    status, _, body = exchange(port, post("/v1/completions", b'{"prompt": "def f(x):", "max_tokens": 2}'))
    return status, json.loads(body)


# -- body size ------------------------------------------------------------------------------------


def test_a_body_over_the_cap_is_refused_with_413_and_the_endpoint_serves_on(serve) -> None:
    endpoint, port = serve()
    cap = endpoint.limits.max_body_bytes
    # announced larger than the cap: refused before a byte of it is read, the connection closed
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {cap + 1}\r\n\r\n".encode())
        status, headers, body = read_response(sock)
        assert status == 413 and headers.get("connection") == "close"
        assert "bytes" in error_of(body)["message"]
        assert closed_by_peer(sock)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="word " * (cap // 5 + 1), max_tokens=2)
    assert refused.value.status_code == 413
    assert completion(port)[0] == 200


# -- Content-Length -------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [None, "-5", "abc", "1e3", "+5", "٣", "9" * 40, "12, 12"])
def test_a_missing_or_bad_content_length_is_400_and_the_endpoint_serves_on(serve, length) -> None:
    _, port = serve()
    body = b'{"prompt": "x", "max_tokens": 1}'
    header = "" if length is None else f"Content-Length: {length}\r\n"
    request = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode() + body
    status, headers, answer = exchange(port, request)
    assert status == 400 and "Content-Length" in error_of(answer)["message"]
    assert headers.get("connection") == "close"  # what follows cannot be told from the next request
    assert completion(port)[0] == 200


def test_two_different_content_lengths_are_refused(serve) -> None:
    _, port = serve()
    body = b'{"prompt": "x", "max_tokens": 1}'
    request = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nContent-Length: 2\r\n\r\n"
    status, _, answer = exchange(port, request.encode() + body)
    assert status == 400 and "Content-Length" in error_of(answer)["message"]


# -- timeouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", ["headers", "body"])
def test_a_client_that_sends_half_a_request_is_dropped(serve, half) -> None:
    _, port = serve(timeout_s=1.0)
    body = b'{"prompt": "def f(x):", "max_tokens": 2}'
    whole = post("/v1/completions", body)
    part = whole[: whole.index(b"Content-Length")] if half == "headers" else whole[: len(whole) - len(body) // 2]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(part)
        assert closed_by_peer(sock)  # within the endpoint's timeout, not never
    assert completion(port)[0] == 200


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_generation_cancelled(serve) -> None:
    endpoint, port = serve(timeout_s=1.0, send_buffer_bytes=4096)
    max_tokens = 2000  # far more than the socket buffers hold
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "def f(x):", "max_tokens": max_tokens, "stream": True}).encode()
        sock.sendall(post("/v1/completions", body))
        # never read a byte; the request counts as served just before its log line is written
        wait_until(lambda: endpoint.served == 1 and len(logged(endpoint)) == 1, "the stalled request to end")
    (row,) = logged(endpoint)
    assert row["cancelled"] and row["finish_reason"] is None and 0 < row["completion_tokens"] < max_tokens
    assert endpoint.in_flight == 0 and completion(port)[0] == 200


# -- concurrency ----------------------------------------------------------------------------------


def test_more_requests_in_flight_than_the_cap_are_refused_with_429(serve, generator) -> None:
    endpoint, port = serve(PromptPace(hold_tokens=20), max_in_flight=2)
    held = json.dumps({"prompt": "word " * 40, "max_tokens": 4, "stream": True}).encode()
    holders = [socket.create_connection(("127.0.0.1", port), timeout=HANG_S) for _ in range(2)]
    try:
        for sock in holders:
            sock.sendall(post("/v1/completions", held))
        wait_until(lambda: endpoint.in_flight == 2, "two requests in flight")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="def f(x):", max_tokens=2)
        assert "in flight" in refused.value.message
    finally:
        for sock in holders:
            sock.close()
    wait_until(lambda: endpoint.in_flight == 0, "the held requests to be cancelled")
    assert completion(port)[0] == 200  # a slot is free again
    assert sum(row["cancelled"] for row in logged(endpoint)) == 2


def test_more_connections_than_the_cap_are_refused_with_429(serve) -> None:
    endpoint, port = serve(max_connections=3)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=HANG_S) for _ in range(3)]
    try:
        wait_until(lambda: endpoint.connections == 3, "three open connections")
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as extra:
            extra.sendall(post("/v1/completions", b'{"prompt": "x", "max_tokens": 1}'))
            status, _, body = read_response(extra)
            assert status == 429 and "connections" in error_of(body)["message"]
            assert closed_by_peer(extra)
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: endpoint.connections == 0, "the idle connections to close")
    assert completion(port)[0] == 200


# -- strict types ---------------------------------------------------------------------------------

BAD_FIELDS = [
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 2.5}, "max_tokens"),
    ("completions", {"max_tokens": "4"}, "max_tokens"),
    ("completions", {"max_tokens": 10**12}, "max_tokens"),
    ("chat", {"max_completion_tokens": False}, "max_completion_tokens"),
    ("completions", {"n": True}, "n"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"stream": 1}, "stream"),
    ("completions", {"stream": True, "stream_options": "yes"}, "stream_options"),
    ("completions", {"stream": True, "stream_options": [True]}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("completions", {"seed": True}, "seed"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"seed": 2**70}, "seed"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"temperature": 9}, "temperature"),
    ("completions", {"top_p": 2}, "top_p"),
    ("completions", {"model": 5}, "model"),
    ("completions", {"return_token_ids": "yes"}, "return_token_ids"),
    ("completions", {"prompt": True}, "prompt"),
    ("completions", {"prompt": [True, 5]}, "prompt"),
    ("completions", {"prompt": [1.5]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [4096]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": {"text": "x"}}, "prompt"),
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages"),
    ("chat", {"messages": [{"role": 1, "content": "hi"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
]


@pytest.mark.parametrize(("route", "fields", "param"), BAD_FIELDS, ids=[f"{p}={f[p]!r}"[:40] for _r, f, p in BAD_FIELDS])
def test_a_field_of_the_wrong_type_or_out_of_range_is_400_naming_it(serve, route, fields, param) -> None:
    _, port = serve()
    base = {"prompt": "def f(x):"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body = json.dumps({"model": "tiny", "max_tokens": 2, **base, **fields}).encode()
    status, _, answer = exchange(port, post(f"/v1/{'completions' if route == 'completions' else 'chat/completions'}",
                                            body))  # fmt: skip
    assert status == 400, answer
    assert error_of(answer)["param"] == param


def test_the_openai_client_hears_of_a_bad_field_as_a_bad_request(serve) -> None:
    _, port = serve()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    for extra in ({"max_tokens": True}, {"stream": True, "stream_options": "yes"}, {"n": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="def f(x):", **extra)
    nan = b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}'  # not JSON, though Python's parser takes it
    status, _, answer = exchange(port, post("/v1/completions", nan))
    assert status == 400 and "not JSON" in error_of(answer)["message"]
    deep = "[" * 100_000 + "]" * 100_000  # nested past any parser's recursion: refused, not a crash
    status, _, answer = exchange(port, post("/v1/completions", deep.encode()))
    assert status == 400 and error_of(answer)
    text = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, {"role": "user", "content": "hi"}])
    assert text.usage.completion_tokens == 2  # content given as text parts is served


# -- keys -----------------------------------------------------------------------------------------


def test_with_a_key_every_route_needs_it_and_odd_headers_are_refused(serve) -> None:
    key = "k-" + "s3cret" * 4
    _, port = serve(key=key)
    url = f"http://127.0.0.1:{port}/v1"
    for path in ("/v1/models", "/health", "/v1/health", "/nowhere"):
        for header in ("", "Authorization: Bearer wrong\r\n", f"Authorization: Bearer {key[:-1]}\r\n",
                       f"Authorization: Bearer {key}x\r\n", f"Authorization: {key}\r\n"):  # fmt: skip
            request = f"GET {path} HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode()
            status, _, body = exchange(port, request)
            assert status == 401 and "API key" in json.loads(body)["error"]["message"], (path, header)
    odd = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\xff\x00k\r\n\r\n"
    assert exchange(port, odd)[0] in (400, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=1)  # fmt: skip
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
    status, _, body = exchange(port, f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    assert status == 200 and json.loads(body)["status"] == "ok"
