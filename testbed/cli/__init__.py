"""The ``testbed`` command line.

Every command reads the inventory given with ``--inventory/-i`` (default ``./inventory.yaml``).
Exit status: 0 when everything is fine, 1 when a node or check failed, 2 for bad input (nothing is
touched on any node then).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from foundation.errors import NodeError, TestbedError
from foundation.jsonable import jsonable
from foundation.units import format_duration, format_rate
from nodes.workers.methods import method_named
from nodes.workers.methods import names as method_names
from testbed import __version__
from testbed.emulation.resolved import load_lab
from testbed.inventory import Inventory, NodeSpec, load_inventory

app = typer.Typer(
    name="testbed",
    help="Orchestrate hardware-in-the-loop experiments for device-cloud LLM inference: "
    "Jetson boards, phones and a GPU server described in inventory.yaml.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
inventory_app = typer.Typer(help="Validate, show and check the nodes of an inventory.", no_args_is_help=True)
app.add_typer(inventory_app, name="inventory")
emulate_app = typer.Typer(
    help="Run the inventory's emulated nodes on this machine: one network namespace, sshd and CPU "
    "quota per node, with management and data networks (the embedded default testbed).",
    no_args_is_help=True,
)
app.add_typer(emulate_app, name="emulate")
link_app = typer.Typer(
    help="Shape the data-plane links between nodes with tc (an HTB class per destination, netem where "
    "the kernel has it), read them back, measure them with iperf3, replay bandwidth traces, and undo "
    "everything from the journal each node keeps.",
    no_args_is_help=True,
)
app.add_typer(link_app, name="link")
power_app = typer.Typer(
    help="Read and set power modes: nvpmodel and jetson_clocks on Jetsons, the GPU power limit on "
    "servers (NVML), the CPU governor and frequency cap on phones. Every change is read back, and "
    "each node keeps a journal of its state before the first change so 'power restore' undoes it.",
    no_args_is_help=True,
)
app.add_typer(power_app, name="power")
telemetry_app = typer.Typer(
    help="Probe and record energy and device telemetry: tegrastats on Jetsons, NVML and RAPL on "
    "servers, the battery on phones, the power model on emulated nodes. Samplers run detached on the "
    "nodes and flush as they sample, so nothing is lost when SSH drops.",
    no_args_is_help=True,
)
app.add_typer(telemetry_app, name="telemetry")
workers_app = typer.Typer(
    help="Run split-inference workers over MPI: the server's pipeline stages and one rank per device, "
    "launched with mpiexec from the server node, MPI pinned to the data plane; devices replay a request "
    "schedule and stamp every token on their own clock.",
    no_args_is_help=True,
)
app.add_typer(workers_app, name="workers")

out = Console()
err = Console(stderr=True)

InventoryOption = Annotated[
    Path,
    typer.Option("--inventory", "-i", help="Inventory file describing the lab.", show_default=True),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
JetsonSourceOption = Annotated[
    str,
    typer.Option("--jetson-source", help="Where Jetson power comes from: tegrastats, or the jtop service "
                 "(jetson-stats) where the lab runs it."),
]
NodesOption = Annotated[
    list[str] | None,
    typer.Option("--nodes", "-n", help="Node or group to act on (repeatable); default: every node."),
]


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        out.print(f"hil-testbed {__version__}")
        raise typer.Exit(0)


@app.command()
def doctor(
    inventory: InventoryOption = Path("inventory.yaml"),
    as_json: JsonOption = False,
) -> None:
    """Report what this machine can do for an emulated testbed (root, namespaces, veth, bridges,
    tc qdiscs, cgroup CPU quotas, sshd, iperf3, mpiexec, torch), by trying each in a scratch
    namespace. Exits 1 if something the emulated testbed needs is missing. netem is optional:
    without it, rate shaping works and delay/jitter/loss are reported as unavailable."""
    from testbed.doctor import check_host

    if inventory.exists():
        load_inventory(inventory)  # a broken inventory is worth knowing about here too
    caps = check_host()
    if as_json:
        out.print_json(data=jsonable(caps))
    else:
        table = Table(title="What this host can do for an emulated testbed")
        for column in ("capability", "status", "detail", "needed for"):
            table.add_column(column, overflow="fold")
        for cap in caps:
            status = "[green]ok[/]" if cap.ok else ("[red]missing[/]" if cap.required else "[yellow]missing[/]")
            table.add_row(cap.name, status, escape(cap.detail), cap.needed_for)
        out.print(table)
    missing = [c.name for c in caps if c.required and not c.ok]
    if missing:
        err.print(f"missing for the emulated testbed: {', '.join(missing)}")
        raise typer.Exit(1)


@inventory_app.command("show")
def inventory_show(
    inventory: InventoryOption = Path("inventory.yaml"),
    as_json: JsonOption = False,
) -> None:
    """Validate the inventory and print it resolved: nodes, groups expanded, link profiles with
    canonical units, and every shaped direction between two nodes. While the emulated testbed runs,
    emulated nodes show the addresses it gave them."""
    inv = load_lab(inventory)
    if as_json:
        data = {
            "path": str(inv.path),
            "spec": json.loads(inv.spec.model_dump_json(by_alias=False)),
            "groups": inv.groups,
            "links": [{"from": lk.source, "to": lk.destination, "profile": lk.profile_name} for lk in inv.links],
        }
        out.print_json(data=data)
        return
    table = Table(title=f"{len(inv.nodes)} nodes in {inv.path}")
    for column in ("node", "kind", "model", "reached at", "data plane", "roles", "tags", "notes"):
        table.add_column(column, overflow="fold")
    for node in inv.nodes:
        table.add_row(
            node.name,
            node.kind,
            node.model,
            _reached_at(inv, node),
            f"{node.data.interface} {node.data.address}" if node.data else "",
            ",".join(node.roles),
            ",".join(node.tags),
            _notes(node),
        )
    out.print(table)
    if inv.groups:
        groups = Table(title="groups")
        groups.add_column("group")
        groups.add_column("nodes", overflow="fold")
        for name, members in inv.groups.items():
            groups.add_row(name, ", ".join(members))
        out.print(groups)
    if inv.spec.link_profiles:
        profiles = Table(title="link profiles (one direction each)")
        for column in ("profile", "rate", "delay", "jitter", "loss", "needs netem"):
            profiles.add_column(column)
        for name, p in inv.spec.link_profiles.items():
            profiles.add_row(
                name,
                format_rate(p.rate_bit_s) if p.rate_bit_s else "",
                format_duration(p.delay_s) if p.delay_s is not None else "",
                format_duration(p.jitter_s) if p.jitter_s is not None else "",
                f"{p.loss_pct:g}%" if p.loss_pct is not None else "",
                "yes" if p.needs_netem else "no",
            )
        out.print(profiles)
    if inv.links:
        out.print(
            f"{len(inv.links)} shaped directions, e.g. "
            + "; ".join(f"{lk.source} -> {lk.destination}: {lk.profile_name}" for lk in inv.links[:4])
        )


def _reached_at(inv: Inventory, node: NodeSpec) -> str:
    if node.kind == "android" and node.adb:
        return f"adb {node.adb.serial} on {node.adb.usb_host}"
    if node.transport == "local":
        return "this machine (local)"
    if node.address is None:
        return "emulated (address assigned at start)"
    t = inv.ssh_target(node)
    return f"ssh {t.user}@{t.host}:{t.port}"


def _notes(node: NodeSpec) -> str:
    notes = []
    if node.gpus:
        notes.append(
            f"{node.gpus} GPU" + ("s" if node.gpus > 1 else "") + (f" {node.gpu_model}" if node.gpu_model else "")
        )
    if node.emulated:
        modes = ", ".join(f"{m.id}:{m.name}" for m in node.emulated.power_modes)
        notes.append(f"emulated ({modes})" if modes else "emulated")
    return "; ".join(notes)


@inventory_app.command("check")
def inventory_check(
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: Annotated[
        list[str] | None, typer.Option("--nodes", "-n", help="Only these nodes or groups (repeatable).")
    ] = None,
    parallel: Annotated[int, typer.Option(help="How many nodes to contact at once.", min=1)] = 32,
    as_json: JsonOption = False,
) -> None:
    """Reach every node in parallel and print its facts: hostname, arch, kernel, OS, Python, CPUs,
    memory, free disk, GPUs, Jetson board and L4T release, phones on USB hosts, passwordless sudo,
    and the clock offset against this machine. Exits 0 when every node is fine, 1 otherwise."""
    from testbed.check import check_nodes

    inv = load_lab(inventory)
    selected = inv.select(nodes)
    result = check_nodes(inv, selected, max_parallel=parallel, console=err)
    if as_json:
        payload = [
            {
                "node": o.node,
                "ok": o.ok and o.value is not None and o.value.ok,
                "error": o.error,
                "facts": jsonable(o.value),
            }
            for o in result.outcomes
        ]
        out.print_json(data=payload)
    else:
        _print_facts(result)
    healthy = sum(1 for o in result.outcomes if o.ok and o.value is not None and o.value.ok)
    if not as_json:
        out.print(f"{healthy}/{len(result.outcomes)} nodes fine ({result.wall_s:.1f} s)")
    if healthy != len(result.outcomes):
        raise typer.Exit(1)


def _print_facts(result: Any) -> None:
    table = Table(title="inventory check")
    for column in ("node", "status", "system", "resources", "accelerators", "sudo", "clock offset"):
        table.add_column(column, overflow="fold")
    notes: list[str] = []
    for outcome in result.outcomes:
        f = outcome.value
        if f is None:
            table.add_row(outcome.node, "[red]unreachable[/]", "(see below)", "", "", "", "")
            notes.append(f"[red]{outcome.node}[/]: " + escape(outcome.error or "failed"))
            continue
        status = "[red]FAIL[/]" if not f.ok else "[yellow]ok (warnings)[/]" if f.warnings else "[green]ok[/]"
        system = f"{f.hostname} {f.arch}\n{f.os}\nkernel {f.kernel}" + (f"\n{f.python}" if f.python else "")
        resources = " · ".join(
            x
            for x in (
                f"{f.cpus} CPUs" if f.cpus else "",
                f"{f.mem_total_mib / 1024:.1f} GiB RAM" if f.mem_total_mib else "",
                f"{f.disk_free_gib:.0f} GiB free" if f.disk_free_gib is not None else "",
            )
            if x
        )
        accelerators = [f"GPU {g.index}: {g.name}" for g in f.gpus]
        if f.l4t_release:
            standin = " (emulated: stand-in files)" if f.emulated else ""
            accelerators.append(f"{f.board_model or 'Jetson'}, L4T {f.l4t_release}{standin}")
        accelerators += [f"adb {d.serial}: {d.state}" for d in f.adb_devices]
        clock = f"{f.clock.offset_s * 1e3:+.1f} ms (±{f.clock.error_bound_s * 1e3:.1f})" if f.clock else "n/a"
        # What a node reports is text, never markup: a hostname or OS name may contain "[".
        table.add_row(f.node, status, escape(system), resources, escape("\n".join(accelerators)), escape(f.sudo), clock)
        notes += [f"[red]{f.node}[/]: " + escape(p) for p in f.problems]
        notes += [f"[yellow]{f.node}[/]: " + escape(w) for w in f.warnings]
    out.print(table)
    for note in notes:
        out.print(note, soft_wrap=True)


@inventory_app.command("export-ansible")
def inventory_export_ansible(
    inventory: InventoryOption = Path("inventory.yaml"),
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
) -> None:
    """Write the same hosts and groups as an Ansible YAML inventory (phones are left out: Ansible
    reaches them through their USB host)."""
    from testbed.inventory.ansible_export import ansible_inventory_yaml

    text, skipped = ansible_inventory_yaml(load_lab(inventory))
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)
        err.print(f"wrote {output}")
    for line in skipped:
        err.print(f"left out {line}")


ModeOption = Annotated[
    str,
    typer.Option(
        "--mode",
        help="netns: namespaces, veths, cgroups (needs root). local: sshd processes on 127.0.0.1, "
        "no isolation, no shaping, no CPU quotas (for machines without root).",
    ),
]


@emulate_app.command("up")
def emulate_up(inventory: InventoryOption = Path("inventory.yaml"), mode: ModeOption = "netns") -> None:
    """Build the emulated testbed from every node with an 'emulated:' section: a network namespace
    with a management veth (unshaped) and a data veth (the plane link shaping applies to), an sshd
    on the management address inside a cgroup with the CPU quota of the node's power mode, and
    stand-in nvpmodel, jetson_clocks and tegrastats on emulated Jetsons. The resolved inventory
    (addresses, keys) is written to the state directory and used by every other command. Running
    it again on a healthy testbed changes nothing; after a crash it first removes the leftovers."""
    from testbed.emulation.lifecycle import up

    inv = load_inventory(inventory)
    result = up(inv, mode=mode, say=lambda line: err.print(escape(line), highlight=False))
    _print_emulation(result)
    if not result.ok:
        raise typer.Exit(1)


@emulate_app.command("down")
def emulate_down(inventory: InventoryOption = Path("inventory.yaml")) -> None:
    """Remove everything 'emulate up' made (processes, cgroups, veths, namespaces, bridges, state),
    using its journal, so it also cleans up after an 'up' that was killed halfway. Touches nothing
    it did not make. Safe to run again."""
    from testbed.emulation.lifecycle import down

    problems = down(load_inventory(inventory), say=lambda line: err.print(escape(line), highlight=False))
    if problems:
        raise typer.Exit(1)


@emulate_app.command("status")
def emulate_status(inventory: InventoryOption = Path("inventory.yaml"), as_json: JsonOption = False) -> None:
    """List the emulated nodes with their addresses, power mode, CPU quota and health. Exits 0 when
    the testbed is up and every node is healthy, 1 otherwise."""
    from testbed.emulation.lifecycle import status

    result = status(load_inventory(inventory))
    if as_json:
        out.print_json(data=jsonable(result))
    else:
        _print_emulation(result)
    if not result.ok:
        raise typer.Exit(1)


def _print_emulation(result: Any) -> None:
    if not result.running:
        leftovers = f" ({result.leftovers} leftover records: run 'testbed emulate down')" if result.leftovers else ""
        out.print(f"the emulated testbed is not running{leftovers}; state directory {result.state_dir}")
        return
    table = Table(title=f"emulated testbed ({result.mode} mode), state in {result.state_dir}")
    for column in ("node", "ssh", "data plane", "power mode", "CPU quota", "health"):
        table.add_column(column, overflow="fold")
    for n in result.nodes:
        health = "[green]ok[/]" if n.ok else "[red]" + escape("; ".join(n.problems)) + "[/]"
        table.add_row(n.node, n.address, n.data_address, n.power_mode, n.cpu_quota, health)
    out.print(table)


# --------------------------------------------------------------------------------------------
# testbed link


def _say(line: str) -> None:
    err.print(escape(line), highlight=False)


def _print_outcome_errors(result: Any) -> None:
    for o in result.outcomes:
        if not o.ok:
            err.print(f"[red]{escape(o.node)}:[/] " + escape(o.error or ""), highlight=False, soft_wrap=True)


def _parse_trace_options(inv: Inventory, specs: list[str]) -> dict[str, Any]:
    """``CSV`` (every device with a link to a server) or ``NODE_OR_GROUP=CSV``."""
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
    transaction: refuse up front, changing nothing, when a node lacks the data interface, when the
    interface carries the SSH session, when a profile needs delay/jitter/loss and the kernel has no
    sch_netem, or when a foreign qdisc is in the way (exit 2). Each node journals its interfaces
    before the first tc command; tc is read back and compared with the plan; if any node fails,
    every node is undone (exit 1). Applying again replaces the shaping in place."""
    from netem.plan import queue_limit_packets
    from testbed.links.apply import apply_plans, apply_trace
    from testbed.links.plans import compile_plan

    inv = load_lab(inventory)
    if sum(x is not None for x in (profile, links_file, trace)) > 1:
        raise TestbedError("give at most one of --profile, --links and --trace")
    started = None
    try:
        if trace:
            result, started = apply_trace(inv, _parse_trace_options(inv, trace), say=_say)
        else:
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
            result = apply_plans(inv, compile_plan(inv, links), say=_say)
    except NodeError as exc:
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        out.print_json(data=jsonable({"applied": result.applied, "trace": started}))
    else:
        table = Table(title="links shaped (read back and matching the plan)" if result.ok else "shaping failed")
        for column in ("node", "device", "direction", "peer", "profile", "rate", "queue"):
            table.add_column(column, overflow="fold")
        for o in result.applied.outcomes:
            for plan in o.value.plans if o.value else ():
                for p in plan.peers:
                    table.add_row(
                        plan.node, plan.shaped_device, plan.direction, p.peer, p.profile_name,
                        format_rate(p.profile.rate_bit_s) if p.profile.rate_bit_s else "",
                        f"{queue_limit_packets(p.profile)} packets",
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
    applied, and whether a trace player runs. Exits 1 if a node cannot be read."""
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
                    "qdiscs": {d: list(s.qdiscs) for d, s in v.states.items()} if v else {},
                }
            )  # fmt: skip
        out.print_json(data=payload)
    else:
        table = Table(title="shaping read back from tc")
        for column in ("node", "device", "class", "peer", "rate", "queue", "sent", "dropped"):
            table.add_column(column, overflow="fold")
        for o in result.outcomes:
            if o.value is None:
                continue
            shaped = False
            for dev, state in o.value.states.items():
                filters = {f.get("options", {}).get("flowid"): f for f in state.filters}
                for c in state.classes:
                    flt = filters.get(c.classid, {}).get("options", {}).get("match", {})
                    peer = ""
                    if flt.get("value"):
                        address = str(ipaddress.IPv4Address(int(flt["value"], 16)))
                        peer = by_address.get(address, address)
                    leaf = state.qdisc(c.leaf) if c.leaf else None
                    queue = f"{leaf['kind']} {leaf.get('options', {}).get('limit', '')}" if leaf else ""
                    table.add_row(
                        o.node, dev, c.classid, peer, format_rate(c.rate_bit_s), queue,
                        f"{c.sent_bytes} B / {c.sent_packets} pkt", str(c.dropped_packets),
                    )  # fmt: skip
                    shaped = True
            if not shaped:
                table.add_row(o.node, "", "", "not shaped", "", "", "", "")
        out.print(table)
        for o in result.outcomes:
            if o.value is not None and o.value.journal is not None and o.value.journal.trace_pidfile:
                out.print(f"{o.node}: a trace player was started ({o.value.journal.trace_pidfile})")
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@link_app.command("verify")
def link_verify(
    inventory: InventoryOption = Path("inventory.yaml"),
    duration: Annotated[float, typer.Option("--duration", help="Seconds of iperf3 per direction.", min=1)] = 3.0,
    as_json: JsonOption = False,
) -> None:
    """Measure every shaped direction of the inventory's links, one at a time: iperf3 from the
    source's data address to a server bound to the destination's data address (TCP goodput, first
    second omitted), and ping RTT and loss where netem shapes delay or loss. Prints measured
    against target; exits 0 when every direction is within tolerance (rate within 10%), else 1."""
    from testbed.links.verify import RATE_TOLERANCE, verify_links

    inv = load_lab(inventory)
    if not inv.links:
        raise TestbedError(f"{inventory} has no links to verify")
    rows = verify_links(inv, duration_s=duration, say=_say)
    if as_json:
        out.print_json(data=jsonable(rows))
    else:
        table = Table(title=f"link verification (rate within {RATE_TOLERANCE:.0%})")
        for column in ("from", "to", "profile", "target", "measured", "error", "RTT ms", "ok", "note"):
            table.add_column(column, overflow="fold")
        for r in rows:
            table.add_row(
                r.source, r.destination, r.profile,
                format_rate(r.target_rate_bit_s) if r.target_rate_bit_s else "",
                f"{r.measured_rate_bit_s / 1e6:.2f} mbit" if r.measured_rate_bit_s else "",
                f"{r.rate_error_pct:+.1f}%" if r.rate_error_pct is not None else "",
                f"{r.measured_rtt_ms:.2f}" if r.measured_rtt_ms is not None else "",
                "[green]yes[/]" if r.within_tolerance else "[red]no[/]", escape(r.note),
            )  # fmt: skip
        out.print(table)
    if not all(r.within_tolerance for r in rows):
        raise typer.Exit(1)


@link_app.command("clear")
def link_clear(inventory: InventoryOption = Path("inventory.yaml")) -> None:
    """Undo all shaping from each node's own journal: stop the trace player, remove only our qdiscs
    (handle 1f7b:, our ingress qdisc) and ifb devices, and check that each interface is back to
    what it was before the first apply. Works after the controller was killed mid-apply. Safe to
    run again; exits 1 if a node could not be cleared."""
    from testbed.links.apply import clear_nodes

    inv = load_lab(inventory)
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


def _power_table(title: str, readings: list[Any]) -> Table:
    table = Table(title=title)
    for column in ("node", "kind", "mode", "clocks locked", "journal", "modes available", "warnings"):
        table.add_column(column, overflow="fold")
    for r in readings:
        mode = f"{r.mode_id} ({r.mode_name})" if r.mode_id != r.mode_name else str(r.mode_id or "-")
        locked = "" if r.clocks_locked is None else ("yes" if r.clocks_locked else "no")
        modes = ", ".join(f"{i} {n}" if i != n else i for i, n in r.modes)
        table.add_row(r.node, r.kind, escape(mode), locked, "changed" if r.journal else "", escape(modes),
                      escape("; ".join(r.warnings)))
    return table


@power_app.command("show")
def power_show(inventory: InventoryOption = Path("inventory.yaml"), nodes: NodesOption = None,
               as_json: JsonOption = False) -> None:
    """Show each node's current power mode (as its tool reads it back), whether clocks are locked,
    the modes it offers, and whether it was changed since the last restore (its journal)."""
    from testbed.power import show_power

    inv = load_lab(inventory)
    result = show_power(inv, nodes)
    readings = list(result.values().values())
    if as_json:
        out.print_json(data=jsonable(readings))
    else:
        out.print(_power_table("power modes", readings))
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@power_app.command("set")
def power_set(
    target: Annotated[str, typer.Argument(help="Node or group name (or 'all').")],
    mode: Annotated[str, typer.Argument(help="Jetson: mode id or name (0, MAXN, MODE_15W). Server: 'default' "
                                      "or a GPU power limit such as 250W. Phone: GOVERNOR[@KHZ].")],
    inventory: InventoryOption = Path("inventory.yaml"),
    lock_clocks: Annotated[bool, typer.Option("--lock-clocks", help="Also lock clocks at their maximum "
                                              "(jetson_clocks; NVML locked clocks).")] = False,
) -> None:
    """Set a power mode on a node or group and read it back; exits 1 if any node reads back
    something else. The state before the first change is journaled on the node."""
    from testbed.power import set_power

    inv = load_lab(inventory)
    result = set_power(inv, [target], mode, lock_clocks=lock_clocks)
    readings = list(result.values().values())
    if readings:
        out.print(_power_table(f"power mode {mode}, read back", readings))
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@power_app.command("restore")
def power_restore(inventory: InventoryOption = Path("inventory.yaml"), nodes: NodesOption = None) -> None:
    """Put every node back to the power mode and clocks its journal recorded before the first
    change, read it back, and drop the journal. Nodes without a journal are left alone."""
    from testbed.power import restore_power

    inv = load_lab(inventory)
    result = restore_power(inv, nodes)
    for o in result.outcomes:
        if o.ok:
            v = o.value
            out.print(f"{o.node}: " + (f"restored to {v.mode_id} ({v.mode_name})" if v else "nothing to restore"))
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@telemetry_app.command("probe")
def telemetry_probe(
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: NodesOption = None,
    require_energy: Annotated[bool, typer.Option("--require-energy", help="Fail (exit 1) for every node "
                                                 "without a working power or energy sensor.")] = False,
    jetson_source: JetsonSourceOption = "tegrastats",
    as_json: JsonOption = False,
) -> None:
    """Take two samples from every node's telemetry source and list each sensor with its reading,
    or why it gave none (NVML NotSupported, RAPL root-only, a charging phone...)."""
    from testbed.telemetry import probe_telemetry

    inv = load_lab(inventory)
    result = probe_telemetry(inv, nodes, require_energy=require_energy, jetson_source=jetson_source)
    probes = list(result.values().values())
    if as_json:
        out.print_json(data=jsonable(probes))
    else:
        table = Table(title="telemetry sensors")
        for column in ("node", "source", "metric", "sensor", "value", "unit", "kind", "problem"):
            table.add_column(column, overflow="fold")
        for p in probes:
            by_metric: dict[str, list[Any]] = {}
            for s in p.sensors:
                by_metric.setdefault(s.metric + ("!" if s.problem else ""), []).append(s)
            for group in by_metric.values():
                s = group[0]  # one row per metric: its first sensor's reading, the others named
                more = f" (+{len(group) - 1} more)" if len(group) > 1 else ""
                value = f"{s.value:.6g}" if s.value is not None else ""
                table.add_row(p.node, p.source, s.metric, escape(s.sensor) + more, value, s.unit, s.kind,
                              f"[yellow]{escape(s.problem)}[/]" if s.problem else "")
        out.print(table)
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@telemetry_app.command("record")
def telemetry_record(
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for <node>.parquet, raw/ and recording.json.")],
    seconds: Annotated[float, typer.Option("--seconds", help="How long to record.", min=0.5, max=86400)] = 10.0,
    interval_ms: Annotated[int, typer.Option("--interval-ms", help="Sampling interval.", min=10, max=60000)] = 100,
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: NodesOption = None,
    require_energy: Annotated[bool, typer.Option("--require-energy", help="Refuse to start unless every "
                                                 "node has a working energy sensor.")] = False,
    jetson_source: JetsonSourceOption = "tegrastats",
) -> None:
    """Record telemetry outside a campaign: start a detached sampler on every node, wait, measure
    clock offsets at both ends, then collect telemetry/<node>.parquet in long format (ts_s on the
    controller's clock, node_ts_s, metric, value, unit, sensor, kind, period_s)."""
    from testbed.telemetry import record_telemetry

    inv = load_lab(inventory)
    result = record_telemetry(inv, nodes, seconds, out_dir, interval_s=interval_ms / 1000.0,
                              require_energy=require_energy, jetson_source=jetson_source, say=_say)
    table = Table(title=f"telemetry recorded in {out_dir}")
    for column in ("node", "rows", "longest gap", "clock offset", "drift", "sampler"):
        table.add_column(column)
    for n in result.nodes:
        gap = f"{n.max_gap_s * 1000:.0f} ms" if n.max_gap_s is not None else ""
        table.add_row(n.node, str(n.rows), gap, f"{n.clock_start.offset_s * 1000:+.2f} ms",
                      f"{n.drift_ppm:+.1f} ppm", n.stopped)
    out.print(table)
    for node, error in result.errors.items():
        err.print(f"[red]{escape(node)}:[/] {escape(error)}", highlight=False, soft_wrap=True)
    if not result.ok:
        raise typer.Exit(1)


@telemetry_app.command("import-tegrastats")
def telemetry_import_tegrastats(
    log: Annotated[Path, typer.Argument(help="A tegrastats log (tegrastats --logfile, or its stdout).")],
    node: Annotated[str, typer.Option("--node", help="The node name the rows are for.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write <node>.parquet to.")] = Path("."),
    interval_ms: Annotated[int, typer.Option("--interval-ms", help="The log's interval (for JetPack 4 lines, "
                                             "which carry no timestamp).", min=1)] = 1000,
    utc_offset_h: Annotated[float, typer.Option("--utc-offset", help="Hours between the board's local time "
                                                "(its timestamps) and UTC.")] = 0.0,
) -> None:
    """Convert an existing tegrastats log (JetPack 4 to 7) into our telemetry format."""
    from testbed.telemetry import import_tegrastats

    if not log.is_file():
        raise TestbedError(f"{log}: no such file")
    path = import_tegrastats(log, node, out_dir, interval_s=interval_ms / 1000.0, utc_offset_h=utc_offset_h)
    out.print(f"wrote {path}")


TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny"


METHODS_HELP = "One of the registered methods (nodes/workers/methods): " + "; ".join(
    f"{m.name} ({m.summary})" for m in map(method_named, method_names())
) + ". Drafting methods use the adapter in MODEL/draft."


@workers_app.command("run")
def workers_run(
    schedule: Annotated[Path, typer.Argument(help="JSON lines of requests: request_id, arrival_s (from the "
                                             "start), prompt or prompt_ids, max_new_tokens. Every device "
                                             "replays it.")],
    inventory: InventoryOption = Path("inventory.yaml"),
    method: Annotated[str, typer.Option(help=METHODS_HELP)] = "ushape",
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory, as seen on the nodes.")] = TINY_MODEL,
    server: Annotated[str, typer.Option(help="Node that runs the pipeline stages and mpiexec.")] = "server",
    devices: Annotated[str, typer.Option(help="Comma-separated device nodes or groups.")] = "devices",
    stages: Annotated[int, typer.Option("--stages", "-P", help="Server pipeline stages (MPI ranks).")] = 1,
    device_layers: Annotated[int, typer.Option("--device-layers", "-m", help="Layers the device runs after "
                                               "the embedding (U-shape's m).")] = 1,
    chunk_tokens: Annotated[int, typer.Option(help="usarathi's prompt chunk (token budget per iteration); the "
                                              "first chunk of pc methods, before the link is measured.")] = 128,
    dtype: Annotated[str, typer.Option(help="float32, float16, bfloat16 or auto (the checkpoint's).")] = "float32",
    out_dir: Annotated[Path, typer.Option("--out", help="Where rank files and mpiexec.log are collected.")] = Path(
        "split-run"
    ),
    run_id: Annotated[str, typer.Option(help="Name of the run's directory on the nodes.")] = "split",
    timeout: Annotated[float, typer.Option(help="Seconds before mpiexec and every rank are ended.")] = 600.0,
    as_json: JsonOption = False,
) -> None:
    """Run one split-inference run and print each request's TTFT and TBT. Files per rank land in
    OUT/ranks/: requests.jsonl and tokens.csv from devices, iterations.csv from server stages."""
    from nodes.workers.run_config import RunConfigError, load_schedule
    from testbed.split_run import SplitRunSpec, run_split

    inv = load_lab(inventory)
    try:
        rows = [r._asdict() for r in load_schedule(str(schedule))]
    except (OSError, RunConfigError) as exc:
        raise TestbedError(str(exc)) from None
    schedule_rows = tuple({k: v for k, v in r.items() if v is not None} for r in rows)
    device_names = tuple(n.name for n in inv.select([d.strip() for d in devices.split(",") if d.strip()]))
    spec = SplitRunSpec(
        method=method, model=str(model.resolve()) if model.exists() else str(model), server=server,
        devices=device_names, stages=stages, device_layers=device_layers, chunk_tokens=chunk_tokens, dtype=dtype,
        schedule=schedule_rows, run_id=run_id, timeout_s=timeout,
    )  # fmt: skip
    try:
        result = run_split(inv, spec, out_dir, say=_say)
    except NodeError as exc:
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    requests = sorted(result.requests(), key=lambda r: (r["node"], r["request_id"]))
    if as_json:
        out.print_json(data={"out": str(out_dir), "seconds": result.seconds, "requests": requests})
        return
    speculative = any("speculative" in r for r in requests)
    caption = ("accept len: vLLM's mean acceptance length, 1 + accepted draft tokens / verification rounds "
               "(the bonus token counted)") if speculative else None  # fmt: skip
    table = Table(title=f"{method}: {len(requests)} requests in {result.seconds:.1f} s (files in {out_dir})",
                  caption=caption)  # fmt: skip
    columns = ["node", "request", "prompt tok", "chunks", "out tok", "TTFT ms", "mean TBT ms", "network ms"]
    for column in [*columns, *(["accept len"] if speculative else []), "text"]:
        table.add_column(column, overflow="fold")
    import pandas as pd

    from analysis.metrics import request_latencies

    latencies = request_latencies(pd.DataFrame(requests)) if requests else None
    for index, r in enumerate(requests):
        tbt = latencies["tpot_s"].iloc[index] * 1e3  # the mean gap between tokens: vLLM's TPOT
        length = (r.get("speculative") or {}).get("acceptance_length")
        table.add_row(
            r["node"], str(r["request_id"]), str(r["prompt_tokens"]), str(len(r["prefill"]["chunks_tokens"])),
            str(r["output_tokens"]), f"{r['ttft_s'] * 1e3:.0f}", f"{tbt:.1f}", f"{r['prefill']['network_s'] * 1e3:.0f}",
            *([f"{length:.2f}" if length is not None else "-"] if speculative else []),
            r["text"][:40].replace("\n", "\\n"),
        )  # fmt: skip
    out.print(table)


def _summarise_changes(changes: tuple[str, ...]) -> str:
    """``made the venv ...``, ``sent <file> ...`` -> ``venv made, 3 files sent`` (the lines printed
    while provisioning, and the record, have the details)."""
    if not changes:
        return "no changes"
    counts: dict[str, int] = {}
    for change in changes:
        verb = change.split(" ", 1)[0]
        what = {"made": "venv made", "pushed": "wheelhouse pushed", "removed": "stale file removed"}.get(verb)
        if verb == "installed":
            what = "wheel installed" if ".whl" in change else "system packages installed"
        counts[what or f"file {verb}"] = counts.get(what or f"file {verb}", 0) + 1
    return ", ".join(f"{n} {what.replace('file ', 'files ')}" if n > 1 else what for what, n in counts.items())


@app.command("provision")
def provision_command(
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: NodesOption = None,
    model: Annotated[Path | None, typer.Option(help="Hugging Face checkpoint directory (safetensors) on this "
                                               "machine: each node gets only its role's tensors.")] = None,
    partition: Annotated[str | None, typer.Option(help="U-shaped partition of --model: m=device layers, "
                                                  "P=server stages, e.g. m=2,P=4.")] = None,
    parallel: Annotated[int, typer.Option(help="How many nodes to provision at once.", min=1)] = 32,
    as_json: JsonOption = False,
) -> None:
    """Bring the nodes to a known, recorded software state, in parallel and idempotently (a second
    run changes nothing and says so). On each Linux node: check what runs need (tc, ip, iperf3,
    passwordless sudo, time sync, jtop on Jetsons, phones on USB hosts, nvidia-smi on GPU servers,
    free disk), installing missing tools where apt and sudo allow, else printing the command to run;
    make the venv (defaults.venv, default <workdir>/venv) and install the node wheel with the extras
    of the node's kind (a Jetson keeps NVIDIA's torch; others get the pinned torch), from PyPI or,
    without registry access, from a wheelhouse this machine pushes. With --model and --partition,
    devices get the embedding, the first m layers, the final norm and the LM head, the server the
    middle layers, as content-hashed safetensors sent only when missing or damaged. Each node's
    versions (packages, torch, CUDA, MPI and its ABI, the wheel's hash) go to the state directory's
    provisioned/<node>.json. Exits 1 when a node failed or has a problem, or when nodes differ in MPI
    ABI or node code version."""
    from testbed.provision import ProvisionOptions, provision
    from testbed.weights import parse_partition

    inv = load_lab(inventory)
    if partition is not None and model is None:
        raise TestbedError("--partition needs --model")
    options = ProvisionOptions(model=model, partition=parse_partition(partition) if partition else None)
    result, across = provision(inv, nodes, options, max_parallel=parallel, say=_say)
    if as_json:
        payload = {
            "nodes": [
                {"node": o.node, "error": o.error, **(jsonable(o.value) if o.value is not None else {})}
                for o in result.outcomes
            ],
            "problems_across_nodes": across,
            "records": str(inv.state_dir / "provisioned"),
        }
        out.print_json(data=payload)
    else:
        table = Table(title=f"provisioning ({result.wall_s:.1f} s; records in {inv.state_dir / 'provisioned'})")
        for column in ("node", "status", "node code", "torch", "MPI", "changes"):
            table.add_column(column, overflow="fold")
        for o in result.outcomes:
            if o.value is None:
                table.add_row(o.node, "[red]failed[/]", "", "", "", escape(o.error or ""))
                continue
            installed = o.value.record.get("installed") or {}
            torch = installed.get("torch", {})
            mpi = installed.get("mpi", {})
            status = "[green]ok[/]"
            if o.value.problems or o.value.warnings:
                status = "[red]problems[/]" if o.value.problems else "[yellow]ok (warnings)[/]"
            cuda = f" CUDA {torch['cuda']}" if torch.get("cuda") else ""
            table.add_row(
                o.node, status, escape(o.value.record.get("installed_wheel") or "not installed"),
                escape(f"{torch.get('version', torch.get('error', '?'))}{cuda}"),
                escape(mpi.get("abi") or str(mpi.get("error", "?"))[:60]),
                escape(_summarise_changes(o.value.changes)),
            )  # fmt: skip
        out.print(table)
        for o in result.outcomes:
            if o.value is not None:
                for problem in o.value.problems:
                    out.print(f"[red]{escape(o.node)}[/]: " + escape(problem), soft_wrap=True)
                for warning in o.value.warnings:
                    out.print(f"[yellow]{escape(o.node)}[/]: " + escape(warning), soft_wrap=True)
        for problem in across:
            out.print("[red]across nodes[/]: " + escape(problem), soft_wrap=True)
        if result.ok and not any(o.changes for o in result.values().values()):
            out.print("nothing to do: every node was already provisioned")
    if not result.ok or across or any(not v.ok for v in result.values().values()):
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------
# testbed run / status / demo

CampaignOutOption = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Campaign directory (ledger, runs, report). Default: results/<campaign name>."),
]


@app.command("run")
def run_command(
    campaign_file: Annotated[Path, typer.Argument(help="Campaign YAML: inventory, base settings, matrix, "
                                                  "repetitions, seed, order, timeout, failure policy.")],
    inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="Use this inventory instead of "
                                                   "the one the campaign names.")] = None,
    out_dir: CampaignOutOption = None,
    resume: Annotated[bool, typer.Option("--resume", help="Go on with a campaign started before (also after "
                                         "the controller was killed): done runs are kept, interrupted ones "
                                         "rerun.")] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="With --resume: run failed and skipped runs "
                                               "again and lift quarantines.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the expanded runs and each node's commands; "
                                          "touch nothing.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Run an experiment campaign: every run of the matrix x repetitions, in the campaign's order,
    each as preflight, configure (power modes, links, read back), telemetry, MPI workers driving the
    workload, drain, collect, restore and a manifest. The ledger (OUT/ledger.sqlite) records each
    run's state, so --resume finishes a campaign whose controller died, doing no run twice. Exit
    status 0 when every run is done, 1 when a run failed or was skipped, 2 for a bad campaign file
    (nothing is touched then)."""
    from testbed.campaign.load import load_campaign

    if retry_failed and not resume:
        raise TestbedError("--retry-failed goes with --resume")
    campaign = load_campaign(campaign_file, inventory=inventory)
    if dry_run:
        _print_dry_run(campaign, as_json)
        return
    from testbed.campaign.display import CampaignDisplay
    from testbed.campaign.runner import run_campaign
    directory = out_dir or Path("results") / campaign.spec.name
    _interrupt_on_sigterm()
    display = CampaignDisplay(err, len(campaign.runs))
    with display:
        summary = run_campaign(campaign, directory, resume=resume, retry_failed=retry_failed, say=display.say,
                               report=display.report)  # fmt: skip
    _print_campaign_summary(summary, as_json)
    if not summary.ok:
        raise typer.Exit(1)


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends a campaign like Ctrl-C: the current run is restored and recorded before exiting
    (its ledger row stays 'running', so --resume runs it again)."""
    import signal

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _print_dry_run(campaign: Any, as_json: bool) -> None:
    from testbed.campaign.plan import plan_run
    from testbed.campaign.runner import describe_run

    plans = [plan_run(campaign, r, 1, live=True) for r in campaign.runs]
    runs = [{**describe_run(r), "commands": plan.actions(), "plan": plan.to_json()}
            for r, plan in zip(campaign.runs, plans, strict=True)]  # fmt: skip
    if as_json:
        out.print_json(data={"campaign": campaign.spec.name, "inventory": str(campaign.inventory.path), "runs": runs})
        return
    table = Table(title=f"{campaign.spec.name}: {len(runs)} runs (dry run: nodes were only read, nothing changed)")
    for column in ("#", "run id", "rep", "seed", "settings"):
        table.add_column(column, overflow="fold")
    for r in campaign.runs:
        table.add_row(str(r.position + 1), r.run_id, str(r.repetition), str(r.seed), escape(r.label()))
    out.print(table)
    for r, plan in zip(campaign.runs, plans, strict=True):
        out.print(f"[bold]run {r.position + 1} {r.run_id}[/] ({escape(r.label())})")
        out.print(escape(plan.render()), highlight=False, soft_wrap=True)


