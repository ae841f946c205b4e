"""The report's figures, each a function of metric tables that returns a matplotlib Figure.

Axes carry their quantity and unit, every series is in a legend, and legends sit outside the
plotting area when there are many series, so nothing overlaps. Figures are made without pyplot, so
no display and no backend are needed, and nothing stays open after saving; a notebook shows a
returned Figure inline.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis import metrics

WIDTH_IN, HEIGHT_IN = 7.5, 4.2


def _legend(ax: Axes, count: int) -> None:
    if count > 4:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif count:
        ax.legend(fontsize=8)


def _two_panels(axes: Sequence[Axes], titles: tuple[str, str], series: int) -> None:
    """Titles on a pair of panels and the legend on the right one."""
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    _legend(axes[1], series)


def _series_label(values: Sequence[object], names: Sequence[str]) -> str:
    return ", ".join(f"{n}={v}" if n != "method" else str(v) for n, v in zip(names, values, strict=True))


def latency_vs_rate(per_run: pd.DataFrame, by: Sequence[str]) -> Figure:
    """Mean TTFT and TBT (ms) against the request rate, one line per group of ``by``."""
    fig = Figure(layout="tight", figsize=(WIDTH_IN + 2, HEIGHT_IN))
    axes = fig.subplots(1, 2)
    groups = list(per_run.groupby(list(by), dropna=False)) if by else [((), per_run)]
    for values, part in groups:
        values = values if isinstance(values, tuple) else (values,)
        means = part.groupby("workload.rate_per_s")[["ttft_ms_mean", "tbt_ms_mean"]].mean().sort_index()
        label = _series_label(values, by) or "all runs"
        axes[0].plot(means.index, means["ttft_ms_mean"], marker="o", label=label)
        axes[1].plot(means.index, means["tbt_ms_mean"], marker="o", label=label)
    for ax, name in zip(axes, ("mean TTFT (ms)", "mean TBT (ms)"), strict=True):
        ax.set_xlabel("request rate per device (requests/s)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
    _two_panels(axes, ("time to first token", "time between tokens"), len(groups))
    return fig


def sla_cdfs(latencies: pd.DataFrame, group: str = "method") -> Figure:
    """HAT Fig. 9-10: SLA compliance against the SLA, prefill (per 128 prompt tokens) and decode
    (per 10 generated tokens), one curve per ``group``."""
    fig = Figure(layout="tight", figsize=(WIDTH_IN + 2, HEIGHT_IN))
    axes = fig.subplots(1, 2)
    columns = (("prefill_delay_per_128_s", "prefill SLA: delay per 128 prompt tokens (ms)"),
               ("decode_delay_per_10_s", "decode SLA: delay per 10 generated tokens (ms)"))  # fmt: skip
    names = sorted(latencies[group].dropna().unique(), key=str)
    for ax, (column, xlabel) in zip(axes, columns, strict=True):
        for name in names:
            cdf = metrics.compliance_cdf(latencies.loc[latencies[group] == name, column])
            ax.step(cdf["sla_s"] * 1e3, cdf["compliance"] * 100, where="post", label=str(name))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("requests within the SLA (%)")
        ax.set_ylim(0, 102)
    _two_panels(axes, ("prefill", "decode"), len(names))
    return fig


def qoe_distribution(qoe: pd.DataFrame, group: str = "method") -> Figure:
    """The CDF of per-request Andes QoE, one curve per ``group``, with the 0.9 threshold marked."""
    fig = Figure(layout="tight", figsize=(WIDTH_IN, HEIGHT_IN))
    ax = fig.subplots()
    names = sorted(qoe[group].dropna().unique(), key=str)
    for name in names:
        values = np.sort(qoe.loc[qoe[group] == name, "qoe"].to_numpy())
        ax.step(values, np.arange(1, len(values) + 1) / len(values) * 100, where="post",
                label=f"{name} (mean {values.mean():.3f})")  # fmt: skip
    ax.axvline(metrics.QOE_THRESHOLD, color="grey", linestyle=":", label="0.9 (Andes' threshold)")
    ax.set_xlabel("QoE (Andes Eq. 1)")
    ax.set_ylabel("requests with at most this QoE (%)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    _legend(ax, len(names) + 1)
    return fig


def energy_per_token(table: pd.DataFrame) -> Figure:
    """Mean energy per token (mJ) by node and power mode: one horizontal bar per (node, mode), so
    any number of them stays readable, hatched where the power is modeled."""
    rows = len(table)
    fig = Figure(layout="tight", figsize=(WIDTH_IN, max(HEIGHT_IN, 0.32 * rows + 1.4)))
    ax = fig.subplots()
    labels = [f"{r.energy_node} ({r.role}), {r.power_mode}" for r in table.itertuples()]
    bars = ax.barh(range(rows), table["energy_per_token_mj"].to_numpy(), color="tab:blue", edgecolor="black")
    for bar, kind in zip(bars, table["kind"], strict=True):
        bar.set_hatch("//" if kind == "modeled" else "")
    ax.set_yticks(range(rows), labels, fontsize=8)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("energy per generated token (mJ)")
    ax.set_ylabel("node (role), power mode")
    ax.set_title("energy per token (hatched: modeled power)")
    ax.grid(axis="x", alpha=0.3)
    return fig


def delivery_curves(tokens: pd.DataFrame, requests: pd.DataFrame, limit: int = 6) -> Figure:
    """One run's token timelines (tokens against seconds since arrival) beside Andes' expected curve
    T(t) = tds (t - TTFT), capped at the response length: on arrival at the client (solid) and, where
    the client buffered them (``display_s``, Andes Sec. 5), as its user was shown them (dotted). With
    preemptions recorded, half the requests drawn are the most preempted ones."""
    fig = Figure(layout="tight", figsize=(WIDTH_IN, HEIGHT_IN))
    ax = fig.subplots()
    done = requests[requests["completed"]]
    chosen = done.head(limit)
    if "serving_preemptions" in done and done["serving_preemptions"].fillna(0).gt(0).any():
        most = done.sort_values("serving_preemptions", ascending=False, kind="stable").head(limit // 2)
        chosen = pd.concat([most, done.drop(most.index).head(limit - len(most))])
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    buffered = "display_s" in tokens and tokens["display_s"].notna().any()
    for i, r in enumerate(chosen.itertuples()):
        mine = tokens[(tokens["node"] == r.node) & (tokens["request_id"] == r.request_id)]
        times = np.sort(mine["ts_s"].to_numpy()) - r.arrival_s
        if not len(times):
            continue
        color = colors[i % len(colors)]
        count = np.arange(1, len(times) + 2).clip(max=len(times))
        preempted = getattr(r, "serving_preemptions", None)
        suffix = f", {int(preempted)} preemptions" if preempted is not None and pd.notna(preempted) else ""
        label = f"{r.node} #{r.request_id}{suffix}"
        ax.step(np.append(times, times[-1]), count, where="post", color=color, label=label)
        if buffered:
            shown = np.sort(mine["display_s"].dropna().to_numpy()) - r.arrival_s
            if len(shown):
                ax.step(np.append(shown, shown[-1]), np.arange(1, len(shown) + 2).clip(max=len(shown)), where="post",
                        color=color, linestyle=":", linewidth=1.2)  # fmt: skip
        end = r.expected_ttft_s + len(times) / r.expected_tds_tok_s
        ax.plot([0, r.expected_ttft_s, end], [0, 0, len(times)], color=color, linestyle="--", linewidth=0.8)
    ax.plot([], [], color="black", linestyle="--", linewidth=0.8, label="expected (Andes)")
    if buffered:
        ax.plot([], [], color="black", linestyle=":", linewidth=1.2, label="shown by the client's buffer")
    ax.set_xlabel("time since the request arrived (s)")
    ax.set_ylabel("tokens delivered (solid) or shown (dotted)")
    ax.grid(alpha=0.3)
    _legend(ax, len(chosen) + 1 + buffered)
    return fig


def qoe_vs_length(table: pd.DataFrame, by: Sequence[str]) -> Figure:
    """Andes Fig. 14: mean QoE (solid) and p10 QoE (dashed) against the request's total length (prompt
    and requested response), one colour per group of ``by`` (rows of
    :func:`analysis.metrics.qoe_by_length`)."""
    fig = Figure(layout="tight", figsize=(WIDTH_IN, HEIGHT_IN))
    ax = fig.subplots()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = list(table.groupby(list(by), sort=True))
    for i, (values, part) in enumerate(groups):
        middle = (part["length_from"] + part["length_to"]) / 2
        label = _series_label(values if isinstance(values, tuple) else (values,), by)
        color = colors[i % len(colors)]
        ax.plot(middle, part["qoe_mean"], marker="o", color=color, label=f"{label} mean")
        ax.plot(middle, part["qoe_p10"], marker=".", linestyle="--", color=color, label=f"{label} p10")
    ax.axhline(metrics.QOE_THRESHOLD, color="grey", linestyle=":", label="0.9 (Andes' threshold)")
    ax.set_xlabel("total length: prompt + requested response (tokens, middle of the bin)")
    ax.set_ylabel("QoE (Andes Eq. 1)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    _legend(ax, 2 * len(groups) + 1)
    return fig


def telemetry_timeline(power: pd.DataFrame, utilisation: pd.DataFrame, requests: pd.DataFrame) -> Figure:
    """One run's node power (W) and CPU utilisation (%) against seconds from the start barrier, with
    each request's span shaded."""
    fig = Figure(layout="tight", figsize=(WIDTH_IN + 2, HEIGHT_IN + 1.5))
    axes = fig.subplots(2, 1, sharex=True)
    for (node, kind), part in power.groupby(["node", "kind"]):
        axes[0].plot(part["t_s"], part["power_mw"] / 1e3, label=f"{node} ({kind})", linewidth=1)
    for node, part in utilisation.groupby("node"):
        axes[1].plot(part["t_s"], part["value"], label=node, linewidth=1)
    for r in requests[requests["completed"]].itertuples():
        for ax in axes:
            ax.axvspan(r.arrival_s, r.last_token_s, color="grey", alpha=0.12, linewidth=0)
    axes[0].set_ylabel("node power (W)")
    axes[1].set_ylabel("CPU utilisation (%)")
    axes[1].set_xlabel("time from the run's start barrier (s); grey: requests in flight")
    for ax in axes:
        ax.grid(alpha=0.3)
        _legend(ax, 5)
    return fig
