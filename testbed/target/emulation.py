"""What a run emulates: the target model's shape, each node's compute profile in its power mode, and
the dilation; resolved from a campaign's ``target:`` settings and the inventory, for the run config.

    base:
      target: {model: vicuna-7b, dilation: 1}     # a built-in shape, or a config.json (or its directory)

A node's profile is its inventory entry's ``compute_profile:`` (a name in ``examples/profiles`` or a
file relative to the inventory), else the profile named like its ``gpu_model`` (a server) or its
``model`` (a board) when there is one. Its mode is the run's ``power:`` setting for the node, else the
emulated node's initial mode, else the profile's first mode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import NodeError, TestbedError
from nodes.contracts.compute_profile import ModeRates
from nodes.contracts.target_model import TargetModel, TargetModelError, builtin, from_hf_config
from testbed.commands.node_context import NodeContext, ensure_node_code, resolve_context
from testbed.commands.planned import PlanLines
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.target.compute_profiles import ComputeProfile, known_profiles, load_profile, profile_path
from testbed.transport import open_transport
from testbed.transport.base import command_line
from testbed.transport.fanout import FanOutResult, fan_out


@dataclass(frozen=True)
class NodeTarget:
    """The hardware a node stands for in a run."""

    profile: str  # the profile's hardware name
    path: str
    mode: str
    rates: ModeRates

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "path": self.path, "mode": self.mode, "rates": self.rates.to_json()}


@dataclass(frozen=True)
class RunTarget:
    model: TargetModel
    dilation: float
    pad_payloads: bool
    nodes: dict[str, NodeTarget]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model.to_json(), "dilation": self.dilation, "pad_payloads": self.pad_payloads,
                "nodes": {name: n.to_json() for name, n in self.nodes.items()}}  # fmt: skip


def load_target_model(name_or_path: str, base_dir: Path, dtype: str | None = None) -> TargetModel:
    """A built-in shape by name, or one read from a Hugging Face config.json (or its directory),
    relative to ``base_dir``."""
    candidate = (base_dir / name_or_path).expanduser()
    if candidate.is_dir():
        candidate = candidate / "config.json"
    try:
        if candidate.is_file():
            raw = json.loads(candidate.read_text())
            return from_hf_config(raw, candidate.parent.name if candidate.name == "config.json" else candidate.stem,
                                  dtype or "")  # fmt: skip
        model = builtin(name_or_path)
        return model._replace(dtype=dtype) if dtype else model
    except (TargetModelError, ValueError) as error:
        raise TestbedError(str(error)) from None


def node_profile(inventory: Inventory, node: NodeSpec) -> ComputeProfile | None:
    """The node's compute profile (module docstring), or None when it names none and no profile is
    named like its hardware."""
    named = node.compute_profile
    if named:
        path = profile_path(named, inventory.path.parent)
        if not path.is_file():
            raise TestbedError(f"{inventory.path}: node {node.name}: compute_profile {named!r}: no profile {path}; "
                               f"known: {', '.join(known_profiles())}")  # fmt: skip
        return load_profile(path)
    for candidate in (node.gpu_model, node.model):
        if candidate and candidate in known_profiles():
            return load_profile(profile_path(candidate, inventory.path.parent))
    return None


def run_modes(inventory: Inventory, power: dict[str, str]) -> dict[str, str]:
    """A run's ``power:`` (node or group -> mode id or name) as node -> mode name (an emulated node's
    id or differently cased name becomes the name it lists)."""
    out = {}
    for key, wanted in power.items():
        for node in inventory.select([key]):
            name = wanted
            for mode in node.emulated.power_modes if node.emulated is not None else ():
                if wanted in (str(mode.id), mode.name) or wanted.lower() == mode.name.lower():
                    name = mode.name
            out[node.name] = name
    return out


def node_mode(node: NodeSpec, modes: dict[str, str], profile: ComputeProfile) -> str:
    """The node's mode in a run: as the run sets it, else its initial mode (emulated), else the profile's first."""
    if node.name in modes:
        return modes[node.name]
    if node.emulated is not None and node.emulated.initial_mode is not None:
        for mode in node.emulated.power_modes:
            if mode.id == node.emulated.initial_mode:
                return mode.name
    return profile.modes[0]


def paced_names(settings: Any, devices: Sequence[str]) -> list[str]:
    """The run's nodes whose steps are paced to a profile: the server and the devices, or the server
    alone for a streaming method (its clients compute nothing)."""
    from nodes.contracts.methods import method_named

    return [settings.server] if method_named(settings.method).streams else [settings.server, *devices]


def resolve_target(inventory: Inventory, base_dir: Path, settings: Any, nodes: list[NodeSpec]) -> RunTarget:
    """The run's target (``settings.target``) with the profile of each of ``nodes`` (server, devices)."""
    target = settings.target
    model = load_target_model(target.model, base_dir, target.dtype)
    modes = run_modes(inventory, dict(settings.power))
    return RunTarget(model, target.dilation, target.pad_payloads,
                     {node.name: resolve_node(inventory, node, modes) for node in nodes})  # fmt: skip


