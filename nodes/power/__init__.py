"""Power control on a node, behind one interface for every node kind, with a journal on the node
that records the state before the first change so that ``restore`` puts it back, also after the
controller was killed.

What the journal says is checked again before it reaches a command (each driver's ``restore`` knows
the patterns of what it wrote): a value that does not pass is the node's error naming the journal and
the field, and the journal stays for a person to mend.

Drivers, one module per node kind, named by the kind (``--kind K`` loads ``nodes.power.K`` and calls its
``driver(options)``): :mod:`nodes.power.jetson` (nvpmodel, jetson_clocks; also the emulated Jetsons'
stand-ins), :mod:`nodes.power.server` (NVML: GPU power limit and locked clocks), :mod:`nodes.power.android`
(CPU governor and per-cluster maximum frequency); ``none`` is the null driver. The interface, the runner
and the journal: :mod:`nodes.power.common`.

Command line (``nodes/power/__main__.py``; prints one JSON object, exit status 1 with
``{"error": ...}`` on failure, as every node tool does: :mod:`nodes.contracts.tool_errors`)::

    python3 -m nodes.power --kind jetson --journal ~/hil-testbed/power/journal.json show
    python3 -m nodes.power --kind jetson --journal J set MODE [--lock-clocks]
    python3 -m nodes.power --kind jetson --journal J restore
"""

import importlib
import pkgutil
import re
from typing import List, Optional

from nodes.power.common import DriverOptions, PowerDriver, PowerError, PowerJournal, Runner

KIND = re.compile(r"^[a-z][a-z0-9_]*$")
NOT_DRIVERS = ("common",)


def driver_kinds() -> List[str]:
    """The kinds this node code has a power driver for (the modules beside this one), and ``none``."""
    found = [m.name for m in pkgutil.iter_modules(__path__) if KIND.match(m.name) and m.name not in NOT_DRIVERS]
    return sorted(found) + ["none"]


def make_driver(
    kind: str, sudo: bool, journal: PowerJournal, serial: Optional[str] = None, adb: str = "adb"
) -> PowerDriver:
    """The power driver of a node of ``kind``: ``nodes.power.<kind>``'s ``driver(options)``."""
    if kind == "none":
        return PowerDriver()
    if not KIND.match(kind) or kind in NOT_DRIVERS:
        raise PowerError("unknown node kind %r" % kind)
    try:
        module = importlib.import_module("nodes.power." + kind)
    except ImportError:
        raise PowerError("unknown node kind %r: no power driver nodes/power/%s.py" % (kind, kind)) from None
    if not hasattr(module, "driver"):
        raise PowerError("unknown node kind %r: nodes/power/%s.py has no driver(options)" % (kind, kind))
    return module.driver(DriverOptions(Runner(sudo=sudo), sudo, journal, serial, adb))
