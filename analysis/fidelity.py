"""How faithful an emulated run was to its target hardware: the share of paced steps that took
longer than the compute profile gave them (``steps.parquet``, one row per step of every rank;
``overrun`` is 1 when the real computation overran, or when the rank woke from its wait more than
5% of the step late, ``late_s`` saying by how much: either way the step lasted longer than modeled).

A run above :data:`VIOLATION_LIMIT` is flagged: its latencies are this machine's, not the target's,
in those steps. The remedy is dilation (``target.dilation``: every modeled duration, trace and link
slowed by one factor), which gives the real computation more room; for DiSCo's endpoints (their tokens
keep a trace's or a phone's pace in real time, which nothing dilates), fewer devices or streams at once.
"""

from __future__ import annotations

import pandas as pd

VIOLATION_LIMIT = 0.05  # share of a node's steps that may overrun before its run is flagged


def violation_shares(steps: pd.DataFrame) -> pd.DataFrame:
    """Per run and node: steps, overruns, their share, real and target seconds, and whether it is
    flagged; the overruns split by cause: ``computed_over`` (the real computation took longer than
    the target: this machine lacked CPU) and ``woke_late`` (the computation kept up, the wake-up did
    not: the rank waited for a core)."""
    columns = ["run_id", "node", "steps", "overruns", "violation_share", "computed_over", "woke_late", "real_s",
               "target_s", "flagged"]  # fmt: skip
    if steps.empty:
        return pd.DataFrame(columns=columns)
    keys = [k for k in ("run_id", "node") if k in steps.columns]
    computed_over = (steps["overrun"] == 1) & (steps["real_s"] > steps["target_s"])
    steps = steps.assign(computed_over=computed_over, woke_late=(steps["overrun"] == 1) & ~computed_over)
    grouped = steps.groupby(keys, sort=True).agg(
        steps=("overrun", "size"), overruns=("overrun", "sum"), computed_over=("computed_over", "sum"),
        woke_late=("woke_late", "sum"), real_s=("real_s", "sum"), target_s=("target_s", "sum"),
    )  # fmt: skip
    grouped["violation_share"] = grouped["overruns"] / grouped["steps"]
    grouped["flagged"] = grouped["violation_share"] > VIOLATION_LIMIT
    return grouped.reset_index()[[c for c in columns if c in keys or c not in ("run_id", "node")]]
