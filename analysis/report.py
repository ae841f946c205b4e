"""A campaign's report: ``report/report.md`` with PNG figures and CSV tables (``testbed report``).

Sections: per-method latency in the layout of HAT's Table 5, per-configuration latency, TTFT and
TBT against the request rate, HAT's SLA compliance CDFs, energy per token by node and power mode, one
run's token delivery curves against the expected curve, one run's telemetry timeline, and the
ledger's failures; and each method family's (:mod:`analysis.report_sections`): Andes QoE
(distribution, by rate, capacity), DiSCo cost per request, LLMS's context-switching latency (Fig. 9)
and the contexts a method holds under a latency constraint (Fig. 10). Tables and figures are written
by :mod:`analysis.report_document`. Every number comes from :mod:`analysis.metrics`; measured and
modeled energy are kept apart, and the report says which is which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import metrics, plots
from analysis.cost_model import DEVICE_USD_PER_PFLOP, ModelShape
from analysis.load import CampaignData, load
from analysis.report_document import Report, varying_settings
from analysis.report_sections import (
    context_service_section,
    dispatch_section,
    fidelity_section,
    gpu_serving_section,
    intervals_section,
    serving_section,
)
from analysis.summary import attention_lines, write_summary


@dataclass(frozen=True)
class ReportOptions:
    """What the report assumes where the campaign does not say."""

    api: str = "gpt-4o-mini"  # DiSCo Table 8 price for the server's share
    device_usd_per_pflop: float = DEVICE_USD_PER_PFLOP["server-constrained"]
    qoe_alpha: float | None = None  # Andes' optional TTFT penalty
    delivery_run: str | None = None  # the run whose timelines are drawn (default: the lowest mean QoE)


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


def _baseline(directory: Path, by: list[str]) -> dict[str, object]:
    """What every group is compared with: the first value of the campaign's first matrix key among ``by``
    (HAT's U-shape, Andes' first scheduler), as the campaign file lists it; none without a matrix."""
    from ruamel.yaml import YAML

    path = directory / "campaign.yaml"
    matrix = (YAML(typ="safe").load(path.read_text()) or {}).get("matrix") if path.is_file() else None
    for key, values in (matrix or {}).items():
        if key in by and isinstance(values, list) and values:
            return {key: values[0]}
    return {}


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
    interval_by = list(dict.fromkeys([*table_by, *axes]))
    intervals_section(report, requests, tokens, done, interval_by, _baseline(directory, interval_by))
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
