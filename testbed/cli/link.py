"""``testbed link``: shape, show, verify and clear data-plane links; bandwidth traces."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from foundation.errors import NodeError, TestbedError
from foundation.jsonable import jsonable
from foundation.units import format_rate
from netem.nfqueue import NfqueueRules
from netem.tc_state import u32_destination
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    _print_outcome_errors,
    _say,
    err,
    link_app,
    out,
)
from testbed.emulation.resolved import load_lab
from testbed.links.targets import trace_targets


@link_app.command("apply")
def link_apply(
    inventory: InventoryOption = Path("inventory.yaml"),
    profile: Annotated[
        str | None, typer.Option("--profile", help="Shape every link of the inventory with this one profile.")
    ] = None,
    links_file: Annotated[
        Path | None,
        typer.Option(
            "--links",
            help="A YAML file with 'links:' (and optionally 'link_profiles:') to apply "
            "instead of the inventory's links.",
        ),
    ] = None,
    trace: Annotated[
        list[str] | None,
        typer.Option(
            "--trace",
            help="Replay a bandwidth trace CSV (t_s,up_rate,down_rate[,delay_ms,loss_pct]) "
            "on the links between devices and the server: CSV for every device, or NODE_OR_GROUP=CSV "
            "(repeatable). Players run on the nodes; 'link clear' stops them.",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Shape the inventory's links (default), or those of --links, --profile or --trace, as one
    transaction. Rate is an HTB class on the sender. Delay, jitter and loss (one way each) take the
    node's delay path: netem under the class where the kernel has sch_netem, else iptables NFQUEUE
    rules on the receiver and a user-space delay handler there (defaults.delay_path: auto, netem or
    nfqueue). Refuses up front, changing nothing, when a node lacks the data interface, when the
    interface carries the SSH session, when no delay path can run, or when a foreign qdisc is in the
    way (exit 2). Each node journals its interfaces, rules and handler before anything changes; tc
    and iptables are read back and compared with the plan; if any node fails, every node is undone
    (exit 1). Applying again replaces the shaping in place."""
    from netem.plan import queue_limit_packets
    from testbed.leases.keeper import command_leases
    from testbed.links.apply import apply_plans, shapeable_nodes
    from testbed.links.plans import compile_plan
    from testbed.links.trace_playback import apply_trace

    inv = load_lab(inventory)
    if sum(x is not None for x in (profile, links_file, trace)) > 1:
        raise TestbedError("give at most one of --profile, --links and --trace")
    started = None
    traces, plans = None, []
    if trace:
        traces = trace_targets(inv, trace)
    else:  # the links to shape, checked before any node is touched
        if links_file is not None:
            from testbed.inventory import links_from_file

            links = links_from_file(inv, links_file)
        elif profile is not None:
            if profile not in inv.spec.link_profiles:
                known = ", ".join(inv.spec.link_profiles) or "none"
                raise TestbedError(f"--profile {profile}: no such profile in {inventory} (it has: {known})")
            chosen = inv.spec.link_profiles[profile]
            links = tuple(dataclasses.replace(lk, profile_name=profile, profile=chosen) for lk in inv.links)
        else:
            links = inv.links
        if not links:
            raise TestbedError(f"{inventory} has no links to shape; add 'links:' or pass --links FILE")
        plans = compile_plan(inv, links)
    try:
        with command_leases(inv, shapeable_nodes(inv)):  # (it clears earlier shaping anywhere)
            if traces is not None:
                result, started = apply_trace(inv, traces, say=_say)
            else:
                result = apply_plans(inv, plans, say=_say)
    except NodeError as exc:
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        out.print_json(data=jsonable({"applied": result.applied, "trace": started}))
    else:
        table = Table(title="links shaped (read back and matching the plan)" if result.ok else "shaping failed")
        for column in ("node", "device", "direction", "peer", "profile", "rate", "queue", "delay/loss"):
            table.add_column(column, overflow="fold")
        held_on = {(d.sender, d.receiver): f"{c.delay_path} on {c.node}" for o in result.applied.outcomes if o.value
                   for c in o.value.held if isinstance(c, NfqueueRules) for d in c.directions}  # fmt: skip
        for o in result.applied.outcomes:
            for plan in o.value.plans if o.value else ():
                for p in plan.peers:
                    pair = (plan.node, p.peer) if plan.direction == "egress" else (p.peer, plan.node)
                    path = held_on.get(pair, plan.delay_path) if p.profile.has_delay_or_loss else ""
                    table.add_row(
                        plan.node, plan.shaped_device, plan.direction, p.peer, p.profile_name,
                        format_rate(p.profile.rate_bit_s) if p.profile.rate_bit_s else "",
                        f"{queue_limit_packets(p.profile)} packets", path,
                    )  # fmt: skip
        out.print(table)
        if started is not None:
            out.print(
                f"trace replaying for {started.duration_s:g} s on "
                + ", ".join(f"{n} (log {f})" for n, f in started.logfiles.items())
            )
    if not result.ok:
        _print_outcome_errors(result.applied)
        raise typer.Exit(1)


