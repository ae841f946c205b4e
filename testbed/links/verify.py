"""Measuring shaped links: iperf3 throughput per direction between data addresses, and ping RTT
and loss where a direction has delay or loss (on either delay path). The result is a table of
measured against target, kept as data so a run's manifest can store it.

RTT is ping's user-to-user time (``ping -U``): plain ping times the reply by its kernel receive stamp,
which is taken before the NFQUEUE delay path holds the packet on the receiving node, so it would
miss the way back's delay.

Each iperf3 server runs detached under ``timeout`` (it ends by itself a while after its test should
have, also when no client ever came), and a caller that journals what it starts (a campaign's
``processes.json``) is told its pidfile before it starts (``before_start``); the client runs under
``timeout`` too, so a controller killed mid-measurement leaves nothing that runs on.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from foundation.errors import NodeError
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import DirectedLink, Inventory, kind_of
from testbed.links.node_journal import journal_dir
from testbed.transport import Transport, open_transport
from testbed.transport.base import background_start_script, background_stop_script, command_line, quote_path

RATE_TOLERANCE = 0.10  # measured TCP goodput within 10% of the HTB rate (headers cost about 4%)
RTT_TOLERANCE_S = 0.001  # plus 10% of the target
PING_COUNT = 100
PING_INTERVAL_S = 0.02
UDP_BYTES = 1000  # one-way loss is counted over UDP datagrams of this size
UDP_MAX_BIT_S = 8e6  # at most this rate (1000 datagrams a second), at most half the shaped rate
FIRST_PORT = 5301
CONNECT_RETRY_S = 10.0
IPERF3_ATTEMPTS = 2
SERVER_MARGIN_S = 60.0  # a server outlives its client's longest wait by this, then ends itself
KILL_AFTER_S = 5  # timeout's TERM, then KILL this much later
STOP_GRACE_S = 5.0  # the server's TERM, then KILL (Transport.stop_background's default)

BeforeStart = Callable[[str, str], None]  # (node, pidfile) of a detached process about to start

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
    measured_rtt_ms: float | None = None  # ping -U, round trip
    rtt_mdev_ms: float | None = None
    round_trip_loss_pct: float | None = None  # ping's: lost one way or the other
    target_loss_pct: float | None = None  # this direction's, one way
    loss_pct: float | None = None  # this direction's, one way (iperf3 UDP)
    loss_packets: int | None = None
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


def loss_tolerance_pct(expected_pct: float, packets: int) -> float:
    """How far a loss measured over ``packets`` may be from ``expected_pct``: three binomial standard
    deviations plus one packet."""
    p = expected_pct / 100
    return 100 * (3 * math.sqrt(p * (1 - p) / packets) + 1 / packets)


def iperf3_udp_loss(report: dict) -> tuple[float, int]:
    """(one-way loss %, packets sent) from ``iperf3 -u -J``, as the receiver counted them."""
    if "error" in report:
        raise ValueError(report["error"])
    received = (report.get("end") or {}).get("sum_received") or (report.get("end") or {}).get("sum")
    if not received or not received.get("packets"):
        raise ValueError("iperf3 printed no UDP packet counts (the test did not run)")
    return 100 * received["lost_packets"] / received["packets"], int(received["packets"])


def bounded(argv: list[str], limit_s: float) -> list[str]:
    """``argv`` under coreutils ``timeout``: TERM after ``limit_s``, KILL a few seconds later."""
    return ["timeout", "-k", str(KILL_AFTER_S), f"{math.ceil(limit_s)}", *argv]


def iperf3_server_argv(dst_addr: str, port: int, duration_s: float) -> list[str]:
    """A one-off iperf3 server that ends by itself a margin after its client's longest wait."""
    limit_s = CONNECT_RETRY_S + duration_s + 30 + SERVER_MARGIN_S
    return bounded(["iperf3", "-s", "-1", "-B", dst_addr, "-p", str(port)], limit_s)


def iperf3_client_argv(src_addr: str, dst_addr: str, port: int, duration_s: float,
                       udp_bit_s: float | None = None) -> list[str]:  # fmt: skip
    """iperf3's client for one test (TCP; with ``udp_bit_s``, UDP at that rate), bounded."""
    argv = ["iperf3", "-c", dst_addr, "-B", src_addr, "-p", str(port), "-t", f"{duration_s:g}", "-J"]
    argv += ["-O", "1"] if udp_bit_s is None else ["-u", "-b", str(round(udp_bit_s)), "-l", str(UDP_BYTES)]
    return bounded(argv, duration_s + 25)


def ping_argv(src_addr: str, dst_addr: str) -> list[str]:
    return ["ping", "-U", "-q", "-c", str(PING_COUNT), "-i", f"{PING_INTERVAL_S:g}", "-I", src_addr, dst_addr]


