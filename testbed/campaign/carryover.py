"""What a run of a campaign takes over from the run just before it in the same invocation: the warm
worker pool (:mod:`testbed.workers.pool`), what planning read from the nodes that does not change
between runs (home directories, the node code's Python, ``mpiexec``; tc state is read again for
every run), and sensor probes that the last run's samplers bore out.

A probe is borne out when the node's sampler of the run before, of the same kind, delivered rows
with no gap longer than five sampling intervals (or a second): its sensors were working moments ago,
so the run does not start a probe on the node again (on a throttled board a probe costs about a
second). Any other outcome, and any node the run before did not sample, is probed as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testbed.campaign.plan import NodeReads
from testbed.energy.telemetry import ProbeResult
from testbed.workers.pool import PoolKeeper

GAP_INTERVALS = 5.0  # a sampler whose longest gap exceeds this many intervals (or 1 s) proves nothing


@dataclass
class Carryover:
    pools: PoolKeeper
    reads: NodeReads = field(default_factory=NodeReads)
    _proven: dict[str, tuple[ProbeResult, str, str]] = field(default_factory=dict)  # node -> probe, run, source
    _proving: dict[str, tuple[ProbeResult, str, str]] = field(default_factory=dict)

    def start_run(self) -> None:
        """A new run: what the run before bore out becomes usable; what is read per run is forgotten."""
        self._proven, self._proving = self._proving, {}
        self.reads.forget_per_run()

    def proven_probes(self, jetson_source: str) -> dict[str, ProbeResult]:
        return {node: probe for node, (probe, _run, source) in self._proven.items() if source == jetson_source}

    def proven_by(self, node: str) -> str | None:
        """The run whose sampler bore out ``node``'s probe, if it is taken over."""
        return self._proven[node][1] if node in self._proven else None

    def note_samplers(self, run_id: str, recording: Any, result: Any, jetson_source: str) -> None:
        """Keep the probes that this run's samplers bore out (``recording``: the run's Recording,
        ``result``: what finishing it gave)."""
        limit_s = max(1.0, GAP_INTERVALS * recording.interval_s)
        for node in result.nodes:
            gap = node.max_gap_s
            if node.rows > 0 and gap is not None and gap <= limit_s and node.node not in result.errors:
                self._proving[node.node] = (recording.probes[node.node], run_id, jetson_source)
