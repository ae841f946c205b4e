"""Warm worker pools: the ranks of one worker shape kept up across a campaign's runs.

A pool (``python -m nodes.workers --pool``, :mod:`nodes.workers.pool`) is one detached ``mpiexec``
on the launch node, started like a single run's launch (same hosts, data-plane environment, venv
Python and pidfile discipline), whose ranks serve one run after another. Its shape is the server,
the devices in order and the server's pipeline stages: every run with that shape can be served by
it, whatever its method, partition or schedule (the ranks reload only the model parts that change).

Per run the controller stages the run's files on the nodes as for a single launch
(:func:`testbed.workers.split_run.stage_run`) and starts a pool if none of the run's shape is up
(``prepare``, alongside the run's configuration), then stores the order ``{"number": n, "run": <run id>}`` in the
pool directory of the launch node, and waits until rank 0 writes the run's ``pool-run.json`` (or
``mpiexec`` ends: a rank failed, and the pool with it). A run that fails or times out ends the pool;
the next run starts a new one (cold).

Every pool is listed in the campaign's ``pools.json`` before it starts, so that ``--resume`` after a
crash ends it; a pool left without orders also stops by itself after its idle timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import NodeError
from nodes.contracts.durable import write_json_atomic
from nodes.contracts.pool_orders import IDLE_TIMEOUT_S, ORDER_FILE, RUN_RECORD
from testbed.commands.node_context import NodeContext
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory
from testbed.transport import open_transport
from testbed.transport.base import (
    Transport,
    background_running_script,
    background_stop_script,
    command_line,
    prefix_words,
)
from testbed.workers.mpi_launch import (
    LAUNCH_MARGIN_S,
    WAIT_POLL_S,
    MpiLaunchPlan,
    launch_argv,
    launch_env,
    launch_failure,
)
from testbed.workers.split_run import SplitRunResult, collect_ranks, plan_rank_listing, plan_served_counts, stage_run
from testbed.workers.split_spec import SplitRunSpec, StagedRun, run_dir_on

STOP_WAIT_S = 15.0  # how long a pool asked to stop may take before it is ended by its pidfile
POOL_RECORD = RUN_RECORD  # rank 0's record of a run it served, in the run's directory


def pool_name(spec: SplitRunSpec) -> str:
    """The pool directory's name for ``spec``'s shape: server, devices in order, pipeline stages (and
    the device slots when more than one)."""
    parts: list[Any] = [spec.server, list(spec.devices), spec.stages]
    if spec.device_slots > 1:  # pools of one slot keep the names they had before slots
        parts.append(spec.device_slots)
    shape = json.dumps(parts)
    return "pool-" + hashlib.sha256(shape.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class PoolFiles:
    """A pool's files on its launch node."""

    directory: str

    @property
    def order(self) -> str:
        return f"{self.directory}/{ORDER_FILE}"

    @property
    def pidfile(self) -> str:
        return f"{self.directory}/mpiexec.pid"

    @property
    def status(self) -> str:
        return f"{self.directory}/mpiexec.status"

    @property
    def log(self) -> str:
        return f"{self.directory}/mpiexec.log"


def pool_files(context: NodeContext, name: str) -> PoolFiles:
    return PoolFiles(context.under_workdir("pools", name))


def pool_launch(
    launch: MpiLaunchPlan, contexts: Mapping[str, NodeContext], name: str, *, lifetime_s: float
) -> MpiLaunchPlan:
    """``launch`` (a single run's) turned into the pool's: the same ranks, hosts and environment, each
    rank serving orders from the pool directory; ``mpiexec`` ends them after ``lifetime_s``."""
    groups = []
    for group in launch.groups:
        context = contexts[group.node]
        argv = (group.argv[0], "-m", "nodes.workers", "--pool", pool_files(context, name).directory,
                "--runs", context.under_workdir("runs"), "--idle-timeout-s", f"{IDLE_TIMEOUT_S:g}")  # fmt: skip
        groups.append(dataclasses.replace(group, argv=argv))
    return dataclasses.replace(launch, groups=tuple(groups), timeout_s=lifetime_s)


def order_bytes(number: int, **order: str) -> bytes:
    return json.dumps({"number": number, **order}).encode()


