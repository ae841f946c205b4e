"""Andes' QoE (Eq. 1) as the server sees it, and its prediction over a lookahead (Eq. 2).

The server keeps a shadow of each client's token buffer: ``delivered`` tokens sent, ``digested``
tokens the user has taken in (the buffer shows them at the request's expected speed s = TDS_exp and
never ahead of delivery: a(t) = min(a(t0) + s (t - t0), n)), and the area under the digested curve
since the request arrived. Eq. 1's QoE at a time h after arrival is that area over the expected
curve's, T(t) = s (t - TTFT_exp) after TTFT_exp and 0 before, integrated over [0, h] with the response
length taken as unbounded because the server does not know it (brief: pitfall 5), capped at 1.

Eq. 2 needs each request's QoE a lookahead later if it is served and if it is not. Served, it gets
its next tokens after a delay d (its prefill, or bringing back its KV) at r = 1/latency(B) tokens/s;
not served, it gets none (r = 0). In both cases the digested curve from now is
A(tau) = min(a + s tau, n + min(r, s) max(0, tau - d)), integrated exactly below.
"""

from typing import Union

import numpy as np

ArrayLike = Union[float, np.ndarray]


class BufferShadow:
    """One request's client buffer, advanced event by event on the server's clock (seconds since the
    request arrived)."""

    __slots__ = ("at_s", "delivered", "digested", "digested_area", "expected_tds", "expected_ttft_s")

    def __init__(self, expected_ttft_s: float, expected_tds: float) -> None:
        if not expected_tds > 0:
            raise ValueError(f"the expected token delivery speed must be positive, not {expected_tds}")
        self.expected_ttft_s, self.expected_tds = float(expected_ttft_s), float(expected_tds)
        self.delivered = 0
        self.digested = 0.0
        self.digested_area = 0.0  # integral of the digested curve from arrival to at_s, token-seconds
        self.at_s = 0.0

    def advance(self, since_arrival_s: float) -> None:
        """Let the user read on until ``since_arrival_s``: the buffer drains at the expected speed."""
        tau = since_arrival_s - self.at_s
        if tau <= 0:
            return
        a, n, s = self.digested, float(self.delivered), self.expected_tds
        dry = min(tau, (n - a) / s)  # the user reads until the buffer is empty, then waits (plain floats:
        self.digested_area += a * dry + 0.5 * s * dry * dry + n * (tau - dry)  # this runs per request per step)
        self.digested = min(a + s * tau, n)
        self.at_s = since_arrival_s

    def deliver(self, since_arrival_s: float, tokens: int = 1) -> None:
        """Tokens reached the client at ``since_arrival_s``."""
        self.advance(since_arrival_s)
        self.delivered += tokens

    def qoe(self, since_arrival_s: float) -> float:
        """Eq. 1 at ``since_arrival_s`` (the response length unbounded)."""
        return float(predicted_qoe(self.digested, self.delivered, self.digested_area, self.expected_ttft_s,
                                   self.expected_tds, self.at_s, since_arrival_s - self.at_s, 0.0, 0.0))  # fmt: skip


def expected_area(expected_ttft_s: ArrayLike, expected_tds: ArrayLike, since_arrival_s: ArrayLike) -> ArrayLike:
    """Area under Eq. 1's expected curve T(t) = s (t - TTFT_exp)+ over [0, since_arrival_s]."""
    late = np.maximum(0.0, np.asarray(since_arrival_s, dtype="float64") - expected_ttft_s)
    return 0.5 * np.asarray(expected_tds, dtype="float64") * late * late


def future_digested_area(digested: ArrayLike, delivered: ArrayLike, expected_tds: ArrayLike, rate_tok_s: ArrayLike,
                         delay_s: ArrayLike, lookahead_s: ArrayLike) -> np.ndarray:  # fmt: skip
    """Integral over [0, lookahead] of A(tau) = min(a + s tau, n + q max(0, tau - d)), q = min(r, s).

    a <= n, so a + s tau starts at or below the delivery curve and, rising at least as fast, crosses it
    once, at tau_c; A follows the user's reading before tau_c and the deliveries after."""
    given = (digested, delivered, expected_tds, rate_tok_s, delay_s, lookahead_s)
    a, n, s, r, d, h = np.broadcast_arrays(*(np.asarray(x, dtype="float64") for x in given))
    q = np.minimum(r, s)
    gap = n - a  # tokens in the buffer, unread
    with np.errstate(divide="ignore", invalid="ignore"):
        reads_dry_before_delay = a + s * d >= n
        crossing = np.where(reads_dry_before_delay, gap / s,
                            np.where(q < s, d + (n - a - s * d) / (s - q), np.inf))  # fmt: skip
    crossing = np.where(gap <= 0, 0.0, crossing)
    y = np.minimum(crossing, h)
    reading = a * y + 0.5 * s * y * y
    after_delay_end = np.maximum(0.0, h - d)
    after_delay_start = np.maximum(0.0, y - d)
    following = n * (h - y) + 0.5 * q * (after_delay_end**2 - after_delay_start**2)
    return reading + np.where(y < h, following, 0.0)


def predicted_qoe(digested: ArrayLike, delivered: ArrayLike, digested_area: ArrayLike, expected_ttft_s: ArrayLike,
                  expected_tds: ArrayLike, since_arrival_s: ArrayLike, lookahead_s: ArrayLike, rate_tok_s: ArrayLike,
                  delay_s: ArrayLike) -> np.ndarray:  # fmt: skip
    """Eq. 1 a lookahead from now if tokens come at ``rate_tok_s`` after ``delay_s`` (0: not served),
    from the shadow's state now (``since_arrival_s`` after arrival). 1 while nothing is expected yet."""
    actual = np.asarray(digested_area, dtype="float64") + future_digested_area(
        digested, delivered, expected_tds, rate_tok_s, delay_s, lookahead_s)
    expected = expected_area(expected_ttft_s, expected_tds, np.asarray(since_arrival_s, dtype="float64") + lookahead_s)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(expected > 0, np.minimum(1.0, actual / expected), 1.0)
