"""Link profiles: what one direction of a link should look like (rate, delay, jitter, loss), as a user
writes it under ``link_profiles:`` (in an inventory or a links file), and the shaped directions
between two nodes that carry one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt

from foundation import units
from foundation.user_fields import STRICT_MODEL_CONFIG, DurationS, Percent, RateBitS


class _Strict(BaseModel):
    model_config = STRICT_MODEL_CONFIG


class LinkProfile(_Strict):
    """One direction of a link: rate, delay, jitter and loss. Delay and jitter are one way, applied
    as the packet leaves the sender (or, for a phone, as it reaches the receiver)."""

    rate_bit_s: RateBitS | None = Field(None, alias="rate", ge=1e3, le=1e11)
    delay_s: DurationS | None = Field(None, alias="delay", le=10)
    jitter_s: DurationS | None = Field(None, alias="jitter", le=10)
    distribution: Literal["normal", "pareto", "paretonormal", "uniform"] | None = None
    loss_pct: Percent | None = Field(None, alias="loss")
    loss_correlation_pct: Percent | None = Field(None, alias="loss_correlation")
    queue_limit_packets: StrictInt | None = Field(None, ge=1, le=1_000_000)
    # Whether jitter may reorder packets. On the NFQUEUE delay path release times stay in order
    # unless this is set; netem's own jitter always reorders (its queue sorts by time to send).
    reorder: StrictBool = False

    @property
    def has_delay_or_loss(self) -> bool:
        """Whether the profile needs a delay path (netem, or NFQUEUE where the kernel lacks netem)."""
        return any(v for v in (self.delay_s, self.jitter_s, self.loss_pct))

    def describe(self) -> str:
        parts = []
        if self.rate_bit_s is not None:
            parts.append(units.format_rate(self.rate_bit_s))
        if self.delay_s is not None:
            parts.append("delay " + units.format_duration(self.delay_s))
        if self.jitter_s is not None:
            parts.append("jitter " + units.format_duration(self.jitter_s))
        if self.loss_pct is not None:
            parts.append(f"loss {self.loss_pct:g}%")
        return ", ".join(parts)


@dataclass(frozen=True)
class DirectedLink:
    """A shaped direction from one node to another, after groups are expanded."""

    source: str
    destination: str
    profile_name: str
    profile: LinkProfile
