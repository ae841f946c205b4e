"""DiSCo's dispatch (``dispatch``) of method ``disco``, and the run config's section: the campaign's
settings with the per-token prices filled in from the cost model (DiSCo App. E): the service's API price
(Table 8) for the server, the device model's FLOPs per token at the regime's energy-to-money rate for
the device. The regime is the policy's (``-s``: server-constrained, ``-d``: device-constrained) unless
the campaign forces one; prices are taken at the Alpaca-like mean prompt of 20 tokens. The endpoints
the run starts take a key of the run's own (``endpoint_key``: shown as ``<per-run key>``, made and
stored on the nodes when the run is staged, never written in a plan, a manifest or a command line)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt

from analysis.cost_model import DispatchPrices, dispatch_regime
from foundation.user_fields import Number
from nodes.contracts.catalogues import DEVICE_SPEED_NAMES, DISPATCH_POLICIES, SERVICE_NAMES
from nodes.contracts.methods import Method
from nodes.contracts.run_config import DispatchSettings as RunDispatchSettings
from testbed.campaign.families import FamilyContext, MethodFamily, Problem, SectionModel
from testbed.inventory import Name
from testbed.workers.split_spec import PER_RUN_KEY

_DISPATCH = RunDispatchSettings._field_defaults  # the dispatcher's defaults (nodes/contracts/run_config)


class DispatchSettings(SectionModel):
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


class Dispatch(MethodFamily):
    section = "dispatch"
    settings_model = DispatchSettings
    summary = "a dispatching method's policy"

    def applies(self, method: Method) -> bool:
        return method.dispatches

    def run_section(self, context: FamilyContext, settings: Any) -> dict[str, Any]:
        return dispatch_config(settings, context.inventory)

    def problems(self, context: FamilyContext, settings: Any) -> Iterable[Problem]:
        """An external endpoint must be in the inventory, and its key's variable set on the controller."""
        name = settings.dispatch.external if settings.dispatch is not None else None
        if name is None:
            return
        endpoints = context.inventory.spec.endpoints
        if name not in endpoints:
            known = ", ".join(endpoints) or "none"
            yield ("dispatch.external", f"no endpoint {name!r} in the inventory (known: {known})",
                   "add it under endpoints: in the inventory, with its url")  # fmt: skip
            return
        variable = endpoints[name].api_key_env
        if variable and not os.environ.get(variable):
            yield ("dispatch.external", f"endpoint {name!r} takes its key from ${variable}, which is not set",
                   f"export {variable}=... on the controller before testbed run")  # fmt: skip

    def ignored(self, settings: Any) -> dict[str, str]:
        if not self.reads(settings):
            return {}
        d, out = self.settings_of(settings), {}
        if d.policy in ("server-only", "device-only"):
            out["dispatch.budget"] = f"policy {d.policy} sends every request one way"
        if d.policy != "disco-d":
            out["dispatch.alpha"] = f"policy {d.policy} does not read it (disco-d does)"
        if not d.migration:
            out["dispatch.source_keeps_streaming"] = "dispatch.migration is false"
        if d.external is not None:
            out["dispatch.server_endpoint"] = "dispatch.external replaces the server's endpoint"
        return out


FAMILY = Dispatch()
