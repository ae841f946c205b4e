"""Arrival processes: when a device issues its requests, in seconds from the run's start barrier.

Every process is seeded (numpy ``Generator(PCG64(seed))``), so one seed gives one list of times on
one numpy version. Renewal processes are described by their inter-arrival gaps:

| process | gap distribution | gap mean | gap CV |
|---|---|---|---|
| ``Poisson(rate)`` | exponential | 1/rate | 1 |
| ``GammaArrivals(rate, cv)`` | Gamma(k = 1/cv², θ = 1/(rate·k)) | 1/rate | cv (Andes §6.4 uses cv = 3) |
| ``ConstantRate(rate)`` | fixed | 1/rate | 0 |
| ``TraceArrivals(path)`` | the recorded trace, replayed | | |
| ``StepRates(steps)`` | exponential, the rate stepping through (rate, seconds) pairs | | 1 |

A step load (an autoscaler's low -> high -> low trace) is Poisson within each step: a step starts
its own gaps at its start (exact, the process being memoryless), and the last step lasts until every
request has arrived.

First arrival: the first request comes one gap after 0 (drawn like every other gap), not at 0, so
that devices with independent streams do not all fire at the start barrier together. A constant
rate gets a seeded phase instead: the first arrival is uniform in (0, 1/rate], later ones exactly
1/rate apart.

Traces are CSV files with a header: one time column, either ``arrival_s`` (seconds from the run's
start, >= 0) or ``ts_s``/``timestamp_s`` (absolute timestamps, shifted so that the earliest is 0),
and optionally ``prompt_tokens``, ``max_new_tokens`` (positive integers; an empty cell means "not
given") and ``device`` (rows for that device only; without it every device replays every row).
Times must not decrease down the file (per device). Blank lines and lines starting with ``#`` are
skipped. Any other column is an error, so that a misspelt column is not silently ignored.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from foundation.errors import InputError, InputProblem, TestbedError

MAX_ARRIVALS = 100_000
TIME_COLUMNS = ("arrival_s", "ts_s", "timestamp_s")
OPTIONAL_COLUMNS = ("prompt_tokens", "max_new_tokens", "device")


@dataclass(frozen=True)
class Poisson:
    rate_per_s: float


@dataclass(frozen=True)
class GammaArrivals:
    rate_per_s: float
    cv: float  # coefficient of variation of the gaps; 1 is Poisson-like, > 1 bursty

    @property
    def shape(self) -> float:
        return 1.0 / (self.cv * self.cv)

    @property
    def scale_s(self) -> float:
        return 1.0 / (self.rate_per_s * self.shape)


@dataclass(frozen=True)
class ConstantRate:
    rate_per_s: float


@dataclass(frozen=True)
class TraceArrivals:
    path: str | Path
    device: str | None = None  # with a ``device`` column: replay this device's rows


@dataclass(frozen=True)
class StepRates:
    steps: tuple[tuple[float, float], ...]  # (rate_per_s, duration_s) in turn; the last one's duration is open


ArrivalProcess = Poisson | GammaArrivals | ConstantRate | TraceArrivals | StepRates


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    device: str | None = None
    line: int | None = None  # where the row is in the trace file


def arrival_times_s(process: ArrivalProcess, *, count: int, seed: int) -> list[float]:
    """``count`` arrival times in seconds, non-decreasing, the same for the same seed."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_ARRIVALS:
        raise TestbedError(f"arrivals: count must be an integer from 1 to {MAX_ARRIVALS}, not {count!r}")
    if isinstance(process, TraceArrivals):
        rows = trace_rows_for(process, count=count)
        return [row.arrival_s for row in rows]
    if isinstance(process, StepRates):
        return _step_times_s(process, count, np.random.Generator(np.random.PCG64(seed)))
    rate = _positive_rate(process)
    rng = np.random.Generator(np.random.PCG64(seed))
    if isinstance(process, Poisson):
        gaps = rng.exponential(1.0 / rate, size=count)
    elif isinstance(process, GammaArrivals):
        if not (math.isfinite(process.cv) and process.cv > 0):
            raise TestbedError(f"gamma arrivals: cv must be a positive number, not {process.cv!r}")
        gaps = rng.gamma(process.shape, process.scale_s, size=count)
    elif isinstance(process, ConstantRate):
        phase = 1.0 - rng.random()  # in (0, 1]
        return [(phase + i) / rate for i in range(count)]
    else:
        raise TestbedError(f"unknown arrival process {process!r}")
    return [float(t) for t in np.cumsum(gaps)]


def trace_rows_for(process: TraceArrivals, *, count: int) -> list[TraceRow]:
    """The first ``count`` rows of a trace (of ``process.device`` where the trace has devices)."""
    rows = load_arrival_trace(process.path)
    has_devices = any(row.device is not None for row in rows)
    if has_devices and process.device is not None:
        rows = [row for row in rows if row.device == process.device]
    elif has_devices:
        rows = sorted(rows, key=lambda row: row.arrival_s)  # every device's rows merged in time order
    if len(rows) < count:
        whose = f" for device {process.device!r}" if has_devices and process.device is not None else ""
        problem = f"{count} requests asked for, but the trace has {len(rows)} rows{whose}"
        raise InputError([InputProblem(str(process.path), None, "", problem, "ask for fewer, or extend the trace")])
    return rows[:count]


