"""Field types for the pydantic models of user files: quantities with units (``8mbit``, ``20ms``,
``1%``) parsed by :mod:`foundation.units`, and the strict model configuration they all use.

A parse error keeps the unit parser's problem and hint, so the user reads them unchanged
(``FILE:LINE: field: problem; hint``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

from foundation import units

# Unknown keys are errors; values are frozen; fields may be given by their aliases. (Each module's
# base model sets it, so that linters see a pydantic model there.)
STRICT_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


def invalid_value(kind: str, problem: str, hint: str) -> PydanticCustomError:
    """A validation error whose message and hint reach the user unchanged."""
    return PydanticCustomError(kind, "{problem}", {"problem": problem, "hint": hint})


def unit_validator(parser: Callable[[object], float], what: str) -> Any:
    """A before-validator that parses a quantity with :mod:`foundation.units`."""

    def validate(value: object) -> float:
        try:
            return parser(value)
        except units.UnitError as exc:
            raise invalid_value("unit", exc.problem, exc.hint) from None

    validate.__name__ = f"parse_{what}"
    return BeforeValidator(validate)


RateBitS = Annotated[float, unit_validator(units.parse_rate_bit_s, "rate"), Field(gt=0)]
DurationS = Annotated[float, unit_validator(units.parse_duration_s, "duration"), Field(ge=0)]
Percent = Annotated[float, unit_validator(units.parse_percent, "percent"), Field(ge=0, le=100)]


# A number as a user writes it: an int or a float, never text ('64') or a boolean; finite (the models'
# allow_inf_nan=False); each field bounds it to what a real value can be.
Number = Annotated[float, Strict()]


# A path or a name the testbed passes on (to a shell, a file name, a run config): not empty, and not
# endless. (Control and format characters are refused in every string of a file: YamlSource.text_problems.)
PlainText = Annotated[str, Field(min_length=1, max_length=4096)]
