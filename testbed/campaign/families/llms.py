"""LLMS' on-device LLM service (``context_service``) of method ``llms``: which memory method the daemon
runs (LLMS, a baseline or an ablation), its budget for contexts' chunks, and the context-switching trace
its apps replay instead of a workload (LLMS Sec. 4). The daemon's command lines are planned by
:mod:`testbed.workers.context_service`; this family makes the devices' schedules and checks the section.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field, StrictInt

from foundation.errors import InputError, TestbedError
from foundation.user_fields import Number
from nodes.contracts.methods import CONTEXT_MEMORY_METHODS, Method
from testbed.campaign.families import FamilyContext, MethodFamily, Problem, SectionModel


class ContextServiceSettings(SectionModel):
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


class ContextService(MethodFamily):
    section = "context_service"
    settings_model = ContextServiceSettings
    summary = "a context-serving method's daemon"

    def applies(self, method: Method) -> bool:
        return method.serves_contexts

    def in_run_config(self, settings: Any) -> bool:
        return False  # the daemon's own command line carries it (testbed.workers.context_service)

    def schedules(
        self, context: FamilyContext, settings: Any, devices: tuple[str, ...], seed: int
    ) -> dict[str, list[dict[str, Any]]] | None:
        """Each device's context-switching trace (LLMS Sec. 4) as schedule rows, seeded per device."""
        if not self.reads(settings):
            return None
        from foundation.seeds import derive_seed
        from workloads.context_traces import context_schedule, context_trace

        service = self.settings_of(settings)
        model_dir = context.resolve(settings.model)
        out = {}
        for index, device in enumerate(devices):
            trace = context_trace(service.contexts, service.contexts * service.calls_per_context, service.pattern,
                                  tasks=tuple(service.tasks), mean_gap_s=service.mean_gap_s,
                                  output_share=service.output_share, max_context_tokens=service.max_context_tokens,
                                  seed=derive_seed(seed, device, "context-trace"))  # fmt: skip
            out[device] = context_schedule(trace, device_index=index, apps=service.apps, model_dir=model_dir,
                                           seed=derive_seed(seed, device, "context-text"))  # fmt: skip
        return out

    def problems(self, context: FamilyContext, settings: Any) -> Iterable[Problem]:
        """The service's scale must be derivable (with a target: each device's profile and its disk), and
        the contexts must fit the model's positions."""
        from testbed.workers.context_service import CONTEXT_SLACK_TOKENS, longest_context_bytes, run_scales

        if not self.reads(settings):
            return
        service = self.settings_of(settings)
        model_dir = context.resolve(settings.model)
        if not model_dir.is_dir():
            return  # reported with the model
        try:
            devices = [n.name for n in context.inventory.select(list(settings.devices))]
            scales = run_scales(context.inventory, context.base_dir, settings, devices, model_dir)
            positions = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
            longest = longest_context_bytes(model_dir, service)
        except (TestbedError, InputError, OSError, ValueError, KeyError) as exc:
            yield "context_service", str(exc), "give every device a compute_profile with a disk in the inventory"
            return
        smallest = min((scale.budget_bytes for scale in scales.values()), default=longest)
        if longest > smallest:  # one context alone must fit (LLMS's budgets hold at least one 4K context)
            need_gb = service.budget_gb * longest / smallest
            yield ("context_service.budget_gb", f"one context of {service.max_context_tokens} tokens needs "
                   f"{need_gb:.3g} GB with {service.memory}, over the budget of {service.budget_gb:g} GB",
                   f"raise budget_gb to {need_gb:.3g} or lower max_context_tokens")  # fmt: skip
        if service.max_context_tokens + CONTEXT_SLACK_TOKENS > positions:
            yield ("context_service.max_context_tokens", f"{service.max_context_tokens} tokens do not fit the "
                   f"model's {positions} positions", f"use at most {positions - CONTEXT_SLACK_TOKENS}")  # fmt: skip

    def ignored(self, settings: Any) -> dict[str, str]:
        if self.reads(settings):
            return {"workload": f"{settings.method}'s apps replay the context trace of context_service, not a workload"}
        return {}


FAMILY = ContextService()
