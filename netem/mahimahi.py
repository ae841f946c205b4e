"""Mahimahi link traces (ravinet/mahimahi, ATC'15) as our bandwidth traces.

A Mahimahi trace is one integer per line: a millisecond at which the link may deliver one MTU-sized
(1500-byte) packet; a millisecond written n times delivers n packets, and the trace repeats from the
start once its last millisecond has passed (its period). We count the delivery opportunities in bins
of ``bin_s`` and turn each bin into a rate: packets x 1500 B x 8 / bin_s. A bin with none would stop
the link, which HTB cannot do: it gets ``MIN_RATE_BIT_S``, and the import says how many did. The
uplink and downlink traces each repeat with their own period over the longer of the two.
"""

from __future__ import annotations

import bisect
import math
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import InputError, InputProblem, TestbedError
from netem.profile import MAX_DELAY_S
from netem.trace import MAX_ROWS, BandwidthTrace, TraceStep

PACKET_BYTES = 1500
MIN_RATE_BIT_S = 8_000.0  # 1 kB/s: what an empty bin gets (HTB has no rate 0)
# Bounds no real link trace reaches, so that no file makes the import allocate or loop without end:
MAX_MS = 86_400_000  # a trace's period: one day
MAX_OPPORTUNITIES = 5_000_000  # lines (10 minutes at 100 mbit)
MAX_PER_MS = 7_000  # one millisecond written this often is 84 gbit/s (a link profile's ceiling is 100 gbit)
MAX_LINE_CHARS = 64
_WHOLE = re.compile(r"[0-9]{1,12}")  # ASCII digits only: no sign, '_', '.', or other scripts' digits


def load_opportunities(path: str | Path) -> tuple[int, ...]:
    """The delivery opportunities (milliseconds, non-decreasing) of a Mahimahi trace file; every
    problem names the file and line. Read a line at a time, each bounded: nothing in the file can make
    this read more than :data:`MAX_OPPORTUNITIES` lines of :data:`MAX_LINE_CHARS`."""
    opportunities, _last_line = _read(Path(path))
    return tuple(opportunities)


def _read(path: Path) -> tuple[array, int]:
    problems: list[InputProblem] = []
    out = array("q")
    number, last_line, repeats = 0, 0, 0

    def refuse(line: int | None, problem: str, hint: str = "") -> None:
        problems.append(InputProblem(str(path), line, "", problem, hint))

    try:
        with open(path, "rb") as handle:
            while len(problems) < 20:
                raw = handle.readline(MAX_LINE_CHARS + 1)
                if not raw:
                    break
                number += 1
                if len(raw) > MAX_LINE_CHARS and not raw.endswith(b"\n"):
                    refuse(number, f"a line longer than {MAX_LINE_CHARS} characters",
                           "a Mahimahi trace has one delivery time (ms) per line")  # fmt: skip
                    break
                try:
                    word = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    refuse(number, "not UTF-8 text", "a Mahimahi trace has one delivery time (ms) per line")
                    continue
                if not word:
                    continue
                if not _WHOLE.fullmatch(word):
                    refuse(number, f"{word!r} is not a whole number of milliseconds",
                           "a Mahimahi trace has one delivery time (ms) per line, in plain digits")  # fmt: skip
                    continue
                ms = int(word)
                if ms > MAX_MS:
                    refuse(number, f"{ms} ms is more than a day ({MAX_MS} ms)", "is this a Mahimahi trace?")
                    break
                if out and ms < out[-1]:
                    refuse(number, f"{ms} ms comes before {out[-1]} ms, on a line above")
                repeats = repeats + 1 if out and ms == out[-1] else 1
                if repeats > MAX_PER_MS:
                    refuse(number, f"millisecond {ms} written more than {MAX_PER_MS} times (over 84 gbit/s)",
                           "is this a Mahimahi trace?")  # fmt: skip
                    break
                if len(out) >= MAX_OPPORTUNITIES:
                    refuse(number, f"more than {MAX_OPPORTUNITIES} delivery times", "import a shorter stretch")
                    break
                out.append(ms)
                last_line = number
    except OSError as exc:
        raise InputError([InputProblem(str(path), None, "", f"cannot read: {exc.strerror or exc}")]) from None
    if not out and not problems:
        refuse(max(number, 1), "the trace has no delivery times", "one delivery time (ms) per line")
    elif out and out[-1] == 0 and not problems:
        refuse(last_line, "the trace lasts 0 ms", "its last line is its period: give a later millisecond")
    if problems:
        raise InputError(problems)
    return out, last_line


