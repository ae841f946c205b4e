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
"""

import contextlib
import json
import os
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from nodes.contracts.records import JsonLinesLog

from .generator import PacedGenerator, max_tokens_for
from .pace import Pace

CHAT_TEMPLATE_SUFFIX = "assistant:"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> bytes:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return json.dumps({"error": {"message": self.message, "type": kind, "param": self.param,
                                     "code": None}}).encode()  # fmt: skip


class Endpoint(object):
    """What the HTTP handlers share: the generator, its pace, the model's name and the log."""

    def __init__(self, generator: PacedGenerator, pace: Pace, model_name: str, log_path: Optional[str],
                 api_key: Optional[str] = None, role: str = "endpoint") -> None:  # fmt: skip
        self.generator, self.pace, self.model_name, self.api_key = generator, pace, model_name, api_key
        header = {"role": role, "pace": pace.label, "modeled": pace.modeled, "model": model_name,
                  "clock_origin_unix_s": time.time() - time.monotonic()}  # fmt: skip
        self.log = JsonLinesLog(log_path, header) if log_path else None
        self._state = threading.Condition()
        self.served = 0
        self.in_flight = 0

    def begin(self) -> None:
        with self._state:
            self.in_flight += 1

    def record(self, row: Dict[str, Any]) -> None:
        with self._state:
            self.served += 1
            self.in_flight -= 1
            if self.log is not None:
                self.log.write(row)  # (flushed as written)
            self._state.notify_all()

    def close(self, wait_s: float = 10.0) -> None:
        """Close the log once the requests in flight are recorded (at most ``wait_s``)."""
        with self._state:
            self._state.wait_for(lambda: self.in_flight == 0, timeout=wait_s)
            if self.log is not None:
                self.log.close()
                self.log = None


