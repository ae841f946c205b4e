"""The run config every rank reads: method, model, partition, and one entry per MPI rank.

JSON written by the controller (or a test). Ranks are ordered: the P server stages first (rank
0 = stage 0), then the devices. Paths are as seen on the node that runs the rank.

    {"run_id": "r1", "method": "ushape", "model": "/path/to/checkpoint", "dtype": "float32",
     "partition": {"device_layers": 2, "stages": 2}, "chunk_tokens": 128, "out_dir": "/path/out",
     "ranks": [{"role": "stage", "node": "server"}, {"role": "stage", "node": "server"},
               {"role": "device", "node": "orin", "schedule": "/path/orin.jsonl"}]}

Schedules are JSON lines: ``{"request_id": 3, "arrival_s": 0.5, "prompt": "...",
"max_new_tokens": 32}`` (or ``prompt_ids`` instead of ``prompt``); ``arrival_s`` counts from the
run's start barrier.
"""

import json
import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from nodes.contracts.catalogues import DISPATCH_POLICIES, ENGINE_SCHEDULER_NAMES
from nodes.contracts.compute_profile import ModeRates, rates_from_json
from nodes.contracts.methods import Method, method_named, names
from nodes.contracts.rank_dirs import RankDir
from nodes.contracts.scheduler_settings import SchedulerSettings
from nodes.contracts.target_model import TargetModel, TargetModelError
from nodes.contracts.target_model import from_json as target_from_json


class RunConfigError(ValueError):
    pass


class RankSpec(NamedTuple):
    role: str  # stage | device
    node: str
    index: int  # stage index or device index
    torch_device: str = "cpu"
    threads: Optional[int] = None
    schedule: Optional[str] = None
    profile: Optional[ModeRates] = None  # the node's compute profile in its power mode: steps are paced


class TargetSettings(NamedTuple):
    """What the emulated testbed stands for: the target model's shape decides step times (with each
    rank's profile) and the bytes of hidden states on the wire; ``dilation`` stretches every modeled
    duration."""

    model: TargetModel
    dilation: float = 1.0
    pad_payloads: bool = True  # hidden states on the wire at the target's width and dtype


class DraftSettings(NamedTuple):
    """The draft model and HAT's drafting knobs (Sec. 3.4-3.5)."""

    adapter: Optional[str] = None  # directory of the adapter; default <model>/draft
    eta: float = 0.6  # drafting threshold of Eq. 5
    max_draft_tokens: int = 8
    top_k: int = 3  # parallel drafting's candidates
    max_parallel_steps: int = 8  # cap on lambda_i of Eq. 6


class ServingSettings(NamedTuple):
    """The serving engine of a streaming method (``methods/serving.py``): its scheduler and budgets.
    The controller derives the KV and swap budgets from the server's profile and the target model;
    None is unbounded (the tiny model's own KV, as far as this machine's memory goes)."""

    scheduler: str = "fcfs"  # fcfs | rr | andes | andes-dp (nodes.serving.schedulers)
    capacity_tokens: Optional[int] = None  # M: KV tokens in GPU memory
    swap_tokens: Optional[int] = None  # KV tokens host memory holds for swapped requests
    host_link_gbps: Optional[float] = None  # GPU <-> host copies (swap), GB/s; None: swaps cost nothing
    max_batch: int = 256  # requests one iteration carries at most (vLLM's max_num_seqs)
    tensor_parallel: int = 1  # GPUs the engine stands for: the profile's per-GPU rates times this
    rr_interval: int = SchedulerSettings.rr_interval  # the scheduler's knobs (nodes.serving.schedulers)
    watermark: float = SchedulerSettings.watermark
    preemption_cap: float = SchedulerSettings.preemption_cap
    lookahead_s: Optional[float] = None  # Andes' delta t; None: the mean completion time so far
    batch_grid: int = SchedulerSettings.batch_grid
    dp_block_tokens: int = SchedulerSettings.dp_block_tokens
    latency_context_tokens: int = 512  # the context latency(B) is tabulated at (Andes App. B: B decides)
    ignore_eos: bool = False  # generate every request's max_new_tokens, as vLLM's benchmarks do


