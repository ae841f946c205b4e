"""The Jetson source: runs tegrastats and turns its lines into rows (formats: :mod:`nodes.jetson.tegrastats`)."""

import time
from typing import Callable, Iterator, List, Optional

from nodes.contracts.telemetry_rows import MEASURED, MODELED, TelemetryRow
from nodes.jetson.tegrastats import STANDIN_PREFIX, parse_tegrastats, sample_rows
from nodes.telemetry.source import ProcessStream, SourceOptions


class TegrastatsSource(ProcessStream):
    """Runs ``tegrastats --interval MS`` and turns each line into rows stamped on arrival (the
    tool's own timestamp has a resolution of one second)."""

    name = "jetson"

    def __init__(
        self, interval_s: float, command: str = "tegrastats", now: Optional[Callable[[], float]] = None
    ) -> None:
        super(TegrastatsSource, self).__init__()
        self.interval_s = interval_s
        self.now = now or time.time
        self.tool = command
        self.start([command, "--interval", str(max(1, round(interval_s * 1000)))])
        self.kind = MEASURED
        self.header = {"tool": command, "power_kind": MEASURED}

    def batches(self, interval_s: float, stopping: Callable[[], bool]) -> Iterator[List[TelemetryRow]]:
        for line in self.lines(stopping):
            ts_s = self.now()
            if line.startswith("#"):
                if line.startswith(STANDIN_PREFIX):
                    self.kind = MODELED
                    self.header["power_kind"] = MODELED
                continue
            try:
                sample = parse_tegrastats(line)
            except ValueError:
                continue
            yield sample_rows(sample, ts_s, self.interval_s, self.kind)


PACES_ITSELF = True


def source(options: SourceOptions) -> TegrastatsSource:
    return TegrastatsSource(options.interval_s)
