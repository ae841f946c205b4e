"""A campaign's summary table: one row per run with its settings, TTFT, TBT and device power.

TTFT is the device's first-token time minus the request's arrival (both on the device's clock);
TBT is every gap between consecutive tokens of a request (vLLM's inter-token latency), pooled over
the run's requests. Power is the median of each device's ``board_power_mw`` samples during the run,
labelled measured or modeled as its sensor says. ``write_summary`` writes
``report/summary.csv`` and ``report/summary.md``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.load import CampaignData, load
from analysis.metrics import request_latencies, token_gaps_s

SETTING_COLUMNS = ("method", "link.profile", "link.trace", "partition.device_layers", "workload.rate_per_s")


def summarize(data: CampaignData) -> pd.DataFrame:
    runs = data.runs.copy()
    keep = ["run_id", "state", *[c for c in runs.columns if c in SETTING_COLUMNS or c.startswith("power.")],
            "repetition"]  # fmt: skip
    table = runs[[c for c in keep if c in runs.columns]].copy()
    if not data.requests.empty:
        latencies = request_latencies(data.requests)
        per_run = latencies.groupby("run_id").agg(
            requests=("request_id", "count"),
            ttft_mean_ms=("ttft_s", lambda s: s.mean() * 1e3),
            ttft_p90_ms=("ttft_s", lambda s: s.quantile(0.9) * 1e3),
        )
        table = table.merge(per_run, on="run_id", how="left")
    gaps = token_gaps_s(data.tokens)
    if not gaps.empty:
        tbt = gaps.groupby("run_id")["gap_s"].agg(tbt_mean_ms=lambda s: s.mean() * 1e3,
                                                   tbt_p90_ms=lambda s: s.quantile(0.9) * 1e3)  # fmt: skip
        table = table.merge(tbt, on="run_id", how="left")
    if not data.telemetry.empty:
        power = data.telemetry[data.telemetry.metric == "board_power_mw"]
        if not power.empty:
            medians = power.groupby(["run_id", "node"])["value"].median().unstack("node")
            kinds = power.groupby("node")["kind"].first()
            medians.columns = [f"power_{node}_mw ({kinds[node]})" for node in medians.columns]
            table = table.merge(medians.reset_index(), on="run_id", how="left")
    return table


def attention_lines(directory: Path) -> list[str]:
    """Lines on failed and skipped runs and quarantined nodes, from the ledger."""
    import sqlite3

    with sqlite3.connect(f"file:{directory / 'ledger.sqlite'}?mode=ro", uri=True) as db:
        runs = db.execute("SELECT run_id, state, reason FROM runs WHERE state IN ('failed', 'skipped')").fetchall()
        nodes = db.execute("SELECT node, reason FROM nodes WHERE quarantined_s IS NOT NULL").fetchall()
    out = [f"- run {run_id} {state}" + (f": {reason}" if reason else "") for run_id, state, reason in runs]
    out += [f"- node {node} quarantined: {reason}" for node, reason in nodes]
    return ["", "## Failures and quarantined nodes", "", *out] if out else []


def write_summary(campaign_dir: str | Path, data: CampaignData | None = None) -> Path:
    """Write ``report/summary.csv`` and ``report/summary.md``; return the markdown file's path."""
    directory = Path(campaign_dir)
    table = summarize(data if data is not None else load(directory))
    report = directory / "report"
    report.mkdir(parents=True, exist_ok=True)
    table.to_csv(report / "summary.csv", index=False)
    lines = [f"# Campaign summary: {directory.name}", "",
             "TTFT: first token minus arrival, on the device's clock. TBT: every gap between consecutive "
             "tokens of a request. Power: median board power of each node during the run (modeled on "
             "emulated nodes).", ""]  # fmt: skip
    shown = table.round(1).astype(object).where(table.notna(), "")
    lines.append("| " + " | ".join(str(c) for c in shown.columns) + " |")
    lines.append("|" + "---|" * len(shown.columns))
    for row in shown.itertuples(index=False):
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
    lines += attention_lines(directory)
    path = report / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
