"""A run's rank files as its two tables: ``requests.parquet`` and ``tokens.parquet``.

``requests.parquet`` has one row per *scheduled* request: what the device recorded (times in
seconds on the device's clock from the run's start barrier, nested timings flattened as
``prefill_*``/``decode_*``) joined with what the schedule asked for (``expected_ttft_s``,
``expected_tds_tok_s``, ``prompt_source``). A request that never finished keeps its row with
``completed`` false, so a failed run's tables say what was missing. ``clock_origin_unix_s`` is the
device's wall clock at its start barrier (from the rank file's header), which lets analysis put
request times on the controller's clock. ``tokens.parquet`` has one row
per delivered token (``node``, ``request_id``, ``index``, ``token_id``, ``ts_s``, and for a streaming
method's clients ``display_s``, when the token buffer showed it). A run that
paces steps (one that emulates a target, or DiSCo's endpoints, whose tokens keep a trace's or a
phone's pace) also gets ``steps.parquet``: every paced step with its real and target seconds.
A run of a GPU-rank method (CoCoServe) gets ``scaling_ops.parquet`` (each module operation or batch
change: the engine's time, kind, layer, GPUs, seconds, bytes) and ``scaling_ticks.parquet`` (each
controller tick: the violation rate, the decision, its action as ``action_*`` columns, and per GPU
its vacancy and bytes used as ``vacancy_<gpu>`` and ``used_bytes_<gpu>``); their times are the
target's seconds already.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from nodes.contracts.rank_dirs import device_glob, parse_rank_dir

SCHEDULE_COLUMNS = ("expected_ttft_s", "expected_tds_tok_s", "prompt_source")
TOKEN_COLUMNS = ["node", "request_id", "index", "token_id", "ts_s"]
OPTIONAL_TOKEN_COLUMNS = ["display_s"]  # a streaming client's token buffer: when each token was shown


def _lines(path: Path) -> list[str]:
    """A rank file's lines without its ``#`` header and without a torn last line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] != "":
        lines = lines[:-1]  # written up to a crash: the last line may be cut
    return [line for line in lines if line and not line.startswith("#")]


def _flatten(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}_"))
        else:
            out[prefix + key] = value
    return out


