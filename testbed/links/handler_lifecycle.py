"""The NFQUEUE delay handler's life on a node: where it keeps its files, starting it with a config (it
returns once its queues are bound), giving it a trace's delays, stopping it (also one an earlier version
of the suite left in the user's directory), and reading back what it did (how late its releases were).
The handler itself is ``nodes/link_delay_handler.py``, installed root-owned by
:mod:`testbed.provisioning.delay_handler`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from foundation.errors import NodeError
from testbed.commands.node_context import NodeContext
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory
from testbed.links import node_journal
from testbed.provisioning.delay_handler import RUN_ROOT, launcher_path, run_dir, run_dir_script
from testbed.provisioning.sudo_rules import privileged
from testbed.transport import Transport, open_transport
from testbed.transport.base import background_alive_test, quote_path
from testbed.transport.fanout import FanOutResult, fan_out


def handler_read_script(workdir: str) -> str:
    """sh that prints, in a ``#### handler`` section, the running delay handler's config (nothing when
    none runs): a re-apply with the same queues leaves it alone."""
    rundir = f"$({run_dir_script(quote_path(node_journal.journal_dir(workdir)))})"
    return f'echo "#### handler"; r={rundir}; if {_alive_in("$r")}; then cat "$r/config.json"; fi; echo'


def _alive_in(rundir_word: str) -> str:
    """A shell test that succeeds while the handler whose run directory ``rundir_word`` names runs."""
    pidfile = f"{rundir_word}/handler.pid"
    return (f'{{ [ -s {pidfile} ] && read pid start < {pidfile} && [ -n "$pid" ] && '
            f'[ "$(sed \'s/.*) //\' /proc/$pid/stat 2>/dev/null | cut -d\' \' -f20)" = "$start" ]; }}')  # fmt: skip


def json_or_none(text: str) -> dict | None:
    try:
        value = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None  # half written: a new handler is started
    return value if isinstance(value, dict) else None


def handler_files(directory: str) -> dict[str, str]:
    """Where the delay handler named by ``directory`` (the journal's, absolute) keeps its config,
    pidfile, log and stats: root's run directory of it, which the user reads."""
    rundir = run_dir(directory)
    return {"dir": rundir, "config": f"{rundir}/config.json", "pidfile": f"{rundir}/handler.pid",
            "log": f"{rundir}/log", "stats": f"{rundir}/stats.jsonl"}  # fmt: skip


def handler_command(action: str, directory: str, *, sudo: bool) -> list[str]:
    """The installed delay handler's ``start``, ``stop`` or ``retime`` of the handler for ``directory``."""
    return privileged([launcher_path(), action, directory], sudo=sudo)


def node_directory_script(workdir: str) -> str:
    """sh that prints the journal's directory as an absolute path (:func:`node_directory`)."""
    return "echo " + quote_path(node_journal.journal_dir(workdir))


def node_directory(transport: Transport, workdir: str) -> str:
    """The journal's directory on the node, as an absolute path (argv words are not expanded by a
    shell, so what a detached process is given must be absolute)."""
    return transport.run_script(node_directory_script(workdir)).check().stdout.strip()


HANDLER_READY_S = 10.0  # nodes/link_delay_handler.py READY_S: its start returns within this


HANDLER_WAIT_S = HANDLER_READY_S + 20.0  # its stop (TERM, 5 s, KILL) and the SSH round trips besides


def start_delay_handler(transport: Transport, directory: str, config: dict) -> None:
    """Start the installed handler for ``directory`` (with sudo: binding a queue needs CAP_NET_ADMIN)
    with ``config``; it returns once every queue is bound."""
    result = transport.run(handler_command("start", directory, sudo=False), sudo=True, timeout_s=HANDLER_WAIT_S,
                           stdin=json.dumps(config).encode())  # fmt: skip
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip())[-600:] or f"exit status {result.exit_code}"
        raise NodeError(transport.node, f"the NFQUEUE delay handler did not start: {detail}")


def stop_delay_handler(transport: Transport, directory: str) -> str:
    """Stop the handler for ``directory``: ``stopped``, ``killed``, ``stale`` or ``absent``."""
    result = transport.run(handler_command("stop", directory, sudo=False), sudo=True, timeout_s=HANDLER_WAIT_S)
    return result.check().stdout.strip().splitlines()[-1]