def run_wait_script(record: str, status: str) -> str:
    """sh that waits up to WAIT_POLL_S for the run's record or the pool's exit status, and prints
    ``done``, ``exit <status>``, or nothing while the run goes on."""
    r, s = shlex.quote(record), shlex.quote(status)
    return (
        f"i=0; while [ ! -s {r} ] && [ ! -s {s} ] && [ $i -lt {int(WAIT_POLL_S / 0.1)} ]; do sleep 0.1; i=$((i+1)); "
        f'done; if [ -s {r} ]; then echo done; elif [ -s {s} ]; then echo "exit $(cat {s})"; fi'
    )


def alive_check(files: PoolFiles) -> str:
    """sh that succeeds when the pool has ended: its exit status is there, or its mpiexec is gone
    without one (killed, the node rebooted)."""
    return f"[ -s {shlex.quote(files.status)} ] || ! ( {background_running_script(files.pidfile)}\n)"


def start_script(files: PoolFiles) -> list[str]:
    """Clear what an earlier pool of the same shape left (its order, exit status and output)."""
    return ["rm", "-f", files.order, files.status, files.log]


@dataclass
class WorkerPool:
    """A started pool, as the controller knows it."""

    pool_id: str  # the pool's name and the run that started it
    name: str
    launch: MpiLaunchPlan
    files: PoolFiles
    orders: int = 0  # orders given so far (the next is orders + 1)
    served: int = 0

    @property
    def server(self) -> str:
        return self.launch.launch_node


@dataclass(frozen=True)
class PreparedRun:
    """A run staged on its nodes, with the pool that will serve it up."""

    spec: SplitRunSpec
    staged: StagedRun
    pool: WorkerPool
    warm: bool  # the pool had been started for an earlier run


@dataclass(frozen=True)
class PoolRun:
    """How a pool served one run."""

    result: SplitRunResult
    pool_id: str
    warm: bool  # the pool had served an earlier run
    runs_before: int
    record: dict[str, Any]  # rank 0's pool-run.json: each rank's setup time, parts loaded and reused


class _StoppedBeforeOrder(Exception):
    """The pool had stopped by itself (idle timeout) before it could take the run's order."""


