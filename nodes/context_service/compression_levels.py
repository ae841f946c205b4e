"""Tolerance-aware compression levels (LLMS Sec. 3.2, Eq. 2-3): which chunks keep 8 bits and which go to 4
or 2, given each chunk's information density D_i (Eq. 1) and a global average ratio.

Levels are ratios over the INT8 baseline: 8/8, 4/8 and 2/8. Chunks are ranked by density (Eq. 2: a
threshold per level on the rank); the densest keep the most bits. The thresholds weigh each chunk's
density by Eq. 3's printed 1/ratio_w and *minimise* that sum, subject to the average ratio staying at or
under ``ratio_global``: Eq. 3 as we read it. Maximising it as printed would send the densest chunks to 2
bits, against the text's rationale; maximising sum ratio_w x D_i instead (our earlier reading) is linear
in the ratio, so its optimum sits at the extremes (densest 8 bits, nearly all the rest 2) and it lost
more perplexity than uniform INT4 on SmolLM2 (measured once and retired; Fig. 12 in
docs/reproductions/llms.md sets the reading kept against uniform INT4). 1/ratio_w is convex: a chunk
goes from 4 to 8 bits only when its density exceeds twice that of the two chunks that pay for it by
going to 2 bits (D_8 > 2 x (D_2 + D_2')), which is the text's "a conservative compression to all chunks
first, then the tolerant ones aggressively". With three levels and integer chunk counts the optimum is
found by enumerating how many chunks keep 8 bits and how many go to 2 (O(n^2) with prefix sums). Levels
only move down: a chunk already at a level below its plan stays there.
"""

from typing import Dict, List, Optional, Sequence, Tuple

BITS = (8, 4, 2)  # the levels, densest first
BASELINE_BITS = 8


def ratio_of(bits: int) -> float:
    return bits / float(BASELINE_BITS)


def plan_levels(densities: Sequence[float], ratio_global: float = 0.5,
                current: Optional[Sequence[int]] = None) -> List[int]:  # fmt: skip
    """Bits per chunk (same order as ``densities``) minimising sum(D / ratio) (Eq. 3 as we read it) with
    mean ratio <= ``ratio_global``. ``current`` (bits a chunk holds now) caps each chunk: levels never go up."""
    n = len(densities)
    if n == 0:
        return []
    if not 0.25 <= ratio_global <= 1.0:
        raise ValueError("ratio_global %.3f: between 0.25 (all 2 bits) and 1 (all 8 bits)" % ratio_global)
    order = sorted(range(n), key=lambda i: (-densities[i], i))  # densest first; ties by position
    ranked = [float(densities[i]) for i in order]
    prefix = [0.0]
    for d in ranked:
        prefix.append(prefix[-1] + d)
    budget = ratio_global * n + 1e-9  # sum of ratios allowed
    best: Tuple[float, int, int] = (float("inf"), 0, n)
    for n8 in range(n + 1):
        for n2 in range(n - n8 + 1):
            n4 = n - n8 - n2
            if n8 * ratio_of(8) + n4 * ratio_of(4) + n2 * ratio_of(2) > budget:
                continue
            lost = (prefix[n8] / ratio_of(8) + (prefix[n8 + n4] - prefix[n8]) / ratio_of(4)
                    + (prefix[n] - prefix[n8 + n4]) / ratio_of(2))  # fmt: skip
            if lost < best[0] - 1e-12:
                best = (lost, n8, n2)
            break  # for this n8 the fewest 2-bit chunks that fit is the best (more 2s only lose)
    _, n8, n2 = best
    bits = [0] * n
    for rank, i in enumerate(order):
        bits[i] = 8 if rank < n8 else (4 if rank < n - n2 else 2)
    if current is not None:
        bits = [min(b, c) for b, c in zip(bits, current)]
    return bits


def weighted_density(densities: Sequence[float], bits: Sequence[int]) -> float:
    """Eq. 3's sum over chunks of D_i / ratio_w, the quantity :func:`plan_levels` minimises."""
    return sum(d / ratio_of(b) for b, d in zip(bits, densities))


def level_counts(bits: Sequence[int]) -> Dict[int, int]:
    return {b: sum(1 for x in bits if x == b) for b in BITS}
