"""Campaign files: a base run configuration, a matrix of overrides x repetitions, seeds and order.

A campaign expands into runs. Each run's id is a content hash of its resolved settings, its
repetition and its seed, so the same file gives the same ids (and, through the seeds, the same
request schedules) every time. Within one repetition every matrix point gets the same workload
seed: methods and settings are compared on identical requests (common random numbers).

Everything is checked before any node is touched: the file's shape (pydantic), every matrix key
against the run settings' fields, and every value against the inventory (nodes, groups, power
modes of emulated boards, link profiles, files, the model's layer count). Problems are reported
together as ``FILE:LINE: field: problem; hint`` (exit status 2).

    name: demo
    inventory: ../../inventory.yaml          # relative to this file
    base:
      method: ushape
      model: ../models/tiny
      partition: {device_layers: 2, stages: 2}
      workload: {arrival: poisson, rate_per_s: 0.5, requests_per_device: 4, max_new_tokens: 16}
      link: {profile: wifi-up}
      power: {devices: MAXN}
    matrix:
      method: [ushape, centralized]
      link.profile: [wifi-up, slow]
    repetitions: 2
    seed: 7
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from foundation.errors import InputError, InputProblem, TestbedError
from foundation.user_files import FieldPath, YamlSource, field_name
from testbed.emulation.resolved import load_lab
from testbed.inventory import Inventory, Name, NodeSpec, pydantic_problem
from workloads.schedule import WorkloadSpec

SPECULATIVE_METHODS = ("sd", "sd_pc", "sd_pd", "hat")  # the methods that draft (HAT Sec. 3.4)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PartitionSettings(_Strict):
    device_layers: StrictInt = Field(1, ge=0, le=1024)  # U-shape's m
    stages: StrictInt = Field(1, ge=1, le=64)  # server pipeline stages (P)


class WorkloadSettings(_Strict):
    """What each device sends: see :class:`workloads.schedule.WorkloadSpec`."""

    arrival: Literal["poisson", "gamma", "constant", "trace"] = "poisson"
    rate_per_s: float | None = Field(1.0, gt=0, le=10_000)
    cv: float | None = Field(None, gt=0, le=100)
    trace: str | None = None
    requests_per_device: StrictInt = Field(8, ge=1, le=100_000)
    prompts: str = "tiny-python"
    max_new_tokens: StrictInt = Field(32, ge=1, le=100_000)
    qoe: Literal["reading", "speaking", "custom"] = "reading"
    expected_ttft_s: float | None = Field(None, gt=0, le=3600)
    expected_tds_tok_s: float | None = Field(None, gt=0, le=10_000)


class LinkSettings(_Strict):
    """How the data plane is shaped for a run: the inventory's links (all fields unset), one
    profile on every link, a bandwidth trace on every device's links, a links file, or not at all."""

    profile: Name | None = None
    trace: str | None = None
    links: str | None = None
    shaped: StrictBool = True
    verify_s: float = Field(0.0, ge=0, le=60)  # iperf3 per direction after shaping; 0 = read back only
    # every shaped rate is multiplied by this: a small model's hidden states are far smaller than the
    # paper's, so scaling the links down keeps communication's share of the latency (HAT: 4096 wide)
    rate_scale: float = Field(1.0, gt=0, le=1000)


class DraftSettings(_Strict):
    """HAT's draft model and drafting knobs (methods sd, sd_pc, sd_pd, hat)."""

    adapter: str | None = None  # the adapter's directory; default: <model>/draft
    eta: float = Field(0.6, ge=0, le=1)  # drafting threshold of Eq. 5
    max_draft_tokens: StrictInt = Field(8, ge=0, le=64)
    top_k: StrictInt = Field(3, ge=0, le=64)  # parallel drafting's candidates
    max_parallel_steps: StrictInt = Field(8, ge=0, le=64)  # cap on lambda_i of Eq. 6


class TelemetrySettings(_Strict):
    enabled: StrictBool = True
    interval_ms: StrictInt = Field(100, ge=10, le=60_000)
    jetson_source: Literal["tegrastats", "jtop"] = "tegrastats"