def _print_campaign_summary(summary: Any, as_json: bool) -> None:
    from testbed.campaign.ledger import Ledger

    with Ledger.open(summary.directory / "ledger.sqlite") as ledger:
        rows, nodes = ledger.runs(), ledger.nodes()
    if as_json:
        out.print_json(data={"directory": str(summary.directory), "counts": summary.counts,
                             "quarantined": summary.quarantined, "runs": jsonable(rows),
                             "nodes": jsonable(nodes)})  # fmt: skip
        return
    c = summary.counts
    table = Table(title=f"campaign in {summary.directory}: {c['done']} done, {c['failed']} failed, "
                  f"{c['skipped']} skipped, {c['todo'] + c['running']} to do")  # fmt: skip
    for column in ("#", "run id", "state", "attempts", "seconds", "settings", "reason"):
        table.add_column(column, overflow="fold")
    for r in rows:
        seconds = f"{r.ended_s - r.started_s:.1f}" if r.ended_s and r.started_s else ""
        color = {"done": "green", "failed": "red", "skipped": "yellow"}.get(r.state, "white")
        table.add_row(str(r.position + 1), r.run_id, f"[{color}]{r.state}[/]", str(r.attempts), seconds,
                      escape(r.label), escape(r.reason or ""))  # fmt: skip
    out.print(table)
    for n in nodes:
        if n.quarantined_s is not None:
            out.print(f"[red]{escape(n.node)} quarantined[/]: {escape(n.reason or '')}", soft_wrap=True)


