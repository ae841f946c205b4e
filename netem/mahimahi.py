"""Mahimahi link traces (ravinet/mahimahi, ATC'15) as our bandwidth traces.

A Mahimahi trace is one integer per line: a millisecond at which the link may deliver one MTU-sized
(1500-byte) packet; a millisecond written n times delivers n packets, and the trace repeats from the
start once its last millisecond has passed (its period). We count the delivery opportunities in bins
of ``bin_s`` and turn each bin into a rate: packets x 1500 B x 8 / bin_s. A bin with none would stop
the link, which HTB cannot do: it gets ``MIN_RATE_BIT_S``, and the import says how many did. The
uplink and downlink traces each repeat with their own period over the longer of the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import InputError, InputProblem
from netem.trace import BandwidthTrace, TraceStep

PACKET_BYTES = 1500
MIN_RATE_BIT_S = 8_000.0  # 1 kB/s: what an empty bin gets (HTB has no rate 0)


def load_opportunities(path: str | Path) -> tuple[int, ...]:
    """The delivery opportunities (milliseconds, non-decreasing) of a Mahimahi trace file; every
    problem names the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError([InputProblem(str(path), None, "", f"cannot read: {exc}")]) from None
    problems, out = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        word = line.strip()
        if not word:
            continue
        if not word.isdigit():
            problems.append(InputProblem(str(path), number, "", f"{word!r} is not a whole number of milliseconds",
                                         "a Mahimahi trace has one delivery time (ms) per line"))  # fmt: skip
            continue
        ms = int(word)
        if out and ms < out[-1]:
            problems.append(InputProblem(str(path), number, "", f"{ms} ms comes before {out[-1]} ms, on a line above"))
        out.append(ms)
    if not out and not problems:
        problems.append(InputProblem(str(path), None, "", "the trace has no delivery times"))
    elif out and out[-1] == 0:
        problems.append(InputProblem(str(path), len(text.splitlines()), "", "the trace lasts 0 ms"))
    if problems:
        raise InputError(problems)
    return tuple(out)


def binned_rates_bit_s(opportunities: Sequence[int], bin_s: float, duration_s: float) -> list[float]:
    """Rates per bin over ``duration_s``, the trace repeating with its period (its last millisecond)."""
    period_ms = opportunities[-1]
    bins = math.ceil(duration_s / bin_s - 1e-9)
    counts = [0] * bins
    for repeat in range(math.ceil(duration_s * 1000 / period_ms)):
        for ms in opportunities:
            t_ms = repeat * period_ms + ms
            if t_ms >= duration_s * 1000:
                break
            counts[min(bins - 1, int(t_ms / 1000 / bin_s))] += 1
    return [n * PACKET_BYTES * 8 / bin_s for n in counts]


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
    up, down = load_opportunities(up_path), load_opportunities(down_path)
    duration_s = max(up[-1], down[-1]) / 1000
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
