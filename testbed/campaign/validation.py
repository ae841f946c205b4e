"""Checks of a campaign against its inventory and the files it names, before any node is touched:
every matrix key against the run settings' fields, and every run's settings against the nodes, their
roles, groups, power modes of emulated boards, link profiles, traces, files and the model's layers.
Each problem is ``FILE:LINE: field: problem; hint``.
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel

from foundation import units
from foundation.errors import InputError, InputProblem, TestbedError
from foundation.user_files import FieldPath, YamlSource, field_name
from netem.profile import MAX_DELAY_S, MAX_RATE_BIT_S, MIN_RATE_BIT_S
from nodes.contracts.methods import MethodCheck, method_named
from testbed.campaign.families import FamilyContext, families
from testbed.campaign.spec import CampaignSpec, RunSettings, workload_spec
from testbed.inventory import DirectedLink, Inventory, links_from_file
from testbed.inventory.node_kinds import kind_of
from testbed.models.packaged import missing_hint


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
        elif not kind_of(server).runs_ranks:
            yield "server", f"{s.server} (kind {server.kind}) runs no MPI ranks", \
                "the server stages need a Linux node"
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
                if not kind_of(node).runs_ranks:
                    yield "devices", f"{node.name} (kind {node.kind}) runs no MPI ranks", \
                        "choose nodes reached over SSH (Jetsons, servers)"
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
                if node.emulated is not None and node.emulated.power_modes:  # it models only these
                    offered = [(str(m.id), m.name) for m in node.emulated.power_modes]
                    if not any(mode in pair or mode.lower() == pair[1].lower() for pair in offered):
                        listing = ", ".join(f"{i} {n}" for i, n in offered)
                        yield f"power.{name}", f"{node.name} has no power mode {mode!r}", f"it has: {listing}"
                        break
                elif (problem := kind_of(node).power_modes.problem(node.kind, mode)) is not None:
                    yield f"power.{name}", f"{node.name}: {problem}", "the node's power tool takes nothing else"
                    break
        yield from self._link_problems(s)
        yield from self._model_problems(s)
        if s.target is not None:
            yield from self._target_problems(s)
        context = FamilyContext(self.lab, self.source.path.parent)
        for family in families():
            yield from family.problems(context, s)
        spec = workload_spec(s)
        for field, message in spec.problems():
            yield f"workload.{field}", message, ""
        if not method_named(s.method).serves_contexts:
            yield from self._workload_file_problems(s)
        for field in ("trace", "prompts"):
            value = getattr(s.workload, field)
            path = value[5:] if field == "prompts" and value and value.startswith("file:") else (
                value if field == "trace" else None)  # fmt: skip
            if path and not relative_path(self.source.path, path).is_file():
                yield f"workload.{field}", f"{path}: no such file", "paths are relative to the campaign file"

    def _workload_file_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """A prompt file and an arrival trace are read now, not when the run's schedules are built."""
        from workloads.arrivals import TraceArrivals, trace_rows_for
        from workloads.prompts import FILE_PREFIX, load_prompt_file

        if s.workload.prompts.startswith(FILE_PREFIX):
            path = relative_path(self.source.path, s.workload.prompts[len(FILE_PREFIX) :])
            if path.is_file():
                try:
                    load_prompt_file(path)
                except TestbedError as exc:
                    yield "workload.prompts", str(exc), "fix the prompt file"
        if s.workload.arrival == "trace" and s.workload.trace:
            path = relative_path(self.source.path, s.workload.trace)
            if path.is_file() and set(s.devices) <= self.names:
                try:
                    for device in [n.name for n in self.lab.select(list(s.devices))]:
                        trace_rows_for(TraceArrivals(path, device), count=s.workload.requests_per_device)
                except TestbedError as exc:
                    yield "workload.trace", str(exc), "fix the arrival trace, or ask for fewer requests"

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
        if link.links and relative_path(self.source.path, link.links).is_file():
            yield from self._links_file_problems(s)
        if link.profile and link.profile in self.lab.spec.link_profiles:
            profile = self.lab.spec.link_profiles[link.profile]
            yield from _scaled_rate_problems(s, [(f"link profile {link.profile}", profile.rate_bit_s,
                                                  max(profile.delay_s or 0, profile.jitter_s or 0))])
        elif not chosen:
            yield from _scaled_rate_problems(s, _profile_rates(self.lab.links))
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
            return
        rates = [(f"{trace.source}, the row at {step.t_s:g} s", rate, step.delay_s) for step in trace.steps
                 for rate in (step.up_bit_s, step.down_bit_s)]  # fmt: skip
        yield from _scaled_rate_problems(s, rates)

    def _links_file_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """A links file is checked against the inventory now, not when the run is planned."""
        try:
            links = links_from_file(self.lab, relative_path(self.source.path, s.link.links))
        except TestbedError as exc:
            yield "link.links", str(exc), "fix the links file"
            return
        yield from _scaled_rate_problems(s, _profile_rates(links))

    def _model_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        directory = relative_path(self.source.path, s.model)
        config = directory / "config.json"
        if not config.is_file():
            yield "model", f"{s.model}: no config.json there", missing_hint(directory)
            return
        try:
            layers = int(json.loads(config.read_text())["num_hidden_layers"])
        except (ValueError, KeyError, TypeError):
            yield "model", f"{config}: no num_hidden_layers", ""
            return
        check = MethodCheck(s.model, str(directory), layers, s.partition.device_layers, s.partition.stages,
                            str(relative_path(self.source.path, s.draft.adapter)) if s.draft.adapter else None)
        yield from method_named(s.method).problems(check)


    def _target_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """The target model must load and split like the run; every run node needs a profile with its mode."""
        from nodes.inference.partition import PartitionError, UShapePartition
        from testbed.target.emulation import load_target_model, paced_names, resolve_target

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
            yield "target", str(exc), "compute profiles live in examples/profiles (testbed/target/compute_profiles.py)"


