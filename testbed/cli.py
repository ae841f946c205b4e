"""The ``testbed`` command line.

Every command reads the inventory given with ``--inventory/-i`` (default ``./inventory.yaml``).
Exit status: 0 when everything is fine, 1 when a node or check failed, 2 for bad input (nothing is
touched on any node then).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from testbed import __version__
from testbed.emulation.resolved import load_lab
from testbed.errors import TestbedError
from testbed.inventory import Inventory, NodeSpec, load_inventory
from testbed.units import format_duration, format_rate

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

out = Console()
err = Console(stderr=True)

InventoryOption = Annotated[
    Path,
    typer.Option("--inventory", "-i", help="Inventory file describing the lab.", show_default=True),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


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
        out.print_json(data=_to_json(caps))
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
                "facts": _to_json(o.value),
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
    from testbed.ansible_export import ansible_inventory_yaml

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
        out.print_json(data=_to_json(result))
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


def main() -> None:
    """Entry point: user errors become a message and exit status 2, never a traceback."""
    try:
        app()  # usage errors exit 2 (click's convention), typer.Exit(n) exits n
    except TestbedError as exc:
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        sys.exit(2)
