"""What a campaign would run on each node, computed from the same plans the runs use, touching nothing.

Power modes are set by the node-side driver (it picks nvpmodel, NVML or sysfs writes on the
node), so its command line is what is shown; tc commands come from the compiled plans; the
workers' line is the run's ``mpiexec`` plan with ``mpiexec`` and the run config as they will be
named on the launch node.
"""

from __future__ import annotations

import shlex

from foundation.errors import TestbedError
from testbed.campaign.execution import node_run_id, run_links
from testbed.campaign.spec import Campaign, PlannedRun, device_names, run_nodes
from testbed.inventory import Inventory
from testbed.split_run import MpiLaunchPlan, RankGroup, data_plane_env
from testbed.telemetry import sampler_plan


def planned_commands(campaign: Campaign, run: PlannedRun) -> dict[str, list[str]]:
    """Node -> the command lines the run would start there, in order."""
    lab, settings = campaign.inventory, run.settings
    out: dict[str, list[str]] = {n.name: [] for n in run_nodes(lab, settings)}
    python, workdir = lab.spec.defaults.python, lab.spec.defaults.workdir.rstrip("/")
    for target, mode in settings.power.items():
        for node in lab.select([target]):
            out[node.name].append(f"{python} -m nodes.power --kind {node.kind} set {shlex.quote(mode)}")
    try:
        plans = _plans(campaign, run)
    except TestbedError as exc:  # e.g. an emulated testbed that is not up has no data interfaces yet
        plans = ()
        out[settings.server].append(f"# link shaping cannot be planned now: {exc}")
    for plan in plans:
        out.setdefault(plan.node, []).extend(shlex.join(c) for c in plan.apply_commands())
    if settings.telemetry.enabled:
        for name in out:
            words = sampler_plan(lab.node(name), settings.telemetry.jetson_source).argv(python)
            words += ["--interval-ms", str(settings.telemetry.interval_ms)]
            out[name].append(shlex.join(words) + "  # detached, until the run ends")
    out[settings.server].append(_mpiexec_line(lab, campaign, run, f"{workdir}/runs/{node_run_id(run, 1)}"))
    for plan in plans:
        out[plan.node].extend(shlex.join(c) for c in plan.undo_commands())
    if settings.power:
        for node in lab.select(list(settings.power)):
            out[node.name].append(f"{python} -m nodes.power --kind {node.kind} restore")
    return out


def _plans(campaign: Campaign, run: PlannedRun) -> tuple:
    from testbed.links.plans import compile_plan

    if not run.settings.link.shaped:
        return ()
    return compile_plan(campaign.inventory, run_links(campaign, run.settings))


def _mpiexec_line(lab: Inventory, campaign: Campaign, run: PlannedRun, run_dir: str) -> str:
    settings = run.settings
    groups = []
    for name, ranks in [(settings.server, settings.partition.stages),
                        *[(d, 1) for d in device_names(lab, settings)]]:  # fmt: skip
        node = lab.node(name)
        env = data_plane_env(node.data.interface) if node.data else {}
        argv = (lab.spec.defaults.python, "-m", "nodes.workers", f"{run_dir}/run.json")
        groups.append(RankGroup(name, node.address or name, ranks, argv, tuple(sorted(env.items()))))
    plan = MpiLaunchPlan(settings.server, "mpiexec", tuple(groups), campaign.spec.run_timeout_s)
    return plan.apply_commands()[0]
