"""DiSCo's live campaigns as a reproduction's experiment: run an example campaign with
bench/campaign_reproduction.py's ``run`` (the emulated lab brought up and down, the generic summary of
means and paired changes), then what DiSCo's page needs besides, with 95% intervals by bootstrap over
requests (pairs kept together; repetitions as clusters):

- Table 2 live: per service and regime, the P99 TTFT reduction of DiSCo against Stoch averaged over the
  campaign's budgets, on the same requests (a repetition's requests and the trace endpoint's per-request
  seeds are the same under every policy); each budget's P99 and mean TTFT change; realised budgets;
- Fig. 7 and Table 3 live: per policy and budget, migration's cost change against the same requests
  without migration (API prices and FLOPs energy, DiSCo App. E), the share migrated, the tokens the client
  held when a migration began (Eq. 5's B), the P99 gap between shown tokens of migrated requests, token
  mismatches at a handoff (must be 0);
- every run against the trace-driven replay of its very requests (bench/disco_campaign_check.py).

    python bench/disco_campaign.py examples/campaigns/disco-budget.yaml --set repetitions=1
    python bench/disco_campaign.py examples/campaigns/disco-migration.yaml --work /var/tmp/disco-mig --resume

The arguments are bench/campaign_reproduction.py's. Writes bench/results/disco_campaign.json unless the
reproduction names the file. Needs root (network namespaces).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.comparison import PAIR_KEY
from analysis.cost_model import DispatchPrices, dispatch_regime
from analysis.dispatch import DISPATCH_DEFAULTS
from analysis.uncertainty import Interval, change_interval, mean_interval, statistic_interval
from bench import campaign_reproduction
from bench._common import write

SETTINGS = {"dispatch.policy": "policy", "dispatch.budget": "budget", "dispatch.service": "service",
            "dispatch.device_speed": "device", "dispatch.migration": "migration", "dispatch.regime": "forced_regime",
            "dispatch.server_endpoint": "server_endpoint"}  # fmt: skip


def request_table(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One row per answered request of the done runs: its pair key, settings, TTFT, the constrained
    endpoint's race tokens, cost (USD) and migration; and the gaps between its shown tokens."""
    from analysis.load import load

    data = load(out)
    runs = data.runs[data.runs["state"] == "done"].copy()
    for column, default in DISPATCH_DEFAULTS.items():
        runs[column] = runs[column].where(runs[column].notna(), default) if column in runs else default
    runs = runs.rename(columns=SETTINGS)[["run_id", "repetition", *SETTINGS.values()]]
    requests = data.requests.merge(runs, on="run_id", how="inner")
    requests = requests[requests["ttft_s"].notna()].copy()
    requests["regime"] = [dispatch_regime(p, f) for p, f in zip(requests["policy"], requests["forced_regime"],
                                                                  strict=True)]  # fmt: skip
    requests["budget"] = requests["budget"].astype(float)
    requests["migration"] = requests["migration"].astype(bool)
    moved = requests.get("dispatch_migrated", pd.Series(False, index=requests.index)).fillna(False).astype(bool)
    target = requests.get("dispatch_migration_target", pd.Series(None, index=requests.index))
    migration_in = requests.get("dispatch_migration_input_tokens", pd.Series(0.0, index=requests.index)).fillna(0)
    migration_in = migration_in * moved
    server_in = requests["dispatch_race_server_input_tokens"] + migration_in * (target == "server-migration")
    device_prefill = requests["dispatch_race_device_prefill_tokens"] + migration_in * (target == "device-migration")
    cost = np.zeros(len(requests))
    for (service, device, regime), rows in requests.groupby(["service", "device", "regime"]).groups.items():
        at = requests.index.get_indexer(rows)
        prices = DispatchPrices.for_dispatch(service, device, regime)
        outputs = requests["dispatch_server_output_tokens"].iloc[at], requests["dispatch_device_output_tokens"].iloc[at]
        cost[at] = prices.cost_usd(server_in.iloc[at], outputs[0], device_prefill.iloc[at], outputs[1])
    requests["cost_usd"] = cost
    requests["migrated"] = moved
    requests["held_tokens"] = requests.get("dispatch_held_tokens", np.nan)
    requests["mismatches"] = requests.get("dispatch_migration_mismatches", pd.Series(0, index=requests.index))
    server = requests["regime"] == "server"
    requests["spent_tokens"] = np.where(server, requests["dispatch_race_server_input_tokens"],
                                        requests["dispatch_race_device_prefill_tokens"])  # fmt: skip
    gaps = pd.DataFrame(columns=["run_id", "node", "request_id", "gap_s"])
    if not data.tokens.empty and "display_s" in data.tokens:
        shown = data.tokens.sort_values(["run_id", "node", "request_id", "index"])
        gaps = shown.assign(gap_s=shown.groupby(["run_id", "node", "request_id"])["display_s"].diff()).dropna(
            subset=["gap_s"])[["run_id", "node", "request_id", "gap_s"]]  # fmt: skip
    return requests.reset_index(drop=True), gaps