class ScalingSettings(NamedTuple):
    """CoCoServe's module scaling (``methods/cocoserve.py``): each GPU rank's memory budget, the link
    between GPU ranks, and the controller's thresholds (``nodes.scaling.controller``). Bytes and
    seconds are the target's when the run has one: ``layer_bytes`` is what one real decoder layer
    stands for (its share of the target's layers), ``kv_bytes_per_token_layer`` likewise."""

    gpu_memory_bytes: Optional[int] = None  # each GPU rank's budget (weights + KV); None: unbounded
    fixed_bytes: int = 0  # the instance's GPU holds this besides layers and KV (embedding, head, activations)
    layer_bytes: int = 0  # one layer copy's weights as the budget counts them; 0: the real layer's
    kv_bytes_per_token_layer: int = 0  # one token's KV in one layer as counted; 0: the real model's
    gpu_link_gbps: Optional[float] = None  # hidden states between GPU ranks (scatter, gather); None: free
    slo_factor: float = 5.0  # a request meets its SLO when it ends within this times its unloaded time
    t_up: float = 0.2
    t_down: float = 0.05
    period_s: float = 2.0
    cooldown_s: float = 10.0
    calm_s: float = 30.0
    window_s: float = 10.0  # the monitor's window for utilisation and SLO violations
    delta_batch: int = 5
    max_migrations: int = 4


class DispatchSettings(NamedTuple):
    """DiSCo's dispatch (``methods/disco.py``): the policy and budget the device dispatches with, the
    server it races (a trace endpoint replaying ``service`` on the server node), its own speed,
    migration, and the per-token prices (USD: server input, server output, device prefill, device
    decode) that Algorithm 1 and Eq. 4 weigh; the controller fills them from the cost model."""

    policy: str = "disco-s"  # one of nodes.contracts.catalogues.DISPATCH_POLICIES
    budget: float = 0.5  # b: the constrained endpoint's share of input tokens
    alpha: float = 0.01  # DiSCo-D's tail ratio
    service: str = "gpt"  # the trace endpoint's service (nodes.endpoints.services)
    server_endpoint: str = "trace"  # trace: the service's times replayed; engine: the serving engine
    device_speed: str = "pixel7pro-bloom-1.1b"  # nodes.endpoints.device_speed
    migration: bool = False
    source_keeps_streaming: bool = True
    consumption_tok_s: float = 4.8  # r_c: the client buffer's pace
    calibration_requests: int = 40  # per endpoint, before the schedule (profiles F and T_d)
    prices: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    external_url: Optional[str] = None  # a lab's OpenAI-compatible server, raced instead of ours
    external_model: str = "default"
    external_key_file: Optional[str] = None  # on the device node, 0600, written at staging, read once
    # the run's own key, asked by every endpoint the run starts (the server's and each device's): a
    # 0600 file in the node's run directory, fresh for each run, written at staging; None: no key
    endpoint_key_file: Optional[str] = None


# The one definition of the drafting knobs' ranges: campaign files are checked against them
# (testbed/campaign/spec.py builds its model from DraftSettings and these), run configs too.
DRAFT_LIMITS = {"eta": (0.0, 1.0), "max_draft_tokens": (0, 64), "top_k": (0, 64), "max_parallel_steps": (0, 64)}


class RunConfig(NamedTuple):
    run_id: str
    method: str
    model: str
    dtype: str
    device_layers: int
    stages: int
    chunk_tokens: int
    out_dir: str
    ranks: Tuple[RankSpec, ...]
    seed: int = 0
    draft: DraftSettings = DraftSettings()
    # a rank still in the run this long after the start barrier ends it (a hung run in a warm pool
    # must not outlive its run's timeout); None: no limit
    deadline_s: Optional[float] = None
    target: Optional[TargetSettings] = None
    serving: ServingSettings = ServingSettings()
    dispatch: DispatchSettings = DispatchSettings()
    scaling: ScalingSettings = ScalingSettings()

    @property
    def method_spec(self) -> Method:
        """The registered method (:mod:`nodes.contracts.methods`): the behaviours the workers compose."""
        return method_named(self.method)

    def uses(self, feature: str) -> bool:
        """Whether the method has HAT's ``sd``, ``pc`` or ``pd``."""
        return self.method_spec.uses(feature)

    @property
    def server_state_in_replies(self) -> bool:
        """HAT's methods size chunks and parallel drafts from the server's state (Eq. 3, Eq. 6)."""
        return self.method_spec.server_state_in_replies

    @property
    def device_ranks(self) -> List[int]:
        return [r for r, spec in enumerate(self.ranks) if spec.role == "device"]

    @property
    def server_device_layers(self) -> int:
        """m as the server sees it: 0 when the device sends token ids (the server runs every layer)."""
        return 0 if self.method_spec.token_ids_only else self.device_layers

    @property
    def wire_bytes_per_token(self) -> Optional[int]:
        """One token's hidden state on the wire when payloads are padded to the target's (else None)."""
        if self.target is None or not self.target.pad_payloads:
            return None
        return self.target.model.hidden_bytes_per_token

    def to_json(self) -> Dict[str, Any]:
        """The run config file's JSON, as :func:`parse` reads it back (``parse(c.to_json()) == c``):
        the controller builds a RunConfig and writes this, never a hand-made dict."""
        ranks = []
        for spec in self.ranks:
            entry = {"role": spec.role, "node": spec.node, "torch_device": spec.torch_device}  # type: Dict[str, Any]
            if spec.threads is not None:
                entry["threads"] = spec.threads
            if spec.schedule is not None:
                entry["schedule"] = spec.schedule
            if spec.profile is not None:
                entry["profile"] = spec.profile.to_json()
            ranks.append(entry)
        return {
            "run_id": self.run_id, "method": self.method, "model": self.model, "dtype": self.dtype,
            "partition": {"device_layers": self.device_layers, "stages": self.stages},
            "chunk_tokens": self.chunk_tokens, "out_dir": self.out_dir, "ranks": ranks, "seed": self.seed,
            "draft": self.draft._asdict(), "deadline_s": self.deadline_s,
            "target": None if self.target is None else {
                "model": self.target.model.to_json(), "dilation": self.target.dilation,
                "pad_payloads": self.target.pad_payloads},
            "serving": self.serving._asdict(),
            "dispatch": dict(self.dispatch._asdict(), prices=list(self.dispatch.prices)),
            "scaling": self.scaling._asdict(),
        }  # fmt: skip

    def rank_dir(self, rank: int) -> str:
        spec = self.ranks[rank]
        return os.path.join(self.out_dir, RankDir(spec.role, spec.index, spec.node).name)


