"""CoCoServe's GPU ranks (``scaling``) of methods ``cocoserve``, ``continuous-batching`` and
``static-batching``: the campaign's controller settings, and the run config's section with the bytes each
GPU's budget counts.

With a target, a real decoder layer stands for ``target layers / real layers`` of the target's, so a
layer copy counts as that many target layers' weights and a token's KV in it as their KV; the
instance's GPU also holds the target's embedding and LM head (``fixed_bytes``). Each GPU's budget is
``scaling.gpu_memory_gb``, by default the server profile's whole memory (Transformers takes what it
needs, with no reserved pool), and hidden states between GPUs cross ``gpu_link_gbps``, by default the
profile's host link (the paper's A100 PCIe cards talk over PCIe). Without a target the real model's
bytes are counted and only a given ``gpu_memory_gb`` bounds them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import Field, StrictInt

from foundation.errors import InputError, TestbedError
from foundation.user_fields import Number
from nodes.contracts.methods import Method, method_named
from nodes.contracts.run_config import ScalingSettings as RunScalingSettings
from nodes.contracts.target_model import TargetModel
from testbed.campaign.families import FamilyContext, MethodFamily, Problem, SectionModel
from testbed.inventory import Inventory

GB = 1e9
_SCALING = RunScalingSettings._field_defaults  # the engine's defaults (nodes/contracts/run_config)


class ScalingSettings(SectionModel):
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


AUTOSCALING_ONLY = ("t_up", "t_down", "cooldown_s", "calm_s", "delta_batch", "max_migrations")


def target_bytes(target: TargetModel, real_layers: int) -> dict[str, int]:
    """What a GPU's budget counts for a real layer copy, a token's KV in it, and the instance's fixed
    share (embedding and head), in ``target``'s bytes."""
    per_copy = target.layers / real_layers
    return {"layer_bytes": int(target.layer_params * target.weight_bytes_per_param * per_copy),
            "kv_bytes_per_token_layer": int(target.kv_bytes_per_token_per_layer * per_copy),
            "fixed_bytes": int((target.params - target.layers * target.layer_params) * target.weight_bytes_per_param)}


def scaling_config(inventory: Inventory, base_dir: Path, settings: Any) -> dict[str, Any]:
    from testbed.target.emulation import load_target_model, node_profile

    scaling = settings.scaling or ScalingSettings()
    shared = [f for f in RunScalingSettings._fields if f in type(scaling).model_fields]  # the rest are derived
    out: dict[str, Any] = {f: getattr(scaling, f) for f in shared}
    budget_gb = scaling.gpu_memory_gb
    if settings.target is not None:
        real = load_target_model(settings.model, base_dir, None if settings.dtype == "auto" else settings.dtype)
        target = load_target_model(settings.target.model, base_dir, settings.target.dtype)
        out.update(target_bytes(target, real.layers))
        profile = node_profile(inventory, inventory.node(settings.server))
        if profile is None:
            raise TestbedError(f"{inventory.path}: node {settings.server} has no compute profile for its GPUs' "
                               "memory and links: add 'compute_profile: <name>' to it")  # fmt: skip
        budget_gb = budget_gb or profile.spec.memory_gb
        out["gpu_link_gbps"] = scaling.gpu_link_gbps or profile.spec.host_link_gbps
        if out["fixed_bytes"] + real.layers * out["layer_bytes"] > budget_gb * GB:
            weights_gb = target.params * target.weight_bytes_per_param / GB
            raise TestbedError(f"scaling: {target.name}'s weights ({weights_gb:.1f} GB) do not fit one GPU of "
                               f"{budget_gb:g} GB; raise scaling.gpu_memory_gb or pick a smaller target model")
    out["gpu_memory_bytes"] = int(budget_gb * GB) if budget_gb else None
    return out


class GpuRanks(MethodFamily):
    section = "scaling"
    settings_model = ScalingSettings
    summary = "a GPU-rank method's budgets and controller"

    def applies(self, method: Method) -> bool:
        return method.gpu_ranks

    def run_section(self, context: FamilyContext, settings: Any) -> dict[str, Any]:
        return scaling_config(context.inventory, context.base_dir, settings)

    def problems(self, context: FamilyContext, settings: Any) -> Iterable[Problem]:
        """The GPUs' budgets must hold the target's weights (checked now, not when the run is planned)."""
        if not self.in_run_config(settings):
            return
        if not context.has_nodes([settings.server]) or not context.resolve(settings.model).is_dir():
            return  # reported with the server or the model
        try:
            scaling_config(context.inventory, context.base_dir, settings)
        except (TestbedError, InputError) as exc:
            given = settings.scaling is not None and settings.scaling.gpu_memory_gb is not None
            yield ("scaling.gpu_memory_gb" if given else "target.model"), str(exc), \
                "give a larger scaling.gpu_memory_gb, or a smaller target model"

    def ignored(self, settings: Any) -> dict[str, str]:
        method = method_named(settings.method)
        if method.gpu_ranks and not method.autoscales:
            return {f"scaling.{name}": f"{settings.method} does not scale" for name in AUTOSCALING_ONLY}
        return {}


FAMILY = GpuRanks()
