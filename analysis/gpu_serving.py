"""GPU serving with module scaling (CoCoServe Sec. 6): throughput, latency, SLO attainment and OOM rate
of the GPU-rank methods against load, the GPU memory each used, and the controller's actions.

The paper leaves "throughput" and "OOM rate" undefined (brief, pitfall 3), so:

- throughput: output tokens and completed requests per second over the run's span (first arrival
  to last token), counting only requests that finished (an out-of-memory failure's tokens are lost);
- OOM rate: the share of scheduled requests that failed out of memory;
- SLO attainment: the share of scheduled requests that finished within their SLO (the engine's:
  ``scaling.slo_factor`` times the request's time alone on an idle server); a failed or unfinished
  request misses it;
- the SLO knee: the highest tested rate whose attainment is at least :data:`KNEE_ATTAINMENT`;
- memory: the most the GPUs held together at any monitor tick (weights, KV, fixed share), and the
  GPUs that held anything (the "single instance" of Fig. 8 uses the others for replicas).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis import metrics

KNEE_ATTAINMENT = 0.9


def request_outcomes(requests: pd.DataFrame) -> pd.DataFrame:
    """Per scheduled request: finished (not failed), out of memory, E2E seconds, and whether it met
    its SLO."""
    frame = requests.copy()
    finished_by = frame["finished_by"] if "finished_by" in frame else pd.Series(None, index=frame.index)
    completed = frame["completed"] if "completed" in frame else pd.Series(True, index=frame.index)
    frame["out_of_memory"] = finished_by == "oom"
    frame["finished"] = completed.fillna(False).astype(bool) & ~frame["out_of_memory"] & (finished_by != "refused")
    frame["e2e_s"] = (frame["last_token_s"] - frame["arrival_s"]).where(frame["finished"])
    slo = frame["serving_slo_s"] if "serving_slo_s" in frame else pd.Series(np.nan, index=frame.index)
    frame["met_slo"] = frame["finished"] & (frame["e2e_s"] <= slo)
    return frame


def gpu_serving_table(requests: pd.DataFrame, runs: pd.DataFrame, ticks: pd.DataFrame,
                      by: Sequence[str]) -> pd.DataFrame:  # fmt: skip
    """Per group of ``by`` (method, rate, ...): requests, throughput, E2E mean/p50/p90, SLO attainment,
    OOM rate, peak GPU memory (GB) and GPUs used (means over the group's runs where per run)."""
    outcomes = request_outcomes(requests)
    frame = outcomes.merge(runs[["run_id", *by]], on="run_id")
    rates = metrics.throughput(requests.assign(completed=outcomes["finished"]))
    memory = peak_memory(ticks)
    rows = []
    for values, part in frame.groupby(list(by), sort=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        row = dict(zip(by, values, strict=True))
        ids = set(part["run_id"])
        mine = rates[rates["run_id"].isin(ids)]
        e2e = part["e2e_s"].dropna()
        row.update(
            runs=len(ids), requests=len(part), output_tokens_per_s=mine["output_tokens_per_s"].mean(),
            requests_per_s=mine["requests_per_s"].mean(), e2e_mean_s=e2e.mean() if len(e2e) else np.nan,
            e2e_p50_s=float(np.percentile(e2e, 50)) if len(e2e) else np.nan,
            e2e_p90_s=float(np.percentile(e2e, 90)) if len(e2e) else np.nan,
            slo_attainment=part["met_slo"].mean(), oom_rate=part["out_of_memory"].mean(),
        )  # fmt: skip
        held = memory[memory["run_id"].isin(ids)]
        row["peak_memory_gb"] = held["peak_bytes"].mean() / 1e9 if len(held) else np.nan
        row["gpus_used"] = held["gpus_used"].mean() if len(held) else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def peak_memory(ticks: pd.DataFrame) -> pd.DataFrame:
    """Per run: the most bytes the GPUs held together at one tick, and how many GPUs held any."""
    if ticks.empty:
        return pd.DataFrame(columns=["run_id", "peak_bytes", "gpus_used"])
    used = [c for c in ticks.columns if c.startswith("used_bytes_")]
    total = ticks[used].fillna(0).sum(axis=1)
    held = ticks[used].fillna(0).gt(0)
    return (ticks.assign(total=total, held=held.sum(axis=1)).groupby("run_id")
            .agg(peak_bytes=("total", "max"), gpus_used=("held", "max")).reset_index())  # fmt: skip


def slo_knees(table: pd.DataFrame, rate: str, by: Sequence[str]) -> pd.DataFrame:
    """Per group of ``by``: the highest tested ``rate`` whose SLO attainment is at least
    :data:`KNEE_ATTAINMENT` (NaN when none is)."""
    rows = []
    for values, part in table.groupby(list(by), sort=True):
        values = values if isinstance(values, tuple) else (values,)
        holding = part.loc[part["slo_attainment"] >= KNEE_ATTAINMENT, rate]
        rows.append(dict(zip(by, values, strict=True), knee_rate=float(holding.max()) if len(holding) else np.nan))
    return pd.DataFrame(rows)


def action_trace(ops: pd.DataFrame, runs: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Every controller action in order per run (time, kind, layer, GPUs, batch cap, seconds, bytes)."""
    if ops.empty:
        return ops
    columns = ["time_s", "kind", "layer", "source", "destination", "batch_size", "offload", "seconds", "bytes"]
    frame = ops.merge(runs[["run_id", *by]], on="run_id")
    return frame[[*by, "run_id", *columns]].sort_values([*by, "run_id", "time_s"], kind="stable")