class RunSettings(_Strict):
    """One run's configuration: what a matrix key may override (``link.profile``, ``power.orin``)."""

    method: Literal["centralized", "ushape", "usarathi", "sd", "pc", "sd_pc", "sd_pd", "hat"] = "ushape"
    model: str = "examples/models/tiny"
    partition: PartitionSettings = PartitionSettings()
    server: Name = "server"
    devices: tuple[Name, ...] = ("devices",)
    workload: WorkloadSettings = WorkloadSettings()
    link: LinkSettings = LinkSettings()
    power: dict[Name, str] = {}  # node or group -> mode, set and read back before the run
    telemetry: TelemetrySettings = TelemetrySettings()
    chunk_tokens: StrictInt = Field(128, ge=1, le=1_000_000)  # usarathi's budget; pc's first chunk
    draft: DraftSettings = DraftSettings()
    dtype: Literal["float32", "float16", "bfloat16", "auto"] = "float32"
    threads_per_rank: StrictInt = Field(1, ge=1, le=256)
    drain_s: float = Field(1.0, ge=0, le=600)  # telemetry kept running after the last token


class FailurePolicy(_Strict):
    on_failure: Literal["continue", "stop"] = "continue"
    quarantine_after: StrictInt = Field(3, ge=1, le=1000)  # failed runs in a row that quarantine a node


class CampaignSpec(_Strict):
    name: Name
    description: str = ""
    inventory: str = "inventory.yaml"
    base: RunSettings = RunSettings()
    matrix: dict[str, list[Any]] = {}
    repetitions: StrictInt = Field(1, ge=1, le=10_000)
    seed: StrictInt = 0
    order: Literal["random", "listed"] = "random"
    run_timeout_s: float = Field(600.0, ge=5, le=86_400)
    failure: FailurePolicy = FailurePolicy()


@dataclass(frozen=True)
class PlannedRun:
    """One run of the expanded campaign."""

    run_id: str
    position: int  # 0-based place in the campaign's (possibly shuffled) order
    repetition: int
    seed: int  # the workload seed (shared by every matrix point of a repetition)
    overrides: tuple[tuple[str, Any], ...]  # matrix key -> value, as written
    settings: RunSettings

    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in self.overrides]
        return ", ".join(parts + [f"rep {self.repetition}"])


