"""``testbed lab``: who holds the lab's machines (leases), and giving leases back."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from testbed.cli.app import InventoryOption, JsonOption, NodesOption, _print_outcome_errors, lab_app, out
from testbed.emulation.resolved import load_lab


@lab_app.command("leases")
def lab_leases(inventory: InventoryOption = Path("inventory.yaml"), nodes: NodesOption = None,
               as_json: JsonOption = False) -> None:  # fmt: skip
    """Show who holds each machine: the holder (user@controller), its campaign and pid, when it last
    renewed and when the lease expires (on the machine's own clock). A phone's lease is its USB
    host's. Exits 1 when a machine cannot be read."""
    from testbed.leases.keeper import lease_machines, leases_on

    lab = load_lab(inventory)
    result = leases_on(lab, lease_machines(lab, lab.select(nodes)))
    if as_json:
        rows = []
        for o in result.outcomes:
            answer = o.value
            lease = answer.lease if answer is not None else None
            rows.append({"node": o.node, "error": o.error, "live": bool(answer and answer.live),
                         "node_now_unix_s": answer.node_now_s if answer else None,
                         "lease": lease.__dict__ if lease else None})  # fmt: skip
        out.print_json(data=rows)
    else:
        table = Table(title=f"leases on {lab.path}")
        for column in ("machine", "state", "holder", "campaign"):
            table.add_column(column, overflow="fold")
        for o in result.outcomes:
            answer = o.value
            if answer is None:
                continue
            lease = answer.lease
            if lease is None:
                table.add_row(o.node, "free", "", "")
                continue
            state = "held" if answer.live else "expired"
            table.add_row(o.node, state, escape(lease.describe(answer.node_now_s)), escape(lease.campaign))
        out.print(table)
    _print_outcome_errors(result)
    if not result.ok:
        raise typer.Exit(1)


@lab_app.command("release")
def lab_release(
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: NodesOption = None,
    campaign: Annotated[
        Path | None,
        typer.Option("--campaign", help="Release the leases this user holds for this campaign directory (what a "
                     "killed `testbed run` left; else they expire on their own)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Release whoever holds them: only when their holder is gone for good.")
    ] = False,
) -> None:
    """Give leases back: yours for a campaign (--campaign), or, with --force, whoever holds them. A
    machine leased to someone else is left alone without --force. Exits 1 when a machine cannot be
    reached or is held by another."""
    from testbed.leases.keeper import holder_for, lease_machines, release_on

    if campaign is None and not force:
        raise typer.BadParameter("name the campaign directory whose leases to give back (--campaign), or --force")
    lab = load_lab(inventory)
    holder = holder_for(campaign) if campaign is not None else None
    result = release_on(lab, lease_machines(lab, lab.select(nodes)), holder, force=force)
    held = [o for o in result.outcomes if o.value is not None and o.value.state == "held"]
    for o in result.outcomes:
        if o.value is not None and o.value.state == "released":
            out.print(f"{o.node}: released")
    for o in held:
        lease = o.value.lease if o.value else None
        who = lease.describe(o.value.node_now_s) if lease and o.value else "another holder"
        out.print(f"[yellow]{o.node}[/]: left alone, leased to {escape(who)} (--force to release it anyway)")
    _print_outcome_errors(result)
    if not result.ok or held:
        raise typer.Exit(1)