def retime_delay_handler(
    transport: Transport, directory: str, start_unix_s: float, timelines: Mapping[int, list]
) -> None:
    """Give the running delay handler a trace's delay rows per queue, reckoned from ``start_unix_s``
    (it rewrites its config, then SIGHUP makes it read the rows again)."""
    update = {"start_unix_s": start_unix_s, "timelines": {str(q): rows for q, rows in timelines.items()}}
    result = transport.run(handler_command("retime", directory, sudo=False), sudo=True, timeout_s=HANDLER_WAIT_S,
                           stdin=json.dumps(update).encode())  # fmt: skip
    if not result.ok:
        detail = (result.stdout.strip() + " " + result.stderr.strip()).strip()[-300:]
        raise NodeError(transport.node, f"the NFQUEUE delay handler is not running ({detail}): the trace's delays")


def stop_earlier_handler(transport: Transport, directory: str, pidfile: str | None) -> str:
    """Stop the handler a journal names: the installed one's (root's run directory), or one a journal
    of an earlier version names in the user's directory (stopped as the user: no sudo'd shell)."""
    if pidfile is not None and not pidfile.startswith(RUN_ROOT + "/"):
        return transport.stop_background(pidfile)
    return stop_delay_handler(transport, directory)


def handler_report_script(files: Mapping[str, str]) -> str:
    """sh that prints ``alive`` while the delay handler runs, then its latest stats lines."""
    return (f"if {background_alive_test(files['pidfile'])}; then echo alive; fi; "
            f"tail -n {HANDLER_REPORT_LINES} {quote_path(files['stats'])} 2>/dev/null; true")  # fmt: skip


HANDLER_REPORT_LINES = 20_000  # a queue's line a second: hours of a few queues


@dataclass(frozen=True)
class DelayHandlerReport:
    """What one node's delay handler did since a time: per second and queue, how late its releases
    were (the NFQUEUE path's own delay error), and whether it still runs."""

    node: str
    alive: bool
    seconds: int  # stats lines (one per queue and second)
    packets: int
    late_mean_ms_worst_second: float | None
    late_max_ms: float | None
    dropped: int  # drawn by the handler (correlated or trace loss)


def parse_handler_report(node: str, output: str, since_unix_s: float) -> DelayHandlerReport:
    lines = output.splitlines()
    alive = bool(lines) and lines[0] == "alive"
    stats = [r for r in (json_or_none(line) for line in lines[1 if alive else 0:])
             if r and r.get("event") == "stats" and r.get("unix_s", 0) >= since_unix_s]  # fmt: skip
    means = [r["late_mean_ms"] for r in stats if r.get("late_mean_ms") is not None]
    return DelayHandlerReport(
        node, alive, len(stats), sum(r["packets"] for r in stats), max(means) if means else None,
        max((r["late_max_ms"] for r in stats), default=None), sum(r["dropped"] for r in stats),
    )


def read_delay_handlers(
    inventory: Inventory, directories: Mapping[str, str], since_unix_s: float
) -> FanOutResult[DelayHandlerReport]:
    """Each node's delay handler record since ``since_unix_s`` (``directories``: node -> the journal's
    directory there, as a path)."""

    def read(name: str) -> DelayHandlerReport:
        with open_transport(inventory, inventory.node(name)) as t:
            output = t.run_script(handler_report_script(handler_files(directories[name])), timeout_s=30.0).stdout
            return parse_handler_report(name, output, since_unix_s)

    return fan_out(list(directories), read, description="reading delay handlers")


def plan_handler_reports(lines: PlanLines, queued: Sequence[str], contexts: Mapping[str, NodeContext]) -> None:
    """The collect phase's lines of :func:`read_delay_handlers` on the nodes that ran a delay handler."""
    for name in queued:
        workdir = lines.lab.settings_of(name).workdir
        files = handler_files(contexts[name].path(node_journal.journal_dir(workdir)))
        lines.add(name, "collect", "read the delay handler's record of the run", sh(handler_report_script(files)))