def _p99(values: np.ndarray) -> np.ndarray:
    return np.percentile(values, 99, axis=0)


def table2_live(requests: pd.DataFrame) -> list[dict[str, Any]]:
    """Per service and regime: DiSCo against Stoch (no migration) on the same requests at every budget."""
    rows = []
    plain = requests[~requests["migration"]]
    for (service, regime), part in plain.groupby(["service", "regime"], sort=True):
        stoch, disco = f"stoch-{regime[0]}", f"disco-{regime[0]}"
        wide = part.pivot_table(index=PAIR_KEY, columns=["policy", "budget"], values="ttft_s")
        budgets = sorted(b for p, b in wide.columns if p == disco and (stoch, b) in wide.columns)
        if not budgets:
            continue
        wide = wide[[(p, b) for b in budgets for p in (stoch, disco)]].dropna()
        values, clusters = wide.to_numpy(), wide.index.get_level_values("repetition").to_numpy()

        def reduction(v: np.ndarray) -> float:
            q = _p99(v)
            return float(np.mean(100.0 * (1.0 - q[1::2] / q[0::2])))

        def average_change(v: np.ndarray) -> float:
            return float(np.mean(100 * (v[:, 1::2].mean(0) / v[:, 0::2].mean(0) - 1)))

        per_budget = []
        for k, b in enumerate(budgets):
            pair = values[:, 2 * k : 2 * k + 2]
            mean_change = change_interval(pair[:, 1], pair[:, 0], clusters=clusters).scaled(100.0)
            p99_change = statistic_interval(pair, lambda v: float(100.0 * (_p99(v)[1] / _p99(v)[0] - 1.0)),
                                            clusters)  # fmt: skip
            realised = {}
            for policy in (stoch, disco):
                spent = part[(part["policy"] == policy) & (part["budget"] == b)]
                realised[policy] = mean_interval(spent["spent_tokens"], spent["prompt_tokens"],
                                                 spent["repetition"]).as_dict()  # fmt: skip
            per_budget.append({"budget": b, "mean_ttft_change_pct": mean_change.as_dict(),
                               "p99_ttft_change_pct": p99_change.as_dict(), "realised_budget": realised,
                               "stoch_p99_ttft_s": float(_p99(pair[:, 0])),
                               "disco_p99_ttft_s": float(_p99(pair[:, 1]))})  # fmt: skip
        rows.append({"service": service, "regime": regime, "device": part["device"].iloc[0], "budgets": budgets,
                     "requests": len(values),
                     "reduction_pct": statistic_interval(values, reduction, clusters).as_dict(),
                     "average_mean_ttft_change_pct": statistic_interval(values, average_change, clusters).as_dict(),
                     "per_budget": per_budget})  # fmt: skip
    return rows


