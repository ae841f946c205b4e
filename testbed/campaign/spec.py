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
from nodes.contracts.catalogues import DEVICE_SPEED_NAMES, DISPATCH_POLICIES, SCHEDULER_NAMES, SERVICE_NAMES
from nodes.contracts.methods import CONTEXT_MEMORY_METHODS, method_named
from nodes.contracts.methods import names as method_names
from nodes.contracts.run_config import DRAFT_LIMITS
from nodes.contracts.run_config import DispatchSettings as RunDispatchSettings
from nodes.contracts.run_config import DraftSettings as RunDraftSettings
from nodes.contracts.run_config import ScalingSettings as RunScalingSettings
from nodes.contracts.run_config import ServingSettings as RunServingSettings
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


def _draft_settings_model() -> type[BaseModel]:
    """HAT's draft model and drafting knobs (methods that draft: sd, sd_pc, sd_pd, hat), as a campaign
    writes them: the fields, defaults and limits of the run contract's DraftSettings, nothing of its own."""
    fields: dict[str, Any] = {}
    for name, default in RunDraftSettings._field_defaults.items():
        if name == "adapter":  # the adapter's directory; default: <model>/draft
            fields[name] = (PlainText | None, default)
            continue
        low, high = DRAFT_LIMITS[name]
        kind = Number if isinstance(default, float) else StrictInt
        fields[name] = (kind, Field(default, ge=low, le=high))
    return create_model("DraftSettings", __base__=_Strict, **fields)


DraftSettings = _draft_settings_model()


class TelemetrySettings(_Strict):
    enabled: StrictBool = True
    interval_ms: StrictInt = Field(100, ge=10, le=60_000)
    jetson_source: Literal[tuple(JETSON_SOURCES)] = "tegrastats"  # type: ignore[valid-type]


class TargetSettings(_Strict):
    """What the emulated testbed stands for (``testbed/target_emulation.py``): the target model, whose
    shape decides step times with each node's compute profile and the bytes of hidden states on the
    wire; ``dilation`` slows every modeled duration, trace and arrival and divides every link rate by
    one factor (analysis divides times back), so that this machine can keep up with a faster target."""

    model: PlainText  # a built-in shape (vicuna-7b, llama-2-13b, opt-66b, ...) or a config.json / checkpoint directory
    dtype: Literal["float16", "bfloat16", "float32", "int8", "q4f16"] | None = None  # default: the model's
    dilation: Number = Field(1.0, ge=1.0, le=1000)
    pad_payloads: StrictBool = True  # hidden states on the wire at the target's width and dtype


_SERVING = RunServingSettings._field_defaults  # the engine's defaults, defined once (nodes/contracts/run_config)


class ServingSettings(_Strict):
    """The serving engine of a streaming method (``serving``): its scheduler (``nodes.serving``) and
    budgets. With a target, the KV capacity is what the server's GPUs hold after the target's weights
    (``tensor_parallel`` x the profile's memory x ``gpu_memory_utilization``), and swaps cross the
    profile's host link; ``capacity_tokens`` overrides it. ``swap_gb``: host memory for swapped KV
    (Andes: 240 GB), None for unbounded; 0 makes every preemption a recompute."""

    scheduler: Literal[SCHEDULER_NAMES] = "fcfs"  # type: ignore[valid-type]
    capacity_tokens: StrictInt | None = Field(None, ge=1, le=10**12)
    swap_gb: Number | None = Field(None, ge=0, le=100_000)
    gpu_memory_utilization: Number = Field(0.9, gt=0, le=1)  # vLLM's default share of GPU memory it takes
    tensor_parallel: StrictInt = Field(_SERVING["tensor_parallel"], ge=1, le=64)
    max_batch: StrictInt = Field(_SERVING["max_batch"], ge=1, le=100_000)
    rr_interval: StrictInt = Field(_SERVING["rr_interval"], ge=1, le=1_000_000)
    watermark: Number = Field(_SERVING["watermark"], gt=0, le=1)
    preemption_cap: Number = Field(_SERVING["preemption_cap"], ge=0, le=1000)
    lookahead_s: Number | None = Field(None, gt=0, le=100_000)
    batch_grid: StrictInt = Field(_SERVING["batch_grid"], ge=1, le=100_000)  # B tried, geometric B_min..B_max
    dp_block_tokens: StrictInt = Field(_SERVING["dp_block_tokens"], ge=1, le=4096)
    latency_context_tokens: StrictInt = Field(_SERVING["latency_context_tokens"], ge=0, le=10**7)
    ignore_eos: StrictBool = _SERVING["ignore_eos"]  # every request makes its max_new_tokens (drawn lengths hold)


