"""``testbed power``: read, set and restore power modes."""

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
    NodesOption,
    _print_outcome_errors,
    out,
    power_app,
)
from testbed.emulation.resolved import load_lab


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
    from testbed.energy.power_modes import show_power

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
    something else, or if another holder (a running campaign) leases its machine. The state before
    the first change is journaled on the node."""
    from testbed.energy.power_modes import set_power
    from testbed.leases.keeper import command_leases

    inv = load_lab(inventory)
    with command_leases(inv, inv.select([target])):
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
    change, read it back, and drop the journal. Nodes without a journal are left alone. Exits 1 if a
    node could not be restored, or if another holder (a running campaign) leases its machine."""
    from testbed.energy.power_modes import restore_power
    from testbed.leases.keeper import command_leases

    inv = load_lab(inventory)
    with command_leases(inv, inv.select(nodes)):
        result = restore_power(inv, nodes)
    for o in result.outcomes:
        if o.ok:
            v = o.value
            out.print(f"{o.node}: " + (f"restored to {v.mode_id} ({v.mode_name})" if v else "nothing to restore"))
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)