class PoolKeeper:
    """The campaign's live pool (at most one). ``serve`` starts a pool when none of the run's shape is
    up (cold) and reuses it otherwise (warm); ``release`` stops it; ``discard`` ends it at once.
    ``warm=False`` stops the pool after every run, so that each run starts cold."""

    def __init__(self, inventory: Inventory, registry: Path, *, warm: bool = True) -> None:
        self.inventory, self.registry, self.warm = inventory, registry, warm
        self.pool: WorkerPool | None = None

    # -- the registry: every pool started, for --resume to end after a crash
    def _register(self, pool: WorkerPool) -> None:
        known = json.loads(self.registry.read_text()) if self.registry.is_file() else []
        entry = {"pool": pool.pool_id, "node": pool.server, "pidfile": pool.files.pidfile}
        write_json_atomic(self.registry, [*known, entry])

    def prepare(
        self,
        spec: SplitRunSpec,
        contexts: Mapping[str, NodeContext],
        launch: MpiLaunchPlan,  # the pool's (pool_launch)
        *,
        on_started: Callable[[WorkerPool, bool], None] = lambda _pool, _warm: None,
    ) -> PreparedRun:
        """Stage ``spec`` on its nodes and make sure the pool of its shape is up (a new pool, cold, when
        none is; its ranks load while the caller configures the nodes). ``on_started(pool, warm)`` is
        called before a new pool starts. A failure ends the pool."""
        name = pool_name(spec)
        if self.pool is not None and self.pool.name != name:
            self.release("the next run has another shape")
        if self.pool is not None and not self._alive(self.pool):
            self.discard()  # it ended between runs (its idle timeout, a crash): this run starts a new one
        try:
            staged = stage_run(self.inventory, spec, contexts)
            if self.pool is not None:
                on_started(self.pool, True)
                return PreparedRun(spec, staged, self.pool, True)
            server = contexts[launch.launch_node]
            pool = WorkerPool(f"{name}/{spec.run_id}", name, launch, pool_files(server, name))
            self._register(pool)
            on_started(pool, False)
            self.pool = pool
            self._start(pool)
            return PreparedRun(spec, staged, pool, False)
        except BaseException:
            self.discard()
            raise

    def serve(
        self, prepared: PreparedRun, out_dir: Path, *, on_wait: Callable[[float], None] = lambda _: None
    ) -> PoolRun:
        """Order the prepared run from its pool, wait for it, collect its ranks' files; a failure
        ends the pool."""
        try:
            if self.pool is not prepared.pool:
                raise NodeError(prepared.pool.server, f"the worker pool {prepared.pool.pool_id} is no longer up")
            try:
                return self._run(prepared.pool, prepared.spec, prepared.staged, out_dir, prepared.warm, on_wait)
            except _StoppedBeforeOrder:  # its idle timeout ran out while this run was configured: start anew
                old = prepared.pool
                self.pool = WorkerPool(f"{old.name}/{prepared.spec.run_id}", old.name, old.launch, old.files)
                self._register(self.pool)
                self._start(self.pool)
                return self._run(self.pool, prepared.spec, prepared.staged, out_dir, False, on_wait)
        except BaseException:
            self.discard()
            raise

    def _alive(self, pool: WorkerPool) -> bool:
        """Whether the pool's mpiexec has not ended (it writes its exit status when it does)."""
        with open_transport(self.inventory, self.inventory.node(pool.server)) as t:
            return t.run_script(alive_check(pool.files), timeout_s=30.0).exit_code != 0

    def _start(self, pool: WorkerPool) -> None:
        with open_transport(self.inventory, self.inventory.node(pool.server)) as t:
            t.run(start_script(pool.files), timeout_s=30.0).check()
            if pool.launch.ssh is not None:
                pool.launch.ssh.write(t)
            t.start_background(launch_argv(pool.launch, pool.files.status), pidfile=pool.files.pidfile,
                               logfile=pool.files.log, env=launch_env(pool.launch.timeout_s))  # fmt: skip

    def _run(self, pool: WorkerPool, spec: SplitRunSpec, staged: StagedRun, out_dir: Path, warm: bool,
             on_wait: Callable[[float], None]) -> PoolRun:  # fmt: skip
        record_path = f"{staged.server_run_dir}/{POOL_RECORD}"
        out_dir.mkdir(parents=True, exist_ok=True)
        runs_before = pool.served
        with open_transport(self.inventory, self.inventory.node(pool.server)) as t:
            pool.orders += 1
            t.store(pool.files.order, order_bytes(pool.orders, run=spec.run_id))
            started = time.monotonic()
            answer = _wait(t, run_wait_script(record_path, pool.files.status), spec.timeout_s, started, on_wait)
            if answer == "exit 0":  # a pool ends well only on a stop order or its idle timeout, never in a run
                pool.orders -= 1
                raise _StoppedBeforeOrder(pool.pool_id)
            seconds = time.monotonic() - started
            log = t.run(["tail", "-c", "200000", pool.files.log], timeout_s=30.0).stdout
            record = {}
            if answer == "done":
                t.get(record_path, out_dir / POOL_RECORD)
                record = json.loads((out_dir / POOL_RECORD).read_text())
        status = {"done": "served", None: "timed out"}.get(answer, answer)
        (out_dir / "mpiexec.log").write_text(
            f"$ {pool.launch.apply_commands()[0]}\n# pool {pool.pool_id}, order {pool.orders}: {status}\n{log}"
        )
        rank_dirs = collect_ranks(self.inventory, staged, out_dir / "ranks")
        if answer != "done":
            raise launch_failure(self.inventory, staged, f"the worker pool {status}", log, pool.launch.groups, out_dir)
        pool.served += 1
        result = SplitRunResult(out_dir, pool.launch, seconds, tuple(rank_dirs))
        if not self.warm:
            try:
                self.release("every run starts cold (warm_runs: false)")
            except Exception as exc:  # the run was served: it is recorded, the pool is ended on --resume
                record = dict(record, release_error=f"could not stop the pool after the run: {exc}")
        return PoolRun(result, pool.pool_id, warm, runs_before, record)

    def release(self, reason: str) -> None:
        """Ask the pool to stop, wait for it, and end it by its pidfile if it has not."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        with open_transport(self.inventory, self.inventory.node(pool.server)) as t:
            t.store(pool.files.order, order_bytes(pool.orders + 1, stop=reason))
            t.run_script(stop_wait_script(pool.files.status), timeout_s=STOP_WAIT_S + 30.0)
            t.stop_background(pool.files.pidfile)

    def discard(self) -> None:
        """End the pool now (a run failed in it, or the controller is interrupted)."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        with open_transport(self.inventory, self.inventory.node(pool.server)) as t:
            t.stop_background(pool.files.pidfile)


