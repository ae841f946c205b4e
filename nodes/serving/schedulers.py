"""Per-iteration scheduling decisions of the serving engine: which requests run the next
continuous-batching iteration. Each scheduler is a pure function of a ``Snapshot`` so it can be
checked against hand traces and timed without a model; the engine carries the decision out
(prefill or bring back the admitted, swap out or drop the preempted).

- ``fcfs``: vLLM's default. Requests are ranked by arrival: the queue is admitted in that order while
  memory and the batch allow (the first that does not fit blocks the rest), and when the running
  requests outgrow the memory the latest-arrived running one is preempted.
- ``rr``: round robin. A request that has run ``rr_interval`` iterations since it was (re)admitted goes
  to the back of the queue when others wait; otherwise like fcfs, ranked by when each joined the queue.
- ``andes``: Andes' QoE-aware scheduler (Sec. 4): unless triggered it serves like fcfs; when the KV
  cache is above the watermark or latency(B) is too slow for the most demanding request's TDS, it
  picks the batch size B in [B_min, B_max] and the requests whose summed Eq. 2 gain is largest
  (Algorithm 1 greedy, Eq. 5 priority), preempting the rest within the cap P (Optimisation 4).
- ``static``: static batching (Transformers' ``generate``, CoCoServe's HF baseline): while any request
  runs, the batch runs alone; once it has ended, the next ``max_batch`` requests by arrival start
  together. Memory is not checked, neither at admission nor as the batch grows: a batch that outgrows
  the GPU fails with out-of-memory, which the engine that uses it counts (``scaling_engine``).
- ``andes-dp``: the same with Algorithm 2's exact DP in place of the greedy packing (a reference).

Memory is counted in KV tokens: a request needs its context plus the token this iteration adds.
Preemption the memory forces is always allowed, by every scheduler (brief: pitfall 7), and counts
towards Andes' cap.
"""

from dataclasses import dataclass, replace
from typing import Callable, Dict, Tuple

import numpy as np

from nodes.contracts.scheduler_settings import SchedulerSettings
from nodes.serving.knapsack import exact_pack, greedy_pack_many, largest_batch
from nodes.serving.qoe_shadow import predicted_qoe


@dataclass(frozen=True)
class Snapshot:
    """The engine's requests before an iteration, one row each (arrays of equal length)."""

    now_s: float
    capacity_tokens: int  # M: KV tokens the server's memory holds (Eq. 3)
    max_batch: int  # requests one iteration may carry (vLLM's max_num_seqs)
    latency_s: np.ndarray  # latency_s[b]: one decode iteration of b requests, b = 1..max_batch
    lookahead_s: float  # Andes' delta t (Eq. 2): the mean completion time so far
    running: np.ndarray  # bool: in the batch now (its KV on the GPU)
    need_tokens: np.ndarray  # int: KV tokens it holds after the next iteration if it runs (l_i + 1)
    arrival_s: np.ndarray  # when it arrived (server clock)
    queued_s: np.ndarray  # when it last joined the queue (its arrival, or its last preemption)
    served_iterations: np.ndarray  # iterations run since it was last admitted
    delay_if_served_s: np.ndarray  # before its next token if admitted: prefill, swap-in or recompute
    expected_ttft_s: np.ndarray
    expected_tds: np.ndarray  # TDS_exp, tokens/s
    delivered: np.ndarray  # tokens sent so far
    digested: np.ndarray  # the client buffer's shadow: tokens read by now
    digested_area: np.ndarray  # token-seconds read so far (Eq. 1's numerator so far)
    ever_run: np.ndarray  # bool: admitted at least once before
    preemptions_total: int = 0  # over the run so far (Andes' cap P)
    admitted_total: int = 0  # requests admitted at least once so far

    def __len__(self) -> int:
        return len(self.running)


@dataclass(frozen=True)
class Decision:
    run: np.ndarray  # bool per row: in the next iteration's batch
    preempted: int  # running rows left out (their KV swapped out or dropped)
    solved: bool  # Andes solved Eq. 4 this iteration (triggered)
    batch: int  # the B it solved for (0 when not solved)
    forced: int = 0  # of the preempted, those the memory forced (the running outgrew M), not chosen


