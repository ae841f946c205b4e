"""Andes' serving engine (``serving``): the scheduler and budgets of a streaming method's engine (and of
DiSCo's engine endpoint), translated into the run config's section with the KV capacity and swap space
the emulated server would have.

With a target (``target.model``), the engine stands for ``tensor_parallel`` GPUs of the server's
compute profile: its KV capacity M is what their memory holds once the target's weights are in
(``tensor_parallel`` x ``memory_gb`` x ``gpu_memory_utilization``, vLLM's way of sizing its cache),
counted in the target's KV tokens; swapped KV crosses ``tensor_parallel`` host links of the profile's
rate, and host memory for it is ``swap_gb``. Without a target, the tiny model's own KV is what the
engine counts, and only ``capacity_tokens`` and ``swap_gb`` (in the tiny model's KV bytes) bound it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt

from foundation.errors import InputError, TestbedError
from foundation.user_fields import Number
from nodes.contracts.catalogues import SCHEDULER_NAMES
from nodes.contracts.methods import Method, method_named
from nodes.contracts.run_config import ServingSettings as RunServingSettings
from nodes.contracts.target_model import TargetModel
from testbed.campaign.families import FamilyContext, MethodFamily, Problem, SectionModel
from testbed.inventory import Inventory

GB = 1e9
_SERVING = RunServingSettings._field_defaults  # the engine's defaults, defined once (nodes/contracts/run_config)


class ServingSettings(SectionModel):
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


ANDES_ONLY = ("watermark", "preemption_cap", "lookahead_s", "batch_grid")  # the schedulers' own knobs


def kv_capacity_tokens(model: TargetModel, memory_gb: float, gpus: int, utilization: float) -> int:
    """M: the KV tokens ``gpus`` GPUs of ``memory_gb`` hold after ``model``'s weights, at ``utilization``
    of their memory; a TestbedError when the weights alone do not fit."""
    usable = gpus * memory_gb * GB * utilization - model.params * model.weight_bytes_per_param
    per_token = model.kv_bytes_per_token
    if usable < per_token:
        raise TestbedError(
            f"serving: {gpus} x {memory_gb:g} GB at {utilization:g} cannot hold {model.name}'s weights "
            f"({model.params * model.weight_bytes_per_param / GB:.1f} GB) and any KV; raise serving.tensor_parallel"
        )
    return int(usable // per_token)


def serving_config(inventory: Inventory, base_dir: Path, settings: Any) -> dict[str, Any]:
    """The run config's ``serving`` section (``nodes/contracts/run_config.ServingSettings``) for ``settings``."""
    from testbed.target.emulation import load_target_model, node_profile

    serving = settings.serving or ServingSettings()
    # the settings the campaign writes as the engine reads them; the budgets below are derived
    shared = [f for f in RunServingSettings._fields if f in type(serving).model_fields]
    out: dict[str, Any] = {f: getattr(serving, f) for f in shared}
    if settings.target is None:  # the real checkpoint's own KV
        dtype = None if settings.dtype == "auto" else settings.dtype
        model = load_target_model(settings.model, base_dir, dtype)
        if serving.swap_gb is not None:
            out["swap_tokens"] = int(serving.swap_gb * GB // model.kv_bytes_per_token)
        return out
    model = load_target_model(settings.target.model, base_dir, settings.target.dtype)
    server = inventory.node(settings.server)
    profile = node_profile(inventory, server)
    if profile is None:
        raise TestbedError(f"{inventory.path}: node {server.name} has no compute profile for its serving engine's "
                           "budgets: add 'compute_profile: <name>' to it")  # fmt: skip
    if out["capacity_tokens"] is None and not method_named(settings.method).gpu_ranks:  # (those follow their GPUs)
        out["capacity_tokens"] = kv_capacity_tokens(model, profile.spec.memory_gb, serving.tensor_parallel,
                                                    serving.gpu_memory_utilization)  # fmt: skip
    if serving.swap_gb is not None:
        out["swap_tokens"] = int(serving.swap_gb * GB // model.kv_bytes_per_token)
    out["host_link_gbps"] = profile.spec.host_link_gbps * serving.tensor_parallel
    return out


def engine_endpoint(settings: Any) -> bool:
    """Whether DiSCo's server endpoint is the serving engine (``dispatch.server_endpoint: engine``)."""
    dispatch = getattr(settings, "dispatch", None)
    return dispatch is not None and dispatch.server_endpoint == "engine"


class Serving(MethodFamily):
    section = "serving"
    settings_model = ServingSettings
    summary = "a streaming method's serving engine: scheduler and budgets"
    refuse_elsewhere = False  # DiSCo's engine endpoint reads it too: reported unread where nothing does

    def applies(self, method: Method) -> bool:
        return method.streams

    def in_run_config(self, settings: Any) -> bool:
        return self.reads(settings) or engine_endpoint(settings)

    def run_section(self, context: FamilyContext, settings: Any) -> dict[str, Any]:
        return serving_config(context.inventory, context.base_dir, settings)

    def runs_engine(self, settings: Any) -> bool:
        """Whether the run has a serving engine (a streaming method, or DiSCo's engine endpoint when no
        external endpoint replaces it)."""
        external = engine_endpoint(settings) and settings.dispatch.external is not None
        return self.reads(settings) or (engine_endpoint(settings) and not external)

    def problems(self, context: FamilyContext, settings: Any) -> Iterable[Problem]:
        """The engine's budgets must be derivable: the server's profile must hold the target's weights
        (the KV capacity is what is left)."""
        if not self.in_run_config(settings) or not context.has_nodes([settings.server]):
            return
        if settings.target is None and not context.resolve(settings.model).is_dir():
            return  # reported with the model
        try:
            serving_config(context.inventory, context.base_dir, settings)
        except (TestbedError, InputError) as exc:
            yield "serving", str(exc), "raise serving.tensor_parallel, or give serving.capacity_tokens"

    def ignored(self, settings: Any) -> dict[str, str]:
        method = method_named(settings.method)
        if not self.runs_engine(settings):
            external = method.dispatches and settings.dispatch is not None and settings.dispatch.external
            return {"serving": f"{settings.method} runs no serving engine"
                    + (" (dispatch.external replaces it)" if external else "")}  # fmt: skip
        out = {}
        serving = self.settings_of(settings)
        scheduler = "static" if method.batching == "static" else serving.scheduler
        if method.batching == "static":
            out["serving.scheduler"] = f"{settings.method} runs a fixed batch to its end, with no scheduler"
        for name in ("rr_interval",) if scheduler != "rr" else ():
            out[f"serving.{name}"] = f"the {scheduler} scheduler does not read it (rr does)"
        for name in ANDES_ONLY if scheduler not in ("andes", "andes-dp") else ():
            out[f"serving.{name}"] = f"the {scheduler} scheduler does not read it (andes and andes-dp do)"
        if scheduler != "andes-dp":
            out["serving.dp_block_tokens"] = f"the {scheduler} scheduler does not read it (andes-dp does)"
        return out


FAMILY = Serving()
