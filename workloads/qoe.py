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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from foundation.errors import TestbedError


@dataclass(frozen=True)
class QoeExpectation:
    expected_ttft_s: float
    expected_tds_tok_s: float


READING = QoeExpectation(1.0, 4.8)
SPEAKING = QoeExpectation(1.0, 3.3)
PRESETS: dict[str, QoeExpectation] = {"reading": READING, "speaking": SPEAKING}
QOE_NAMES = (*PRESETS, "custom")


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