def load(path: str) -> RunConfig:
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, ValueError) as error:
        raise RunConfigError("%s: cannot read the run config (%s)" % (path, error)) from None
    return parse(raw, path)


def parse(raw: Dict[str, Any], source: str = "run config") -> RunConfig:
    """Validate a run config; every problem is a RunConfigError naming ``source`` and the field."""
    try:
        return _parse(raw, source)
    except RunConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as error:
        raise RunConfigError("%s: malformed run config (%s)" % (source, error)) from None


def _parse(raw: Dict[str, Any], source: str) -> RunConfig:
    def need(name: str, kind: type) -> Any:
        if name not in raw:
            raise RunConfigError("%s: field %r is missing" % (source, name))
        if not isinstance(raw[name], kind):
            raise RunConfigError("%s: field %r must be %s" % (source, name, kind.__name__))
        return raw[name]

    method = need("method", str)
    if method not in names():
        raise RunConfigError("%s: field 'method' is %r; choose one of %s" % (source, method, ", ".join(names())))
    partition = need("partition", dict)
    stages = int(partition.get("stages", 1))
    device_layers = int(partition.get("device_layers", 0))
    ranks: List[RankSpec] = []
    counters = {"stage": 0, "device": 0}
    for position, entry in enumerate(need("ranks", list)):
        role = entry.get("role")
        if role not in counters:
            raise RunConfigError("%s: ranks[%d].role must be 'stage' or 'device'" % (source, position))
        if role == "stage" and counters["device"]:
            raise RunConfigError("%s: ranks[%d]: server stages come before devices" % (source, position))
        if role == "device" and not entry.get("schedule"):
            raise RunConfigError("%s: ranks[%d].schedule is missing (a device replays a schedule)" % (source, position))
        ranks.append(
            RankSpec(
                role=role,
                node=str(entry.get("node", "%s%d" % (role, counters[role]))),
                index=counters[role],
                torch_device=str(entry.get("torch_device", "cpu")),
                threads=entry.get("threads"),
                schedule=entry.get("schedule"),
                profile=_profile(entry.get("profile"), "%s: ranks[%d].profile" % (source, position)),
            )
        )
        counters[role] += 1
    if counters["stage"] != stages:
        raise RunConfigError(
            "%s: partition.stages is %d but %d stage ranks are listed" % (source, stages, counters["stage"])
        )
    if not counters["device"]:
        raise RunConfigError("%s: no device ranks" % source)
    if not method_named(method).token_ids_only and device_layers < 0:
        raise RunConfigError("%s: partition.device_layers must be >= 0" % source)
    chunk = int(raw.get("chunk_tokens", 128))
    if chunk < 1:
        raise RunConfigError("%s: field 'chunk_tokens' must be >= 1" % source)
    draft_raw = raw.get("draft") or {}
    if not isinstance(draft_raw, dict):
        raise RunConfigError("%s: field 'draft' must be a mapping" % source)
    unknown = sorted(set(draft_raw) - set(DraftSettings._fields))
    if unknown:
        raise RunConfigError(
            "%s: draft.%s is not a field; known: %s" % (source, unknown[0], ", ".join(DraftSettings._fields))
        )
    for name in ("eta", "max_draft_tokens", "top_k", "max_parallel_steps"):
        value = draft_raw.get(name, DraftSettings._field_defaults[name])
        kinds = (int, float) if name == "eta" else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "a number" if name == "eta" else "an integer"
            raise RunConfigError("%s: draft.%s must be %s, not %r" % (source, name, kind, value))
    draft = DraftSettings(**dict(draft_raw, eta=float(draft_raw.get("eta", DraftSettings._field_defaults["eta"]))))
    low, high = DRAFT_LIMITS["eta"]
    if not low <= draft.eta <= high:
        raise RunConfigError("%s: draft.eta must lie in [%g, %g]" % (source, low, high))
    if draft.max_draft_tokens < 0 or draft.top_k < 0 or draft.max_parallel_steps < 0:
        raise RunConfigError("%s: draft.max_draft_tokens, top_k and max_parallel_steps must be >= 0" % source)
    for name in ("max_draft_tokens", "top_k", "max_parallel_steps"):
        if getattr(draft, name) > DRAFT_LIMITS[name][1]:
            raise RunConfigError("%s: draft.%s must be at most %d" % (source, name, DRAFT_LIMITS[name][1]))
    deadline = raw.get("deadline_s")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0):
        raise RunConfigError("%s: field 'deadline_s' must be a positive number of seconds" % source)
    return RunConfig(
        run_id=str(raw.get("run_id", "run")),
        method=method,
        model=os.path.expanduser(need("model", str)),
        dtype=str(raw.get("dtype", "float32")),
        device_layers=device_layers,
        stages=stages,
        chunk_tokens=chunk,
        out_dir=os.path.expanduser(need("out_dir", str)),
        ranks=tuple(ranks),
        seed=int(raw.get("seed", 0)),
        draft=draft,
        deadline_s=None if deadline is None else float(deadline),
        target=_target(raw.get("target"), source),
        serving=_serving(raw.get("serving"), source),
        dispatch=dispatch_settings(raw.get("dispatch"), source),
        scaling=scaling_settings(raw.get("scaling"), source),
    )