def binned_rates_bit_s(opportunities: Sequence[int], bin_s: float, duration_s: float) -> list[float]:
    """Rates per bin over ``duration_s``, the trace repeating with its period (its last millisecond).
    Counted from the sorted opportunities (a bisection per bin edge), never by walking every repeat."""
    period_ms, n = opportunities[-1], len(opportunities)
    at_period = n - bisect.bisect_left(opportunities, period_ms)

    def before(t_ms: int) -> int:  # deliveries at integer times r * period + ms < t_ms, r >= 0
        if t_ms <= 0:
            return 0
        repeats, rem = divmod(t_ms, period_ms)
        return repeats * n + bisect.bisect_left(opportunities, rem) - (at_period if repeats and not rem else 0)

    def first_in(b: int) -> int:  # the first integer millisecond that int(t / 1000 / bin_s) puts in bin b
        t = max(0, math.ceil(b * bin_s * 1000 - 1e-6))
        while t > 0 and int((t - 1) / 1000 / bin_s) >= b:
            t -= 1
        while int(t / 1000 / bin_s) < b:
            t += 1
        return t

    bins = math.ceil(duration_s / bin_s - 1e-9)
    edges = [first_in(b) for b in range(bins)] + [math.ceil(duration_s * 1000)]
    counts = [before(edges[b + 1]) - before(edges[b]) for b in range(bins)]
    return [n_b * PACKET_BYTES * 8 / bin_s for n_b in counts]


@dataclass(frozen=True)
class ImportedTrace:
    trace: BandwidthTrace
    empty_bins: int  # bins with no delivery opportunity, given MIN_RATE_BIT_S


def import_mahimahi(
    up_path: str | Path,
    down_path: str | Path,
    *,
    bin_s: float = 1.0,
    delay_ms: float | None = None,
    loss_pct: float | None = None,
) -> ImportedTrace:
    """Our trace (``t_s, up_rate, down_rate[, delay_ms, loss_pct]``) from a Mahimahi uplink and downlink
    trace; ``delay_ms`` and ``loss_pct`` (one way, each direction) are put on every row when given."""
    for name, value, low, high in (("bin_s", bin_s, 0.01, 3600.0), ("delay_ms", delay_ms, 0.0, MAX_DELAY_S * 1000),
                                   ("loss_pct", loss_pct, 0.0, 100.0)):  # fmt: skip
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise TestbedError(f"{name}: {value!r} is not a number from {low:g} to {high:g}")
    (up, up_last), (down, down_last) = _read(Path(up_path)), _read(Path(down_path))
    duration_s = max(up[-1], down[-1]) / 1000
    rows = math.ceil(duration_s / bin_s - 1e-9)
    if rows > MAX_ROWS:
        longer, line = (up_path, up_last) if up[-1] >= down[-1] else (down_path, down_last)
        raise InputError([InputProblem(str(longer), line, "", f"the trace lasts {duration_s:g} s: {rows} rows of "
                                       f"{bin_s:g} s, more than a trace may have ({MAX_ROWS})",
                                       "give a larger --bin, or import a shorter stretch")])  # fmt: skip
    ups = binned_rates_bit_s(up, bin_s, duration_s)
    downs = binned_rates_bit_s(down, bin_s, duration_s)
    empty = sum(rate == 0 for rate in ups + downs)
    steps = tuple(
        TraceStep(round(i * bin_s, 6), max(u, MIN_RATE_BIT_S), max(d, MIN_RATE_BIT_S),
                  None if delay_ms is None else delay_ms / 1000, loss_pct)
        for i, (u, d) in enumerate(zip(ups, downs, strict=True))
    )  # fmt: skip
    source = f"mahimahi up={Path(up_path).name} down={Path(down_path).name}, {bin_s:g} s bins"
    return ImportedTrace(BandwidthTrace(source, steps), empty)
