"""tegrastats lines into telemetry rows (the source that runs tegrastats: :mod:`nodes.telemetry.tegrastats`).

Formats (one line per interval):

- JetPack 4 (L4T R32): rails as ``NAME cur/avg`` in mW without a unit (``POM_5V_IN 3120/3120``,
  ``GPU 0/0 CPU 310/310``); no timestamp.
- JetPack 5 and 6 (R35, R36): a ``MM-DD-YYYY HH:MM:SS`` timestamp; rails as ``NAME cur mW/avg mW``
  (``VDD_GPU_SOC 1590mW/1590mW``); ``GR3D_FREQ 0%@[305,305]`` on multi-GPC Orins.
- JetPack 7.0/7.1 (R38, Thor) as JetPack 6; ``GR3D_FREQ @[f,f,f]`` without a load.
- JetPack 7.2 (R39): rails carry three values, ``cur mW/avg mW/max mW``, and temperatures two
  (``cpu@34.3C/34.8C``, current and maximum). Thor's rails can read slightly negative.

Only the instantaneous value is used. tegrastats' second value is a running average since the
tool started, not a mean over any window we choose; energy is integrated from the instantaneous
samples by the analysis instead.

Which rail is the board total (``board_power_mw``):

=====================  ===========================================================
Orin NX, Orin Nano,    ``VDD_IN``: the module's input rail, i.e. the total (the other
Xavier NX              rails are parts of it and must not be added to it)
Nano (JP4)             ``POM_5V_IN``: the module's input rail (TX2: ``VDD_IN``)
Thor dev kit           ``VIN``: the carrier board's input (INA238)
AGX Orin               no input rail (``VIN_SYS_5V0`` is the 5 V system rail, not the
                       total): the sum of ``VDD_GPU_SOC``, ``VDD_CPU_CV``, ``VIN_SYS_5V0``
                       and, on JetPack 5, ``VDDQ_VDD2_1V8AO``
AGX Xavier             no input rail: the sum of ``GPU``, ``CPU``, ``SOC``, ``CV``,
                       ``VDDRQ`` and ``SYS5V``
=====================  ===========================================================

The row's ``sensor`` says which: ``VDD_IN`` or ``sum(VDD_GPU_SOC+VDD_CPU_CV+...)``.
"""

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

from nodes.contracts.telemetry_rows import MEASURED, TelemetryRow

# Printed by the testbed's stand-in tegrastats as its first line (see nodes.emulated.tegrastats).
STANDIN_PREFIX = "# hil-testbed stand-in tegrastats"
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN", "VIN")  # an input rail: the board total by itself (VIN: Thor's carrier)
NOT_RAILS = ("RAM", "SWAP", "IRAM", "NC")

_TIMESTAMP = re.compile(r"^(\d\d-\d\d-\d{4} \d\d:\d\d:\d\d)\s")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\](?:@(\d+))?")
_FREQ = re.compile(r"\b(EMC|GR3D\d*)_FREQ (?:(\d+)%)?(?:@\[?([\d,]+)\]?)?")
_ENGINE = re.compile(r"\b(NVENC\d?|NVDEC\d?|NVJPG\d?|VIC|OFA|NVDLA\d|PVA\d|APE|MSENC)(?:_FREQ)? (?:\d+%)?@?(\d+)\b")
_TEMP = re.compile(r"\b([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C\b")
_RAIL = re.compile(r"\b([A-Za-z][A-Za-z0-9_]*) (-?\d+)(mW)?/(-?\d+)(?:mW)?(?:/(-?\d+)(?:mW)?)?(?=\s|$)")


class TegrastatsSample(NamedTuple):
    """One tegrastats line, parsed. Absent fields are None or empty."""

    timestamp: Optional[str]  # as printed (JetPack 5+), seconds resolution, the board's local time
    generation: str  # "jp4" (unitless mW), "jp5" (cur mW/avg mW, also JetPack 6 and 7.0), "jp7" (three values)
    ram_used_mb: Optional[int]
    ram_total_mb: Optional[int]
    swap_used_mb: Optional[int]
    cpus: Tuple[Tuple[Optional[int], Optional[int]], ...]  # per core: (load %, MHz); (None, None) = off
    engines_util: Dict[str, Tuple[Optional[int], Optional[int]]]  # EMC, GR3D...: (load %, MHz); Thor: no load
    engines_mhz: Dict[str, int]  # VIC, APE, NVENC...: MHz
    temperatures_c: Dict[str, float]  # powered-off sensors (-256 C) left out
    rails_mw: Dict[str, int]  # instantaneous power per rail
    board_power_mw: Optional[int]
    board_power_sensor: str


def board_total(rails_mw: Dict[str, int]) -> Tuple[Optional[int], str]:
    """The board's power and how it was obtained (see the module docstring's table)."""
    for name in TOTAL_RAILS:
        if name in rails_mw:
            return rails_mw[name], name
    if not rails_mw:
        return None, ""
    return sum(rails_mw.values()), "sum(" + "+".join(rails_mw) + ")"