def _queue_by(snapshot: Snapshot, rank: np.ndarray, settings: SchedulerSettings) -> Decision:
    """Serve in the order ``rank`` (lower first): keep the running ones while memory allows, preempting
    the worst-ranked running first, then admit the queue in rank order until one does not fit."""
    run = snapshot.running.copy()
    need = snapshot.need_tokens
    preempted = 0
    running_rows = np.flatnonzero(run)
    keep = running_rows[np.argsort(rank[running_rows], kind="stable")]
    used = np.cumsum(need[keep])
    fits = min(int(np.searchsorted(used, snapshot.capacity_tokens, side="right")), snapshot.max_batch)
    if fits < len(keep):
        run[keep[fits:]] = False
        preempted = len(keep) - fits
    if preempted == 0:  # vLLM admits nothing in an iteration that had to preempt
        total, count = int(need[run].sum()), int(run.sum())
        waiting = np.flatnonzero(~run)
        for row in waiting[np.argsort(rank[waiting], kind="stable")]:
            if count + 1 > snapshot.max_batch or total + need[row] > snapshot.capacity_tokens:
                break
            run[row] = True
            total, count = total + int(need[row]), count + 1
    return Decision(run, preempted, False, 0, preempted)


def fcfs(snapshot: Snapshot, settings: SchedulerSettings) -> Decision:
    return _queue_by(snapshot, snapshot.arrival_s, settings)


def round_robin(snapshot: Snapshot, settings: SchedulerSettings) -> Decision:
    rank = snapshot.queued_s.astype("float64").copy()
    running = snapshot.running
    if np.any(~running):  # others wait: those whose turn is over leave the batch for the back of the queue
        over = running & (snapshot.served_iterations >= settings.rr_interval)
        rank[over] = snapshot.now_s + np.arange(int(over.sum())) * 1e-9
        running = running & ~over
    decision = _queue_by(replace(snapshot, running=running), rank, settings)
    return Decision(decision.run, int(np.sum(snapshot.running & ~decision.run)), False, 0, decision.forced)


def static(snapshot: Snapshot, settings: SchedulerSettings) -> Decision:
    run = snapshot.running.copy()
    if not run.any():
        waiting = np.flatnonzero(~run)
        run[waiting[np.argsort(snapshot.arrival_s[waiting], kind="stable")][: snapshot.max_batch]] = True
    return Decision(run, 0, False, 0)


def batch_bounds(snapshot: Snapshot) -> Tuple[int, int]:
    """Optimisation 2: B_max, the most requests that fit at once; B_min, the largest batch whose
    per-request speed 1 / latency(B) still meets the most demanding TDS_exp (1 if none does)."""
    b_max = max(1, min(largest_batch(snapshot.need_tokens, snapshot.capacity_tokens), snapshot.max_batch))
    fast_enough = np.flatnonzero(1.0 / snapshot.latency_s[1 : b_max + 1] >= float(np.max(snapshot.expected_tds)))
    b_min = int(fast_enough[-1]) + 1 if len(fast_enough) else 1
    return b_min, b_max


def triggered(snapshot: Snapshot, settings: SchedulerSettings) -> bool:
    """Optimisation 1: solve only when the KV cache is above the watermark or the batch now runs too
    slowly for the most demanding request."""
    used = int(snapshot.need_tokens[snapshot.running].sum())
    batch_now = max(1, int(snapshot.running.sum()))
    too_slow = snapshot.latency_s[min(batch_now, snapshot.max_batch)] > 1.0 / float(np.max(snapshot.expected_tds))
    return used > settings.watermark * snapshot.capacity_tokens or bool(too_slow)


def _batch_grid(b_min: int, b_max: int, points: int) -> np.ndarray:
    if b_max - b_min + 1 <= points:
        return np.arange(b_min, b_max + 1)
    return np.unique(np.round(np.geomspace(b_min, b_max, points)).astype("int64"))


