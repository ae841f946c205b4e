"""``testbed doctor``: what this machine can do for an emulated testbed."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from foundation.jsonable import jsonable
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    app,
    err,
    out,
)
from testbed.inventory import load_inventory


@app.command()
def doctor(
    inventory: InventoryOption = Path("inventory.yaml"),
    as_json: JsonOption = False,
) -> None:
    """Report what this machine can do for an emulated testbed (root, namespaces, veth, bridges,
    tc qdiscs, iptables NFQUEUE, cgroup CPU quotas, sshd, ethtool, ping, iperf3, mpiexec, torch), by
    trying each in a scratch namespace. Exits 1 if something the emulated testbed needs is missing.
    netem and NFQUEUE are optional: delay, jitter and loss take netem where the kernel has it, else
    the NFQUEUE path (the 'delay-path' row says which); without either, rate shaping still works."""
    from testbed.checks.doctor import check_host

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
