"""Running a campaign: the ledger's runs in order, one at a time, resumable after any crash.

Layout of a campaign directory::

    ledger.sqlite                  run states and attempts (see testbed.campaign.ledger)
    campaign.yaml, runs.json       the campaign file as started, and its expansion
    runs/<run_id>/                 the run's last finished attempt: manifest.json, events.jsonl,
                                   requests.parquet, tokens.parquet, telemetry/, schedules/, workers/
    runs/<run_id>.attempt<N>/      an attempt in progress (renamed to runs/<run_id>/ when it ends)
    runs/<run_id>.attempt<N>.interrupted/   an attempt the controller died in (never counted)

    pools.json                     every warm worker pool started (ended on --resume after a crash)

Runs are served by warm worker pools (:mod:`testbed.workers.pool`): consecutive runs of one shape
share the ranks, and a run leaves power modes and shaping in place on the nodes the next run sets
again; they are restored after the last run that needs them, when a run fails, and when the
campaign ends (also on Ctrl-C).

A run's files are complete before its ledger row says ``done``; the rename of the attempt
directory comes between the two, after every file under it is synced, and is synced itself. On
``--resume`` the pools and the processes interrupted runs had started are ended (``pools.json``,
``processes.json``: each entry checked again first, and a file with an entry the controller never
writes refuses the resume before any node is touched), every node of the campaign is restored from
its journals (shaping, power modes), and a run found ``running`` is counted done (or failed) only if
this attempt's manifest says it finished, in its finished directory (or done, in the attempt's own:
it is moved into place then); otherwise its partial directory is set aside and the run goes back to ``todo``.
A campaign directory without a ledger had nothing started in it: ``--resume`` starts the campaign.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from nodes.contracts.durable import rename_durably, write_atomic, write_json_atomic
from nodes.contracts.journal_values import JournalValueError, checked_path
from testbed.campaign.carryover import Carryover
from testbed.campaign.execution import Report, execute_run
from testbed.campaign.ledger import Ledger, finished_seconds
from testbed.campaign.plan import configured_nodes
from testbed.campaign.restore_phase import release_nodes
from testbed.campaign.run_state import Kept
from testbed.campaign.spec import Campaign, PlannedRun, run_nodes
from testbed.commands.node_context import transport_for
from testbed.inventory import Inventory, NodeSpec, host_of, kind_of
from testbed.leases.keeper import LeaseKeeper, holder_for, lease_machines
from testbed.transport import open_transport
from testbed.transport.fanout import fan_out
from testbed.workers.pool import PoolKeeper, end_registered_pools

LEDGER = "ledger.sqlite"
POOLS = "pools.json"


@dataclass(frozen=True)
class CampaignSummary:
    directory: Path
    counts: dict[str, int]
    quarantined: dict[str, str]
    stopped_early: bool  # the failure policy stopped the campaign with runs left to do

    @property
    def ok(self) -> bool:
        return not any(self.counts[state] for state in ("failed", "skipped", "todo", "running"))


def attempt_dir(directory: Path, run_id: str, attempt: int) -> Path:
    return directory / "runs" / f"{run_id}.attempt{attempt}"


def final_dir(directory: Path, run_id: str) -> Path:
    return directory / "runs" / run_id


CONTROLLER_LOCK = ".controller.lock"


def start_campaign(campaign: Campaign, directory: Path) -> Ledger:
    """A new campaign directory with its ledger (refused if one exists: use resume). The ledger comes
    last and whole: a directory with a ledger has the rest."""
    if (directory / LEDGER).exists():
        raise TestbedError(f"{directory / LEDGER} exists: resume that campaign with --resume, or choose another --out")
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"name": campaign.spec.name, "file": str(campaign.path), "digest": campaign.digest(),
            "inventory": str(campaign.inventory.path), "runs": len(campaign.runs)}  # fmt: skip
    rows = [(r.run_id, r.label(), [n.name for n in run_nodes(campaign.inventory, r.settings)]) for r in campaign.runs]
    write_atomic(directory / "campaign.yaml", campaign.path.read_bytes())
    write_atomic(directory / "runs.json", json.dumps([describe_run(r) for r in campaign.runs], indent=1) + "\n")
    return Ledger.create(directory / LEDGER, meta, rows)


@contextmanager
def controller_lock(directory: Path) -> Iterator[None]:
    """This process as the only controller of the campaign in ``directory`` for the block (an flock,
    which a killed controller loses with its process); a second one is refused at once."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / CONTROLLER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            raise TestbedError(f"{directory} is being run by {holder} right now: wait for it, or stop it "
                               "(a second controller on one campaign would run its runs twice)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        yield
    finally:
        os.close(fd)


