"""DiSCo's dispatch policy (Sec. 4.2, Algorithms 1-3, App. F), computed from profiles:

- ``constrained_endpoint``: Algorithm 1. The device is the constrained endpoint when its cheapest
  token costs more than the server's dearest; otherwise the server is.
- ``wait_map``: Algorithm 2 (DiSCo-D, the device constrained). Every request goes to the server at
  once; the device starts on it after a wait W[l] that depends on the prompt length l, and only if
  the server has not produced a first token by then. Every length waits at most w_tail =
  F^-1(1 - min(alpha, b)) (tail protection); the budget left over makes the shortest prompts start on
  the device at once, and the first length it does not cover in full gets the wait that spends it.
- ``length_threshold``: Algorithm 3 / Eq. 3 (DiSCo-S, the server constrained). Prompts shorter than
  l_th run on the device alone; longer ones race on both. l_th solves
  sum_{l < l_th} l p(l) = (1 - b) E[l]; the boundary length is split at random so that b holds exactly.

The budget b is the share of all input tokens that the constrained endpoint may process (the brief's
reading of Sec. 5.1). F is the server's TTFT distribution and p(l) the prompt-length distribution,
both profiled on a calibration split, never on the requests being evaluated.
"""

from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEVICE, SERVER = "device", "server"


@dataclass(frozen=True)
class TokenCosts:
    """Per-token costs in one currency: the server's API prices, the device's energy times lambda."""

    server_prefill: float
    server_decode: float
    device_prefill: float
    device_decode: float


def constrained_endpoint(costs: TokenCosts) -> str:
    """Algorithm 1: ``"device"`` if min(c_d^p, c_d^d) > max(c_s^p, c_s^d), else ``"server"``."""
    cheapest_device = min(costs.device_prefill, costs.device_decode)
    return DEVICE if cheapest_device > max(costs.server_prefill, costs.server_decode) else SERVER


