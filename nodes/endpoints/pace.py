"""When an endpoint's tokens are due: the first after TTFT, each next one a gap later.

- ``DevicePace``: a phone at its measured rates (DiSCo Sec. 5.1): TTFT = c + l / prefill rate, one
  token every 1 / decode rate.
- ``TracePace``: a service's TTFT and inter-token distributions (``nodes.endpoints.services``), drawn
  per request from one seeded stream, so a run's server behaviour is reproducible.
- ``ComputePace``: no target: tokens as fast as the checkpoint computes them (measured, not modeled).
"""

import threading
from typing import Optional

import numpy as np

from nodes.endpoints.device_speed import DeviceSpeed
from nodes.endpoints.services import ServiceModel


class Pace(object):
    """A request's schedule; ``modeled`` says whether its times are the target's."""

    modeled = True
    label = ""

    def first_token_s(self, prompt_tokens: int) -> float:
        raise NotImplementedError

    def gap_s(self) -> float:
        raise NotImplementedError

    def seeded(self, seed: int) -> "Pace":
        """The pace of one request that names its own random stream (the API's ``seed``): its draws
        are then reproducible whatever the order requests arrive in."""
        return self


class ComputePace(Pace):
    modeled = False
    label = "compute"

    def first_token_s(self, prompt_tokens: int) -> float:
        return 0.0

    def gap_s(self) -> float:
        return 0.0


class EnginePace(Pace):
    """A serving engine keeps its own time (its scheduler, and the server's profile when the run has a
    target): the endpoint adds none."""

    def __init__(self, scheduler: str, modeled: bool) -> None:
        self.label, self.modeled = "engine:" + scheduler, modeled

    def first_token_s(self, prompt_tokens: int) -> float:
        return 0.0

    def gap_s(self) -> float:
        return 0.0


class DevicePace(Pace):
    def __init__(self, speed: DeviceSpeed, jitter_sigma: float = 0.0, seed: int = 0) -> None:
        self.speed, self.jitter_sigma = speed, jitter_sigma
        self.label = "device:" + speed.name
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def first_token_s(self, prompt_tokens: int) -> float:
        with self._lock:
            jitter = float(np.exp(self.jitter_sigma * self._rng.standard_normal())) if self.jitter_sigma else 1.0
        return float(self.speed.ttft_s(prompt_tokens)) * jitter

    def gap_s(self) -> float:
        return self.speed.decode_s()

    def seeded(self, seed: int) -> "Pace":
        return DevicePace(self.speed, self.jitter_sigma, seed)


class TracePace(Pace):
    """Draws are shared by every request of the endpoint, in the order they ask (thread-safe)."""

    def __init__(self, service: ServiceModel, seed: int = 0, time_scale: float = 1.0) -> None:
        self.service, self.time_scale = service, time_scale
        self.label = "trace:" + service.name
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def first_token_s(self, prompt_tokens: int) -> float:
        with self._lock:
            return float(self.service.ttft_s(self._rng, 1)[0]) * self.time_scale

    def gap_s(self) -> float:
        with self._lock:
            return float(self.service.inter_token_s(self._rng, 1)[0]) * self.time_scale

    def seeded(self, seed: int) -> "Pace":
        """First the TTFT, then one gap per token, from ``default_rng(seed)``: the order the replay
        draws a request in (``ReplayInput.draw_seeded``)."""
        return TracePace(self.service, seed, self.time_scale)


def pace_named(kind: str, name: Optional[str], seed: int = 0) -> Pace:
    """``device`` + a device speed, ``trace`` + a service, or ``compute``."""
    from nodes.endpoints.device_speed import device_speed_named
    from nodes.endpoints.services import service_named

    if kind == "device":
        return DevicePace(device_speed_named(name or ""), seed=seed)
    if kind == "trace":
        return TracePace(service_named(name or ""), seed=seed)
    if kind == "compute":
        return ComputePace()
    raise ValueError("an endpoint's pace is device, trace or compute, not %r" % (kind,))
