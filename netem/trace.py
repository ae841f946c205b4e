"""Time-varying bandwidth traces: CSV files of ``t_s, up_rate, down_rate[, delay_ms, loss_pct]``,
a seeded generator of HAT-style WiFi traces, and the per-node schedules that replay them.

``up`` is a device's link to a server-role node, ``down`` the way back. ``delay_ms`` and
``loss_pct`` apply to each direction (one way). A trace starts with the row at ``t_s = 0``; that
row is applied as the initial plan, the later rows are replayed on the node by
``nodes/link_trace_player.py`` with ``tc class change`` (and ``tc qdisc change`` for netem, or
on the NFQUEUE delay path the node's delay handler plays the rows' delay and loss).
"""

from __future__ import annotations

import csv
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from foundation import units
from foundation.errors import InputError, InputProblem, TestbedError
from foundation.user_files import read_user_text
from netem.nfqueue import NfqueueRules
from netem.plan import HTB_HANDLE, TcPlan, burst_bytes, netem_args, quantum_bytes, queue_limit_packets
from netem.profile import MAX_DELAY_S, MAX_RATE_BIT_S, MIN_RATE_BIT_S, DirectedLink, LinkProfile
from netem.topology import LinkTopology

COLUMNS = ("t_s", "up_rate", "down_rate", "delay_ms", "loss_pct")
MB_S = 8e6  # bit/s in one MB/s (SI), the unit HAT reports

# HAT (Sec. 5.1): three groups of devices at 2, 8 and 14 m from the routers; uplinks varied within
# 5-10 MB/s and downlinks within 10-15 MB/s. The paper gives only the overall ranges; we give each
# distance a third of each range (nearer is faster), so the groups differ as they would.
HAT_DISTANCE_GROUPS = {
    "near": {"distance_m": 2, "up_MBps": (8.33, 10.0), "down_MBps": (13.33, 15.0)},
    "mid": {"distance_m": 8, "up_MBps": (6.67, 8.33), "down_MBps": (11.67, 13.33)},
    "far": {"distance_m": 14, "up_MBps": (5.0, 6.67), "down_MBps": (10.0, 11.67)},
}


@dataclass(frozen=True)
class TraceStep:
    t_s: float
    up_bit_s: float
    down_bit_s: float
    delay_s: float | None = None
    loss_pct: float | None = None


@dataclass(frozen=True)
class BandwidthTrace:
    source: str  # the file it came from, or how it was generated
    steps: tuple[TraceStep, ...]

    @property
    def has_delay_or_loss(self) -> bool:
        return any(s.delay_s or s.loss_pct for s in self.steps)

    @property
    def duration_s(self) -> float:
        return self.steps[-1].t_s


MAX_ROWS = 1_000_000  # rows of one trace (a day at 0.1 s)
MAX_TRACE_S = 1e6  # a row's time: 11.6 days
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")  # ASCII digits: no sign, '_', 'inf' or 'nan'