@link_app.command("show")
def link_show(inventory: InventoryOption = Path("inventory.yaml"), as_json: JsonOption = False) -> None:
    """Print what is shaped on every node, read back from tc (not from the inventory): each HTB
    class with its peer, rate, queue and the bytes, packets and drops counted since it was
    applied, the profile its node's link journal says the direction was applied with, and whether
    a trace player runs; on the NFQUEUE delay path, each receiver's handler:
    its directions, delays and last second (packets, how late its releases were, held, dropped).
    Exits 1 if a node cannot be read."""
    from testbed.links.apply import show_nodes

    inv = load_lab(inventory)
    result = show_nodes(inv)
    by_address = {n.data.address: n.name for n in inv.nodes if n.data}
    if as_json:
        payload = []
        for o in result.outcomes:
            v = o.value
            payload.append(
                {
                    "node": o.node, "error": o.error, "journal": v is not None and v.journal is not None,
                    "classes": {d: jsonable(s.classes) for d, s in v.states.items()} if v else {},
                    "held": v.held if v else {}, "delay_handler": list(v.handler) if v else [],
                    "applied": list(v.journal.applied) if v and v.journal else [],
                    "qdiscs": {d: list(s.qdiscs) for d, s in v.states.items()} if v else {},
                }
            )  # fmt: skip
        out.print_json(data=payload)
    else:
        table = Table(title="shaping read back from tc")
        for column in ("node", "device", "class", "peer", "profile", "rate", "queue", "sent", "dropped"):
            table.add_column(column, overflow="fold")
        for o in result.outcomes:
            if o.value is None:
                continue
            applied = o.value.journal.applied if o.value.journal else ()
            profiles = {(e["source"], e["destination"]): e["profile_name"] for e in applied}
            shaped = False
            for dev, state in o.value.states.items():
                filters = {f.get("options", {}).get("flowid"): f for f in state.filters}
                for c in state.classes:
                    address = u32_destination(filters.get(c.classid, {}))
                    peer = by_address.get(address, address) if address else ""
                    leaf = state.qdisc(c.leaf) if c.leaf else None
                    queue = f"{leaf['kind']} {leaf.get('options', {}).get('limit', '')}" if leaf else ""
                    profile = profiles.get((o.node, peer)) or profiles.get((peer, o.node)) or ""
                    table.add_row(
                        o.node, dev, c.classid, peer, profile, format_rate(c.rate_bit_s), queue,
                        f"{c.sent_bytes} B / {c.sent_packets} pkt", str(c.dropped_packets),
                    )  # fmt: skip
                    shaped = True
            if not shaped:
                table.add_row(o.node, "", "", "not shaped", "", "", "", "", "")
        out.print(table)
        for o in result.outcomes:
            if o.value is not None and o.value.journal is not None and o.value.journal.trace_pidfile:
                out.print(f"{o.node}: a trace player was started ({o.value.journal.trace_pidfile})")
        delayed = Table(title="NFQUEUE delay path: each receiver's handler, its last second")
        for column in ("node", "direction", "delay", "packets", "late mean / max ms", "held", "dropped"):
            delayed.add_column(column, overflow="fold")
        for o in result.outcomes:
            v = o.value
            if v is None or not v.held:
                continue
            if not v.handler:
                delayed.add_row(o.node, "; ".join(r for lines in v.held.values() for r in lines[1:]),
                                "", "", "[yellow]handler not running: packets pass undelayed[/]", "", "")  # fmt: skip
            for q in v.handler:
                late = f"{q['late_mean_ms'] if q['late_mean_ms'] is not None else '-'} / {q['late_max_ms']}"
                delayed.add_row(o.node, f"{q.get('from')} -> {q.get('to')}", f"{1000 * q['delay_s']:g} ms",
                                str(q["packets"]), late, str(q["held"]), str(q["dropped"]))  # fmt: skip
        if delayed.rows:
            out.print(delayed)
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@link_app.command("verify")
def link_verify(
    inventory: InventoryOption = Path("inventory.yaml"),
    duration: Annotated[float, typer.Option("--duration", help="Seconds of iperf3 per direction.", min=1)] = 3.0,
    links_file: Annotated[
        Path | None,
        typer.Option("--links", help="Verify the links of this YAML file instead of what is applied."),
    ] = None,
    inventory_links: Annotated[
        bool,
        typer.Option("--inventory-links", help="Verify the inventory's links as written instead of what is applied."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Measure every shaped direction, one at a time: by default what the nodes' link journals say
    is applied (by 'link apply', with --links or --profile too, or by a run), else the links of
    --links FILE or the inventory's (--inventory-links). iperf3 from the source's data address to a
    server bound to the destination's data address (TCP goodput, first second omitted); where a
    direction or its way back has delay, the round trip with ping -U (user to user: it includes delay
    held on the receiver); where it has loss, its one-way loss over iperf3 UDP datagrams. Prints
    measured against target; exits 0 when every direction is within tolerance (rate within 10%, RTT
    within 1 ms + 10%, loss within 3 binomial deviations), else 1. Nothing applied, or a trace still
    playing (its rates change as it plays), exits 2."""
    from testbed.links.verify import RATE_TOLERANCE, verify_links

    inv = load_lab(inventory)
    if links_file is not None and inventory_links:
        raise TestbedError("give at most one of --links and --inventory-links")
    if links_file is not None:
        from testbed.inventory import links_from_file

        links, source = links_from_file(inv, links_file), str(links_file)
    elif inventory_links:
        links, source = inv.links, str(inventory)
    else:
        from testbed.links.apply import applied_links

        applied = applied_links(inv)  # a node that cannot be read: exit 1 naming it (the CLI's error policy)
        if applied.traced:
            raise TestbedError(f"a bandwidth trace is playing on {', '.join(applied.traced)}: its rates change as it "
                               "plays, and verify measures fixed shaping; 'testbed link clear', then apply fixed links")
        links, source = applied.links, "the nodes' link journals"
        if not links:
            raise TestbedError("nothing is applied: no node's link journal names a shaped direction; run 'testbed "
                               "link apply' first, or verify --links FILE or --inventory-links")  # fmt: skip
    if not links:
        raise TestbedError(f"{source} has no links to verify")
    _say(f"verifying {len(links)} directions from {source}")
    rows = verify_links(inv, links, duration_s=duration, say=_say)
    if as_json:
        out.print_json(data=jsonable(rows))
    else:
        table = Table(title=f"link verification (rate within {RATE_TOLERANCE:.0%})")
        for column in ("from", "to", "profile", "target", "measured", "error", "RTT ms", "loss %", "ok", "note"):
            table.add_column(column, overflow="fold")
        for r in rows:
            table.add_row(
                r.source, r.destination, r.profile,
                format_rate(r.target_rate_bit_s) if r.target_rate_bit_s else "",
                f"{r.measured_rate_bit_s / 1e6:.2f} mbit" if r.measured_rate_bit_s else "",
                f"{r.rate_error_pct:+.1f}%" if r.rate_error_pct is not None else "",
                f"{r.measured_rtt_ms:.2f} of {r.target_rtt_ms:g}" if r.measured_rtt_ms is not None else "",
                f"{r.loss_pct:.2f} of {r.target_loss_pct:g}" if r.loss_pct is not None else "",
                "[green]yes[/]" if r.within_tolerance else "[red]no[/]", escape(r.note),
            )  # fmt: skip
        out.print(table)
    if not all(r.within_tolerance for r in rows):
        raise typer.Exit(1)


@link_app.command("clear")
def link_clear(inventory: InventoryOption = Path("inventory.yaml")) -> None:
    """Undo all shaping from each node's own journal: stop the trace player and the delay handler,
    remove only our qdiscs (handle 1f7b:, our ingress qdisc), ifb devices and iptables chains
    (TB-IN-*, TB-EG-* and the jumps into them), and check that each interface is back to what it
    was before the first apply. Works after the controller was killed mid-apply. Safe to
    run again; exits 1 if a node could not be cleared, or if another holder (a running campaign)
    leases one of the machines (testbed lab leases; a holder that is gone: testbed lab release --force)."""
    from testbed.leases.keeper import command_leases
    from testbed.links.apply import clear_nodes, shapeable_nodes

    inv = load_lab(inventory)
    with command_leases(inv, shapeable_nodes(inv)):
        result = clear_nodes(inv)
    for o in result.outcomes:
        if o.value is None:
            continue
        v = o.value
        if not v.had_journal:
            out.print(f"{o.node}: nothing to undo")
            continue
        trace = f", trace player {v.trace_stopped}" if v.trace_stopped else ""
        out.print(f"{o.node}: undone ({v.commands} tc/ip commands{trace})")
        for leftover in v.leftovers:
            err.print(f"[yellow]{escape(o.node)}: not as before apply:[/] {escape(leftover)}", highlight=False)
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@link_app.command("hat-trace")
def link_hat_trace(
    output: Annotated[Path, typer.Argument(help="CSV file to write.")],
    group: Annotated[str, typer.Option(help="Distance group: near (2 m), mid (8 m) or far (14 m).")] = "near",
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same trace.")] = 0,
    duration: Annotated[float, typer.Option("--duration", help="Length of the trace in seconds.", min=1)] = 60.0,
) -> None:
    """Write a HAT-style WiFi bandwidth trace: uplink within 5-10 MB/s and downlink within 10-15
    MB/s (HAT, Sec. 5.1), the group's share of each range, changing every 2-5 s. Replay it with
    'testbed link apply --trace FILE'."""
    from netem.trace import hat_trace, write_trace

    trace = hat_trace(group, seed=seed, duration_s=duration)
    write_trace(trace, output)
    out.print(f"wrote {len(trace.steps)} steps over {trace.duration_s:g} s to {output}")


@link_app.command("import-mahimahi")
def link_import_mahimahi(
    uplink: Annotated[Path, typer.Argument(help="Mahimahi trace of the device's uplink (one delivery ms per line).")],
    downlink: Annotated[Path, typer.Argument(help="Mahimahi trace of the downlink.")],
    output: Annotated[Path, typer.Option("--out", help="Our trace CSV to write.")],
    bin_s: Annotated[
        float, typer.Option("--bin", help="Seconds per row: opportunities are counted in bins.", min=0.01, max=3600)
    ] = 1.0,
    delay_ms: Annotated[
        float | None,
        typer.Option("--delay-ms", help="One-way delay to put on every row (each direction).", min=0, max=10_000),
    ] = None,
    loss_pct: Annotated[
        float | None,
        typer.Option("--loss-pct", help="One-way loss to put on every row (each direction).", min=0, max=100),
    ] = None,
) -> None:
    """Turn a pair of Mahimahi link traces (e.g. its cellular traces) into our trace CSV for 'link apply
    --trace' or a campaign's link.trace. Each Mahimahi line is a millisecond at which one 1500-byte
    packet may be delivered; the opportunities in each --bin seconds become that row's rate (packets x
    1500 B x 8 / bin). A bin without any gets 8 kbit (HTB cannot stop a link) and the import says how
    many. Mahimahi traces repeat: the shorter one repeats over the longer. Mahimahi's own delay and
    loss shells are separate: give them with --delay-ms and --loss-pct."""
    import math

    from netem.mahimahi import MIN_RATE_BIT_S, import_mahimahi
    from netem.trace import write_trace

    for option, value in (("--bin", bin_s), ("--delay-ms", delay_ms), ("--loss-pct", loss_pct)):
        if value is not None and not math.isfinite(value):
            raise typer.BadParameter(f"{value} is not a finite number", param_hint=f"'{option}'")
    imported = import_mahimahi(uplink, downlink, bin_s=bin_s, delay_ms=delay_ms, loss_pct=loss_pct)
    write_trace(imported.trace, output)
    steps = imported.trace.steps
    mean = [sum(getattr(s, f"{c}_bit_s") for s in steps) / len(steps) for c in ("up", "down")]
    out.print(
        f"wrote {len(steps)} rows over {imported.trace.duration_s:g} s to {output} "
        f"(mean up {format_rate(mean[0])}, down {format_rate(mean[1])})"
    )
    if imported.empty_bins:
        err.print(f"[yellow]{imported.empty_bins} bins had no delivery opportunity: they carry "
                  f"{format_rate(MIN_RATE_BIT_S)}[/]", highlight=False)  # fmt: skip
