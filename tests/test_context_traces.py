"""LLMS's traces: Poisson calls, Table 3's context growth per task, and the three switching patterns."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from foundation.errors import TestbedError
from workloads.context_traces import TASK_DELTAS, context_trace


def _reuse_distance(trace) -> list[int]:
    """For each call after the first few: how many distinct other contexts were used since its last call."""
    recency: list[int] = []
    out = []
    for call in trace:
        if call.context in recency:
            out.append(recency.index(call.context))
            recency.remove(call.context)
        recency.insert(0, call.context)
    return out


def test_calls_are_poisson_and_grow_their_contexts_by_their_tasks_ranges() -> None:
    trace = context_trace(6, 3000, "random", mean_gap_s=300.0, seed=1)
    gaps = np.diff([0.0] + [c.time_s for c in trace])
    assert gaps.mean() == pytest.approx(300.0, rel=0.06) and np.std(gaps) == pytest.approx(300.0, rel=0.08)
    for call in trace:
        low, high = TASK_DELTAS[call.task]
        assert low <= call.prompt_tokens + call.output_tokens <= high + 1
        assert call.task == list(TASK_DELTAS)[call.context % len(TASK_DELTAS)]
    counts = Counter(c.context for c in trace)
    assert min(counts.values()) > 0.8 * 3000 / 6  # uniform


def test_markov_favours_recent_contexts_and_gaussian_moderate_ones() -> None:
    markov = Counter(_reuse_distance(context_trace(8, 4000, "markov", seed=2)))
    gaussian = Counter(_reuse_distance(context_trace(8, 4000, "gaussian", seed=2)))
    uniform = Counter(_reuse_distance(context_trace(8, 4000, "random", seed=2)))
    assert markov[0] > 0.4 * sum(markov.values()) and markov[0] > 2 * uniform[0]  # P(most recent) ~ 1/2
    middle = gaussian[3] + gaussian[4]
    assert middle > gaussian[0] + gaussian[7] and middle > uniform[3] + uniform[4]


def test_a_bounded_context_is_never_overfilled_and_bad_settings_are_refused() -> None:
    trace = context_trace(3, 200, "random", tasks=("xsum",), max_context_tokens=4096, seed=3)
    sizes: Counter = Counter()
    for call in trace:
        if call.restart:
            sizes[call.context] = 0
        sizes[call.context] += call.prompt_tokens + call.output_tokens
        assert sizes[call.context] <= 4096
    assert sum(c.restart for c in trace) > 0  # xsum fills 4K in a few calls
    with pytest.raises(TestbedError, match="one of random"):
        context_trace(3, 10, "zipf")
    with pytest.raises(TestbedError, match="task 'imdb'"):
        context_trace(3, 10, tasks=("imdb",))