def open_campaign(campaign: Campaign, directory: Path) -> Ledger:
    """The ledger of a started campaign, checked against the campaign file as it is now."""
    ledger = Ledger.open(directory / LEDGER)
    digest = ledger.meta().get("digest")
    if digest != campaign.digest():
        ledger.close()
        raise TestbedError(
            f"{campaign.path} no longer expands to the runs {directory} was started with (its runs, seeds or "
            "order changed); restore the file (a copy is in campaign.yaml there) or start a new --out"
        )
    return ledger


def describe_run(run: PlannedRun) -> dict[str, Any]:
    return {"run_id": run.run_id, "position": run.position, "repetition": run.repetition, "seed": run.seed,
            "overrides": dict(run.overrides), "settings": run.settings.model_dump(mode="json")}  # fmt: skip


def recover(campaign: Campaign, directory: Path, ledger: Ledger, *, say: Callable[[str], None]) -> list[str]:
    """Settle runs a dead controller left ``running``; restore every node of the campaign.
    Returns the ids put back to ``todo``. Every pool and process entry is checked before any is ended."""
    interrupted = [row for row in ledger.runs() if row.state == "running"]
    lab = campaign.inventory
    checked_processes(lab, directory / POOLS, with_host=False)
    noted = [e for row in interrupted
             for e in checked_processes(lab, attempt_dir(directory, row.run_id, row.attempts) / "processes.json")]
    end_registered_pools(lab, directory / POOLS, say)
    _end_processes(lab, noted, say)
    # also between runs a dead controller leaves nodes set for the next run: restore every node the
    # campaign touches (and holds the leases of)
    restore_nodes(campaign, list(campaign.nodes()), say)
    requeued = []
    for row in interrupted:
        partial = attempt_dir(directory, row.run_id, row.attempts)
        manifest = _finished_manifest(final_dir(directory, row.run_id), row.attempts)
        if manifest is None and (_finished_manifest(partial, row.attempts) or {}).get("status") == "done":
            _settle_directory(directory, row.run_id, partial, None)  # done, killed before the rename: kept
            manifest = _finished_manifest(final_dir(directory, row.run_id), row.attempts)
        if manifest is not None:
            say(f"{row.run_id}: attempt {row.attempts} had finished ({manifest['status']}) before the crash")
            ledger.finish(row.run_id, manifest["status"], reason=manifest.get("reason"),
                          node=manifest.get("failed_node"), run_nodes=row.nodes,
                          quarantine_after=campaign.spec.failure.quarantine_after)  # fmt: skip
            continue
        if partial.exists():
            rename_durably(partial, partial.with_name(partial.name + ".interrupted"))
        ledger.requeue(row.run_id, ["running"])
        requeued.append(row.run_id)
        say(f"{row.run_id}: attempt {row.attempts} was interrupted; it will run again")
    return requeued


def _finished_manifest(run_dir: Path, attempt: int) -> dict[str, Any] | None:
    """``run_dir``'s manifest if it is attempt ``attempt``'s and says the attempt finished."""
    path = run_dir / "manifest.json"
    try:
        manifest = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):  # written atomically: a torn one was never the attempt's
        return None
    if isinstance(manifest, dict) and manifest.get("attempt") == attempt and manifest.get("status") in (
            "done", "failed"):  # fmt: skip
        return manifest
    return None


@dataclass(frozen=True)
class NotedProcess:
    node: NodeSpec  # the node whose commands reach the process (a phone's: its USB host)
    pidfile: str


