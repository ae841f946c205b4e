"""The workers' part of a run (:class:`SplitRunSpec`): method, model, partition, the devices'
schedules (requests, or an LLM service's context-switching trace), the draft adapter, and the
method's settings translated into the run config's sections; on a dilated time axis for a target
emulation run.
"""

from __future__ import annotations

from typing import Any

from nodes.contracts.draft import default_adapter_dir
from nodes.contracts.methods import method_named
from testbed.campaign.spec import Campaign, PlannedRun, RunSettings, device_names, workload_spec
from testbed.split_run import MethodSections, SplitRunSpec


def node_run_id(run: PlannedRun, attempt: int) -> str:
    """The run's directory name on the nodes: one per attempt, so attempts never share files."""
    return f"{run.run_id}-a{attempt}"


def draft_config(campaign: Campaign, settings: RunSettings) -> dict[str, Any]:
    """The run config's ``draft`` mapping, the adapter's path resolved against the campaign file (by
    default the checkpoint's ``draft/``, where the model is, also when devices run a placed part)."""
    draft = settings.draft.model_dump()
    draft["adapter"] = str(campaign.resolve(draft["adapter"] or default_adapter_dir(settings.model)))
    return draft


def split_spec(campaign: Campaign, run: PlannedRun, attempt: int) -> SplitRunSpec:
    """The workers' part of the run: method, model, partition, per-device schedules, run id."""
    from workloads.schedule import build_schedules

    lab, settings = campaign.inventory, run.settings
    devices = device_names(lab, settings)
    if method_named(settings.method).serves_contexts:  # the LLM service's apps replay a context trace
        schedules = context_schedules(settings, devices, seed=run.seed, model_dir=campaign.resolve(settings.model))
    else:
        schedules = build_schedules(
            workload_spec(settings), devices, seed=run.seed, model_dir=campaign.resolve(settings.model),
            base_dir=campaign.base_dir,
        )  # fmt: skip
    method = method_named(settings.method)
    engine_endpoint = settings.dispatch is not None and settings.dispatch.server_endpoint == "engine"
    serving = scaling = dispatch = target_section = None
    if method.streams or engine_endpoint:
        from testbed.campaign.serving_budget import serving_config

        serving = serving_config(lab, campaign.base_dir, settings)
    if method.gpu_ranks:
        from testbed.campaign.scaling_config import scaling_config

        scaling = scaling_config(lab, campaign.base_dir, settings)
    if method.dispatches:
        from testbed.campaign.dispatch_config import dispatch_config

        dispatch = dispatch_config(settings, lab)
    if settings.target is not None:
        from testbed.target_emulation import paced_names, resolve_target

        target = resolve_target(lab, campaign.base_dir, settings, list(lab.select(paced_names(settings, devices))))
        target_section = target.to_json()
        schedules = {d: dilated_schedule(rows, target.dilation) for d, rows in schedules.items()}
    sections = MethodSections(draft_config(campaign, settings), serving, scaling, dispatch, target_section)
    return SplitRunSpec(
        method=settings.method, model=str(campaign.resolve(settings.model)), server=settings.server,
        devices=devices, stages=settings.partition.stages, device_layers=settings.partition.device_layers,
        chunk_tokens=settings.chunk_tokens, dtype=settings.dtype,
        schedules=tuple((d, tuple(schedules[d])) for d in devices), run_id=node_run_id(run, attempt),
        timeout_s=campaign.spec.run_timeout_s, threads_per_rank=settings.threads_per_rank, sections=sections,
        device_slots=settings.device_slots,
    )  # fmt: skip


def context_schedules(
    settings: RunSettings, devices: tuple[str, ...], *, seed: int, model_dir: Any
) -> dict[str, list[dict[str, Any]]]:
    """Each device's context-switching trace (LLMS Sec. 4) as schedule rows, seeded per device."""
    from foundation.seeds import derive_seed
    from workloads.context_traces import context_schedule, context_trace

    service = settings.context_service_or_default
    out = {}
    for index, device in enumerate(devices):
        trace = context_trace(service.contexts, service.contexts * service.calls_per_context, service.pattern,
                              tasks=tuple(service.tasks), mean_gap_s=service.mean_gap_s,
                              output_share=service.output_share, max_context_tokens=service.max_context_tokens,
                              seed=derive_seed(seed, device, "context-trace"))  # fmt: skip
        out[device] = context_schedule(trace, device_index=index, apps=service.apps, model_dir=model_dir,
                                       seed=derive_seed(seed, device, "context-text"))  # fmt: skip
    return out


def dilation_of(settings: RunSettings) -> float:
    return settings.target.dilation if settings.target is not None else 1.0


def dilated_schedule(rows: list[dict[str, Any]], dilation: float) -> list[dict[str, Any]]:
    """A device's schedule on the dilated time axis: every arrival ``dilation`` times later."""
    if dilation == 1.0:
        return rows
    return [dict(row, arrival_s=float(row["arrival_s"]) * dilation) for row in rows]