def server_files(workdir: str, port: int) -> tuple[str, str, str]:
    """The directory, pidfile and log of the iperf3 server on ``port``, in the receiver's ``workdir``."""
    directory = journal_dir(workdir)
    return directory, f"{directory}/iperf3-{port}.pid", f"{directory}/iperf3-{port}.log"


def _targets(link: DirectedLink, every: Sequence[DirectedLink]) -> tuple[float | None, float | None]:
    """The round trip (ms: this direction's delay and its way back's) and the UDP rate a direction is
    measured with; None where it has no delay, no loss."""
    back = next((x.profile for x in every if (x.source, x.destination) == (link.destination, link.source)), None)
    target_rtt = None
    if link.profile.delay_s or (back is not None and back.delay_s):
        target_rtt = 1000 * ((link.profile.delay_s or 0) + ((back.delay_s or 0) if back else 0))
    udp_bit_s = None
    if link.profile.loss_pct:
        udp_bit_s = min(UDP_MAX_BIT_S, (link.profile.rate_bit_s or 2 * UDP_MAX_BIT_S) / 2)
    return target_rtt, udp_bit_s


def _measurable(inventory: Inventory, link: DirectedLink) -> str:
    """Why a direction is not measured ('' where it is)."""
    src_node, dst_node = inventory.node(link.source), inventory.node(link.destination)
    if not (kind_of(src_node).runs_ranks and kind_of(dst_node).runs_ranks):
        return "not measured: iperf3 on phones is not supported yet"
    if src_node.data is None or dst_node.data is None:
        return "not measured: a node has no data address"
    return ""


def _run_iperf3(
    src: Transport, dst: Transport, src_addr: str, dst_addr: str, port: int, duration_s: float, workdir: str,
    *, udp_bit_s: float | None = None, before_start: BeforeStart | None = None,
) -> tuple[float, int | None]:
    """TCP goodput (bit/s, retransmits); with ``udp_bit_s``, UDP at that rate: (loss %, packets).
    ``workdir``: the receiver's, where its server's files go. A test that broke off after connecting
    (iperf3's control connection crosses the same lossy link) is run once more with a fresh server."""
    directory, pidfile, logfile = server_files(workdir, port)
    dst.run_script(f"mkdir -p {quote_path(directory)}").check()
    for attempt in range(IPERF3_ATTEMPTS):
        if before_start is not None:
            before_start(dst.node, pidfile)
        dst.start_background(iperf3_server_argv(dst_addr, port, duration_s), pidfile=pidfile, logfile=logfile)
        try:
            deadline = time.monotonic() + CONNECT_RETRY_S
            while True:
                argv = iperf3_client_argv(src_addr, dst_addr, port, duration_s, udp_bit_s)
                result = src.run(argv, timeout_s=duration_s + 30)
                try:
                    report = json.loads(result.stdout or "{}")
                    return iperf3_goodput(report) if udp_bit_s is None else iperf3_udp_loss(report)
                except (ValueError, json.JSONDecodeError) as exc:
                    detail = f"{exc} {result.stderr.strip()}".strip()
                    if "connect" in str(exc) and time.monotonic() < deadline:
                        time.sleep(0.2)  # the server is not listening yet
                        continue
                    if attempt + 1 == IPERF3_ATTEMPTS:
                        raise NodeError(src.node, f"iperf3 to {dst_addr}:{port} failed: {detail}") from None
                    break
        finally:
            dst.stop_background(pidfile, grace_s=STOP_GRACE_S)
    raise AssertionError("unreachable")


