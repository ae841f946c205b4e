"""A campaign directory as pandas DataFrames.

``load(campaign_dir)`` reads the ledger and every run directory and returns :class:`CampaignData`:

- ``runs``: one row per run of the ledger (state, attempts, reason), with the run's settings
  flattened into columns (``method``, ``link.profile``, ``power.orin``, ``workload.rate_per_s``, ...)
  from its manifest;
- ``requests``, ``tokens``: the runs' tables with ``run_id`` in front;
- ``telemetry``: every node's samples (long format, ``ts_s`` on the controller's clock);
- ``events``: the orchestration events.

Only runs whose ledger state is ``done`` or ``failed`` are read (``failed`` ones keep what they
collected; filter on ``runs.state``); interrupted attempts are never read.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass(frozen=True)
class CampaignData:
    runs: pd.DataFrame
    requests: pd.DataFrame
    tokens: pd.DataFrame
    telemetry: pd.DataFrame
    events: pd.DataFrame


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


def load(campaign_dir: str | Path) -> CampaignData:
    directory = Path(campaign_dir)
    runs = _ledger_runs(directory)
    settings_rows, requests, tokens, telemetry, events = [], [], [], [], []
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
        for name, bucket in (("requests", requests), ("tokens", tokens)):
            path = run_dir / f"{name}.parquet"
            if path.is_file():
                bucket.append(_with_run(pd.read_parquet(path), run_id))
        for path in sorted((run_dir / "telemetry").glob("*.parquet")):
            telemetry.append(_with_run(pd.read_parquet(path), run_id))
        events_path = run_dir / "events.jsonl"
        if events_path.is_file():
            lines = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
            events.append(pd.DataFrame(lines))
    settings = pd.DataFrame(settings_rows)
    if not settings.empty:
        runs = runs.merge(settings, on="run_id", how="left")

    def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    return CampaignData(runs, concat(requests), concat(tokens), concat(telemetry), concat(events))
