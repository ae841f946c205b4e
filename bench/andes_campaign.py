"""An Andes campaign on real ranks as a reproduction's experiment, in Andes Table 4's layout with intervals.

Runs bench/campaign_reproduction.py's ``run`` with the same arguments (the campaign on its emulated lab, then
per group of runs the mean TTFT, TBT and QoE and the paired changes against ``--baseline``, with
intervals), then reads the campaign's requests and tokens again and adds, per group (the matrix's
settings): QoE (Eq. 1, every request with an expectation; one never served counts 0, brief pitfall 8),
TTFT (s) and TDS before the client's buffer ((n - 1) / (t_last - t_first) tokens/s, pitfall 9) at
p10/p50/p90 as Table 4 prints them, preemptions per request (Fig. 13) and generated tokens per second
(Fig. 12); and each group's differences of those percentiles against the baseline group on the same
requests (``(repetition, node, request_id)``: every scheduler meets the same arrivals and prompts).
Intervals: 95% percentile bootstrap over requests within repetitions and over repetitions (as
``analysis/uncertainty.py``), the same resample for both sides of a paired difference.

    python bench/andes_campaign.py examples/campaigns/andes-table4.yaml --baseline serving.scheduler=fcfs \\
        --set base.workload.requests_per_device=250 --set base.workload.rate_per_s=0.4375

Writes bench/results/andes_campaign.json unless a reproduction names the file. Needs root.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.comparison import baseline_group, settings_of
from analysis.uncertainty import mean_interval, percentile_interval, statistic_samples
from bench import campaign_reproduction
from bench._common import write

PERCENTILES = (10, 50, 90)  # Table 4's
METRICS = ("qoe", "ttft_s", "tds_tok_s")
PAIR_KEY = ["repetition", "node", "request_id"]


def served(out: Path, by: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every request with a QoE expectation of the done runs (its ``by`` settings, repetition, QoE, TTFT,
    TDS and preemptions), and each done run's generated tokens per second with its settings."""
    from analysis.load import load
    from analysis.metrics import qoe_table, served_requests, throughput

    data = load(out)
    runs = data.runs[data.runs["state"] == "done"]
    columns = [*by, *(["repetition"] if "repetition" not in by else [])]
    frame = served_requests(data.requests, data.tokens, qoe_table(data.requests, data.tokens), runs, columns)
    completed = frame["completed"].astype(bool) if "completed" in frame else True
    frame["ttft_s"] = (frame["first_token_s"] - frame["arrival_s"]).where(completed)
    frame["preemptions"] = frame["serving_preemptions"].fillna(0) if "serving_preemptions" in frame else np.nan
    rates = throughput(data.requests).merge(runs[["run_id", *columns]], on="run_id")
    return frame, rates


def _percentiles(values: np.ndarray) -> np.ndarray:
    """p10/p50/p90 of every column (NaN left out; NaN for a column without values): shape (3, columns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanpercentile(values, PERCENTILES, axis=0)


def _by_metric(estimate: np.ndarray, samples: np.ndarray, units: int) -> dict[str, dict[str, dict[str, float]]]:
    """{metric: {"p10": interval, ...}} from estimates (3, metrics) and samples (resamples, 3, metrics)."""
    return {metric: {f"p{pct}": percentile_interval(estimate[p, m], samples[:, p, m], units).as_dict()
                     for p, pct in enumerate(PERCENTILES)} for m, metric in enumerate(METRICS)}  # fmt: skip


def table4(frame: pd.DataFrame, rates: pd.DataFrame, by: list[str], baseline: dict[str, Any]) -> dict[str, Any]:
    """Per group: Table 4's percentiles with intervals, mean QoE and preemptions per request with
    intervals, throughput; per group against its baseline group: the paired differences (treatment -
    baseline) and relative changes (treatment / baseline - 1) of every percentile."""
    groups, changes = [], []
    for values, part in frame.groupby(by, sort=True, dropna=False) if by else [((), frame)]:
        settings = settings_of(by, values)
        data = part[list(METRICS)].to_numpy(dtype="float64")
        samples = statistic_samples(data, _percentiles, part["repetition"].to_numpy())
        mine = rates
        for column, value in settings.items():
            mine = mine[mine[column] == value]
        groups.append({"settings": settings, "requests": len(part), "repetitions": int(part["repetition"].nunique()),
                       "percentiles": _by_metric(_percentiles(data), samples, len(part)),
                       "qoe_mean": mean_interval(part["qoe"], clusters=part["repetition"]).as_dict(),
                       "preemptions_per_request": mean_interval(part["preemptions"],
                                                                clusters=part["repetition"]).as_dict(),
                       "output_tokens_per_s": float(mine["output_tokens_per_s"].mean()),
                       "runs_output_tokens_per_s": [float(v) for v in mine["output_tokens_per_s"]]})  # fmt: skip
        if not baseline or all(settings.get(c) == v for c, v in baseline.items()):
            continue
        others = [c for c in by if c not in baseline]
        base, against = baseline_group(frame, by, settings, baseline)
        paired = part.merge(base, on=[*PAIR_KEY, *others], suffixes=("", "_base"))
        if paired.empty:
            continue
        t = paired[list(METRICS)].to_numpy(dtype="float64")
        b = paired[[f"{m}_base" for m in METRICS]].to_numpy(dtype="float64")
        both = statistic_samples(np.hstack([t, b]), _percentiles, paired["repetition"].to_numpy())  # one draw
        sample_t, sample_b = both[..., : len(METRICS)], both[..., len(METRICS) :]
        est_t, est_b = _percentiles(t), _percentiles(b)
        with np.errstate(invalid="ignore", divide="ignore"):
            changes.append({"settings": settings, "against": against,
                            "pairs": len(paired),
                            "difference": _by_metric(est_t - est_b, sample_t - sample_b, len(paired)),
                            "change": _by_metric(est_t / est_b - 1, sample_t / sample_b - 1, len(paired))})  # fmt: skip
    return {"percentiles": list(PERCENTILES), "groups": groups, "changes": changes}


# bench/campaign_reproduction.py's options, under this script's name and description
PARSER = campaign_reproduction.argument_parser(f"bench/{Path(__file__).name}", __doc__)


def main() -> None:
    result = campaign_reproduction.run(sys.argv[1:], PARSER)
    frame, rates = served(Path(result["work"]) / "out", list(result["by"]))
    result["table4"] = table4(frame, rates, list(result["by"]), dict(result.get("baseline") or {}))
    result["command"] = " ".join(["python", "bench/andes_campaign.py", *sys.argv[1:]])
    print(f"wrote {write('andes_campaign', result)}")


if __name__ == "__main__":
    main()
