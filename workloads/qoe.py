"""Per-request QoE expectations: the expected token delivery timeline each request is judged by.

Andes (Liu et al.) §2.2: a user waits for the first token (expected TTFT), then digests tokens at
an expected token delivery speed (TDS); the two fix the expected timeline
``T(t) = TDS_expected · (t - TTFT_expected)`` that the QoE metric (§3.1) compares the actual delivery
with. Average reading speed (Table 1, by age group) is 4.8 tokens/s and average speaking speed
(Table 2, by language) 3.3 tokens/s, translated from words per minute with ChatGPT's word-to-token
ratio. §6.1 sets the expected TTFT to 1 s for every request; the voice-chat QoE trace (§6.4) keeps 1 s
and uses the speaking speed.

| preset | expected_ttft_s | expected_tds_tok_s |
|---|---|---|
| reading | 1.0 | 4.8 |
| speaking | 1.0 | 3.3 |
| custom | given | given |

Drawn per request (Andes §6.1 samples each request's TDS from the table's groups; the brief's
reading), a request's TDS_exp is its group's words per minute with the group's share of users as its
probability, scaled so that the mean is the preset's: ``draw_expected_tds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from foundation.errors import TestbedError


@dataclass(frozen=True)
class QoeExpectation:
    expected_ttft_s: float
    expected_tds_tok_s: float


READING = QoeExpectation(1.0, 4.8)
SPEAKING = QoeExpectation(1.0, 3.3)
PRESETS: dict[str, QoeExpectation] = {"reading": READING, "speaking": SPEAKING}
QOE_NAMES = (*PRESETS, "custom")
# (words per minute, share of users): Andes Table 1 (reading, by age) and Table 2 (speaking, by language)
SPEED_GROUPS: dict[str, tuple[tuple[float, float], ...]] = {
    "reading": ((236, 0.280), (200, 0.519), (192, 0.112), (185, 0.056), (175, 0.033)),
    "speaking": ((150, 0.793), (158, 0.070), (150, 0.069), (195, 0.036), (218, 0.032)),
}


def draw_expected_tds(name: str, rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` TDS_exp (tokens/s) drawn from the preset's table: a group by its share of users, its
    speed scaled so that the table's mean is the preset's mean (4.8 reading, 3.3 speaking)."""
    if name not in SPEED_GROUPS:
        raise TestbedError(f"qoe: no speed table for {name!r}; one of {', '.join(SPEED_GROUPS)}")
    wpm, share = (np.array(column, dtype="float64") for column in zip(*SPEED_GROUPS[name], strict=True))
    share = share / share.sum()
    tokens_per_s = wpm * PRESETS[name].expected_tds_tok_s / float(wpm @ share)
    return rng.choice(tokens_per_s, size=count, p=share)


def qoe_problems(
    name: str | None, expected_ttft_s: float | None = None, expected_tds_tok_s: float | None = None
) -> list[tuple[str, str]]:
    """(field, message) for every reason these settings give no expectation."""
    problems = []
    if name is not None and name not in QOE_NAMES:
        problems.append(("qoe", f"unknown QoE preset {name!r}; choose one of {', '.join(QOE_NAMES)}"))
    for field, value in (("expected_ttft_s", expected_ttft_s), ("expected_tds_tok_s", expected_tds_tok_s)):
        if value is None:
            if name in (None, "custom"):
                problems.append((field, "needed when qoe is custom (no preset to take it from)"))
        elif isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
            problems.append((field, f"must be a positive number, not {value!r}"))
    return problems


def qoe_expectation(
    name_or_none: str | None, expected_ttft_s: float | None = None, expected_tds_tok_s: float | None = None
) -> QoeExpectation:
    """A preset (``reading``, ``speaking``) with any field overridden, or ``custom``/None with both given."""
    problems = qoe_problems(name_or_none, expected_ttft_s, expected_tds_tok_s)
    if problems:
        raise TestbedError("; ".join(f"{field}: {message}" for field, message in problems))
    base = PRESETS.get(name_or_none or "", QoeExpectation(math.nan, math.nan))
    return QoeExpectation(
        float(expected_ttft_s) if expected_ttft_s is not None else base.expected_ttft_s,
        float(expected_tds_tok_s) if expected_tds_tok_s is not None else base.expected_tds_tok_s,
    )
