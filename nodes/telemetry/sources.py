"""Telemetry sources by name, as the controller asks for them on the sampler's command line.

- ``jetson``: tegrastats (JetPack 4-7 formats; the stand-in on an emulated Jetson)
- ``jtop``: a Jetson's rails from the jtop service (jetson-stats), where a lab runs it
- ``nvml``: every NVIDIA GPU through nvidia-ml-py
- ``host``: the host's CPU utilisation, RAM, and RAPL energy where readable
- ``emulated``: an emulated node's cgroup utilisation and modeled power
- ``android``: a phone's battery over adb (``--serial``), from its USB host
"""

from typing import List, Optional, Sequence

from nodes.telemetry.source import CompositeSource, PolledSource, Source

NAMES = ("jetson", "jtop", "nvml", "host", "emulated", "android")
STREAMS = ("jetson", "jtop", "android")  # sources that pace themselves


class UnknownSource(ValueError):
    pass


def build_source(names: Sequence[str], interval_s: float, serial: Optional[str] = None, adb: str = "adb") -> Source:
    """One source for ``names``: a stream source alone, or polled sources sampled together."""
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise UnknownSource(
            "unknown telemetry source %s; known: %s" % (", ".join(unknown) or "(none)", ", ".join(NAMES))
        )
    for stream in STREAMS:
        if stream in names and len(names) > 1:
            raise UnknownSource("the %s source paces itself and cannot be combined with others" % stream)
    if names[0] == "jetson":
        from nodes.jetson.tegrastats import TegrastatsSource

        return TegrastatsSource(interval_s)
    if names[0] == "jtop":
        from nodes.jetson.jtop_source import JtopSource

        return JtopSource(interval_s)
    if names[0] == "android":
        if not serial:
            raise UnknownSource("the android source needs --serial")
        from nodes.android.battery import BatterySource

        return BatterySource(serial, interval_s, adb=adb)
    polled: List[PolledSource] = []
    for name in names:
        if name == "nvml":
            from nodes.server.nvml import NvmlSource

            polled.append(NvmlSource(interval_s))
        elif name == "host":
            from nodes.server.host import HostSource

            polled.append(HostSource(interval_s))
        elif name == "emulated":
            from nodes.emulated.power_source import ModeledPowerSource

            polled.append(ModeledPowerSource(interval_s))
    return polled[0] if len(polled) == 1 else CompositeSource(polled)