_DISPATCH = RunDispatchSettings._field_defaults  # the dispatcher's defaults (nodes/contracts/run_config)


class DispatchSettings(_Strict):
    """DiSCo's dispatch (method ``disco``): the policy and budget b (the constrained endpoint's share of
    input tokens), the service the server's trace endpoint replays, the phone's speed, and migration.
    The per-token prices come from the cost model (the service's API price, the device model's FLOPs at
    the regime's energy-to-money rate: DiSCo App. E); ``regime`` forces the rate (default: the policy's,
    ``server`` for one-endpoint policies)."""

    policy: Literal[DISPATCH_POLICIES] = "disco-s"  # type: ignore[valid-type]
    budget: Number = Field(_DISPATCH["budget"], ge=0, le=1)
    alpha: Number = Field(_DISPATCH["alpha"], gt=0, lt=1)
    service: Literal[SERVICE_NAMES] = "gpt"  # type: ignore[valid-type]
    server_endpoint: Literal["trace", "engine"] = "trace"  # engine: the serving engine (``serving:``) behind the API
    external: Name | None = None  # an inventory endpoint (a lab's vLLM, ...) raced instead of the server's
    device_speed: Literal[DEVICE_SPEED_NAMES] = "pixel7pro-bloom-1.1b"  # type: ignore[valid-type]
    migration: StrictBool = False
    source_keeps_streaming: StrictBool = True
    consumption_tok_s: Number = Field(_DISPATCH["consumption_tok_s"], gt=0, le=1000)
    calibration_requests: StrictInt = Field(_DISPATCH["calibration_requests"], ge=2, le=10_000)
    regime: Literal["server", "device"] | None = None


_SCALING = RunScalingSettings._field_defaults  # the engine's defaults (nodes/contracts/run_config)


class ScalingSettings(_Strict):
    """The GPU ranks of methods ``cocoserve``, ``continuous-batching`` and ``static-batching``: each
    GPU's memory budget (default: the server profile's whole memory, as Transformers uses it), the
    link hidden states cross between GPUs (default: the profile's host link, PCIe on the paper's
    A100s), and CoCoServe's controller: T_up vacancy, T_down SLO violations over ``window_s``, the
    tick period, a cooldown after each action, ``calm_s`` before scaling up after a scale-down, Δbs
    and the migrations of one episode. A request meets its SLO when it ends within ``slo_factor``
    times its time alone on an idle server. The paper gives none of these values: the defaults are
    the brief's."""

    gpu_memory_gb: Number | None = Field(None, gt=0, le=100_000)
    gpu_link_gbps: Number | None = Field(None, gt=0, le=100_000)
    slo_factor: Number = Field(_SCALING["slo_factor"], gt=0, le=1000)
    t_up: Number = Field(_SCALING["t_up"], ge=0, le=1)
    t_down: Number = Field(_SCALING["t_down"], ge=0, le=1)
    period_s: Number = Field(_SCALING["period_s"], gt=0, le=3600)
    cooldown_s: Number = Field(_SCALING["cooldown_s"], ge=0, le=3600)
    calm_s: Number = Field(_SCALING["calm_s"], ge=0, le=3600)
    window_s: Number = Field(_SCALING["window_s"], gt=0, le=3600)
    delta_batch: StrictInt = Field(_SCALING["delta_batch"], ge=1, le=100_000)
    max_migrations: StrictInt = Field(_SCALING["max_migrations"], ge=0, le=1000)


