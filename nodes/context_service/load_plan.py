"""The swapping-recompute plan of a Load (LLMS Sec. 3.3, Eq. 4): of the missing chunks, which to read
from disk and which to recompute from the context's text, so that the slower of the two, running side
by side, finishes first.

T_re(x) = a x + b is the recompute time of x chunks (one pass over every layer, whatever their
compression), T_IO(m) = a m + b the read time of m bytes; both are fitted at install time (intercepts
included, and zero when nothing is done). Recomputing a chunk costs the same time whatever its level
and saves the read of its bytes, so for any count of recomputed chunks the heaviest are the ones to
recompute: the plan enumerates that count (the small LP's optimum is on this greedy path).
"""

from typing import List, NamedTuple, Sequence


class LinearCost(NamedTuple):
    """seconds = per_unit_s x units + fixed_s (units > 0), 0 for nothing."""

    per_unit_s: float
    fixed_s: float

    def seconds(self, units: float) -> float:
        return self.per_unit_s * units + self.fixed_s if units > 0 else 0.0


class LoadPlan(NamedTuple):
    recompute: List[int]  # indices into the missing chunks
    read: List[int]
    recompute_s: float  # T_re of the recomputed chunks
    read_s: float  # T_IO of the read bytes
    bytes_read: int

    @property
    def delay_s(self) -> float:
        """Eq. 4's pipelineDelay: the two run side by side."""
        return max(self.recompute_s, self.read_s)


def plan_load(chunk_bytes: Sequence[int], recompute: LinearCost, read: LinearCost,
              allow_recompute: bool = True) -> LoadPlan:  # fmt: skip
    """The plan minimising max(T_re, T_IO) over the missing chunks of ``chunk_bytes`` (their sizes on
    disk). ``allow_recompute=False`` reads everything (the ablation without the pipeline)."""
    order = sorted(range(len(chunk_bytes)), key=lambda i: (-chunk_bytes[i], i))  # heaviest first
    total = sum(chunk_bytes)
    best = None
    saved = 0
    for k in range(len(order) + 1 if allow_recompute else 1):
        if k:
            saved += chunk_bytes[order[k - 1]]
        plan = (recompute.seconds(k), read.seconds(total - saved), k)
        if best is None or max(plan[0], plan[1]) < max(best[0], best[1]) - 1e-15:
            best = plan
    assert best is not None
    k = best[2]
    chosen = sorted(order[:k])
    rest = sorted(order[k:])
    return LoadPlan(chosen, rest, best[0], best[1], total - sum(chunk_bytes[i] for i in chosen))
