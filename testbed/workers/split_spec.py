"""What a split-inference run is (:class:`SplitRunSpec`: method, model, partition, schedules, the method
families' sections), the ranks it places in MPI order, and the run config each node's ranks read
(:func:`run_config_for`), with the places of the endpoint keys a run stores on its nodes.

Every node gets its own copy of the run config (paths as seen on that node) under
``<workdir>/runs/<run_id>/``; results come back to ``<out>/ranks/<role>-<i>-<node>/``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from foundation.errors import TestbedError
from nodes.contracts.compute_profile import rates_from_json
from nodes.contracts.draft import default_adapter_dir
from nodes.contracts.methods import names as method_names
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
from testbed.commands.node_context import NodeContext
from testbed.inventory import Inventory, NodeSpec, kind_of


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


def rank_specs(
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


def run_dir_on(context: NodeContext, run_id: str) -> str:
    """The run's directory on a node (its config, schedules and the ranks' ``out/``)."""
    return context.under_workdir("runs", run_id)
