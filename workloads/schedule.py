"""Request schedules: per device, when each request arrives, what it asks and what its user expects.

A schedule is JSON lines, one request per line, keys sorted, in arrival order::

    {"arrival_s": 0.412731, "expected_tds_tok_s": 4.8, "expected_ttft_s": 1.0, "max_new_tokens": 32,
     "prompt_ids": [0, 812, ...], "prompt_source": "tiny-python:enum.py:301", "prompt_tokens": 77,
     "request_id": 1000000}

Device workers read ``request_id``, ``arrival_s`` (seconds from the run's start barrier),
``prompt_ids`` and ``max_new_tokens`` (``nodes/contracts/run_config.py``), and a streaming method's
clients the QoE expectation (``expected_ttft_s``, ``expected_tds_tok_s``: the preset's, or with
``qoe_draw`` each request's own from Andes' Table 1 or 2); the rest is kept for analysis. Each
device has its own random streams, seeded from (seed, device name, purpose) through SHA-256: a
device's arrivals, prompts and speeds do not depend on the other devices, and changing the prompt
set leaves the arrivals as they were (``foundation.seeds``). Request ids are ``device index *
1_000_000 + i`` (``nodes.contracts.schedules``), the index being the device's position in the list
given.
The same spec, seed and devices give byte-identical files (for one model, one interpreter's
standard library and one numpy version).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from foundation.errors import TestbedError
from foundation.seeds import derive_seed
from nodes.contracts.schedules import request_id
from workloads.arrivals import (
    MAX_ARRIVALS,
    ArrivalProcess,
    ConstantRate,
    GammaArrivals,
    Poisson,
    StepRates,
    TraceArrivals,
    arrival_times_s,
    trace_rows_for,
)
from workloads.prompts import OUTPUT_LENGTH_MODELS, draw_output_lengths, draw_prompts, prompt_set_problem
from workloads.qoe import SPEED_GROUPS, draw_expected_tds, qoe_expectation, qoe_problems

ARRIVALS = ("poisson", "gamma", "constant", "trace", "steps")


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: str = "poisson"  # poisson | gamma | constant | trace | steps
    rate_per_s: float | None = 1.0  # per device; unused by trace and steps
    cv: float | None = None  # gamma only: coefficient of variation of the gaps
    trace: str | None = None  # trace only: CSV path (relative to base_dir)
    rate_steps: Sequence[Sequence[float]] | None = None  # steps only: [rate_per_s per device, duration_s] in turn
    requests_per_device: int = 8
    prompts: str = "tiny-python"  # a prompt set (workloads.prompts) or file:<path>
    max_new_tokens: int = 32
    qoe: str = "reading"  # reading | speaking | custom
    expected_ttft_s: float | None = None  # overrides the preset's
    expected_tds_tok_s: float | None = None  # overrides the preset's
    qoe_draw: bool | None = None  # each request's TDS_exp drawn from the preset's table (Andes Table 1/2)
    output_lengths: str | None = None  # each request's max_new_tokens drawn from this set (at most max_new_tokens)

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every semantic error; files are checked when schedules are built."""
        out: list[tuple[str, str]] = []
        if self.arrival not in ARRIVALS:
            out.append(("arrival", f"unknown arrival process {self.arrival!r}; choose one of {', '.join(ARRIVALS)}"))
        elif self.arrival not in ("trace", "steps") and not _positive(self.rate_per_s):
            out.append(("rate_per_s", f"{self.arrival} arrivals need a positive rate, not {self.rate_per_s!r}"))
        if self.arrival == "gamma" and not _positive(self.cv):
            out.append(("cv", f"gamma arrivals need a positive cv (Andes uses 3), not {self.cv!r}"))
        elif self.arrival != "gamma" and self.cv is not None:
            out.append(("cv", "cv applies to gamma arrivals only"))
        if self.arrival == "trace" and not (isinstance(self.trace, str) and self.trace.strip()):
            out.append(("trace", "trace arrivals need a trace file (CSV)"))
        elif self.arrival != "trace" and self.trace is not None:
            out.append(("trace", "a trace file applies to arrival: trace only"))
        if self.arrival == "steps" and not _steps(self.rate_steps):
            out.append(("rate_steps", "step arrivals need a list of [rate_per_s, duration_s] pairs, each positive, "
                        f"not {self.rate_steps!r}"))  # fmt: skip
        elif self.arrival != "steps" and self.rate_steps is not None:
            out.append(("rate_steps", "rate_steps applies to arrival: steps only"))
        if not _count(self.requests_per_device, MAX_ARRIVALS):
            out.append(("requests_per_device", f"must be an integer from 1 to {MAX_ARRIVALS}"))
        problem = prompt_set_problem(self.prompts)
        if problem:
            out.append(("prompts", problem))
        if not _count(self.max_new_tokens, None):
            out.append(("max_new_tokens", f"must be a positive integer, not {self.max_new_tokens!r}"))
        out.extend(qoe_problems(self.qoe, self.expected_ttft_s, self.expected_tds_tok_s))
        if self.output_lengths is not None and self.output_lengths not in OUTPUT_LENGTH_MODELS:
            out.append(("output_lengths", f"unknown output length set {self.output_lengths!r}; choose one of "
                        f"{', '.join(OUTPUT_LENGTH_MODELS)}"))  # fmt: skip
        if self.qoe_draw and (self.qoe not in SPEED_GROUPS or self.expected_tds_tok_s is not None):
            out.append(("qoe_draw", f"draws from the reading or speaking table; not with qoe {self.qoe!r}"
                        + (" and expected_tds_tok_s given" if self.expected_tds_tok_s is not None else "")))
        return out