def measure_link(
    inventory: Inventory, link: DirectedLink, *, port: int, duration_s: float,
    all_links: Sequence[DirectedLink] | None = None, before_start: BeforeStart | None = None,
) -> LinkMeasurement:
    """One direction, measured against its profile (``all_links``: the set it belongs to, where its
    way back is looked up; the inventory's links by default; ``before_start``: told each iperf3
    server's node and pidfile before it starts)."""
    src_node, dst_node = inventory.node(link.source), inventory.node(link.destination)
    target_rate = link.profile.rate_bit_s
    target_loss = link.profile.loss_pct or None
    target_rtt, udp_bit_s = _targets(link, inventory.links if all_links is None else all_links)

    def row(**measured: Any) -> LinkMeasurement:
        return LinkMeasurement(link.source, link.destination, link.profile_name, target_rate, target_rtt,
                               target_loss_pct=target_loss, **measured)  # fmt: skip

    if why := _measurable(inventory, link):
        return row(note=why)
    assert src_node.data is not None and dst_node.data is not None
    workdir = inventory.settings_of(dst_node).workdir
    with open_transport(inventory, src_node) as src, open_transport(inventory, dst_node) as dst:
        measured, retransmits = _run_iperf3(
            src, dst, src_node.data.address, dst_node.data.address, port, duration_s, workdir, before_start=before_start
        )
        ok = True
        error_pct = None
        note = ""
        if target_rate and not target_loss:
            error_pct = 100 * (measured - target_rate) / target_rate
            ok = abs(error_pct) <= 100 * RATE_TOLERANCE
        elif target_rate:
            note = "goodput not compared with the rate: TCP under loss is held back by the loss"
        rtt = mdev = rt_loss = loss = loss_packets = None
        if target_rtt is not None:
            ping = src.run(ping_argv(src_node.data.address, dst_node.data.address),
                           timeout_s=30 + PING_COUNT * PING_INTERVAL_S)  # fmt: skip
            rtt, mdev, rt_loss = parse_ping(ping.stdout)
            ok = ok and abs(rtt - target_rtt) <= 1000 * RTT_TOLERANCE_S + 0.1 * target_rtt
        if target_loss is not None:
            loss, loss_packets = _run_iperf3(
                src, dst, src_node.data.address, dst_node.data.address, port, duration_s, workdir, udp_bit_s=udp_bit_s,
                before_start=before_start,
            )
            ok = ok and abs(loss - target_loss) <= loss_tolerance_pct(target_loss, loss_packets)
    return row(
        measured_rate_bit_s=measured, rate_error_pct=error_pct, retransmits=retransmits, measured_rtt_ms=rtt,
        rtt_mdev_ms=mdev, round_trip_loss_pct=rt_loss, loss_pct=loss, loss_packets=loss_packets,
        within_tolerance=ok, note=note,
    )  # fmt: skip


def verify_links(
    inventory: Inventory,
    links: Sequence[DirectedLink] | None = None,
    *,
    duration_s: float = 3.0,
    say: Callable[[str], None] = lambda _: None,
    before_start: BeforeStart | None = None,
) -> tuple[LinkMeasurement, ...]:
    """Measure each direction in turn (one at a time: a reverse flow's ACKs share the shaped
    class of the other direction). A node error becomes that row's note, not an exception.
    ``before_start``: told each iperf3 server's (node, pidfile) before it starts."""
    rows = []
    links = tuple(links if links is not None else inventory.links)
    for i, link in enumerate(links):
        say(f"measuring {link.source} -> {link.destination} ({link.profile.describe()})")
        try:
            rows.append(measure_link(inventory, link, port=FIRST_PORT + i, duration_s=duration_s, all_links=links,
                                     before_start=before_start))  # fmt: skip
        except NodeError as exc:
            rows.append(
                LinkMeasurement(link.source, link.destination, link.profile_name, link.profile.rate_bit_s,
                                note=f"failed: {exc}")
            )  # fmt: skip
    return tuple(rows)


def plan_verification(lines: PlanLines, links: Sequence[DirectedLink], duration_s: float) -> None:
    """The configure phase's lines of :func:`verify_links` (a campaign's ``link.verify_s`` > 0): for each
    direction it measures, the receiver's iperf3 server started and stopped around the sender's client
    (both again when a test broke off: the same lines), ping where the direction has delay, and a UDP
    test where it has loss."""
    lab = lines.lab
    for i, link in enumerate(links):
        if _measurable(lab, link):
            continue
        src, dst = lab.node(link.source), lab.node(link.destination)
        assert src.data is not None and dst.data is not None
        port = FIRST_PORT + i
        directory, pidfile, logfile = server_files(lab.settings_of(dst).workdir, port)
        target_rtt, udp_bit_s = _targets(link, links)
        tests = [None] if udp_bit_s is None else [None, udp_bit_s]
        for n, rate in enumerate(tests):
            what = f"{link.source} -> {link.destination}" + (" (UDP, for loss)" if rate else "")
            if n == 0:
                lines.add(dst, "configure", "where verification's iperf3 server keeps its files",
                          sh(f"mkdir -p {quote_path(directory)}"))  # fmt: skip
            server = iperf3_server_argv(dst.data.address, port, duration_s)
            lines.add(dst, "configure", f"start iperf3's server to measure {what}",
                      sh(background_start_script(server, pidfile, logfile, None)))  # fmt: skip
            lines.add(src, "configure", f"measure {what} with iperf3",
                      command_line(iperf3_client_argv(src.data.address, dst.data.address, port, duration_s, rate)))
            lines.add(dst, "configure", "stop iperf3's server", sh(background_stop_script(pidfile, STOP_GRACE_S)))
            if n == 0 and target_rtt is not None:
                lines.add(src, "configure", f"measure the round trip of {what} with ping",
                          command_line(ping_argv(src.data.address, dst.data.address)))  # fmt: skip
