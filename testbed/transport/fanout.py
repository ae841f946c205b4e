"""Run one operation on many nodes at once, with bounded concurrency and per-node deadlines.

One failing, unreachable or slow node never aborts the others: every node gets an outcome, with
its value or its error. Operations that take longer than a second show a progress display on a
terminal.

A node whose operation runs past ``deadline_s`` gets an error outcome at that moment and its place
goes to the next node. Its call cannot be interrupted (Python threads cannot be), so it is left to
end in its daemon thread, by the transport's own bounds (every wait on a node is bounded); what it
returns then is discarded, and the controller's exit never waits for it (it ends with the process).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from foundation.errors import NodeError, TestbedError

T = TypeVar("T")

DEFAULT_PARALLEL = 32
PROGRESS_AFTER_S = 1.0


@dataclass(frozen=True)
class NodeOutcome(Generic[T]):
    """What the operation did on one node."""

    node: str
    value: T | None
    error: str | None
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class FanOutResult(Generic[T]):
    """Every node's outcome, in the order the nodes were given."""

    outcomes: tuple[NodeOutcome[T], ...]
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    @property
    def failed(self) -> tuple[NodeOutcome[T], ...]:
        return tuple(o for o in self.outcomes if not o.ok)

    def values(self) -> dict[str, T]:
        return {o.node: o.value for o in self.outcomes if o.ok and o.value is not None}

    def require(self, what: str) -> dict[str, T]:
        """Every node's value; if any node failed, a NodeError naming the first and listing all."""
        if self.failed:
            detail = "; ".join(f"{o.node}: {o.error}" for o in self.failed)
            raise NodeError(self.failed[0].node, f"{what} failed ({detail})")
        return {o.node: o.value for o in self.outcomes}  # type: ignore[misc]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NodeError):
        return exc.message
    if isinstance(exc, TestbedError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def fan_out(
    names: Sequence[str],
    operation: Callable[[str], T],
    *,
    max_parallel: int = DEFAULT_PARALLEL,
    description: str = "working",
    console: Console | None = None,
    deadline_s: float | None = None,
) -> FanOutResult[T]:
    """Run ``operation(name)`` for every name, at most ``max_parallel`` at a time; a node still
    running after ``deadline_s`` gets an error outcome and is left behind (module docstring)."""
    if max_parallel < 1:
        raise ValueError("max_parallel must be at least 1")
    start = time.monotonic()
    outcomes: dict[str, NodeOutcome[T]] = {}
    todo = deque(names)
    running: dict[str, float] = {}  # node -> when its operation started
    left_behind: set[str] = set()
    finished: queue.SimpleQueue[NodeOutcome[T]] = queue.SimpleQueue()
    lock = threading.Lock()

    def one(name: str) -> NodeOutcome[T]:
        t0 = time.monotonic()
        try:
            return NodeOutcome(name, operation(name), None, time.monotonic() - t0)
        except BaseException as exc:  # every failure becomes that node's outcome
            error = _describe(exc)
            if not isinstance(exc, (NodeError, TestbedError, OSError, TimeoutError)):
                error += "\n" + "".join(traceback.format_exception(exc)[-3:])
            return NodeOutcome(name, None, error, time.monotonic() - t0)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                name = todo.popleft()
                running[name] = time.monotonic()
            outcome = one(name)
            with lock:
                del running[name]
                behind = name in left_behind
            finished.put(outcome)
            if behind:
                return  # its place went to another worker when it was left behind

    def spawn() -> None:
        threading.Thread(target=worker, name="fanout", daemon=True).start()

    console = console or Console(stderr=True)
    for _ in range(min(max_parallel, len(names))):
        spawn()
    progress: Progress | None = None
    task = None
    try:
        while len(outcomes) < len(names):
            try:
                outcome = finished.get(timeout=0.1)
                if outcome.node not in outcomes:  # one left behind that ended after all is discarded
                    outcomes[outcome.node] = outcome
            except queue.Empty:
                pass
            if deadline_s is not None:
                now = time.monotonic()
                with lock:
                    late = {n: now - t0 for n, t0 in running.items() if now - t0 >= deadline_s and n not in left_behind}
                    left_behind.update(late)
                for name, ran_s in late.items():
                    outcomes[name] = NodeOutcome(
                        name, None, f"did not finish within its deadline of {deadline_s:g} s (left running in "
                        "the background, its result discarded)", ran_s,
                    )  # fmt: skip
                    spawn()
            waiting = len(outcomes) < len(names)
            if progress is None and waiting and console.is_terminal and time.monotonic() - start > PROGRESS_AFTER_S:
                progress = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=console,
                    transient=True,
                )
                progress.start()
                task = progress.add_task(description, total=len(names))
            if progress is not None and task is not None:
                progress.update(task, completed=len(outcomes))
    except KeyboardInterrupt:
        # Nodes not started yet are dropped; those under way end by their own timeouts.
        with lock:
            todo.clear()
        raise
    finally:
        if progress is not None:
            progress.stop()
    return FanOutResult(tuple(outcomes[n] for n in names), time.monotonic() - start)
