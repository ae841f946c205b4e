"""Parsers for what ``nvpmodel`` and ``jetson_clocks`` print, and for ``/etc/nvpmodel.conf``.

``nvpmodel -q`` prints optional ``NVPM WARN``/``NVPM VERB`` lines, then ``NV Power Mode: NAME``
and the mode id on a line of its own. ``nvpmodel -p --verbose`` lists ``POWER_MODEL: ID=N NAME=X``
lines; the configuration file declares ``< POWER_MODEL ID=N NAME=X >`` blocks and
``< PM_CONFIG DEFAULT=N >``.
"""

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

_MODE_LINE = re.compile(r"^NV Power Mode:\s*(\S.*?)\s*$")
_POWER_MODEL = re.compile(r"POWER_MODEL:?\s+ID=(\d+)\s+NAME=([^\s>]+)")
_DEFAULT = re.compile(r"PM_CONFIG:?\s+DEFAULT=(?:[^\s(>]*\()?(\d+)\)?")
_CLOCK_FIELDS = re.compile(r"(\w+)=(\S+)")


class NvpmodelQuery(NamedTuple):
    mode_id: int
    mode_name: str
    warnings: List[str]  # the NVPM WARN lines, without their prefix


def parse_query(output: str) -> NvpmodelQuery:
    """The current mode from ``nvpmodel -q [--verbose]``. Raises ValueError without one."""
    name: Optional[str] = None
    mode_id: Optional[int] = None
    warnings = []
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("NVPM WARN:"):
            warnings.append(line[len("NVPM WARN:") :].strip())
            continue
        if line.startswith("NVPM ERROR:"):
            raise ValueError("nvpmodel: " + line[len("NVPM ERROR:") :].strip())
        if line.startswith("NVPM VERB: Current mode:"):
            line = line[len("NVPM VERB: Current mode:") :].strip()  # -q --verbose
        elif line.startswith("NVPM"):
            continue
        match = _MODE_LINE.match(line)
        if match:
            name = match.group(1)
        elif name is not None and mode_id is None and line.isdigit():
            mode_id = int(line)
    if name is None or mode_id is None:
        raise ValueError("no 'NV Power Mode' and mode id in nvpmodel -q output: %r" % output[-300:])
    return NvpmodelQuery(mode_id, name, warnings)


def parse_modes(text: str) -> Tuple[List[Tuple[int, str]], Optional[int]]:
    """(id, name) of every power mode, and the default id, from ``nvpmodel -p --verbose`` output
    or from ``/etc/nvpmodel.conf`` (comments start with ``#``)."""
    modes: List[Tuple[int, str]] = []
    default: Optional[int] = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0] if raw.lstrip().startswith("#") else raw
        match = _POWER_MODEL.search(line)
        if match:
            entry = (int(match.group(1)), match.group(2))
            if entry not in modes:
                modes.append(entry)
            continue
        match = _DEFAULT.search(line)
        if match:
            default = int(match.group(1))
    return modes, default


class ClockState(NamedTuple):
    cpu: Dict[str, Dict[str, str]]  # cpuN -> MinFreq, MaxFreq, CurrentFreq, Governor...
    gpu: Dict[str, str]
    emc: Dict[str, str]
    power_mode: Optional[str]

    @property
    def locked(self) -> bool:
        """jetson_clocks pins every online CPU's and the GPU's minimum at its maximum."""
        cpus = [c for c in self.cpu.values() if c.get("Online", "1") == "1"]
        if not cpus or not self.gpu:
            return False
        pinned = all(c.get("MinFreq") == c.get("MaxFreq") for c in cpus)
        return pinned and self.gpu.get("MinFreq") == self.gpu.get("MaxFreq")


def parse_clocks_show(output: str) -> ClockState:
    """``jetson_clocks --show``: per-CPU, GPU and EMC frequency settings."""
    cpu: Dict[str, Dict[str, str]] = {}
    gpu: Dict[str, str] = {}
    emc: Dict[str, str] = {}
    mode = None
    for raw in output.splitlines():
        line = raw.strip()
        head = line.split(":", 1)[0] if ":" in line else line.split(" ", 1)[0]
        if re.match(r"^cpu\d+$", head):
            cpu[head] = dict(_CLOCK_FIELDS.findall(line))
        elif line.startswith("GPU "):
            gpu = dict(_CLOCK_FIELDS.findall(line))
        elif line.startswith("EMC "):
            emc = dict(_CLOCK_FIELDS.findall(line))
        elif line.startswith("NV Power Mode:"):
            mode = line.split(":", 1)[1].strip()
    if not cpu:
        raise ValueError("no cpu lines in jetson_clocks --show output: %r" % output[-300:])
    return ClockState(cpu, gpu, emc, mode)
