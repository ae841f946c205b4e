"""Per-token information density (LLMS Sec. 3.2, Eq. 1), accumulated during every forward pass.

A token's density is the mean of its column of the attention matrix over the rows that can attend to
it (rows at or after it), over query heads and layers; a chunk's is the mean over its tokens. SDPA
does not return attention weights, so a layer whose cache asks for them (``observe_attention``)
computes its attention written out (``Attention.attend_with_weights``) and hands the weights here; the
column sums and the row counts are kept, so that prefill in pieces and decoding steps add up to the
same densities as one pass over the whole sequence.
"""

from typing import List, Sequence

import torch


class DensityTracker(object):
    def __init__(self, capacity: int = 256) -> None:
        self.column_sum = torch.zeros(capacity, dtype=torch.float64)  # sum of A[row, col] over rows, heads, layers
        self.row_count = torch.zeros(capacity, dtype=torch.float64)  # how many (row, head, layer) saw col

    def _grow(self, needed: int) -> None:
        if needed <= self.column_sum.numel():
            return
        size = max(needed, 2 * self.column_sum.numel())
        for name in ("column_sum", "row_count"):
            old = getattr(self, name)
            new = torch.zeros(size, dtype=torch.float64)
            new[: old.numel()] = old
            setattr(self, name, new)

    def observe_weights(self, weights: torch.Tensor, start: int) -> None:
        """Attention weights [heads, n, total] of queries at positions start.. (causal: zero above)."""
        heads, n, total = weights.shape
        visible = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]
        self._grow(total)
        self.column_sum[:total] += weights.sum(dim=(0, 1)).double().cpu()
        self.row_count[:total] += visible.sum(dim=0).double() * heads

    def restore(self, column_sum: Sequence[float], row_count: Sequence[float]) -> None:
        """The sums as a saved context had them (a restarted service)."""
        self._grow(len(column_sum))
        self.column_sum[: len(column_sum)] = torch.tensor(list(column_sum), dtype=torch.float64)
        self.row_count[: len(row_count)] = torch.tensor(list(row_count), dtype=torch.float64)

    def truncate(self, length: int) -> None:
        """Forget what positions from ``length`` on were seen by (and saw): a rolled-back tail."""
        self.column_sum[length:] = 0
        self.row_count[length:] = 0

    def token_density(self, length: int) -> torch.Tensor:
        counts = self.row_count[:length]
        return torch.where(counts > 0, self.column_sum[:length] / counts.clamp(min=1), torch.zeros_like(counts))

    def chunk_density(self, length: int, chunk_tokens: int) -> List[float]:
        """Eq. 1 per chunk of ``chunk_tokens`` (the last may be partial)."""
        tokens = self.token_density(length)
        return [float(tokens[i : i + chunk_tokens].mean()) for i in range(0, length, chunk_tokens)]


def reference_density(attention: Sequence[torch.Tensor]) -> torch.Tensor:
    """Eq. 1's token density from whole attention matrices ([heads, R, R] per layer, causal): for the
    tests, and for a reader who wants the formula in one line."""
    layers = []
    for matrix in attention:
        rows = matrix.shape[-1]
        below = torch.arange(rows, 0, -1, dtype=torch.float64)  # R - col rows see column col
        layers.append((matrix.double().sum(dim=1) / below).mean(dim=0))
    return torch.stack(layers).mean(dim=0)
