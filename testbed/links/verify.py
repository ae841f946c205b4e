"""Measuring shaped links: iperf3 throughput per direction between data addresses, and ping RTT
and loss where the kernel has netem. The result is a table of measured against target, kept as
data so a run's manifest can store it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from foundation.errors import NodeError
from testbed.inventory import DirectedLink, Inventory
from testbed.links.apply import NETEM_PROBE
from testbed.links.node_journal import journal_dir
from testbed.transport import Transport, open_transport
from testbed.transport.base import quote_path

RATE_TOLERANCE = 0.10  # measured TCP goodput within 10% of the HTB rate (headers cost about 4%)
RTT_TOLERANCE_S = 0.001  # plus 10% of the target
FIRST_PORT = 5301
CONNECT_RETRY_S = 10.0

_PING_RTT = re.compile(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms")
_PING_LOSS = re.compile(r"([\d.]+)% packet loss")


@dataclass(frozen=True)
class LinkMeasurement:
    """One direction of one link: what was asked, what was measured, and whether it is close enough."""

    source: str
    destination: str
    profile: str
    target_rate_bit_s: float | None
    target_rtt_ms: float | None = None
    measured_rate_bit_s: float | None = None
    rate_error_pct: float | None = None
    retransmits: int | None = None
    measured_rtt_ms: float | None = None
    rtt_mdev_ms: float | None = None
    loss_pct: float | None = None
    within_tolerance: bool = False
    note: str = ""


def iperf3_goodput(report: dict) -> tuple[float, int | None]:
    """Received bit/s and retransmits from ``iperf3 -J``. iperf 3.12 exits 0 and puts an
    ``error`` member in the JSON when it could not connect: that is an error here."""
    if "error" in report:
        raise ValueError(report["error"])
    end = report.get("end") or {}
    received = (end.get("sum_received") or {}).get("bits_per_second")
    if received is None:
        raise ValueError("iperf3 printed no sum_received (the test did not run)")
    return float(received), (end.get("sum_sent") or {}).get("retransmits")


def parse_ping(text: str) -> tuple[float, float, float]:
    """(avg RTT ms, mdev ms, loss %) from iputils ping's summary lines."""
    rtt = _PING_RTT.search(text)
    loss = _PING_LOSS.search(text)
    if loss is None:
        raise ValueError("ping printed no packet-loss line")
    if rtt is None:  # every packet lost
        return float("nan"), float("nan"), float(loss.group(1))
    return float(rtt.group(2)), float(rtt.group(4)), float(loss.group(1))


def _run_iperf3(
    src: Transport, dst: Transport, src_addr: str, dst_addr: str, port: int, duration_s: float, workdir: str
) -> tuple[float, int | None]:
    base = f"{journal_dir(workdir)}/iperf3-{port}"
    dst.run_script(f"mkdir -p {quote_path(journal_dir(workdir))}").check()
    dst.start_background(
        ["iperf3", "-s", "-1", "-B", dst_addr, "-p", str(port)], pidfile=base + ".pid", logfile=base + ".log"
    )
    try:
        deadline = time.monotonic() + CONNECT_RETRY_S
        while True:
            argv = ["iperf3", "-c", dst_addr, "-B", src_addr, "-p", str(port), "-t", f"{duration_s:g}", "-O", "1", "-J"]
            result = src.run(argv, timeout_s=duration_s + 30)
            try:
                return iperf3_goodput(json.loads(result.stdout or "{}"))
            except (ValueError, json.JSONDecodeError) as exc:
                if "connect" not in str(exc) or time.monotonic() > deadline:
                    detail = f"{exc} {result.stderr.strip()}".strip()
                    raise NodeError(src.node, f"iperf3 to {dst_addr}:{port} failed: {detail}") from None
                time.sleep(0.2)  # the server is not listening yet
    finally:
        dst.stop_background(base + ".pid")


def measure_link(inventory: Inventory, link: DirectedLink, *, port: int, duration_s: float) -> LinkMeasurement:
    src_node, dst_node = inventory.node(link.source), inventory.node(link.destination)
    target_rate = link.profile.rate_bit_s
    target_rtt = None
    if link.profile.delay_s:
        back = next((x for x in inventory.links if (x.source, x.destination) == (link.destination, link.source)), None)
        target_rtt = 1000 * (link.profile.delay_s + ((back.profile.delay_s or 0) if back else 0))

    def row(**measured: Any) -> LinkMeasurement:
        return LinkMeasurement(link.source, link.destination, link.profile_name, target_rate, target_rtt, **measured)

    if "android" in (src_node.kind, dst_node.kind):
        return row(note="not measured: iperf3 on phones is not supported yet")
    if src_node.data is None or dst_node.data is None:
        return row(note="not measured: a node has no data address")
    workdir = inventory.spec.defaults.workdir
    with open_transport(inventory, src_node) as src, open_transport(inventory, dst_node) as dst:
        measured, retransmits = _run_iperf3(
            src, dst, src_node.data.address, dst_node.data.address, port, duration_s, workdir
        )
        ok = True
        error_pct = None
        if target_rate:
            error_pct = 100 * (measured - target_rate) / target_rate
            ok = abs(error_pct) <= 100 * RATE_TOLERANCE
        rtt = mdev = loss = None
        note = ""
        if link.profile.needs_netem:
            if src.run_script(NETEM_PROBE).check().stdout.strip() == "missing":
                note = "delay and loss not measured: no sch_netem"
                ok = False
            else:
                ping = src.run(
                    ["ping", "-c", "20", "-i", "0.2", "-I", src_node.data.address, dst_node.data.address],
                    timeout_s=30,
                )
                rtt, mdev, loss = parse_ping(ping.stdout)
                if target_rtt is not None:
                    ok = ok and abs(rtt - target_rtt) <= 1000 * RTT_TOLERANCE_S + 0.1 * target_rtt
    return row(
        measured_rate_bit_s=measured, rate_error_pct=error_pct, retransmits=retransmits, measured_rtt_ms=rtt,
        rtt_mdev_ms=mdev, loss_pct=loss, within_tolerance=ok, note=note,
    )  # fmt: skip


def verify_links(
    inventory: Inventory,
    links: Sequence[DirectedLink] | None = None,
    *,
    duration_s: float = 3.0,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[LinkMeasurement, ...]:
    """Measure each direction in turn (one at a time: a reverse flow's ACKs share the shaped
    class of the other direction). A node error becomes that row's note, not an exception."""
    rows = []
    for i, link in enumerate(links if links is not None else inventory.links):
        say(f"measuring {link.source} -> {link.destination} ({link.profile.describe()})")
        try:
            rows.append(measure_link(inventory, link, port=FIRST_PORT + i, duration_s=duration_s))
        except NodeError as exc:
            rows.append(
                LinkMeasurement(link.source, link.destination, link.profile_name, link.profile.rate_bit_s,
                                note=f"failed: {exc}")
            )  # fmt: skip
    return tuple(rows)