def chat_prompt(messages: Any) -> str:
    """The chat messages as one prompt (a plain "role: content" template; the tiny model has none)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ApiError(400, "messages[%d] needs a string content" % i, "messages")
        lines.append("%s: %s" % (message.get("role", "user"), message["content"]))
    return "\n".join(lines + [CHAT_TEMPLATE_SUFFIX])


class Handler(BaseHTTPRequestHandler):
    server_version = "testbed-endpoint/1"
    protocol_version = "HTTP/1.1"
    endpoint: Endpoint  # set on the subclass that ``make_server`` builds

    def log_message(self, format: str, *args: Any) -> None:  # the request log is ours
        return

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().handle()  # (a client may cancel between requests of a kept-alive connection)

    # -- routing -------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", "/v1/health"):
            self._json(200, {"status": "ok", "pace": self.endpoint.pace.label, "served": self.endpoint.served})
        elif self.path.rstrip("/") == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.endpoint.model_name, "object": "model",
                                                         "owned_by": "testbed"}]})  # fmt: skip
        else:
            self._error(ApiError(404, "no route %s" % self.path))

    def do_POST(self) -> None:
        try:
            if not self._authorised():
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")
            body = self._body()
            if self.path.rstrip("/") == "/v1/completions":
                self._complete(body, chat=False)
            elif self.path.rstrip("/") == "/v1/chat/completions":
                self._complete(body, chat=True)
            else:
                raise ApiError(404, "no route %s" % self.path)
        except ApiError as error:
            self._error(error)

    # -- a completion --------------------------------------------------------------------------------
    def _complete(self, body: Dict[str, Any], chat: bool) -> None:
        endpoint = self.endpoint
        prompt_ids = self._prompt_ids(body, chat)
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n = 1 is served", "n")
        if body.get("logprobs") not in (None, False):
            raise ApiError(400, "logprobs are not served", "logprobs")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise ApiError(400, "max_tokens must be a positive integer", "max_tokens")
        max_tokens = max_tokens_for(endpoint.generator, len(prompt_ids), asked)
        if max_tokens < 1:
            raise ApiError(400, "the prompt (%d tokens) fills the model's context" % len(prompt_ids), "prompt")
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        taken = time.monotonic()
        tokens: List[int] = []
        stamps: List[float] = []
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise ApiError(400, "seed must be a non-negative integer", "seed")
        pace = endpoint.pace.seeded(seed) if seed is not None else endpoint.pace
        endpoint.begin()
        row: Dict[str, Any] = {"id": ident, "client": self.client_address[0],  # which node asked
                               "route": "chat" if chat else "completions", "stream": stream,
                               "prompt_tokens": len(prompt_ids), "max_tokens": max_tokens, "taken_s": round(taken, 6),
                               "pace": endpoint.pace.label, "modeled": endpoint.pace.modeled, "seed": seed,
                               "overrun_tokens": 0}  # fmt: skip
        try:
            cancelled, finish = self._generate(ident, chat, prompt_ids, max_tokens, pace, stream, usage_wanted,
                                               tokens, stamps, row)  # fmt: skip
        except Exception as exc:  # the request is logged whatever ended it (in flight counts must fall)
            row.update(cancelled=False, finish_reason="error", error=repr(exc)[:300], completion_tokens=len(tokens))
            endpoint.record(row)
            raise
        row.update(completion_tokens=len(tokens), cancelled=cancelled, finish_reason=None if cancelled else finish,
                   first_token_s=round(stamps[0], 6) if stamps else None,
                   last_token_s=round(stamps[-1], 6) if stamps else None)  # fmt: skip
        endpoint.record(row)
        if cancelled:
            self.close_connection = True

    def _generate(self, ident: str, chat: bool, prompt_ids: List[int], max_tokens: int, pace: Pace, stream: bool,
                  usage_wanted: bool, tokens: List[int], stamps: List[float], row: Dict[str, Any]) -> Tuple[bool, str]:
        """Stream (or collect) the tokens; (cancelled, finish reason). A client gone is a cancellation."""
        endpoint = self.endpoint
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
                overruns += emitted.overrun_s > 0
                row["overrun_tokens"] = overruns
                if emitted.token_id == endpoint.generator.tokenizer.eos_id:
                    finish = "stop"
                if stream:
                    done = len(tokens) == max_tokens or finish == "stop"
                    self._event(self._chunk(ident, chat, piece, [emitted.token_id], finish if done else None,
                                            first=len(tokens) == 1))  # fmt: skip
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
                     "total_tokens": len(prompt_ids) + len(tokens)}  # fmt: skip
            if stream:
                if usage_wanted:
                    self._event({"id": ident, "object": self._object(chat, True), "created": int(time.time()),
                                 "model": endpoint.model_name, "choices": [], "usage": usage})  # fmt: skip
                self._raw(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")  # the chunked body's end
                self.wfile.flush()
            else:
                self._json(200, self._whole(ident, chat, tokens, finish, usage))
        except (BrokenPipeError, ConnectionResetError):
            return True, finish
        finally:
            if generator is not None:
                generator.close()
        return False, finish

    def _prompt_ids(self, body: Dict[str, Any], chat: bool) -> List[int]:
        generator = self.endpoint.generator
        if chat:
            return generator.encode(chat_prompt(body.get("messages")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return generator.encode(prompt)
        vocab = generator.tokenizer.vocab_size
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            return list(prompt)
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids below %d" % vocab, "prompt")

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

    def _authorised(self) -> bool:
        key = self.endpoint.api_key
        return not key or self.headers.get("Authorization", "") == "Bearer " + key

    def _body(self) -> Dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            raise ApiError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _json(self, status: int, payload: Dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, error: ApiError) -> None:
        data = error.body()
        self.send_response(error.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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


# socketserver listens with a backlog of 5: every device's calibration (4 streams each) and a race's
# two streams at once overflowed it on a busy server, and clients saw connections reset.
LISTEN_BACKLOG = 128


def make_server(endpoint: Endpoint, host: str, port: int) -> Tuple[ThreadingHTTPServer, int]:
    """The HTTP server (not started) and the port it bound (``port`` 0: any free one)."""
    handler = type("BoundHandler", (Handler,), {"endpoint": endpoint})
    server_class = type("EndpointServer", (ThreadingHTTPServer,), {"request_queue_size": LISTEN_BACKLOG})
    server = server_class((host, port), handler)
    server.daemon_threads = True
    return server, server.server_address[1]


def api_key_from_env(variable: Optional[str]) -> Optional[str]:
    """The key a client must present, read from the environment variable the inventory names."""
    if not variable:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ValueError("the environment variable %s that should hold the endpoint's key is not set" % variable)
    return value
