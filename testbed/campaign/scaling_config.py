"""The run config's ``scaling`` section for a GPU-rank method (``methods/cocoserve.py``): the campaign's
controller settings, and the bytes each GPU's budget counts.

With a target, a real decoder layer stands for ``target layers / real layers`` of the target's, so a
layer copy counts as that many target layers' weights and a token's KV in it as their KV; the
instance's GPU also holds the target's embedding and LM head (``fixed_bytes``). Each GPU's budget is
``scaling.gpu_memory_gb``, by default the server profile's whole memory (Transformers takes what it
needs, with no reserved pool), and hidden states between GPUs cross ``gpu_link_gbps``, by default the
profile's host link (the paper's A100 PCIe cards talk over PCIe). Without a target the real model's
bytes are counted and only a given ``gpu_memory_gb`` bounds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from nodes.contracts.run_config import ScalingSettings as RunScalingSettings
from nodes.contracts.target_model import TargetModel
from testbed.inventory import Inventory

GB = 1e9


def target_bytes(target: TargetModel, real_layers: int) -> dict[str, int]:
    """What a GPU's budget counts for a real layer copy, a token's KV in it, and the instance's fixed
    share (embedding and head), in ``target``'s bytes."""
    per_copy = target.layers / real_layers
    return {"layer_bytes": int(target.layer_params * target.weight_bytes_per_param * per_copy),
            "kv_bytes_per_token_layer": int(target.kv_bytes_per_token_per_layer * per_copy),
            "fixed_bytes": int((target.params - target.layers * target.layer_params) * target.weight_bytes_per_param)}


def scaling_config(inventory: Inventory, base_dir: Path, settings: Any) -> dict[str, Any]:
    from testbed.campaign.spec import ScalingSettings
    from testbed.target_emulation import load_target_model, node_profile

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
