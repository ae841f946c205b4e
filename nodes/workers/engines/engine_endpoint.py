"""The serving engine behind an OpenAI-compatible endpoint: DiSCo's server endpoint "served by our
server engine and scheduler" (``dispatch.server: engine``), where the trace endpoint replays a
service's times instead.

``EngineEndpoint`` is the serving engine (``serving_engine.py``: continuous batching under the KV
budget, preemption by swap or recompute, the run's scheduler, the target's step times from the
server's profile) whose requests come from HTTP handler threads rather than MPI: each handler
submits its prompt ids and takes its tokens from a queue as the engine produces them; a client that
goes away has its request cancelled (dropped from the engine at the next iteration, its KV freed).
The engine loop runs on the caller's thread (``serve``), the HTTP server on its own.
"""

import itertools
import queue
import threading
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from nodes.endpoints.generator import Emitted, TokenText
from nodes.serving.engine_state import IterationPlan, ServedRequest

from .serving_engine import ServingEngine

DONE = None  # a request's queue ends with this
WAIT_S = 0.05  # how long the idle engine waits for a request before it looks again
EXPECTED_TTFT_S, EXPECTED_TDS = 1.0, 1e6  # an API request states no QoE expectation: Andes' defaults


class EngineStreams(TokenText):
    """What the HTTP endpoint calls ``generator``: ``stream`` submits a request to the engine and
    yields its tokens as the engine releases them."""

    def __init__(self, engine: "EngineEndpoint") -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.context_tokens = engine.context_tokens

    def stream(self, prompt_ids: Sequence[int], max_tokens: int, pace: object = None, stop_at_eos: bool = True,
               sleep=time.sleep) -> Iterator[Emitted]:  # fmt: skip
        key, tokens = self.engine.submit(list(prompt_ids), max_tokens)
        index = 0
        try:
            while True:
                try:
                    token = tokens.get(timeout=WAIT_S)
                except queue.Empty:
                    sleep(0.0)  # (the HTTP handler's sleep notices a client that went away)
                    continue
                if token is DONE:
                    return
                yield Emitted(int(token), index, time.monotonic())
                index += 1
        finally:
            self.engine.cancel(key)  # a no-op once the request is done


class EngineEndpoint(ServingEngine):
    """A serving engine fed by HTTP handlers (see the module docstring)."""

    def __init__(self, config, comm, rank: int, parts=None) -> None:
        super().__init__(config, comm, rank, parts)
        self.context_tokens = int(getattr(self.part.config, "max_position_embeddings", 2048))
        self._arrivals: "queue.Queue[Tuple[Tuple[int, int], List[int], int, queue.Queue]]" = queue.Queue()
        self._cancelled: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._outputs: Dict[Tuple[int, int], "queue.Queue"] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.streams = EngineStreams(self)

    def submit(self, prompt_ids: List[int], max_tokens: int) -> Tuple[Tuple[int, int], "queue.Queue"]:
        key = (0, next(self._ids))
        tokens: "queue.Queue" = queue.Queue()
        self._arrivals.put((key, prompt_ids, max_tokens, tokens))
        return key, tokens

    def cancel(self, key: Tuple[int, int]) -> None:
        self._cancelled.put(key)

    def stop(self) -> None:
        """End ``serve`` once nothing is in flight."""
        self._stop.set()

    def serve(self) -> None:
        while not (self._stop.is_set() and not self.state.live and self._arrivals.empty()):
            self._take_arrivals(block=not self.state.live)
            self._take_cancellations()
            if self.state.live:
                self._iterate()
        self.log.close()
        self.request_log.close()
        if self.pacer is not None:
            self.pacer.close()

    def _take_arrivals(self, block: bool) -> None:
        try:
            first = self._arrivals.get(timeout=WAIT_S) if block else self._arrivals.get_nowait()
        except queue.Empty:
            return
        batch = [first]
        while True:
            try:
                batch.append(self._arrivals.get_nowait())
            except queue.Empty:
                break
        now = self.clock()
        for key, ids, max_tokens, tokens in batch:
            request = ServedRequest(key, now, ids, max_tokens, EXPECTED_TTFT_S, EXPECTED_TDS)
            self._outputs[key] = tokens
            if not self.state.add(request, now):  # its prompt alone exceeds the KV capacity
                self._log_request(request)
                self._outputs.pop(key).put(DONE)

    def _take_cancellations(self) -> None:
        now = self.clock()
        while True:
            try:
                key = self._cancelled.get_nowait()
            except queue.Empty:
                return
            for request in self.state.live:
                if request.key == key:
                    self.state.cancel(request, now)
                    self._log_request(request)
            tokens: Optional[queue.Queue] = self._outputs.pop(key, None)
            if tokens is not None:
                tokens.put(DONE)

    def _stream(self, plan: IterationPlan, tokens: List[int]) -> None:
        now = self.clock()
        for request, token in zip(plan.compute, tokens):
            ended = self.state.delivered(request, token, now, self.eos_id)
            out = self._outputs.get(request.key)
            if out is not None:
                out.put(token)
                if ended:
                    out.put(DONE)
                    self._outputs.pop(request.key, None)
            if ended:
                self._log_request(request)
