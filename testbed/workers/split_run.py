"""One split-inference run: stage its files on every node (the node code, the run directory, each
device's schedule, the keys, each node's run config), launch it (:mod:`testbed.workers.mpi_launch`),
wait, and collect what every rank wrote (also after a failure); and the plan's lines for each step.
A campaign serves its runs from warm pools instead (:mod:`testbed.workers.pool`), with the same staging.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from nodes.contracts.methods import method_named
from nodes.contracts.rank_dirs import device_glob, parse_rank_dir
from testbed.commands.node_context import NodeContext, ensure_node_code, resolve_contexts
from testbed.commands.planned import PlanLines, normalised_line, sh
from testbed.inventory import Inventory
from testbed.provisioning.provision import compare_records, load_record
from testbed.transport import open_transport
from testbed.transport.base import command_line, quote_path, store_script
from testbed.transport.fanout import fan_out
from testbed.workers.mpi_launch import MpiLaunchPlan, find_mpiexec, launch_and_wait, launch_failure, launch_plan
from testbed.workers.split_spec import (
    KEY_FILE,
    PER_RUN_KEY,
    SplitRunSpec,
    StagedRun,
    check_spec,
    device_schedule,
    rank_specs,
    run_config_for,
    run_dir_on,
    run_key_path,
)

Say = Callable[[str], None]


def private_store_script(path: str, size: int) -> str:
    """``store_script`` for a file its user alone may read (a key; the value comes on stdin, never argv)."""
    return "umask 077 && " + store_script(path, size)


def endpoint_key(spec: SplitRunSpec) -> bytes | None:
    """An external endpoint's key, from the controller's environment (checked when the campaign loaded)."""
    name = (spec.sections.dispatch or {}).get("external_key_env")
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise TestbedError(f"the environment variable {name} that holds the external endpoint's key is not set; "
                           f"export {name}=... on the controller")  # fmt: skip
    return value.encode()


@dataclass(frozen=True)
class SplitRunResult:
    out_dir: Path
    plan: MpiLaunchPlan
    seconds: float
    rank_dirs: tuple[Path, ...]

    def requests(self) -> list[dict[str, Any]]:
        rows = []
        for directory in self.rank_dirs:
            path = directory / "requests.jsonl"
            if path.exists():
                rows += [
                    json.loads(line) for line in path.read_text().splitlines() if line and not line.startswith("#")
                ]
        return rows



def stage_run(inventory: Inventory, spec: SplitRunSpec, contexts: Mapping[str, NodeContext] | None = None) -> StagedRun:
    """Check the run's nodes can run together, then put the run's files on every node: the node code
    (when it lacks it), a new run directory, each device's schedule, and each node's run config."""
    server, devices = check_spec(inventory, spec)
    nodes = [server, *devices]
    records = {n.name: load_record(inventory, n.name) for n in nodes}
    differences = compare_records({name: r for name, r in records.items() if r})
    if differences:
        raise TestbedError("the run's nodes cannot run together:\n" + "\n".join(differences))
    if contexts is None:
        contexts = resolve_contexts(inventory, [n.name for n in nodes]).require("reading the nodes' home directories")
    model_dirs = {n.name: _model_dir_on(records[n.name], "server" if n is server else "device", spec) for n in nodes}
    key = endpoint_key(spec)
    run_key = secrets.token_urlsafe(32).encode()  # fresh for every run staged; never in a plan or manifest

    def stage(name: str) -> dict[str, str]:
        node = inventory.node(name)
        with open_transport(inventory, node) as t:
            ensure_node_code(t, contexts[name])
            run_dir = run_dir_on(contexts[name], spec.run_id)
            # everything of an earlier run with this id goes (its outputs, a pool's record of it): the
            # same campaign run again in the same lab has the same run ids
            t.run(["rm", "-rf", run_dir], timeout_s=60.0).check()
            info = {"run_dir": run_dir}
            if name in spec.devices:
                rows = device_schedule(spec, spec.devices.index(name))
                path = f"{run_dir}/schedule-{name}.jsonl"
                t.store(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
                info["schedule"] = path
                if key is not None:  # readable by the node's user alone; the rank removes it once read
                    t.run(["sh", "-c", private_store_script(f"{run_dir}/{KEY_FILE}", len(key))], stdin=key,
                          timeout_s=60.0).check()  # fmt: skip
            key_path = run_key_path(spec.sections.dispatch, run_dir)
            if key_path is not None:  # the run's endpoints ask for it; its ranks read it from here
                t.run(["sh", "-c", private_store_script(key_path, len(run_key))], stdin=run_key, timeout_s=60.0).check()
            return info

    info = fan_out([n.name for n in nodes], stage).require("staging the run")
    schedules = {d.name: info[d.name]["schedule"] for d in devices}
    ranks = rank_specs(spec, server, devices, schedules)

    def write_config(name: str) -> str:
        node = inventory.node(name)
        config = run_config_for(spec, model_dirs[name], info[name]["run_dir"], ranks)
        path = f"{info[name]['run_dir']}/run.json"
        with open_transport(inventory, node) as t:
            t.store(path, (json.dumps(config.to_json(), indent=1) + "\n").encode())
        return path

    fan_out([n.name for n in nodes], write_config).require("writing the run config")
    return StagedRun(server, tuple(nodes), info)


def run_split(
    inventory: Inventory,
    spec: SplitRunSpec,
    out_dir: Path,
    *,
    say: Say = lambda _: None,
    on_wait: Callable[[float], None] = lambda _: None,
    contexts: Mapping[str, NodeContext] | None = None,
    mpiexec: str | None = None,
) -> SplitRunResult:
    """Stage the run on every node, launch it, wait (bounded; ``on_wait`` is called with the
    seconds elapsed every few seconds), and collect every rank's files (also after a failure).
    A run plan passes the nodes' ``contexts`` and the launch node's ``mpiexec`` it resolved.
    (A campaign serves its runs from warm pools instead: :mod:`testbed.workers.pool`.)"""
    if contexts is None:
        names = [spec.server, *spec.devices]
        contexts = resolve_contexts(inventory, names).require("reading the nodes' home directories")
    staged = stage_run(inventory, spec, contexts)
    server = staged.server
    run_dir = staged.server_run_dir
    with open_transport(inventory, server) as t:
        mpiexec = mpiexec or find_mpiexec(t, contexts[server.name].python)
        plan = launch_plan(inventory, spec, contexts, mpiexec)
        groups = plan.groups
        say(f"launching {sum(g.ranks for g in groups)} ranks from {server.name}: {plan.hosts_argument()}")
        started = time.monotonic()
        exit_code, log = launch_and_wait(t, plan, run_dir, spec.timeout_s, on_wait)
        seconds = time.monotonic() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    status = "timed out" if exit_code is None else f"exit status {exit_code}"
    (out_dir / "mpiexec.log").write_text(f"$ {plan.apply_commands()[0]}\n# {status}\n{log}")
    rank_dirs = collect_ranks(inventory, staged, out_dir / "ranks")
    if exit_code != 0:
        raise launch_failure(inventory, staged, f"mpiexec {status}", log, groups, out_dir)
    return SplitRunResult(out_dir, plan, seconds, tuple(rank_dirs))


def _model_dir_on(record: dict, role: str, spec: SplitRunSpec) -> str:
    """The directory of the part ``testbed provision`` placed on the node (``record``) for this model and m, else
    ``spec.model`` (the checkpoint at the same path on every node). ``centralized`` needs the whole
    model on the server, which no part holds."""
    if method_named(spec.method).token_ids_only:
        return spec.model
    wanted = os.path.realpath(spec.model)
    for placed in record.get("weights", []):
        if (
            placed["role"] == role
            and placed["device_layers"] == spec.device_layers
            and os.path.realpath(placed["model"]) == wanted
        ):
            return str(placed["directory"])
    return spec.model


def rank_listing_script(out: str) -> str:
    """sh that lists the files under a node's ``out/`` (relative, ``./``-prefixed)."""
    return f"cd {shlex.quote(out)} 2>/dev/null && find . -type f"