@dataclass(frozen=True)
class Campaign:
    path: Path
    spec: CampaignSpec
    inventory: Inventory
    runs: tuple[PlannedRun, ...]

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def resolve(self, relative: str) -> Path:
        """A path written in the campaign, relative to the campaign file."""
        path = Path(relative).expanduser()
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    def digest(self) -> str:
        """Identity of the expansion: the run ids in order (what a resumed campaign must match)."""
        return hashlib.sha256("\n".join(r.run_id for r in self.runs).encode()).hexdigest()[:16]

    def nodes(self) -> tuple[str, ...]:
        """Every node some run uses (server, devices, nodes with power modes)."""
        names: set[str] = set()
        for run in self.runs:
            names.update(n.name for n in run_nodes(self.inventory, run.settings))
        return tuple(n.name for n in self.inventory.nodes if n.name in names)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, stable across Python processes (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


def run_id_of(settings: RunSettings, repetition: int, seed: int) -> str:
    body = json.dumps(
        {"settings": settings.model_dump(mode="json"), "repetition": repetition, "seed": seed}, sort_keys=True
    )
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def run_nodes(inventory: Inventory, settings: RunSettings) -> tuple[NodeSpec, ...]:
    names = [settings.server, *settings.devices, *settings.power]
    return inventory.select(names)


def device_names(inventory: Inventory, settings: RunSettings) -> tuple[str, ...]:
    return tuple(n.name for n in inventory.select(list(settings.devices)))


# --------------------------------------------------------------------------------------------
# Loading


def load_campaign(path: str | Path, *, inventory: str | Path | None = None) -> Campaign:
    """Read, validate and expand a campaign file; every problem at once as :class:`InputError`."""
    source = YamlSource.load(path)
    if not isinstance(source.data, dict):
        raise InputError([source.problem((), "a campaign must be a mapping with 'name' and 'base'", "")])
    try:
        spec = CampaignSpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError([pydantic_problem(source, err) for err in exc.errors()]) from None
    inventory_path = Path(inventory) if inventory is not None else _relative(source.path, spec.inventory)
    if not inventory_path.is_file():
        where = () if inventory is not None else ("inventory",)
        raise InputError([source.problem(where, f"inventory {inventory_path} does not exist",
                                         "give the inventory's path relative to the campaign file")])  # fmt: skip
    lab = load_lab(inventory_path)
    problems = list(_matrix_key_problems(spec, source, lab))
    if problems:
        raise InputError(problems)
    checker = _SettingsChecker(source, lab)
    problems += checker.check(spec.base, ("base",))
    points = list(_matrix_points(spec, source, checker, problems))
    if problems:
        raise InputError(_unique(problems))
    runs = expand(spec, points)
    return Campaign(source.path, spec, lab, runs)


def _relative(campaign: Path, written: str) -> Path:
    path = Path(written).expanduser()
    return path if path.is_absolute() else Path(os.path.normpath(campaign.parent / path))


def _unique(problems: Iterable[InputProblem]) -> list[InputProblem]:
    return list(dict.fromkeys(problems))


MatrixPoint = tuple[tuple[tuple[str, Any], ...], RunSettings]  # (matrix key, value) pairs and the settings


def expand(spec: CampaignSpec, points: Sequence[MatrixPoint]) -> tuple[PlannedRun, ...]:
    """Matrix points x repetitions, ids by content, shuffled by the campaign seed unless ``listed``."""
    runs = []
    for repetition in range(spec.repetitions):
        seed = derive_seed(spec.seed, "repetition", repetition)
        for overrides, settings in points:
            runs.append((overrides, settings, repetition, seed))
    if spec.order == "random":
        random.Random(derive_seed(spec.seed, "order")).shuffle(runs)
    planned = []
    seen: set[str] = set()
    for overrides, settings, repetition, seed in runs:
        run_id = run_id_of(settings, repetition, seed)
        if run_id in seen:
            continue  # two matrix points that resolve to the same settings are one run
        seen.add(run_id)
        planned.append(PlannedRun(run_id, len(planned), repetition, seed, overrides, settings))
    return tuple(planned)


def _matrix_points(
    spec: CampaignSpec, source: YamlSource, checker: _SettingsChecker, problems: list[InputProblem]
) -> Iterable[MatrixPoint]:
    """Every combination of matrix values applied to ``base``; a value that makes invalid settings
    is reported at its own line."""
    keys = list(spec.matrix)
    for key in keys:
        values = spec.matrix[key]
        if not values:
            problems.append(source.problem(("matrix", key), "an empty list of values", "give at least one value"))
        for index, value in enumerate(values):
            settings, errors = _apply(spec.base, [(key, value)], source, ("matrix", key, index))
            problems += errors
            if settings is not None:
                problems += checker.check(settings, ("matrix", key, index), only_under=key)
    if problems:
        return
    for combination in itertools.product(*(spec.matrix[k] for k in keys)):
        overrides = tuple(zip(keys, combination, strict=True))
        settings, errors = _apply(spec.base, list(overrides), source, ("matrix",))
        combo = ", ".join(f"{k}={v}" for k, v in overrides)
        for e in errors:
            problems.append(InputProblem(e.file, e.line, "matrix", f"{combo}: {e.problem}", e.hint))
        if settings is None:
            continue
        for e in checker.check(settings, ("matrix",)):
            problems.append(InputProblem(e.file, e.line, "matrix", f"{combo}: {e.problem}", e.hint))
        yield overrides, settings


def _apply(
    base: RunSettings, overrides: Sequence[tuple[str, Any]], source: YamlSource, at: FieldPath
) -> tuple[RunSettings | None, list[InputProblem]]:
    data = base.model_dump(mode="json")
    for key, value in overrides:
        parts = key.split(".")
        target = data
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = _plain(value)
    try:
        return RunSettings.model_validate(data), []
    except ValidationError as exc:
        out = []
        for err in exc.errors():
            problem = pydantic_problem(source, {**err, "loc": ()})
            field = field_name(tuple(p for p in err["loc"] if isinstance(p, (str, int))))
            out.append(InputProblem(str(source.path), source.line_of(at), field_name(at),
                                    f"{field}: {problem.problem}", problem.hint))  # fmt: skip
        return None, out


def _plain(value: Any) -> Any:
    """ruamel's commented containers as plain dicts and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _matrix_key_problems(spec: CampaignSpec, source: YamlSource, lab: Inventory) -> Iterable[InputProblem]:
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
            if part == "power" and model is RunSettings:
                if depth + 1 < len(parts) and parts[depth + 1] not in names:
                    yield source.problem(("matrix", key), f"{key!r}: {parts[depth + 1]!r} is not a node or group "
                                         f"of {lab.path}", "use power.NODE or power.GROUP")  # fmt: skip
                if len(parts) > depth + 2:
                    yield source.problem(("matrix", key), f"{key!r}: power.NODE takes a mode, not fields", "")
                break
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


class _SettingsChecker:
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
        spec = workload_spec(s)
        for field, message in spec.problems():
            yield f"workload.{field}", message, ""
        for field in ("trace", "prompts"):
            value = getattr(s.workload, field)
            path = value[5:] if field == "prompts" and value and value.startswith("file:") else (
                value if field == "trace" else None)  # fmt: skip
            if path and not _relative(self.source.path, path).is_file():
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
            if value and not _relative(self.source.path, value).is_file():
                yield f"link.{field}", f"{value}: no such file", "paths are relative to the campaign file"
        if link.trace and _relative(self.source.path, link.trace).is_file() and self.lab.links:
            yield from self._trace_problems(s)
        if link.shaped and not chosen and not self.lab.links:
            yield "link", f"{self.lab.path} has no links to shape", "add 'links:' to it, or set link.shaped: false"

    def _trace_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        """A trace drives the links between the run's devices and its server: they must exist."""
        from netem.trace import load_trace
        from testbed.links.plans import traced_links

        try:
            trace = load_trace(_relative(self.source.path, s.link.trace))
            devices = [n.name for n in self.lab.select(list(s.devices))] if set(s.devices) <= self.names else []
            traced_links(self.lab, {d: trace for d in devices})
        except TestbedError as exc:
            yield "link.trace", str(exc), ""

    def _model_problems(self, s: RunSettings) -> Iterable[tuple[str, str, str]]:
        directory = _relative(self.source.path, s.model)
        config = directory / "config.json"
        if not config.is_file():
            yield "model", f"{s.model}: no config.json there", "give a Hugging Face checkpoint directory"
            return
        try:
            layers = int(json.loads(config.read_text())["num_hidden_layers"])
        except (ValueError, KeyError, TypeError):
            yield "model", f"{config}: no num_hidden_layers", ""
            return
        m, stages = s.partition.device_layers, s.partition.stages
        server_layers = layers if s.method == "centralized" else layers - m  # the device runs layers 0..m-1
        if s.method != "centralized" and server_layers < 1:
            yield "partition.device_layers", f"{m} device layers leave the server none of {layers}", \
                f"use at most {layers - 1}"
        elif stages > server_layers:
            yield "partition.stages", f"{stages} stages for {server_layers} server layers", \
                f"use at most {server_layers}"
        if s.method in SPECULATIVE_METHODS:
            yield from self._draft_problems(s, directory)

    def _draft_problems(self, s: RunSettings, model_dir: Path) -> Iterable[tuple[str, str, str]]:
        """A speculative method needs a draft adapter trained on the output of the run's m device layers."""
        field = "draft.adapter" if s.draft.adapter else "method"
        directory = _relative(self.source.path, s.draft.adapter) if s.draft.adapter else model_dir / "draft"
        config = directory / "adapter_config.json"
        m = s.partition.device_layers
        train = f"train one: python scripts/train_draft.py --model {s.model} --device-layers {m}"
        if not config.is_file():
            yield field, f"{s.method} drafts with an adapter, and {directory} has no adapter_config.json", train
            return
        try:
            trained_for = int(json.loads(config.read_text())["device_layers"])
        except (ValueError, KeyError, TypeError):
            yield field, f"{config}: no device_layers", train
            return
        if trained_for != s.partition.device_layers:
            yield "partition.device_layers", (f"the draft adapter in {directory} was trained on {trained_for} device "
                                              f"layers, not {s.partition.device_layers}"), train  # fmt: skip


def _with_role(lab: Inventory, role: str) -> str:
    return ", ".join(n.name for n in lab.nodes if role in n.roles) or "none has it"


def workload_spec(settings: RunSettings) -> WorkloadSpec:
    return WorkloadSpec(**settings.workload.model_dump())
