"""``testbed profile``: measure the inference engine on a node and fit a compute profile."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from foundation.errors import TestbedError
from testbed.cli.app import InventoryOption, JsonOption, app, err, out
from testbed.emulation.resolved import load_lab
from testbed.inventory import Inventory
from testbed.target.compute_profiles import MAX_RATE

TINY = "examples/models/tiny"


@contextlib.contextmanager
def cpu_paced(lab: Inventory, names: list[str]) -> Iterator[None]:
    """The emulated ones of ``names`` paced as a run paces them while the block measures paced steps:
    a quota that never holds the real work back, in short periods. Under the power mode's quota (100 ms
    periods) the profiler's untimed setup used up a period's time and the timed step after it waited
    for the next period: an overrun that measured the quota, not the profile."""
    from testbed.target.emulation import pace_nodes

    if not names:
        yield
        return
    pace_nodes(lab, names, True).require("pacing the node's CPU")
    try:
        yield
    finally:
        pace_nodes(lab, names, False).require("ending the CPU pacing")


@app.command("profile")
def profile(
    node: Annotated[str, typer.Argument(help="The node to measure (an inventory node name).")],
    model: Annotated[str, typer.Option("--model", help="Checkpoint directory, as the node sees it (Hugging "
                                       "Face format: the tiny model or a Llama-family checkpoint).")] = TINY,
    inventory: InventoryOption = Path("inventory.yaml"),
    target: Annotated[str | None, typer.Option("--target", help="Self-check of the emulation: pace every step "
                      "as a run emulating this target model does (vicuna-7b, ...) with the node's own "
                      "profile, and check the fit gives that profile back within 5%.")] = None,
    mode: Annotated[str | None, typer.Option("--mode", help="With --target: the power mode whose numbers "
                                             "pace the steps (default: the node's initial mode).")] = None,
    dilation: Annotated[float, typer.Option("--dilation", help="With --target: stretch every paced step by "
                                            "this factor, so that this machine keeps up.")] = 1.0,
    grid: Annotated[str, typer.Option("--grid", help="quick (a minute) or full (new tokens to 2048, batch to "
                                      "64, context to 4096, 1-4 layers).")] = "quick",
    reps: Annotated[int, typer.Option("--reps", help="Timed repetitions per point (the median is kept; with "
                                      "--target the fastest clean one: load only lengthens a paced step).")] = 3,
    device: Annotated[str, typer.Option("--device", help="Where the node runs the engine: cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="float32, float16, bfloat16 or auto.")] = "auto",
    out_path: Annotated[Path | None, typer.Option("--out", help="Profile file to write (default: "
                        "profiles/<node>.yaml), with its measurements beside it as .measurements.json.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Measure the engine on NODE over a grid of steps (prompt steps of 1 to 2048 tokens, decode
    steps against batch and context, the LM head, several layer counts), fit a compute profile (the
    roofline of examples/profiles) to the medians, and write it with its raw measurements.

    On the emulated testbed, --target measures the paced steps instead and checks that the fit gives
    back the profile they were paced with (exit status 1 when it does not, within 5%)."""
    from nodes.contracts.target_model import from_hf_config
    from testbed.target.emulation import load_target_model, node_mode, node_profile
    from testbed.target.profiling import FULL_GRID, QUICK_GRID, agreement, fit_profile, measure, profile_yaml

    if grid not in ("quick", "full"):
        raise TestbedError(f"--grid {grid!r}: choose quick or full")
    lab = load_lab(inventory)
    spec = lab.node(node)
    known = node_profile(lab, spec)
    paced = None
    if target is not None:
        if known is None:
            raise TestbedError(f"{lab.path}: node {node} has no compute profile to pace with (compute_profile:)")
        chosen = mode or node_mode(spec, {}, known)
        shape = load_target_model(target, Path.cwd())
        paced = (shape, known.rates(chosen), dilation)
    model_dir = str(Path(model).resolve()) if Path(model).is_dir() else model  # emulated nodes share this disk
    with cpu_paced(lab, [node] if paced is not None else []):
        rows, said = measure(lab, spec, model_dir, QUICK_GRID if grid == "quick" else FULL_GRID, reps=reps,
                             device=device, dtype=dtype, paced=paced)  # fmt: skip
    if paced is None:  # the checkpoint's own shape, as the node read it
        shape = from_hf_config(said["config"], Path(model).name, "" if dtype == "auto" else dtype)
    if paced is not None:  # a dilated step lasts k times its target: fit what the target is
        rows = [dataclasses.replace(r, seconds=r.seconds / dilation) for r in rows]
    peak = (known.rates().mem_bw_gbps, known.rates().peak_tflops) if known is not None else (1.0, 1.0)
    if paced is not None:
        peak = (paced[1].mem_bw_gbps, paced[1].peak_tflops)
    # a known peak is the hardware's: no engine beats it. Without one, the rates are fitted as such, up
    # to the largest a profile file accepts
    fit = fit_profile(rows, shape, *peak, max_efficiency=1.0 if known is not None else MAX_RATE)
    if known is None:
        # no peak known: the effective rates are the peak, efficiency 1
        r = fit.rates
        fit = dataclasses.replace(fit, rates=r._replace(
            mem_bw_gbps=r.mem_bw_gbps * r.bw_efficiency, bw_efficiency=1.0,
            peak_tflops=r.peak_tflops * r.flops_efficiency, flops_efficiency=1.0))  # fmt: skip
    rates = fit.rates
    result = {
        "node": node, "model": shape.name, "paced": paced is not None, "points": fit.points,
        "excluded_points": fit.excluded,
        "overrun_repetitions": sum(r.overruns or 0 for r in rows), "rms_log_error": round(fit.rms_log_error, 4),
        "max_relative_error": round(fit.max_relative_error, 4), "rates": rates.to_json(), "engine": said,
        "at_bounds": list(fit.at_bounds),
    }  # fmt: skip
    if paced is not None:
        result["agreement_with_paced_profile"] = round(agreement(rates, paced[1], shape, rows), 4)
    path = out_path or Path("profiles") / f"{node}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    measurements = path.with_suffix(".measurements.json")
    raw = [dataclasses.asdict(r) for r in rows]
    measurements.write_text(json.dumps({"result": result, "dilation": dilation if paced else 1.0,
                                        "measurements": raw}, indent=1) + "\n")  # fmt: skip
    extra = {}
    if known is not None:
        extra = {"description": known.spec.description, "peak_source": f"as in {known.path}",
                 "memory_source": f"as in {known.path}", "host_link_gbps": known.spec.host_link_gbps,
                 "host_link_source": f"as in {known.path}",
                 "disk": (known.spec.disk.read_mbps, known.spec.disk.write_mbps, known.spec.disk.io_latency_ms),
                 "disk_source": f"as in {known.path}"}  # fmt: skip
    hardware = known.hardware if known is not None else spec.model
    memory_gb = known.spec.memory_gb if known is not None else 1.0
    path.write_text(profile_yaml(hardware, node, fit, shape, memory_gb, extra, measurements.name))
    if as_json:
        out.print_json(data=result)
    else:
        table = Table(title=f"{node}: fitted compute profile ({fit.points} points, {fit.excluded} left out: "
                      f"every repetition overran)")
        for column in ("field", "value"):
            table.add_column(column)
        for key, value in rates.to_json().items():
            table.add_row(key, f"{value:.6g}")
        table.add_row("rms log error", f"{fit.rms_log_error:.4f}")
        table.add_row("largest relative error", f"{fit.max_relative_error:.2%}")
        if fit.at_bounds:
            table.add_row("not determined by the steps (at their bound)", ", ".join(fit.at_bounds))
        if "agreement_with_paced_profile" in result:
            table.add_row("differs from the paced profile by", f"{result['agreement_with_paced_profile']:.2%}")
        out.print(table)
        err.print(f"wrote {path} and {measurements}")
    if paced is not None and result["agreement_with_paced_profile"] > 0.05:
        err.print(f"the fit differs from the profile the steps were paced with by "
                  f"{result['agreement_with_paced_profile']:.1%} (more than 5%)")  # fmt: skip
        raise typer.Exit(1)
