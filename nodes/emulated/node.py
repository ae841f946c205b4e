"""An emulated node as its stand-in tools see it: the configuration ``testbed emulate up`` wrote,
the current power mode, and the modeled power of that mode.

Modeled power (DESIGN.md, "The emulated testbed"): P = P_idle + (P_busy - P_idle) * u, where u is
the CPU utilisation of the node (its CPU time per second of wall time, over its mode's CPU quota,
clipped to [0, 1]).
"""

import contextlib
import json
import os
import sys
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from nodes.contracts.durable import write_atomic
from nodes.emulated.cgroup import CpuCgroup, ProcessTreeCpu

CONFIG_VARIABLE = "TESTBED_EMULATED_NODE"  # path of node.json; set in every SSH session of the node
STANDIN_ROOT_VARIABLE = "TESTBED_STANDIN_ROOT"  # where the stand-in board files live
PACING_DIRECTORY = "pacing"  # beside the power mode: the CPU pacing state of a target emulation


class NotEmulated(Exception):
    """Raised when a stand-in tool runs outside an emulated node."""


class PowerMode(NamedTuple):
    id: int
    name: str
    cpus: float
    idle_w: float
    busy_w: float


def modeled_power_w(mode: PowerMode, utilisation: float) -> float:
    """P = P_idle + (P_busy - P_idle) * u, with u clipped to [0, 1]."""
    u = min(1.0, max(0.0, utilisation))
    return mode.idle_w + (mode.busy_w - mode.idle_w) * u


class EmulatedNode:
    def __init__(self, config: Dict[str, Any]) -> None:
        self.config = config
        self.name = str(config["node"])
        self.kind = str(config["kind"])
        self.model = str(config["model"])
        self.mode = str(config["mode"])  # netns or local
        self.power_modes = [PowerMode(**m) for m in config["power_modes"]]
        self.power_mode_file = str(config["power_mode_file"])

    @classmethod
    def from_environment(cls) -> "EmulatedNode":
        path = os.environ.get(CONFIG_VARIABLE)
        if not path:
            raise NotEmulated(
                "this is a stand-in for an NVIDIA tool and runs only on a node of hil-testbed's emulated "
                "testbed (%s is not set)" % CONFIG_VARIABLE
            )
        with open(path) as f:
            return cls(json.load(f))

    @classmethod
    def for_standin(cls, error_prefix: str) -> "Optional[EmulatedNode]":
        """The node a stand-in tool runs on; None (after saying why on stderr) outside the testbed."""
        try:
            return cls.from_environment()
        except NotEmulated as exc:
            sys.stderr.write("%s%s\n" % (error_prefix, exc))
            return None

    # -- power modes ------------------------------------------------------------------------

    def power_mode(self) -> Optional[PowerMode]:
        try:
            with open(self.power_mode_file) as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = ""
        for mode in self.power_modes:
            if str(mode.id) == text:
                return mode
        return self.power_modes[0] if self.power_modes else None

    def mode_by_id(self, mode_id: int) -> Optional[PowerMode]:
        for mode in self.power_modes:
            if mode.id == mode_id:
                return mode
        return None

    def set_power_mode(self, mode: PowerMode) -> None:
        """Switch to ``mode``: its CPU quota (netns mode; the pacing quota while paced) and the recorded
        mode id."""
        write_atomic(self.power_mode_file, "%d\n" % mode.id, mode=0o644)
        self._apply_quota()

    # -- CPU pacing (target emulation) --------------------------------------------------------

    @property
    def pacing_file(self) -> str:
        """In a directory of its own, which a lab reached as a non-root user gives that user (pacing is the
        emulation's own machinery, no rule a real lab needs; testbed.emulation.lifecycle)."""
        return os.path.join(os.path.dirname(self.power_mode_file), PACING_DIRECTORY, "cpu_pacing")

    def cpu_pacing(self) -> Optional[Tuple[float, int]]:
        """(CPUs, period in us) while the node runs paced steps of a target emulation, else None."""
        try:
            with open(self.pacing_file) as f:
                cpus, period = f.read().split()
            return float(cpus), int(period)
        except (FileNotFoundError, ValueError):
            return None

    def set_cpu_pacing(self, cpus: Optional[float], period_us: int = 10000) -> None:
        """Give the node ``cpus`` CPUs in short periods while its steps are paced to a compute profile
        (their time is the profile's: the quota must only never hold the real work back); None: back
        to the power mode's quota and period."""
        if cpus is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.pacing_file)
        else:
            write_atomic(self.pacing_file, "%g %d\n" % (cpus, period_us), mode=0o644)
        self._apply_quota()

    def _apply_quota(self) -> None:
        group = self.cgroup()
        if group is None:
            return
        paced = self.cpu_pacing()
        if paced is not None:
            group.set_quota_cpus(paced[0], paced[1])
            return
        mode = self.power_mode()
        group.set_quota_cpus(mode.cpus if mode is not None else 1.0)

    # -- CPU time ---------------------------------------------------------------------------

    def cgroup(self) -> Optional[CpuCgroup]:
        name = self.config.get("cgroup")
        return CpuCgroup(name) if name else None

    def cpu_usage_s(self) -> float:
        """CPU seconds used by the node so far (its cgroup, or its sshd's process tree)."""
        group = self.cgroup()
        if group is not None:
            return group.usage_s()
        pid = self.config.get("cpu_root_pid")
        return ProcessTreeCpu(int(pid)).usage_s() if pid else 0.0


class UtilisationMeter:
    """Utilisation of the node between successive calls, against the current mode's CPU quota."""

    def __init__(self, node: EmulatedNode) -> None:
        self.node = node
        self.last = (time.monotonic(), node.cpu_usage_s())

    def sample(self) -> List[float]:
        """[CPUs busy, utilisation in 0..1] since the previous sample."""
        now, used = time.monotonic(), self.node.cpu_usage_s()
        wall = max(1e-6, now - self.last[0])
        busy_cpus = max(0.0, used - self.last[1]) / wall
        self.last = (now, used)
        mode = self.node.power_mode()
        quota = mode.cpus if mode is not None else 1.0
        return [busy_cpus, min(1.0, busy_cpus / quota)]


def online_cores(total_cores: int, node: EmulatedNode, mode: Optional[PowerMode]) -> int:
    """Cores a power mode keeps online, in proportion to its CPU quota against the largest mode's."""
    if mode is None or not node.power_modes:
        return total_cores
    largest = max(m.cpus for m in node.power_modes)
    return max(1, min(total_cores, round(total_cores * mode.cpus / largest)))


def clocks_pinned_file(node: EmulatedNode) -> str:
    """Where the stand-in jetson_clocks records whether clocks are pinned at their maximum."""
    return os.path.join(os.path.dirname(node.power_mode_file), "clocks_pinned")


def clocks_pinned(node: EmulatedNode) -> bool:
    try:
        with open(clocks_pinned_file(node)) as f:
            return f.read().strip() == "1"
    except FileNotFoundError:
        return False


def set_clocks_pinned(node: EmulatedNode, pinned: bool) -> None:
    with open(clocks_pinned_file(node), "w") as f:
        f.write("1\n" if pinned else "0\n")
