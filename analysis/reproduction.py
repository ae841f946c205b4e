"""A paper's headline numbers beside ours: the verdict on each, and the page that shows them.

A headline is one number of a paper's table or figure. Most are effects: a change against a baseline
(HAT's TTFT -41.4% against U-shape) or a factor (Andes' 4.7x capacity), each with a value that means no
effect at all (0 for a change, 1 for a factor). Ours is an :class:`~analysis.uncertainty.Interval`.

Verdicts, for an effect (``no_effect`` set), with ``r = (ours - no_effect) / (paper - no_effect)``:

- **within ±25%**: ``0.75 <= r <= 1.25`` and the interval excludes no effect;
- **right direction**: ``r > 0`` and the interval excludes no effect;
- **missed**: otherwise (the wrong direction, or within noise: the interval includes no effect).

For a plain value (``no_effect`` None), within ±25% of the paper's value, otherwise missed. For a bound
(``at_most``: the paper's claim is that the value stays under its number, as DiSCo's premise that a
server's TTFT hardly correlates with the prompt's length, Pearson < 0.1), the claim holds (counted
within) when the whole interval is under it, right direction when the estimate is but the interval
reaches over, missed otherwise. A headline
whose experiment has no result is **not run**; one whose result was computed by code that has changed
since is marked **stale** (its verdict stands but is not current).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from analysis.uncertainty import Interval

WITHIN, DIRECTION, MISSED, NOT_RUN = "within ±25%", "right direction", "missed", "not run"
TOLERANCE = 0.25


@dataclass(frozen=True)
class Comparison:
    """One headline: where it is in the paper, what it measures, the paper's value and ours."""

    figure: str  # the paper's table or figure, e.g. "Table 5, SpecBench (Vicuna-7B)"
    quantity: str  # e.g. "HAT: TTFT against U-shape"
    unit: str  # "%" for a change (values in percent), "x" for a factor, or the value's unit
    paper: float
    ours: Interval | None  # None: not run
    no_effect: float | None = 0.0  # the value that means no effect; None for a plain value
    stale: bool = False
    experiment: str = ""
    note: str = ""  # what decides it, e.g. "modeled: the server's TTFT is a lognormal reading"
    x: float | None = None  # its place on the figure's x axis, for a figure that is a curve
    series: str = ""  # the curve it belongs to
    at_most: bool = False  # the paper's number is a bound ours should stay under, not a value to match

    @property
    def ratio(self) -> float:
        """Ours over the paper's, as an effect when it is one (see the module's docstring)."""
        if self.ours is None or math.isnan(self.ours.estimate):
            return math.nan
        base = self.no_effect or 0.0
        span = self.paper - base
        return (self.ours.estimate - base) / span if span else math.nan

    @property
    def has_interval(self) -> bool:
        return self.ours is not None and not math.isnan(self.ours.low) and not math.isnan(self.ours.high)

    @property
    def within_noise(self) -> bool:
        return self.no_effect is not None and self.has_interval and self.ours is not None \
            and self.ours.contains(self.no_effect)  # fmt: skip

    @property
    def verdict(self) -> str:
        if self.ours is None or math.isnan(self.ours.estimate):
            return NOT_RUN
        if self.at_most:
            under = self.ours.high <= self.paper if self.has_interval else False
            return WITHIN if under else DIRECTION if self.ours.estimate <= self.paper else MISSED
        close = abs(self.ratio - 1) <= TOLERANCE
        if self.no_effect is None:
            return WITHIN if close else MISSED
        if self.within_noise:
            return MISSED
        return WITHIN if close else DIRECTION if self.ratio > 0 else MISSED


def counts(comparisons: Sequence[Comparison]) -> dict[str, int]:
    """How many headlines have each verdict, and how many are stale."""
    out = {v: sum(c.verdict == v for c in comparisons) for v in (WITHIN, DIRECTION, MISSED, NOT_RUN)}
    out["stale"] = sum(c.stale and c.verdict != NOT_RUN for c in comparisons)
    out["without interval"] = sum(c.ours is not None and not c.has_interval for c in comparisons)
    return out


def count_line(comparisons: Sequence[Comparison]) -> str:
    n = counts(comparisons)
    line = (f"**{len(comparisons)} headlines: {n[WITHIN]} within ±25% of the paper's, {n[DIRECTION]} in the right "
            f"direction, {n[MISSED]} missed")  # fmt: skip
    extra = [f"{n[NOT_RUN]} not run yet"] if n[NOT_RUN] else []
    extra += [f"{n['stale']} stale"] if n["stale"] else []
    extra += [f"{n['without interval']} without an interval"] if n["without interval"] else []
    return line + (f" ({', '.join(extra)})" if extra else "") + ".**"


