"""The phone's battery source: one ``adb shell`` loop over the battery's sysfs files, from the USB host
(formats and conventions: :mod:`nodes.android.battery`)."""

import time
from typing import Callable, Iterator, List, Optional

from nodes.android.adb import adb_shell
from nodes.android.battery import (
    BATTERY,
    POWER_SOURCES,
    STANDIN_PROPERTY,
    CurrentConvention,
    charging_from_dumpsys,
    detect_convention,
    parse_dumpsys_battery,
    parse_sysfs_status,
)
from nodes.contracts.telemetry_rows import MEASURED, MODELED, TelemetryRow
from nodes.telemetry.source import ProcessStream, SourceOptions, UnknownSource


# One iteration of the loop the phone runs: a line "S current voltage capacity temp status".
def loop_script(interval_s: float, count: int) -> str:
    files = " ".join("%s/%s" % (BATTERY, f) for f in ("current_now", "voltage_now", "capacity", "temp"))
    return (
        "i=0; while [ $i -lt %d ]; do echo S $(cat %s 2>/dev/null) $(cat %s/status 2>/dev/null); "
        "i=$((i+1)); sleep %s; done" % (count, files, BATTERY, ("%.3f" % interval_s).rstrip("0").rstrip("."))
    )


class BatterySource(ProcessStream):
    """Streams the battery files from one ``adb shell`` loop (one process, not one adb call per
    sample) and stamps each line on arrival at the USB host."""

    name = "android"
    tool = "the adb shell loop"

    def __init__(
        self,
        serial: str,
        interval_s: float,
        adb: str = "adb",
        max_samples: int = 10**7,
        now: Optional[Callable[[], float]] = None,
    ) -> None:
        super(BatterySource, self).__init__()
        self.serial, self.adb, self.interval_s = serial, adb, interval_s
        self.now = now or time.time
        # A stand-in phone (the testbed's tests) answers this property; a real one has no such property.
        self.kind = MODELED if self._adb_shell("getprop %s" % STANDIN_PROPERTY).strip() == "1" else MEASURED
        dumpsys = self._adb_shell("dumpsys battery")
        self.dumpsys = parse_dumpsys_battery(dumpsys)
        self.convention: Optional[CurrentConvention] = None
        if self.dumpsys.get("updates_stopped"):
            self.problems.append(
                (
                    "power_mw",
                    "battery",
                    "dumpsys battery says UPDATES STOPPED: its values were "
                    "forced; run `adb shell dumpsys battery reset`",
                )
            )
        if charging_from_dumpsys(self.dumpsys):
            self.problems.append(
                (
                    "power_mw",
                    "battery",
                    "the phone is charging (%s): the battery current includes "
                    "the charger; suspend charging (root) or use adb over Wi-Fi"
                    % (", ".join(k for k in POWER_SOURCES if self.dumpsys.get(k)) or "status charging"),
                )
            )
        self.header = {
            "kind": self.kind,
            "serial": serial,
            "dumpsys_battery": {k: v for k, v in self.dumpsys.items() if isinstance(v, (int, bool))},
        }
        self.start([adb, "-s", serial, "shell", loop_script(interval_s, max_samples)])

    def _adb_shell(self, command: str) -> str:
        return adb_shell(self.adb, self.serial, command)

    def rows_of(self, line: str, ts_s: float) -> List[TelemetryRow]:
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[0] != "S":
            return []
        current, voltage_uv, capacity, temp = (int(p) for p in parts[1:5])
        charging = parse_sysfs_status(parts[5])
        if self.convention is None:
            self.convention = detect_convention(current, charging)
            if self.convention is not None:
                self.header["current_convention"] = self.convention._asdict()
        period = self.interval_s

        def row(metric: str, value: float, unit: str) -> TelemetryRow:
            return TelemetryRow(ts_s, metric, float(value), unit, "battery", self.kind, period)

        rows = [
            row("battery_voltage_mv", voltage_uv / 1000.0, "mV"),
            row("battery_capacity_pct", capacity, "%"),
            row("battery_temp_c", temp / 10.0, "C"),
            row("charging", 1 if charging else 0, ""),
        ]
        if self.convention is not None:
            ma = self.convention.discharge_ma(current)
            rows.append(row("battery_current_ma", ma, "mA"))
            rows.append(row("power_mw", ma * voltage_uv / 1e6, "mW"))
        return rows

    def batches(self, interval_s: float, stopping: Callable[[], bool]) -> Iterator[List[TelemetryRow]]:
        for line in self.lines(stopping):
            rows = self.rows_of(line, self.now())
            if self.convention is None and rows and not any("unit and sign" in p[2] for p in self.problems):
                self.problems.append(
                    (
                        "power_mw",
                        "battery",
                        "current_now's unit and sign cannot be told while "
                        "the phone charges or reads 0; power is not reported until it discharges",
                    )
                )
            yield rows


PACES_ITSELF = True


def source(options: SourceOptions) -> BatterySource:
    if not options.serial:
        raise UnknownSource("the android source needs --serial")
    return BatterySource(options.serial, options.interval_s, adb=options.adb)
