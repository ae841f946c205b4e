"""One split-inference run: place ranks, launch them with ``mpiexec``, collect what they wrote.

The server node runs the P pipeline stages (ranks 0..P-1) and each device node one device rank.
``mpiexec`` (MPICH's hydra, from the node's Python environment) is started on the server node and
reaches the devices over SSH at their management addresses, so that launching never waits on a
shaped link. What the ranks exchange is pinned to the data plane by the environment every rank
gets: ``MPIR_CVAR_NOLOCAL=1`` (no shared-memory shortcut, which ranks on one kernel would take),
``UCX_TLS=tcp,self`` with ``UCX_NET_DEVICES`` naming the node's data interface, and
``FI_PROVIDER=tcp`` with ``FI_TCP_IFACE`` for MPICH builds on libfabric. On the emulated testbed a
test checks the data veths' byte counters against the hidden states sent.

Every node gets its own copy of the run config (paths as seen on that node) under
``<workdir>/runs/<run_id>/``; results come back to ``<out>/ranks/<role>-<i>-<node>/``.

One concept, the MPI launch of a split run, over ~450 lines.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import NodeError, TestbedError
from nodes.contracts.compute_profile import rates_from_json
from nodes.contracts.draft import default_adapter_dir
from nodes.contracts.methods import method_named
from nodes.contracts.methods import names as method_names
from nodes.contracts.rank_dirs import ABORT_REASON_GLOB, device_glob, parse_rank_dir
from nodes.contracts.run_config import (
    DispatchSettings,
    DraftSettings,
    RankSpec,
    RunConfig,
    ServingSettings,
    TargetSettings,
    dispatch_settings,
    scaling_settings,
)
from nodes.contracts.schedules import request_id
from nodes.contracts.target_model import from_json as target_from_json
from testbed.commands.node_context import NodeContext, ensure_node_code, resolve_contexts
from testbed.commands.planned import PlanLines, normalised_line, sh
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.provisioning.provision import compare_records, load_record
from testbed.transport import open_transport
from testbed.transport.base import Transport, command_line, quote_path, store_script
from testbed.transport.fanout import fan_out

Say = Callable[[str], None]
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

    def hosts_argument(self) -> str:
        return ",".join(f"{g.host}:{g.ranks}" for g in self.groups)

    def argv(self) -> list[str]:
        words = [self.mpiexec, "-launcher", "ssh", "-hosts", self.hosts_argument()]
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


@dataclass(frozen=True)
class MethodSections:
    """The run config's sections of the method families, as the campaign's settings became them (each
    holds its contract's fields, nodes.contracts.run_config; None: the run has none)."""

    draft: Mapping[str, Any] | None = None  # HAT's draft model and drafting (DraftSettings)
    serving: Mapping[str, Any] | None = None  # the serving engine's budgets and scheduler (Andes)
    scaling: Mapping[str, Any] | None = None  # CoCoServe's GPU memory, speedup model and monitor
    dispatch: Mapping[str, Any] | None = None  # DiSCo's policy, prices, endpoints and their key's place
    target: Mapping[str, Any] | None = None  # target emulation: the model, the dilation, each node's profile


@dataclass(frozen=True)
class SplitRunSpec:
    method: str
    model: str  # checkpoint directory as seen on the nodes
    server: str
    devices: tuple[str, ...]
    stages: int = 1
    device_layers: int = 1
    chunk_tokens: int = 128
    dtype: str = "float32"
    schedule: tuple[dict[str, Any], ...] = ()  # one schedule, replayed by every device
    schedules: tuple[tuple[str, tuple[dict[str, Any], ...]], ...] = ()  # or one per device (request ids as given)
    run_id: str = "split"
    timeout_s: float = 600.0
    threads_per_rank: int = 1
    sections: MethodSections = MethodSections()
    device_slots: int = 1  # device ranks per device node: a free one takes the next request


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


def check_spec(inventory: Inventory, spec: SplitRunSpec) -> tuple[NodeSpec, list[NodeSpec]]:
    if spec.method not in method_names():
        raise TestbedError(f"method {spec.method!r}: choose one of {', '.join(method_names())}")
    known = {n.name: n for n in inventory.nodes}
    unknown = [name for name in (spec.server, *spec.devices) if name not in known]
    if unknown:
        raise TestbedError(f"{inventory.path}: no node named {unknown[0]!r}; known: {', '.join(known)}")
    server = known[spec.server]
    devices = [known[name] for name in spec.devices]
    if not devices:
        raise TestbedError("a split run needs at least one device")
    for node in [server, *devices]:
        if not kind_of(node).runs_ranks:
            raise TestbedError(f"{node.name} (kind {node.kind}) runs no MPI ranks; choose a Jetson or server node")
        if node.data is None:
            raise TestbedError(f"{inventory.path}: node {node.name!r} has no 'data:' interface for MPI traffic")
        if node.address is None:
            raise TestbedError(f"{inventory.path}: node {node.name!r} has no address for mpiexec to reach it at")
    if spec.stages < 1 or spec.device_layers < 0:
        raise TestbedError("stages must be >= 1 and device_layers >= 0")
    per_device = dict(spec.schedules)
    if per_device:
        lacking = [d for d in spec.devices if not per_device.get(d)]
        if lacking:
            raise TestbedError(f"no requests scheduled for {', '.join(lacking)}")
    elif not spec.schedule:
        raise TestbedError("the schedule is empty: give at least one request")
    return server, devices


def _rank_specs(
    spec: SplitRunSpec, server: NodeSpec, devices: Sequence[NodeSpec], schedules: dict[str, str]
) -> tuple[RankSpec, ...]:
    """The run's ranks in MPI order: the server's P stages, then each device's slots (a rank each, all
    reading the device's schedule: a free slot claims the next request, see ``nodes.workers.split.device``);
    each with its node's compute profile when the run emulates a target (``sections.target``)."""
    device = _torch_device(server)
    profiles = {name: rates_from_json(entry["rates"])
                for name, entry in ((spec.sections.target or {}).get("nodes") or {}).items()}  # fmt: skip
    ranks = [RankSpec("stage", server.name, i, device, spec.threads_per_rank, profile=profiles.get(server.name))
             for i in range(spec.stages)]  # fmt: skip
    slots = [node for node in devices for _ in range(spec.device_slots)]
    ranks += [RankSpec("device", node.name, i, "cpu", spec.threads_per_rank, schedules[node.name],
                       profiles.get(node.name)) for i, node in enumerate(slots)]  # fmt: skip
    return tuple(ranks)


def run_config_for(spec: SplitRunSpec, model_dir: str, run_dir: str, ranks: tuple[RankSpec, ...]) -> RunConfig:
    """The run config one node's ranks read (the model as that node has it: a placed part or the
    checkpoint); the draft adapter stays with the checkpoint, also when the node runs a placed part."""
    draft = {"adapter": default_adapter_dir(spec.model), **(spec.sections.draft or {})}
    target = spec.sections.target
    return RunConfig(
        run_id=spec.run_id, method=spec.method, model=model_dir, dtype=spec.dtype, device_layers=spec.device_layers,
        stages=spec.stages, chunk_tokens=spec.chunk_tokens, out_dir=f"{run_dir}/out", ranks=ranks,
        draft=DraftSettings(**draft), deadline_s=spec.timeout_s,
        target=None if target is None else TargetSettings(
            target_from_json(target["model"]), float(target["dilation"]), bool(target["pad_payloads"])),
        serving=ServingSettings(**(spec.sections.serving or {})),
        dispatch=_dispatch_settings(spec.sections.dispatch, run_dir),
        scaling=scaling_settings(spec.sections.scaling, "the run's scaling settings"),
    )  # fmt: skip


KEY_FILE = "endpoint.key"  # an external endpoint's key on a device node, in its run directory
RUN_KEY_FILE = "endpoints.key"  # the run's own key for the endpoints it starts, on each of its nodes
PER_RUN_KEY = "<per-run key>"  # the dispatch section's ``endpoint_key``: one is made when the run is staged


def _dispatch_settings(raw: Mapping[str, Any] | None, run_dir: str) -> DispatchSettings:
    """The run config's dispatch section: the key's variable name becomes the path of its file, and a
    per-run key the path of the file staging writes it to."""
    fields = {k: v for k, v in (raw or {}).items() if k not in ("external_key_env", "endpoint_key")}
    if raw and raw.get("external_key_env"):
        fields["external_key_file"] = f"{run_dir}/{KEY_FILE}"
    fields["endpoint_key_file"] = run_key_path(raw, run_dir)
    return dispatch_settings(fields if raw else None, "the run's dispatch settings")


def run_key_path(dispatch: Mapping[str, Any] | None, run_dir: str) -> str | None:
    """Where a node keeps the run's endpoint key, when the run's dispatch section asks for one."""
    return f"{run_dir}/{RUN_KEY_FILE}" if (dispatch or {}).get("endpoint_key") == PER_RUN_KEY else None


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


def _torch_device(node: NodeSpec) -> str:
    return "cuda" if node.gpus and node.emulated is None else "cpu"


def device_schedule(spec: SplitRunSpec, device_index: int) -> list[dict[str, Any]]:
    """The run's schedule as one device replays it: its own, or the shared one with request ids made
    unique per device."""
    per_device = dict(spec.schedules)
    if per_device:
        return [dict(row) for row in per_device[spec.devices[device_index]]]
    out = []
    for position, request in enumerate(spec.schedule):
        row = dict(request)
        row["request_id"] = request_id(device_index, int(row.get("request_id", position)))
        out.append(row)
    return out


@dataclass(frozen=True)
class StagedRun:
    """A run's files in place on its nodes: each node's run directory (and a device's schedule)."""

    server: NodeSpec
    nodes: tuple[NodeSpec, ...]
    info: dict[str, dict[str, str]]

    @property
    def server_run_dir(self) -> str:
        return self.info[self.server.name]["run_dir"]


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
    ranks = _rank_specs(spec, server, devices, schedules)

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
        exit_code, log = _launch_and_wait(t, plan, run_dir, spec.timeout_s, on_wait)
        seconds = time.monotonic() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    status = "timed out" if exit_code is None else f"exit status {exit_code}"
    (out_dir / "mpiexec.log").write_text(f"$ {plan.apply_commands()[0]}\n# {status}\n{log}")
    rank_dirs = collect_ranks(inventory, staged, out_dir / "ranks")
    if exit_code != 0:
        raise launch_failure(inventory, staged, f"mpiexec {status}", log, groups, out_dir)
    return SplitRunResult(out_dir, plan, seconds, tuple(rank_dirs))


def run_dir_on(context: NodeContext, run_id: str) -> str:
    """The run's directory on a node (its config, schedules and the ranks' ``out/``)."""
    return context.under_workdir("runs", run_id)


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
    return MpiLaunchPlan(server.name, mpiexec or "mpiexec", tuple(groups), spec.timeout_s)


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


def rank_listing_script(out: str) -> str:
    """sh that lists the files under a node's ``out/`` (relative, ``./``-prefixed)."""
    return f"cd {shlex.quote(out)} 2>/dev/null && find . -type f"


def _launch_and_wait(
    t: Transport, plan: MpiLaunchPlan, run_dir: str, timeout_s: float, on_wait: Callable[[float], None]
) -> tuple[int | None, str]:
    """Start ``mpiexec`` detached on the launch node (so a controller that dies leaves a pidfile to
    end it by, and MPIEXEC_TIMEOUT bounds it meanwhile), wait for its exit status, and return it
    (None after a timeout, when it is stopped) with its output."""
    status, log = launch_files(run_dir)
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


def plan_mpiexec_search(lines: PlanLines, server: str, context: NodeContext) -> None:
    """The plan phase's line of :func:`find_mpiexec`."""
    lines.add(server, "plan", "find mpiexec beside the workers' Python", sh(mpiexec_search_script(context.python)))


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
