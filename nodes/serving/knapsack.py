"""Which requests to serve under a batch size B and a KV capacity of M tokens (Andes Eq. 4):
maximise the summed gain q_i over a selection with sum(x) = B and sum(l_i x_i) <= M.

- ``greedy_pack``: Algorithm 1, by Eq. 5's priority q_i / l_i, stopping at the first request that
  does not fit (the paper's ``break``: it may select fewer than B); ``greedy_pack_many`` for several
  batch sizes in one pass;
- ``exact_pack``: Algorithm 2's dynamic programme, exact, memory counted in blocks (1 token a block is
  Eq. 4 exactly; vLLM allocates KV in blocks of 16);
- ``largest_batch``: B_max, the most requests that fit at once (the shortest first).
"""

from typing import Optional

import numpy as np


def greedy_pack(gains: np.ndarray, lengths: np.ndarray, batch: int, capacity_tokens: int) -> np.ndarray:
    """Algorithm 1: take requests in descending q_i / l_i (Eq. 5) while both the batch and the memory
    have room; the first that does not fit ends the packing. Returns the selection as a bool mask."""
    return greedy_pack_many(np.asarray(gains, dtype="float64")[None, :], lengths, np.array([batch]), capacity_tokens)[0]


def greedy_pack_many(gains: np.ndarray, lengths: np.ndarray, batches: np.ndarray, capacity_tokens: int) -> np.ndarray:
    """Algorithm 1 for several batch sizes at once: row g packs ``gains[g]`` (one gain per request)
    into ``batches[g]`` requests; a bool mask per row. Ties keep the caller's order (oldest first)."""
    lengths = np.asarray(lengths, dtype="int64")
    if np.any(lengths < 1):
        raise ValueError("every request holds at least one token")
    priority = np.asarray(gains, dtype="float64") / lengths
    order = np.argsort(-priority, axis=1, kind="stable")
    used = np.cumsum(lengths[order], axis=1)
    taken = np.minimum(np.maximum(np.asarray(batches), 0), (used <= capacity_tokens).sum(axis=1))
    chosen = np.zeros(priority.shape, dtype=bool)
    np.put_along_axis(chosen, order, np.arange(priority.shape[1])[None, :] < taken[:, None], axis=1)
    return chosen


def exact_pack(gains: np.ndarray, lengths: np.ndarray, batch: int, capacity_tokens: int,
               block_tokens: int = 1) -> Optional[np.ndarray]:  # fmt: skip
    """Algorithm 2: the selection of exactly ``batch`` requests whose blocks (ceil(l / block_tokens)) fit
    in capacity_tokens // block_tokens blocks and whose summed gain is largest; None if none fits.

    dp[b][m] is the best gain of b requests within m blocks over the requests seen so far
    (dp[i][b][m] = max(dp[i-1][b][m], dp[i-1][b-1][m - l_i] + q_i)); O(N B M) time, O(N B M) bits to
    trace the choice back."""
    q = np.asarray(gains, dtype="float64")
    blocks = -(-np.asarray(lengths, dtype="int64") // block_tokens)
    if np.any(blocks < 1):
        raise ValueError("every request holds at least one token")
    capacity = capacity_tokens // block_tokens
    if batch < 0 or batch > len(q):
        return None
    best = np.full((batch + 1, capacity + 1), -np.inf)
    best[0, :] = 0.0  # nothing chosen fits anywhere
    took = np.zeros((len(q), batch + 1, capacity + 1), dtype=bool)
    for i, (gain, size) in enumerate(zip(q, blocks)):
        if size > capacity:
            continue
        with_it = np.full_like(best, -np.inf)
        with_it[1:, size:] = best[:-1, : capacity + 1 - size] + gain
        better = with_it > best
        took[i] = better
        best = np.where(better, with_it, best)
    if not np.isfinite(best[batch, capacity]):
        return None
    chosen = np.zeros(len(q), dtype=bool)
    b, m = batch, capacity
    for i in range(len(q) - 1, -1, -1):
        if took[i, b, m]:
            chosen[i] = True
            b, m = b - 1, m - int(blocks[i])
    return chosen


def largest_batch(lengths: np.ndarray, capacity_tokens: int) -> int:
    """B_max: how many requests fit in the memory at once, adding the shortest first."""
    used = np.cumsum(np.sort(np.asarray(lengths, dtype="int64")))
    return int(np.searchsorted(used, capacity_tokens, side="right"))
