"""``testbed emulate``: bring the emulated testbed up, down, and show its state."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from foundation.jsonable import jsonable
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    emulate_app,
    err,
    out,
)
from testbed.inventory import load_inventory

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
    print_emulation(result)
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
        print_emulation(result)
    if not result.ok:
        raise typer.Exit(1)


def print_emulation(result: Any) -> None:
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