def collect_ranks(inventory: Inventory, staged: StagedRun, into: Path) -> list[Path]:
    """Copy every rank directory of the run from its node (what exists, also after a failure)."""
    nodes, info = staged.nodes, staged.info
    into.mkdir(parents=True, exist_ok=True)

    def collect(name: str) -> list[Path]:
        node = inventory.node(name)
        got: list[Path] = []
        with open_transport(inventory, node) as t:
            out = f"{info[name]['run_dir']}/out"
            listing = t.run_script(rank_listing_script(out), timeout_s=30.0).stdout
            for relative in sorted(line[2:] for line in listing.split() if line.startswith("./")):
                rank = parse_rank_dir(relative.split("/")[0])
                if rank is None or rank.node != name:
                    continue  # a shared file system shows other nodes' ranks too
                local = into / relative
                local.parent.mkdir(parents=True, exist_ok=True)
                t.get(f"{out}/{relative}", local)
                if local.parent not in got:
                    got.append(local.parent)
        return got

    dirs: list[Path] = []
    for outcome in fan_out([n.name for n in nodes], collect).outcomes:
        if outcome.ok:
            dirs += outcome.value
    return sorted(set(dirs))


def served_count_script(context: NodeContext, run_id: str, device: str) -> str:
    """sh that prints how many requests ``device``'s ranks have finished so far in run ``run_id``."""
    pattern = f"{quote_path(run_dir_on(context, run_id) + '/out')}/{device_glob(shlex.quote(device))}"
    return f"cat {pattern}/requests.jsonl 2>/dev/null | grep -c request_id || true"


