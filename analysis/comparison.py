"""Groups of a campaign's runs side by side, with intervals: each group's mean TTFT, TBT and QoE with its
95% interval (bootstrap over requests and repetitions, :mod:`analysis.uncertainty`), and each group's
change against a baseline group measured on the same requests, marked when it is within noise.

A request is the unit: ``(repetition, node, request_id)`` names the same request in every run of one
repetition (a campaign gives one workload seed per repetition, so every method meets the same arrivals
and prompts), which is what pairs a treatment's request with the baseline's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import qoe_table, request_latencies, served_requests, token_gaps_s
from analysis.uncertainty import Interval, change_interval, mean_interval, within_noise

PAIR_KEY = ["repetition", "node", "request_id"]
# name -> (numerator column, denominator column or None, factor to the unit in the name)
MEANS = {"ttft_ms": ("ttft_s", None, 1e3), "tbt_ms": ("gap_sum_s", "gaps", 1e3), "qoe": ("qoe", None, 1.0)}


def request_units(requests: pd.DataFrame, tokens: pd.DataFrame, runs: pd.DataFrame, by: Sequence[str],
                  qoe_alpha: float | None = None) -> pd.DataFrame:  # fmt: skip
    """One row per completed request of the done ``runs``: the ``by`` settings, its repetition, node and
    id, ``ttft_s``, the sum of its gaps between tokens and their count (TBT's mean is their ratio over
    requests), and its Andes ``qoe`` where requests carry QoE expectations (0 for one never served)."""
    runs = runs[runs["state"] == "done"] if "state" in runs else runs
    settings = runs[["run_id", "repetition", *by]]
    if requests.empty:
        return pd.DataFrame(columns=[*settings.columns, "node", "request_id", "ttft_s", "gap_sum_s", "gaps"])
    units = request_latencies(requests)[["run_id", "node", "request_id", "ttft_s"]]
    gaps = token_gaps_s(tokens).groupby(["run_id", "node", "request_id"])["gap_s"].agg(["sum", "count"])
    units = units.merge(gaps.rename(columns={"sum": "gap_sum_s", "count": "gaps"}).reset_index(),
                        on=["run_id", "node", "request_id"], how="left")  # fmt: skip
    if {"expected_ttft_s", "expected_tds_tok_s"} <= set(requests.columns):
        served = served_requests(requests, tokens, qoe_table(requests, tokens, qoe_alpha), runs, [])
        units = units.merge(served[["run_id", "node", "request_id", "qoe"]], on=["run_id", "node", "request_id"],
                            how="outer")  # fmt: skip
    return units.merge(settings, on="run_id", how="inner")


def _interval(units: pd.DataFrame, name: str) -> Interval | None:
    numerator, denominator, factor = MEANS[name]
    if numerator not in units or units[numerator].notna().sum() == 0:
        return None
    den = units[denominator] if denominator else None
    return mean_interval(units[numerator], den, units["repetition"]).scaled(factor)


def group_means(units: pd.DataFrame, by: Sequence[str]) -> list[dict[str, Any]]:
    """Per group of ``by``: its settings, requests and repetitions, and each mean of :data:`MEANS` it has
    with its interval (as :meth:`Interval.as_dict`)."""
    rows = []
    for values, part in units.groupby(list(by), sort=True, dropna=False) if by else [((), units)]:
        row: dict[str, Any] = {"settings": settings_of(by, values), "requests": len(part),
                               "repetitions": int(part["repetition"].nunique())}  # fmt: skip
        for name in MEANS:
            interval = _interval(part, name)
            if interval is not None:
                row[name] = interval.as_dict()
        rows.append(row)
    return rows


def baseline_group(frame: pd.DataFrame, by: Sequence[str], settings: Mapping[str, object],
                   baseline: Mapping[str, object]) -> tuple[pd.DataFrame, dict[str, Any]]:  # fmt: skip
    """The rows of ``frame`` that the group with ``settings`` (of ``by``) is compared against: those of
    the group with ``baseline``'s settings and the group's own for the rest; and that group's settings."""
    base = frame
    for column in by:
        base = base[base[column] == baseline.get(column, settings[column])]
    return base, {**{c: settings[c] for c in by if c not in baseline}, **baseline}


def settings_of(by: Sequence[str], values: object) -> dict[str, Any]:
    """A pandas group's key (one value, or a tuple of them) as ``{setting: plain value}`` of ``by``."""
    values = values if isinstance(values, tuple) else (values,)
    return {column: plain(value) for column, value in zip(by, values, strict=True)}


def plain(value: object) -> object:
    """A numpy scalar or array as Python's own (what JSON takes); anything else as it is."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def changes_against(units: pd.DataFrame, by: Sequence[str], baseline: Mapping[str, object]) -> list[dict[str, Any]]:
    """Each group's change of every mean of :data:`MEANS` against its baseline, the group that differs from
    it only in ``baseline``'s settings (e.g. ``{"method": "ushape"}``), on the requests both served
    (paired by :data:`PAIR_KEY`): the relative change with its interval and whether it is within noise."""
    rows = []
    others = [c for c in by if c not in baseline]
    for values, part in units.groupby(list(by), sort=True, dropna=False):
        settings = settings_of(by, values)
        if all(settings[c] == v for c, v in baseline.items()):
            continue
        base, against = baseline_group(units, by, settings, baseline)
        if base.empty:
            continue
        paired = part.merge(base, on=[*PAIR_KEY, *others], suffixes=("", "_base"))
        row: dict[str, Any] = {"settings": settings, "against": against, "pairs": len(paired)}
        for name, (numerator, denominator, _) in MEANS.items():
            if numerator not in paired or paired[numerator].notna().sum() == 0:
                continue
            change = change_interval(
                paired[numerator], paired[f"{numerator}_base"],
                paired[denominator] if denominator else None, paired[f"{denominator}_base"] if denominator else None,
                paired["repetition"],
            )  # fmt: skip
            if not math.isnan(change.estimate):
                row[name.split("_")[0] + "_change"] = {**change.as_dict(), "within_noise": within_noise(change)}
        rows.append(row)
    return rows