def load_trace(path: str | Path) -> BandwidthTrace:
    """Read a trace CSV; every problem names the file, line and column. Rates must lie where a link
    profile's may (:data:`~netem.profile.MIN_RATE_BIT_S` to :data:`~netem.profile.MAX_RATE_BIT_S`)."""
    path = Path(path)
    text = read_user_text(path, "give the trace CSV's path")
    numbered = [(i, line) for i, line in enumerate(text.splitlines(), start=1)
                if line.strip() and not line.startswith("#")]  # fmt: skip
    if not numbered:
        raise InputError([InputProblem(str(path), 1, "", "the trace is empty", "first line: " + ",".join(COLUMNS))])
    if len(numbered) > MAX_ROWS + 1:
        raise InputError([InputProblem(str(path), numbered[MAX_ROWS + 1][0], "", f"more than {MAX_ROWS} rows",
                                       "use coarser rows (a trace row holds until the next)")])  # fmt: skip
    problems: list[InputProblem] = []
    rows: list[tuple[int, list[str]]] = []
    for line_number, line in numbered:
        try:
            rows.append((line_number, next(csv.reader([line]))))
        except csv.Error as exc:
            problems.append(InputProblem(str(path), line_number, "", f"not a CSV row: {exc}", "one row per line"))
    if problems:
        raise InputError(problems)
    header_line, header = rows[0][0], [h.strip() for h in rows[0][1]]
    unknown = [h for h in header if h not in COLUMNS]
    missing = [c for c in COLUMNS[:3] if c not in header]
    repeated = sorted({h for h in header if header.count(h) > 1})
    if unknown or missing or repeated:
        twice = f", repeated {repeated}" if repeated else ""
        raise InputError([InputProblem(str(path), header_line, "header", f"unknown columns {unknown}, missing "
                                       f"{missing}{twice}", "columns: t_s, up_rate, down_rate and optionally "
                                       "delay_ms, loss_pct, each once")])  # fmt: skip
    steps: list[TraceStep] = []
    previous_t_s: float | None = None
    for line, row in rows[1:]:
        cells = dict(zip(header, (c.strip() for c in row), strict=False))
        if len(row) != len(header):
            problems.append(InputProblem(str(path), line, "", f"{len(row)} values for {len(header)} columns"))
            continue
        t_s = _decimal(cells["t_s"], MAX_TRACE_S)
        if t_s is None:
            problems.append(InputProblem(str(path), line, "t_s", f"{cells['t_s']!r} is not a time in seconds from 0 "
                                         f"to {MAX_TRACE_S:g}", "write a plain decimal number, e.g. 2.5"))  # fmt: skip
            continue
        values: dict[str, float | None] = {}
        for column in ("up_rate", "down_rate"):
            try:
                rate = units.parse_rate_bit_s(cells[column])
            except units.UnitError as exc:
                problems.append(InputProblem(str(path), line, column, exc.problem, exc.hint))
                continue
            if rate < MIN_RATE_BIT_S:
                problems.append(InputProblem(str(path), line, column, f"{cells[column]}: a link's rate must be at "
                                             f"least {units.format_rate(MIN_RATE_BIT_S)} (HTB has no rate 0)",
                                             "give a small rate instead, e.g. 8kbit"))  # fmt: skip
                continue
            if rate > MAX_RATE_BIT_S:
                problems.append(InputProblem(str(path), line, column, f"{cells[column]}: a link's rate must be at most "
                                             f"{units.format_rate(MAX_RATE_BIT_S)}", "is the unit right?"))  # fmt: skip
                continue
            values[column] = rate
        for column, high in (("delay_ms", MAX_DELAY_S * 1000), ("loss_pct", 100.0)):
            raw = cells.get(column, "")
            values[column] = _decimal(raw, high) if raw else None
            if raw and values[column] is None:
                problems.append(InputProblem(str(path), line, column, f"{raw!r} is not a number from 0 to {high:g}",
                                             "write a plain decimal number, or leave the cell empty"))  # fmt: skip
        if previous_t_s is not None and t_s <= previous_t_s:
            problems.append(InputProblem(str(path), line, "t_s", f"{t_s:g} does not come after {previous_t_s:g}"))
        previous_t_s = t_s
        if len(values) == 4 and values["up_rate"] and values["down_rate"]:
            delay_ms = values["delay_ms"]
            steps.append(
                TraceStep(t_s, values["up_rate"], values["down_rate"],
                          None if delay_ms is None else delay_ms / 1000, values["loss_pct"])
            )  # fmt: skip
    if not problems and (not steps or steps[0].t_s != 0):
        problems.append(InputProblem(str(path), rows[1][0] if len(rows) > 1 else header_line, "t_s",
                                     "the first row must be t_s = 0", "start the trace at 0"))  # fmt: skip
    if problems:
        raise InputError(problems)
    return BandwidthTrace(str(path), tuple(steps))


def _decimal(text: str, high: float) -> float | None:
    """A plain decimal number from 0 to ``high`` (None if it is not one)."""
    if not _DECIMAL.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) and value <= high else None


