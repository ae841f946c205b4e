"""The workers' part of a run (:class:`SplitRunSpec`): method, model, partition, the devices'
schedules (requests, or what a method family makes instead: LLMS' context-switching trace), and the
method families' settings translated into the run config's sections (:mod:`testbed.campaign.families`);
on a dilated time axis for a target emulation run.
"""

from __future__ import annotations

from typing import Any

from testbed.campaign.families import FamilyContext, families
from testbed.campaign.spec import Campaign, PlannedRun, RunSettings, device_names, workload_spec
from testbed.workers.split_spec import MethodSections, SplitRunSpec


def node_run_id(run: PlannedRun, attempt: int) -> str:
    """The run's directory name on the nodes: one per attempt, so attempts never share files."""
    return f"{run.run_id}-a{attempt}"


def split_spec(campaign: Campaign, run: PlannedRun, attempt: int) -> SplitRunSpec:
    """The workers' part of the run: method, model, partition, per-device schedules, run id."""
    from workloads.schedule import build_schedules

    lab, settings = campaign.inventory, run.settings
    context = FamilyContext(lab, campaign.base_dir)
    devices = device_names(lab, settings)
    made = (family.schedules(context, settings, devices, run.seed) for family in families())
    schedules = next((rows for rows in made if rows is not None), None)  # a family's own (LLMS' traces)
    if schedules is None:  # the workload's requests
        schedules = build_schedules(
            workload_spec(settings), devices, seed=run.seed, model_dir=campaign.resolve(settings.model),
            base_dir=campaign.base_dir,
        )  # fmt: skip
    sections: dict[str, Any] = {family.section: family.run_section(context, settings)
                                for family in families() if family.in_run_config(settings)}  # fmt: skip
    if settings.target is not None:
        from testbed.target.emulation import paced_names, resolve_target

        target = resolve_target(lab, campaign.base_dir, settings, list(lab.select(paced_names(settings, devices))))
        sections["target"] = target.to_json()
        schedules = {d: dilated_schedule(rows, target.dilation) for d, rows in schedules.items()}
    return SplitRunSpec(
        method=settings.method, model=str(campaign.resolve(settings.model)), server=settings.server,
        devices=devices, stages=settings.partition.stages, device_layers=settings.partition.device_layers,
        chunk_tokens=settings.chunk_tokens, dtype=settings.dtype,
        schedules=tuple((d, tuple(schedules[d])) for d in devices), run_id=node_run_id(run, attempt),
        timeout_s=campaign.spec.run_timeout_s, threads_per_rank=settings.threads_per_rank,
        sections=MethodSections(**sections),
        device_slots=settings.device_slots,
    )  # fmt: skip


def dilation_of(settings: RunSettings) -> float:
    return settings.target.dilation if settings.target is not None else 1.0


def dilated_schedule(rows: list[dict[str, Any]], dilation: float) -> list[dict[str, Any]]:
    """A device's schedule on the dilated time axis: every arrival ``dilation`` times later."""
    if dilation == 1.0:
        return rows
    return [dict(row, arrival_s=float(row["arrival_s"]) * dilation) for row in rows]