def plan_stage(lines: PlanLines, spec: SplitRunSpec, contexts: Mapping[str, NodeContext]) -> None:
    """The stage phase's lines of :func:`stage_run`, node by node (a key's value comes on stdin: never
    in a plan, a manifest or a command line)."""
    external = bool((spec.sections.dispatch or {}).get("external_key_env"))
    for name in (spec.server, *spec.devices):
        context = contexts[name]
        run_dir = run_dir_on(context, spec.run_id)
        lines.node_code(name, "stage", context)
        lines.add(name, "stage", "remove what an earlier run with this id left", command_line(["rm", "-rf", run_dir]))
        if name in spec.devices:
            lines.store(name, "stage", "store the device's schedule", f"{run_dir}/schedule-{name}.jsonl")
            if external:
                _plan_private_store(lines, name, "store the external endpoint's key, its user's alone (0600)",
                                    f"{run_dir}/{KEY_FILE}")  # fmt: skip
        key_path = run_key_path(spec.sections.dispatch, run_dir)
        if key_path is not None:
            _plan_private_store(lines, name, f"store the run's endpoint key, its user's alone (0600): {PER_RUN_KEY}",
                                key_path)  # fmt: skip
        lines.store(name, "stage", "store the run config", f"{run_dir}/run.json")


def _plan_private_store(lines: PlanLines, name: str, what: str, path: str) -> None:
    """A key's store (:func:`private_store_script`; its value comes on stdin: never in a plan)."""
    lines.add(name, "stage", what, normalised_line(sh(private_store_script(path, 0))), short=f"(store, 0600) {path}")


def plan_served_counts(lines: PlanLines, spec: SplitRunSpec, contexts: Mapping[str, NodeContext]) -> None:
    """The lines that count the requests served while a run goes on (the progress a campaign shows)."""
    for device in spec.devices:
        lines.add(device, "workers", "count the requests served so far",
                  sh(served_count_script(contexts[device], spec.run_id, device)), "polled")  # fmt: skip


def plan_rank_listing(lines: PlanLines, spec: SplitRunSpec, contexts: Mapping[str, NodeContext]) -> None:
    """The lines of :func:`collect_ranks` that list each node's rank files."""
    for name in (spec.server, *spec.devices):
        out = run_dir_on(contexts[name], spec.run_id) + "/out"
        lines.add(name, "workers", "list the ranks' files to collect", sh(rank_listing_script(out)))
