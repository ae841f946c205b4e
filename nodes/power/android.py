"""A phone's power mode: the CPU frequency governor and a cap on every cluster's maximum frequency
(``/sys/devices/system/cpu/cpufreq/policyN``), written as root over ``adb shell su -c`` and read
back. Modes are written ``GOVERNOR`` or ``GOVERNOR@KHZ`` (``schedutil@1804800``: each cluster's
maximum capped at 1804800 kHz, or at its own maximum if lower). ``state`` also reads the thermal
zones (``/sys/class/thermal/thermal_zoneN``, millidegrees). Every policy name, governor and frequency
is checked against a strict pattern before it goes into the root shell, also those read back from the
journal on ``restore``.
"""

import re
import shlex
from typing import Any, Dict, List, Tuple

from nodes.android.adb import AdbError, adb_shell
from nodes.android.battery import POWER_SOURCES, charging_from_dumpsys, parse_dumpsys_battery
from nodes.contracts.journal_values import JournalValueError, checked
from nodes.power.common import DriverOptions, PowerDriver, PowerError, PowerModeInfo, PowerState, PowerUsageError

CPUFREQ = "/sys/devices/system/cpu/cpufreq"
THERMAL = "/sys/class/thermal"
_MODE = re.compile(r"^([a-z_]+)(?:@(\d+))?$")
POLICY = re.compile(r"policy\d{1,4}")
GOVERNOR = re.compile(r"[A-Za-z0-9_-]{1,32}")  # schedutil, performance, sched_pixel, ...
KHZ = re.compile(r"\d{1,10}")


def checked_target(policy: object, governor: object, khz: object, where: str) -> Tuple[str, str, str]:
    """(policy, governor, kHz) as they may go into the root shell, or JournalValueError naming the field."""
    return (
        checked(policy, POLICY, where, "a cpufreq policy name (policyN)"),
        checked(governor, GOVERNOR, "%s.%s.governor" % (where, policy), "a governor name (letters, digits, _, -)"),
        checked(khz, KHZ, "%s.%s.max_khz" % (where, policy), "a frequency in kHz (digits)"),
    )


