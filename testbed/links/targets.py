"""Which devices a bandwidth trace drives, from what the user wrote (``testbed link apply --trace``)."""

from __future__ import annotations

from typing import Any

from foundation.errors import TestbedError
from testbed.inventory import Inventory


def trace_targets(inv: Inventory, specs: list[str]) -> dict[str, Any]:
    """The bandwidth trace of each device from ``--trace`` options: ``CSV`` (every device with a link to
    a server-role node) or ``NODE_OR_GROUP=CSV``."""
    from netem.trace import load_trace

    traces: dict[str, Any] = {}
    servers = {n.name for n in inv.nodes if "server" in n.roles}
    for spec in specs:
        target, sep, path = spec.rpartition("=")
        trace = load_trace(path)
        if sep:
            if target not in inv.groups and target not in {n.name for n in inv.nodes}:
                raise TestbedError(f"--trace {spec}: {target!r} is not a node or group of {inv.path}")
            names = inv.groups.get(target, (target,))
        else:
            names = tuple(
                n.name for n in inv.nodes if n.name not in servers and any(
                    {lk.source, lk.destination} == {n.name, s} for lk in inv.links for s in servers)
            )  # fmt: skip
        for name in names:
            traces[name] = trace
    if not traces:
        raise TestbedError(f"no device in {inv.path} has a link to a server-role node for the trace to drive")
    return traces