def _section(raw: Any, source: str, name: str, kind: Any) -> Any:
    """Section ``name`` as a ``kind`` (its defaults when absent), once checked to be a mapping of its fields."""
    if raw is None:
        return kind()
    if not isinstance(raw, dict):
        raise RunConfigError("%s: field '%s' must be a mapping" % (source, name))
    unknown = sorted(set(raw) - set(kind._fields))
    if unknown:
        known = ", ".join(kind._fields)
        raise RunConfigError("%s: %s.%s is not a field; known: %s" % (source, name, unknown[0], known))
    if name == "dispatch":  # a JSON list in the file, a tuple in the settings
        raw = dict(raw, prices=tuple(raw.get("prices") or kind().prices))
    return kind(**raw)


def scaling_settings(raw: Any, source: str) -> ScalingSettings:
    """The ``scaling`` section checked: known fields, numbers >= 0, thresholds within [0, 1]."""
    settings = _section(raw, source, "scaling", ScalingSettings)  # type: ScalingSettings
    for name, value in settings._asdict().items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise RunConfigError("%s: scaling.%s must be a number >= 0, not %r" % (source, name, value))
    if settings.t_up > 1 or settings.t_down > 1 or settings.delta_batch < 1 or settings.period_s <= 0:
        raise RunConfigError("%s: scaling.t_up and t_down lie in [0, 1], delta_batch >= 1, period_s > 0" % source)
    return settings


def dispatch_settings(raw: Any, source: str) -> DispatchSettings:
    """The ``dispatch`` section checked (``source`` names where it came from in messages)."""
    settings = _section(raw, source, "dispatch", DispatchSettings)  # type: DispatchSettings
    if settings.server_endpoint not in ("trace", "engine"):
        raise RunConfigError("%s: dispatch.server_endpoint is %r; choose trace or engine"
                             % (source, settings.server_endpoint))  # fmt: skip
    if settings.policy not in DISPATCH_POLICIES:
        raise RunConfigError("%s: dispatch.policy is %r; choose one of %s"
                             % (source, settings.policy, ", ".join(DISPATCH_POLICIES)))  # fmt: skip
    if not 0 <= settings.budget <= 1 or not 0 < settings.alpha < 1:
        raise RunConfigError("%s: dispatch.budget must lie in [0, 1] and dispatch.alpha in (0, 1)" % source)
    if len(settings.prices) != 4 or any(p < 0 for p in settings.prices):
        raise RunConfigError("%s: dispatch.prices are four USD-per-token figures >= 0" % source)
    if settings.consumption_tok_s <= 0 or settings.calibration_requests < 2:
        raise RunConfigError("%s: dispatch.consumption_tok_s must be > 0 and calibration_requests >= 2" % source)
    for name in ("external_key_file", "endpoint_key_file"):  # paths to keys, never keys
        value = getattr(settings, name)
        if value is not None and not (isinstance(value, str) and value):
            raise RunConfigError("%s: dispatch.%s must be the path of a key file" % (source, name))
    return settings


