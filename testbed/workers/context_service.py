"""The on-device LLM service of a run whose method serves contexts (``llms``, LLMS Sec. 3): on every
device, the daemon (``python -m nodes.context_service``) is started detached through the run plan once
the run is staged, checked until it answers on its socket, and stopped at restore. Its pidfile is in
the run's ``processes.json`` before it starts (``--resume`` after a crash ends it) and ``--max-seconds``
bounds its life, so a killed controller leaves no daemon behind for long.

Time and bytes of a target (``target:``), labelled modeled: a chunk of the target model (``chunk_tokens``
tokens x its layers of INT8 keys and values with their metadata) is R times the checkpoint's, so the
memory budget and the disk's bandwidth are divided by R and the disk's per-I/O latency multiplied by
the ratio of layers (each layer is one read); recompute takes the target's T_re on the device's
compute profile (a prefill of x chunks after 1K tokens of context, fitted a x + b). This keeps the
target's read:recompute ratio, on which LLMS's effects rest. Without a target, the budget is in the
checkpoint's own bytes, the disk is the node's (unpaced) and T_re is what the daemon measures.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import NodeError
from nodes.contracts.compute_profile import ModeRates, step_seconds
from nodes.contracts.kv_chunk_bytes import chunk_bytes_all_layers
from nodes.contracts.methods import FLOAT16_CONTEXT_MEMORY
from nodes.contracts.service_files import ServiceFiles, service_files
from nodes.contracts.target_model import TargetModel, from_hf_config
from testbed.commands.node_context import NodeContext, transport_for
from testbed.commands.planned import PlanLines, sh
from testbed.inventory import Inventory
from testbed.transport.base import background_running_script, background_stop_script, command_line
from testbed.transport.fanout import FanOutResult, fan_out
from testbed.workers.split_spec import run_dir_on

READY_TIMEOUT_S = 300.0  # loading the model and fitting T_re and T_IO at start
READY_POLL_S = 0.5
STOP_GRACE_S = 10.0  # a call in flight ends first
LIFETIME_MARGIN_S = 120.0  # the daemon outlives the run's timeout by this much at most
RECOMPUTE_CONTEXT_TOKENS = 1024  # T_re is fitted for chunks recomputed after this much context
RECOMPUTE_FIT_CHUNKS = (1, 2, 4, 8, 16)
CONTEXT_SLACK_TOKENS = 1  # the daemon's context limit over the trace's longest context: the BOS it adds


@dataclass(frozen=True)
class ContextScale:
    """The daemon's memory, disk and recompute in the checkpoint's bytes, standing for a target's."""

    target_over_model: float  # R: a target chunk's bytes over the checkpoint's (1 without a target)
    budget_bytes: int
    disk: tuple[float, float, float] | None  # read MB/s, write MB/s, per-I/O latency ms; None: the node's own
    recompute: tuple[float, float] | None  # the target's T_re: s a chunk, fixed s; None: measured
    modeled: bool

    def to_json(self) -> dict[str, Any]:
        return {"target_over_model": self.target_over_model, "budget_bytes": self.budget_bytes,
                "disk": list(self.disk) if self.disk else None,
                "recompute": list(self.recompute) if self.recompute else None, "modeled": self.modeled}  # fmt: skip


def target_recompute(rates: ModeRates, target: TargetModel, chunk_tokens: int) -> tuple[float, float]:
    """T_re(x) = a x + b of ``target`` on a device with ``rates``: prefills of x chunks after 1K tokens."""
    points = [(x, step_seconds(rates, target, target.layers, [(chunk_tokens * x, RECOMPUTE_CONTEXT_TOKENS)]))
              for x in RECOMPUTE_FIT_CHUNKS]  # fmt: skip
    n = len(points)
    mean_x, mean_y = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return max(slope, 0.0), max(mean_y - slope * mean_x, 0.0)


