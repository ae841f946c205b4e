"""What one run of a campaign has done so far, shared by its phases: the run's state (what restore
must undo and the manifest records), its event log, what it leaves configured for the next run, how
it ended, and the helpers its phases share (failing on a node, noting processes before they start,
running calls side by side).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundation.errors import NodeError, TestbedError
from nodes.contracts.durable import SyncedLines, write_json_atomic
from testbed.campaign.plan import RunPlan
from testbed.workers.pool import PreparedRun


class EventLog:
    """``events.jsonl``: one line per orchestration event, flushed and synced as it happens."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path, self.run_id = path, run_id
        self._file = SyncedLines(path)
        self._lock = threading.Lock()  # phases that run side by side write here too

    def write(self, event: str, **details: Any) -> None:
        row = {"ts_s": round(time.time(), 6), "run_id": self.run_id, "event": event, **details}
        with self._lock:
            self._file.write(json.dumps(row, default=str))

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class Kept:
    """What a run left configured for the next run (restored after it, or when the campaign ends)."""

    power: frozenset[str] = frozenset()  # nodes whose power mode stays set
    links: frozenset[str] = frozenset()  # nodes whose shaping stays in place
    contexts: dict[str, Any] = field(default_factory=dict)  # the run plan's node contexts

    def __bool__(self) -> bool:
        return bool(self.power or self.links)


@dataclass(frozen=True)
class RunOutcome:
    state: str  # done | failed
    reason: str | None
    failed_node: str | None
    requests_scheduled: int
    requests_completed: int
    kept: Kept = Kept()


@dataclass
class RunState:
    """What a run has done so far: what restore must undo and what the manifest records."""

    phases_s: dict[str, float] = field(default_factory=dict)
    power_set: dict[str, str] = field(default_factory=dict)  # node -> mode, set by this run
    power_unchanged: dict[str, str] = field(default_factory=dict)  # node -> mode it held already
    power_read_back: dict[str, Any] = field(default_factory=dict)
    shaped_nodes: tuple[str, ...] = ()
    links: dict[str, Any] = field(default_factory=dict)
    recording: Any = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    schedules: dict[str, list[dict]] = field(default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=dict)
    completed: int = 0
    failure: tuple[str, str, str | None] | None = None  # phase, reason, node
    plan: RunPlan | None = None  # made in preflight, with the nodes read back
    workers: dict[str, Any] = field(default_factory=dict)  # which pool served the run, warm or cold
    kept: Kept = Kept()
    prepared: PreparedRun | None = None  # staged, with its pool up
    fidelity: dict[str, Any] = field(default_factory=dict)  # per node: paced steps that overran their target
    paced_nodes: tuple[str, ...] = ()  # emulated nodes whose CPU quota is paced for this run
    flag: str | None = None  # said of a run that is done but not faithful (over the violation limit)
    services: tuple[Any, ...] = ()  # LLM service daemons started (testbed.workers.context_service.ServicePlan)
    _failing: threading.Lock = field(default_factory=threading.Lock)  # phases side by side may fail at once

    def fail(self, phase: str, reason: str, node: str | None) -> None:
        """Record the run's failure: the first one to happen (the others are in events.jsonl)."""
        with self._failing:
            if self.failure is None:
                self.failure = (phase, reason, node)


def side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` at once (each in a thread but the first) and wait for all of them."""
    threads = [threading.Thread(target=call, daemon=True) for call in calls[1:]]
    for thread in threads:
        thread.start()
    try:
        calls[0]()
    finally:
        for thread in threads:
            thread.join()


def plan_of(state: RunState) -> RunPlan:
    if state.plan is None:
        raise TestbedError("the run has no plan (preflight did not finish)")
    return state.plan


def require(result: Any, what: str) -> None:
    if not result.ok:
        first = result.failed[0]
        raise NodeError(first.node, f"{what}: {first.error}")


PROCESSES_LOCK = threading.Lock()  # telemetry and staging note their processes side by side


def note_processes(directory: Path, entries: list[dict[str, str]]) -> None:
    """Add processes about to be started on nodes to ``processes.json`` (synced before they start)."""
    path = directory / "processes.json"
    with PROCESSES_LOCK:
        known = json.loads(path.read_text()) if path.exists() else []
        write_json_atomic(path, known + entries)