def checked_processes(lab: Inventory, path: Path, *, with_host: bool = True) -> list[NotedProcess]:
    """The processes a journal of started processes names (``processes.json``, ``pools.json``), each
    entry checked again before anything is signalled: a node of the inventory (and its host), and a
    pidfile under the testbed's workdir. An entry the controller never writes is refused with the file,
    the entry and the field named (exit status 2), before any node is touched."""
    if not path.is_file():
        return []
    hint = ("restore the file as the controller wrote it, or remove that entry and end its process on the node "
            "by hand; then --resume again")  # fmt: skip
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TestbedError(f"{path}: not a JSON list of started processes ({exc}); {hint}") from None
    if not isinstance(entries, list):
        raise TestbedError(f"{path}: not a JSON list of started processes; {hint}")
    nodes = {n.name: n for n in lab.nodes}
    found = []
    for number, entry in enumerate(entries, 1):
        where = f"{path}: entry {number}"
        if not isinstance(entry, dict):
            raise TestbedError(f"{where}: not an object with node, host and pidfile; {hint}")
        node = nodes.get(entry.get("node")) if isinstance(entry.get("node"), str) else None
        if node is None:
            raise TestbedError(f"{where}: node: {entry.get('node')!r} is not a node of {lab.path}; {hint}")
        if with_host and entry.get("host") not in (node.name, host_of(node)):
            raise TestbedError(f"{where}: host: {entry.get('host')!r} is neither {node.name} nor where its commands "
                               f"run ({host_of(node)!r}); {hint}")  # fmt: skip
        try:
            pidfile = checked_path(entry.get("pidfile"), "pidfile", suffix=".pid")
            _check_under_workdir(pidfile, lab.settings_of(node).workdir)
        except JournalValueError as exc:
            raise TestbedError(f"{where}: {exc}; {hint}") from None
        found.append(NotedProcess(node, pidfile))
    return found


def _check_under_workdir(path: str, workdir: str) -> None:
    """``path`` is in the testbed's workdir on a node: ``~/W/...`` or ``<some home>/W/...`` for a
    ``~/W`` workdir, ``W/...`` for an absolute one."""
    workdir = workdir.rstrip("/")
    if workdir.startswith("~/"):
        inside = path.startswith(workdir + "/") or f"/{workdir[2:]}/" in path
    else:
        inside = workdir in ("", "~") or path.startswith(workdir + "/")
    if not inside:
        raise JournalValueError(f"pidfile: {path!r} is not under the testbed's workdir {workdir}")


def _end_processes(lab: Inventory, noted: list[NotedProcess], say: Callable[[str], None]) -> None:
    """End what interrupted attempts started on nodes (mpiexec, samplers, iperf3 servers), by their pidfiles."""
    for process in noted:
        name = process.node.name
        try:
            with transport_for(lab, process.node) as t:
                how = t.stop_background(process.pidfile)
            if how in ("stopped", "killed"):
                say(f"{name}: ended a process the interrupted run had left ({process.pidfile}: {how})")
        except Exception as exc:  # a node that cannot be reached now is reported, not fatal
            say(f"{name}: could not end {process.pidfile}: {exc}")


def restore_nodes(campaign: Campaign, names: list[str], say: Callable[[str], None]) -> None:
    """Undo shaping and power modes on ``names`` from their journals (nothing where none is kept), and
    end the CPU pacing of emulated nodes."""
    from testbed.energy.power_modes import restore_power
    from testbed.links.apply import clear_nodes

    lab = campaign.inventory
    linux = [n for n in names if kind_of(lab.node(n)).shapes_links and lab.node(n).data is not None]
    cleared = clear_nodes(lab, linux)
    restored = restore_power(lab, names)
    for o in (*cleared.failed, *restored.failed):
        say(f"{o.node}: could not restore: {o.error}")
    for o in cleared.outcomes:
        if o.value is not None and o.value.had_journal:
            say(f"{o.node}: link shaping left by the interrupted run undone")
    for o in restored.outcomes:
        if o.value is not None:
            say(f"{o.node}: power mode restored to {o.value.mode_name}")
    if any(lab.node(n).emulated is not None for n in names):  # a target run's CPU pacing, if one was left
        from testbed.target.emulation import pace_nodes

        for o in pace_nodes(lab, names, False).failed:
            say(f"{o.node}: could not end CPU pacing: {o.error}")


