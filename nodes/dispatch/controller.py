"""The device's dispatch decisions for each request: where it starts (DiSCo Sec. 4.2 and its
baselines) and whether and when its stream migrates (Sec. 4.3).

A route is two start times: the server's (0, or never) and the device's. The device starts at its
time only if the server has not produced a first token by then; whichever endpoint produces the first
token keeps decoding and the other is cancelled (the race). So:

- ``server-only`` (vLLM in the paper) and ``device-only`` (llama.cpp): one endpoint, always;
- ``stoch-s`` / ``stoch-d``: one endpoint, the constrained one with probability b (Bernoulli per
  request, exclusive: the brief's reading of the paper's Stoch baselines);
- ``disco-s`` (server constrained, Algorithm 3): shorter than l_th on the device alone, else both at 0;
- ``disco-d`` (device constrained, Algorithm 2): the server at 0, the device after W[l].

Migration (Eq. 4, Eq. 5): once the winner streams, the request moves to the other endpoint when the
decode price it saves on the tokens it expects to remain exceeds the target's prefill of prompt and
output so far; it starts once the client's buffer holds B = r_c t_m tokens, t_m the target's
estimated time to be ready.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from nodes.contracts.catalogues import DISPATCH_POLICIES
from nodes.endpoints.device_speed import LinearTtft

from .policy import (
    DEVICE,
    SERVER,
    LengthDistribution,
    LengthThreshold,
    ServerTtft,
    TokenCosts,
    WaitMap,
    length_threshold,
    wait_map,
)

POLICIES = DISPATCH_POLICIES
REGIME_OF = {"stoch-s": SERVER, "disco-s": SERVER, "stoch-d": DEVICE, "disco-d": DEVICE}
NEVER = float("inf")
GENERATION_CAP_TOKENS = 128  # DiSCo App. E: generation capped at 128 tokens


@dataclass(frozen=True)
class DispatchPlan:
    """A policy made concrete for one budget b from the calibration profiles."""

    policy: str
    budget: float
    threshold: Optional[LengthThreshold] = None
    waits: Optional[WaitMap] = None

    def starts(self, prompt_tokens: np.ndarray, draws: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(server start, device start) in seconds for each request (``NEVER`` where it does not
        start); ``draws`` are uniform in [0, 1), one per request (the Stoch coin, the boundary split)."""
        lengths = np.asarray(prompt_tokens)
        n = len(lengths)
        zero, never = np.zeros(n), np.full(n, NEVER)
        if self.policy == "server-only":
            return zero, never
        if self.policy == "device-only":
            return never, zero
        if self.policy == "stoch-s":  # the server (constrained) with probability b
            to_server = draws < self.budget
            return np.where(to_server, 0.0, NEVER), np.where(to_server, NEVER, 0.0)
        if self.policy == "stoch-d":  # the device (constrained) with probability b
            to_device = draws < self.budget
            return np.where(to_device, NEVER, 0.0), np.where(to_device, 0.0, NEVER)
        if self.policy == "disco-s":
            assert self.threshold is not None
            alone = np.array([self.threshold.device_only(int(length), float(draw))
                              for length, draw in zip(lengths, draws)], dtype=bool)  # fmt: skip
            return np.where(alone, NEVER, 0.0), zero
        if self.policy == "disco-d":
            assert self.waits is not None
            return zero, np.array([self.waits.wait_s(int(length)) for length in lengths])
        raise ValueError("unknown dispatch policy %r; known: %s" % (self.policy, ", ".join(POLICIES)))


def plan_dispatch(policy: str, budget: float, lengths: LengthDistribution, ttft: ServerTtft,
                  alpha: float = 0.01) -> DispatchPlan:  # fmt: skip
    """The plan of ``policy`` at budget b (the share of input tokens the constrained endpoint may
    process), from the calibration profiles p(l) and F."""
    if policy not in POLICIES:
        raise ValueError("unknown dispatch policy %r; known: %s" % (policy, ", ".join(POLICIES)))
    if policy == "disco-s":
        return DispatchPlan(policy, budget, threshold=length_threshold(lengths, budget))
    if policy == "disco-d":
        return DispatchPlan(policy, budget, waits=wait_map(lengths, ttft, budget, alpha))
    return DispatchPlan(policy, budget)


@dataclass(frozen=True)
class MigrationRule:
    """When a stream moves to the other endpoint (Eq. 4) and how many tokens the client's buffer
    must hold first (Eq. 5)."""

    costs: TokenCosts
    consumption_tok_s: float  # r_c: the client's display pace
    device_ttft: LinearTtft  # T_d, to estimate a device target's t_m
    server_ttft_median_s: float  # F's median, to estimate a server target's t_m
    remaining_after: np.ndarray  # E[n - g | n > g] for g = 0 .. cap (calibration outputs)
    source_keeps_streaming: bool = True  # Sec. 4.3 / Fig. 4; False: it stops when the migration begins

    @classmethod
    def from_calibration(cls, costs: TokenCosts, consumption_tok_s: float, device_ttft: LinearTtft,
                         server_ttft: ServerTtft, output_tokens: Sequence[int],
                         source_keeps_streaming: bool = True) -> "MigrationRule":  # fmt: skip
        outputs = np.minimum(np.asarray(output_tokens, dtype="int64"), GENERATION_CAP_TOKENS)
        remaining = np.zeros(GENERATION_CAP_TOKENS + 1)
        for g in range(GENERATION_CAP_TOKENS + 1):
            longer = outputs[outputs > g]
            remaining[g] = float(np.mean(longer - g)) if len(longer) else 0.0
        return cls(costs, consumption_tok_s, device_ttft, float(np.median(server_ttft.sorted_s)), remaining,
                   source_keeps_streaming)

    def decode_saving(self, source: str) -> float:
        """Δc_decode: what one token costs less at the other endpoint (negative: it costs more)."""
        if source == SERVER:
            return self.costs.server_decode - self.costs.device_decode
        return self.costs.device_decode - self.costs.server_decode

    def worth_it(self, source: str, prompt_tokens: int, generated: int) -> bool:
        """Eq. 4: Δc_decode x l_remaining > the target's prefill of prompt + generated tokens."""
        saving = self.decode_saving(source)
        if saving <= 0:
            return False
        remaining = self.remaining_after[min(generated, GENERATION_CAP_TOKENS)]
        target_prefill = self.costs.device_prefill if source == SERVER else self.costs.server_prefill
        return saving * remaining > target_prefill * (prompt_tokens + generated)

    def estimated_ready_s(self, source: str, context_tokens) -> np.ndarray:
        """t_m: the target's time to its first token on prompt + generated tokens."""
        if source == SERVER:
            return self.device_ttft.ttft_s(context_tokens)
        return np.full(np.shape(context_tokens), self.server_ttft_median_s)

    def buffer_tokens(self, source: str, context_tokens) -> np.ndarray:
        """Eq. 5: B = r_c x t_m, in whole tokens."""
        return np.ceil(self.consumption_tok_s * self.estimated_ready_s(source, context_tokens))
