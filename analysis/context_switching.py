"""LLMS's context-switching views of the ``llms`` runs, one row per served call of a context-switching
trace (``requests.parquet``: ``context``, ``restart``, ``context_tokens``, ``switch_*``):

- ``switch_rows``: the calls that switched to a context with a past (what Fig. 9 averages);
- ``switching_table``: Fig. 9, the switching latency per pattern, active contexts and memory method,
  what the switches read, recomputed and wrote, and each method's slowdown against LLMS;
- ``max_contexts_under``: Fig. 10, the most active contexts a method holds under a latency constraint.

The switching latency (``switch_switch_s``) runs from the call until its context is resident.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

MIB = 1 << 20
SETTINGS = {"pattern": "random", "contexts": 4, "memory": "llms", "budget_gb": 1.0, "chunk_tokens": 16}
KEYS = ["pattern", "contexts", "memory"]
SWEPT = ["budget_gb", "chunk_tokens"]  # settings that key the tables too where the requests carry them (Fig. 10, 14)


def with_settings(requests: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """``requests`` with their run's ``context_service`` settings (the loader's flattened
    ``context_service.*`` columns) as ``pattern``, ``contexts``, ``memory``, ``budget_gb`` and
    ``chunk_tokens``; a setting a run does not record takes the campaign spec's default."""
    settings = runs[["run_id"]].copy()
    for name, default in SETTINGS.items():
        column = f"context_service.{name}"
        values = runs[column] if column in runs.columns else pd.Series(default, index=runs.index)
        settings[name] = values.where(values.notna(), default).astype(type(default))
    return requests.merge(settings.drop_duplicates("run_id"), on="run_id", how="inner")


def switch_rows(requests: pd.DataFrame) -> pd.DataFrame:
    """The completed calls that switched to a context with a past (LLMS Fig. 9): some of its chunks
    were missing, or the context held tokens before the call (``context_tokens`` counts them after
    it). A context's first call and a restarted context switch to nothing and are left out."""
    done = requests[requests["completed"].astype(bool)] if "completed" in requests else requests
    done = done[done["switch_switch_s"].notna()]
    past = done["context_tokens"] > done["prompt_tokens"] + done["output_tokens"]
    restart = done["restart"].fillna(False).astype(bool) if "restart" in done else False
    return done[(past | (done["switch_missing_chunks"] > 0)) & ~restart]


def _order(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """LLMS first, then the other methods by name, within each pattern, budget and context count."""
    table = table.assign(_llms=table["memory"] != "llms")
    return table.sort_values([k for k in keys if k != "memory"] + ["_llms", "memory"]).drop(columns="_llms")


def switching_table(requests: pd.DataFrame) -> pd.DataFrame:
    """LLMS Fig. 9: per pattern, active contexts and memory method (and budget and chunk size where the
    requests carry ``budget_gb`` and ``chunk_tokens``: Fig. 10 and 14; Fig. 13's ablations are memory
    methods), over the switches (:func:`switch_rows`): their count; the mean, P50 and P99 switching
    latency (ms); the mean chunks missing, recomputed and read per switch; the MiB read
    and written at switch time and the faults, summed over the switches; and ``slower_than_llms``,
    the mean latency over LLMS's at the same pattern, contexts, budget and chunk size (NaN without an
    LLMS row)."""
    keys = [*KEYS, *[k for k in SWEPT if k in requests.columns]]
    switches = switch_rows(requests).assign(_ms=lambda f: f["switch_switch_s"] * 1e3)
    columns = [*keys, "switches", "mean_switch_ms", "p50_switch_ms", "p99_switch_ms", "mean_missing_chunks",
               "mean_recomputed_chunks", "mean_read_chunks", "read_mib", "written_at_switch_mib", "faults",
               "slower_than_llms"]  # fmt: skip
    if switches.empty:
        return pd.DataFrame(columns=columns)
    table = switches.groupby(keys).agg(
        switches=("_ms", "size"), mean_switch_ms=("_ms", "mean"), p50_switch_ms=("_ms", "median"),
        p99_switch_ms=("_ms", lambda s: s.quantile(0.99)),
        mean_missing_chunks=("switch_missing_chunks", "mean"),
        mean_recomputed_chunks=("switch_recomputed_chunks", "mean"),
        mean_read_chunks=("switch_read_chunks", "mean"),
        read_mib=("switch_bytes_read", "sum"), written_at_switch_mib=("switch_bytes_written", "sum"),
        faults=("switch_faults", "sum"),
    ).reset_index()  # fmt: skip
    table[["read_mib", "written_at_switch_mib"]] = table[["read_mib", "written_at_switch_mib"]] / MIB
    others = [k for k in keys if k != "memory"]
    llms = table.loc[table["memory"] == "llms", [*others, "mean_switch_ms"]].rename(
        columns={"mean_switch_ms": "_llms_ms"})  # fmt: skip
    table = table.merge(llms, on=others, how="left")
    table["slower_than_llms"] = table["mean_switch_ms"] / table["_llms_ms"].where(table["_llms_ms"] > 0)
    return _order(table.drop(columns="_llms_ms"), keys)[columns].reset_index(drop=True)


def max_contexts_under(table: pd.DataFrame, constraint_ms: float) -> pd.DataFrame:
    """LLMS Fig. 10: per pattern and memory method (and budget and chunk size where ``table`` has them),
    ``max_contexts``, the largest tested number of active contexts whose mean switching latency
    (``mean_switch_ms`` of :func:`switching_table`) is at most ``constraint_ms``, 0 if none is; and
    ``interpolated_contexts`` where the latency reaches it (:func:`contexts_under`), with
    ``every_tested_within`` when the sweep never got there."""
    keys = ["pattern", *[k for k in SWEPT if k in table.columns], "memory"]
    within = table["contexts"].where(table["mean_switch_ms"] <= constraint_ms)
    out = within.groupby([table[k] for k in keys]).max().fillna(0).astype(np.int64).rename("max_contexts")
    between = table.groupby(keys).apply(
        lambda g: pd.Series(contexts_under(g["contexts"].tolist(), g["mean_switch_ms"].tolist(), constraint_ms),
                            index=["interpolated_contexts", "every_tested_within"]), include_groups=False)  # fmt: skip
    out = out.to_frame().join(between)
    out["every_tested_within"] = out["every_tested_within"].astype(bool)
    return _order(out.reset_index(), keys).reset_index(drop=True)


def contexts_under(contexts: list[int], mean_switch_ms: list[float], constraint_ms: float) -> tuple[float, bool]:
    """The active contexts at which the mean switching latency reaches ``constraint_ms`` (the paper's
    fractional counts, e.g. 4.32): linear between the last tested count within the constraint and the
    first over it, from one context at 0 ms (a single context is never switched away from). With every
    tested count within, the largest one and ``True`` (the real limit lies beyond the sweep)."""
    below_n, below_ms = 1.0, 0.0
    for n, ms in sorted(zip(contexts, mean_switch_ms, strict=True)):
        if ms > constraint_ms:
            return below_n + (constraint_ms - below_ms) / (ms - below_ms) * (n - below_n), False
        below_n, below_ms = float(n), ms
    return below_n, True
