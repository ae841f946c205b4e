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


# What a shaped rate may be (a trace's rows, and every rate after a campaign's scaling, are held to it
# too): HTB has no rate 0 and sends bursts of at least two packets, and nothing here carries 100 gbit.
MIN_RATE_BIT_S = 1e3
MAX_RATE_BIT_S = 1e11
MAX_DELAY_S = 10.0


class LinkProfile(_Strict):
    """One direction of a link: rate, delay, jitter and loss. Delay and jitter are one way, applied
    as the packet leaves the sender (or, for a phone, as it reaches the receiver)."""

    rate_bit_s: RateBitS | None = Field(None, alias="rate", ge=MIN_RATE_BIT_S, le=MAX_RATE_BIT_S)
    delay_s: DurationS | None = Field(None, alias="delay", le=MAX_DELAY_S)
    jitter_s: DurationS | None = Field(None, alias="jitter", le=MAX_DELAY_S)
    distribution: Literal["normal", "pareto", "paretonormal", "uniform"] | None = None
    loss_pct: Percent | None = Field(None, alias="loss")
    loss_correlation_pct: Percent | None = Field(None, alias="loss_correlation")
    queue_limit_packets: StrictInt | None = Field(None, ge=1, le=1_000_000)
    # Whether jitter may reorder packets. On the NFQUEUE delay path release times stay in order
    # unless this is set; netem's own jitter always reorders (its queue sorts by time to send).
    reorder: StrictBool = False

    def problems(self) -> list[tuple[str, str, str]]:
        """(field as written, what is wrong, how to fix it) for settings that the others make meaningless."""
        out = []
        if all(v is None for v in (self.rate_bit_s, self.delay_s, self.loss_pct)):
            out.append(("", "the profile shapes nothing", "give at least one of rate, delay, loss"))
        if self.jitter_s is not None and not self.delay_s:
            out.append(("jitter", "jitter needs a delay", "add delay: (jitter varies around it)"))
        elif self.jitter_s and self.delay_s and self.jitter_s > self.delay_s:
            out.append(("jitter", f"jitter {units.format_duration(self.jitter_s)} is larger than the delay "
                        f"{units.format_duration(self.delay_s)}: delays below 0 are cut to 0, so neither the mean "
                        "delay nor the jitter would be what is written", "give a jitter of at most the delay"))
        if self.distribution is not None and not self.jitter_s:
            out.append(("distribution", "a delay distribution needs jitter", "add jitter:"))
        if self.reorder and not self.jitter_s:
            out.append(("reorder", "reorder needs jitter (without it every packet has the same delay)",
                        "add jitter:, or remove reorder"))
        if self.loss_correlation_pct is not None and not self.loss_pct:
            out.append(("loss_correlation", "loss correlation needs loss", "add loss:"))
        elif self.loss_correlation_pct is not None and self.loss_correlation_pct >= 100:
            out.append(("loss_correlation", "a loss correlation of 100% makes loss meaningless: netem repeats its "
                        "first draw for ever (no loss at all), a Gilbert chain never leaves its lossy state",
                        "give a correlation below 100%, e.g. 25%"))
        return out

    @property
    def has_delay_or_loss(self) -> bool:
        """Whether the profile needs a delay path (netem, or NFQUEUE where the kernel lacks netem)."""
        return any(v for v in (self.delay_s, self.jitter_s, self.loss_pct))

    def as_written(self) -> dict[str, object]:
        """The profile as a file writes it (its aliases, each quantity exact with its unit): what
        ``LinkProfile.model_validate`` reads back to an equal profile (a link journal keeps it so)."""
        units_of = {"rate_bit_s": "bit", "delay_s": "s", "jitter_s": "s", "loss_pct": "%", "loss_correlation_pct": "%"}
        out: dict[str, object] = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if value is None or (name == "reorder" and not value):
                continue
            out[info.alias or name] = f"{value!r}{units_of[name]}" if name in units_of else value
        return out

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
