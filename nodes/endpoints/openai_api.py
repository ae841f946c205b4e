"""An OpenAI-compatible HTTP API in front of a paced generator: what the device and trace endpoints
serve, so that DiSCo's dispatcher, the official ``openai`` client, ``curl`` or any other client talks
to them as it would to vLLM or llama.cpp's server.

Routes: ``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` (``prompt``: a string, or a list
of token ids) and ``POST /v1/chat/completions`` (``messages``), each with ``stream: true`` (server-sent
events, ``data: [DONE]`` at the end, a usage chunk when ``stream_options.include_usage``) or without.
Decoding is greedy whatever ``temperature`` says (the testbed compares outputs token for token);
``n`` > 1 and ``logprobs`` are refused. Each choice carries ``token_ids`` beside its text (vLLM's
extension), so that a client can hand a stream over to another endpoint by token ids.

A client that closes its connection cancels its request: generation stops at the next token and the
request is logged as cancelled with the tokens it produced (billing counts them). Every request is
one line of ``endpoint_requests.jsonl``, written when it ends: its times on this node's monotonic clock
and whether they were modeled.

Limits (``EndpointLimits``): a body over ``max_body_bytes`` is refused with 413, a missing or bad
``Content-Length`` with 400; a connection that sends nothing or reads nothing for ``timeout_s`` is
dropped (a stream it was reading is cancelled); more than ``max_in_flight`` completions at once, or
more than ``max_connections`` open connections, are refused with 429. Fields are checked strictly
(``request_checks.py``). With a key, every route asks for it (``Authorization: Bearer KEY``),
compared in constant time.
"""

import contextlib
import hmac
import json
import os
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from nodes.contracts.paced_steps import ENDPOINT_OPS, STEP_COLUMNS, step_row
from nodes.contracts.records import CsvLog, JsonLinesLog

from .generator import Emitted, PacedGenerator, max_tokens_for
from .pace import Pace
from .request_checks import ApiError, CompletionRequest, completion_request

CONTENT_LENGTH_DIGITS = 18  # more digits than any body this endpoint takes: a bad length, not a big body
DISCARD_MAX_BYTES = 16 << 20  # a refused body up to this size is read and dropped, so its client hears why
LINGER_S = 5.0  # at most this long reading what a refused client still sends before the connection closes
REFUSAL_TIMEOUT_S = 2.0  # a connection over the cap: how long it may take to send its request line


class EndpointLimits(NamedTuple):
    """What one endpoint takes; the defaults fit a campaign's dispatchers (64 requests at once each)."""

    max_body_bytes: int = 1 << 20  # a request's JSON body
    timeout_s: float = 60.0  # a connection sending nothing (mid-request or idle) or reading nothing is dropped
    max_in_flight: int = 128  # completions generating at once; more are refused with 429
    max_connections: int = 512  # connections open at once; more are refused with 429
    send_buffer_bytes: int = 16 << 10  # the socket's send buffer: a stream that is not read stalls soon