def context_scale(
    model_config: Mapping[str, Any],
    chunk_tokens: int,
    budget_gb: float,
    *,
    target: TargetModel | None = None,
    rates: ModeRates | None = None,
    disk: Any = None,
) -> ContextScale:
    """The scale of a run: ``model_config`` is the checkpoint's config.json; with ``target``, ``rates``
    and ``disk`` (the device profile's mode and disk), the target's bytes and times."""
    model = from_hf_config(dict(model_config), "checkpoint")
    model_chunk = chunk_bytes_all_layers(model.layers, model.kv_heads, model.head_dim, chunk_tokens)
    if target is None:
        return ContextScale(1.0, int(budget_gb * (1 << 30)), None, None, False)
    target_chunk = chunk_bytes_all_layers(target.layers, target.kv_heads, target.head_dim, chunk_tokens)
    ratio = target_chunk / model_chunk
    paced_disk = None
    if disk is not None:
        per_io_ms = disk.io_latency_ms * target.layers / model.layers  # one read a layer
        paced_disk = (disk.read_mbps / ratio, disk.write_mbps / ratio, per_io_ms)
    recompute = target_recompute(rates, target, chunk_tokens) if rates is not None else None
    return ContextScale(ratio, int(budget_gb * (1 << 30) / ratio), paced_disk, recompute, True)


@dataclass(frozen=True)
class ServicePlan:
    """One device's daemon for one run: its command line and files on the node."""

    node: str
    argv: tuple[str, ...]  # as the node runs it (the node code on PYTHONPATH where it needs it)
    files: ServiceFiles
    scale: ContextScale
    memory: str

    def check_argv(self, python: str) -> list[str]:
        return [python, "-m", "nodes.context_service.client", "--socket", self.files.socket, "stats"]

    def log_tail_argv(self) -> list[str]:
        return ["tail", "-c", "2000", self.files.logfile]

    def directory_argv(self) -> list[str]:
        """Make the service's directory, its user's alone (the daemon refuses a socket directory others
        may enter)."""
        return ["mkdir", "-p", "-m", "0700", self.files.directory]


def service_plans(
    inventory: Inventory,
    settings: Any,
    contexts: Mapping[str, NodeContext],
    devices: Sequence[str],
    run_id: str,
    model_dir: str,
    scale_by_node: Mapping[str, ContextScale],
    lifetime_s: float,
) -> tuple[ServicePlan, ...]:
    """The daemons of a run: one per device, with the memory method and sizes of ``context_service``."""
    service = settings.section("context_service")
    plans = []
    for name in devices:
        context = contexts[name]
        files = service_files(run_dir_on(context, run_id))
        scale = scale_by_node[name]
        words = [context.python, "-m", "nodes.context_service", "--model", model_dir, "--socket", files.socket,
                 "--state-dir", files.state_dir, "--memory", service.memory,
                 "--budget-mib", f"{scale.budget_bytes / (1 << 20):.6g}", "--chunk-tokens", str(service.chunk_tokens),
                 "--ratio", f"{service.ratio:g}", "--contexts-per-app", str(contexts_per_app(service)),
                 "--context-tokens", str(service.max_context_tokens + CONTEXT_SLACK_TOKENS),
                 "--threads", str(settings.threads_per_rank), "--max-seconds", f"{lifetime_s:g}"]  # fmt: skip
        if scale.disk is not None:
            words += ["--disk", ",".join(f"{v:.6g}" for v in scale.disk)]
        if scale.recompute is not None:
            words += ["--recompute-pace", ",".join(f"{v:.6g}" for v in scale.recompute)]
        plans.append(ServicePlan(name, tuple(context.command(words)), files, scale, service.memory))
    return tuple(plans)


def contexts_per_app(service: Any) -> int:
    """K: an app holds its share of the run's contexts (context i belongs to app i mod apps)."""
    return math.ceil(service.contexts / service.apps)


def longest_context_bytes(model_dir: Path, service: Any) -> int:
    """What the longest context takes in the checkpoint's bytes at the memory method's storage level
    (float16 for the uncompressed baselines, else INT8; compression below it is not counted on)."""
    model = from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()), "checkpoint")
    bits = 16 if service.memory in FLOAT16_CONTEXT_MEMORY else 8
    chunks = math.ceil((service.max_context_tokens + CONTEXT_SLACK_TOKENS) / service.chunk_tokens)
    return chunks * chunk_bytes_all_layers(model.layers, model.kv_heads, model.head_dim, service.chunk_tokens, bits)


def run_scales(
    inventory: Inventory, base_dir: Path, settings: Any, devices: Sequence[str], model_dir: Path
) -> dict[str, ContextScale]:
    """Each device's scale (its own profile's disk and rates when the run has a target); ``model_dir``:
    the run's checkpoint, resolved against the campaign file."""
    from testbed.target.compute_profiles import load_profile

    service = settings.section("context_service")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if settings.target is None:
        return {d: context_scale(config, service.chunk_tokens, service.budget_gb) for d in devices}
    from testbed.target.emulation import resolve_target

    target = resolve_target(inventory, base_dir, settings, list(inventory.select(list(devices))))
    out = {}
    for name in devices:
        node = target.nodes[name]
        disk = load_profile(node.path).spec.disk
        out[name] = context_scale(config, service.chunk_tokens, service.budget_gb, target=target.model,
                                  rates=node.rates, disk=disk)  # fmt: skip
    return out


