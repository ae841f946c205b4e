"""``testbed provision``: bring nodes to a known, recorded state."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from foundation.errors import TestbedError
from foundation.jsonable import jsonable
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    NodesOption,
    _say,
    app,
    out,
)
from testbed.emulation.resolved import load_lab


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
    provisioned/<node>.json. Exits 1 when a node failed or has a problem, when nodes differ in MPI
    ABI or node code version, or when another holder (a running campaign) leases a node's machine."""
    from testbed.leases.keeper import command_leases
    from testbed.provisioning.provision import ProvisionOptions, provision
    from testbed.provisioning.weights import parse_partition

    inv = load_lab(inventory)
    if partition is not None and model is None:
        raise TestbedError("--partition needs --model")
    options = ProvisionOptions(model=model, partition=parse_partition(partition) if partition else None)
    with command_leases(inv, inv.select(nodes)):
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
                escape(o.value.summary()),
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