class Endpoint(object):
    """What the HTTP handlers share: the generator, its pace, the model's name, the log, the key and
    the counts the limits are checked against."""

    def __init__(self, generator: PacedGenerator, pace: Pace, model_name: str, log_path: Optional[str],
                 api_key: Optional[str] = None, role: str = "endpoint",
                 limits: Optional[EndpointLimits] = None, steps_path: Optional[str] = None,
                 t0: Optional[float] = None) -> None:  # fmt: skip
        self.generator, self.pace, self.model_name = generator, pace, model_name
        self.limits = limits or EndpointLimits()
        self._authorization = ("Bearer " + api_key).encode() if api_key else None
        header = {"role": role, "pace": pace.label, "modeled": pace.modeled, "model": model_name,
                  "clock_origin_unix_s": time.time() - time.monotonic()}  # fmt: skip
        self.log_path = log_path
        self.log = JsonLinesLog(log_path, header) if log_path else None
        # each token a paced step (the fidelity monitor's steps.csv, its ts_s from the run's t0), for a
        # generator that paces its tokens; written under a lock of its own, off the handlers' counts
        self.t0 = time.monotonic() if t0 is None else t0
        self.steps = CsvLog(steps_path, STEP_COLUMNS, header) if steps_path else None
        self._steps_lock = threading.Lock()
        self._state = threading.Condition()
        self.served = 0
        self.in_flight = 0
        self.connections = 0

    @property
    def keyed(self) -> bool:
        return self._authorization is not None

    def authorised(self, header: Optional[str]) -> bool:
        """Whether an ``Authorization`` header carries the key (constant time; any header without a key)."""
        if self._authorization is None:
            return True
        return hmac.compare_digest((header or "").encode("latin-1", "replace"), self._authorization)

    def _take(self, counter: str, most: int) -> bool:
        with self._state:
            if getattr(self, counter) >= most:
                return False
            setattr(self, counter, getattr(self, counter) + 1)
            return True

    def try_begin(self) -> bool:
        """Take a slot for a completion; False when ``max_in_flight`` are generating."""
        return self._take("in_flight", self.limits.max_in_flight)

    def record(self, row: Dict[str, Any], steps: Sequence[Dict[str, Any]] = ()) -> None:
        """Log a request done, its tokens' paced steps first (flushed with it)."""
        with self._steps_lock:
            if self.steps is not None and steps:
                self.steps.write_many(steps)
        with self._state:
            self.served += 1
            self.in_flight -= 1
            if self.log is not None:
                self.log.write(row)  # (flushed as written)
            self._state.notify_all()

    def step_row(self, emitted: Emitted, prompt_tokens: int) -> Dict[str, Any]:
        """A token as a paced step: the prompt's prefill for the first, one token after it (no layer
        count: an endpoint's token stands for the whole model)."""
        prefill, token = ENDPOINT_OPS
        return step_row(emitted.began_s - self.t0, token if emitted.index else prefill, 0,
                        1 if emitted.index else prompt_tokens, 1, prompt_tokens + emitted.index, emitted.real_s,
                        emitted.target_s, emitted.late_s, emitted.overran)  # fmt: skip

    def open_connection(self) -> bool:
        """Count a new connection; False when ``max_connections`` are open."""
        return self._take("connections", self.limits.max_connections)

    def connection_closed(self) -> None:
        with self._state:
            self.connections -= 1

    def close(self, wait_s: float = 10.0) -> None:
        """Close the log once the requests in flight are recorded (at most ``wait_s``)."""
        with self._state:
            self._state.wait_for(lambda: self.in_flight == 0, timeout=wait_s)
            if self.log is not None:
                self.log.close()
                self.log = None
        with self._steps_lock:
            if self.steps is not None:
                self.steps.close()
                self.steps = None


def _reject_constant(name: str) -> Any:
    raise ValueError("%s is not JSON" % name)