class AndroidPower(PowerDriver):
    kind = "android"

    def __init__(self, serial: str, adb: str = "adb") -> None:
        self.serial, self.adb = serial, adb

    def shell(self, command: str, root: bool = False) -> str:
        try:
            return adb_shell(self.adb, self.serial, "su -c %s" % shlex.quote(command) if root else command)
        except AdbError as exc:
            raise PowerError(str(exc)) from None

    def policies(self) -> Dict[str, Dict[str, str]]:
        """policyN -> governor, max, hw_max (kHz), available governors, related cpus."""
        script = (
            'for p in %s/policy*; do echo "$(basename $p)|$(cat $p/scaling_governor)|$(cat $p/scaling_max_freq)'
            '|$(cat $p/cpuinfo_max_freq)|$(cat $p/scaling_available_governors)|$(cat $p/related_cpus)"; done' % CPUFREQ
        )
        found: Dict[str, Dict[str, str]] = {}
        for line in self.shell(script).splitlines():
            parts = line.strip().split("|")
            if len(parts) == 6 and parts[0].startswith("policy"):
                found[parts[0]] = {
                    "governor": parts[1],
                    "max_khz": parts[2],
                    "hw_max_khz": parts[3],
                    "governors": parts[4],
                    "cpus": parts[5],
                }
        if not found:
            raise PowerError("no cpufreq policies under %s on phone %s" % (CPUFREQ, self.serial))
        return found

    def thermal_c(self) -> Dict[str, float]:
        script = 'for z in %s/thermal_zone*; do echo "$(cat $z/type)|$(cat $z/temp)"; done' % THERMAL
        zones: Dict[str, float] = {}
        for line in self.shell(script).splitlines():
            name, _, value = line.strip().partition("|")
            if re.match(r"^-?\d+$", value):
                zones[name] = int(value) / 1000.0
        return zones

    def modes(self) -> List[PowerModeInfo]:
        first = sorted(self.policies().items())[0][1]
        return [
            PowerModeInfo(g, g, "append @KHZ to cap every cluster's maximum frequency")
            for g in first["governors"].split()
        ]

    def state(self) -> PowerState:
        policies = self.policies()
        governors = {p["governor"] for p in policies.values()}
        capped = [p for p in policies.values() if p["max_khz"] != p["hw_max_khz"]]
        mode = governors.pop() if len(governors) == 1 else "mixed"
        if mode != "mixed" and capped:
            mode += "@" + str(max(int(p["max_khz"]) for p in capped))
        return PowerState(
            mode, mode, None, self._charging_warnings(), {"policies": policies, "thermal_c": self.thermal_c()}
        )

    def _charging_warnings(self) -> List[str]:
        """A phone that charges skews every battery reading: say so wherever its state is shown."""
        try:
            fields = parse_dumpsys_battery(self.shell("dumpsys battery"))
        except (PowerError, ValueError) as exc:
            return ["dumpsys battery unreadable: %s" % exc]
        if not charging_from_dumpsys(fields):
            return []
        sources = ", ".join(k for k in POWER_SOURCES if fields.get(k)) or "status charging"
        return ["the phone is charging (%s): battery readings include the charger" % sources]

    def _targets(self, mode: str, policies: Dict[str, Dict[str, str]]) -> List[Tuple[str, str, str]]:
        match = _MODE.match(mode.strip())
        if not match:
            raise PowerError("a phone power mode is GOVERNOR or GOVERNOR@KHZ (e.g. schedutil@1804800), not %r" % mode)
        governor, cap = match.group(1), match.group(2)
        targets = []
        for name, p in sorted(policies.items()):
            if governor not in p["governors"].split():
                raise PowerError("%s has no governor %r (it has: %s)" % (name, governor, p["governors"]))
            top = int(p["hw_max_khz"])
            targets.append((name, governor, str(min(top, int(cap)) if cap else top)))
        return targets

    def _write(self, targets: List[Tuple[str, str, str]]) -> None:
        try:
            for name, governor, khz in targets:  # also what the phone's own listing said
                checked_target(name, governor, khz, "policies")
        except JournalValueError as exc:
            raise PowerError("refusing to write cpufreq: %s" % exc) from None
        script = "; ".join(
            "echo %s > %s/%s/scaling_governor && echo %s > %s/%s/scaling_max_freq"
            % (g, CPUFREQ, name, khz, CPUFREQ, name)
            for name, g, khz in targets
        )
        self.shell(script, root=True)
        now = self.policies()
        for name, governor, khz in targets:
            if now[name]["governor"] != governor or now[name]["max_khz"] != khz:
                raise PowerError(
                    "%s reads back governor %s, max %s kHz; asked for %s, %s kHz"
                    % (name, now[name]["governor"], now[name]["max_khz"], governor, khz)
                )

    def check_mode(self, mode: str) -> None:
        self._targets(mode, self.policies())

    def set_mode(self, mode: str) -> PowerState:
        self._write(self._targets(mode, self.policies()))
        return self.state()

    def snapshot(self) -> Dict[str, Any]:
        return {
            "policies": {n: {"governor": p["governor"], "max_khz": p["max_khz"]} for n, p in self.policies().items()}
        }

    def restore(self, snapshot: Dict[str, Any]) -> PowerState:
        saved = snapshot.get("policies") or {}
        if not isinstance(saved, dict) or not all(isinstance(p, dict) for p in saved.values()):
            raise JournalValueError("policies: not a map of policy names to {governor, max_khz}")
        targets = [checked_target(n, p.get("governor"), p.get("max_khz"), "policies") for n, p in saved.items()]
        self._write(sorted(targets))
        return self.state()


def driver(options: DriverOptions) -> AndroidPower:
    if not options.serial:
        raise PowerUsageError("the android driver needs --serial")
    return AndroidPower(options.serial, adb=options.adb)
