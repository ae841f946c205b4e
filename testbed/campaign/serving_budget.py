"""The serving engine's budgets for one run: the run config's ``serving`` section, with the KV capacity
and swap space the emulated server would have.

With a target (``target.model``), the engine stands for ``tensor_parallel`` GPUs of the server's
compute profile: its KV capacity M is what their memory holds once the target's weights are in
(``tensor_parallel`` x ``memory_gb`` x ``gpu_memory_utilization``, vLLM's way of sizing its cache),
counted in the target's KV tokens; swapped KV crosses ``tensor_parallel`` host links of the profile's
rate, and host memory for it is ``swap_gb``. Without a target, the tiny model's own KV is what the
engine counts, and only ``capacity_tokens`` and ``swap_gb`` (in the tiny model's KV bytes) bound it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from nodes.contracts.methods import method_named
from nodes.contracts.run_config import ServingSettings as RunServingSettings
from nodes.contracts.target_model import TargetModel
from testbed.inventory import Inventory

GB = 1e9


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
    from testbed.campaign.spec import ServingSettings
    from testbed.target_emulation import load_target_model, node_profile

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
