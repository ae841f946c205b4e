"""Campaign files: a base run configuration, a matrix of overrides x repetitions, seeds and order.

A campaign expands into runs. Each run's id is a content hash of its resolved settings, its
repetition and its seed, so the same file gives the same ids (and, through the seeds, the same
request schedules) every time. Within one repetition every matrix point gets the same workload
seed: methods and settings are compared on identical requests (common random numbers).

This module holds the file's models and the expanded campaign; :mod:`testbed.campaign.load` reads
and checks a file (:mod:`testbed.campaign.validation`) and expands it
(:mod:`testbed.campaign.expansion`). Problems are reported together as
``FILE:LINE: field: problem; hint`` (exit status 2).

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

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    create_model,
    field_validator,
    model_validator,
)

from foundation.user_fields import STRICT_MODEL_CONFIG, Number, PlainText
from nodes.contracts.methods import method_named
from nodes.contracts.methods import names as method_names
from testbed.campaign.families import families, family_named
from testbed.inventory import Inventory, Name, NodeSpec
from testbed.inventory.node_kinds import JETSON_SOURCES
from workloads.schedule import WorkloadSpec


class _Strict(BaseModel):
    model_config = STRICT_MODEL_CONFIG


class PartitionSettings(_Strict):
    device_layers: StrictInt = Field(1, ge=0, le=1024)  # U-shape's m
    stages: StrictInt = Field(1, ge=1, le=64)  # server pipeline stages (P)


StepRate = Annotated[Number, Field(gt=0, le=10_000)]
StepSeconds = Annotated[Number, Field(gt=0, le=86_400)]


class WorkloadSettings(_Strict):
    """What each device sends: see :class:`workloads.schedule.WorkloadSpec`."""

    arrival: Literal["poisson", "gamma", "constant", "trace", "steps"] = "poisson"
    rate_per_s: Number | None = Field(1.0, gt=0, le=10_000)
    cv: Number | None = Field(None, gt=0, le=100)
    trace: PlainText | None = None
    # steps only: [rate_per_s, duration_s] in turn (per device); the last step lasts until every request is in
    rate_steps: list[tuple[StepRate, StepSeconds]] | None = Field(None, max_length=10_000)
    requests_per_device: StrictInt = Field(8, ge=1, le=100_000)
    prompts: PlainText = "tiny-python"
    max_new_tokens: StrictInt = Field(32, ge=1, le=100_000)
    qoe: Literal["reading", "speaking", "custom"] = "reading"
    expected_ttft_s: Number | None = Field(None, gt=0, le=3600)
    expected_tds_tok_s: Number | None = Field(None, gt=0, le=10_000)
    qoe_draw: StrictBool | None = None  # each request's TDS_exp drawn from Andes' Table 1 (reading) or 2 (speaking)
    output_lengths: str | None = None  # max_new_tokens drawn per request: sharegpt | alpaca (at most max_new_tokens)


class LinkSettings(_Strict):
    """How the data plane is shaped for a run: the inventory's links (all fields unset), one
    profile on every link, a bandwidth trace on every device's links, a links file, or not at all."""

    profile: Name | None = None
    trace: PlainText | None = None
    links: PlainText | None = None
    shaped: StrictBool = True
    verify_s: Number = Field(0.0, ge=0, le=60)  # iperf3 per direction after shaping; 0 = read back only
    # every shaped rate is multiplied by this: a small model's hidden states are far smaller than the
    # paper's, so scaling the links down keeps communication's share of the latency (HAT: 4096 wide)
    rate_scale: Number = Field(1.0, gt=0, le=1000)


class TelemetrySettings(_Strict):
    enabled: StrictBool = True
    interval_ms: StrictInt = Field(100, ge=10, le=60_000)
    jetson_source: Literal[tuple(JETSON_SOURCES)] = "tegrastats"  # type: ignore[valid-type]


class TargetSettings(_Strict):
    """What the emulated testbed stands for (``testbed/target/emulation.py``): the target model, whose
    shape decides step times with each node's compute profile and the bytes of hidden states on the
    wire; ``dilation`` slows every modeled duration, trace and arrival and divides every link rate by
    one factor (analysis divides times back), so that this machine can keep up with a faster target."""

    model: PlainText  # a built-in shape (vicuna-7b, llama-2-13b, opt-66b, ...) or a config.json / checkpoint directory
    dtype: Literal["float16", "bfloat16", "float32", "int8", "q4f16"] | None = None  # default: the model's
    dilation: Number = Field(1.0, ge=1.0, le=1000)
    pad_payloads: StrictBool = True  # hidden states on the wire at the target's width and dtype


