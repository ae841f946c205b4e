"""``testbed profile``: measure the engine on a node over a grid and fit a compute profile to it.

The node times its steps (``python -m nodes.workers.profile_engine``: prompt steps, decode steps
against batch and context, LM head steps, for several layer counts). The fit finds the roofline's
effective bandwidth and throughput and its fixed costs (per step, per layer) that best explain the
points' times (least squares on log time, Nelder-Mead, for each knee sharpness in :data:`SHARPNESSES`).
The result is written as a profile file (with the hardware's peak from its existing profile when it
has one, so the efficiencies are shares of that peak) beside its raw measurements.

On the emulated testbed with ``--target``, the node paces every step with its own profile, so the
fit must give that profile back: the self-check compares both profiles' predictions over the grid.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundation.errors import NodeError, TestbedError
from nodes.contracts.compute_profile import ModeRates, step_seconds
from nodes.contracts.target_model import TargetModel
from testbed.commands.node_context import ensure_node_code, resolve_context
from testbed.inventory import Inventory, NodeSpec
from testbed.target.compute_profiles import MIN_EFFICIENCY
from testbed.transport import open_transport

SHARPNESSES = (1.4, 1.5, 2.0, 3.0, 4.0)
MAX_OVERHEAD_MS = 1000.0  # per step or per layer: the largest fixed cost a fit may give
QUICK_GRID = {"layers": "1,2", "prefill": "1,64,256", "batch": "1,8", "context": "0,256", "head": "1,8"}
FULL_GRID = {"layers": "1,2,4", "prefill": "1,16,128,512,2048", "batch": "1,8,32,64", "context": "0,512,2048,4096",
             "head": "1,8,64"}  # fmt: skip


@dataclass(frozen=True)
class Measurement:
    op: str  # layers | head
    layers: int
    tokens: int
    sequences: int
    context_tokens: int
    seconds: float
    overruns: int | None = None  # paced: repetitions that overran (they measured this machine)
    clean_reps: int | None = None  # paced: repetitions that did not (the point is their fastest)

    @property
    def usable(self) -> bool:
        """Whether the point measured what it meant to: unpaced, or paced with a clean repetition."""
        if self.seconds <= 0:
            return False
        return not self.overruns if self.clean_reps is None else self.clean_reps > 0

    def predicted_s(self, rates: ModeRates, model: TargetModel) -> float:
        segments = [(self.tokens, self.context_tokens)] * self.sequences
        if self.op == "head":
            return step_seconds(rates, model, 0, segments, head_tokens=self.tokens)
        return step_seconds(rates, model, self.layers, segments)


@dataclass(frozen=True)
class Fit:
    rates: ModeRates
    rms_log_error: float
    max_relative_error: float
    points: int
    excluded: int  # paced points whose every repetition overran (they measure this machine)
    at_bounds: tuple[str, ...] = ()  # rates the steps did not determine: the fit stopped at their bound


def measure(
    inventory: Inventory, node: NodeSpec, model_dir: str, grid: dict[str, str], *, reps: int = 3, device: str = "cpu",
    dtype: str = "auto", paced: tuple[TargetModel, ModeRates, float] | None = None, timeout_s: float = 1800.0,
) -> tuple[list[Measurement], dict[str, Any]]:  # fmt: skip
    """Run the node's profiler over ``grid``; its measurements and what it said of itself."""
    argv = ["-m", "nodes.workers.profile_engine", "--model", model_dir, "--reps", str(reps), "--device", device,
            "--dtype", dtype, *[w for k, v in grid.items() for w in (f"--{k}", v)]]  # fmt: skip
    if paced is not None:
        target, rates, dilation = paced
        argv += ["--target", json.dumps(target.to_json()), "--rates", json.dumps(rates.to_json()),
                 "--dilation", str(dilation)]  # fmt: skip
    with open_transport(inventory, node) as t:
        context = resolve_context(inventory, node, t)
        ensure_node_code(t, context)
        result = t.run(context.command([context.python, *argv]), timeout_s=timeout_s)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if result.exit_code != 0 or not rows or not rows[-1].get("done"):
        raise NodeError(node.name, f"the profiler failed (exit status {result.exit_code}): "
                                   f"{(result.stderr or result.stdout).strip()[-600:]}")  # fmt: skip
    return [Measurement(**{k: r[k] for k in Measurement.__dataclass_fields__ if k in r}) for r in rows[:-1]], rows[-1]