# -- applying ------------------------------------------------------------------------------------


def start_services(
    inventory: Inventory, plans: Sequence[ServicePlan], contexts: Mapping[str, NodeContext]
) -> FanOutResult:
    """Start each daemon detached and wait until it answers (or ends, or the timeout passes)."""

    def start(plan: ServicePlan) -> str:  # (the daemon checks its socket's path and directory on its node)
        node = inventory.node(plan.node)
        with transport_for(inventory, node) as t:
            t.run(plan.directory_argv(), timeout_s=30.0).check()
            t.start_background(list(plan.argv), pidfile=plan.files.pidfile, logfile=plan.files.logfile)
            return wait_ready(t, plan, contexts[plan.node])

    by_node = {p.node: p for p in plans}
    return fan_out(list(by_node), lambda name: start(by_node[name]), description="starting the LLM services")


def wait_ready(t: Any, plan: ServicePlan, context: NodeContext, timeout_s: float = READY_TIMEOUT_S) -> str:
    """Poll the daemon's ``stats`` until it answers; a daemon that ends first is a NodeError with its log."""
    check = context.command(plan.check_argv(context.python))
    deadline = time.monotonic() + timeout_s
    while True:
        answer = t.run(check, timeout_s=30.0)
        if answer.exit_code == 0:
            return answer.stdout.strip()
        if answer.exit_code not in (1, 2) or "usage:" in answer.stderr:  # not "cannot reach it yet": say why
            raise NodeError(plan.node, f"the LLM service's check failed (exit status {answer.exit_code}): "
                            f"{(answer.stderr or answer.stdout).strip()[-800:]}")  # fmt: skip
        if t.run_script(background_running_script(plan.files.pidfile), timeout_s=30.0).exit_code != 0:
            log = t.run(plan.log_tail_argv(), timeout_s=30.0).stdout
            raise NodeError(plan.node, f"the LLM service ended before it answered: {log.strip()[-1500:]}")
        if time.monotonic() > deadline:
            raise NodeError(plan.node, f"the LLM service did not answer on {plan.files.socket} in {timeout_s:.0f} s")
        time.sleep(READY_POLL_S)


def stop_services(inventory: Inventory, plans: Sequence[ServicePlan]) -> FanOutResult:
    """Stop each daemon (TERM: the call in flight ends first; KILL after the grace)."""
    by_node = {p.node: p for p in plans}

    def stop(name: str) -> str:
        with transport_for(inventory, inventory.node(name)) as t:
            return t.stop_background(by_node[name].files.pidfile, grace_s=STOP_GRACE_S)

    return fan_out(list(by_node), stop, description="stopping the LLM services")


def plan_services_start(lines: PlanLines, plans: Sequence[ServicePlan], contexts: Mapping[str, NodeContext]) -> None:
    """The services phase's lines of :func:`start_services` (once the run is staged)."""
    for service in plans:
        context = contexts[service.node]
        lines.add(service.node, "services", "make the LLM service's directory (0700: its user's alone)",
                  command_line(service.directory_argv()))  # fmt: skip
        lines.detached(service.node, "services", "start the LLM service (detached)", service.argv,
                       service.files.pidfile, service.files.logfile)  # fmt: skip
        lines.add(service.node, "services", "wait until the LLM service answers",
                  command_line(context.command(service.check_argv(context.python))), "polled")  # fmt: skip
        lines.add(service.node, "services", "is the LLM service still running? (while it does not answer yet)",
                  sh(background_running_script(service.files.pidfile)), "polled")  # fmt: skip
        lines.add(service.node, "services", "read the LLM service's log (it ended before it answered)",
                  command_line(service.log_tail_argv()), "on-failure")  # fmt: skip


def plan_services_stop(lines: PlanLines, plans: Sequence[ServicePlan]) -> None:
    """The restore phase's lines of :func:`stop_services`."""
    for service in plans:
        lines.add(service.node, "restore", "stop the LLM service",
                  sh(background_stop_script(service.files.pidfile, STOP_GRACE_S)))  # fmt: skip
