"""The live progress of ``testbed run``: runs done/failed/skipped of the total, the time the rest
should take (the ledger's run times), the current run, its phase and the requests its devices have
served. A rich live panel on a terminal; plain lines
(one per phase and per run) when the output is a file or a pipe."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table


def eta_s(run_seconds: Sequence[float], runs_left: int) -> float | None:
    """The time the runs left should take: each the median of the runs that finished (None before one has)."""
    if not run_seconds or runs_left <= 0:
        return None
    return statistics.median(run_seconds) * runs_left


def eta_text(run_seconds: Sequence[float], runs_left: int) -> str:
    """``about 12 min left (8 runs at the median 90 s of 4)``, or '' before a run has finished."""
    left = eta_s(run_seconds, runs_left)
    if left is None:
        return ""
    shown = f"{left / 3600:.1f} h" if left >= 5400 else f"{left / 60:.0f} min" if left >= 90 else f"{left:.0f} s"
    runs = f"{runs_left} run{'s' if runs_left != 1 else ''}"
    return f"about {shown} left ({runs} at the median {statistics.median(run_seconds):.0f} s of {len(run_seconds)})"


class CampaignDisplay:
    def __init__(self, console: Console, total: int) -> None:
        self.console, self.total = console, total
        self.counts: dict[str, int] = {}
        self.run_id, self.label, self.phase, self.attempt = "", "", "", 0
        self.served, self.scheduled = 0, 0
        self.run_started = time.monotonic()
        self.eta = ""
        self._live: Live | None = None

    def __enter__(self) -> CampaignDisplay:
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)

    def say(self, line: str) -> None:
        self.console.print(escape(line), highlight=False, soft_wrap=True)

    def report(self, event: str, details: dict[str, Any]) -> None:
        """Called by the runner: ``campaign``, ``run_start``, ``phase``, ``served``, ``run_end``."""
        self.counts = details.get("counts", self.counts)
        if event == "run_start":
            self.run_id, self.label, self.attempt = details["run_id"], details["label"], details["attempt"]
            self.served, self.scheduled, self.phase = 0, 0, ""
            self.run_started = time.monotonic()
            place = f"{details['position'] + 1}/{self.total}"
            c = self.counts
            self.eta = eta_text(details.get("run_seconds", ()), c.get("todo", 0) + c.get("running", 0))
            eta = f"; {self.eta}" if self.eta else ""
            self._line(f"run {place} {self.run_id} ({self.label}), attempt {self.attempt}{eta}")
        elif event == "phase":
            self.phase = details["phase"]
            self._line(f"  {self.phase}")
        elif event == "served":
            self.served, self.scheduled = details["served"], details["scheduled"]
        elif event == "run_end":
            reason = f": {details['reason']}" if details.get("reason") else ""
            took = f" in {time.monotonic() - self.run_started:.1f} s" if details["run_id"] == self.run_id else ""
            self._line(f"  -> {details['state']}{took}{reason}")
        if self._live is not None:
            self._live.update(self._render())

    def _line(self, text: str) -> None:
        if self._live is None:
            self.console.print(escape(text), highlight=False, soft_wrap=True)
        else:
            self._live.console.print(escape(text), highlight=False, soft_wrap=True)

    def _render(self) -> Table:
        c = self.counts
        table = Table.grid(padding=(0, 2))
        table.add_row(
            "[bold]runs[/]",
            f"{c.get('done', 0)} done, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped, "
            f"{c.get('todo', 0) + c.get('running', 0)} to go, of {self.total}",
        )
        if self.eta:
            table.add_row("[bold]left[/]", escape(self.eta))
        if self.run_id:
            table.add_row("[bold]now[/]", escape(f"{self.run_id} ({self.label})"))
            table.add_row("[bold]phase[/]", escape(self.phase))
            if self.scheduled:
                table.add_row("[bold]requests[/]", f"{self.served} of {self.scheduled} served")
        return table