def _andes(snapshot: Snapshot, settings: SchedulerSettings, exact: bool) -> Decision:
    if len(snapshot) == 0 or not triggered(snapshot, settings):
        return fcfs(snapshot, settings)
    b_min, b_max = batch_bounds(snapshot)
    since = snapshot.now_s - snapshot.arrival_s
    delay = np.where(snapshot.running, 0.0, snapshot.delay_if_served_s)
    shadow = (snapshot.digested, snapshot.delivered, snapshot.digested_area, snapshot.expected_ttft_s,
              snapshot.expected_tds, since)  # fmt: skip
    # equal priorities go to the running (no preemption for nothing), then to the oldest
    order = np.lexsort((snapshot.arrival_s, ~snapshot.running))
    grid = _batch_grid(b_min, b_max, settings.batch_grid)
    rates = 1.0 / snapshot.latency_s[grid][:, None]  # tokens/s a request gets in a batch of B, one row per B
    waiting = predicted_qoe(*shadow, snapshot.lookahead_s, 0.0, 0.0)
    gains = predicted_qoe(*shadow, snapshot.lookahead_s, rates, delay) - waiting  # Eq. 2, [B, request]
    chosen = np.zeros(gains.shape, dtype=bool)
    if exact:
        for row, batch in enumerate(grid):
            picked = exact_pack(gains[row, order], snapshot.need_tokens[order], int(batch), snapshot.capacity_tokens,
                                settings.dp_block_tokens)  # fmt: skip
            if picked is not None:
                chosen[row, order] = picked
    else:
        need = snapshot.need_tokens[order]
        chosen[:, order] = greedy_pack_many(gains[:, order], need, grid, snapshot.capacity_tokens)
    totals = np.where(chosen.any(axis=1), (gains * chosen).sum(axis=1), -np.inf)
    best = int(np.argmax(totals))  # the smallest B among equals
    if not np.isfinite(totals[best]):
        return fcfs(snapshot, settings)
    batch, run, gain = int(grid[best]), chosen[best], gains[best]
    run, forced = _within_cap(snapshot, settings, run.copy(), gain / snapshot.need_tokens)
    return Decision(run, int(np.sum(snapshot.running & ~run)), True, batch, forced)


def _within_cap(snapshot: Snapshot, settings: SchedulerSettings, run: np.ndarray,
                priority: np.ndarray) -> Tuple[np.ndarray, int]:  # fmt: skip
    """Optimisation 4: preempt at most as many as keep (preemptions + k) / admitted <= P; the
    highest-priority of the rest stay, and admissions give way (lowest priority first) until the
    batch fits the memory again. Returns the batch and how many preemptions the memory forced past
    the cap (the kept requests alone outgrew M)."""
    leaving = np.flatnonzero(snapshot.running & ~run)
    admitted = snapshot.admitted_total + int(np.sum(run & ~snapshot.ever_run))
    allowed = max(0, int(np.floor(settings.preemption_cap * admitted + 1e-9)) - snapshot.preemptions_total)
    if len(leaving) <= allowed:
        return run, 0
    stay = leaving[np.argsort(-priority[leaving], kind="stable")][: len(leaving) - allowed]
    run[stay] = True
    joining = np.flatnonzero(run & ~snapshot.running)
    for row in joining[np.argsort(priority[joining], kind="stable")]:
        if int(snapshot.need_tokens[run].sum()) <= snapshot.capacity_tokens and int(run.sum()) <= snapshot.max_batch:
            break
        run[row] = False
    if int(snapshot.need_tokens[run].sum()) > snapshot.capacity_tokens:  # the memory forces the rest
        forced = _queue_by(replace(snapshot, running=run), -priority, settings)
        return forced.run, forced.forced
    return run, 0


def andes(snapshot: Snapshot, settings: SchedulerSettings) -> Decision:
    return _andes(snapshot, settings, exact=False)


def andes_dp(snapshot: Snapshot, settings: SchedulerSettings) -> Decision:
    return _andes(snapshot, settings, exact=True)


SCHEDULERS: Dict[str, Callable[[Snapshot, SchedulerSettings], Decision]] = {
    "fcfs": fcfs,
    "rr": round_robin,
    "andes": andes,
    "andes-dp": andes_dp,
    "static": static,
}
