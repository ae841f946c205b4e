"""``testbed telemetry import-tegrastats``: a tegrastats log taken on a board outside the testbed (a
lab's own measurement), turned into the long format a recording writes (``<node>.parquet``)."""

from __future__ import annotations

import calendar
import time
from pathlib import Path

import pandas as pd

from foundation.errors import TestbedError
from testbed.energy.telemetry import COLUMNS


def import_tegrastats(log: Path, node: str, out_dir: Path, *, interval_s: float, utc_offset_h: float = 0.0) -> Path:
    """Convert a tegrastats log into ``out_dir/<node>.parquet``. Lines with JetPack 5+ timestamps
    (the board's local time, ``utc_offset_h`` from UTC) keep them; JetPack 4 lines, which have
    none, are placed ``interval_s`` apart from 0. A stand-in's mark makes the power rows modeled."""
    from nodes.jetson.tegrastats import STANDIN_PREFIX, parse_tegrastats, sample_rows

    rows = []
    kind = "measured"
    untimed = 0
    lines = log.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if line.startswith(STANDIN_PREFIX):
            kind = "modeled"
        if not line.strip() or line.startswith("#"):
            continue
        try:
            sample = parse_tegrastats(line)
        except ValueError:
            raise TestbedError(f"{log}:{number}: not a tegrastats line: {line[:80]!r}") from None
        if sample.timestamp is not None:
            stamp = time.strptime(sample.timestamp, "%m-%d-%Y %H:%M:%S")
            ts = float(calendar.timegm(stamp)) - utc_offset_h * 3600.0
        else:
            ts, untimed = untimed * interval_s, untimed + 1
        rows.extend(sample_rows(sample, ts, interval_s, kind))
    if not rows:
        raise TestbedError(f"{log}: no tegrastats lines")
    frame = pd.DataFrame([r._asdict() for r in rows])
    frame["node_ts_s"] = frame["ts_s"]
    frame["node"] = node
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{node}.parquet"
    frame[COLUMNS].to_parquet(path, index=False)
    return path
