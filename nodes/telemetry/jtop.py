"""Jetson power from the jtop service (jetson-stats), where a lab runs it instead of tegrastats.

jtop reads the INA3221 rails itself and publishes, per rail, ``power`` (mW, instantaneous),
``volt`` (mV), ``curr`` (mA) and ``avg``; ``tot`` is the input rail (``VDD_IN``/``POM_5V_IN``) where
the board has one, else the sum of the rails. Only ``power`` is used: jtop's ``avg`` is a running
value of its own (each new reading averaged with the previous average), not a mean over any
window, so energy is integrated from the instantaneous samples instead.
"""

import time
from typing import Any, Callable, Iterator, List, Optional

from nodes.contracts.telemetry_rows import MEASURED, TelemetryRow
from nodes.telemetry.source import Source, SourceOptions


def power_rows(power: Any, ts_s: float, period_s: float) -> List[TelemetryRow]:
    """Rows from jtop's ``jetson.power`` dict (``{"rail": {...}, "tot": {...}}``)."""
    rows = []
    rails = dict(power.get("rail") or {})
    for name, rail in sorted(rails.items()):
        if rail.get("online", True) and rail.get("power") is not None:
            rows.append(TelemetryRow(ts_s, "power_mw", float(rail["power"]), "mW", name, MEASURED, period_s))
    total = power.get("tot") or {}
    if total.get("power") is not None:
        sensor = str(total.get("name") or "sum(" + "+".join(sorted(rails)) + ")")
        rows.append(TelemetryRow(ts_s, "board_power_mw", float(total["power"]), "mW", sensor, MEASURED, period_s))
    return rows


class JtopSource(Source):
    """Reads ``jetson.power`` each time the jtop service publishes (its own interval)."""

    name = "jtop"

    def __init__(self, interval_s: float, jtop_class: Any = None, now: Optional[Callable[[], float]] = None) -> None:
        super(JtopSource, self).__init__()
        if jtop_class is None:
            try:
                from jtop import jtop as jtop_class
            except ImportError:
                raise RuntimeError("jetson-stats is not installed (pip install jetson-stats)") from None
        self.now = now or time.time
        self.interval_s = interval_s
        self.client = jtop_class(interval=interval_s)
        self.client.start()  # raises when the jtop service is not running
        self.header = {"tool": "jtop", "power_kind": MEASURED}

    def batches(self, interval_s: float, stopping: Callable[[], bool]) -> Iterator[List[TelemetryRow]]:
        while not stopping() and self.client.ok():
            yield power_rows(self.client.power, self.now(), self.interval_s)

    def close(self) -> None:
        self.client.close()


PACES_ITSELF = True


def source(options: SourceOptions) -> JtopSource:
    return JtopSource(options.interval_s)
