"""DiSCo's dispatcher against live endpoints (the device's own and a server, both speaking the OpenAI
streaming API): the same routes, race and migration as the trace-driven runs (``replay.py``), with
real streams, real cancellation and tokens computed by the endpoints.

Each call serves one request (requests are independent: the device's dispatcher runs one call per
request in flight, the paper's arrive 30 s apart). The server stream starts at its route's time, the
device stream at its own unless the server has answered by then; the first token decides the winner
and the loser is cancelled. With a ``MigrationRule``, once Eq. 4 holds and the client buffer holds B
tokens, the other endpoint is asked to continue from prompt + the token ids so far; the source streams
on until the target's first token, then it is cancelled and the target's tokens take over from where
the source stopped. Every token the target repeats is checked against the source's (greedy decoding
with one model at both ends: they must agree).
"""

import math
import queue
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from nodes.endpoints.client import CompletionStream
from nodes.endpoints.device_speed import LinearTtft

from .controller import MigrationRule
from .policy import DEVICE, SERVER
from .replay import display_times


class EndpointAddress(object):
    """Where an endpoint is, the model name it serves, and the key it takes (None: none)."""

    def __init__(self, base_url: str, model: str = "default", api_key: Optional[str] = None) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key


MIGRATION = "-migration"  # the stream that continues a request on the other endpoint: "server-migration"


class _Request(object):
    """One request's streams and tokens while it is served."""

    def __init__(self, prompt: List[int], max_tokens: int, endpoints: Dict[str, EndpointAddress],
                 tokenize: Optional[Callable[[str], List[int]]], seed: Optional[int]) -> None:  # fmt: skip
        self.prompt, self.max_tokens, self.endpoints, self.tokenize = prompt, max_tokens, endpoints, tokenize
        self.seed = seed
        self.events: "queue.Queue" = queue.Queue()
        self.t0 = time.monotonic()
        self.streams: Dict[str, CompletionStream] = {}
        self.winner: Optional[str] = None  # the endpoint that produced the first token
        self.source: Optional[str] = None  # the stream whose tokens the client takes now
        self.target: Optional[str] = None  # a migration stream, once asked
        self.tokens: List[int] = []
        self.arrivals: List[float] = []
        self.target_next = 0  # the output index of the target's next token
        self.handoff = self.held = self.mismatches = 0
        self.wants_migration: Optional[bool] = None
        self.failure: Optional[str] = None
        self.failed: Dict[str, str] = {}  # a failed stream's name -> its error
        self.finished = False

    def open(self, name: str, endpoint: str, ids: List[int], budget: int) -> None:
        """Start a stream; the race's two carry the request's seed (a trace endpoint's draws), a
        migration's does not (it is a new request to its endpoint)."""
        address = self.endpoints[endpoint]
        seed = self.seed if name == endpoint else None
        self.streams[name] = CompletionStream(name, address.base_url, ids, budget, self.events, address.model,
                                              address.api_key, self.tokenize, seed=seed).start()  # fmt: skip

    def take(self, name: str, kind: str, payload, stamp: float) -> None:
        if kind == "failed":
            self.failed[name] = str(payload)
            if name == self.source:
                self.failure, self.finished = "%s: %s" % (name, payload), True
            elif name == self.target:  # the migration is given up: the source streams on
                self.target = None
            return
        if kind == "done":
            if name == self.source:
                self.finished = True
                if self.target is not None and self.source != self.target:  # the source ended first
                    self.streams[self.target].cancel()
            return
        if self.winner is None:  # the race's first token: the other endpoint is cancelled
            self.winner = self.source = name
            for other, stream in self.streams.items():
                if other != name:
                    stream.cancel()
        if name == self.target and self.source != self.target:  # the target is ready: hand over
            self.streams[self.source].cancel()
            self.handoff, self.source = len(self.tokens), self.target
        if name != self.source:
            return
        for token in payload:
            if name == self.target and self.target_next < len(self.tokens):  # a token the source already sent
                self.mismatches += token != self.tokens[self.target_next]
            else:
                self.tokens.append(token)
                self.arrivals.append(stamp - self.t0)
            if name == self.target:
                self.target_next += 1

    def maybe_migrate(self, rule: MigrationRule, consumption_tok_s: float) -> None:
        """Eq. 4, decided at the first token; Eq. 5 checked at every chunk until the buffer holds B."""
        if self.finished or self.target is not None or self.winner is None or not self.tokens:
            return
        if len(self.tokens) >= self.max_tokens:
            return
        if self.wants_migration is None:
            self.wants_migration = rule.worth_it(self.winner, len(self.prompt), len(self.tokens))
        if not self.wants_migration:
            return
        buffered = len(self.tokens) - _shown_count(self.arrivals, time.monotonic() - self.t0, consumption_tok_s)
        if buffered >= int(rule.buffer_tokens(self.winner, len(self.prompt) + len(self.tokens))):
            other = SERVER if self.winner == DEVICE else DEVICE
            self.target, self.held, self.target_next = other + MIGRATION, buffered, len(self.tokens)
            self.open(self.target, other, self.prompt + self.tokens, self.max_tokens - len(self.tokens))


