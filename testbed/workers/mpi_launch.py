"""The MPI launch of a split run: ``mpiexec`` (MPICH's hydra, from the node's Python environment) is started
on the server node, detached, and reaches the devices over SSH at their management addresses, so that
launching never waits on a shaped link; what a failed launch says (the reason a rank aborted with, else
hydra's summary).

Hydra's own ssh launcher starts the ranks, with a launcher of ours (``-launcher-exec``) that runs the
server's ``ssh`` with a config written from the inventory: each node's user, port and address, batch
mode and strict host keys, then the server's own SSH config (``ssh.node_config``, default
``~/.ssh/config``) for its keys and whatever else the lab sets there. Why hydra's launcher and not one
of ours over the controller's transport: hydra keeps each rank a child of its proxy (exit codes, abort
and signal forwarding, the bounds MPIEXEC_TIMEOUT sets), a detached launch outlives a controller that
died (its pidfile ends it on --resume), and the controller's jump host stays the controller's: the
server reaches the devices on the lab's own network, as the preflight checks with the same command.

What the ranks exchange is pinned to the data plane by the environment every rank gets:
``MPIR_CVAR_NOLOCAL=1`` (no shared-memory shortcut, which ranks on one kernel would take),
``UCX_TLS=tcp,self`` with ``UCX_NET_DEVICES`` naming the node's data interface, and ``FI_PROVIDER=tcp``
with ``FI_TCP_IFACE`` for MPICH builds on libfabric. On the emulated testbed a test checks the data
veths' byte counters against the hidden states sent.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import NodeError
from nodes.contracts.rank_dirs import ABORT_REASON_GLOB
from testbed.commands.launch_ssh import HydraSsh, hydra_ssh
from testbed.commands.node_context import NodeContext
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory
from testbed.transport import open_transport
from testbed.transport.base import Transport
from testbed.transport.fanout import fan_out
from testbed.workers.split_spec import SplitRunSpec, StagedRun, check_spec, run_dir_on

LAUNCH_MARGIN_S = 60.0
WAIT_POLL_S = 3.0  # how long one remote wait for the exit status lasts


def data_plane_env(interface: str) -> dict[str, str]:
    """Environment that keeps a rank's MPI traffic on TCP over ``interface``. On loopback (the
    emulated testbed's local mode: every node a process on this host, nothing shaped) there is no
    data plane to keep traffic on, and UCX's TCP transport refuses to connect two processes over
    loopback, so ranks pass messages through shared memory instead."""
    if interface == "lo":
        return {"UCX_TLS": "self,posix,sysv", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": interface}
    return {
        "MPIR_CVAR_NOLOCAL": "1",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": interface,
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": interface,
    }


@dataclass(frozen=True)
class RankGroup:
    """Consecutive ranks on one node: the server's stages, or one device."""

    node: str
    host: str  # the address mpiexec reaches the node at (management plane)
    ranks: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MpiLaunchPlan:
    """The ``mpiexec`` command for a run, started on ``launch_node``."""

    launch_node: str
    mpiexec: str
    groups: tuple[RankGroup, ...]
    timeout_s: float
    ssh: HydraSsh | None = None  # None: hydra runs the launch node's plain ssh

    def hosts_argument(self) -> str:
        return ",".join(f"{g.host}:{g.ranks}" for g in self.groups)

    def argv(self) -> list[str]:
        words = [self.mpiexec, "-launcher", "ssh"]
        if self.ssh is not None:
            words += ["-launcher-exec", self.ssh.launcher_path]
        words += ["-hosts", self.hosts_argument()]
        for index, group in enumerate(self.groups):
            if index:
                words.append(":")
            words += ["-n", str(group.ranks)]
            for name, value in group.env:
                words += ["-env", name, value]
            words += list(group.argv)
        return words

    def apply_commands(self) -> list[str]:
        return [shlex.join(self.argv())]

    def undo_commands(self) -> list[str]:
        """Nothing persists: hydra ends every rank when mpiexec ends (MPIEXEC_TIMEOUT bounds it)."""
        return []


