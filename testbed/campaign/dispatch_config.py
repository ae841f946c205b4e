"""The run config's ``dispatch`` section for a dispatching method (``disco``): the campaign's settings
with the per-token prices filled in from the cost model (DiSCo App. E): the service's API price
(Table 8) for the server, the device model's FLOPs per token at the regime's energy-to-money rate for
the device. The regime is the policy's (``-s``: server-constrained, ``-d``: device-constrained) unless
the campaign forces one; prices are taken at the Alpaca-like mean prompt of 20 tokens. The endpoints
the run starts take a key of the run's own (``endpoint_key``: shown as ``<per-run key>``, made and
stored on the nodes when the run is staged, never written in a plan, a manifest or a command line)."""

from __future__ import annotations

from typing import Any

from analysis.cost_model import DispatchPrices, dispatch_regime
from nodes.contracts.run_config import DispatchSettings as RunDispatchSettings
from testbed.campaign.spec import DispatchSettings
from testbed.split_run import PER_RUN_KEY


def dispatch_config(run_settings: Any, inventory: Any = None) -> dict[str, Any]:
    """The section; with ``dispatch.external``, the inventory endpoint's URL and model, and the name
    (never the value) of the variable its key is in (``external_key_env``: staging stores the key)."""
    settings = run_settings.dispatch or DispatchSettings()
    prices = DispatchPrices.for_dispatch(settings.service, settings.device_speed,
                                         dispatch_regime(settings.policy, settings.regime))  # fmt: skip
    shared = {f: getattr(settings, f) for f in RunDispatchSettings._fields if f in type(settings).model_fields}
    out = dict(shared, prices=prices.as_list(), endpoint_key=PER_RUN_KEY)
    if settings.external is not None and inventory is not None:
        endpoint = inventory.spec.endpoints[settings.external]
        out.update(external_url=endpoint.url, external_model=endpoint.model, external_key_env=endpoint.api_key_env)
    return out