def arrival_process(spec: WorkloadSpec, *, device: str | None = None, base_dir: Path | None = None) -> ArrivalProcess:
    if spec.arrival == "poisson":
        return Poisson(float(spec.rate_per_s))
    if spec.arrival == "gamma":
        return GammaArrivals(float(spec.rate_per_s), float(spec.cv))
    if spec.arrival == "constant":
        return ConstantRate(float(spec.rate_per_s))
    if spec.arrival == "steps":
        return StepRates(tuple((float(rate), float(duration)) for rate, duration in spec.rate_steps or ()))
    return TraceArrivals(_resolve(str(spec.trace), base_dir), device)


def build_schedules(
    spec: WorkloadSpec, devices: Sequence[str], *, seed: int, model_dir: str | Path, base_dir: Path | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every device's schedule (rows as in the module docstring), keyed by device name."""
    problems = spec.problems()
    if problems:
        raise TestbedError("workload: " + "; ".join(f"{field}: {message}" for field, message in problems))
    names = list(devices)
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise TestbedError(f"workload: devices must be distinct non-empty names, not {names!r}")
    qoe = qoe_expectation(spec.qoe, spec.expected_ttft_s, spec.expected_tds_tok_s)
    count = spec.requests_per_device
    out: dict[str, list[dict[str, Any]]] = {}
    for index, device in enumerate(names):
        process = arrival_process(spec, device=device, base_dir=base_dir)
        prompt_tokens = max_new = None
        if isinstance(process, TraceArrivals):
            rows = trace_rows_for(process, count=count)
            times = [row.arrival_s for row in rows]
            prompt_tokens = [row.prompt_tokens for row in rows]
            max_new = [row.max_new_tokens for row in rows]
        else:
            times = arrival_times_s(process, count=count, seed=derive_seed(seed, device, "arrivals"))
        if spec.output_lengths is not None and max_new is None:
            max_new = draw_output_lengths(spec.output_lengths, count=count, seed=derive_seed(seed, device, "outputs"),
                                          max_new_tokens=spec.max_new_tokens)  # fmt: skip
        prompts = draw_prompts(
            spec.prompts,
            count=count,
            seed=derive_seed(seed, device, "prompts"),
            model_dir=model_dir,
            max_new_tokens=spec.max_new_tokens,
            base_dir=base_dir,
            prompt_tokens=prompt_tokens,
            max_new_tokens_per_request=max_new,
        )
        speeds = [qoe.expected_tds_tok_s] * count
        if spec.qoe_draw:
            drawn = draw_expected_tds(spec.qoe, np.random.default_rng(derive_seed(seed, device, "qoe")), count)
            speeds = [round(float(v), 6) for v in drawn]
        out[device] = [
            {
                "request_id": request_id(index, i),
                "arrival_s": round(float(time_s), 6),
                "prompt_ids": [int(t) for t in prompt.prompt_ids],
                "prompt_tokens": prompt.prompt_tokens,
                "max_new_tokens": prompt.max_new_tokens,
                "expected_ttft_s": qoe.expected_ttft_s,
                "expected_tds_tok_s": speed,
                "prompt_source": prompt.source,
            }
            for i, (time_s, prompt, speed) in enumerate(zip(times, prompts, speeds, strict=True))
        ]
    return out


def schedule_bytes(rows: Sequence[dict[str, Any]]) -> bytes:
    """The schedule file's exact bytes: one JSON object per line, keys sorted."""
    return "".join(json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n" for row in rows).encode()


def write_schedule(rows: Sequence[dict[str, Any]], path: str | Path) -> str:
    """Write a schedule file; returns its :func:`schedule_digest`."""
    data = schedule_bytes(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def schedule_digest(rows: Sequence[dict[str, Any]]) -> str:
    """SHA-256 (hex) of the schedule's file bytes."""
    return hashlib.sha256(schedule_bytes(rows)).hexdigest()


def _resolve(path: str, base_dir: Path | None) -> Path:
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else (base_dir or Path.cwd()) / resolved


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value > 0


def _steps(value: object) -> bool:
    """A non-empty list of [rate_per_s, duration_s] pairs, each positive."""
    if not isinstance(value, list | tuple) or not value:
        return False
    return all(isinstance(step, list | tuple) and len(step) == 2 and all(_positive(v) for v in step) for step in value)


def _count(value: object, high: int | None) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1 and (high is None or value <= high)