def launch_plan(
    inventory: Inventory,
    spec: SplitRunSpec,
    contexts: Mapping[str, NodeContext],
    mpiexec: str | None,
    *,
    data_plane: bool = True,
) -> MpiLaunchPlan:
    """The ``mpiexec`` launch of ``spec``: P stage ranks on the server, a rank per device slot, each with
    its node's workers' Python, the node code bundle and the data-plane environment. ``mpiexec`` None:
    not looked up yet (shown as ``mpiexec``). ``data_plane=False`` (a plan made before an emulated
    testbed is up) leaves out the data-plane environment and takes node names for missing addresses."""
    if data_plane:
        server, devices = check_spec(inventory, spec)
    else:
        server, devices = inventory.node(spec.server), [inventory.node(d) for d in spec.devices]
    groups = []
    for node, count in [(server, spec.stages), *[(d, spec.device_slots) for d in devices]]:
        context = contexts[node.name]
        env = dict(context.code_env())
        if data_plane:
            assert node.data is not None
            env.update(data_plane_env(node.data.interface))
        argv = (context.python, "-m", "nodes.workers", f"{run_dir_on(context, spec.run_id)}/run.json")
        groups.append(RankGroup(node.name, node.address or node.name, count, argv, tuple(sorted(env.items()))))
    directory = contexts[server.name].path(inventory.settings_of(server).workdir.rstrip("/") + "/mpi")
    ssh = hydra_ssh(inventory, server, [server, *devices], directory)
    return MpiLaunchPlan(server.name, mpiexec or "mpiexec", tuple(groups), spec.timeout_s, ssh)


def mpiexec_pidfile(run_dir: str) -> str:
    """Where the launch node keeps the pid of a run's ``mpiexec`` (to end it after a controller crash)."""
    return f"{run_dir}/mpiexec.pid"


def launch_files(run_dir: str) -> tuple[str, str]:
    """(exit status file, output log) of a run's detached ``mpiexec`` on the launch node."""
    return f"{run_dir}/mpiexec.status", f"{run_dir}/mpiexec.log"


def launch_argv(plan: MpiLaunchPlan, status: str) -> list[str]:
    """``mpiexec`` wrapped so that its exit status lands in ``status`` when it ends."""
    return ["sh", "-c", '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"', status, *plan.argv()]


def launch_env(timeout_s: float) -> dict[str, str]:
    return {"MPIEXEC_TIMEOUT": str(int(timeout_s))}


def launch_wait_script(status: str) -> str:
    """sh that waits up to WAIT_POLL_S for the exit status and prints it (nothing while still running)."""
    return (
        f"i=0; while [ ! -s {shlex.quote(status)} ] && [ $i -lt {int(WAIT_POLL_S / 0.1)} ]; do sleep 0.1; i=$((i+1)); "
        f"done; cat {shlex.quote(status)} 2>/dev/null || true"
    )


def mpiexec_search_script(python: str) -> str:
    """sh that prints the mpiexec beside ``python`` (the mpich wheel's), else the one on PATH."""
    return (
        f"p=$({shlex.quote(python)} -c 'import os,sys; print(os.path.dirname(sys.executable))')/mpiexec; "
        '[ -x "$p" ] && echo "$p" || command -v mpiexec'
    )


def launch_and_wait(
    t: Transport, plan: MpiLaunchPlan, run_dir: str, timeout_s: float, on_wait: Callable[[float], None]
) -> tuple[int | None, str]:
    """Start ``mpiexec`` detached on the launch node (so a controller that dies leaves a pidfile to
    end it by, and MPIEXEC_TIMEOUT bounds it meanwhile), wait for its exit status, and return it
    (None after a timeout, when it is stopped) with its output."""
    status, log = launch_files(run_dir)
    if plan.ssh is not None:
        plan.ssh.write(t)
    t.run(["rm", "-f", status], timeout_s=30.0).check()
    t.start_background(
        launch_argv(plan, status), pidfile=mpiexec_pidfile(run_dir), logfile=log, env=launch_env(timeout_s)
    )
    started = time.monotonic()
    deadline = started + timeout_s + LAUNCH_MARGIN_S
    wait_script = launch_wait_script(status)
    exit_code: int | None = None
    try:
        while time.monotonic() < deadline:
            answer = t.run_script(wait_script, timeout_s=WAIT_POLL_S + 30.0).stdout.strip()
            if answer:
                exit_code = int(answer.splitlines()[-1])
                break
            on_wait(time.monotonic() - started)
    finally:  # timed out, or the controller was interrupted (Ctrl-C, SIGTERM): end the ranks too
        if exit_code is None:
            t.stop_background(mpiexec_pidfile(run_dir))
    output = t.run(["tail", "-c", "200000", log], timeout_s=30.0).stdout
    return exit_code, output


def failed_node(log: str, groups: Sequence[RankGroup]) -> str | None:
    """The node hydra names in a failed run (``RUNNING AT <host>``), if any: the rank that died first."""
    by_host = {g.host: g.node for g in groups}
    for line in log.splitlines():
        words = line.split("RUNNING AT", 1)[1].split() if "RUNNING AT" in line else []
        if words and words[0] in by_host:
            return by_host[words[0]]
    return None


_REASON_MARK = "@@abort-reason"


