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
from typing import Any, Dict, NamedTuple, Optional

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