class Handler(BaseHTTPRequestHandler):
    server_version = "testbed-endpoint/1"
    protocol_version = "HTTP/1.1"
    endpoint: Endpoint  # set on the subclass that ``make_server`` builds
    _drain_bytes = 0  # what the client may still send after a refusal that closes the connection

    def log_message(self, format: str, *args: Any) -> None:  # the request log is ours
        return

    def setup(self) -> None:
        with contextlib.suppress(OSError):
            self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.endpoint.limits.send_buffer_bytes)
        super().setup()  # (the socket's timeout: ``timeout``, set by ``make_server``)

    def handle(self) -> None:
        # a client may cancel between requests of a kept-alive connection, or stall past the timeout
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, socket.timeout):
            super().handle()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._drain_bytes:
                self._linger(self._drain_bytes)

    # -- routing -------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        try:
            self._check_key()
            if self.path.rstrip("/") in ("/health", "/v1/health"):
                self._json(200, {"status": "ok", "pace": self.endpoint.pace.label, "served": self.endpoint.served})
            elif self.path.rstrip("/") == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": self.endpoint.model_name, "object": "model",
                                                             "owned_by": "testbed"}]})  # fmt: skip
            else:
                raise ApiError(404, "no route %s" % self.path)
        except ApiError as error:
            self._error(error)

    def do_POST(self) -> None:
        try:
            self._check_key()
            body = self._body()
            if self.path.rstrip("/") == "/v1/completions":
                self._complete(body, chat=False)
            elif self.path.rstrip("/") == "/v1/chat/completions":
                self._complete(body, chat=True)
            else:
                raise ApiError(404, "no route %s" % self.path)
        except ApiError as error:
            self._error(error)

    def _check_key(self) -> None:
        if not self.endpoint.authorised(self.headers.get("Authorization")):
            self._refuse_unread(self._announced_length())
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")

    # -- a completion --------------------------------------------------------------------------------
    def _complete(self, body: Dict[str, Any], chat: bool) -> None:
        endpoint = self.endpoint
        generator = endpoint.generator
        request = completion_request(body, chat, generator.tokenizer.vocab_size, generator.context_tokens,
                                     generator.encode, generator.chat_template if chat else None)  # fmt: skip
        prompt_ids, seed = request.prompt_ids, request.seed
        max_tokens = max_tokens_for(generator, len(prompt_ids), request.max_tokens)
        if max_tokens < 1:
            raise ApiError(400, "the prompt (%d tokens) fills the model's context" % len(prompt_ids), "prompt")
        if not endpoint.try_begin():
            raise ApiError(429, "the endpoint has %d requests in flight, the most it serves at once; retry later"
                           % endpoint.limits.max_in_flight)  # fmt: skip
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        taken = time.monotonic()
        tokens: List[int] = []
        stamps: List[float] = []
        steps: List[Dict[str, Any]] = []  # the tokens' paced steps, when the endpoint logs them
        pace = endpoint.pace.seeded(seed) if seed is not None else endpoint.pace
        row: Dict[str, Any] = {"id": ident, "client": self.client_address[0],  # which node asked
                               "route": "chat" if chat else "completions", "stream": request.stream,
                               "prompt_tokens": len(prompt_ids), "max_tokens": max_tokens, "taken_s": round(taken, 6),
                               "pace": endpoint.pace.label, "modeled": endpoint.pace.modeled, "seed": seed,
                               "overrun_tokens": 0}  # fmt: skip
        try:
            cancelled, finish = self._generate(ident, chat, request, max_tokens, pace, tokens, stamps, row, steps)
        except Exception as exc:  # the request is logged whatever ended it (in flight counts must fall)
            row.update(cancelled=False, finish_reason="error", error=repr(exc)[:300], completion_tokens=len(tokens))
            endpoint.record(row, steps)
            raise
        row.update(completion_tokens=len(tokens), cancelled=cancelled, finish_reason=None if cancelled else finish,
                   first_token_s=round(stamps[0], 6) if stamps else None,
                   last_token_s=round(stamps[-1], 6) if stamps else None)  # fmt: skip
        endpoint.record(row, steps)
        if cancelled:
            self.close_connection = True

    def _generate(self, ident: str, chat: bool, request: CompletionRequest, max_tokens: int, pace: Pace,
                  tokens: List[int], stamps: List[float], row: Dict[str, Any],
                  steps: List[Dict[str, Any]]) -> Tuple[bool, str]:  # fmt: skip
        """Stream (or collect) the tokens; (cancelled, finish reason). A client gone, or one that reads
        nothing for the timeout, is a cancellation."""
        endpoint = self.endpoint
        prompt_ids, stream = request.prompt_ids, request.stream
        finish, overruns = "length", 0
        generator = None
        try:
            if stream:
                self._start_events()
            generator = endpoint.generator.stream(prompt_ids, max_tokens, pace, sleep=self._sleep_watching)
            for emitted in generator:
                piece = endpoint.generator.piece(tokens, emitted.token_id)
                tokens.append(emitted.token_id)
                stamps.append(emitted.released_s)
                overruns += emitted.overran
                row["overrun_tokens"] = overruns
                if endpoint.steps is not None:
                    steps.append(endpoint.step_row(emitted, len(prompt_ids)))
                if emitted.token_id == endpoint.generator.tokenizer.eos_id:
                    finish = "stop"
                if stream:
                    done = len(tokens) == max_tokens or finish == "stop"
                    self._event(self._chunk(ident, chat, piece, [emitted.token_id], finish if done else None,
                                            first=len(tokens) == 1))  # fmt: skip
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
                     "total_tokens": len(prompt_ids) + len(tokens)}  # fmt: skip
            if stream:
                if request.include_usage:
                    self._event({"id": ident, "object": self._object(chat, True), "created": int(time.time()),
                                 "model": endpoint.model_name, "choices": [], "usage": usage})  # fmt: skip
                self._raw(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")  # the chunked body's end
                self.wfile.flush()
            else:
                self._json(200, self._whole(ident, chat, tokens, finish, usage))
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            return True, finish
        finally:
            if generator is not None:
                generator.close()
        return False, finish

    @staticmethod
    def _object(chat: bool, stream: bool) -> str:
        if chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def _chunk(self, ident: str, chat: bool, piece: str, ids: List[int], finish: Optional[str],
               first: bool) -> Dict[str, Any]:  # fmt: skip
        if chat:
            delta: Dict[str, Any] = {"content": piece}
            if first:
                delta["role"] = "assistant"
            choice: Dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
        choice["token_ids"] = ids
        return {"id": ident, "object": self._object(chat, True), "created": int(time.time()),
                "model": self.endpoint.model_name, "choices": [choice]}  # fmt: skip

    def _whole(self, ident: str, chat: bool, tokens: List[int], finish: str, usage: Dict[str, int]) -> Dict[str, Any]:
        text = self.endpoint.generator.decode(tokens)
        if chat:
            choice: Dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish, "logprobs": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        choice["token_ids"] = tokens
        return {"id": ident, "object": self._object(chat, False), "created": int(time.time()),
                "model": self.endpoint.model_name, "choices": [choice], "usage": usage}  # fmt: skip

    # -- HTTP plumbing -------------------------------------------------------------------------------
    def _sleep_watching(self, seconds: float) -> None:
        """Wait for a token's due time, noticing a client that closes its connection meanwhile (a
        cancelled request stops before its next token, also while its first one is pending); with 0
        seconds, only look."""
        end = time.monotonic() + seconds
        while True:
            left = max(0.0, end - time.monotonic())
            readable, _, _ = select.select([self.connection], [], [], left)
            if readable:
                try:
                    peeked = self.connection.recv(1, socket.MSG_PEEK)
                except OSError:
                    raise BrokenPipeError("the client went away") from None
                if not peeked:
                    raise BrokenPipeError("the client went away")
                time.sleep(max(0.0, end - time.monotonic()))  # it sent more (a next request): just wait
                return
            if time.monotonic() >= end:
                return

    def _announced_length(self) -> int:
        """What the request says its body holds, for draining after a refusal (0 if it says nothing usable)."""
        text = (self.headers.get("Content-Length") or "").strip()
        return int(text) if text.isascii() and text.isdigit() and len(text) <= CONTENT_LENGTH_DIGITS else 0

    def _refuse_unread(self, unread_bytes: int) -> None:
        """The refusal about to be sent closes the connection: what the client still sends is read and
        dropped (``DISCARD_MAX_BYTES`` at most) so that it hears the answer instead of a reset."""
        self.close_connection = True
        self._drain_bytes = min(DISCARD_MAX_BYTES, max(unread_bytes, 1 << 16))

    def _content_length(self) -> int:
        """The body's length in bytes: 400 for a missing, malformed or conflicting one, 413 over the cap."""
        if self.headers.get("Transfer-Encoding") is not None:
            self._refuse_unread(0)
            raise ApiError(400, "send the body with a Content-Length header, not a Transfer-Encoding")
        values = {value.strip() for value in self.headers.get_all("Content-Length") or []}
        if len(values) != 1:
            self._refuse_unread(0)
            raise ApiError(400, "a POST needs one Content-Length header (%d different given)" % len(values))
        (text,) = values
        if not (text.isascii() and text.isdigit()) or len(text) > CONTENT_LENGTH_DIGITS:
            self._refuse_unread(0)
            raise ApiError(400, "Content-Length must be a whole number of bytes, not %r" % text[:40])
        length = int(text)
        if length > self.endpoint.limits.max_body_bytes:
            self._refuse_unread(length)
            raise ApiError(413, "the body is %d bytes, over the %d bytes this endpoint takes"
                           % (length, self.endpoint.limits.max_body_bytes))  # fmt: skip
        return length

    def _body(self) -> Dict[str, Any]:
        length = self._content_length()
        data = self.rfile.read(length) if length else b""
        if len(data) < length:
            raise ConnectionResetError("the client closed the connection inside its body")
        try:
            body = json.loads(data.decode("utf-8") or "{}", parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, "the body is not JSON (%s)" % type(exc).__name__) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _json(self, status: int, payload: Dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        if status == 429:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, error: ApiError) -> None:
        self._json(error.status, error.payload())

    def _linger(self, most_bytes: int) -> None:
        """Say we are done, then read (and drop) what the client still sends, bounded in bytes and time."""
        deadline = time.monotonic() + min(LINGER_S, self.timeout or LINGER_S)
        with contextlib.suppress(OSError):
            self.request.shutdown(socket.SHUT_WR)
            while most_bytes > 0 and time.monotonic() < deadline:
                self.request.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.request.recv(min(1 << 16, most_bytes))
                if not data:
                    return
                most_bytes -= len(data)

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _event(self, payload: Dict[str, Any]) -> None:
        self._raw(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _raw(self, data: bytes) -> None:
        """One HTTP chunk of the event stream."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class _Refusal(Handler):
    """A connection over ``max_connections``: its request is answered 429 and the connection closed."""

    timeout = REFUSAL_TIMEOUT_S

    def handle(self) -> None:
        with contextlib.suppress(OSError):  # (timeouts, resets: it is being refused anyway)
            self.handle_one_request()

    def do_GET(self) -> None:
        self._refuse_unread(self._announced_length())
        self._error(ApiError(429, "the endpoint has %d connections open, the most it takes; retry later"
                             % self.endpoint.limits.max_connections))  # fmt: skip

    do_POST = do_GET


# socketserver listens with a backlog of 5: every device's calibration (4 streams each) and a race's
# two streams at once overflowed it on a busy server, and clients saw connections reset.
LISTEN_BACKLOG = 128


class EndpointServer(ThreadingHTTPServer):
    """One thread a connection, up to the endpoint's ``max_connections``; those over it are refused."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, address: Tuple[str, int], endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        fields = {"endpoint": endpoint, "timeout": endpoint.limits.timeout_s}
        self.refusal = type("BoundRefusal", (_Refusal,), dict(fields, timeout=min(REFUSAL_TIMEOUT_S,
                                                                                   endpoint.limits.timeout_s)))
        super().__init__(address, type("BoundHandler", (Handler,), fields))

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        admitted = self.endpoint.open_connection()
        try:
            (self.RequestHandlerClass if admitted else self.refusal)(request, client_address, self)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            if admitted:
                self.endpoint.connection_closed()
            self.shutdown_request(request)


def make_server(endpoint: Endpoint, host: str, port: int) -> Tuple[ThreadingHTTPServer, int]:
    """The HTTP server (not started) and the port it bound (``port`` 0: any free one)."""
    server = EndpointServer((host, port), endpoint)
    return server, server.server_address[1]


def api_key_from_env(variable: Optional[str]) -> Optional[str]:
    """The key a client must present, read from the environment variable the inventory names."""
    if not variable:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ValueError("the environment variable %s that should hold the endpoint's key is not set" % variable)
    return value


def api_key_from_file(path: str) -> str:
    """The key a client must present, read from a file that its owner alone may read (a run's key)."""
    with open(path, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if mode & 0o077:
            raise ValueError("%s holds a key but others may read it (mode %o): chmod 600 it" % (path, mode & 0o777))
        value = handle.read().decode("utf-8").strip()
    if not value:
        raise ValueError("%s holds no key" % path)
    return value
