"""HAT's state monitoring (Sec. 3.2): moving averages of the server's load and a delay predictor.

mu_t = alpha * mu_(t-1) + (1 - alpha) * mu_hat_t                       (Eq. 1)
g_t(mu) = alpha * g_(t-1)(mu) + (1 - alpha) * eta_hat_t                 (Eq. 2)

mu is the batched token size of an iteration, eta its compute delay. g is kept as a table over
token-size buckets (powers of two), each updated by Eq. 2 with the delays observed at that size;
between observed buckets g interpolates linearly in the token count, and beyond the largest it
extrapolates with the per-token slope of the two largest.
"""

import math
from typing import Dict, List, Optional, Sequence

ALPHA = 0.8


def bucket_of(tokens: int) -> int:
    """The power of two at or above ``tokens`` (1, 2, 4, ...)."""
    return 1 << max(0, math.ceil(math.log2(max(1, tokens))))


class StateMonitor:
    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError("alpha must lie in [0, 1]")
        self.alpha = alpha
        self.mu: Optional[float] = None
        self._delay_s: Dict[int, float] = {}

    def observe(self, batched_tokens: int, compute_s: float) -> None:
        """Record one iteration (Eq. 1 for mu, Eq. 2 for g at this batch size's bucket)."""
        a = self.alpha
        self.mu = batched_tokens if self.mu is None else a * self.mu + (1 - a) * batched_tokens
        bucket = bucket_of(batched_tokens)
        previous = self._delay_s.get(bucket)
        self._delay_s[bucket] = compute_s if previous is None else a * previous + (1 - a) * compute_s

    def predict_s(self, tokens: int) -> Optional[float]:
        """g(tokens): the predicted compute delay of an iteration of ``tokens`` tokens (None before any)."""
        if not self._delay_s:
            return None
        points = sorted(self._delay_s.items())
        if len(points) == 1:
            size, delay = points[0]
            return delay * max(1, tokens) / size if tokens > size else delay
        if tokens <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (tokens - x1)

    def snapshot(self) -> Dict[str, float]:
        return {"mu_tokens": self.mu or 0.0, **{"g_%d_s" % k: v for k, v in sorted(self._delay_s.items())}}

    @classmethod
    def from_delays(cls, delays_s: Dict[int, float], alpha: float = ALPHA) -> "StateMonitor":
        """A monitor whose g table is ``delays_s`` (bucket -> seconds), as another process kept it."""
        monitor = cls(alpha)
        monitor._delay_s = dict(delays_s)
        return monitor

    def to_vector(self, stages: int) -> List[float]:
        """[mu, P, bucket_1, g_1, ..., bucket_B, g_B]: the STATE segment's payload (see ``wire``)."""
        out = [float(self.mu or 0.0), float(stages)]
        for bucket, delay in sorted(self._delay_s.items()):
            out += [float(bucket), delay]
        return out


class ServerState:
    """What a device knows of the server from its last reply: mu and g (the whole middle model's delay,
    i.e. P times one stage's, as Eq. 3 divides by P)."""

    def __init__(self, values: Sequence[float]) -> None:
        if len(values) < 2 or len(values) % 2:
            raise ValueError(
                "a server state vector has mu, P, then (tokens, seconds) pairs; got %d values" % len(values)
            )
        self.mu = float(values[0])
        self.stages = max(1, round(values[1]))
        pairs = range(2, len(values), 2)
        self._stage = StateMonitor.from_delays({round(values[i]): float(values[i + 1]) for i in pairs})

    def g_s(self, tokens: float) -> Optional[float]:
        """g(tokens): predicted delay of the whole middle model for an iteration of ``tokens`` tokens."""
        per_stage = self._stage.predict_s(math.ceil(tokens))
        return None if per_stage is None else per_stage * self.stages