def reason_files_script(run_dir: str) -> str:
    """A shell script printing each reason file in ``run_dir`` after a line with its mark, time and name."""
    return (
        f"cd {shlex.quote(run_dir)} 2>/dev/null || exit 0; for f in {ABORT_REASON_GLOB}; do [ -f \"$f\" ] || continue; "
        f"echo; echo \"{_REASON_MARK} $(date -r \"$f\" +%s.%N 2>/dev/null || echo 0) $f\"; cat \"$f\"; done"
    )


def split_reason_files(text: str) -> list[tuple[float, int, str]]:
    """(written at, rank, text) of each reason file in what :func:`abort_reasons`' script printed."""
    found: list[tuple[float, int, str]] = []
    for block in text.split("\n" + _REASON_MARK + " ")[1:]:
        header, _, body = block.partition("\n")
        written, _, name = header.partition(" ")
        rank = name.removeprefix("abort-rank-").removesuffix(".txt")
        if rank.isdigit() and body.strip():
            found.append((float(written) if written.replace(".", "", 1).isdigit() else 0.0, int(rank), body.strip()))
    return found


def abort_reasons(inventory: Inventory, staged: StagedRun, groups: Sequence[RankGroup]) -> list[tuple[str, str]]:
    """(node, text) of every ``abort-rank-<r>.txt`` the run's ranks left in their run directories, the
    oldest first: why a rank ended the launch with MPI_Abort, kept even when mpiexec lost the rank's
    last output. Every node is read (boards that log in as one user share a run directory's path,
    not its disk), and each file is put down to the node that runs its rank."""
    node_of_rank = [g.node for g in groups for _ in range(g.ranks)]

    def read(name: str) -> list[tuple[float, int, str]]:
        with open_transport(inventory, inventory.node(name)) as t:
            text = t.run_script(reason_files_script(staged.info[name]["run_dir"]), timeout_s=30.0).stdout
        return split_reason_files(text)

    by_rank: dict[int, tuple[float, str]] = {}
    for outcome in fan_out([node.name for node in staged.nodes], read).outcomes:
        for written, rank, text in outcome.value if outcome.ok else []:
            by_rank.setdefault(rank, (written, text))
    ordered = sorted(by_rank.items(), key=lambda item: (item[1][0], item[0]))
    return [(node_of_rank[r] if r < len(node_of_rank) else staged.server.name, text) for r, (_, text) in ordered]


def launch_failure(
    inventory: Inventory, staged: StagedRun, what: str, log: str, groups: Sequence[RankGroup], out_dir: Path
) -> NodeError:
    """The error for a launch (or warm pool) that ended badly: the node and reason a rank gave when it
    aborted, else what hydra's output says; the reasons are appended to ``out_dir/mpiexec.log``."""
    reasons = abort_reasons(inventory, staged, groups)
    if reasons:
        with open(out_dir / "mpiexec.log", "a", encoding="utf-8") as handle:
            handle.writelines(f"# {node} aborted the launch:\n{text}\n" for node, text in reasons)
        node, text = reasons[0]
        lines = text.splitlines()
        said = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # a traceback's last line says what
        return NodeError(node, f"{what}: {said[:500]} (see {out_dir}/mpiexec.log)")
    culprit = failed_node(log, groups) or staged.server.name
    return NodeError(culprit, f"{what}: {hydra_summary(log)} (see {out_dir}/mpiexec.log)")


def hydra_summary(log: str) -> str:
    """One line for a failed launch: where hydra says a rank ended and how, else the last line of
    output (the whole output is kept in mpiexec.log)."""
    lines = [line.strip(" =") for line in log.splitlines() if line.strip(" =")]
    where = next((line.split("RUNNING AT", 1)[1].strip() for line in lines if "RUNNING AT" in line), "")
    how = next((line.split("EXIT STRING:", 1)[1].strip() for line in lines if "EXIT STRING:" in line), "")
    how = how or next((line for line in lines if line.startswith("EXIT CODE:")), "")
    if where or how:
        return f"a rank{' at ' + where if where else ''} ended: {how or 'see the log'}"
    return lines[-1][:300] if lines else "no output"


def find_mpiexec(t: Transport, python: str) -> str:
    """The mpiexec beside the node's Python (the mpich wheel's), else the one on PATH."""
    found = t.run_script(mpiexec_search_script(python), timeout_s=30.0).stdout.strip()
    if not found:
        raise NodeError(t.node, "no mpiexec beside its Python or on PATH (pip install mpich mpi4py)")
    return found.splitlines()[-1]


def plan_mpiexec_search(lines: PlanLines, server: str, context: NodeContext) -> None:
    """The plan phase's line of :func:`find_mpiexec`."""
    lines.add(server, "plan", "find mpiexec beside the workers' Python", sh(mpiexec_search_script(context.python)))
