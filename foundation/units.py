"""Quantities written with units in user files, parsed in exactly one place.

Rates: ``bit``, ``kbit``, ``mbit``, ``gbit`` (bits per second, SI) and ``Bps``, ``KBps``,
``MBps``, ``GBps`` (bytes per second, SI); IEC forms ``kibit``, ``mibit``, ``gibit``, ``KiBps``,
``MiBps``, ``GiBps`` are accepted too. ``mbps``/``Mbps``/``kbps`` are refused: tc reads ``mbps`` as
megabytes per second while most people mean megabits, so the unit is ambiguous.
Durations: ``us``, ``ms``, ``s``, ``min``, ``h``. Percentages: ``0.1%``.
A bare number is refused for every quantity: the unit must be written.
"""

from __future__ import annotations

import math
import re

_NUMBER = r"(?P<num>[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"

_RATE_UNITS_BIT_S: dict[str, float] = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "kibit": 1024.0,
    "mibit": 1024.0**2,
    "gibit": 1024.0**3,
    "Bps": 8.0,
    "KBps": 8e3,
    "MBps": 8e6,
    "GBps": 8e9,
    "KiBps": 8 * 1024.0,
    "MiBps": 8 * 1024.0**2,
    "GiBps": 8 * 1024.0**3,
}
_RATE_AMBIGUOUS = {"bps", "kbps", "mbps", "gbps", "Kbps", "Mbps", "Gbps", "KBPS", "MBPS", "GBPS"}

_DURATION_UNITS_S: dict[str, float] = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


class UnitError(ValueError):
    """A quantity that could not be parsed; ``hint`` says how to write it."""

    def __init__(self, problem: str, hint: str) -> None:
        self.problem = problem
        self.hint = hint
        super().__init__(f"{problem}; {hint}")


def _split(text: object, what: str, example: str) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UnitError(f"expected a {what} such as {example!r}, got {text!r}", f"write e.g. {example}")
    if isinstance(text, (int, float)):
        raise UnitError(f"{text!r} has no unit", f"write the unit, e.g. {example}")
    if text != text.strip() or re.search(r"\s", text):
        raise UnitError(f"{text!r} contains whitespace", f"write number and unit together, e.g. {example}")
    m = re.fullmatch(_NUMBER + r"(?P<unit>[A-Za-z%]*)", text)
    if not m:
        raise UnitError(f"{text!r} is not a {what}", f"write e.g. {example}")
    if not m["unit"]:
        raise UnitError(f"{text!r} has no unit", f"write the unit, e.g. {example}")
    value = float(m["num"])
    if not math.isfinite(value):
        raise UnitError(f"{text!r} is not finite", f"write e.g. {example}")
    return value, m["unit"]


def parse_rate_bit_s(text: object) -> float:
    """Parse a link rate such as ``40mbit`` or ``10MBps`` into bits per second."""
    value, unit = _split(text, "rate", "40mbit or 5MBps")
    if unit in _RATE_AMBIGUOUS:
        raise UnitError(
            f"{text!r}: unit {unit!r} is ambiguous (tc reads it as bytes, most people as bits)",
            f"write {value:g}mbit for megabits/s or {value:g}MBps for megabytes/s",
        )
    if unit not in _RATE_UNITS_BIT_S:
        raise UnitError(
            f"{text!r}: unknown rate unit {unit!r}",
            "use one of " + ", ".join(_RATE_UNITS_BIT_S),
        )
    return value * _RATE_UNITS_BIT_S[unit]


def parse_duration_s(text: object) -> float:
    """Parse a duration such as ``5ms`` or ``30s`` into seconds."""
    value, unit = _split(text, "duration", "5ms or 30s")
    if unit not in _DURATION_UNITS_S:
        raise UnitError(
            f"{text!r}: unknown duration unit {unit!r}",
            "use one of " + ", ".join(_DURATION_UNITS_S),
        )
    return value * _DURATION_UNITS_S[unit]


def parse_percent(text: object) -> float:
    """Parse a percentage such as ``0.1%`` into percent (0.1), refusing values above 100."""
    value, unit = _split(text, "percentage", "0.1%")
    if unit != "%":
        raise UnitError(f"{text!r}: expected a percentage", "write e.g. 0.1%")
    if value > 100.0:
        raise UnitError(f"{text!r} is more than 100%", "write a value between 0% and 100%")
    return value


def format_rate(bit_s: float) -> str:
    """Canonical text for a rate, in tc's bit units (exact where possible)."""
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bit_s >= factor and (bit_s / factor) == round(bit_s / factor, 3):
            return f"{bit_s / factor:g}{unit}"
    return f"{bit_s:g}bit"


def format_duration(seconds: float) -> str:
    """Canonical text for a duration: ms below one second, else s."""
    if seconds < 1.0:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds:g}s"
