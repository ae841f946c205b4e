"""GPU telemetry through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

Per GPU (sensor ``gpuN``): ``energy_mj`` from the total-energy counter (Volta and newer; the
difference over a window is the energy, exact to the counter's 20-100 ms update), ``power_mw``
(Ampere and newer except GA100 report a one-second average, older GPUs an instantaneous value;
the row's ``period_s`` says which), ``gpu_util_pct``, ``mem_util_pct``, ``mem_used_mb``,
``sm_clock_mhz``, ``temp_c`` and ``clock_event_reasons`` (NVML's bitmask of why clocks are held
down: power cap, thermal, ...). A counter or reading the GPU does not support is reported by the
probe with NVML's error (NotSupported on pre-Volta energy, on a Jetson's partial NVML) instead
of being left out silently.
"""

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

from nodes.contracts.telemetry_rows import MEASURED, TelemetryRow
from nodes.server.nvml import MB, averaged_power, load_pynvml, nvml_error, text
from nodes.telemetry.source import PolledSource, SourceOptions


class NvmlSource(PolledSource):
    name = "nvml"

    def __init__(self, interval_s: float, nvml: Any = None) -> None:
        super(NvmlSource, self).__init__()
        self.nvml = nvml or load_pynvml()
        self.interval_s = interval_s
        self.nvml.nvmlInit()
        self.handles: List[Tuple[str, Any, str, Optional[int]]] = []  # sensor, handle, name, architecture
        for i in range(self.nvml.nvmlDeviceGetCount()):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
            name = text(self.nvml.nvmlDeviceGetName(handle))
            self.handles.append(("gpu%d" % i, handle, name, self._architecture(handle)))
        self.unsupported: set = set()  # (sensor, metric) that raised NotSupported once
        self.energy_base: Dict[str, int] = {}
        reasons = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self.reasons = reasons or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.header = {
            "gpus": [{"sensor": s, "name": n} for s, _, n, _ in self.handles],
            "driver": self._driver_version(),
        }
        if not self.handles:
            self.problems.append(("power_mw", "gpu", "NVML sees no GPU"))

    def _architecture(self, handle: Any) -> Optional[int]:
        call = getattr(self.nvml, "nvmlDeviceGetArchitecture", None)  # nvidia-ml-py 11.450 and later
        if call is None:
            return None
        try:
            return int(call(handle))
        except Exception:
            return None  # old driver (FunctionNotFound) or unknown: the product name decides

    def _driver_version(self) -> str:
        try:
            return text(self.nvml.nvmlSystemGetDriverVersion())
        except Exception:
            return ""

    def _read(self, sensor: str, metric: str, call: Callable[..., Any], *args: Any) -> Optional[Any]:
        if (sensor, metric) in self.unsupported:
            return None
        try:
            return call(*args)
        except self.nvml.NVMLError as exc:
            self.unsupported.add((sensor, metric))
            self.problems.append((metric, sensor, nvml_error(self.nvml, exc)))
            return None

    def sample(self, now_s: float) -> List[TelemetryRow]:
        rows: List[TelemetryRow] = []
        for sensor, handle, name, architecture in self.handles:
            rows.extend(self._gpu_rows(now_s, sensor, handle, name, architecture))
        return rows

    def _gpu_rows(
        self, now_s: float, sensor: str, h: Any, name: str, architecture: Optional[int]
    ) -> List[TelemetryRow]:
        nvml, period = self.nvml, self.interval_s
        rows: List[TelemetryRow] = []

        def add(metric: str, value: Optional[float], unit: str, native_period_s: float = period) -> None:
            if value is not None:
                rows.append(TelemetryRow(now_s, metric, float(value), unit, sensor, MEASURED, native_period_s))

        energy = self._read(sensor, "energy_mj", nvml.nvmlDeviceGetTotalEnergyConsumption, h)
        if energy is not None:
            base = self.energy_base.setdefault(sensor, int(energy))
            add("energy_mj", int(energy) - base, "mJ")  # since the sampler started
        power = self._read(sensor, "power_mw", nvml.nvmlDeviceGetPowerUsage, h)
        add("power_mw", power, "mW", 1.0 if averaged_power(name, architecture) else period)
        util = self._read(sensor, "gpu_util_pct", nvml.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            add("gpu_util_pct", util.gpu, "%")
            add("mem_util_pct", util.memory, "%")
        memory = self._read(sensor, "mem_used_mb", nvml.nvmlDeviceGetMemoryInfo, h)
        if memory is not None:
            add("mem_used_mb", memory.used / MB, "MB")
        sm_clock = self._read(sensor, "sm_clock_mhz", nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)
        add("sm_clock_mhz", sm_clock, "MHz")
        add("temp_c", self._read(sensor, "temp_c", nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU), "C")
        add("clock_event_reasons", self._read(sensor, "clock_event_reasons", self.reasons, h), "bitmask")
        return rows

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a library that may be half-initialised
            self.nvml.nvmlShutdown()


PACES_ITSELF = False


def source(options: SourceOptions) -> NvmlSource:
    return NvmlSource(options.interval_s)