def number(value: float, unit: str) -> str:
    """A value as the page prints it: 4 significant figures, the unit after it."""
    if value is None or math.isnan(value):
        return "–"
    text = f"{value:.4g}" if abs(value) < 10000 else f"{value:.0f}"
    return f"{text}{'' if unit in ('', 'x') else ' ' if unit not in ('%',) else ''}{unit if unit != 'x' else '×'}"


def ours_text(c: Comparison) -> str:
    if c.ours is None or math.isnan(c.ours.estimate):
        return "–"
    text = number(c.ours.estimate, c.unit)
    if c.has_interval:
        text += f" [{number(c.ours.low, c.unit)}, {number(c.ours.high, c.unit)}]"
    else:
        text += " (no interval)"
    return text


def verdict_text(c: Comparison) -> str:
    text = c.verdict
    if c.verdict == MISSED and c.within_noise:
        text += " (within noise)"
    return text + (" · **stale**" if c.stale and c.verdict != NOT_RUN else "")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    lines = ["| headline | paper | ours (95% interval) | ours / paper | verdict |", "|---|---|---|---|---|"]
    for c in comparisons:
        ratio = "–" if math.isnan(c.ratio) else f"{c.ratio:.2f}"
        quantity = c.quantity + (f" ({c.note})" if c.note else "")
        paper = ("≤ " if c.at_most else "") + number(c.paper, c.unit)
        lines.append(f"| {quantity} | {paper} | {ours_text(c)} | {ratio} | {verdict_text(c)} |")
    return "\n".join(lines)


def comparison_figure(title: str, comparisons: Sequence[Comparison]):  # -> matplotlib Figure
    """The paper's values and ours on the paper's axes, one panel per unit: curves over ``x`` where the
    headlines have one (a sweep), otherwise bars per headline; ours with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = list(dict.fromkeys(c.unit for c in comparisons)) or [""]
    sizes = [max(1, sum(c.unit == u for c in comparisons)) for u in units]
    fig, axes = plt.subplots(1, len(units), figsize=(7.0 + 1.2 * (len(units) - 1), 3.8), dpi=100, squeeze=False,
                             gridspec_kw={"width_ratios": sizes})  # fmt: skip
    for ax, unit in zip(axes[0], units, strict=True):
        _panel(ax, [c for c in comparisons if c.unit == unit])
        ax.set_ylabel("%" if unit == "%" else "×" if unit == "x" else unit)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _panel(ax: Any, comparisons: Sequence[Comparison]) -> None:  # ax: a matplotlib Axes
    import numpy as np

    if comparisons and all(c.x is not None for c in comparisons):
        for series in dict.fromkeys(c.series for c in comparisons):
            points = sorted((c for c in comparisons if c.series == series), key=lambda c: c.x or 0.0)
            label = f"{series} " if series else ""
            line = ax.plot([c.x for c in points], [c.paper for c in points], "--", marker="o", label=label + "(paper)")
            ours = [c for c in points if _measured(c)]
            values, low, high = _error_bars(ours)
            ax.errorbar([c.x for c in ours], values, yerr=[low, high], color=line[0].get_color(), marker="s",
                        capsize=3, label=label + "(ours)")  # fmt: skip
        ax.set_xlabel(comparisons[0].figure.split("|")[-1].strip() if "|" in comparisons[0].figure else "x")
    else:
        positions = np.arange(len(comparisons))
        ax.bar(positions - 0.2, [c.paper for c in comparisons], 0.4, label="paper", color="0.7")
        values, low, high = _error_bars(comparisons)
        ax.bar(positions + 0.2, values, 0.4, yerr=[low, high], capsize=3, label="ours", color="tab:blue")
        ax.set_xticks(positions, [_short(c.quantity) for c in comparisons], rotation=25, ha="right", fontsize=7)
        ax.axhline(0.0, color="black", linewidth=0.6)
    ax.legend(fontsize=7)


def _measured(c: Comparison) -> bool:
    return c.ours is not None and not math.isnan(c.ours.estimate)


def _error_bars(comparisons: Sequence[Comparison]) -> tuple[list[float], list[float], list[float]]:
    """Ours (0 where not measured) and the distances down and up to its interval's ends (0 without one)."""
    values, low, high = [], [], []
    for c in comparisons:
        ours = c.ours if c.ours is not None and _measured(c) else None
        values.append(ours.estimate if ours else 0.0)
        low.append(ours.estimate - ours.low if ours and c.has_interval else 0.0)
        high.append(ours.high - ours.estimate if ours and c.has_interval else 0.0)
    return values, low, high


def _short(quantity: str) -> str:
    return quantity if len(quantity) <= 28 else quantity[:27] + "…"
