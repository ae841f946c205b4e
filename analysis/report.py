"""A campaign's report: ``report/report.md`` with PNG figures and CSV tables (``testbed report``).

Sections: per-method latency in the layout of HAT's Table 5, per-configuration latency, TTFT and
TBT against the request rate, HAT's SLA compliance CDFs, Andes QoE (distribution, by rate,
capacity), energy per token by node and power mode, DiSCo cost per request, LLMS's context-switching
latency (Fig. 9) and the contexts a method holds under a latency constraint (Fig. 10), one run's token
delivery curves against the expected curve, one run's telemetry timeline, and the ledger's
failures. Every number comes from :mod:`analysis.metrics`; measured and modeled energy are kept
apart, and the report says which is which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis import context_switching, dispatch, fidelity, gpu_serving, metrics, plots
from analysis.cost_model import DEVICE_USD_PER_PFLOP, ModelShape
from analysis.load import CampaignData, load
from analysis.summary import attention_lines, write_summary

IGNORED_SETTINGS = ("seed", "repetition", "origin_ts_s")


@dataclass(frozen=True)
class ReportOptions:
    """What the report assumes where the campaign does not say."""

    api: str = "gpt-4o-mini"  # DiSCo Table 8 price for the server's share
    device_usd_per_pflop: float = DEVICE_USD_PER_PFLOP["server-constrained"]
    qoe_alpha: float | None = None  # Andes' optional TTFT penalty
    delivery_run: str | None = None  # the run whose timelines are drawn (default: the lowest mean QoE)


@dataclass
class Report:
    directory: Path
    lines: list[str] = field(default_factory=list)

    def table(self, name: str, frame: pd.DataFrame, caption: str, digits: int = 1) -> None:
        path = self.directory / f"{name}.csv"
        frame.to_csv(path, index=False)
        self.lines += [caption, "", markdown_table(frame, digits), "", f"[{path.name}]({path.name})", ""]

    def figure(self, name: str, fig: Figure, caption: str) -> None:
        path = self.directory / f"{name}.png"
        fig.savefig(path, dpi=110)
        self.lines += [f"![{caption}]({path.name})", "", f"*{caption}*", ""]


def markdown_table(frame: pd.DataFrame, digits: int = 1) -> str:
    if frame.empty:
        return "(no rows)"
    shown = frame.copy()
    for column in shown.columns:
        if pd.api.types.is_float_dtype(shown[column]):
            shown[column] = shown[column].map(lambda v: "" if pd.isna(v) else f"{v:.{digits}f}")
    shown = shown.astype(object).where(shown.notna(), "")
    lines = ["| " + " | ".join(str(c) for c in shown.columns) + " |", "|" + "---|" * len(shown.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in shown.itertuples(index=False)]
    return "\n".join(lines)


def varying_settings(runs: pd.DataFrame) -> list[str]:
    """The settings columns that differ between the campaign's runs (the matrix's axes)."""
    skip = {"run_id", "position", "label", "state", "attempts", "started_s", "ended_s", "reason", "failed_node",
            *IGNORED_SETTINGS}  # fmt: skip
    out = []
    for column in runs.columns:
        if column in skip:
            continue
        values = runs[column].map(lambda v: json.dumps(v, sort_keys=True, default=str) if isinstance(v, list | dict)
                                  else v)  # fmt: skip
        if values.nunique(dropna=False) > 1:
            out.append(column)
    return out


def _model_shape(directory: Path) -> ModelShape | None:
    """The model's shape from the config.json a manifest recorded, or from the model directory it
    names if that is still readable; None when neither is."""
    for path in sorted((directory / "runs").glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        if manifest.get("model_config"):
            return ModelShape.from_config(manifest["model_config"])
        model = manifest.get("model_directory")
        if model and (Path(model) / "config.json").is_file():
            return ModelShape.from_model_dir(model)
    return None


def _per_run(data: CampaignData, latencies: pd.DataFrame, gaps: pd.DataFrame, qoe: pd.DataFrame) -> pd.DataFrame:
    per = latencies.groupby("run_id").agg(requests=("ttft_s", "size"), ttft_ms_mean=("ttft_s", "mean"),
                                          ttft_ms_p90=("ttft_s", lambda s: s.quantile(0.9)))  # fmt: skip
    per[["ttft_ms_mean", "ttft_ms_p90"]] *= 1e3
    tbt = gaps.groupby("run_id")["gap_s"].agg(tbt_ms_mean="mean", tbt_ms_p90=lambda s: s.quantile(0.9)) * 1e3
    q = qoe.groupby("run_id")["qoe"].mean().rename("qoe_mean")
    return data.runs.merge(per.join(tbt, how="outer").join(q, how="outer").reset_index(), on="run_id", how="inner")


def _power_mode(runs: pd.DataFrame, run_id: str, node: str) -> str:
    column = f"power.{node}"
    if column in runs.columns:
        value = runs.loc[runs["run_id"] == run_id, column]
        if len(value) and pd.notna(value.iloc[0]):
            return str(value.iloc[0])
    return "-"


def _utilisation(telemetry: pd.DataFrame) -> pd.DataFrame:
    """CPU utilisation per node and sample: the node's aggregate sensor (``cpu`` or ``cgroup``)."""
    cpu = telemetry[telemetry["metric"] == "cpu_util_pct"]
    aggregate = cpu[cpu["sensor"].isin(["cpu", "cgroup"])]
    return aggregate if not aggregate.empty else cpu.groupby(["node", "t_s"], as_index=False)["value"].mean()


