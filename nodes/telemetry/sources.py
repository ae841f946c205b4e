"""Telemetry sources by name, as the controller asks for them on the sampler's command line: one module
per source in this package, each with ``source(options)`` and ``PACES_ITSELF`` (a stream that reads at
its own pace, which cannot be combined with others; polled sources are sampled together).

- ``jetson``: tegrastats (JetPack 4-7 formats; the stand-in on an emulated Jetson), :mod:`.tegrastats`
- ``jtop``: a Jetson's rails from the jtop service (jetson-stats), where a lab runs it, :mod:`.jtop`
- ``nvml``: every NVIDIA GPU through nvidia-ml-py, :mod:`.nvml`
- ``host``: the host's CPU utilisation, RAM, and RAPL energy where readable, :mod:`.host`
- ``emulated``: an emulated node's cgroup utilisation and modeled power, :mod:`.modeled_power`
- ``android``: a phone's battery over adb (``--serial``), from its USB host, :mod:`.battery`
- ``monsoon``: a Monsoon power monitor inline with the node's supply, on the host its USB is plugged
  into (``--meter-*``; an emulated phone's stand-in reads its modeled battery), :mod:`.monsoon`
"""

import importlib
from typing import Any, List, Optional, Sequence

from nodes.telemetry.source import CompositeSource, PolledSource, Source, SourceOptions, UnknownSource

SOURCES = {
    "jetson": "nodes.telemetry.tegrastats",
    "jtop": "nodes.telemetry.jtop",
    "nvml": "nodes.telemetry.nvml",
    "host": "nodes.telemetry.host",
    "emulated": "nodes.telemetry.modeled_power",
    "android": "nodes.telemetry.battery",
    "monsoon": "nodes.telemetry.monsoon",
}
NAMES = tuple(SOURCES)


def _module(name: str) -> Any:
    return importlib.import_module(SOURCES[name])


def build_source(
    names: Sequence[str], interval_s: float, serial: Optional[str] = None, adb: str = "adb", **meter: Any
) -> Source:
    """One source for ``names``: a stream source alone, or polled sources sampled together."""
    unknown = [n for n in names if n not in SOURCES]
    if unknown or not names:
        raise UnknownSource(
            "unknown telemetry source %s; known: %s" % (", ".join(unknown) or "(none)", ", ".join(NAMES))
        )
    modules = [_module(name) for name in names]
    for name, module in zip(names, modules):
        if module.PACES_ITSELF and len(names) > 1:
            raise UnknownSource("the %s source paces itself and cannot be combined with others" % name)
    options = SourceOptions(interval_s, serial, adb, **meter)
    made = [module.source(options) for module in modules]
    if len(made) == 1:
        return made[0]
    polled: List[PolledSource] = made
    return CompositeSource(polled)
