"""A host's own CPUs: utilisation from ``/proc/stat`` and energy from Intel/AMD RAPL through the
powercap sysfs (``/sys/class/powercap/intel-rapl:N[:M]``).

RAPL's ``energy_uj`` is a counter in microjoules that wraps at ``max_energy_range_uj``; since
Linux 5.10 (CVE-2020-8694) it is readable by root only, which the probe reports rather than
hiding. Power is the counter's difference over the sample interval.
"""

import os
from typing import Dict, List, Optional, Tuple

from nodes.contracts.telemetry_rows import MEASURED, TelemetryRow
from nodes.telemetry.source import PolledSource, SourceOptions

POWERCAP = "/sys/class/powercap"


def read_cpu_times(path: str = "/proc/stat") -> Tuple[int, int]:
    """(busy, total) jiffies of the aggregate ``cpu`` line. Idle is idle + iowait; guest time is
    already inside user time, so it is not added again."""
    with open(path) as f:
        fields = f.readline().split()
    if not fields or fields[0] != "cpu":
        raise ValueError("%s does not start with the aggregate cpu line" % path)
    values = [int(v) for v in fields[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return total - idle, total


def utilisation_pct(before: Tuple[int, int], after: Tuple[int, int]) -> Optional[float]:
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    return 100.0 * max(0, busy) / total


class RaplDomain(object):
    """One powercap domain (``package-0``, ``core``, ``dram``...), unwrapped across wraparounds."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        with open(os.path.join(directory, "name")) as f:
            self.name = "rapl:" + f.read().strip()
        try:
            with open(os.path.join(directory, "max_energy_range_uj")) as f:
                self.range_uj = int(f.read())
        except (OSError, ValueError):
            self.range_uj = 0
        self.last: Optional[Tuple[float, int]] = None
        self.total_uj = 0

    def read_uj(self) -> int:
        with open(os.path.join(self.directory, "energy_uj")) as f:
            return int(f.read())

    def sample(self, now_s: float, period_s: float) -> List[TelemetryRow]:
        raw = self.read_uj()
        rows = []
        if self.last is not None:
            delta = raw - self.last[1]
            if delta < 0 and self.range_uj:
                delta += self.range_uj  # the counter wrapped
            self.total_uj += max(0, delta)
            dt = now_s - self.last[0]
            if dt > 0:
                rows.append(TelemetryRow(now_s, "power_mw", delta / dt / 1000.0, "mW", self.name, MEASURED, period_s))
        rows.append(TelemetryRow(now_s, "energy_uj", float(self.total_uj), "uJ", self.name, MEASURED, period_s))
        self.last = (now_s, raw)
        return rows


def rapl_domains(root: str = POWERCAP) -> List[str]:
    """Directories of the RAPL domains under ``root`` (packages and their subdomains)."""
    if not os.path.isdir(root):
        return []
    return sorted(
        os.path.join(root, d)
        for d in os.listdir(root)
        if d.startswith(("intel-rapl:", "amd-rapl:")) and os.path.exists(os.path.join(root, d, "energy_uj"))
    )


class HostSource(PolledSource):
    """CPU utilisation of the whole host, and RAPL energy and power where readable."""

    name = "host"

    def __init__(self, interval_s: float, proc_stat: str = "/proc/stat", powercap: str = POWERCAP) -> None:
        super(HostSource, self).__init__()
        self.interval_s = interval_s
        self.proc_stat = proc_stat
        self.last_cpu = read_cpu_times(proc_stat)
        self.domains: List[RaplDomain] = []
        for directory in rapl_domains(powercap):
            domain = RaplDomain(directory)
            try:
                domain.read_uj()
            except OSError as exc:
                self.problems.append(
                    (
                        "energy_uj",
                        domain.name,
                        "not readable (%s); RAPL counters are root-only "
                        "since Linux 5.10: run the sampler with sudo" % exc.strerror,
                    )
                )
                continue
            self.domains.append(domain)
        if not rapl_domains(powercap):
            self.problems.append(
                ("energy_uj", "rapl", "no RAPL domain under %s (no Intel/AMD RAPL, or a VM)" % powercap)
            )
        self.header = {"rapl_domains": [d.name for d in self.domains]}

    def sample(self, now_s: float) -> List[TelemetryRow]:
        rows: List[TelemetryRow] = []
        cpu = read_cpu_times(self.proc_stat)
        pct = utilisation_pct(self.last_cpu, cpu)
        self.last_cpu = cpu
        if pct is not None:
            rows.append(TelemetryRow(now_s, "cpu_util_pct", pct, "%", "cpu", MEASURED, self.interval_s))
        with open("/proc/meminfo") as f:
            meminfo = parse_meminfo(f.read())
        if "MemTotal" in meminfo:
            used_kb = meminfo["MemTotal"] - meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
            rows.append(TelemetryRow(now_s, "ram_used_mb", used_kb / 1024.0, "MB", "ram", MEASURED, self.interval_s))
        for domain in self.domains:
            rows.extend(domain.sample(now_s, self.interval_s))
        return rows


def parse_meminfo(text: str) -> Dict[str, int]:
    """/proc/meminfo as {key: kB}."""
    info: Dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            info[key.strip()] = int(parts[0])
    return info


PACES_ITSELF = False


def source(options: SourceOptions) -> HostSource:
    return HostSource(options.interval_s)
