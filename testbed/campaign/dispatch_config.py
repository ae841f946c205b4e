"""The run config's ``dispatch`` section for a dispatching method (``disco``): the campaign's settings
with the per-token prices filled in from the cost model (DiSCo App. E): the service's API price
(Table 8) for the server, the device model's FLOPs per token at the regime's energy-to-money rate for
the device. The regime is the policy's (``-s``: server-constrained, ``-d``: device-constrained) unless
the campaign forces one; prices are taken at the Alpaca-like mean prompt of 20 tokens."""

from __future__ import annotations

from typing import Any

from analysis.cost_model import SERVICE_APIS, DispatchPrices
from nodes.workers.run_config import DispatchSettings as RunDispatchSettings
from testbed.campaign.spec import DispatchSettings

PRICE_CONTEXT_TOKENS = 20.0
DEVICE_MODELS = {"pixel7pro-bloom-1.1b": "bloom-1.1b", "pixel7pro-bloom-560m": "bloom-560m",
                 "xiaomi14-qwen-0.5b": "qwen-0.5b"}  # fmt: skip


def regime_of(settings: DispatchSettings) -> str:
    if settings.regime is not None:
        return settings.regime
    return "device" if settings.policy.endswith("-d") else "server"


def dispatch_config(run_settings: Any, inventory: Any = None) -> dict[str, Any]:
    """The section; with ``dispatch.external``, the inventory endpoint's URL and model, and the name
    (never the value) of the variable its key is in (``external_key_env``: staging stores the key)."""
    settings = run_settings.dispatch or DispatchSettings()
    prices = DispatchPrices.for_run(SERVICE_APIS[settings.service], DEVICE_MODELS[settings.device_speed],
                                    regime_of(settings), PRICE_CONTEXT_TOKENS)  # fmt: skip
    shared = {f: getattr(settings, f) for f in RunDispatchSettings._fields if f in type(settings).model_fields}
    out = dict(shared, prices=[prices.server_prefill, prices.server_decode, prices.device_prefill,
                               prices.device_decode])  # fmt: skip
    if settings.external is not None and inventory is not None:
        endpoint = inventory.spec.endpoints[settings.external]
        out.update(external_url=endpoint.url, external_model=endpoint.model, external_key_env=endpoint.api_key_env)
    return out
