"""A phone's battery: ``dumpsys battery`` and ``/sys/class/power_supply/battery``, read over adb.

``current_now`` is documented in µA, negative when discharging, but vendors differ: some report
mA, some positive while discharging (Samsung, Huawei, Xiaomi, Mi A1 and OnePlus have all been
seen), and Android passes the kernel's value through unchanged. So both are detected per device
and recorded with the data:

- unit: a phone that is awake draws at least ~50 mA, so a magnitude of 10000 or more is µA and
  anything smaller (but not zero) is mA;
- sign: read while the phone is not charging, the sign of the current is the sign of discharge.

Rows: ``battery_current_ma`` (positive = drawn from the battery), ``battery_voltage_mv``,
``power_mw`` (their product), ``battery_capacity_pct``, ``battery_temp_c`` and ``charging`` (1/0).
"""

import re
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

from nodes.android.adb import adb_shell
from nodes.contracts.telemetry_rows import MEASURED, MODELED, TelemetryRow
from nodes.telemetry.source import ProcessStream

BATTERY = "/sys/class/power_supply/battery"
STATUS_CODES = {1: "Unknown", 2: "Charging", 3: "Discharging", 4: "Not charging", 5: "Full"}
MICROAMP_THRESHOLD = 10000
STANDIN_PROPERTY = "ro.hil_testbed.standin"
POWER_SOURCES = ("AC powered", "USB powered", "Wireless powered", "Dock powered")
_LINE = re.compile(r"^\s*([A-Za-z][A-Za-z ]*?):\s*(.*?)\s*$")


def parse_dumpsys_battery(text: str) -> Dict[str, Any]:
    """``dumpsys battery`` as a dict keyed by the printed names (``AC powered``, ``level``, ...),
    values as int or bool where they are numbers or booleans. ``updates_stopped`` is True when
    someone forced values with ``dumpsys battery set``/``unplug`` (the readings are then fake)."""
    fields: Dict[str, Any] = {"updates_stopped": "UPDATES STOPPED" in text}
    for raw in text.splitlines():
        if raw.startswith(" Time when") or raw.startswith(" The last"):
            continue  # Android 14+ broadcast bookkeeping lines, one leading space
        match = _LINE.match(raw)
        if not match:
            continue
        key, value = match.group(1), match.group(2)
        if value in ("true", "false"):
            fields[key] = value == "true"
        elif re.match(r"^-?\d+$", value):
            fields[key] = int(value)
        else:
            fields[key] = value
    if "level" not in fields and "status" not in fields:
        raise ValueError("not dumpsys battery output: %r" % text[:200])
    return fields


def charging_from_dumpsys(fields: Dict[str, Any]) -> bool:
    powered = any(fields.get(k) is True for k in POWER_SOURCES)
    return powered or fields.get("status") == 2


class CurrentConvention(NamedTuple):
    unit: str  # "uA" or "mA"
    discharge_sign: int  # -1: negative means discharging (the kernel ABI); +1: the opposite
    evidence: str

    def discharge_ma(self, raw: int) -> float:
        """The current drawn from the battery in mA (negative while it charges)."""
        ma = raw / 1000.0 if self.unit == "uA" else float(raw)
        return ma * self.discharge_sign


def detect_convention(raw_current: int, charging: bool) -> Optional[CurrentConvention]:
    """Unit and sign from one reading taken while not charging; None when it cannot tell."""
    if raw_current == 0 or charging:
        return None
    unit = "uA" if abs(raw_current) >= MICROAMP_THRESHOLD else "mA"
    sign = -1 if raw_current < 0 else 1
    return CurrentConvention(unit, sign, "current_now=%d while discharging" % raw_current)


def parse_sysfs_status(word: str) -> bool:
    """Whether the sysfs ``status`` word says the battery charges."""
    return word.strip().lower() in ("charging", "full")


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