def _budget(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError("the budget is a share of input tokens, within [0, 1], not %r" % (value,))
    return float(value)


@dataclass(frozen=True)
class LengthDistribution:
    """p(l): distinct prompt lengths (tokens, ascending) and their probabilities."""

    lengths: np.ndarray
    probabilities: np.ndarray

    @classmethod
    def from_samples(cls, lengths_tokens: Sequence[int]) -> "LengthDistribution":
        values, counts = np.unique(np.asarray(lengths_tokens, dtype="int64"), return_counts=True)
        if not len(values) or values[0] < 1:
            raise ValueError("prompt lengths must be at least 1 token, and there must be some")
        return cls(values, counts / counts.sum())

    def token_shares(self) -> np.ndarray:
        """Each length's share of all input tokens, l p(l) / E[l] (they sum to 1)."""
        weights = self.lengths * self.probabilities
        return weights / weights.sum()


@dataclass(frozen=True)
class ServerTtft:
    """F: the server's empirical TTFT distribution (seconds)."""

    sorted_s: np.ndarray

    @classmethod
    def from_samples(cls, ttft_s: Sequence[float]) -> "ServerTtft":
        values = np.sort(np.asarray(ttft_s, dtype="float64"))
        if not len(values) or not np.all(np.isfinite(values)) or values[0] < 0:
            raise ValueError("server TTFT samples must be finite, non-negative seconds, and there must be some")
        return cls(values)

    def cdf(self, wait_s: np.ndarray) -> np.ndarray:
        """F(w): the share of samples at or below w."""
        return np.searchsorted(self.sorted_s, wait_s, side="right") / len(self.sorted_s)

    def quantile_s(self, share: float) -> float:
        """F^-1(q): the smallest sample w with F(w) >= q (0 for q <= 0)."""
        if share <= 0:
            return 0.0
        rank = int(np.ceil(min(share, 1.0) * len(self.sorted_s))) - 1
        return float(self.sorted_s[max(rank, 0)])


@dataclass(frozen=True)
class WaitMap:
    """DiSCo-D's plan: W[l], the device's wait before it starts on a prompt of length l."""

    lengths: np.ndarray
    waits_s: np.ndarray
    tail_wait_s: float

    def wait_s(self, length_tokens: int) -> float:
        """The wait of the first tabulated length at or above ``length_tokens`` (never shorter than a
        shorter prompt's); w_tail beyond the table."""
        at = int(np.searchsorted(self.lengths, length_tokens, side="left"))
        return float(self.waits_s[at]) if at < len(self.lengths) else self.tail_wait_s

    def device_share(self, lengths: LengthDistribution, ttft: ServerTtft) -> float:
        """The expected share of input tokens the device processes: sum l p(l) (1 - F(W[l])) / E[l]."""
        waits = np.array([self.wait_s(int(length)) for length in lengths.lengths])
        return float(np.sum(lengths.token_shares() * (1.0 - ttft.cdf(waits))))


def wait_map(lengths: LengthDistribution, ttft: ServerTtft, budget: float, alpha: float = 0.01) -> WaitMap:
    """Algorithm 2: the device-constrained wait map for a device budget b and tail ratio alpha.

    Every length starts at w_tail = F^-1(1 - min(alpha, b)), which costs the device the share
    1 - F(w_tail) of every length's tokens. What is left of b goes to the shortest lengths first:
    starting at once costs a length its token share times F(w_tail) more; the first length that the
    rest cannot cover gets w* with l p(l) (1 - F(w*)) / E[l] = its base cost plus the rest."""
    b = _budget(budget)
    if not 0.0 < alpha < 1.0:
        raise ValueError("the tail ratio alpha must be within (0, 1), not %r" % (alpha,))
    tail = ttft.quantile_s(1.0 - min(alpha, b))
    waits = np.full(len(lengths.lengths), tail)
    base = 1.0 - float(ttft.cdf(np.array([tail]))[0])  # the share every length already spends at w_tail
    available = b - base
    if b <= alpha or available <= 0:
        return WaitMap(lengths.lengths, waits, tail)
    shares = lengths.token_shares()
    extra = shares * (1.0 - base)  # what starting at once adds, per length, shortest first
    spent = np.cumsum(extra)
    covered = int(np.searchsorted(spent, available + 1e-12, side="right"))
    waits[:covered] = 0.0
    if covered < len(waits):
        rest = available - (float(spent[covered - 1]) if covered else 0.0)
        waits[covered] = ttft.quantile_s(1.0 - (base + rest / shares[covered]))
    return WaitMap(lengths.lengths, waits, tail)


@dataclass(frozen=True)
class LengthThreshold:
    """DiSCo-S's plan: prompts shorter than ``length_tokens`` run on the device alone, longer ones
    race on both; one of exactly ``length_tokens`` runs on the device alone with probability
    ``boundary_device_only``."""

    length_tokens: int
    boundary_device_only: float

    def device_only(self, length_tokens: int, draw: float) -> bool:
        """Whether a prompt of this length skips the server; ``draw`` is uniform in [0, 1)."""
        if length_tokens != self.length_tokens:
            return length_tokens < self.length_tokens
        return draw < self.boundary_device_only

    def server_share(self, lengths: LengthDistribution) -> float:
        """The expected share of input tokens sent to the server."""
        shares = lengths.token_shares()
        above = float(shares[lengths.lengths > self.length_tokens].sum())
        boundary = float(shares[lengths.lengths == self.length_tokens].sum())
        return above + boundary * (1.0 - self.boundary_device_only)


def length_threshold(lengths: LengthDistribution, budget: float) -> LengthThreshold:
    """Algorithm 3 (Eq. 3): the threshold whose shorter prompts hold 1 - b of the input tokens."""
    device_part = 1.0 - _budget(budget)
    shares = lengths.token_shares()
    before = np.concatenate(([0.0], np.cumsum(shares)[:-1]))
    at = int(np.searchsorted(before + shares, device_part - 1e-12, side="left"))
    at = min(at, len(shares) - 1)
    boundary = min(1.0, max(0.0, (device_part - before[at]) / shares[at]))
    return LengthThreshold(int(lengths.lengths[at]), boundary)
