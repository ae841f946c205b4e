"""A run plan's shell lines: what one line says (:class:`PlannedCommand`) and the list the action
modules write them into (:class:`PlanLines`). Each action module (power, telemetry, links, split run,
worker pool, LLM services, pacing) plans its own lines with the functions it runs them with, so what
``--dry-run`` prints is what the run sends; :mod:`testbed.campaign.plan` calls them in phase order.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from testbed.commands.node_context import NodeContext
from testbed.inventory import Inventory, NodeSpec, host_of
from testbed.transport.base import background_start_script, command_line, store_script

WHEN = ("once", "per-campaign", "if-missing", "polled", "on-failure", "live", "if-cold", "if-differs", "at-release")
STORED_SIZE = re.compile(r"(-eq |of )\d+( bytes)?")


@dataclass(frozen=True)
class PlannedCommand:
    """One shell line the run sends to a node, exactly as the transport runs it."""

    node: str  # the inventory node it concerns
    host: str  # the node whose transport runs it (a phone's USB host)
    phase: str
    what: str
    line: str
    when: str = "once"
    short: str = ""  # the same for a reader: what a detached process runs, which file is stored

    @property
    def shown(self) -> str:
        return self.short or self.line.removeprefix("exec ")


def normalised_line(line: str) -> str:
    """A command line with stored files' byte counts replaced by ``<N>`` (for comparing runs with plans)."""
    return STORED_SIZE.sub(lambda m: m.group(1) + "<N>" + (m.group(2) or ""), line)


def sh(script: str) -> str:
    """``script`` as the transport sends it: ``sh -c '...'``."""
    return command_line(["sh", "-c", script])


class PlanLines:
    """The lines of one run plan, appended in the order the run sends them."""

    def __init__(self, lab: Inventory) -> None:
        self.lab = lab
        self.out: list[PlannedCommand] = []

    def add(self, node: NodeSpec | str, phase: str, what: str, line: str, when: str = "once", short: str = "") -> None:
        assert when in WHEN, when
        spec = self.lab.node(node) if isinstance(node, str) else node
        self.out.append(PlannedCommand(spec.name, host_of(spec), phase, what, line, when, short))

    def store(self, node: str, phase: str, what: str, path: str, when: str = "once") -> None:
        """Storing a file at ``path`` (its byte count shown as ``<N>``)."""
        self.add(node, phase, what, normalised_line(sh(store_script(path, 0))), when, f"(store) {path}")

    def detached(
        self, node: str, phase: str, what: str, argv: Sequence[str], pidfile: str, logfile: str, when: str = "once"
    ) -> None:
        """Starting ``argv`` detached, its pid in ``pidfile``."""
        self.add(node, phase, what, sh(background_start_script(argv, pidfile, logfile, None)), when,
                 f"(detached, pid in {pidfile}) {shlex.join(argv)}")  # fmt: skip

    def node_code(self, node: str, phase: str, context: NodeContext) -> None:
        """Storing the node code bundle where the node has none (a provisioned node has its venv's wheel)."""
        if not context.uses_bundle:
            return
        self.add(node, phase, "is the node code bundle there?", command_line(["test", "-s", context.code_path]))
        self.store(node, phase, "store the node code bundle", context.code_path, "if-missing")
