"""Server behaviour as distributions: the TTFT and inter-token times of the four streaming services
DiSCo traced (Sec. 3, Sec. 5.1), so that a trace endpoint can replay them and the trace-driven runs
can draw them.

The paper publishes no trace, only its shape: server TTFT hardly depends on the prompt (Table 1,
Pearson |r| < 0.05), sits around a typical value and has a heavy right tail ("GPT-4o-mini from 0.3 s
to several seconds at busy times"); decoding beats reading speed. Typical values are the brief's
reading of Table 5 (MAE over MAPE of a moving average): GPT about 0.40 s, DeepSeek 1.4 s, Command
0.23 s, LLaMA 0.78 s. Our reading, labelled as such everywhere it is used: a lognormal body around
that median with a log-spread near the MAPE, mixed with a lognormal tail component (a share of
requests that queue behind a busy period). Inter-token times are lognormal around each service's
public decode speed (GPT-4o-mini about 80 tokens/s, Command 40, LLaMA-3-70B on Hyperbolic 30,
DeepSeek-V2.5 20 in late 2024).

A lab that has its own traces replaces these with :meth:`ServiceModel.from_samples`.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Lognormal:
    """A lognormal by its median (seconds) and the standard deviation of its log."""

    median_s: float
    log_sigma: float

    def sample(self, rng: np.random.Generator, shape) -> np.ndarray:
        return self.median_s * np.exp(self.log_sigma * rng.standard_normal(shape))


@dataclass(frozen=True)
class ServiceModel:
    """One service: TTFT = body, or with probability ``tail_share`` the tail component; inter-token
    times from ``inter_token``. ``samples_s``: an empirical TTFT trace to resample instead."""

    name: str
    ttft_body: Lognormal
    tail_share: float
    ttft_tail: Lognormal
    inter_token: Lognormal
    source: str
    samples_s: Optional[np.ndarray] = None

    @classmethod
    def from_samples(cls, name: str, ttft_s: Sequence[float], inter_token: Lognormal) -> "ServiceModel":
        """A service that resamples a recorded TTFT trace (a lab's own measurements)."""
        values = np.asarray(ttft_s, dtype="float64")
        if not len(values) or not np.all(np.isfinite(values)) or values.min() < 0:
            raise ValueError("a TTFT trace needs finite, non-negative seconds")
        median = float(np.median(values))
        return cls(name, Lognormal(median, 0.0), 0.0, Lognormal(median, 0.0), inter_token, "recorded trace", values)

    def ttft_s(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` independent first-token times (independent of the prompt: Table 1)."""
        if self.samples_s is not None:
            return rng.choice(self.samples_s, size=count)
        body = self.ttft_body.sample(rng, count)
        tail = self.ttft_tail.sample(rng, count)
        return np.where(rng.random(count) < self.tail_share, np.maximum(body, tail), body)

    def inter_token_s(self, rng: np.random.Generator, shape) -> np.ndarray:
        """Times between successive tokens of a stream."""
        return self.inter_token.sample(rng, shape)

    def describe(self) -> Dict[str, object]:
        return {"name": self.name, "ttft_median_s": self.ttft_body.median_s, "ttft_log_sigma": self.ttft_body.log_sigma,
                "tail_share": self.tail_share, "tail_median_s": self.ttft_tail.median_s,
                "tail_log_sigma": self.ttft_tail.log_sigma, "inter_token_median_s": self.inter_token.median_s,
                "inter_token_log_sigma": self.inter_token.log_sigma, "source": self.source,
                "modeled": True}  # fmt: skip


_READING = "our reading of DiSCo Sec. 3 and Table 5 (no trace is published): modeled"
SERVICES: Dict[str, ServiceModel] = {
    "gpt": ServiceModel("gpt", Lognormal(0.40, 0.25), 0.05, Lognormal(1.6, 0.5), Lognormal(0.0125, 0.5), _READING),
    "deepseek": ServiceModel("deepseek", Lognormal(1.40, 0.28), 0.03, Lognormal(3.5, 0.4), Lognormal(0.05, 0.5),
                             _READING),
    "command": ServiceModel("command", Lognormal(0.23, 0.38), 0.05, Lognormal(1.2, 0.6), Lognormal(0.025, 0.5),
                            _READING),
    "llama": ServiceModel("llama", Lognormal(0.78, 0.40), 0.05, Lognormal(2.5, 0.5), Lognormal(0.033, 0.5), _READING),
}  # fmt: skip


def service_named(name: str) -> ServiceModel:
    try:
        return SERVICES[name]
    except KeyError:
        raise ValueError("unknown service trace %r; known: %s" % (name, ", ".join(SERVICES))) from None