def stop_wait_script(status: str) -> str:
    """sh that waits up to STOP_WAIT_S for a pool's exit status."""
    s = shlex.quote(status)
    return f"i=0; while [ ! -s {s} ] && [ $i -lt {int(STOP_WAIT_S / 0.1)} ]; do sleep 0.1; i=$((i+1)); done"


def _wait(t: Transport, script: str, timeout_s: float, started: float, on_wait: Callable[[float], None]) -> str | None:
    """``done``, ``exit <status>``, or None when the run outlived ``timeout_s`` (plus a margin)."""
    deadline = started + timeout_s + LAUNCH_MARGIN_S
    while time.monotonic() < deadline:
        answer = t.run_script(script, timeout_s=WAIT_POLL_S + 30.0).stdout.strip()
        if answer:
            return answer.splitlines()[-1]
        on_wait(time.monotonic() - started)
    return None


def end_registered_pools(inventory: Inventory, registry: Path, say: Callable[[str], None]) -> None:
    """End every pool ``registry`` lists (after a crash: a pool of a dead controller serves nobody)."""
    if not registry.is_file():
        return
    names = {n.name for n in inventory.nodes}
    failed = []
    for entry in json.loads(registry.read_text()):
        if entry["node"] not in names:
            continue
        try:
            with open_transport(inventory, inventory.node(entry["node"])) as t:
                how = t.stop_background(entry["pidfile"])
            if how in ("stopped", "killed"):
                say(f"{entry['node']}: ended the worker pool {entry['pool']} the interrupted campaign had left ({how})")
        except Exception as exc:  # a node that cannot be reached now is reported, not fatal
            say(f"{entry['node']}: could not end the worker pool {entry['pool']}: {exc}")
            failed.append(entry)
    if failed:  # kept for the next --resume to try again
        write_json_atomic(registry, failed)
    else:
        registry.unlink()


def plan_pool_up(lines: PlanLines, launch: MpiLaunchPlan, files: PoolFiles) -> None:
    """The stage phase's lines of :meth:`PoolKeeper.prepare` that start the pool when none of its shape is up."""
    server = launch.launch_node
    lines.add(server, "stage", "has the warm pool ended since the last run?", sh(alive_check(files)), "live")
    lines.add(server, "stage", "clear what an earlier pool of this shape left", command_line(start_script(files)),
              "if-cold")  # fmt: skip
    if launch.ssh is not None:
        launch.ssh.plan(lines, server, "stage")
    words = prefix_words(sudo=False, env=launch_env(launch.timeout_s))
    lines.detached(server, "stage", "start the warm worker pool with mpiexec (detached)",
                   [*words, *launch_argv(launch, files.status)], files.pidfile, files.log, "if-cold")  # fmt: skip


def plan_pool_serve(
    lines: PlanLines, spec: SplitRunSpec, contexts: Mapping[str, NodeContext], files: PoolFiles
) -> None:
    """The workers phase's lines of :meth:`PoolKeeper.serve`: order, wait, end on failure, collect."""
    server = spec.server
    lines.store(server, "workers", "order the run from the pool", files.order)
    record = f"{run_dir_on(contexts[server], spec.run_id)}/{POOL_RECORD}"
    lines.add(server, "workers", "wait for the run to finish (or the pool to end)",
              sh(run_wait_script(record, files.status)), "polled")  # fmt: skip
    plan_served_counts(lines, spec, contexts)
    lines.add(server, "workers", "end the pool (the run failed or timed out)",
              sh(background_stop_script(files.pidfile, 5.0)), "on-failure")  # fmt: skip
    lines.add(server, "workers", "read the pool's output", command_line(["tail", "-c", "200000", files.log]))
    plan_rank_listing(lines, spec, contexts)


def plan_pool_release(lines: PlanLines, server: str, files: PoolFiles) -> None:
    """The lines of :meth:`PoolKeeper.release` (after the last run of the pool's shape)."""
    lines.store(server, "restore", "order the pool to stop", files.order, "at-release")
    lines.add(server, "restore", "wait for the pool to end", sh(stop_wait_script(files.status)), "at-release")
    lines.add(server, "restore", "end the pool if it has not", sh(background_stop_script(files.pidfile, 5.0)),
              "at-release")  # fmt: skip
