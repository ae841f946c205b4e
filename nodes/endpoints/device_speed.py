"""How fast a phone runs its on-device model, and the device TTFT model DiSCo dispatches with.

``DeviceSpeed``: the measured prefill and decode rates DiSCo Sec. 5.1 uses (Li et al. 2024, mean of
10 runs), one per device-model pair of Table 2's columns. A device endpoint is paced to them.

``LinearTtft``: T_d(l) = k l + c (DiSCo Sec. 3: on-device TTFT is linear and stable in the prompt
length), fitted by least squares on calibration runs, never on the requests being evaluated.
"""

from dataclasses import dataclass
from typing import Dict, Sequence

import numpy as np


@dataclass(frozen=True)
class DeviceSpeed:
    """A device-model pair: prefill and decode tokens per second; ``overhead_s`` before the prefill."""

    name: str
    prefill_tok_s: float
    decode_tok_s: float
    model: str  # the on-device model (a key of the cost model's shapes)
    overhead_s: float = 0.0

    def ttft_s(self, prompt_tokens) -> np.ndarray:
        """The time to a first token: the prompt's prefill at the measured rate."""
        return self.overhead_s + np.asarray(prompt_tokens, dtype="float64") / self.prefill_tok_s

    def decode_s(self) -> float:
        return 1.0 / self.decode_tok_s


DEVICE_SPEEDS: Dict[str, DeviceSpeed] = {
    "pixel7pro-bloom-1.1b": DeviceSpeed("pixel7pro-bloom-1.1b", 31.32, 13.93, "bloom-1.1b"),
    "pixel7pro-bloom-560m": DeviceSpeed("pixel7pro-bloom-560m", 51.80, 20.14, "bloom-560m"),
    "xiaomi14-qwen-0.5b": DeviceSpeed("xiaomi14-qwen-0.5b", 79.90, 21.47, "qwen-0.5b"),
}  # Table 2's columns, slowest first


def device_speed_named(name: str) -> DeviceSpeed:
    try:
        return DEVICE_SPEEDS[name]
    except KeyError:
        raise ValueError("unknown device speed %r; known: %s" % (name, ", ".join(DEVICE_SPEEDS))) from None


@dataclass(frozen=True)
class LinearTtft:
    """T_d(l) = k l + c, with the Pearson correlation of the samples it was fitted on."""

    seconds_per_token: float
    intercept_s: float
    pearson: float
    samples: int

    @classmethod
    def fit(cls, prompt_tokens: Sequence[int], ttft_s: Sequence[float]) -> "LinearTtft":
        x = np.asarray(prompt_tokens, dtype="float64")
        y = np.asarray(ttft_s, dtype="float64")
        if len(x) != len(y) or len(x) < 2 or np.ptp(x) == 0:
            raise ValueError("fitting T_d(l) needs at least two calibration runs of different prompt lengths")
        k, c = np.polyfit(x, y, 1)
        r = float(np.corrcoef(x, y)[0, 1]) if np.ptp(y) > 0 else 1.0
        return cls(float(k), float(c), r, len(x))

    def ttft_s(self, prompt_tokens) -> np.ndarray:
        return self.intercept_s + self.seconds_per_token * np.asarray(prompt_tokens, dtype="float64")
