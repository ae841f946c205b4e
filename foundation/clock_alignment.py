"""One clock alignment for everything stamped on a node: telemetry samples and request instants.

A node's offset (node clock minus controller clock) is measured when a run starts and when it ends;
between the two it is taken as linear in time, so drift is corrected too:

    offset(t) = o0 + (o1 - o0) / (c1 - c0) * (t - o0 - c0),    controller time = t - offset(t)

where ``t`` is a node-clock instant and ``c0``, ``c1`` the controller's times of the measurements. With
one measurement (or two at the same instant) it is a constant offset. Works on floats and on numpy
arrays or pandas Series alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClockAlignment:
    start_controller_s: float  # controller time of the first offset measurement (Unix seconds)
    start_offset_s: float  # node minus controller, then
    end_controller_s: float
    end_offset_s: float

    @classmethod
    def constant(cls, offset_s: float) -> ClockAlignment:
        return cls(0.0, offset_s, 0.0, offset_s)

    @property
    def drift(self) -> float:
        """Seconds of offset gained per second (0 for a constant offset)."""
        span = self.end_controller_s - self.start_controller_s
        return (self.end_offset_s - self.start_offset_s) / span if span > 0 else 0.0

    @property
    def drift_ppm(self) -> float:
        return self.drift * 1e6

    def offset_at(self, node_s: Any) -> Any:
        """The node's offset at node-clock instant(s) ``node_s``."""
        return self.start_offset_s + self.drift * (node_s - self.start_offset_s - self.start_controller_s)

    def to_controller(self, node_s: Any) -> Any:
        """Node-clock instant(s) ``node_s`` on the controller's clock."""
        return node_s - self.offset_at(node_s)

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> ClockAlignment:
        """From a manifest's ``clock_offsets[node]``: ``start`` and ``end`` offsets with the controller
        times they were measured at (older manifests lack the times: a constant start offset then)."""
        start, end = entry.get("start") or {}, entry.get("end") or {}
        o0 = float(start.get("offset_s", 0.0))
        if "start_unix_s" not in entry or "end_unix_s" not in entry or not end:
            return cls.constant(o0)
        return cls(float(entry["start_unix_s"]), o0, float(entry["end_unix_s"]), float(end.get("offset_s", o0)))