def write_trace(trace: BandwidthTrace, path: str | Path) -> None:
    """Write a trace CSV (the delay_ms and loss_pct columns only when a row has them)."""
    extra = any(s.delay_s is not None or s.loss_pct is not None for s in trace.steps)
    with open(path, "w", newline="") as f:
        f.write(f"# {trace.source}\n")
        w = csv.writer(f)
        w.writerow(COLUMNS if extra else COLUMNS[:3])
        for s in trace.steps:
            row = [f"{s.t_s:g}", f"{s.up_bit_s / MB_S:.9g}MBps", f"{s.down_bit_s / MB_S:.9g}MBps"]
            if extra:
                row.append("" if s.delay_s is None else f"{s.delay_s * 1000:g}")
                row.append("" if s.loss_pct is None else f"{s.loss_pct:g}")
            w.writerow(row)


def hat_trace(
    group: str, *, seed: int, duration_s: float = 60.0, hold_s: tuple[float, float] = (2.0, 5.0)
) -> BandwidthTrace:
    """A HAT-style WiFi trace for one distance group (``near``, ``mid``, ``far``): rates drawn
    uniformly in the group's share of 5-10 MB/s up and 10-15 MB/s down, each held for a time drawn
    from ``hold_s``. The same seed gives the same trace."""
    if group not in HAT_DISTANCE_GROUPS:
        raise TestbedError(f"unknown distance group {group!r}; use one of {', '.join(HAT_DISTANCE_GROUPS)}")
    g = HAT_DISTANCE_GROUPS[group]
    rng = random.Random(f"hat-{group}-{seed}")
    steps, t = [], 0.0
    while t < duration_s:
        up = round(rng.uniform(*g["up_MBps"]), 2) * MB_S
        down = round(rng.uniform(*g["down_MBps"]), 2) * MB_S
        steps.append(TraceStep(round(t, 3), up, down))
        t += rng.uniform(*hold_s)
    return BandwidthTrace(
        f"hat_trace(group={group!r}, seed={seed}, duration_s={duration_s:g}, {g['distance_m']} m)", tuple(steps)
    )


def scale_trace(trace: BandwidthTrace, rate_scale: float, time_scale: float = 1.0) -> BandwidthTrace:
    """The trace with every rate multiplied by ``rate_scale`` (a campaign's ``link.rate_scale``) and its
    time axis and delays by ``time_scale`` (a target's dilation: everything happens that much slower)."""
    if rate_scale == 1.0 and time_scale == 1.0:
        return trace
    steps = tuple(
        replace(s, t_s=s.t_s * time_scale, up_bit_s=s.up_bit_s * rate_scale, down_bit_s=s.down_bit_s * rate_scale,
                delay_s=None if s.delay_s is None else s.delay_s * time_scale)
        for s in trace.steps
    )  # fmt: skip
    slower = f", time x {time_scale:g}" if time_scale != 1.0 else ""
    return BandwidthTrace(f"{trace.source} x {rate_scale:g}{slower}", steps)


def traced_links(
    topology: LinkTopology, traces: dict[str, BandwidthTrace]
) -> tuple[tuple[DirectedLink, ...], dict[tuple[str, str], tuple[BandwidthTrace, str]]]:
    """The topology's links with the traced ones set to their first step, and which trace column
    (``up`` or ``down``) drives each traced direction. ``traces`` maps device node names."""
    servers = topology.servers
    driven: dict[tuple[str, str], tuple[BandwidthTrace, str]] = {}
    links = []
    for link in topology.links:
        if link.source in traces and link.destination in servers:
            driven[(link.source, link.destination)] = (traces[link.source], "up")
        elif link.destination in traces and link.source in servers:
            driven[(link.source, link.destination)] = (traces[link.destination], "down")
        hit = driven.get((link.source, link.destination))
        if hit is None:
            links.append(link)
            continue
        trace, column = hit
        first = trace.steps[0]
        rate_max = max(getattr(s, f"{column}_bit_s") for s in trace.steps)
        profile = LinkProfile.model_construct(
            rate_bit_s=getattr(first, f"{column}_bit_s"),
            delay_s=(first.delay_s or 1e-6) if trace.has_delay_or_loss else None,
            jitter_s=None, distribution=None,
            # the rows change the loss; how bursty it is stays the link's own (netem or the handler's chain)
            loss_pct=first.loss_pct, loss_correlation_pct=link.profile.loss_correlation_pct, reorder=False,
            # the queue is sized once, for the fastest row (the user's own limit, if given, wins)
            queue_limit_packets=queue_limit_packets(link.profile.model_copy(update={"rate_bit_s": rate_max})),
        )  # fmt: skip
        links.append(DirectedLink(link.source, link.destination, f"trace:{column}", profile))
    for device in traces:
        for column, pairs in (("up", [(device, s) for s in servers]), ("down", [(s, device) for s in servers])):
            if not any(pair in driven for pair in pairs):
                raise TestbedError(
                    f"the trace for {device!r} has {column}_rate, but {topology.source} has no {column}link between "
                    f"{device!r} and a server-role node for it to drive; add one under links:"
                )
    return tuple(links), driven


