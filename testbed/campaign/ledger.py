"""The campaign ledger: one SQLite database (WAL) per campaign directory, the truth about runs.

States: ``todo`` -> ``running`` (attempts + 1) -> ``done`` | ``failed``; ``skipped`` when a run
needs a quarantined node. Every change is one transaction, so a controller killed at any moment
leaves the ledger consistent: a run still ``running`` when a campaign resumes was interrupted, and
is decided again from what is on disk (see :mod:`testbed.campaign.runner`), never counted twice.
Nodes have a row too: failed runs in a row, and when they were quarantined.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from nodes.contracts.durable import rename_durably

STATES = ("todo", "running", "done", "failed", "skipped")
SCHEMA = """
CREATE TABLE IF NOT EXISTS campaign (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    position INTEGER NOT NULL,
    label TEXT NOT NULL,
    nodes TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('todo', 'running', 'done', 'failed', 'skipped')),
    attempts INTEGER NOT NULL DEFAULT 0,
    started_s REAL,
    ended_s REAL,
    reason TEXT,
    failed_node TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    failures_in_row INTEGER NOT NULL DEFAULT 0,
    quarantined_s REAL,
    reason TEXT
);
"""


@dataclass(frozen=True)
class RunRow:
    run_id: str
    position: int
    label: str
    nodes: tuple[str, ...]
    state: str
    attempts: int
    started_s: float | None
    ended_s: float | None
    reason: str | None
    failed_node: str | None


def finished_seconds(rows: Sequence[RunRow]) -> list[float]:
    """How long each run that finished (done or failed, its last attempt) took, from the ledger's times."""
    return [r.ended_s - r.started_s for r in rows
            if r.state in ("done", "failed") and r.started_s is not None and r.ended_s is not None]  # fmt: skip


@dataclass(frozen=True)
class NodeRow:
    node: str
    failures_in_row: int
    quarantined_s: float | None
    reason: str | None