def resolve_node(inventory: Inventory, node: NodeSpec, modes: dict[str, str]) -> NodeTarget:
    """The node's profile in its run mode; a TestbedError names what is missing."""
    profile = node_profile(inventory, node)
    if profile is None:
        raise TestbedError(
            f"{inventory.path}: node {node.name} has no compute profile: add 'compute_profile: <name>' "
            f"to it (one of {', '.join(known_profiles())}, or a profile file)"
        )
    mode = node_mode(node, modes, profile)
    if mode not in profile.modes:
        raise TestbedError(f"{profile.path}: has no mode {mode!r} for node {node.name} (it has "
                           f"{', '.join(profile.modes)}); add the mode to the profile")  # fmt: skip
    return NodeTarget(profile.hardware, str(profile.path), mode, profile.rates(mode))


# -- CPU pacing of emulated nodes ------------------------------------------------------------------

PACED_PERIOD_MS = 10.0  # the CFS period of an emulated node whose steps are paced (default 100 ms)


def paced_cpus() -> float:
    """The quota of a paced node: every CPU of this machine, so that the quota never holds the real
    work back (the profile decides the step's time; nodes share the CPUs by CFS weight)."""
    import os

    return float(os.cpu_count() or 1)


def pacing_command(context: NodeContext, on: bool) -> list[str]:
    """The node tool's command line that starts (``on``) or ends CPU pacing on an emulated node."""
    words = ["on", "--cpus", f"{paced_cpus():g}", "--period-ms", f"{PACED_PERIOD_MS:g}"] if on else ["off"]
    return context.command([context.base_python, "-m", "nodes.emulated.cpu_pacing", *words])


def paceable(inventory: Inventory, names: Sequence[str]) -> list[str]:
    """The emulated ones of ``names`` (a real board's CPU is not this machine's to pace; an emulated
    phone hosts no steps to pace)."""
    return [n for n in names if inventory.node(n).emulated is not None and kind_of(inventory.node(n)).runs_ranks]


def plan_pacing(lines: PlanLines, names: Sequence[str], contexts: Mapping[str, NodeContext], on: bool) -> None:
    """The lines of :func:`pace_nodes` (configure: ``on``; restore: off) for the paceable ones of ``names``."""
    for name in names:
        if on:
            lines.node_code(name, "configure", contexts[name])
            lines.add(name, "configure", "pace the CPU: 10 ms CFS periods, a quota of every CPU",
                      command_line(pacing_command(contexts[name], True)))  # fmt: skip
        else:
            lines.add(name, "restore", "end the CPU pacing (the power mode's quota again)",
                      command_line(pacing_command(contexts[name], False)))  # fmt: skip


def pace_nodes(
    inventory: Inventory, names: Sequence[str], on: bool, contexts: Mapping[str, NodeContext] | None = None
) -> FanOutResult[dict[str, Any]]:
    """Start or end CPU pacing on the emulated ones of ``names``; each node's answer."""

    def pace(name: str) -> dict[str, Any]:
        node = inventory.node(name)
        with open_transport(inventory, node) as t:
            context = (contexts or {}).get(name) or resolve_context(inventory, node, t)
            ensure_node_code(t, context)
            result = t.run(pacing_command(context, on), timeout_s=60.0)
        try:
            return dict(json.loads(result.stdout.strip().splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            raise NodeError(name, f"cpu pacing failed (exit status {result.exit_code}): "
                                  f"{(result.stderr or result.stdout).strip()[-300:]}") from None  # fmt: skip

    return fan_out(paceable(inventory, names), pace, description="pacing CPUs" if on else "ending CPU pacing")