class ContextServiceSettings(_Strict):
    """The on-device LLM service of method ``llms`` (LLMS): which memory method the daemon runs (LLMS, a
    baseline or an ablation), its budget for contexts' chunks (the target device's bytes with a
    ``target``), and the context-switching trace its apps replay (Sec. 4: Poisson calls, time
    compressed to ``mean_gap_s``; contexts grown by Table 3's tasks; Random / Markov / Gaussian)."""

    memory: Literal[CONTEXT_MEMORY_METHODS] = "llms"  # type: ignore[valid-type]  (context_memory.BASELINES)
    budget_gb: Number = Field(1.0, gt=0, le=1024)
    chunk_tokens: StrictInt = Field(16, ge=1, le=4096)
    ratio: Number = Field(0.5, gt=0, le=1)  # the global compression ratio over INT8 (Eq. 2-3)
    contexts: StrictInt = Field(4, ge=1, le=1024)  # N, the active contexts
    pattern: Literal["random", "markov", "gaussian"] = "random"
    calls_per_context: StrictInt = Field(5, ge=1, le=100_000)
    tasks: tuple[Literal["agnews", "xsum", "samsum", "cnndm", "wmt17", "sst2"], ...] = Field((
        "sst2", "samsum", "agnews", "wmt17"), min_length=1, max_length=64)  # fmt: skip
    max_context_tokens: StrictInt = Field(1024, ge=32, le=1 << 20)
    mean_gap_s: Number = Field(0.5, gt=0, le=3600)
    output_share: Number = Field(0.2, ge=0, lt=1)  # of a call's growth, its teacher-forced ground truth
    apps: StrictInt = Field(2, ge=1, le=256)  # client processes; context i belongs to app i mod apps


class RunSettings(_Strict):
    """One run's configuration: what a matrix key may override (``link.profile``, ``power.orin``)."""

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
    draft: DraftSettings = DraftSettings()  # type: ignore[valid-type]
    dtype: Literal["float32", "float16", "bfloat16", "auto"] = "float32"
    threads_per_rank: StrictInt = Field(1, ge=1, le=256)
    drain_s: Number = Field(1.0, ge=0, le=600)  # telemetry kept running after the last token
    target: TargetSettings | None = None  # None: this machine's speed and the real model's bytes
    # requests one device serves at once, each slot a device rank of its own (a request goes to a free
    # slot, else waits for the first to free up): 1 is one user's device, whose requests wait for the
    # one before; HAT's lab serves arrivals at once (a serial device would queue them at its rates)
    device_slots: StrictInt = Field(1, ge=1, le=64)
    serving: ServingSettings | None = None  # a streaming method's engine; None: its defaults
    dispatch: DispatchSettings | None = None  # a dispatching method's policy; None: its defaults
    context_service: ContextServiceSettings | None = None  # a context-serving method's daemon; None: its defaults
    scaling: ScalingSettings | None = None  # a GPU-rank method's budgets and controller; None: their defaults

    @property
    def context_service_or_default(self) -> ContextServiceSettings:
        return self.context_service or ContextServiceSettings()

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in method_names():
            raise ValueError(f"unknown method {name!r}; one of {', '.join(method_names())}")
        return name

    @model_validator(mode="after")
    def _dispatch_for_disco(self) -> RunSettings:
        if self.dispatch is not None and not method_named(self.method).dispatches:
            raise ValueError(f"dispatch: {self.method} does not dispatch between endpoints; use method: disco, "
                             "or remove the dispatch section")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _context_service_for_llms(self) -> RunSettings:
        if self.context_service is not None and not method_named(self.method).serves_contexts:
            raise ValueError(f"context_service: {self.method} does not run the on-device LLM service; use method: "
                             "llms, or remove the context_service section")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _scaling_for_gpu_ranks(self) -> RunSettings:
        if self.scaling is not None and not method_named(self.method).gpu_ranks:
            raise ValueError(f"scaling: {self.method} does not run on the server's GPU ranks; use method: cocoserve, "
                             "continuous-batching or static-batching, or remove the scaling section")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _one_client_a_device(self) -> RunSettings:
        if self.device_slots > 1 and method_named(self.method).streams:
            raise ValueError(f"device_slots: {self.method}'s client keeps every request of its device in flight "
                             "at once; leave device_slots at 1")  # fmt: skip
        return self


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
        """Every node some run uses (server, devices, nodes with power modes)."""
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