def dispatch_request(request_id: int, prompt_ids: Sequence[int], max_tokens: int, server_start_s: float,
                     device_start_s: float, endpoints: Dict[str, EndpointAddress], consumption_tok_s: float,
                     device_ttft: LinearTtft, migration: Optional[MigrationRule] = None,
                     tokenize: Optional[Callable[[str], List[int]]] = None, timeout_s: float = 120.0,
                     seed: Optional[int] = None) -> dict:  # fmt: skip
    """Serve one request; return its record (times in seconds from its arrival on this clock).
    ``seed``: sent with the race's two requests (the API's ``seed``), so a trace endpoint draws
    this request's times reproducibly."""
    request = _Request(list(prompt_ids), max_tokens, endpoints, tokenize, seed)
    due = {SERVER: server_start_s, DEVICE: device_start_s}
    while not request.finished:
        elapsed = time.monotonic() - request.t0
        if elapsed > timeout_s:
            request.failure = "timed out after %.0f s" % timeout_s
            break
        if request.winner is None:
            for endpoint, start_s in due.items():
                if endpoint not in request.streams and start_s <= elapsed:
                    request.open(endpoint, endpoint, request.prompt, max_tokens)
        waiting = [s for e, s in due.items() if e not in request.streams and math.isfinite(s)]
        if request.winner is None and not waiting and set(request.streams) <= set(request.failed):
            failures = "; ".join("%s (%s)" % (name, request.failed[name]) for name in sorted(request.failed))
            failures = failures or "the route starts neither endpoint"
            request.failure = "no endpoint answered: %s" % failures
            break
        wait = min(waiting) - elapsed if waiting and request.winner is None else 1.0
        try:
            event = request.events.get(timeout=max(0.0, min(wait, 1.0)))
        except queue.Empty:
            continue
        request.take(*event)
        if migration is not None:
            request.maybe_migrate(migration, consumption_tok_s)
    for stream in request.streams.values():
        stream.cancel()
    for stream in request.streams.values():
        stream.join(5.0)
    return _record(request_id, request, device_ttft)


def _shown_count(arrivals: Sequence[float], now_s: float, consumption_tok_s: float) -> int:
    """How many tokens the client buffer (``replay.display_times``) has shown by ``now_s``."""
    if not arrivals:
        return 0
    return int(np.searchsorted(display_times(np.asarray(arrivals), consumption_tok_s), now_s, side="right"))


def _record(request_id: int, request: _Request, device_ttft: LinearTtft) -> dict:
    prompt, streams, t0 = request.prompt, request.streams, request.t0
    first = request.arrivals[0] if request.arrivals else None
    device = streams.get(DEVICE)
    device_prefill = 0.0
    if device is not None:  # the share of its prefill the device did before it was cancelled
        if device.received or first is None:
            device_prefill = float(len(prompt))
        else:
            elapsed = first - (device.started_s - t0)
            device_prefill = len(prompt) * max(0.0, min(1.0, elapsed / float(device_ttft.ttft_s(len(prompt)))))
    target = streams.get(request.target) if request.target else None
    migrated = target is not None and request.source == request.target

    def received(name: str) -> int:
        return streams[name].received if name in streams else 0

    return {
        "request_id": request_id, "prompt_tokens": len(prompt), "max_new_tokens": request.max_tokens,
        "output_tokens": len(request.tokens), "token_ids": request.tokens,
        "arrivals_s": [round(a, 6) for a in request.arrivals],
        "ttft_s": round(first, 6) if first is not None else None, "winner": request.winner,
        "failure": request.failure,
        "started_s": {name: round(s.started_s - t0, 6) for name, s in streams.items()},
        "race_server_input_tokens": len(prompt) if SERVER in streams else 0,
        "race_device_prefill_tokens": round(device_prefill, 3),
        "server_output_tokens": received(SERVER) + received(SERVER + MIGRATION),
        "device_output_tokens": received(DEVICE) + received(DEVICE + MIGRATION),
        "migration_target": request.target, "migrated": migrated, "handoff_tokens": request.handoff,
        "held_tokens": request.held, "migration_input_tokens": len(target.prompt_ids) if target is not None else 0,
        "migration_mismatches": request.mismatches, "seed": request.seed, "modeled_times": True,
    }  # fmt: skip
