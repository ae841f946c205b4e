"""``testbed inventory``: validate, show and check an inventory's nodes; export it for Ansible."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from foundation.jsonable import jsonable
from foundation.units import format_duration, format_rate
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    err,
    inventory_app,
    out,
)
from testbed.emulation.resolved import load_lab
from testbed.inventory import Inventory, NodeSpec, kind_of


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
        for column in ("profile", "rate", "delay", "jitter", "loss", "needs a delay path"):
            profiles.add_column(column)
        for name, p in inv.spec.link_profiles.items():
            profiles.add_row(
                name,
                format_rate(p.rate_bit_s) if p.rate_bit_s else "",
                format_duration(p.delay_s) if p.delay_s is not None else "",
                format_duration(p.jitter_s) if p.jitter_s is not None else "",
                f"{p.loss_pct:g}%" if p.loss_pct is not None else "",
                "yes" if p.has_delay_or_loss else "no",
            )
        out.print(profiles)
    if inv.links:
        out.print(
            f"{len(inv.links)} shaped directions, e.g. "
            + "; ".join(f"{lk.source} -> {lk.destination}: {lk.profile_name}" for lk in inv.links[:4])
        )


def _reached_at(inv: Inventory, node: NodeSpec) -> str:
    if kind_of(node).via_usb_host and node.adb:
        return f"adb {node.adb.serial} on {node.adb.usb_host}"
    if node.transport == "local":
        return "this machine (local)"
    if node.address is None:
        return "emulated (address assigned at start)"
    t = inv.ssh_target(node)
    return f"ssh {t.describe()}"


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
    deep: Annotated[bool, typer.Option("--deep", help="Also check what runs need: tools, sudo rules, clock "
                                       "sync, torch (with CUDA on GPU nodes), free disk for the weights, MPI "
                                       "ports between server and devices, endpoints, power modes.")] = False,
    model: Annotated[Path | None, typer.Option(help="With --deep: the checkpoint directory whose weights the "
                                               "nodes will hold (default: the fidelity model, "
                                               "examples/models/smollm2-135m, where it is).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Reach every node in parallel and print its facts: hostname, arch, kernel, OS, Python, CPUs,
    memory, free disk, GPUs, Jetson board and L4T release, phones on USB hosts, passwordless sudo,
    the clock offset against this machine, and whether each server reaches every device over SSH as
    mpiexec will. With --deep, the preflight before a campaign on a real lab: every problem comes
    with the command that fixes it. Exits 0 when every node is fine, 1 otherwise (naming them)."""
    from testbed.checks.deep_check import FIDELITY_MODEL, weights_bytes
    from testbed.checks.inventory_check import check_nodes
    from testbed.provisioning.provision import BASE_SPACE_GIB

    inv = load_lab(inventory)
    selected = inv.select(nodes)
    need_gib = None
    if deep:
        weights = model if model is not None else FIDELITY_MODEL if FIDELITY_MODEL.is_dir() else None
        need_gib = BASE_SPACE_GIB + weights_bytes(weights) / 2**30
    result = check_nodes(inv, selected, max_parallel=parallel, console=err, deep_need_gib=need_gib)
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
        failing = [o.node for o in result.outcomes if not (o.ok and o.value is not None and o.value.ok)]
        err.print(f"not fine: {', '.join(failing)}")
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