def gather_node_facts(campaign: Campaign) -> dict[str, Any]:
    """Facts of every node the campaign uses, once per invocation (for the manifests)."""
    from foundation.jsonable import jsonable
    from testbed.transport.facts import gather_facts

    lab = campaign.inventory

    def facts(name: str) -> Any:
        node = lab.node(name)
        with open_transport(lab, node) as t:
            return jsonable(gather_facts(lab, node, t))

    result = fan_out(list(campaign.nodes()), facts, description="gathering facts")
    out: dict[str, Any] = dict(result.values())
    for o in result.failed:
        out[o.node] = {"error": o.error}
    return out


def run_campaign(
    campaign: Campaign,
    directory: Path,
    *,
    resume: bool = False,
    retry_failed: bool = False,
    say: Callable[[str], None] = lambda _: None,
    report: Report = lambda _e, _d: None,
) -> CampaignSummary:
    """Run every ``todo`` run of the campaign in order (after settling a crashed invocation)."""
    if resume and not (directory / LEDGER).exists():  # a controller killed before its ledger touched nothing
        say(f"{directory} has no ledger: nothing was started there; starting the campaign")
        resume = False
    machines = lease_machines(campaign.inventory, campaign.nodes())
    # one controller a campaign directory, then the lab's machines leased (before anything is written
    # there: a refused campaign leaves nothing behind), then its ledger
    with controller_lock(directory), LeaseKeeper(campaign.inventory, machines, holder_for(directory)) as leases, \
            (open_campaign(campaign, directory) if resume else start_campaign(campaign, directory)) as ledger:
        if resume:
            recover(campaign, directory, ledger, say=say)
            if retry_failed:
                for row in ledger.runs():
                    if ledger.requeue(row.run_id, ["failed", "skipped"]):
                        say(f"{row.run_id}: retrying ({row.state} before)")
                for node in ledger.quarantined():
                    ledger.release(node)
        by_id = {r.run_id: r for r in campaign.runs}
        facts = gather_node_facts(campaign)
        report("campaign", {"counts": ledger.counts(), "total": len(campaign.runs)})
        pools = PoolKeeper(campaign.inventory, directory / POOLS, warm=campaign.spec.warm_runs)
        carry = Carryover(pools)
        held = Kept()  # what the last run left set for the next one
        stopped = False
        try:
            for row in ledger.runs():
                if row.state != "todo":
                    continue
                run = by_id[row.run_id]
                if leases.lost:  # another controller took a machine after our lease ran out (were we stopped?)
                    stopped = True
                    taken = "; ".join(f"{m} was taken by {who}" for m, who in leases.lost.items())
                    say(f"stopping: the lease on {taken} (renewals failed for longer than the lease lasts); "
                        "--resume goes on once it is free")
                    break
                quarantined = ledger.quarantined()
                blocked = [n for n in row.nodes if n in quarantined]
                if blocked:
                    ledger.skip(row.run_id, f"{', '.join(blocked)} quarantined ({quarantined[blocked[0]]})")
                    report("run_end", {"run_id": row.run_id, "state": "skipped", "counts": ledger.counts()})
                    continue
                held = _release_unneeded(campaign, held, configured_nodes(campaign, run.settings), say)
                attempt = ledger.start(row.run_id)
                report("run_start", {"run_id": row.run_id, "label": run.label(), "attempt": attempt,
                                     "position": row.position, "counts": ledger.counts(),
                                     "run_seconds": finished_seconds(ledger.runs())})  # fmt: skip
                work = attempt_dir(directory, row.run_id, attempt)
                following = _following(ledger, by_id, row.run_id)
                keep = (configured_nodes(campaign, following.settings) if following and campaign.spec.warm_runs
                        else (frozenset(), frozenset()))  # fmt: skip
                outcome = execute_run(campaign, run, attempt, work, facts=facts, carry=carry, keep=keep,
                                      report=report)  # fmt: skip
                if outcome.state == "failed":
                    pools.discard()  # a failed run's pool may be broken: the next run starts cold
                    # what the run before left set and this one never reached (it failed before
                    # configuring them) is restored now, not at the campaign's end
                    _release_unneeded(campaign, held, (outcome.kept.power, outcome.kept.links), say)
                held = outcome.kept
                reason = _settle_directory(directory, row.run_id, work, outcome.reason)
                newly = ledger.finish(
                    row.run_id, outcome.state, reason=reason, node=outcome.failed_node,
                    run_nodes=row.nodes, quarantine_after=campaign.spec.failure.quarantine_after,
                )  # fmt: skip
                for node in newly:
                    say(f"{node} is quarantined: it failed {campaign.spec.failure.quarantine_after} runs in a row; "
                        "runs that need it are skipped (--resume --retry-failed tries them again)")  # fmt: skip
                report("run_end", {"run_id": row.run_id, "state": outcome.state, "reason": reason,
                                   "counts": ledger.counts()})  # fmt: skip
                if outcome.state == "failed" and campaign.spec.failure.on_failure == "stop":
                    stopped = any(r.state == "todo" for r in ledger.runs())
                    say(f"stopping: run {row.run_id} failed and failure.on_failure is 'stop' (--resume goes on)")
                    break
        finally:  # also on Ctrl-C: nothing left running, shaped or throttled
            _finish(campaign, directory, pools, held, say)
        return CampaignSummary(directory, ledger.counts(), ledger.quarantined(), stopped)


