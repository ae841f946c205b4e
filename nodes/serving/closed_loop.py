"""The engine's bookkeeping and scheduler in a closed loop without a model or ranks: requests arrive,
the scheduler decides every iteration, and time moves on by a caller's model of each iteration (a
compute profile's step time, a latency table). Tests check the engine's budgets with it; the
calibration benchmark predicts where a campaign's knee lies before any rank runs."""

from typing import Callable, Dict, List, Sequence

from .engine_state import EngineState, IterationPlan, Key, ServedRequest


def run_closed_loop(state: EngineState, requests: Sequence[ServedRequest],
                    iteration_s: Callable[[IterationPlan], float],
                    max_iterations: int = 2000000) -> Dict[Key, List[float]]:  # fmt: skip
    """Feed ``requests`` to ``state`` at their ``arrival_s``, run iterations until every one has
    finished, each lasting ``iteration_s(plan)`` (called after the decision is applied: it may check
    the state), and deliver one token to every request the iteration computed. Returns the token
    times of each request by key; a RuntimeError if ``max_iterations`` do not finish them."""
    pending = sorted(requests, key=lambda r: r.arrival_s)
    stamps: Dict[Key, List[float]] = {r.key: [] for r in pending}
    now, nxt = 0.0, 0
    for _ in range(max_iterations):
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            state.add(pending[nxt], now)
            nxt += 1
        if not state.live:
            if nxt >= len(pending):
                return stamps
            now = pending[nxt].arrival_s
            continue
        plan = state.apply(state.decide(now), now)
        now += iteration_s(plan)
        for request in plan.compute:
            stamps[request.key].append(now)
            state.delivered(request, 0, now, None)
    raise RuntimeError("%d iterations did not finish %d requests" % (max_iterations, len(pending)))
