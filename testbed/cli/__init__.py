"""The ``testbed`` command line: one thin module per command group (they parse, call the module that
owns the concept, and print).

Every command reads the inventory given with ``--inventory/-i``, else ``$TESTBED_INVENTORY``, else
``./inventory.yaml``; a campaign names its own (``-i`` overrides it, the variable does not).
Exit status: 0 when everything is fine, 1 when a node or check failed, 2 for bad input (nothing is
touched on any node then), 130 for a campaign interrupted by Ctrl-C or SIGTERM (``--resume`` goes on).
"""

from __future__ import annotations

import sys

from rich.markup import escape

from foundation.errors import NodeError, TestbedError
from testbed.cli import (  # noqa: F401
    campaign,
    doctor,
    emulate,
    inventory,
    lab,
    link,
    model,
    power,
    profile,
    provision,
    reproduce,
    telemetry,
    workers,
)
from testbed.cli.app import app, err, with_short_helps

__all__ = ["app", "main"]

with_short_helps(app)  # each command's line in its group's listing: its help's first sentence


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
