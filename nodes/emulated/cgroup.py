"""A node's CPU cgroup: its quota (the power mode) and the CPU time its processes used.

Works with cgroup v1 (the ``cpu`` and ``cpuacct`` controllers, mounted together or apart) and with
cgroup v2 (``cpu.max`` and ``cpu.stat``). :class:`ProcessTreeCpu` is the fallback without cgroups
(the emulated testbed's local mode): it adds up the CPU time of a process and its descendants.
"""

import contextlib
import os
from typing import Dict, List, Optional

CGROUP_ROOT = "/sys/fs/cgroup"
PERIOD_US = 100000


def cgroup_version(root: str = CGROUP_ROOT) -> Optional[int]:
    """2 on a unified hierarchy with the cpu controller, 1 with a v1 cpu controller, else None."""
    controllers = os.path.join(root, "cgroup.controllers")
    if os.path.exists(controllers):
        with open(controllers) as f:
            return 2 if "cpu" in f.read().split() else None
    if os.path.exists(os.path.join(root, "cpu", "cpu.cfs_quota_us")):
        return 1
    return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class CpuCgroup:
    """The cgroup (one directory per hierarchy) named ``name`` under the cgroup root."""

    def __init__(self, name: str, root: str = CGROUP_ROOT, version: Optional[int] = None) -> None:
        self.name = name
        self.root = root
        self.version = version if version is not None else cgroup_version(root)
        if self.version is None:
            raise OSError("no cgroup cpu controller under " + root)
        if self.version == 2:
            self.directories = [os.path.join(root, name)]
        else:
            cpu = os.path.join(root, "cpu", name)
            cpuacct = os.path.join(root, "cpuacct", name)
            # Mounted together (cpu,cpuacct) both names lead to one directory.
            same = os.path.realpath(os.path.join(root, "cpu")) == os.path.realpath(os.path.join(root, "cpuacct"))
            has_cpuacct = os.path.isdir(os.path.join(root, "cpuacct"))
            self.directories = [cpu] if same or not has_cpuacct else [cpu, cpuacct]

    @property
    def quota_directory(self) -> str:
        return self.directories[0]

    @property
    def usage_directory(self) -> str:
        return self.directories[-1]

    def exists(self) -> bool:
        return all(os.path.isdir(d) for d in self.directories)

    def create(self) -> None:
        if self.version == 2:
            # The cpu controller must be enabled for the children of the root.
            subtree = os.path.join(self.root, "cgroup.subtree_control")
            if "cpu" not in _read(subtree).split():
                _write(subtree, "+cpu")
        for d in self.directories:
            if not os.path.isdir(d):
                os.mkdir(d)

    def set_quota_cpus(self, cpus: float, period_us: int = PERIOD_US) -> None:
        """Limit the group to ``cpus`` CPUs' worth of time (0.25: a quarter of one CPU) in every period
        of ``period_us`` (a shorter period throttles in shorter bursts)."""
        quota_us = max(1000, round(cpus * period_us))
        if self.version == 2:
            _write(os.path.join(self.quota_directory, "cpu.max"), "%d %d" % (quota_us, period_us))
        else:
            _write(os.path.join(self.quota_directory, "cpu.cfs_quota_us"), "-1")  # any period is then valid
            _write(os.path.join(self.quota_directory, "cpu.cfs_period_us"), str(period_us))
            _write(os.path.join(self.quota_directory, "cpu.cfs_quota_us"), str(quota_us))

    def quota_files(self) -> List[str]:
        """The files :meth:`set_quota_cpus` writes."""
        names = ["cpu.max"] if self.version == 2 else ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
        return [os.path.join(self.quota_directory, n) for n in names]

    def period_us(self) -> int:
        if self.version == 2:
            return int(_read(os.path.join(self.quota_directory, "cpu.max")).split()[1])
        return int(_read(os.path.join(self.quota_directory, "cpu.cfs_period_us")))

    def quota_cpus(self) -> Optional[float]:
        """The quota in CPUs, or None when unlimited."""
        if self.version == 2:
            quota, period = _read(os.path.join(self.quota_directory, "cpu.max")).split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int(_read(os.path.join(self.quota_directory, "cpu.cfs_quota_us")))
        period_us = int(_read(os.path.join(self.quota_directory, "cpu.cfs_period_us")))
        return None if quota_us < 0 else quota_us / period_us

    def usage_s(self) -> float:
        """CPU time used by every process that ever ran in the group, in seconds."""
        if self.version == 2:
            for line in _read(os.path.join(self.usage_directory, "cpu.stat")).splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            raise OSError("no usage_usec in cpu.stat of " + self.usage_directory)
        return int(_read(os.path.join(self.usage_directory, "cpuacct.usage"))) / 1e9

    def attach(self, pid: int) -> None:
        for d in self.directories:
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def pids(self) -> List[int]:
        found: set = set()
        for d in self.directories:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in _read(os.path.join(d, "cgroup.procs")).split())
        return sorted(found)

    def remove(self) -> None:
        """Remove the (empty) group; a missing group is fine."""
        for d in self.directories:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(d)


def process_stat(pid: int) -> Optional[List[str]]:
    """Fields 3 onwards of /proc/PID/stat (state, ppid, ...), or None when there is no such process.
    ``process_stat(pid)[k - 3]`` is field k of proc(5)."""
    try:
        stat = _read("/proc/%d/stat" % pid)
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and ")"


def _process_table() -> Dict[int, List[int]]:
    """pid -> [ppid, utime+stime+cutime+cstime in clock ticks] for every process we can read."""
    table: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        fields = process_stat(int(entry)) if entry.isdigit() else None
        if fields is not None:  # ppid is field 4; utime, stime, cutime, cstime are fields 14-17
            table[int(entry)] = [int(fields[1]), sum(int(x) for x in fields[11:15])]
    return table


class ProcessTreeCpu:
    """CPU time of a process and all its descendants (no cgroup needed, no quota possible)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid

    def usage_s(self) -> float:
        table = _process_table()
        children: Dict[int, List[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        total, stack = 0, [self.root_pid]
        while stack:
            pid = stack.pop()
            if pid in table:
                total += table[pid][1]
                stack.extend(children.get(pid, ()))
        return total / os.sysconf("SC_CLK_TCK")
