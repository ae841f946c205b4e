"""The report's sections of each method family beside the common ones (:mod:`analysis.report`): the
paced steps' fidelity (target emulation), Andes' serving (QoE by length and rate, capacity), CoCoServe's
GPU serving, DiSCo's dispatch (cost and TTFT), LLMS's context switching (Fig. 9 and 10)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import comparison, context_switching, dispatch, fidelity, gpu_serving, metrics, plots
from analysis.load import CampaignData
from analysis.report_document import Report


def fidelity_section(report: Report, steps: pd.DataFrame, done: pd.DataFrame) -> None:
    """The target emulation's fidelity: per run and node, the share of paced steps that overran the
    time the compute profile gave them; runs over the limit are named (their latencies are in part
    this machine's). Nothing when no run was paced."""
    if steps.empty:
        return
    shares = fidelity.violation_shares(steps[steps["run_id"].isin(set(done["run_id"]))])
    limit = f"{fidelity.VIOLATION_LIMIT:.0%}"
    report.lines += ["## Fidelity of the target emulation", ""]
    report.table("fidelity", shares,
                 "Paced steps per run and node: how many overran their target time, and their share; over "
                 f"{limit} flags the run. `computed_over`: the real computation took longer than the compute "
                 "profile predicts for the target (this machine lacked CPU); `woke_late`: it kept up, but the rank "
                 "woke from its wait late (it waited for a core).", digits=4)  # fmt: skip
    flagged = sorted(set(shares.loc[shares["flagged"], "run_id"]))
    if flagged:
        report.lines += [f"**Flagged runs:** {', '.join(flagged)}: more than {limit} of a node's steps overran; "
                         "raise `target.dilation` (or emulate fewer nodes) so that this machine keeps up.", ""]
    else:
        report.lines += [f"Every node of every run kept its overruns at or under {limit} of its steps.", ""]


def _interval_text(value: dict | None, scale: float = 1.0, unit: str = "") -> str:
    if not value:
        return ""
    estimate, low, high = (value[k] * scale for k in ("estimate", "low", "high"))
    text = f"{estimate:.4g}{unit} [{low:.4g}, {high:.4g}]"
    return text + (" (within noise)" if value.get("within_noise") else "")


def intervals_section(report: Report, requests: pd.DataFrame, tokens: pd.DataFrame, done: pd.DataFrame,
                      by: list[str], baseline: dict[str, object]) -> None:  # fmt: skip
    """Means with their 95% intervals per group of ``by`` (bootstrap over requests and repetitions), and
    each group's change against ``baseline`` on the same requests, marked where it is within noise."""
    units = comparison.request_units(requests, tokens, done, by)
    if units.empty:
        return
    means = comparison.group_means(units, by)
    report.lines += ["## Means and differences with 95% intervals", ""]
    rows = [{**m["settings"], "requests": m["requests"], "repetitions": m["repetitions"],
             "ttft_ms": _interval_text(m.get("ttft_ms")), "tbt_ms": _interval_text(m.get("tbt_ms")),
             "qoe": _interval_text(m.get("qoe"))} for m in means]  # fmt: skip
    report.table("means_with_intervals", pd.DataFrame(rows).replace("", np.nan).dropna(axis=1, how="all"),
                 "Mean TTFT and TBT (ms) and QoE per group, each with its 95% interval [low, high]: a bootstrap "
                 "over requests, and over repetitions where there are several (a request's token gaps stay "
                 "together).")  # fmt: skip
    if not baseline:
        return
    changes = comparison.changes_against(units, by, baseline)
    if not changes:
        return
    rows = [{**c["settings"], "pairs": c["pairs"], "ttft_change_pct": _interval_text(c.get("ttft_change"), 100, "%"),
             "tbt_change_pct": _interval_text(c.get("tbt_change"), 100, "%"),
             "qoe_change_pct": _interval_text(c.get("qoe_change"), 100, "%")} for c in changes]  # fmt: skip
    against = ", ".join(f"{k}={v}" for k, v in baseline.items())
    report.table("changes_with_intervals", pd.DataFrame(rows).replace("", np.nan).dropna(axis=1, how="all"),
                 f"Each group's change of its mean against {against} (the group that differs only there), on the "
                 "requests both served (the same request of the same repetition): the change with its 95% "
                 "interval. *Within noise*: the interval includes no change, so this campaign cannot tell the "
                 "two apart; run more requests or repetitions.")  # fmt: skip
    noise = [c for c in changes if any((c.get(k) or {}).get("within_noise") for k in ("ttft_change", "tbt_change"))]
    if noise:
        report.lines += [f"**Within noise:** {len(noise)} of {len(changes)} groups differ from {against} by less "
                         "than this campaign can resolve in TTFT or TBT.", ""]  # fmt: skip


SERVING_AXES = ("workload.rate_per_s", "workload.arrival", "workload.cv", "workload.qoe", "serving.preemption_cap",
                "serving.lookahead_s", "serving.capacity_tokens")  # fmt: skip


def serving_section(report: Report, requests: pd.DataFrame, tokens: pd.DataFrame, qoe: pd.DataFrame,
                    done: pd.DataFrame, axes: list[str]) -> None:  # fmt: skip
    """Andes' view of the serving runs: Table 4's layout per scheduler (and per rate, trace, cap...),
    and each scheduler's capacity when the rate varies."""
    serving = done[done["serving.scheduler"].notna()]
    by = ["serving.scheduler", *[a for a in SERVING_AXES if a in axes]]
    mine = requests[requests["run_id"].isin(serving["run_id"])]
    table = metrics.serving_table(mine, tokens, qoe, serving, by)
    report.lines += ["## Serving (Andes Table 4 layout)", ""]
    report.table("serving", table,
                 "Per scheduler: QoE (Eq. 1, every request with an expectation; a refused one counts 0), TTFT "
                 "(s) and TDS (tokens/s from the first token to the last, before the client's buffer) at "
                 "p10/p50/p90; preemptions per request; requests refused (their prompt alone exceeds the KV "
                 "capacity); generated tokens per second over each run's span.", digits=3)  # fmt: skip
    if "workload.rate_per_s" in by:
        others = [c for c in by if c != "workload.rate_per_s"]
        lines = []
        for values, part in table.groupby(others, sort=True):
            label = ", ".join(f"{c}={v}" for c, v in zip(others, values if isinstance(values, tuple) else (values,),
                                                            strict=True))  # fmt: skip
            capacity = metrics.capacity_per_s(part["workload.rate_per_s"], part["qoe_mean"])
            lines.append(f"{label}: {'none' if np.isnan(capacity) else f'{capacity:g} requests/s a device'}")
        report.lines += ["Capacity (the highest tested rate whose mean QoE is at least 0.9, Andes Sec. 6.1): "
                         + "; ".join(lines) + ".", ""]  # fmt: skip
    served = metrics.served_requests(mine, tokens, qoe, serving, by)
    where = ""
    if "workload.rate_per_s" in by:  # Fig. 14 is at one rate: the knee, the highest that some scheduler holds
        holding = table.loc[table["qoe_mean"] >= metrics.QOE_THRESHOLD, "workload.rate_per_s"]
        knee = float(holding.max() if len(holding) else table["workload.rate_per_s"].min())
        served = served[served["workload.rate_per_s"] == knee]
        by = [c for c in by if c != "workload.rate_per_s"]
        where = f" at {knee:g} requests/s a device (the highest rate some scheduler holds at mean QoE 0.9)"
    by_length = metrics.qoe_by_length(served, by)
    report.table("qoe_by_length", by_length,
                 f"QoE against the request's total length (prompt + requested response){where}, in bins of "
                 "equal request counts (Andes Fig. 14: which lengths a scheduler starves).", digits=3)  # fmt: skip
    report.figure("qoe_vs_length", plots.qoe_vs_length(by_length, by),
                  f"Mean and p10 QoE against the request's total length{where}.")  # fmt: skip


def gpu_serving_section(report: Report, data: CampaignData, requests: pd.DataFrame, done: pd.DataFrame,
                        axes: list[str]) -> None:  # fmt: skip
    """CoCoServe's view of the GPU-rank runs: throughput, latency, SLO attainment, OOM rate and memory
    against load per method (Fig. 8, 10, 11), the SLO knees, and the controller's actions in order."""
    by = ["method", *[a for a in axes if a != "method"]]
    mine = requests[requests["run_id"].isin(done["run_id"])]
    table = gpu_serving.gpu_serving_table(mine, done, data.scaling_ticks, by)
    report.lines += ["## GPU serving (CoCoServe Fig. 8, 10 and 11)", ""]
    report.table("gpu_serving", table,
                 "Per method and setting: output tokens and completed requests per second over each run's span "
                 "(requests that failed out of memory add nothing), E2E latency (s) of finished requests, SLO "
                 "attainment (finished within the engine's SLO: slo_factor times the request's time alone on "
                 "an idle server; a failed request misses it), OOM rate (the share of requests that failed "
                 "out of memory), the most GPU memory (GB) held at once and the GPUs that held any.", digits=3)
    rate = "workload.rate_per_s"
    if rate in by:
        knees = gpu_serving.slo_knees(table, rate, [c for c in by if c != rate])
        report.table("gpu_serving_knees", knees,
                     f"The SLO knee: the highest tested rate (requests/s a client) with SLO attainment at least "
                     f"{gpu_serving.KNEE_ATTAINMENT:g} (CoCoServe Fig. 11).", digits=3)  # fmt: skip
    trace = gpu_serving.action_trace(data.scaling_ops, done, by)
    if not trace.empty:
        report.table("scaling_actions", trace,
                     "Every action of the scaling controller in order (the engine's clock, target seconds): "
                     "replicas added (Algorithm 1), layers migrated and replicas evicted, the batch cap "
                     "reduced or restored (Algorithm 2), with the operation's seconds and the bytes it moved "
                     "(the target's).", digits=4)  # fmt: skip


def dispatch_section(report: Report, requests: pd.DataFrame, tokens: pd.DataFrame, done: pd.DataFrame) -> None:
    """DiSCo's view of the dispatch runs: per run, TTFT mean and P99 against the budget, the realised
    budget and cost; Table 2's reduction against Stoch where both ran at the same budgets; Table 3's
    migration counts where migration ran."""
    runs = dispatch.live_runs(requests, tokens, done)
    if runs.empty:
        return
    report.lines += ["## Dispatch (DiSCo Sec. 5)", ""]
    shown = runs.assign(cost_micro_usd_per_request=runs["cost_usd_per_request"] * 1e6)
    shown = shown.drop(columns=["run_id", "slipped_tokens_mean", "cost_usd_per_request"]).sort_values(
        ["trace", "device", "regime", "policy", "budget", "migration"])  # fmt: skip
    report.table("dispatch_runs", shown,
                 "Per run: TTFT mean and P99 (s, from each request's arrival on its device), the realised budget "
                 "(the constrained endpoint's share of all input tokens in the race: a cancelled server request "
                 "is billed in full, a cancelled device prefill by the share it did), cost per request (micro-USD: the "
                 "service's API price and the device's FLOPs at the regime's rate, DiSCo App. E), the share the "
                 "device answered first, migrations (tokens the client held when one began) and token mismatches "
                 "at a handoff (0 when both ends run the same model greedily). Server times replay a service "
                 "trace and the device is paced to its measured rates: modeled.", digits=3)  # fmt: skip
    plain = runs[~runs["migration"]]
    pairs = {("server", "stoch-s", "disco-s"), ("device", "stoch-d", "disco-d")}
    if any({stoch, disco} <= set(plain.loc[plain["regime"] == regime, "policy"]) for regime, stoch, disco in pairs):
        rows = plain
        for regime, stoch, disco in pairs:  # the table needs both columns; a regime without them drops out
            if not {stoch, disco} <= set(rows.loc[rows["regime"] == regime, "policy"]):
                rows = rows[rows["regime"] != regime]
        table2 = dispatch.tail_reduction_table(rows)
        report.table("dispatch_tail_reduction", table2.reset_index(),
                     "P99 TTFT reduction against Stoch (%), averaged over the budgets both ran at (DiSCo Table 2).",
                     digits=1)  # fmt: skip
    if runs["migration"].any():
        report.table("dispatch_migration", dispatch.migration_table(runs),
                     "Migrated requests (DiSCo Table 3): their share, the tokens the client held when the "
                     "migration began (the paper's delay_num), and the P99 gap between shown tokens.",
                     digits=3)  # fmt: skip


CONSTRAINTS_MS = (10.0, 25.0)  # LLMS Fig. 10's switching-latency constraints


def context_service_section(report: Report, requests: pd.DataFrame, done: pd.DataFrame) -> None:
    """LLMS's view of the context-service runs (method ``llms``): Fig. 9's mean switching latency per
    pattern, active contexts and memory method (the ablations of Fig. 13 are methods; budgets and chunk
    sizes, Fig. 10 and 14, are keys), with what the switches read, recomputed and wrote, and Fig. 10's
    most active contexts each method holds under 10 and 25 ms."""
    mine = requests[requests["switch_switch_s"].notna() & requests["run_id"].isin(set(done["run_id"]))]
    if mine.empty:
        return
    runs = done[done["run_id"].isin(set(mine["run_id"]))]
    rows = context_switching.with_settings(mine, runs)
    table = context_switching.switching_table(rows)
    report.lines += ["## Context service (LLMS Fig. 9, 10, 13 and 14)", ""]
    targets = runs["target.model"].dropna() if "target.model" in runs.columns else pd.Series(dtype=object)
    if len(targets) == len(runs):
        timing = (f"Times are the target's ({', '.join(sorted(set(map(str, targets))))} on the device's profile): "
                  "modeled, not measured.")  # fmt: skip
    elif len(targets):
        timing = (f"Times of the runs with a target ({len(targets)} of {len(runs)}) are the target's, modeled; the "
                  "others', this machine's, measured.")  # fmt: skip
    else:
        timing = "Times are this machine's, measured."
    bytes_note = (" Bytes are the checkpoint's (a target's are the manifest's `target_over_model` times more)."
                  if len(targets) else "")  # fmt: skip
    report.table("context_switching", table,
                 "Context switching (LLMS Fig. 9; budget and chunk size for Fig. 10 and 14; the ablations of "
                 "Fig. 13 as memory methods): per switching pattern, active contexts and memory method, over "
                 "the calls to a context with a past (a context's first call and a restarted context left out): "
                 "their count, the switching latency (ms, from the call until its context is resident: mean, P50, "
                 "P99), the mean chunks per switch that were missing, recomputed and read, the MiB read and "
                 "written at switch time and the faults (summed over the switches), and the mean latency over "
                 "LLMS's at the same pattern, contexts, budget and chunk size. "
                 f"{timing}{bytes_note}", digits=3)  # fmt: skip
    limits = [context_switching.max_contexts_under(table, limit).rename(columns={
        "max_contexts": f"max_contexts_{limit:g}ms", "interpolated_contexts": f"contexts_at_{limit:g}ms",
        "every_tested_within": f"beyond_sweep_{limit:g}ms"}) for limit in CONSTRAINTS_MS]  # fmt: skip
    keys = [c for c in limits[0].columns if not c.startswith(("max_contexts", "contexts_at", "beyond_sweep"))]
    held = limits[0]
    for more in limits[1:]:
        held = held.merge(more, on=keys, how="outer")
    report.table("context_max_contexts", held,
                 "The most active contexts each memory method holds (LLMS Fig. 10): the largest tested number "
                 "of contexts whose mean switching latency is at most "
                 + " and ".join(f"{limit:g} ms" for limit in CONSTRAINTS_MS) + " (0: none tested is), and "
                 "`contexts_at_*`, the count at which the latency reaches the constraint (linear between the "
                 "tested counts, from one context at 0 ms: the paper's fractional counts; `beyond_sweep_*` "
                 "when every tested count was within, so the real limit is higher). " + timing,
                 digits=2)  # fmt: skip