class _BaseRunSettings(_Strict):
    """One run's configuration: what a matrix key may override (``link.profile``, ``power.orin``). The
    method families' sections (``draft``, ``serving``, ...) are added from their registry below."""

    method: str = "ushape"  # a registered method (nodes/contracts/methods)
    model: PlainText = "examples/models/tiny"
    partition: PartitionSettings = PartitionSettings()
    server: Name = "server"
    devices: tuple[Name, ...] = Field(("devices",), max_length=10_000)
    workload: WorkloadSettings = WorkloadSettings()
    link: LinkSettings = LinkSettings()
    power: dict[Name, PlainText] = {}  # node or group -> mode, set and read back before the run
    telemetry: TelemetrySettings = TelemetrySettings()
    chunk_tokens: StrictInt = Field(128, ge=1, le=1_000_000)  # usarathi's budget; pc's first chunk
    dtype: Literal["float32", "float16", "bfloat16", "auto"] = "float32"
    threads_per_rank: StrictInt = Field(1, ge=1, le=256)
    drain_s: Number = Field(1.0, ge=0, le=600)  # telemetry kept running after the last token
    target: TargetSettings | None = None  # None: this machine's speed and the real model's bytes
    # requests one device serves at once, each slot a device rank of its own (a request goes to a free
    # slot, else waits for the first to free up): 1 is one user's device, whose requests wait for the
    # one before; HAT's lab serves arrivals at once (a serial device would queue them at its rates)
    device_slots: StrictInt = Field(1, ge=1, le=64)

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in method_names():
            raise ValueError(f"unknown method {name!r}; one of {', '.join(method_names())}")
        return name

    @model_validator(mode="after")
    def _sections_for_their_methods(self) -> _BaseRunSettings:
        method = method_named(self.method)
        for family in families():
            if family.refuse_elsewhere and getattr(self, family.section) is not None and not family.applies(method):
                raise ValueError(family.elsewhere(self.method))
        return self

    def section(self, name: str) -> Any:
        """The run's section of method family ``name`` (``families``), or its defaults when not written."""
        return family_named(name).settings_of(self)

    @model_validator(mode="after")
    def _one_client_a_device(self) -> _BaseRunSettings:
        if self.device_slots > 1 and method_named(self.method).streams:
            raise ValueError(f"device_slots: {self.method}'s client keeps every request of its device in flight "
                             "at once; leave device_slots at 1")  # fmt: skip
        return self


def _run_settings_model() -> type[_BaseRunSettings]:
    """RunSettings: the base fields, and one field per method family holding its section (None: the
    family's defaults; a family whose section is always written defaults to its settings)."""
    fields: dict[str, Any] = {}
    for family in families():
        model = family.settings_model
        fields[family.section] = (model, model()) if family.default_written else (model | None, None)
    return create_model("RunSettings", __base__=_BaseRunSettings, __doc__=_BaseRunSettings.__doc__,
                        __module__=__name__, **fields)  # fmt: skip


RunSettings = _run_settings_model()
MAX_RUNS = 10_000  # matrix points x repetitions a campaign may expand to (the largest example has 108)
MAX_MATRIX_VALUES = 1000  # values of one matrix key


class FailurePolicy(_Strict):
    on_failure: Literal["continue", "stop"] = "continue"
    quarantine_after: StrictInt = Field(3, ge=1, le=1000)  # failed runs in a row that quarantine a node


class CampaignSpec(_Strict):
    name: Name
    description: Annotated[str, Field(max_length=10_000)] = ""
    inventory: PlainText = "inventory.yaml"
    base: RunSettings = RunSettings()
    matrix: dict[PlainText, Annotated[list[Any], Field(max_length=MAX_MATRIX_VALUES)]] = Field({}, max_length=64)
    repetitions: StrictInt = Field(1, ge=1, le=10_000)
    seed: StrictInt = Field(0, ge=0, le=2**63 - 1)  # a 64-bit seed (every derived seed is one too)
    # random: shuffled by the seed, then runs that one warm worker pool can serve (same server, devices
    # and stages) and that load the same model parts made adjacent; listed: as the matrix lists them
    order: Literal["random", "listed"] = "random"
    # a run starts where the one before left off: the same warm worker pool when the shape is the same,
    # and the power modes and shaping it will set again still in place (false: every run starts cold,
    # with new ranks, and configures and restores the nodes on its own)
    warm_runs: StrictBool = True
    run_timeout_s: Number = Field(600.0, ge=5, le=86_400)
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
        """Every node some run uses (server, devices, nodes with power modes), worked out once: all the
        campaign touches (a run shapes only links between its own nodes), leases and may restore."""
        return self._nodes

    @functools.cached_property
    def _nodes(self) -> tuple[str, ...]:
        names: set[str] = set()
        for run in self.runs:
            names.update(n.name for n in run_nodes(self.inventory, run.settings))
        return tuple(n.name for n in self.inventory.nodes if n.name in names)


def run_nodes(inventory: Inventory, settings: RunSettings) -> tuple[NodeSpec, ...]:
    names = [settings.server, *settings.devices, *settings.power]
    return inventory.select(names)


POOL_SHAPE = 4  # worker_shape's entries that decide which ranks a pool has


def worker_shape(settings: RunSettings) -> tuple[Any, ...]:
    """What one warm worker pool serves (server, devices, pipeline stages, device slots: its first
    :data:`POOL_SHAPE` entries), then what decides the model parts its ranks hold (method family,
    model, partition, dtype): runs alike in all of it reuse everything a pool has loaded."""
    from nodes.contracts.methods import method_named

    return (settings.server, settings.devices, settings.partition.stages, settings.device_slots,
            method_named(settings.method).token_ids_only, settings.model, settings.partition.device_layers,
            settings.dtype)  # fmt: skip


def device_names(inventory: Inventory, settings: RunSettings) -> tuple[str, ...]:
    return tuple(n.name for n in inventory.select(list(settings.devices)))


def workload_spec(settings: RunSettings) -> WorkloadSpec:
    return WorkloadSpec(**settings.workload.model_dump())
