"""GPU power control through NVML: a power limit (the server's "power mode") and locked SM
clocks, both set on every GPU and read back. Both need root (NVML answers NoPermission
otherwise) and neither survives a driver reload. The journal records each GPU's power limit;
NVML cannot read whether clocks were locked, so restore always resets locked clocks.

Modes: ``default`` (each GPU's default limit), or a limit such as ``250W`` for every GPU; a
limit outside a GPU's constraints is refused before anything is set.
"""

import re
from typing import Any, Dict, List, Optional, Tuple

from nodes.power.common import DriverOptions, PowerDriver, PowerError, PowerModeInfo, PowerState, Runner
from nodes.server.nvml import load_pynvml, nvml_error, text

_WATTS = re.compile(r"^(\d+(?:\.\d+)?)\s*W$", re.IGNORECASE)


class NvmlPower(PowerDriver):
    kind = "server"

    def __init__(self, run: "Optional[Runner]" = None, nvml: Any = None) -> None:
        self.nvml: Any = None
        self.error = ""
        try:
            self.nvml = nvml or load_pynvml()
            self.nvml.nvmlInit()
        except Exception as exc:  # no NVML means no GPU power control; say why
            self.error = str(exc) or type(exc).__name__
            self.nvml = None
        self.handles: List[Any] = []
        if self.nvml is not None:
            self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())]

    def _call(self, what: str, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except self.nvml.NVMLError as exc:
            raise PowerError("%s: %s" % (what, nvml_error(self.nvml, exc))) from None

    def _require(self) -> None:
        if self.nvml is None or not self.handles:
            raise PowerError("no GPU power control on this node: " + (self.error or "NVML sees no GPU"))

    def modes(self) -> List[PowerModeInfo]:
        if self.nvml is None or not self.handles:
            return []
        low, high = self._call(
            "power limit constraints", self.nvml.nvmlDeviceGetPowerManagementLimitConstraints, self.handles[0]
        )
        default = self._call("default power limit", self.nvml.nvmlDeviceGetPowerManagementDefaultLimit, self.handles[0])
        return [
            PowerModeInfo("default", "default", "%g W" % (default / 1000.0)),
            PowerModeInfo("<watts>W", "power limit", "%g-%g W per GPU" % (low / 1000.0, high / 1000.0)),
        ]

    def state(self) -> PowerState:
        if self.nvml is None or not self.handles:
            return PowerState(None, None, None, [self.error or "NVML sees no GPU"], {})
        gpus = []
        limits = set()
        for i, h in enumerate(self.handles):
            limit = self._call("power limit of gpu%d" % i, self.nvml.nvmlDeviceGetPowerManagementLimit, h)
            default = self._call(
                "default power limit of gpu%d" % i, self.nvml.nvmlDeviceGetPowerManagementDefaultLimit, h
            )
            limits.add("default" if limit == default else "%gW" % (limit / 1000.0))
            gpus.append(
                {
                    "gpu": i,
                    "name": text(self.nvml.nvmlDeviceGetName(h)),
                    "power_limit_w": limit / 1000.0,
                    "default_limit_w": default / 1000.0,
                    "sm_clock_mhz": self._call(
                        "SM clock", self.nvml.nvmlDeviceGetClockInfo, h, self.nvml.NVML_CLOCK_SM
                    ),
                }
            )
        mode = limits.pop() if len(limits) == 1 else "mixed"
        return PowerState(mode, mode, None, [], {"gpus": gpus})

    def check_mode(self, mode: str) -> None:
        self._targets(mode)

    def set_mode(self, mode: str) -> PowerState:
        for i, h, target in self._targets(mode):
            self._call("setting the power limit of gpu%d" % i, self.nvml.nvmlDeviceSetPowerManagementLimit, h, target)
            back = self._call("power limit of gpu%d" % i, self.nvml.nvmlDeviceGetPowerManagementLimit, h)
            if back != target:
                raise PowerError(
                    "set gpu%d's power limit to %g W but it reads back %g W" % (i, target / 1000.0, back / 1000.0)
                )
        return self.state()

    def _targets(self, mode: str) -> List[Tuple[int, Any, int]]:
        """(index, handle, limit in mW) per GPU; raises before anything is set if one is out of range."""
        self._require()
        targets = []
        for i, h in enumerate(self.handles):
            low, high = self._call("power limit constraints", self.nvml.nvmlDeviceGetPowerManagementLimitConstraints, h)
            if mode.lower() == "default":
                target = self._call("default limit", self.nvml.nvmlDeviceGetPowerManagementDefaultLimit, h)
            else:
                match = _WATTS.match(mode.strip())
                if not match:
                    raise PowerError(
                        "a server power mode is 'default' or a limit in watts such as '250W', not %r" % mode
                    )
                target = round(float(match.group(1)) * 1000)
                if not low <= target <= high:
                    raise PowerError(
                        "gpu%d accepts power limits of %g-%g W, not %s" % (i, low / 1000.0, high / 1000.0, mode)
                    )
            targets.append((i, h, target))
        return targets

    def lock_clocks(self) -> PowerState:
        """Lock every GPU's SM clock at its maximum (steadier timings; NVML's locked clocks)."""
        self._require()
        for i, h in enumerate(self.handles):
            top = self._call("max SM clock", self.nvml.nvmlDeviceGetMaxClockInfo, h, self.nvml.NVML_CLOCK_SM)
            self._call("locking gpu%d's clocks" % i, self.nvml.nvmlDeviceSetGpuLockedClocks, h, top, top)
        state = self.state()
        return state._replace(clocks_locked=True)

    def snapshot(self) -> Dict[str, Any]:
        self._require()
        return {
            "power_limits_mw": [
                self._call("power limit", self.nvml.nvmlDeviceGetPowerManagementLimit, h) for h in self.handles
            ]
        }

    def restore(self, snapshot: Dict[str, Any]) -> PowerState:
        self._require()
        limits = snapshot.get("power_limits_mw") or []
        if len(limits) != len(self.handles):
            raise PowerError(
                "the journal has power limits of %d GPUs; this node has %d" % (len(limits), len(self.handles))
            )
        for i, (h, limit) in enumerate(zip(self.handles, limits)):
            self._call("resetting gpu%d's clocks" % i, self.nvml.nvmlDeviceResetGpuLockedClocks, h)
            self._call("restoring gpu%d's power limit" % i, self.nvml.nvmlDeviceSetPowerManagementLimit, h, int(limit))
            back = self._call("power limit", self.nvml.nvmlDeviceGetPowerManagementLimit, h)
            if back != int(limit):
                raise PowerError(
                    "restored gpu%d's power limit to %g W but it reads back %g W"
                    % (i, int(limit) / 1000.0, back / 1000.0)
                )
        return self.state()


def driver(options: DriverOptions) -> NvmlPower:
    return NvmlPower(options.runner)