@dataclass(frozen=True)
class NodeSchedule:
    """What the trace player on one node does: at each time, these commands."""

    node: str
    steps: tuple[dict, ...]  # {"t_s", "commands", "rates"}


def schedules(
    plans: Sequence[TcPlan], driven: dict[tuple[str, str], tuple[BandwidthTrace, str]], sudo_words: Sequence[str]
) -> tuple[NodeSchedule, ...]:
    """Per node, the commands of every trace row after the first: ``tc class change`` for the rate,
    and on the netem delay path ``tc qdisc change`` for delay and loss (on the NFQUEUE path the
    delay handler plays both itself: :func:`delay_timelines`)."""
    out = []
    for node in dict.fromkeys(p.node for p in plans):
        timeline: dict[float, dict] = {}
        for plan in (p for p in plans if p.node == node):
            dev = plan.shaped_device
            for peer in plan.peers:
                pair = (peer.peer, node) if plan.direction == "ingress" else (node, peer.peer)
                if pair not in driven:
                    continue
                trace, column = driven[pair]
                classid = f"{HTB_HANDLE}:{peer.minor:x}"
                for s in trace.steps[1:]:
                    rate = getattr(s, f"{column}_bit_s")
                    step = timeline.setdefault(s.t_s, {"t_s": s.t_s, "commands": [], "rates": {}})
                    burst = f"{burst_bytes(rate)}b"
                    step["commands"].append(
                        [*sudo_words, "tc", "class", "change", "dev", dev, "parent", f"{HTB_HANDLE}:",
                         "classid", classid, "htb", "rate", f"{round(rate)}bit", "ceil", f"{round(rate)}bit",
                         "burst", burst, "cburst", burst, "quantum", str(quantum_bytes(rate))]
                    )  # fmt: skip
                    if plan.leaf_kind(peer) == "netem":
                        netem = replace(peer, profile=peer.profile.model_copy(
                            update={"delay_s": s.delay_s or 1e-6, "loss_pct": s.loss_pct}))  # fmt: skip
                        step["commands"].append(
                            [*sudo_words, "tc", "qdisc", "change", "dev", dev, "parent", classid, "handle",
                             f"{peer.minor:x}:", "netem", *netem_args(netem.profile), "limit",
                             str(queue_limit_packets(peer.profile))]
                        )  # fmt: skip
                    step["rates"][f"{pair[0]}->{pair[1]}"] = rate
        if timeline:
            out.append(NodeSchedule(node, tuple(timeline[t] for t in sorted(timeline))))
    return tuple(out)


def delay_timelines(
    chains: Sequence[NfqueueRules], driven: dict[tuple[str, str], tuple[BandwidthTrace, str]]
) -> dict[str, dict[int, list[list[float]]]]:
    """Per node and NFQUEUE number, the ``[t_s, delay_s, loss_pct]`` rows after the first that the
    node's delay handler plays (the NFQUEUE delay path; the rows' rates are the trace player's)."""
    out: dict[str, dict[int, list[list[float]]]] = {}
    for chain in chains:
        for d in chain.directions:
            if (d.sender, d.receiver) not in driven or d.queue_num is None:
                continue
            trace, _column = driven[(d.sender, d.receiver)]
            rows = [[s.t_s, s.delay_s or 0.0, s.loss_pct or 0.0] for s in trace.steps[1:]]
            out.setdefault(chain.node, {})[d.queue_num] = rows
    return out
