"""The interface every telemetry source implements, and the probe that checks its sensors.

A source yields batches of :class:`~nodes.contracts.telemetry_rows.TelemetryRow`. Polled sources (NVML,
/proc/stat, RAPL, battery files, the emulated power model) implement :meth:`PolledSource.sample`
and are timed here on a deadline schedule; stream sources (tegrastats) pace themselves.
"""

import subprocess
import time
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from nodes.contracts.telemetry_rows import TelemetryRow
from nodes.contracts.tool_answers import ENERGY_METRICS, SensorStatus  # noqa: F401 (sources report these)


class UnknownSource(ValueError):
    """A source name or combination the sampler cannot make (bad input)."""


class SourceOptions(NamedTuple):
    """What the sampler's command line gives a source module's ``source(options)``."""

    interval_s: float
    serial: Optional[str] = None  # a phone's adb serial
    adb: str = "adb"
    meter_channel: str = "main"  # an inline supply meter's output channel (monsoon: main or usb)
    meter_vout_v: float = 4.0  # the voltage the meter supplies the node with
    meter_log: Optional[str] = None  # where the meter's own logger writes its file (kept beside the rows)


class Source(object):
    """A telemetry source. ``problems`` collects sensors that exist but gave no number
    (e.g. NVML's NotSupported), so that the probe reports them instead of staying silent."""

    name = "source"

    def __init__(self) -> None:
        self.problems: List[Tuple[str, str, str]] = []  # (metric, sensor, problem)
        self.header: Dict[str, object] = {}  # what the file header records about the source

    def batches(self, interval_s: float, stopping: Callable[[], bool]) -> Iterator[List[TelemetryRow]]:
        raise NotImplementedError

    def probe(self, interval_s: float = 0.2, batches: int = 2) -> List[SensorStatus]:
        """Take ``batches`` samples and report every sensor seen, with its last value."""
        seen: Dict[Tuple[str, str], SensorStatus] = {}
        taken = [0]

        def enough() -> bool:
            return taken[0] >= batches

        for batch in self.batches(interval_s, enough):
            taken[0] += 1
            for row in batch:
                seen[(row.metric, row.sensor)] = SensorStatus(row.metric, row.sensor, row.unit, row.kind, row.value)
        for metric, sensor, problem in self.problems:
            if (metric, sensor) not in seen:
                seen[(metric, sensor)] = SensorStatus(metric, sensor, "", "", None, problem)
        return sorted(seen.values())

    def close(self) -> None:
        pass


class PolledSource(Source):
    """A source read on the sampler's schedule."""

    def sample(self, now_s: float) -> List[TelemetryRow]:
        raise NotImplementedError

    def batches(self, interval_s: float, stopping: Callable[[], bool]) -> Iterator[List[TelemetryRow]]:
        return polled([self], interval_s, stopping)


def polled(
    sources: Sequence[PolledSource], interval_s: float, stopping: Callable[[], bool]
) -> Iterator[List[TelemetryRow]]:
    """Sample every source each ``interval_s`` on a deadline schedule (monotonic clock): a late
    sample does not push the later ones back, and a sampler that fell behind skips ahead instead
    of bursting."""
    deadline = time.monotonic()
    while not stopping():
        batch: List[TelemetryRow] = []
        now_s = time.time()
        for source in sources:
            batch.extend(source.sample(now_s))
        yield batch
        deadline += interval_s
        now = time.monotonic()
        if now > deadline + interval_s:
            deadline = now  # fell behind by more than a period: resume from now
        while not stopping() and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


class CompositeSource(PolledSource):
    """Several polled sources sampled together (a GPU server's NVML and its CPUs)."""

    def __init__(self, sources: Sequence[PolledSource]) -> None:
        super(CompositeSource, self).__init__()
        self.sources = list(sources)
        self.name = "+".join(s.name for s in self.sources)
        for s in self.sources:
            self.header.update(s.header)

    def sample(self, now_s: float) -> List[TelemetryRow]:
        rows: List[TelemetryRow] = []
        for source in self.sources:
            rows.extend(source.sample(now_s))
        self.problems = [p for s in self.sources for p in s.problems]
        return rows

    def close(self) -> None:
        for source in self.sources:
            source.close()


class ProcessStream(Source):
    """A source that reads the lines a tool prints at its own pace (tegrastats, an adb shell loop)."""

    tool = "the tool"

    def start(self, argv: Sequence[str]) -> None:
        self.process = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, bufsize=1
        )

    def lines(self, stopping: Callable[[], bool]) -> Iterator[str]:
        """The tool's lines until ``stopping()``; an unexpected end is an error with its stderr."""
        assert self.process.stdout is not None
        while not stopping():
            line = self.process.stdout.readline()
            if not line:
                if stopping():
                    return  # stopped with our process group: the tool got the signal too
                error = self.process.stderr.read().strip() if self.process.stderr else ""
                raise RuntimeError(
                    "%s ended (exit status %s)%s"
                    % (self.tool, self.process.wait(), ": " + error[-300:] if error else "")
                )
            yield line

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
