"""A streaming client of an OpenAI-compatible completions API that a dispatcher can cancel at any
time (standard library only: it runs on the device node, Python 3.8).

``CompletionStream`` posts ``/v1/completions`` with the prompt as token ids and ``stream: true`` from
its own thread and reports to a queue: ``("tokens", ids, t)`` per chunk, ``("done", usage, t)`` at the
end, ``("failed", message, t)`` on an error. ``t`` is ``time.monotonic()`` when the chunk was read.
Token ids come from the chunk's ``token_ids`` (our endpoints and vLLM's ``return_token_ids``) or, from
an endpoint without them, from tokenising its text. ``cancel()`` closes the connection: the endpoint
sees its client gone and stops generating.
"""

import contextlib
import http.client
import json
import queue
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Sequence
from urllib.parse import urlsplit


class CompletionStream(object):
    def __init__(self, name: str, base_url: str, prompt_ids: Sequence[int], max_tokens: int, events: "queue.Queue",
                 model: str = "default", api_key: Optional[str] = None,
                 tokenize: Optional[Callable[[str], List[int]]] = None, timeout_s: float = 60.0,
                 seed: Optional[int] = None) -> None:  # fmt: skip
        self.name, self.base_url, self.events = name, base_url.rstrip("/"), events
        self.prompt_ids, self.max_tokens, self.model, self.api_key = list(prompt_ids), max_tokens, model, api_key
        self.tokenize, self.timeout_s, self.seed = tokenize, timeout_s, seed
        self.started_s = 0.0
        self.received = 0
        self.usage: Optional[dict] = None
        self._cancelled = threading.Event()
        self._connection: Optional[http.client.HTTPConnection] = None
        self._thread = threading.Thread(target=self._run, name="stream-" + name, daemon=True)

    def start(self) -> "CompletionStream":
        self.started_s = time.monotonic()
        self._thread.start()
        return self

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop reading and close the connection (the endpoint stops at its next token)."""
        self._cancelled.set()
        connection = self._connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)

    def join(self, timeout_s: Optional[float] = None) -> None:
        self._thread.join(timeout_s)

    def _post(self) -> http.client.HTTPResponse:
        url = urlsplit(self.base_url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._connection = connection = kind(url.hostname, url.port, timeout=self.timeout_s)
        request = {"model": self.model, "prompt": self.prompt_ids, "max_tokens": self.max_tokens,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                   "return_token_ids": True}  # fmt: skip
        if self.seed is not None:
            request["seed"] = self.seed
        body = json.dumps(request)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        connection.request("POST", url.path + "/completions", body=body, headers=headers)
        return connection.getresponse()

    def _run(self) -> None:
        try:
            response = self._post()
            if response.status != 200:
                detail = response.read(2000).decode("utf-8", "replace")
                self._report("failed", "HTTP %d: %s" % (response.status, detail))
                return
            for line in response:
                if self.cancelled:
                    return
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                self._chunk(json.loads(data))
            self._report("done", self.usage)
        except (OSError, http.client.HTTPException, ValueError) as error:
            if not self.cancelled:
                self._report("failed", "%s: %s" % (type(error).__name__, error))
        finally:
            if self._connection is not None:
                self._connection.close()

    def _chunk(self, chunk: Any) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            if ids is None:
                text = choice.get("text") or ""
                ids = self.tokenize(text) if (self.tokenize and text) else []
            if ids:
                self.received += len(ids)
                self._report("tokens", [int(i) for i in ids])

    def _report(self, kind: str, payload: Any) -> None:
        if not self.cancelled:
            self.events.put((self.name, kind, payload, time.monotonic()))