@app.command("status")
def status_command(
    campaign_dir: Annotated[Path, typer.Argument(help="The campaign's directory (testbed run --out).")],
    as_json: JsonOption = False,
) -> None:
    """Show a campaign's progress from its ledger: each run's state, attempts, time and failure
    reason, and quarantined nodes. Reads only files; exits 1 while runs failed or remain."""
    from testbed.campaign.ledger import Ledger
    from testbed.campaign.runner import LEDGER, CampaignSummary

    with Ledger.open(campaign_dir / LEDGER) as ledger:
        summary = CampaignSummary(campaign_dir, ledger.counts(), ledger.quarantined(), False)
    _print_campaign_summary(summary, as_json)
    if not summary.ok:
        raise typer.Exit(1)


@app.command("report")
def report_command(
    campaign_dir: Annotated[Path, typer.Argument(help="The campaign's directory (testbed run --out).")],
    api: Annotated[str, typer.Option(help="API whose price (DiSCo Table 8, USD per million tokens) bills the "
                                     "server's share of each request.")] = "gpt-4o-mini",
    device_usd_per_pflop: Annotated[float, typer.Option(help="Device cost per 10^15 FLOPs (DiSCo App. E: 0.3 "
                                                        "server-constrained, 5 device-constrained).")] = 0.3,
    qoe_alpha: Annotated[float | None, typer.Option(help="Andes' TTFT penalty alpha in [0, 1] (default: none, "
                                                    "Eq. 1 as is).")] = None,
    run_id: Annotated[str | None, typer.Option("--run", help="The run whose token timelines and telemetry are "
                                               "drawn (default: the done run with the lowest mean QoE).")] = None,
) -> None:
    """Analyse a finished (or partly finished) campaign: write report/report.md with PNG figures and
    CSV tables beside it. It covers TTFT/TBT per method in the layout of HAT's Table 5 and per
    configuration, latency against request rate, HAT's SLA compliance CDFs, Andes QoE and capacity,
    energy per token by node and power mode (measured and modeled kept apart), DiSCo's cost per
    request, and one run's token timelines and telemetry. Reads only files."""
    from analysis.cost_model import API_PRICES_USD_PER_MTOK
    from analysis.report import ReportOptions, build_report

    if not (campaign_dir / "ledger.sqlite").is_file():
        raise TestbedError(f"{campaign_dir}: not a campaign directory (no ledger.sqlite); give testbed run's --out")
    if api not in API_PRICES_USD_PER_MTOK:
        raise TestbedError(f"--api: unknown API {api!r}; one of {', '.join(API_PRICES_USD_PER_MTOK)}")
    if run_id is not None and not (campaign_dir / "runs" / run_id / "manifest.json").is_file():
        raise TestbedError(f"--run: {campaign_dir}/runs/{run_id} is not a finished run of this campaign")
    if qoe_alpha is not None and not 0 <= qoe_alpha <= 1:
        raise TestbedError(f"--qoe-alpha: {qoe_alpha} is outside [0, 1]")
    if not device_usd_per_pflop >= 0:
        raise TestbedError(f"--device-usd-per-pflop: {device_usd_per_pflop} must not be negative")
    path = build_report(campaign_dir, ReportOptions(api=api, device_usd_per_pflop=device_usd_per_pflop,
                                                    qoe_alpha=qoe_alpha, delivery_run=run_id))
    out.print(f"report: {path}", soft_wrap=True)