def method_lines(directory: Path) -> list[str]:
    """What each method of the campaign is and what to read for it, as its plugin described it in the
    runs' manifests (nodes/contracts/methods)."""
    described: dict[str, dict] = {}
    for path in sorted((directory / "runs").glob("*/manifest.json")):
        method = json.loads(path.read_text()).get("method")
        if isinstance(method, dict) and method.get("name"):
            described.setdefault(method["name"], method)
    if not described:
        return []
    lines = ["## Methods", ""]
    for name, m in described.items():
        notes = "; ".join(m.get("report_notes") or [])
        lines.append(f"- **{name}**: {m.get('summary', '')} (prefill: {m.get('prefill')}, decode: {m.get('decode')})"
                     + (f". Read: {notes}." if notes else ""))  # fmt: skip
    return [*lines, ""]


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


def build_report(campaign_dir: str | Path, options: ReportOptions | None = None) -> Path:
    """Compute every metric of the campaign, write the report's tables, figures and markdown into
    ``<campaign>/report/`` and return the markdown file's path."""
    options = options or ReportOptions()
    directory = Path(campaign_dir)
    data = load(directory)
    out = directory / "report"
    out.mkdir(parents=True, exist_ok=True)
    write_summary(directory, data)
    report = Report(out)
    runs, requests, tokens = data.runs, data.requests, data.tokens
    done = runs[runs["state"] == "done"] if "state" in runs else runs
    r = report.lines
    r += [f"# Campaign report: {directory.name}", "",
          f"{len(runs)} runs in the ledger: {int((runs['state'] == 'done').sum())} done, "
          f"{int((runs['state'] == 'failed').sum())} failed, {int((runs['state'] == 'skipped').sum())} skipped. "
          "Only done runs enter the tables and figures. Latency is stamped on the device that issued each "
          "request, on its monotonic clock; TBT is every gap between consecutive tokens of a request.", ""]  # fmt: skip
    tel = data.telemetry
    modeled = sorted(set(tel.loc[tel["kind"] == "modeled", "node"])) if {"kind", "node"} <= set(tel.columns) else []
    if modeled:
        r += [f"Modeled telemetry (not measured): {', '.join(modeled)}. Energy figures for these nodes come from "
              "the emulated power model, and are never added to measured energy.", ""]  # fmt: skip
    r += method_lines(directory)
    switching, switching_done = requests.iloc[:0], done
    if "switch_switch_s" in requests.columns:  # context-service calls: their own section, no tokens or TTFT
        calls = requests["switch_switch_s"].notna()
        switching, requests = requests[calls & requests["run_id"].isin(set(done["run_id"]))], requests[~calls]
        done = done[~done["run_id"].isin(set(switching["run_id"]) - set(requests["run_id"]))]
    if requests.empty or done.empty:
        if not switching.empty:
            context_service_section(report, switching, switching_done)
        else:
            r += ["No completed run with requests: nothing to report.", ""]
        r += attention_lines(directory)
        path = out / "report.md"
        path.write_text("\n".join(r) + "\n")
        return path

    ids = set(done["run_id"])
    requests, tokens = requests[requests["run_id"].isin(ids)], tokens[tokens["run_id"].isin(ids)]
    axes = varying_settings(done)
    settings = done[["run_id", *dict.fromkeys(["method", *axes])]]  # method labels every figure, varied or not
    latencies = metrics.request_latencies(requests).merge(settings, on="run_id")
    gaps = metrics.token_gaps_s(tokens)
    qoe = metrics.qoe_table(requests, tokens, options.qoe_alpha).merge(settings, on="run_id")
    per_run = _per_run(data, latencies, gaps, qoe)

    r += ["## Latency by method (HAT Table 5 layout)", ""]
    table_by = [c for c in ("workload.prompts", "method") if c in done.columns]
    table = metrics.latency_table(requests, tokens, done, by=table_by, gaps=gaps)
    steps = requests[requests["completed"]].merge(done[["run_id", *table_by]], on="run_id")
    table = table.merge(metrics.tokens_per_decode_step(steps, by=table_by).reset_index(), on=table_by)
    if {"speculative_accepted", "speculative_rounds"} <= set(requests.columns):
        spec = requests[requests["completed"]].merge(done[["run_id", *table_by]], on="run_id")
        length = metrics.acceptance_length_by(spec, table_by)
        table = table.merge(length.reset_index(), on=table_by, how="left")
    report.table("latency_by_method", table,
                 "TTFT and TBT in ms (mean and percentiles over all requests and token gaps of the method's runs), "
                 "per prompt set (HAT's dataset column) and method. `tokens_per_decode_step` is the decode tokens "
                 "over the decode steps of all requests: the acceptance length (bonus token counted, as vLLM "
                 "reports it) for speculative methods, 1 for plain decoding. `acceptance_length` (speculative "
                 "methods) is vLLM's: 1 + accepted draft tokens / verification rounds, the bonus token counted; "
                 "the two differ only by rounds cut short by the output limit or EOS.")  # fmt: skip
    scaled = done[done["link.rate_scale"].fillna(1.0) != 1.0] if "link.rate_scale" in done.columns else done.iloc[:0]
    if not scaled.empty:
        scales = ", ".join(f"{s:g}" for s in sorted(set(scaled["link.rate_scale"])))
        r += [f"**Scaled links:** {len(scaled)} of {len(done)} runs shaped every link rate multiplied by {scales} "
              "(`link.rate_scale`, so that a small model's hidden states take as long to send as the paper's); "
              "their absolute latencies stand for the paper's testbed, not for this one's unscaled links.",
              ""]  # fmt: skip
    fidelity_section(report, data.steps, done)
    if axes:
        r += ["## Latency by configuration", ""]
        report.table("latency_by_configuration", metrics.latency_table(requests, tokens, done, by=axes, gaps=gaps),
                     f"The same per combination of the settings that vary: {', '.join(axes)}.")  # fmt: skip
    if "workload.rate_per_s" in axes:
        others = [a for a in axes if a not in ("workload.rate_per_s",) and not a.startswith("power.")]
        report.figure("latency_vs_rate", plots.latency_vs_rate(per_run, others or ["method"]),
                      "Mean TTFT and TBT against the request rate.")  # fmt: skip

    r += ["## SLA compliance (HAT Sec. 5.2)", "",
          "Prefill SLA: a request's TTFT per 128 prompt tokens; decode SLA: its decode time per 10 generated "
          "tokens. A curve at (x, y): y% of requests meet an SLA of x.", ""]  # fmt: skip
    report.figure("sla_compliance", plots.sla_cdfs(latencies), "SLA compliance rate against the SLA, by method.")
    cdf = pd.concat([metrics.compliance_cdf(part[c]).assign(method=m, sla=c.split("_")[0])
                     for m, part in latencies.groupby("method") for c in ("prefill_delay_per_128_s",
                                                                         "decode_delay_per_10_s")])  # fmt: skip
    cdf.to_csv(out / "sla_compliance.csv", index=False)
    r += ["The curves' points: [sla_compliance.csv](sla_compliance.csv).", ""]

    r += ["## QoE (Andes Eq. 1)", ""]
    if qoe.empty:
        r += ["No request carries QoE expectations.", ""]
    else:
        report.figure("qoe_distribution", plots.qoe_distribution(qoe),
                      "Distribution of per-request QoE by method (Andes Eq. 1, integrated exactly).")  # fmt: skip
        if "workload.rate_per_s" in axes:
            by_rate = qoe.groupby(["method", "workload.rate_per_s"])["qoe"].agg(["mean", "count"]).reset_index()
            by_rate = by_rate.rename(columns={"mean": "qoe_mean", "count": "requests"})
            capacity = by_rate.groupby("method").apply(
                lambda g: metrics.capacity_per_s(g["workload.rate_per_s"], g["qoe_mean"]), include_groups=False)
            report.table("qoe_by_rate", by_rate, "Mean QoE by method and request rate per device.", digits=3)
            r += ["Capacity (Andes Sec. 6.1: the highest tested rate with mean QoE >= 0.9): "
                  + ", ".join(f"{m} {'none' if np.isnan(c) else f'{c:g} requests/s'}" for m, c in capacity.items())
                  + ".", ""]  # fmt: skip

    gpu_runs = set(requests.loc[requests["serving_slo_s"].notna(), "run_id"]) if "serving_slo_s" in requests else set()
    andes = done[~done["run_id"].isin(gpu_runs)]  # (the GPU-rank methods' engines have their own section)
    if "serving.scheduler" in andes.columns and andes["serving.scheduler"].notna().any():
        serving_section(report, requests, tokens, qoe, andes, axes)
    if gpu_runs:
        gpu_serving_section(report, data, requests, done[done["run_id"].isin(gpu_runs)], axes)
    if "dispatch_winner" in requests.columns:
        dispatch_section(report, requests, tokens, done)
    if not switching.empty:
        context_service_section(report, switching, switching_done)

    power = metrics.node_power(data.telemetry[data.telemetry["run_id"].isin(ids)]) if not data.telemetry.empty \
        else pd.DataFrame()  # fmt: skip
    r += ["## Energy", ""]
    energy = metrics.request_energy(requests, power) if not power.empty else pd.DataFrame()
    if energy.empty:
        r += ["No power telemetry, or no request could be placed on the controller's clock: no energy.", ""]
    else:
        energy["power_mode"] = [_power_mode(done, run, node) for run, node in zip(energy["run_id"],
                                                                                  energy["energy_node"], strict=True)]
        per_token = (energy.groupby(["energy_node", "role", "power_mode", "kind"])
                     .agg(requests=("request_id", "count"), energy_j=("energy_j", "sum"),
                          output_tokens=("output_tokens", "sum")).reset_index())  # fmt: skip
        per_token["energy_per_token_mj"] = per_token["energy_j"] / per_token["output_tokens"] * 1e3
        report.table("energy_per_token", per_token,
                     "Energy attributed to requests, by node, role and power mode: a device's power over its own "
                     "requests' prefill and decode windows; a server's power shared equally among the requests "
                     "in flight. `kind` says measured or modeled; rows of different kinds are never summed.",
                     digits=2)  # fmt: skip
        report.figure("energy_per_token", plots.energy_per_token(per_token),
                      "Energy per generated token by node and power mode.")  # fmt: skip
        nodes = metrics.node_energy(power)
        report.table("energy_by_node", nodes, "Each node's energy over each run's sampled span (idle included).",
                     digits=2)  # fmt: skip

    shape = _model_shape(directory)
    r += ["## Cost (DiSCo App. E)", ""]
    if shape is None:
        r += ["No manifest records the model's config.json and its directory is not readable here: no FLOP-based "
              "cost.", ""]
    else:
        cost = metrics.request_cost(requests, done, shape, api=options.api,
                                    device_usd_per_pflop=options.device_usd_per_pflop)  # fmt: skip
        by_method = cost.merge(done[["run_id", "method"]]).groupby("method")[
            ["device_flops", "server_flops", "device_usd", "server_usd", "total_usd"]].mean().reset_index()
        by_method[["device_usd", "server_usd", "total_usd"]] *= 1e6
        by_method[["device_flops", "server_flops"]] /= 1e9
        by_method = by_method.rename(columns={c: c.replace("_usd", "_micro_usd").replace("_flops", "_gflop")
                                              for c in by_method.columns})  # fmt: skip
        report.table("cost_by_method", by_method,
                     f"Mean cost per request in micro-USD: the device's FLOPs (DiSCo Eq. 7-9) at "
                     f"{options.device_usd_per_pflop:g} USD per 10^15 FLOPs, and the server's share of the "
                     f"request's FLOPs priced at {options.api}'s Table 8 rate. Eq. 8 is implemented as printed; "
                     "DiSCo's Table 6 prefill column grows faster with length than Eq. 8 does.", digits=3)  # fmt: skip

    worst = qoe.groupby("run_id")["qoe"].mean().sort_values(kind="stable")
    run_id = options.delivery_run or str(worst.index[0] if len(worst) else done["run_id"].iloc[0])
    label = done.loc[done["run_id"] == run_id, "label"]
    title = f"run {run_id}" + (f" ({label.iloc[0]})" if len(label) else "")
    r += [f"## One run up close: {title}", ""]
    one = requests[requests["run_id"] == run_id]
    if one.empty:
        r += [f"Run {run_id} has no requests.", ""]
    else:
        if one[["expected_ttft_s", "expected_tds_tok_s"]].notna().all(axis=None):
            report.figure("delivery_curves", plots.delivery_curves(tokens[tokens["run_id"] == run_id], one),
                          "Tokens against time since arrival: on arrival at the client (solid), as the client's "
                          "buffer showed them where it paced them (dotted), and Andes' expected curve (dashed), "
                          "per request.")  # fmt: skip
        if not power.empty:
            tel = data.telemetry[data.telemetry["run_id"] == run_id]
            run_power = power[power["run_id"] == run_id].merge(tel[["ts_s", "t_s"]].drop_duplicates("ts_s"),
                                                                on="ts_s", how="left")  # fmt: skip
            report.figure("telemetry_timeline", plots.telemetry_timeline(run_power, _utilisation(tel), one),
                          "Node power and CPU utilisation during the run; grey spans: requests in flight.")

    per_request = latencies.merge(qoe[[*metrics.REQUEST_KEY, "qoe"]], on=metrics.REQUEST_KEY, how="left")
    per_request.to_csv(out / "requests_metrics.csv", index=False)
    r += ["Per-request metrics (TTFT, e2e, TPOT, SLA delays, QoE): [requests_metrics.csv](requests_metrics.csv).", ""]
    r += attention_lines(directory)
    path = out / "report.md"
    path.write_text("\n".join(r) + "\n")
    return path
