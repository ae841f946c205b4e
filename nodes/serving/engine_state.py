"""The serving engine's requests and its KV budget, without a model: what the scheduler sees and what
each iteration must do.

A request is ``waiting`` (never run), ``running`` (its KV in the GPU's budget of M tokens),
``swapped`` (preempted, its KV in host memory, which holds ``swap_tokens``), ``dropped`` (preempted
with no room in host memory: its KV is recomputed from its prompt and output when it resumes) or
``done``. Each iteration:

1. ``snapshot`` gives the scheduler (``schedulers``) every live request;
2. ``apply`` carries the decision out: running requests left out are swapped out (or dropped), and
   requests let in are prefilled, swapped back in or recomputed; it returns an ``IterationPlan``;
3. the worker computes the plan and reports each new token with ``delivered``.

As vLLM 0.2.7 (which Andes builds on) does, an iteration that admits requests is a prefill iteration
of those alone; the running ones decode in the next. Every preemption is counted per request. A
request that could never run (its prompt and one token over the whole KV capacity) is refused as it
arrives, and one that grows to the whole capacity alone ends there, as vLLM ends a sequence at the
model's length: ``finished_by`` says which.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .qoe_shadow import BufferShadow
from .schedulers import SCHEDULERS, Decision, SchedulerSettings, Snapshot

WAITING, RUNNING, SWAPPED, DROPPED, DONE = "waiting", "running", "swapped", "dropped", "done"
Key = Tuple[int, int]  # (device rank, request id)


class ServedRequest(object):
    """One request as the engine holds it (times in seconds on the engine's clock)."""

    def __init__(self, key: Key, arrival_s: float, prompt_ids: List[int], max_new_tokens: int,
                 expected_ttft_s: float, expected_tds: float) -> None:  # fmt: skip
        self.key, self.arrival_s = key, arrival_s
        self.prompt_ids, self.max_new_tokens = list(prompt_ids), max_new_tokens
        self.shadow = BufferShadow(expected_ttft_s, expected_tds)
        self.generated: List[int] = []
        self.state = WAITING
        self.queued_s = arrival_s
        self.served_iterations = 0
        self.ever_run = False
        self.preemptions = self.swaps = self.recomputes = 0
        self.first_token_s: Optional[float] = None
        self.done_s: Optional[float] = None
        self.finished_by: Optional[str] = None  # eos | length | capacity | refused | cancelled | oom
        self.cache: Any = None  # the worker's KV cache object (kept while swapped, dropped when dropped)

    @property
    def context_tokens(self) -> int:
        """l_i: prompt and output tokens, the KV the request holds once its last token is fed."""
        return len(self.prompt_ids) + len(self.generated)

    def stats(self) -> Dict[str, Any]:
        return {"preemptions": self.preemptions, "swaps": self.swaps, "recomputes": self.recomputes}


class IterationPlan(NamedTuple):
    kind: str  # "prefill" (admitted requests only) or "decode" (the running ones)
    compute: Tuple[ServedRequest, ...]  # prefill: prompt (and output, recomputed); decode: the last token
    swapped_out: Tuple[ServedRequest, ...]
    swapped_in: Tuple[ServedRequest, ...]
    dropped: Tuple[ServedRequest, ...]
    decision: Decision


class EngineState(object):
    def __init__(self, scheduler: str, settings: SchedulerSettings, capacity_tokens: int, swap_tokens: int,
                 max_batch: int, latency_s: Callable[[int], float], prefill_s: Callable[[int], float],
                 swap_s: Callable[[int], float], lookahead_s: Optional[float] = None) -> None:  # fmt: skip
        """``latency_s(B)``: one decode iteration of B requests (the server's profile, Andes App. B);
        ``prefill_s(tokens)`` and ``swap_s(tokens)``: what bringing a request back costs, for Eq. 2's
        delay; ``lookahead_s``: Andes' delta t, None for the mean completion time so far."""
        if scheduler not in SCHEDULERS:
            raise ValueError("unknown scheduler %r; one of %s" % (scheduler, ", ".join(SCHEDULERS)))
        self.decide_with, self.settings = SCHEDULERS[scheduler], settings
        self.capacity_tokens, self.swap_tokens, self.max_batch = capacity_tokens, swap_tokens, max_batch
        self.latency_of = latency_s
        self.refresh_latency()
        self.prefill_s, self.swap_s = prefill_s, swap_s
        self.fixed_lookahead_s = lookahead_s
        self.live: List[ServedRequest] = []
        self.finished: List[ServedRequest] = []
        self.preemptions_total = self.admitted_total = 0
        self.forced_total = 0  # of the preemptions, those the memory forced rather than a scheduler chose

    def refresh_latency(self) -> None:
        """Tabulate latency(B) again (an engine without a profile learns it as it runs)."""
        self.latency_table = np.array([np.nan] + [self.latency_of(b) for b in range(1, self.max_batch + 1)])

    # -- what the engine holds -----------------------------------------------------------------
    def add(self, request: ServedRequest, now_s: float) -> bool:
        """Take a request in; False when it is refused (it could never fit in the KV capacity)."""
        if request.context_tokens + 1 > self.capacity_tokens:
            self._finish(request, now_s, "refused")
            return False
        self.live.append(request)
        return True

    def _finish(self, request: ServedRequest, now_s: float, why: str) -> None:
        request.state, request.done_s, request.cache, request.finished_by = DONE, now_s, None, why
        if request in self.live:
            self.live.remove(request)
        self.finished.append(request)

    def cancel(self, request: ServedRequest, now_s: float, why: str = "cancelled") -> None:
        """The request leaves the engine now, its KV freed: its client went away, or (``why``) the
        engine failed it (``oom``: its GPU ran out of memory)."""
        if request.state != DONE:
            self._finish(request, now_s, why)

    def in_state(self, state: str) -> List[ServedRequest]:
        return [r for r in self.live if r.state == state]

    def kv_used_tokens(self) -> int:
        return sum(r.context_tokens + 1 for r in self.live if r.state == RUNNING)

    def swap_used_tokens(self) -> int:
        return sum(r.context_tokens for r in self.live if r.state == SWAPPED)

    def lookahead_s(self) -> float:
        if self.fixed_lookahead_s is not None:
            return self.fixed_lookahead_s
        spans = [r.done_s - r.arrival_s for r in self.finished if r.done_s is not None and r.finished_by != "refused"]
        return float(np.mean(spans)) if spans else 30.0  # before any completes: a long answer's time

    # -- one iteration -------------------------------------------------------------------------
    def snapshot(self, now_s: float, room_tokens: Optional[int] = None) -> Snapshot:
        """What a scheduler decides on; ``room_tokens``: see :meth:`decide`."""
        rows = self.live
        for r in rows:
            r.shadow.advance(now_s - r.arrival_s)

        def column(get: Callable[[ServedRequest], Any], dtype: str) -> np.ndarray:
            return np.array([get(r) for r in rows], dtype=dtype)

        def delay(r: ServedRequest) -> float:
            if r.state == SWAPPED:
                return self.swap_s(r.context_tokens)
            return self.prefill_s(r.context_tokens) if r.state in (WAITING, DROPPED) else 0.0

        return Snapshot(
            now_s=now_s, capacity_tokens=self.capacity_tokens if room_tokens is None else room_tokens,
            max_batch=self.max_batch,
            latency_s=self.latency_table, lookahead_s=self.lookahead_s(),
            running=column(lambda r: r.state == RUNNING, "bool"),
            need_tokens=column(lambda r: r.context_tokens + 1, "int64"),
            arrival_s=column(lambda r: r.arrival_s, "float64"), queued_s=column(lambda r: r.queued_s, "float64"),
            served_iterations=column(lambda r: r.served_iterations, "int64"),
            delay_if_served_s=column(delay, "float64"),
            expected_ttft_s=column(lambda r: r.shadow.expected_ttft_s, "float64"),
            expected_tds=column(lambda r: r.shadow.expected_tds, "float64"),
            delivered=column(lambda r: r.shadow.delivered, "float64"),
            digested=column(lambda r: r.shadow.digested, "float64"),
            digested_area=column(lambda r: r.shadow.digested_area, "float64"),
            ever_run=column(lambda r: r.ever_run, "bool"),
            preemptions_total=self.preemptions_total, admitted_total=self.admitted_total,
        )  # fmt: skip

    def decide(self, now_s: float, room_tokens: Optional[int] = None) -> Decision:
        """The scheduler's choice now. ``room_tokens``: the KV tokens it may place this iteration, when
        less than the empty server's ``capacity_tokens`` (an engine whose memory also holds what moves
        while it serves, as CoCoServe's GPUs hold layer copies); the capacity itself by default."""
        return self.decide_with(self.snapshot(now_s, room_tokens), self.settings)

    def apply(self, decision: Decision, now_s: float) -> IterationPlan:
        """Preempt the running requests left out (swap while host memory holds them, else drop) and
        let in the chosen ones; the plan is the iteration to compute."""
        out, back, dropped, admitted = [], [], [], []
        self.forced_total += decision.forced
        for request, run in zip(self.live, decision.run):
            if request.state == RUNNING and not run:
                (out if self.preempt(request, now_s) == SWAPPED else dropped).append(request)
            elif request.state != RUNNING and run:
                if request.state == SWAPPED:
                    back.append(request)
                else:
                    admitted.append(request)
                if not request.ever_run:
                    request.ever_run = True
                    self.admitted_total += 1
                request.state = RUNNING
                request.served_iterations = 0
        compute = tuple(admitted) if admitted else tuple(r for r in self.live if r.state == RUNNING)
        for request in compute:
            request.served_iterations += 1
        return IterationPlan("prefill" if admitted else "decode", compute, tuple(out), tuple(back), tuple(dropped),
                             decision)  # fmt: skip

    def preempt(self, request: ServedRequest, now_s: float, swap: bool = True) -> str:
        """Take a running request out of the batch: its KV swapped to host memory while that holds it
        (and ``swap``: False when it has no KV yet), else dropped (recomputed when it resumes); the
        state it is now in."""
        request.preemptions += 1
        self.preemptions_total += 1
        request.queued_s, request.served_iterations = now_s, 0
        if swap and request.context_tokens <= self.swap_tokens - self.swap_used_tokens():
            request.state, request.swaps = SWAPPED, request.swaps + 1
        else:
            request.state, request.recomputes, request.cache = DROPPED, request.recomputes + 1, None
        return request.state

    def delivered(self, request: ServedRequest, token: int, now_s: float, eos_id: Optional[int]) -> bool:
        """A new token of ``request`` left the engine at ``now_s``; True when that ends the request."""
        request.generated.append(token)
        request.shadow.deliver(now_s - request.arrival_s)
        if request.first_token_s is None:
            request.first_token_s = now_s
        if eos_id is not None and token == eos_id:
            self._finish(request, now_s, "eos")
        elif len(request.generated) >= request.max_new_tokens:
            self._finish(request, now_s, "length")
        elif request.context_tokens + 1 > self.capacity_tokens:  # no room for its next token, even alone
            self._finish(request, now_s, "capacity")
        return request.state == DONE