def load_arrival_trace(path: str | Path) -> list[TraceRow]:
    """Read a trace CSV (see the module docstring); every problem names the file and line."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError([InputProblem(name, None, "", f"cannot read the trace ({error})")]) from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")]
    if not lines:
        raise InputError([InputProblem(name, None, "", "the trace is empty", "give a header and one row per request")])
    header = _trace_header(name, *lines[0])
    time_column = next(c for c in header if c in TIME_COLUMNS)
    problems: list[InputProblem] = []
    rows = [row for number, line in lines[1:] if (row := _trace_row(name, number, line, header, problems))]
    last: dict[str | None, TraceRow] = {}
    for row in rows:
        before = last.get(row.device)
        if before is not None and row.arrival_s < before.arrival_s:
            problem = f"{row.arrival_s} is earlier than line {before.line}'s {before.arrival_s}"
            problems.append(InputProblem(name, row.line, time_column, problem, "list requests in time order"))
        last[row.device] = row
    if problems:
        raise InputError(sorted(problems, key=lambda p: p.line or 0))
    if not rows:
        raise InputError([InputProblem(name, None, "", "the trace has a header but no rows")])
    if time_column == "arrival_s":
        return rows
    start_s = min(row.arrival_s for row in rows)
    return [replace(row, arrival_s=row.arrival_s - start_s) for row in rows]


def _trace_header(name: str, number: int, line: str) -> list[str]:
    header = [c.strip() for c in next(csv.reader([line]))]
    times = [c for c in header if c in TIME_COLUMNS]
    unknown = [c for c in header if c not in TIME_COLUMNS + OPTIONAL_COLUMNS]
    if unknown:
        problem = f"unknown column {unknown[0]!r}"
    elif len(set(header)) != len(header):
        problem = "a column is repeated"
    elif len(times) != 1:
        problem = f"two time columns ({', '.join(times)})" if times else "no time column"
    else:
        return header
    hint = f"columns: one of {', '.join(TIME_COLUMNS)}, and optionally {', '.join(OPTIONAL_COLUMNS)}"
    raise InputError([InputProblem(name, number, "header", problem, hint)])


def _trace_row(name: str, number: int, line: str, header: list[str], problems: list[InputProblem]) -> TraceRow | None:
    """One row, or None with its problems appended."""
    cells = [c.strip() for c in next(csv.reader([line]))]
    if len(cells) != len(header):
        problems.append(InputProblem(name, number, "", f"{len(cells)} cells for {len(header)} columns"))
        return None
    row = dict(zip(header, cells, strict=True))
    found = len(problems)
    time_column = next(c for c in header if c in TIME_COLUMNS)
    time_s = _number(row[time_column])
    if time_s is None or (time_column == "arrival_s" and time_s < 0):
        wanted = "a number of seconds >= 0" if time_column == "arrival_s" else "a number of seconds"
        problems.append(InputProblem(name, number, time_column, f"{row[time_column]!r} is not {wanted}"))
    if "device" in row and not row["device"]:
        problems.append(InputProblem(name, number, "device", "empty", "name the device that sends this request"))
    counts = {column: _positive_int(row.get(column, "")) for column in ("prompt_tokens", "max_new_tokens")}
    for column, value in counts.items():
        if row.get(column) and value is None:
            problems.append(InputProblem(name, number, column, f"{row[column]!r} is not a positive integer"))
    if len(problems) > found or time_s is None:
        return None
    return TraceRow(time_s, counts["prompt_tokens"], counts["max_new_tokens"], row.get("device") or None, number)


def _step_times_s(process: StepRates, count: int, rng: np.random.Generator) -> list[float]:
    """Poisson arrivals whose rate steps through ``process.steps``; the last step runs on until
    ``count`` have arrived."""
    if not process.steps or any(not (math.isfinite(r) and r > 0 and math.isfinite(d) and d > 0)
                                for r, d in process.steps):  # fmt: skip
        raise TestbedError(f"step arrivals: every step needs a positive rate and duration, not {process.steps!r}")
    times: list[float] = []
    start = 0.0
    for index, (rate, duration) in enumerate(process.steps):
        last = index == len(process.steps) - 1
        t = start + rng.exponential(1.0 / rate)
        while len(times) < count and (last or t < start + duration):
            times.append(float(t))
            t += rng.exponential(1.0 / rate)
        start += duration
    return times


def _positive_rate(process: Poisson | GammaArrivals | ConstantRate) -> float:
    rate = process.rate_per_s
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not (math.isfinite(rate) and rate > 0):
        raise TestbedError(f"{type(process).__name__}: rate_per_s must be a positive number, not {rate!r}")
    return float(rate)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 1 else None