def _serving(raw: Any, source: str) -> ServingSettings:
    settings = _section(raw, source, "serving", ServingSettings)  # type: ServingSettings
    if settings.scheduler not in ENGINE_SCHEDULER_NAMES:
        raise RunConfigError("%s: serving.scheduler is %r; choose one of %s"
                             % (source, settings.scheduler, ", ".join(ENGINE_SCHEDULER_NAMES)))  # fmt: skip
    for name in ("capacity_tokens", "swap_tokens", "max_batch", "tensor_parallel", "rr_interval", "batch_grid",
                 "dp_block_tokens", "latency_context_tokens"):  # fmt: skip
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise RunConfigError("%s: serving.%s must be a whole number >= 0, not %r" % (source, name, value))
    for name in ("host_link_gbps", "watermark", "preemption_cap", "lookahead_s"):
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise RunConfigError("%s: serving.%s must be a number >= 0, not %r" % (source, name, value))
    if not isinstance(settings.ignore_eos, bool):
        raise RunConfigError("%s: serving.ignore_eos must be true or false" % source)
    if settings.max_batch < 1 or settings.tensor_parallel < 1:
        raise RunConfigError("%s: serving.max_batch and serving.tensor_parallel must be at least 1" % source)
    return settings


def _profile(raw: Any, where: str) -> Optional[ModeRates]:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - set(ModeRates._fields):
        raise RunConfigError("%s must be a mapping of %s" % (where, ", ".join(ModeRates._fields)))
    rates = rates_from_json(raw)
    if min(rates.mem_bw_gbps, rates.peak_tflops, rates.bw_efficiency, rates.flops_efficiency) <= 0:
        raise RunConfigError("%s: bandwidth, throughput and efficiencies must be > 0" % where)
    return rates


def _target(raw: Any, source: str) -> Optional[TargetSettings]:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise RunConfigError("%s: field 'target' must be a mapping with 'model'" % source)
    try:
        model = target_from_json(raw["model"])
    except TargetModelError as error:
        raise RunConfigError("%s: %s" % (source, error)) from None
    dilation = raw.get("dilation", 1.0)
    if isinstance(dilation, bool) or not isinstance(dilation, (int, float)) or dilation <= 0:
        raise RunConfigError("%s: target.dilation must be a number > 0" % source)
    return TargetSettings(model, float(dilation), bool(raw.get("pad_payloads", True)))


class ScheduledRequest(NamedTuple):
    request_id: int
    arrival_s: float
    prompt: Optional[str]
    prompt_ids: Optional[List[int]]
    max_new_tokens: int
    expected_ttft_s: Optional[float] = None  # Andes' QoE expectation of the request (a streaming method's
    expected_tds_tok_s: Optional[float] = None  # token buffer shows tokens at this speed)


def load_schedule(path: str) -> List[ScheduledRequest]:
    """A device's requests in arrival order; errors name the file and line."""
    out: List[ScheduledRequest] = []
    with open(os.path.expanduser(path), encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                request = ScheduledRequest(
                    request_id=int(row["request_id"]),
                    arrival_s=float(row.get("arrival_s", 0.0)),
                    prompt=row.get("prompt"),
                    prompt_ids=row.get("prompt_ids"),
                    max_new_tokens=int(row.get("max_new_tokens", 32)),
                    expected_ttft_s=_optional_float(row.get("expected_ttft_s")),
                    expected_tds_tok_s=_optional_float(row.get("expected_tds_tok_s")),
                )
            except (ValueError, KeyError, TypeError) as error:
                raise RunConfigError("%s:%d: bad request (%s)" % (path, number, error)) from None
            if request.prompt is None and not request.prompt_ids:
                raise RunConfigError("%s:%d: field 'prompt' or 'prompt_ids' is needed" % (path, number))
            if request.max_new_tokens < 1:
                raise RunConfigError("%s:%d: field 'max_new_tokens' must be >= 1" % (path, number))
            out.append(request)
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)