class Ledger:
    """A campaign's ledger. Open it with :meth:`create` (a new campaign) or :meth:`open`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    @classmethod
    def create(cls, path: Path, meta: dict[str, Any], runs: Sequence[tuple[str, str, Sequence[str]]]) -> Ledger:
        """A new ledger with ``runs`` (id, label, nodes) as ``todo`` in campaign order. It is built
        beside ``path`` and renamed into place whole: a controller killed meanwhile leaves no ledger
        (nothing was started), never one without its runs."""
        if path.exists():
            raise TestbedError(f"{path} exists: resume that campaign with --resume, or choose another --out")
        path.parent.mkdir(parents=True, exist_ok=True)
        building = path.with_name(path.name + ".new")
        for leftover in ("", "-wal", "-shm", "-journal"):  # of a create that was killed
            Path(f"{building}{leftover}").unlink(missing_ok=True)
        ledger = cls(building)
        try:
            with ledger._transaction() as db:
                db.executemany("INSERT INTO campaign VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
                db.executemany(
                    "INSERT INTO runs (run_id, position, label, nodes, state) VALUES (?, ?, ?, ?, 'todo')",
                    [(run_id, i, label, json.dumps(list(nodes))) for i, (run_id, label, nodes) in enumerate(runs)],
                )
            ledger._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # all in the file that moves
        finally:
            ledger.close()
        rename_durably(building, path)
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> Ledger:
        if not path.is_file():
            raise TestbedError(f"{path}: no campaign ledger here (was the campaign started with this --out?)")
        return cls(path)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- reading

    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM campaign")}

    def runs(self) -> list[RunRow]:
        rows = self._db.execute(
            "SELECT run_id, position, label, nodes, state, attempts, started_s, ended_s, reason, failed_node "
            "FROM runs ORDER BY position"
        )
        return [RunRow(r[0], r[1], r[2], tuple(json.loads(r[3])), *r[4:]) for r in rows]

    def run(self, run_id: str) -> RunRow:
        for row in self.runs():
            if row.run_id == run_id:
                return row
        raise KeyError(run_id)

    def counts(self) -> dict[str, int]:
        found = dict(self._db.execute("SELECT state, COUNT(*) FROM runs GROUP BY state").fetchall())
        return {state: int(found.get(state, 0)) for state in STATES}

    def nodes(self) -> list[NodeRow]:
        rows = self._db.execute("SELECT node, failures_in_row, quarantined_s, reason FROM nodes ORDER BY node")
        return [NodeRow(*r) for r in rows]

    def quarantined(self) -> dict[str, str]:
        return {n.node: n.reason or "" for n in self.nodes() if n.quarantined_s is not None}

    # -- changing

    def start(self, run_id: str) -> int:
        """``todo`` -> ``running``; returns the attempt number (1 for the first)."""
        with self._transaction() as db:
            found = db.execute("SELECT state, attempts FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if found is None:
                raise TestbedError(f"no run {run_id} in {self.path}")
            state, attempts = found
            if state != "todo":
                raise TestbedError(f"run {run_id} is {state}, not todo")
            db.execute(
                "UPDATE runs SET state = 'running', attempts = ?, started_s = ?, ended_s = NULL, reason = NULL, "
                "failed_node = NULL WHERE run_id = ?",
                (attempts + 1, time.time(), run_id),
            )
        return attempts + 1

    def finish(
        self, run_id: str, state: str, *, reason: str | None = None, node: str | None = None,
        run_nodes: Sequence[str] = (), quarantine_after: int = 0,
    ) -> list[str]:  # fmt: skip
        """``running`` -> ``done`` | ``failed``, and the nodes' failure streaks in the same
        transaction. Returns the nodes newly quarantined (``node`` failed ``quarantine_after`` runs
        in a row); a node's streak ends with any run it takes part in that does not fail because of it."""
        if state not in ("done", "failed"):
            raise ValueError(state)
        newly: list[str] = []
        with self._transaction() as db:
            changed = db.execute(
                "UPDATE runs SET state = ?, ended_s = ?, reason = ?, failed_node = ? WHERE run_id = ? "
                "AND state = 'running'",
                (state, time.time(), reason, node, run_id),
            ).rowcount
            if not changed:
                return newly  # not running (finished already): nothing is counted twice
            for name in run_nodes:
                if name != node:
                    db.execute(
                        "INSERT INTO nodes (node, failures_in_row) VALUES (?, 0) "
                        "ON CONFLICT(node) DO UPDATE SET failures_in_row = 0", (name,)
                    )  # fmt: skip
            if state == "failed" and node is not None:
                db.execute(
                    "INSERT INTO nodes (node, failures_in_row) VALUES (?, 1) "
                    "ON CONFLICT(node) DO UPDATE SET failures_in_row = failures_in_row + 1", (node,)
                )  # fmt: skip
                streak, quarantined = db.execute(
                    "SELECT failures_in_row, quarantined_s FROM nodes WHERE node = ?", (node,)
                ).fetchone()
                if quarantine_after and streak >= quarantine_after and quarantined is None:
                    db.execute(
                        "UPDATE nodes SET quarantined_s = ?, reason = ? WHERE node = ?",
                        (time.time(), f"failed {streak} runs in a row; last: {reason}", node),
                    )
                    newly.append(node)
        return newly

    def skip(self, run_id: str, reason: str) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE runs SET state = 'skipped', reason = ?, ended_s = ? WHERE run_id = ? AND state = 'todo'",
                (reason, time.time(), run_id),
            )

    def requeue(self, run_id: str, states: Sequence[str]) -> bool:
        """Put a run back to ``todo`` if it is in one of ``states`` (an interrupted ``running`` run,
        or ``failed``/``skipped`` ones the user asks to retry)."""
        marks = ",".join("?" for _ in states)
        with self._transaction() as db:
            changed = db.execute(
                f"UPDATE runs SET state = 'todo' WHERE run_id = ? AND state IN ({marks})", (run_id, *states)
            ).rowcount
        return bool(changed)

    def release(self, node: str) -> None:
        """Lift a node's quarantine (``--retry-failed`` does, for the nodes it retries)."""
        with self._transaction() as db:
            db.execute("UPDATE nodes SET quarantined_s = NULL, reason = NULL, failures_in_row = 0 WHERE node = ?",
                       (node,))  # fmt: skip