def _following(ledger: Ledger, by_id: dict[str, PlannedRun], run_id: str) -> PlannedRun | None:
    """The run after ``run_id`` in the ledger's order that is still to do (what it will set is kept)."""
    rows = ledger.runs()
    after = [r for r in rows[[r.run_id for r in rows].index(run_id) + 1 :] if r.state == "todo"]
    return by_id[after[0].run_id] if after else None


def _release_unneeded(
    campaign: Campaign, held: Kept, needed: tuple[frozenset[str], frozenset[str]], say: Callable[[str], None]
) -> Kept:
    """Restore what ``held`` (what the last run kept) has beyond ``needed`` (what the next run sets; after
    a failed run, what it kept itself: nothing); what is left held."""
    release = Kept(held.power - needed[0], held.links - needed[1], held.contexts)
    if release:
        for problem in release_nodes(campaign.inventory, release, {}):
            say(f"could not restore: {problem}")
    return Kept(held.power & needed[0], held.links & needed[1], held.contexts)


def _finish(campaign: Campaign, directory: Path, pools: PoolKeeper, held: Kept, say: Callable[[str], None]) -> None:
    """The campaign's end: stop the warm pool and restore what the last run left set."""
    try:
        pools.release("the campaign ends")
    except Exception as exc:  # reported; --resume ends it from pools.json
        say(f"could not stop the worker pool: {exc}")
    if held:
        outcome: dict[str, Any] = {}
        problems = release_nodes(campaign.inventory, held, outcome)
        write_json_atomic(directory / "restore.json", {"nodes": outcome, "problems": problems})
        for problem in problems:
            say(f"could not restore: {problem}")


def _settle_directory(directory: Path, run_id: str, work: Path, reason: str | None) -> str | None:
    """Make ``work`` the run's directory; an earlier failed attempt there moves aside (kept). Returns
    ``reason`` with the paths it names in ``work`` moved too, as the manifest now says it (a failed
    run's reason points at its logs, which the user must find where they are)."""
    final = final_dir(directory, run_id)
    if final.exists():
        previous = json.loads((final / "manifest.json").read_text()).get("attempt", 0) if (
            final / "manifest.json").is_file() else 0  # fmt: skip
        rename_durably(final, final.with_name(f"{run_id}.attempt{previous}"))
    rename_durably(work, final)
    if reason is None or str(work) not in reason:
        return reason
    moved = reason.replace(str(work), str(final))
    manifest = final / "manifest.json"
    if manifest.is_file():
        recorded = json.loads(manifest.read_text())
        if isinstance(recorded.get("reason"), str):
            write_json_atomic(manifest, dict(recorded, reason=recorded["reason"].replace(str(work), str(final))))
    return moved
