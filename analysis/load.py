"""A campaign directory as pandas DataFrames.

``load(campaign_dir)`` reads the ledger and every run directory and returns :class:`CampaignData`:

- ``runs``: one row per run of the ledger (state, attempts, reason), with the run's settings
  flattened into columns (``method``, ``link.profile``, ``power.orin``, ``workload.rate_per_s``, ...)
  from its manifest;
- ``requests``, ``tokens``: the runs' tables with ``run_id`` in front; request times (``arrival_s``,
  ``first_token_s``, ...) are seconds on the device's clock from the run's start barrier, and
  ``arrival_ts_s``, ``first_token_ts_s``, ``last_token_ts_s`` are the same instants on the
  controller's clock (the device's wall clock, aligned as telemetry is: offset and drift);
- ``telemetry``: every node's samples (long format, ``ts_s`` on the controller's clock, ``t_s``
  seconds from the run's start barrier, the axis request times use);
- ``events``: the orchestration events;
- ``steps``: the paced steps of runs that emulate a target (real and target seconds per step; see
  :mod:`analysis.fidelity`);
- ``scaling_ops``, ``scaling_ticks``: a GPU-rank method's module operations and controller ticks
  (:mod:`testbed.campaign.results`; times in the target's seconds).

A run with ``target.dilation`` k ran everything k times slower: its request and token times are
divided back by k here (the instants on the controller's clock are not), and ``time_dilation`` says k.

Only runs whose ledger state is ``done`` or ``failed`` are read (``failed`` ones keep what they
collected; filter on ``runs.state``); interrupted attempts are never read.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from foundation.clock_alignment import ClockAlignment


@dataclass(frozen=True)
class CampaignData:
    runs: pd.DataFrame
    requests: pd.DataFrame
    tokens: pd.DataFrame
    telemetry: pd.DataFrame
    events: pd.DataFrame
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    scaling_ops: pd.DataFrame = field(default_factory=pd.DataFrame)
    scaling_ticks: pd.DataFrame = field(default_factory=pd.DataFrame)


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def _ledger_runs(directory: Path) -> pd.DataFrame:
    path = directory / "ledger.sqlite"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a campaign directory (no ledger)")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return pd.read_sql_query(
            "SELECT run_id, position, label, state, attempts, started_s, ended_s, reason, failed_node "
            "FROM runs ORDER BY position",
            db,
        )


def _with_run(frame: pd.DataFrame, run_id: str) -> pd.DataFrame:
    frame.insert(0, "run_id", run_id)
    return frame


def _aligned_requests(frame: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    """Add the controller-clock instants of each request (NaN where the rank files carry no wall
    clock origin), aligned as telemetry is: the node's offset at the start and the end of the run,
    drift included (:class:`foundation.clock_alignment.ClockAlignment`)."""
    alignments = {node: ClockAlignment.from_manifest(entry)
                  for node, entry in (manifest.get("clock_offsets") or {}).items()}  # fmt: skip
    origin = frame.get("clock_origin_unix_s", pd.Series(float("nan"), index=frame.index))
    for column in ("arrival_s", "first_token_s", "last_token_s"):
        if column not in frame:
            continue
        node_s = origin + frame[column]
        aligned = pd.Series(node_s, index=frame.index, dtype=float)
        for node, alignment in alignments.items():
            mine = frame["node"] == node
            aligned[mine] = alignment.to_controller(node_s[mine])
        frame[column.removesuffix("_s") + "_ts_s"] = aligned
    return frame


def _undilated(frame: pd.DataFrame, dilation: float) -> pd.DataFrame:
    """Durations and instants relative to the start barrier divided by the run's dilation (not clock
    readings, not what the schedule expected of the user)."""
    frame["time_dilation"] = dilation
    if dilation == 1.0:
        return frame
    for column in frame.columns:
        relative = column.endswith("_s") and not column.endswith(("_unix_s", "_ts_s", "_monotonic_s"))
        if relative and not column.startswith("expected_") and pd.api.types.is_numeric_dtype(frame[column]):
            frame[column] = frame[column] / dilation
    return frame


def load(campaign_dir: str | Path) -> CampaignData:
    directory = Path(campaign_dir)
    runs = _ledger_runs(directory)
    settings_rows, requests, tokens, telemetry, events, steps = [], [], [], [], [], []
    scaling: dict[str, list[pd.DataFrame]] = {"scaling_ops": [], "scaling_ticks": []}
    for run_id in runs.loc[runs.state.isin(["done", "failed"]), "run_id"]:
        run_dir = directory / "runs" / run_id
        manifest_path = run_dir / "manifest.json"
        if not manifest_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        row: dict[str, object] = {"run_id": run_id, "repetition": manifest.get("repetition"),
                                  "seed": manifest.get("seed")}  # fmt: skip
        _flatten("", manifest.get("settings", {}), row)
        settings_rows.append(row)
        dilation = float(((manifest.get("settings") or {}).get("target") or {}).get("dilation") or 1.0)
        for name, bucket in (("requests", requests), ("tokens", tokens)):
            path = run_dir / f"{name}.parquet"
            if path.is_file():
                frame = pd.read_parquet(path)
                if name == "requests":
                    frame = _aligned_requests(frame, manifest)
                    origins = frame["arrival_ts_s"] - frame["arrival_s"] if "arrival_s" in frame else pd.Series()
                    row["origin_ts_s"] = origins.min() if origins.notna().any() else float("nan")
                bucket.append(_with_run(_undilated(frame, dilation), run_id))
        if (run_dir / "steps.parquet").is_file():
            steps.append(_with_run(pd.read_parquet(run_dir / "steps.parquet"), run_id))
        for name, bucket in scaling.items():
            if (run_dir / f"{name}.parquet").is_file():
                bucket.append(_with_run(pd.read_parquet(run_dir / f"{name}.parquet"), run_id))
        for path in sorted((run_dir / "telemetry").glob("*.parquet")):
            frame = _with_run(pd.read_parquet(path), run_id)
            origin = row.get("origin_ts_s", float("nan"))
            frame["t_s"] = frame["ts_s"] - (origin if pd.notna(origin) else frame["ts_s"].min())
            telemetry.append(frame)
        events_path = run_dir / "events.jsonl"
        if events_path.is_file():
            lines = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
            events.append(pd.DataFrame(lines))
    settings = pd.DataFrame(settings_rows)
    if not settings.empty:
        runs = runs.merge(settings, on="run_id", how="left")

    def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    return CampaignData(runs, concat(requests), concat(tokens), concat(telemetry), concat(events), concat(steps),
                        concat(scaling["scaling_ops"]), concat(scaling["scaling_ticks"]))
