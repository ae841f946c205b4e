"""Append-only result files a rank writes, flushed as it goes, so that a crash loses nothing.

Devices write ``requests.jsonl`` (one line per finished request) and ``tokens.csv`` (one row per
delivered token); server stages write ``iterations.csv`` (one row per iteration). Times are
seconds on the rank's own monotonic clock counted from the run's start barrier; the first line of
each file (a ``#`` comment) gives that origin as the absolute monotonic time and the node's name.
"""

import csv
import json
import os
from typing import Any, Dict, Sequence


class CsvLog:
    def __init__(self, path: str, columns: Sequence[str], header: Dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._handle = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115 (open for the run)
        self._handle.write("# " + json.dumps(header, sort_keys=True) + "\n")
        self._writer = csv.DictWriter(self._handle, fieldnames=list(columns), extrasaction="raise")
        self._writer.writeheader()
        self._handle.flush()

    def write(self, row: Dict[str, Any]) -> None:
        self._writer.writerow(row)

    def write_many(self, rows: Sequence[Dict[str, Any]]) -> None:
        self._writer.writerows(rows)
        self._handle.flush()

    def flush(self) -> None:
        self._handle.flush()

    def close(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


class JsonLinesLog:
    def __init__(self, path: str, header: Dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._handle = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open for the run)
        self._handle.write("# " + json.dumps(header, sort_keys=True) + "\n")
        self._handle.flush()

    def write(self, record: Dict[str, Any]) -> None:
        self._handle.write(json.dumps(record, sort_keys=True) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
