"""HAT's drafting (``draft``): the draft adapter and the drafting knobs of the methods that draft (sd,
sd_pc, sd_pd, hat; HAT Sec. 3.4-3.5: Eq. 5's threshold eta, Eq. 6's cap on parallel drafts). The section's
fields, defaults and limits are the run contract's ``DraftSettings`` and ``DRAFT_LIMITS``, nothing of its own.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt, create_model

from foundation.user_fields import Number, PlainText
from nodes.contracts.draft import default_adapter_dir
from nodes.contracts.methods import Method
from nodes.contracts.run_config import DRAFT_LIMITS
from nodes.contracts.run_config import DraftSettings as RunDraftSettings
from testbed.campaign.families import FamilyContext, MethodFamily, SectionModel


def _draft_settings_model() -> type[SectionModel]:
    fields: dict[str, Any] = {}
    for name, default in RunDraftSettings._field_defaults.items():
        if name == "adapter":  # the adapter's directory; default: <model>/draft
            fields[name] = (PlainText | None, default)
            continue
        low, high = DRAFT_LIMITS[name]
        kind = Number if isinstance(default, float) else StrictInt
        fields[name] = (kind, Field(default, ge=low, le=high))
    return create_model("DraftSettings", __base__=SectionModel, **fields)


DraftSettings = _draft_settings_model()


class Drafting(MethodFamily):
    section = "draft"
    settings_model = DraftSettings
    summary = "the draft adapter and drafting knobs (methods that draft)"
    default_written = True  # every run config carries it: the adapter's default is the model's draft/
    refuse_elsewhere = False  # a base that sets it for a matrix of methods is common: reported unread

    def applies(self, method: Method) -> bool:
        return method.drafts

    def in_run_config(self, settings: Any) -> bool:
        return True

    def run_section(self, context: FamilyContext, settings: Any) -> dict[str, Any]:
        """The adapter's path resolved against the campaign file (by default the checkpoint's ``draft/``,
        where the model is, also when devices run a placed part)."""
        draft = self.settings_of(settings).model_dump()
        draft["adapter"] = str(context.resolve(draft["adapter"] or default_adapter_dir(settings.model)))
        return draft

    def ignored(self, settings: Any) -> dict[str, str]:
        return {} if self.reads(settings) else {"draft": f"{settings.method} does not draft"}


FAMILY = Drafting()