def read_header(path: Path) -> dict[str, Any]:
    """A rank file's ``#`` header (its first line), or {} when it has none."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            first = f.readline()
        return json.loads(first[1:]) if first.startswith("#") else {}
    except (OSError, json.JSONDecodeError):
        return {}


def clock_origins_unix_s(ranks: Path) -> dict[str, float]:
    """Each device's wall clock at the start barrier, by node, from its rank files' headers."""
    origins = {}
    for path in sorted(ranks.glob(device_glob() + "/requests.jsonl")):
        header = read_header(path)
        if "clock_origin_unix_s" in header:
            origins[str(header.get("node", _node_of(path.parent)))] = float(header["clock_origin_unix_s"])
    return origins


def read_requests(ranks: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(ranks.glob(device_glob() + "/requests.jsonl")):
        for line in _lines(path):
            try:
                rows.append(_flatten(json.loads(line)))
            except json.JSONDecodeError:
                continue
    return pd.DataFrame(rows)


def read_tokens(ranks: Path) -> pd.DataFrame:
    frames = []
    for path in sorted(ranks.glob(device_glob() + "/tokens.csv")):
        node = _node_of(path.parent)
        body = "\n".join(_lines(path))
        if body.count("\n") < 1:
            continue  # the column header alone
        frame = pd.read_csv(io.StringIO(body))
        frame.insert(0, "node", node)
        frames.append(frame)
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype="float64" if c == "ts_s" else "int64") for c in TOKEN_COLUMNS[1:]}
                            ).assign(node=pd.Series(dtype="object"))[TOKEN_COLUMNS]  # fmt: skip
    tokens = pd.concat(frames, ignore_index=True)
    return tokens[TOKEN_COLUMNS + [c for c in OPTIONAL_TOKEN_COLUMNS if c in tokens]]


def requests_table(ranks: Path, schedules: Mapping[str, Sequence[Mapping[str, Any]]]) -> pd.DataFrame:
    """Every scheduled request, with what its device recorded where it finished."""
    scheduled = pd.DataFrame(
        [
            {"node": node, "request_id": int(r["request_id"]), "scheduled_arrival_s": float(r["arrival_s"]),
             "scheduled_prompt_tokens": r.get("prompt_tokens"), **{c: r.get(c) for c in SCHEDULE_COLUMNS}}
            for node, rows in schedules.items() for r in rows
        ],
        columns=["node", "request_id", "scheduled_arrival_s", "scheduled_prompt_tokens", *SCHEDULE_COLUMNS],
    )  # fmt: skip
    recorded = read_requests(ranks) if ranks.is_dir() else pd.DataFrame()
    if recorded.empty:
        table = scheduled.assign(completed=False)
    else:
        recorded = recorded.drop(columns=[c for c in ("method",) if c in recorded])
        table = scheduled.merge(recorded, on=["node", "request_id"], how="outer", indicator=True)
        table["completed"] = table.pop("_merge") != "left_only"
    origins = clock_origins_unix_s(ranks) if ranks.is_dir() else {}
    table["clock_origin_unix_s"] = table["node"].map(origins).astype("float64")
    return table.sort_values(["node", "request_id"], kind="stable").reset_index(drop=True)


def read_steps(ranks: Path) -> pd.DataFrame:
    """Every paced step of every rank (``steps.csv``, written when the run emulates a target), with the
    rank's ``role``, ``index`` and ``node`` in front; empty when nothing was paced."""
    frames = []
    for path in sorted(ranks.glob("*/steps.csv")) if ranks.is_dir() else []:
        rank = parse_rank_dir(path.parent.name)
        body = "\n".join(_lines(path))
        if rank is None or body.count("\n") < 1:
            continue
        frame = pd.read_csv(io.StringIO(body))
        frame.insert(0, "node", rank.node)
        frame.insert(0, "index", rank.index)
        frame.insert(0, "role", rank.role)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def read_scaling(ranks: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The instance engine's module operations and controller ticks (empty frames when none)."""
    ops, ticks = [], []
    for path in sorted(ranks.glob("*/scaling_ops.csv")) if ranks.is_dir() else []:
        body = "\n".join(_lines(path))
        if body.count("\n") >= 1:
            ops.append(pd.read_csv(io.StringIO(body)))
    for path in sorted(ranks.glob("*/scaling_ticks.jsonl")) if ranks.is_dir() else []:
        ticks += [_flatten(json.loads(line)) for line in _lines(path)]
    return (pd.concat(ops, ignore_index=True) if ops else pd.DataFrame()), pd.DataFrame(ticks)


def write_results(ranks: Path, schedules: Mapping[str, Sequence[Mapping[str, Any]]], directory: Path) -> None:
    """Write ``requests.parquet`` and ``tokens.parquet`` (and ``steps.parquet`` for a paced run) into
    ``directory`` from ``ranks``."""
    requests_table(ranks, schedules).to_parquet(directory / "requests.parquet", index=False)
    tokens = read_tokens(ranks) if ranks.is_dir() else read_tokens(Path("/nonexistent"))
    tokens.to_parquet(directory / "tokens.parquet", index=False)
    steps = read_steps(ranks)
    if not steps.empty:
        steps.to_parquet(directory / "steps.parquet", index=False)
    ops, ticks = read_scaling(ranks)
    for name, frame in (("scaling_ops", ops), ("scaling_ticks", ticks)):
        if not frame.empty:
            frame = frame.drop(columns=[c for c in ("action",) if c in frame])  # (none; else its action_* columns)
            frame.to_parquet(directory / f"{name}.parquet", index=False)


def _node_of(rank_dir: Path) -> str:
    rank = parse_rank_dir(rank_dir.name)
    return rank.node if rank is not None else rank_dir.name
