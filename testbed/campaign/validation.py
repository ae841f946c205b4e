"""Checks of a campaign against its inventory and the files it names, before any node is touched:
every matrix key against the run settings' fields, and every run's settings against the nodes, their
roles, groups, power modes of emulated boards, link profiles, traces, files and the model's layers.
Each problem is ``FILE:LINE: field: problem; hint``.
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from foundation.errors import InputError, InputProblem, TestbedError
from foundation.user_files import FieldPath, YamlSource, field_name
from nodes.workers.methods import MethodCheck, method_named
from testbed.campaign.spec import CampaignSpec, RunSettings, workload_spec
from testbed.inventory import Inventory


def relative_path(campaign: Path, written: str) -> Path:
    path = Path(written).expanduser()
    return path if path.is_absolute() else Path(os.path.normpath(campaign.parent / path))


def matrix_key_problems(spec: CampaignSpec, source: YamlSource, lab: Inventory) -> Iterable[InputProblem]:
    names = {n.name for n in lab.nodes} | set(lab.groups) | {"all"}
    for key in spec.matrix:
        model: type[BaseModel] | None = RunSettings
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if model is None:
                yield source.problem(("matrix", key), f"{key!r}: {'.'.join(parts[:depth])} has no fields",
                                     "override the whole value instead")  # fmt: skip
                break
            fields = model.model_fields
            if part not in fields:
                where = ".".join(parts[:depth]) or "a run's settings"
                yield source.problem(
                    ("matrix", key), f"{key!r} is not a config field: {where} has no field {part!r}",
                    "fields: " + ", ".join(fields),
                )  # fmt: skip
                break
            annotation = fields[part].annotation
            optional = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(optional) == 1 and type(None) in typing.get_args(annotation):
                annotation = optional[0]  # X | None: X's fields (the base must set it for them to apply)
            if part == "power" and model is RunSettings:
                if depth + 1 < len(parts) and parts[depth + 1] not in names:
                    yield source.problem(("matrix", key), f"{key!r}: {parts[depth + 1]!r} is not a node or group "
                                         f"of {lab.path}", "use power.NODE or power.GROUP")  # fmt: skip
                if len(parts) > depth + 2:
                    yield source.problem(("matrix", key), f"{key!r}: power.NODE takes a mode, not fields", "")
                break
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


class SettingsChecker:
    """Checks of a run's settings against the inventory and the files they name."""

    def __init__(self, source: YamlSource, lab: Inventory) -> None:
        self.source, self.lab = source, lab
        self.names = {n.name for n in lab.nodes} | set(lab.groups)

    def check(self, settings: RunSettings, at: FieldPath, *, only_under: str | None = None) -> list[InputProblem]:
        """Problems of ``settings``; located at ``at`` + the field, or at ``at`` itself when the
        settings came from a matrix value (``only_under``: report only what that key changed)."""
        out = []
        for field, problem, hint in self._problems(settings):
            if only_under is not None:
                if not (field == only_under or field.startswith(only_under + ".") or only_under.startswith(field)):
                    continue
                out.append(InputProblem(str(self.source.path), self.source.line_of(at), field_name(at),
                                        f"{field}: {problem}", hint))  # fmt: skip
            else:
                path = (*at, *[int(p) if p.isdigit() else p for p in field.split(".") if p])
                out.append(self.source.problem(path, problem, hint))
        return out

    def _problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        lab = self.lab
        known = ", ".join(sorted(self.names))
        server = next((n for n in lab.nodes if n.name == s.server), None)
        if server is None:
            yield "server", f"no node named {s.server!r} in {lab.path}", f"known: {known}"
        elif server.kind == "android":
            yield "server", f"{s.server} is a phone; the server stages need a Linux node", ""
        elif "server" not in server.roles:
            yield "server", f"{s.server} does not have the server role in {lab.path}", \
                f"add 'server' to its roles, or name a node that has it: {_with_role(lab, 'server')}"
        for i, name in enumerate(s.devices):
            if name not in self.names:
                yield f"devices.{i}", f"no node or group named {name!r} in {lab.path}", f"known: {known}"
        if all(name in self.names for name in s.devices):
            chosen = lab.select(list(s.devices))
            if not chosen:
                yield "devices", "no device selected", "name at least one device node or group"
            for node in chosen:
                if node.kind == "android":
                    yield "devices", f"{node.name} is a phone: phones run no MPI ranks", "choose Jetson or server nodes"
                elif node.name == s.server:
                    yield "devices", f"{node.name} is the run's server; a node is either the server or a device", ""
                elif "device" not in node.roles:
                    yield "devices", f"{node.name} does not have the device role in {lab.path}", \
                        f"add 'device' to its roles, or choose nodes that have it: {_with_role(lab, 'device')}"
                if node.data is None and node.emulated is None:  # emulated nodes get one at 'emulate up'
                    yield "devices", f"{node.name} has no 'data:' interface for MPI traffic", f"add one in {lab.path}"
        for name, mode in s.power.items():
            if name not in self.names and name != "all":
                yield f"power.{name}", f"no node or group named {name!r} in {lab.path}", f"known: {known}"
                continue
            for node in lab.select([name]):
                if node.emulated is not None and node.emulated.power_modes and node.kind == "jetson":
                    offered = [(str(m.id), m.name) for m in node.emulated.power_modes]
                    if not any(mode in pair or mode.lower() == pair[1].lower() for pair in offered):
                        listing = ", ".join(f"{i} {n}" for i, n in offered)
                        yield f"power.{name}", f"{node.name} has no power mode {mode!r}", f"it has: {listing}"
        yield from self._link_problems(s)
        yield from self._model_problems(s)
        if s.target is not None:
            yield from self._target_problems(s)
        if method_named(s.method).streams:
            yield from self._serving_problems(s)
        if s.dispatch is not None and s.dispatch.external is not None:
            yield from self._external_problems(s.dispatch.external)
        if method_named(s.method).serves_contexts:
            yield from self._context_service_problems(s)
        spec = workload_spec(s)
        for field, message in spec.problems():
            yield f"workload.{field}", message, ""
        for field in ("trace", "prompts"):
            value = getattr(s.workload, field)
            path = value[5:] if field == "prompts" and value and value.startswith("file:") else (
                value if field == "trace" else None)  # fmt: skip
            if path and not relative_path(self.source.path, path).is_file():
                yield f"workload.{field}", f"{path}: no such file", "paths are relative to the campaign file"

    def _link_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        link = s.link
        chosen = [f for f in ("profile", "trace", "links") if getattr(link, f)]
        if len(chosen) > 1:
            yield "link", f"give one of profile, trace and links (this has {', '.join(chosen)})", ""
        if link.profile and link.profile not in self.lab.spec.link_profiles:
            have = ", ".join(self.lab.spec.link_profiles) or "none"
            yield "link.profile", f"no link profile {link.profile!r} in {self.lab.path}", f"it has: {have}"
        for field in ("trace", "links"):
            value = getattr(link, field)
            if value and not relative_path(self.source.path, value).is_file():
                yield f"link.{field}", f"{value}: no such file", "paths are relative to the campaign file"
        if link.trace and relative_path(self.source.path, link.trace).is_file() and self.lab.links:
            yield from self._trace_problems(s)
        if link.shaped and not chosen and not self.lab.links:
            yield "link", f"{self.lab.path} has no links to shape", "add 'links:' to it, or set link.shaped: false"

    def _trace_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """A trace drives the links between the run's devices and its server: they must exist."""
        from netem.trace import load_trace
        from testbed.links.plans import traced_links

        try:
            trace = load_trace(relative_path(self.source.path, s.link.trace))
            devices = [n.name for n in self.lab.select(list(s.devices))] if set(s.devices) <= self.names else []
            traced_links(self.lab, {d: trace for d in devices})
        except TestbedError as exc:
            yield "link.trace", str(exc), ""

    def _model_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        directory = relative_path(self.source.path, s.model)
        config = directory / "config.json"
        if not config.is_file():
            yield "model", f"{s.model}: no config.json there", "give a Hugging Face checkpoint directory"
            return
        try:
            layers = int(json.loads(config.read_text())["num_hidden_layers"])
        except (ValueError, KeyError, TypeError):
            yield "model", f"{config}: no num_hidden_layers", ""
            return
        check = MethodCheck(s.model, str(directory), layers, s.partition.device_layers, s.partition.stages,
                            str(relative_path(self.source.path, s.draft.adapter)) if s.draft.adapter else None)
        yield from method_named(s.method).problems(check)


    def _external_problems(self, name: str) -> Iterable[tuple[str, str, str]]:
        """An external endpoint must be in the inventory, and its key's variable set on the controller."""
        endpoints = self.lab.spec.endpoints
        if name not in endpoints:
            known = ", ".join(endpoints) or "none"
            yield ("dispatch.external", f"no endpoint {name!r} in the inventory (known: {known})",
                   "add it under endpoints: in the inventory, with its url")  # fmt: skip
            return
        variable = endpoints[name].api_key_env
        if variable and not os.environ.get(variable):
            yield ("dispatch.external", f"endpoint {name!r} takes its key from ${variable}, which is not set",
                   f"export {variable}=... on the controller before testbed run")  # fmt: skip

    def _context_service_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """The service's scale must be derivable (with a target: each device's profile and its disk), and
        the contexts must fit the model's positions."""
        from testbed.context_service import CONTEXT_SLACK_TOKENS, longest_context_bytes, run_scales

        service = s.context_service_or_default
        model_dir = relative_path(self.source.path, s.model)
        if not model_dir.is_dir():
            return  # reported above
        try:
            devices = [n.name for n in self.lab.select(list(s.devices))]
            scales = run_scales(self.lab, self.source.path.parent, s, devices, model_dir)
            positions = _model_positions(model_dir)
            longest = longest_context_bytes(model_dir, service)
        except (TestbedError, InputError, OSError, ValueError) as exc:
            yield "context_service", str(exc), "give every device a compute_profile with a disk in the inventory"
            return
        smallest = min((scale.budget_bytes for scale in scales.values()), default=longest)
        if longest > smallest:  # one context alone must fit (LLMS's budgets hold at least one 4K context)
            need_gb = service.budget_gb * longest / smallest
            yield ("context_service.budget_gb", f"one context of {service.max_context_tokens} tokens needs "
                   f"{need_gb:.3g} GB with {service.memory}, over the budget of {service.budget_gb:g} GB",
                   f"raise budget_gb to {need_gb:.3g} or lower max_context_tokens")  # fmt: skip
        if service.max_context_tokens + CONTEXT_SLACK_TOKENS > positions:
            yield ("context_service.max_context_tokens", f"{service.max_context_tokens} tokens do not fit the "
                   f"model's {positions} positions", f"use at most {positions - CONTEXT_SLACK_TOKENS}")  # fmt: skip

    def _serving_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """The serving engine's budgets must be derivable: the server's profile must hold the target's
        weights (the KV capacity is what is left)."""
        from testbed.campaign.serving_budget import serving_config

        if s.server not in self.names or (s.target is None and not relative_path(self.source.path, s.model).is_dir()):
            return  # reported above
        try:
            serving_config(self.lab, self.source.path.parent, s)
        except (TestbedError, InputError) as exc:
            yield "serving", str(exc), "raise serving.tensor_parallel, or give serving.capacity_tokens"

    def _target_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """The target model must load and split like the run; every run node needs a profile with its mode."""
        from nodes.inference.partition import PartitionError, UShapePartition
        from testbed.target_emulation import load_target_model, paced_names, resolve_target

        target = s.target
        if target is None:
            return
        try:
            model = load_target_model(target.model, self.source.path.parent, target.dtype)
        except TestbedError as exc:
            yield "target.model", str(exc), "name a built-in model or a config.json relative to the campaign file"
            return
        m = 0 if method_named(s.method).token_ids_only else s.partition.device_layers
        try:
            UShapePartition.make(model.layers, m, s.partition.stages)
        except PartitionError as exc:
            yield "target.model", f"{model.name}: {exc}", ""
        names = paced_names(s, s.devices)
        if not all(name in self.names for name in names):
            return  # reported above
        try:
            resolve_target(self.lab, self.source.path.parent, s, list(self.lab.select(names)))
        except (TestbedError, InputError) as exc:
            yield "target", str(exc), "compute profiles live in examples/profiles (testbed/compute_profiles.py)"


def _with_role(lab: Inventory, role: str) -> str:
    return ", ".join(n.name for n in lab.nodes if role in n.roles) or "none has it"


def _model_positions(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