EXAMPLE_CAMPAIGNS = Path(__file__).resolve().parents[2] / "examples" / "campaigns"


@app.command("demo")
def demo_command(
    inventory: InventoryOption = Path("inventory.yaml"),
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Campaign directory; a previous demo there is "
                                          "replaced.")] = Path("demo-output/campaign"),
    campaign_file: Annotated[Path | None, typer.Option("--campaign", help="Campaign to run (default: "
                                                       "examples/campaigns/demo.yaml, or demo-local.yaml without "
                                                       "root).")] = None,
) -> None:
    """The whole suite in one command: bring up the emulated testbed (network namespaces as root,
    local processes otherwise), run the demo campaign (methods x link profiles x power modes on the
    tiny model), write its report (testbed report), print where it is, and take the testbed down again
    (unless it was already up)."""
    import os
    import shutil

    from testbed.campaign.display import CampaignDisplay
    from testbed.campaign.load import load_campaign
    from testbed.campaign.runner import LEDGER, run_campaign
    from testbed.emulation.lifecycle import down, status, up

    root = os.geteuid() == 0
    chosen = campaign_file or EXAMPLE_CAMPAIGNS / ("demo.yaml" if root else "demo-local.yaml")
    load_campaign(chosen, inventory=inventory)  # a bad file stops here, before anything is built
    if out_dir.exists():
        if not (out_dir / LEDGER).exists():
            raise TestbedError(f"{out_dir} exists and is not a campaign directory; choose another --out")
        shutil.rmtree(out_dir)
    lab = load_inventory(inventory)
    was_up = status(lab).running
    say = lambda line: err.print(escape(line), highlight=False)  # noqa: E731
    if not was_up:
        result = up(lab, mode="netns" if root else "local", say=say)
        if not result.ok:
            _print_emulation(result)
            down(lab, say=say)
            raise typer.Exit(1)
    _interrupt_on_sigterm()
    try:
        campaign = load_campaign(chosen, inventory=inventory)
        display = CampaignDisplay(err, len(campaign.runs))
        with display:
            summary = run_campaign(campaign, out_dir, say=display.say, report=display.report)
        from analysis.report import build_report

        report = build_report(out_dir)
    finally:
        if not was_up:
            down(lab, say=say)
    _print_campaign_summary(summary, False)
    out.print(f"report: {report}", soft_wrap=True)
    if not summary.ok:
        raise typer.Exit(1)


def main() -> None:
    """Entry point, and the one error policy: user input is a message and exit status 2
    (``FILE:LINE: field: problem; hint``); a node or a check that failed is a message naming the node
    and exit status 1; never a traceback."""
    try:
        app()  # usage errors exit 2 (click's convention), typer.Exit(n) exits n
    except TestbedError as exc:  # the user's input or setup: nothing was changed on any node
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        sys.exit(2)
    except NodeError as exc:  # a node (or this machine, hosting an emulated testbed) failed
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        sys.exit(1)
