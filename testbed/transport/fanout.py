"""Run one operation on many nodes at once, with bounded concurrency.

One failing, unreachable or slow node never aborts the others: every node gets an outcome, with
its value or its error. Operations that take longer than a second show a progress display on a
terminal.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
) -> FanOutResult[T]:
    """Run ``operation(name)`` for every name, at most ``max_parallel`` at a time."""
    if max_parallel < 1:
        raise ValueError("max_parallel must be at least 1")
    start = time.monotonic()
    outcomes: dict[str, NodeOutcome[T]] = {}

    def one(name: str) -> NodeOutcome[T]:
        t0 = time.monotonic()
        try:
            return NodeOutcome(name, operation(name), None, time.monotonic() - t0)
        except Exception as exc:  # every failure becomes that node's outcome
            error = _describe(exc)
            if not isinstance(exc, (NodeError, TestbedError, OSError, TimeoutError)):
                error += "\n" + "".join(traceback.format_exception(exc)[-3:])
            return NodeOutcome(name, None, error, time.monotonic() - t0)

    console = console or Console(stderr=True)
    workers = min(max_parallel, max(1, len(names)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fanout") as pool:
        pending: dict[Future[NodeOutcome[T]], str] = {pool.submit(one, n): n for n in names}
        progress: Progress | None = None
        task = None
        try:
            while pending:
                done, _ = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                for future in done:
                    outcome = future.result()
                    outcomes[outcome.node] = outcome
                    del pending[future]
                if progress is None and pending and console.is_terminal and time.monotonic() - start > PROGRESS_AFTER_S:
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
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            if progress is not None:
                progress.stop()
    return FanOutResult(tuple(outcomes[n] for n in names), time.monotonic() - start)