def parse_tegrastats(line: str) -> TegrastatsSample:
    """Parse one tegrastats line (JetPack 4 to 7). Raises ValueError on a line with neither RAM
    nor power rails (not a tegrastats line)."""
    text = line.strip()
    stamp = _TIMESTAMP.match(text)
    ram = _RAM.search(text)
    swap = _SWAP.search(text)
    cpus: List[Tuple[Optional[int], Optional[int]]] = []
    cpu = _CPU.search(text)
    if cpu:
        shared_mhz = cpu.group(2)  # the legacy form CPU [a%,b%]@f
        for entry in cpu.group(1).split(","):
            entry = entry.strip()
            if entry == "off" or not entry:
                cpus.append((None, None))
                continue
            load, _, mhz = entry.partition("%@")
            mhz = mhz or shared_mhz or ""
            cpus.append((int(load.rstrip("%")), int(mhz) if mhz else None))
    engines_util: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
    for name, load, mhz in _FREQ.findall(text):
        freqs = [int(f) for f in mhz.split(",") if f] if mhz else []
        if load or freqs:
            engines_util[name] = (int(load) if load else None, max(freqs) if freqs else None)
    engines_mhz = {name: int(mhz) for name, mhz in _ENGINE.findall(text)}
    temps: Dict[str, float] = {}
    for name, value in _TEMP.findall(text):
        if float(value) > -256:
            temps[name] = float(value)
    rails: Dict[str, int] = {}
    generation = ""
    for name, cur, unit, _avg, third in _RAIL.findall(text):
        if name in NOT_RAILS:
            continue
        rails[name] = int(cur)
        generation = "jp7" if third else ("jp5" if unit else "jp4")
    if ram is None and not rails:
        raise ValueError("not a tegrastats line: %r" % text[:120])
    total, total_sensor = board_total(rails)
    return TegrastatsSample(
        timestamp=stamp.group(1) if stamp else None,
        generation=generation or ("jp5" if stamp else "jp4"),
        ram_used_mb=int(ram.group(1)) if ram else None,
        ram_total_mb=int(ram.group(2)) if ram else None,
        swap_used_mb=int(swap.group(1)) if swap else None,
        cpus=tuple(cpus),
        engines_util=engines_util,
        engines_mhz=engines_mhz,
        temperatures_c=temps,
        rails_mw=rails,
        board_power_mw=total,
        board_power_sensor=total_sensor,
    )


def sample_rows(sample: TegrastatsSample, ts_s: float, period_s: float, kind: str = MEASURED) -> List[TelemetryRow]:
    """Long-format rows of one parsed line. ``kind`` applies to power (a stand-in's rails are
    modeled); loads, clocks, temperatures and memory are what the tool read."""

    def row(metric: str, value: float, unit: str, sensor: str, row_kind: str = MEASURED) -> TelemetryRow:
        return TelemetryRow(ts_s, metric, float(value), unit, sensor, row_kind, period_s)

    rows = [row("power_mw", mw, "mW", rail, kind) for rail, mw in sample.rails_mw.items()]
    if sample.board_power_mw is not None:
        rows.append(row("board_power_mw", sample.board_power_mw, "mW", sample.board_power_sensor, kind))
    online = [c for c in sample.cpus if c[0] is not None]
    for i, (load, mhz) in enumerate(sample.cpus):
        if load is None:
            continue
        rows.append(row("cpu_util_pct", load, "%", "cpu%d" % i))
        if mhz is not None:
            rows.append(row("cpu_freq_mhz", mhz, "MHz", "cpu%d" % i))
    if online:
        rows.append(row("cpu_util_pct", sum(c[0] or 0 for c in online) / float(len(online)), "%", "cpu"))
        rows.append(row("cpu_online", len(online), "cores", "cpu"))
    for name, (load, mhz) in sample.engines_util.items():
        sensor = "emc" if name == "EMC" else name.lower().replace("gr3d", "gpu")
        if load is not None:
            rows.append(row("emc_util_pct" if name == "EMC" else "gpu_util_pct", load, "%", sensor))
        if mhz is not None:
            rows.append(row("emc_freq_mhz" if name == "EMC" else "gpu_freq_mhz", mhz, "MHz", sensor))
    for name, mhz in sample.engines_mhz.items():
        rows.append(row("engine_freq_mhz", mhz, "MHz", name.lower()))
    for name, celsius in sample.temperatures_c.items():
        rows.append(row("temp_c", celsius, "C", name))
    if sample.ram_used_mb is not None:
        rows.append(row("ram_used_mb", sample.ram_used_mb, "MB", "ram"))
    if sample.swap_used_mb is not None:
        rows.append(row("swap_used_mb", sample.swap_used_mb, "MB", "swap"))
    return rows
