"""The telemetry row (long format) and the append-only file it is written to.

One row is one reading: ``ts_s`` (the node's wall clock, seconds since the epoch), ``metric``
(with its unit in the name, e.g. ``power_mw``), ``value``, ``unit``, ``sensor`` (rail, GPU index,
battery, ...), ``kind`` (``measured`` or ``modeled``) and ``period_s`` (the sensor's native update
period where known, else the sampling interval). Files are CSV with ``#`` comment lines carrying a
JSON header (source, node, interval, start), so that pandas reads them with ``comment="#"``.
"""

import csv
import io
import json
import os
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, TextIO

COLUMNS = ("ts_s", "metric", "value", "unit", "sensor", "kind", "period_s")
MEASURED = "measured"
MODELED = "modeled"
FSYNC_EVERY_S = 1.0


class TelemetryRow(NamedTuple):
    ts_s: float
    metric: str
    value: float
    unit: str
    sensor: str
    kind: str  # measured | modeled
    period_s: float

    def csv_line(self) -> str:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(
            [
                "%.6f" % self.ts_s,
                self.metric,
                repr(float(self.value)),
                self.unit,
                self.sensor,
                self.kind,
                "%g" % self.period_s,
            ]
        )
        return buffer.getvalue()


class RowWriter:
    """Appends rows to a CSV file: every batch is flushed to the OS at once (a killed sampler loses
    nothing it wrote) and fsynced at least every second (a node that loses power loses at most
    the last second)."""

    def __init__(self, path: str, header: Optional[Dict[str, Any]] = None) -> None:
        self.path = path
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.file: TextIO = open(path, "a")  # noqa: SIM115 - open for the writer's lifetime, closed by close()
        if new:
            if header is not None:
                self.file.write("# " + json.dumps(header, sort_keys=True) + "\n")
            self.file.write(",".join(COLUMNS) + "\n")
        elif header is not None:
            self.file.write("# resumed " + json.dumps(header, sort_keys=True) + "\n")
        self._flush(force=True)
        self.rows_written = 0

    def _flush(self, force: bool = False) -> None:
        self.file.flush()
        now = time.monotonic()
        if force or now - getattr(self, "_synced_at", 0.0) >= FSYNC_EVERY_S:
            os.fsync(self.file.fileno())
            self._synced_at = now

    def write(self, rows: Iterable[TelemetryRow]) -> int:
        count = 0
        for row in rows:
            self.file.write(row.csv_line())
            count += 1
        self.rows_written += count
        self._flush()
        return count

    def comment(self, text: str) -> None:
        self.file.write("# " + text.replace("\n", " ") + "\n")
        self._flush()

    def close(self) -> None:
        if not self.file.closed:
            self._flush(force=True)
            self.file.close()


def read_rows(path: str) -> List[TelemetryRow]:
    """Every row of a sampler file (comment lines and a torn last line are skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or line.startswith("ts_s,") or not line.endswith("\n"):
                continue
            fields = next(csv.reader([line]))
            if len(fields) != len(COLUMNS):
                continue
            rows.append(
                TelemetryRow(
                    float(fields[0]), fields[1], float(fields[2]), fields[3], fields[4], fields[5], float(fields[6])
                )
            )
    return rows


def read_header(path: str) -> Dict[str, Any]:
    """The JSON header of a sampler file (the first comment line)."""
    with open(path) as f:
        first = f.readline()
    if first.startswith("# {"):
        return dict(json.loads(first[2:]))
    return {}