def _nelder_mead(loss: Callable[[np.ndarray], float], start: np.ndarray, steps: int = 1500) -> np.ndarray:
    """Minimise ``loss`` from ``start`` (a plain Nelder-Mead: the fit has four parameters)."""
    simplex = [start] + [start + np.eye(len(start))[i] * (0.5 if start[i] == 0 else 0.2 * abs(start[i]) + 0.1)
                         for i in range(len(start))]  # fmt: skip
    values = [loss(x) for x in simplex]
    for _ in range(steps):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < 1e-12:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = loss(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = loss(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = loss(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [loss(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def fit_profile(
    measurements: Sequence[Measurement], model: TargetModel, peak_bw_gbps: float, peak_tflops: float,
    max_efficiency: float = 1.0,
) -> Fit:
    """The roofline that best explains ``measurements`` of ``model``'s steps (points left out whose
    every repetition overran). Efficiencies stay within [:data:`MIN_EFFICIENCY`, ``max_efficiency``]
    of the peak and overheads within :data:`MAX_OVERHEAD_MS`: where the steps do not tell a rate (a
    model so small that reading its weights takes no time), the fit stops at a bound instead of
    wandering off to numbers no hardware has (:attr:`Fit.at_bounds` names them)."""
    usable = [m for m in measurements if m.usable]
    if len(usable) < 4:
        raise TestbedError(f"{len(usable)} usable measurements: too few to fit a profile (widen the grid)")
    measured = np.log([m.seconds for m in usable])
    low, high = math.log(MIN_EFFICIENCY), math.log(max_efficiency)

    def rates_of(x: np.ndarray, p: float) -> ModeRates:
        bw, flops = (math.exp(min(high, max(low, v))) for v in x[:2])
        step_ms, layer_ms = (min(MAX_OVERHEAD_MS, abs(v)) for v in x[2:])
        return ModeRates(peak_bw_gbps, peak_tflops, bw, flops, step_ms * 1e-3, layer_ms * 1e-3, p)

    best: tuple[float, ModeRates] | None = None
    for p in SHARPNESSES:

        def loss(x: np.ndarray, p: float = p) -> float:
            r = rates_of(x, p)
            return float(np.mean((np.log([m.predicted_s(r, model) for m in usable]) - measured) ** 2))

        x = _nelder_mead(loss, np.array([math.log(0.5), math.log(0.5), 0.0, 0.0]))
        x = _nelder_mead(loss, x)  # a restart from the first answer
        value = loss(x)
        if best is None or value < best[0]:
            best = (value, rates_of(x, p))
    assert best is not None
    rates = best[1]
    errors = [abs(m.predicted_s(rates, model) / m.seconds - 1) for m in usable]
    bounds = {"bw_efficiency": (MIN_EFFICIENCY, max_efficiency), "flops_efficiency": (MIN_EFFICIENCY, max_efficiency),
              "step_overhead_s": (0.0, MAX_OVERHEAD_MS * 1e-3), "layer_overhead_s": (0.0, MAX_OVERHEAD_MS * 1e-3)}
    at_bounds = tuple(name for name, (lo, hi) in bounds.items()
                      if hi > 0 and (math.isclose(getattr(rates, name), hi, rel_tol=1e-9)
                                     or (lo > 0 and math.isclose(getattr(rates, name), lo, rel_tol=1e-9))))
    return Fit(rates, math.sqrt(best[0]), max(errors), len(usable), len(measurements) - len(usable), at_bounds)


def agreement(a: ModeRates, b: ModeRates, model: TargetModel, measurements: Sequence[Measurement]) -> float:
    """The largest relative difference between two profiles' predictions over the grid's points."""
    return max(abs(m.predicted_s(a, model) / m.predicted_s(b, model) - 1) for m in measurements)


def profile_yaml(hardware: str, node: str, fit: Fit, model: TargetModel, memory_gb: float, extra: dict[str, Any],
                 measurements_file: str) -> str:  # fmt: skip
    """A profile file for the fitted rates (``testbed/target/compute_profiles.py``'s format), sources given."""
    r, when = fit.rates, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    where = f"measured by `testbed profile {node}` on {when} with {model.name} ({measurements_file})"
    return "\n".join([
        f"# Fitted by testbed profile from {fit.points} measured steps on {node}: rms log error "
        f"{fit.rms_log_error:.3f}, largest relative error {fit.max_relative_error:.1%}.",
        f"hardware: {hardware}",
        f"description: {json.dumps(extra.get('description', hardware))}",
        f"memory_gb: {memory_gb:g}",
        f"host_link_gbps: {extra.get('host_link_gbps', r.mem_bw_gbps):g}",
        "disk: {{read_mbps: {:g}, write_mbps: {:g}, io_latency_ms: {:g}}}".format(*extra.get("disk", (500, 250, 0.2))),
        f"peak: {{mem_bw_gbps: {r.mem_bw_gbps:g}, tflops: {r.peak_tflops:g}}}",
        "efficiency:",
        f"  bw: {min(1.0, r.bw_efficiency):.4f}",
        f"  flops: {min(1.0, r.flops_efficiency):.4f}",
        f"  sharpness: {r.sharpness:g}",
        f"  step_overhead_ms: {r.step_overhead_s * 1e3:.4f}",
        f"  layer_overhead_ms: {r.layer_overhead_s * 1e3:.4f}",
        "modes:",
        "  default: {}",
        "sources:",
        f"  memory_gb: {extra.get('memory_source', 'the node as the inventory describes it')}",
        f"  host_link_gbps: {extra.get('host_link_source', 'assumed equal to the memory bandwidth')}",
        f"  disk: {extra.get('disk_source', 'not measured by testbed profile (placeholder values)')}",
        f"  peak: {extra.get('peak_source', 'the fitted effective rates themselves (no peak known)')}",
        f"  efficiency: {where}",
        f"  modes: {where}",
        "",
    ])  # fmt: skip