def migration_live(requests: pd.DataFrame, gaps: pd.DataFrame) -> list[dict[str, Any]]:
    """Per policy and budget (and over all budgets: ``budget`` "all"): migration against none on the same
    requests."""
    disco = requests[requests["policy"].isin(["disco-s", "disco-d"])]
    groups = [(policy, budget, part) for (policy, budget), part in disco.groupby(["policy", "budget"], sort=True)]
    groups += [(policy, "all", part) for policy, part in disco.groupby("policy", sort=True)]
    shown = {key: g.to_numpy() for key, g in gaps.groupby(["run_id", "node", "request_id"])["gap_s"]}
    rows = []
    for policy, budget, part in groups:
        paired = part[part["migration"]].merge(part[~part["migration"]], on=[*PAIR_KEY, "budget"],
                                               suffixes=("", "_without"))  # fmt: skip
        if paired.empty:
            continue
        cost = change_interval(paired["cost_usd"], paired["cost_usd_without"], clusters=paired["repetition"])
        moved = paired[paired["migrated"]]
        moved_gaps = [shown.get(key, np.zeros(0)) for key in zip(moved["run_id"], moved["node"], moved["request_id"],
                                                                 strict=True)]  # fmt: skip

        def gap_p99(rows: np.ndarray, moved_gaps: list[np.ndarray] = moved_gaps) -> float:
            pooled = np.concatenate([moved_gaps[int(i)] for i in rows[:, 0]] or [np.zeros(0)])
            return float(np.percentile(pooled, 99)) if len(pooled) else float("nan")

        tbt = statistic_interval(np.arange(len(moved))[:, None], gap_p99, moved["repetition"].to_numpy())
        rows.append({
            "policy": policy, "regime": paired["regime"].iloc[0], "budget": budget, "pairs": len(paired),
            "cost_cut_pct": Interval(-100 * cost.estimate, -100 * cost.high, -100 * cost.low, cost.units).as_dict(),
            "cost_usd_per_request": {"with": float(paired["cost_usd"].mean()),
                                     "without": float(paired["cost_usd_without"].mean())},
            "migrated_share": mean_interval(paired["migrated"].astype(float), clusters=paired["repetition"]).as_dict(),
            "held_tokens_mean": mean_interval(moved["held_tokens"], clusters=moved["repetition"]).as_dict(),
            "held_tokens_p99": float(np.percentile(moved["held_tokens"], 99)) if len(moved) else None,
            "migrated_tbt_p99_s": tbt.as_dict(), "handoff_mismatches": int(paired["mismatches"].fillna(0).sum()),
        })  # fmt: skip
    return rows


def replay_check(out: Path) -> list[dict[str, Any]]:
    from bench.disco_campaign_check import check_run

    return [row for run in sorted((out / "runs").glob("*")) if (row := check_run(run)) is not None]


# bench/campaign_reproduction.py's options, under this script's name and description
PARSER = campaign_reproduction.argument_parser(f"bench/{Path(__file__).name}", __doc__)


def main() -> None:
    argv = sys.argv[1:]
    campaign = campaign_reproduction.run(argv, PARSER)
    out = Path(campaign["work"]) / "out"
    requests, gaps = request_table(out)
    checks = replay_check(out)
    gap = {k: float(np.max(np.abs([r[k] for r in checks]))) if checks else None
           for k in ("mean_ttft_gap_pct", "p99_ttft_gap_pct", "budget_gap_pct")}  # fmt: skip
    result = {
        "command": " ".join(["python", "bench/disco_campaign.py", *argv]), "campaign_summary": campaign,
        "fidelity": campaign.get("fidelity", []),
        "requests": len(requests), "table2_live": table2_live(requests),
        "migration_live": migration_live(requests, gaps),
        "replay_check": {"runs": checks, "largest_abs_gap_pct": gap}, "modeled_times": True,
    }  # fmt: skip
    for row in result["table2_live"]:
        print(row["service"], row["regime"], "P99 TTFT reduction %:", row["reduction_pct"], flush=True)
    for row in result["migration_live"]:
        print(row["policy"], row["budget"], "cost cut %:", row["cost_cut_pct"], flush=True)
    print(f"wrote {write('disco_campaign', result)}")


if __name__ == "__main__":
    main()
