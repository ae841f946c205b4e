"""How big HAT's device makes a prompt chunk (Eq. 3) and how many parallel draft steps it takes (Eq. 6).

Both compare the device's transfer time with the server's predicted compute:

    X_i * A / beta_up = (g(mu) + g(mu + X_i)) / P                                        (Eq. 3)
    lambda_i = floor((mu_i * A / beta_up + g(mu) + mu_i * A / beta_down) / gamma_i)        (Eq. 6)

A is the bytes of one token's hidden state, g the server's delay predictor and mu its moving batch
size (sent back with every reply, ``state_monitor.ServerState``), P the pipeline length, mu_i the
tokens of the draft being verified, gamma_i one draft step's delay on the device.

The device has no clock in common with the server, so it cannot tell the uplink's time from the
downlink's: ``LinkEstimator`` relates a round trip's network time (round trip minus the server's
residence, which the server reports) to the bytes it moved, and the same seconds-per-byte stands
for 1/beta_up and 1/beta_down.
"""

import math
from typing import Optional

from .state_monitor import ALPHA, ServerState

MIN_CHUNK_TOKENS = 16  # below this a chunk's fixed costs (headers, an iteration) outweigh the overlap
# a round trip that moved fewer bytes than this says little of the rate: a link lets a few ms of its rate
# through at once (a shaper's burst, WiFi's frame aggregation), so such messages cross in about no time
# and their slope against bytes made a 19 Mbit/s link look like 8 Gbit/s to HAT's decode rounds
MIN_MEASURED_BYTES = 64 * 1024


class MovingAverage:
    """x_t = alpha * x_(t-1) + (1 - alpha) * sample (the moving average of HAT's Eq. 1-2)."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha, self.value = alpha, None  # type: float, Optional[float]

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * self.value + (1 - self.alpha) * sample
        return self.value


class LinkEstimator:
    """Seconds per byte of the device's link, from round trips (``observe``).

    A message's network time is latency + bytes x seconds-per-byte. So the rate is the slope of an
    exponentially weighted least-squares fit of time against bytes (weights decay by ``alpha`` per
    observation, as Eq. 1-2 do), and bytes over time of the messages seen while their sizes do not
    yet spread enough to fit a line. Messages under :data:`MIN_MEASURED_BYTES` are not observed.
    """

    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._ratio = MovingAverage(alpha)

    def observe(self, nbytes: int, network_s: float) -> None:
        if nbytes < MIN_MEASURED_BYTES or network_s <= 0:
            return
        a = self.alpha
        self._w, self._x, self._y = a * self._w + 1, a * self._x + nbytes, a * self._y + network_s
        self._xx, self._xy = a * self._xx + nbytes * nbytes, a * self._xy + nbytes * network_s
        self._ratio.update(network_s / nbytes)

    @property
    def s_per_byte(self) -> Optional[float]:
        if self._ratio.value is None:
            return None
        mean_x = self._x / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread > (0.25 * mean_x) ** 2:  # sizes differ by enough to separate slope from intercept
            slope = (self._xy / self._w - mean_x * self._y / self._w) / spread
            if slope > 0:
                return slope
        return self._ratio.value

    def rate_mbit(self) -> Optional[float]:
        s = self.s_per_byte
        return None if not s else 8e-6 / s


def chunk_tokens_eq3(
    remaining: int, bytes_per_token: int, s_per_byte: Optional[float], server: Optional[ServerState], fallback: int
) -> int:
    """X_i of Eq. 3: the smallest chunk whose upload takes as long as the server's compute of the
    previous and this chunk over P stages, so that uploading chunk j+1 hides behind computing chunk j.

    When the upload of the rest is faster than its compute for every X (no crossing), the rest goes
    in one piece; before any measurement (no rate or no server state yet) chunks are ``fallback``.
    """
    if remaining <= 0:
        return 0
    if s_per_byte is None or server is None or server.g_s(1) is None:
        return min(remaining, max(1, fallback))
    g_now = server.g_s(server.mu) or 0.0
    for x in range(min(MIN_CHUNK_TOKENS, remaining), remaining + 1):
        upload_s = x * bytes_per_token * s_per_byte
        if upload_s >= (g_now + (server.g_s(server.mu + x) or 0.0)) / server.stages:
            return x
    return remaining


def parallel_steps_eq6(
    draft_tokens: int, bytes_per_token: int, s_per_byte: Optional[float], server: Optional[ServerState],
    step_s: Optional[float], cap: int,
) -> int:  # fmt: skip
    """lambda_i of Eq. 6: the draft steps that fit in one verification (upload, compute, download),
    at most ``cap``; 0 before the device has measured its link, its draft step and the server."""
    if s_per_byte is None or server is None or not step_s:
        return 0
    g_now = server.g_s(server.mu)
    if g_now is None:
        return 0
    transfer_s = 2 * draft_tokens * bytes_per_token * s_per_byte
    return max(0, min(cap, math.floor((transfer_s + g_now) / step_s)))
