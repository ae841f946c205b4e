"""Results (dataclasses, NamedTuples from nodes/, pydantic models, tuples, paths) as JSON-ready values."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a NamedTuple from nodes/
        return jsonable(value._asdict())
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "model_dump") and not isinstance(value, type):  # a pydantic model (a link profile)
        return value.model_dump(mode="json")
    return value