def unused_setting_problems(spec: CampaignSpec, source: YamlSource, runs: Sequence[RunSettings]) -> list[InputProblem]:
    """Settings written in the campaign (in ``base`` or as a matrix key) that no run uses: each ignored by
    the run's method, or made meaningless by another setting of its section (:func:`ignored_settings`)."""
    ignored = [ignored_settings(run) for run in runs]

    def why_unused(dotted: str) -> str | None:
        reasons = []
        for by_run in ignored:
            reason = next((why for path, why in by_run.items() if dotted == path or dotted.startswith(path + ".")),
                          None)  # fmt: skip
            if reason is None:
                return None
            reasons.append(reason)
        return reasons[0] if reasons else None

    problems: list[InputProblem] = []
    refused: list[str] = []
    written = [("base", *path) for path in _written(spec.base)] + [("matrix", key) for key in spec.matrix]
    for at in written:
        dotted = ".".join(str(p) for p in at[1:])
        if any(dotted.startswith(r + ".") for r in refused):
            continue  # its section is refused already
        why = why_unused(dotted)
        if why is not None:
            refused.append(dotted)
            problems.append(source.problem(at, f"no run of the campaign uses it: {why}",
                                           "remove it, or add a run that uses it"))  # fmt: skip
    return problems


def _written(settings: BaseModel, prefix: tuple[str, ...] = ()) -> Iterable[tuple[str, ...]]:
    """The fields of ``settings`` written in the file (not defaults), sections before their fields."""
    for name in type(settings).model_fields:
        if name in settings.model_fields_set:
            yield (*prefix, name)
            value = getattr(settings, name)
            if isinstance(value, BaseModel):
                yield from _written(value, (*prefix, name))


def ignored_settings(s: RunSettings) -> dict[str, str]:
    """The settings (dotted paths) run ``s`` does not use, each with the reason."""
    m, out = method_named(s.method), {}
    if m.prefill not in ("device_chunks", "server_chunks"):
        out["chunk_tokens"] = f"{s.method} does not prefill in chunks"
    for family in families():
        out.update(family.ignored(s))
    if not s.link.shaped:
        out.update({f"link.{name}": "link.shaped is false" for name in ("profile", "trace", "links", "verify_s",
                                                                        "rate_scale")})  # fmt: skip
    if not s.telemetry.enabled:
        out.update({f"telemetry.{name}": "telemetry.enabled is false" for name in ("interval_ms", "jetson_source")})
    if s.workload.arrival in ("trace", "steps"):
        out["workload.rate_per_s"] = f"{s.workload.arrival} arrivals take their rates from the " + \
            ("trace" if s.workload.arrival == "trace" else "rate_steps")
    return out


Scaled = tuple[str, float | None, float | None]  # what, its rate (bit/s), its longest delay or jitter (s)


def _profile_rates(links: Iterable[DirectedLink]) -> list[Scaled]:
    return [(f"link profile {link.profile_name}", link.profile.rate_bit_s,
             max(link.profile.delay_s or 0, link.profile.jitter_s or 0)) for link in links]  # fmt: skip


def _scaled_rate_problems(s: RunSettings, rates: Iterable[Scaled]) -> Iterable[tuple[str, str, str]]:
    """Every rate the run shapes, times ``link.rate_scale`` and divided by the target's dilation, and every
    delay, times the dilation, must lie where a link profile's may: the scaled links are built without
    the profile's bounds."""
    dilation = s.target.dilation if s.target is not None else 1.0
    scale = s.link.rate_scale / dilation
    for what, _rate, delay_s in rates:
        if delay_s and delay_s * dilation > MAX_DELAY_S:
            yield ("target.dilation", f"{what}: a delay of {units.format_duration(delay_s)} x {dilation:g} is "
                   f"{units.format_duration(delay_s * dilation)}, longer than a link's {MAX_DELAY_S:g} s",
                   "a smaller dilation, or shorter delays")  # fmt: skip
            break
    if scale == 1.0:
        return
    field = "link.rate_scale" if s.link.rate_scale != 1.0 else "target.dilation"
    for what, rate, _delay_s in rates:
        if rate is None:
            continue
        scaled = rate * scale
        if not MIN_RATE_BIT_S <= scaled <= MAX_RATE_BIT_S:
            bound = (f"below a link's floor of {units.format_rate(MIN_RATE_BIT_S)}" if scaled < MIN_RATE_BIT_S
                     else f"above a link's ceiling of {units.format_rate(MAX_RATE_BIT_S)}")  # fmt: skip
            yield (field, f"{what}: {units.format_rate(rate)} x {scale:g} is {units.format_rate(scaled)}, {bound}",
                   "scale the rates less, or shape faster links")  # fmt: skip
            return


def _with_role(lab: Inventory, role: str) -> str:
    return ", ".join(n.name for n in lab.nodes if role in n.roles) or "none has it"


