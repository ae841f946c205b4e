"""DiSCo's report tables from trace-driven or live dispatch runs, one row per run (trace, device,
regime, budget b, policy, migration, seed) with the run's summary (``ReplayResult.summary`` or the
same numbers from a live run's requests):

- ``tail_reduction_table``: Table 2, the P99 TTFT reduction against Stoch averaged over the budgets;
- ``budget_curves``: Fig. 6, mean and P99 TTFT against b per policy;
- ``cost_curves``: Fig. 7, cost per request against b with and without migration;
- ``migration_table``: Table 3, tokens held for a migration ("delay_num"), tokens shown late, and the
  P99 gap between shown tokens of migrated requests.

Seeds are pooled by their median before any ratio is taken (these runs are noisy at P99).
"""

from __future__ import annotations

import pandas as pd

from analysis.cost_model import DispatchPrices, dispatch_regime

KEYS = ["trace", "regime", "device", "budget"]


def _by_policy(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The seed median of ``metric`` per trace, regime, device, budget and policy (no migration)."""
    plain = rows[~rows["migration"]]
    return plain.groupby([*KEYS, "policy"])[metric].median().unstack("policy")


def tail_reduction_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Table 2: 1 - P99(DiSCo) / P99(Stoch) in percent, averaged over the budget grid, per trace and
    regime (rows) and device (columns)."""
    p99 = _by_policy(rows, "p99_ttft_s").reset_index()
    p99["disco"] = p99.apply(lambda r: r["disco-s"] if r["regime"] == "server" else r["disco-d"], axis=1)
    p99["stoch"] = p99.apply(lambda r: r["stoch-s"] if r["regime"] == "server" else r["stoch-d"], axis=1)
    p99["reduction_pct"] = 100.0 * (1.0 - p99["disco"] / p99["stoch"])
    table = p99.groupby(["trace", "regime", "device"])["reduction_pct"].mean().unstack("device")
    order = [d for d in rows["device"].drop_duplicates() if d in table.columns]
    return table[order]


def budget_curves(rows: pd.DataFrame) -> pd.DataFrame:
    """Fig. 6: mean and P99 TTFT (seconds, seed medians) per trace, regime, device, budget, policy."""
    plain = rows[~rows["migration"]]
    return plain.groupby([*KEYS, "policy"])[["mean_ttft_s", "p99_ttft_s", "realised_budget"]].median().reset_index()


def cost_curves(rows: pd.DataFrame) -> pd.DataFrame:
    """Fig. 7: DiSCo's cost per request (USD, seed medians) without and with migration, and the cut."""
    disco = rows[rows["policy"].isin(["disco-s", "disco-d"])]
    cost = disco.groupby([*KEYS, "migration"])["cost_usd_per_request"].median().unstack("migration")
    cost.columns = ["without_migration" if not c else "with_migration" for c in cost.columns]
    cost["cut_pct"] = 100.0 * (1.0 - cost["with_migration"] / cost["without_migration"])
    return cost.reset_index()


def migration_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Table 3 over migrated requests (runs with migration, pooled over devices and budgets)."""
    moved = rows[rows["migration"] & (rows["migrated_share"] > 0)]
    return moved.groupby(["trace", "regime"]).agg(
        migrated_share=("migrated_share", "mean"), held_tokens_mean=("held_tokens_mean", "mean"),
        held_tokens_p99=("held_tokens_p99", "mean"), slipped_tokens_mean=("slipped_tokens_mean", "mean"),
        tbt_p99_s=("migrated_tbt_p99_s", "median"), tbt_p99_s_worst=("migrated_tbt_p99_s", "max"),
    ).reset_index()  # fmt: skip


DISPATCH_DEFAULTS = {"dispatch.policy": "disco-s", "dispatch.budget": 0.5, "dispatch.service": "gpt",
                     "dispatch.device_speed": "pixel7pro-bloom-1.1b", "dispatch.migration": False,
                     "dispatch.regime": None, "dispatch.server_endpoint": "trace",
                     "serving.scheduler": "fcfs"}  # fmt: skip


def live_runs(requests: pd.DataFrame, tokens: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """One row per live dispatch run (method ``disco``) in the sweep's schema: trace (the service the
    trace endpoint replays, or ``engine:<scheduler>`` for the serving engine), device, regime,
    budget, policy, migration, TTFT mean and P99 (s), realised budget, cost per request (USD), the
    share the device answered first, migrations and what the client held for them, and token
    mismatches at a handoff (must be 0); TBT P99 after the client's buffer over migrated requests."""
    rows = []
    for _, run in runs.iterrows():
        mine = requests[(requests["run_id"] == run["run_id"]) & requests["ttft_s"].notna()]
        if mine.empty or "dispatch_winner" not in mine.columns:
            continue
        setting = {k: run.get(k, v) if k in runs.columns and pd.notna(run.get(k)) else v
                   for k, v in DISPATCH_DEFAULTS.items()}  # fmt: skip
        regime = dispatch_regime(setting["dispatch.policy"], setting["dispatch.regime"])
        prices = DispatchPrices.for_dispatch(setting["dispatch.service"], setting["dispatch.device_speed"], regime)
        target = mine.get("dispatch_migration_target", pd.Series([None] * len(mine), index=mine.index))
        moved = mine["dispatch_migrated"].fillna(False).astype(bool)
        migration_in = mine["dispatch_migration_input_tokens"].fillna(0) * moved
        server_in = mine["dispatch_race_server_input_tokens"] + migration_in * (target == "server-migration")
        device_prefill = mine["dispatch_race_device_prefill_tokens"] + migration_in * (target == "device-migration")
        cost = prices.cost_usd(server_in, mine["dispatch_server_output_tokens"], device_prefill,
                               mine["dispatch_device_output_tokens"])  # fmt: skip
        constrained = "server_input_tokens" if regime == "server" else "device_prefill_tokens"
        spent = mine[f"dispatch_race_{constrained}"]
        rows.append({
            "run_id": run["run_id"], "device": setting["dispatch.device_speed"],
            "trace": setting["dispatch.service"] if setting["dispatch.server_endpoint"] == "trace"
            else "engine:" + str(setting["serving.scheduler"]),  # what the server behaves like
            "regime": regime, "budget": float(setting["dispatch.budget"]), "policy": setting["dispatch.policy"],
            "migration": bool(setting["dispatch.migration"]), "requests": len(mine),
            "mean_ttft_s": float(mine["ttft_s"].mean()), "p99_ttft_s": float(mine["ttft_s"].quantile(0.99)),
            "realised_budget": float(spent.sum() / mine["prompt_tokens"].sum()),
            "cost_usd_per_request": float(cost.mean()),
            "device_first_share": float((mine["dispatch_winner"] == "device").mean()),
            "migrated_share": float(moved.mean()),
            "held_tokens_mean": float(mine.loc[moved, "dispatch_held_tokens"].mean()) if moved.any() else float("nan"),
            "held_tokens_p99": float(mine.loc[moved, "dispatch_held_tokens"].quantile(0.99)) if moved.any()
            else float("nan"),
            "slipped_tokens_mean": float("nan"),
            "migrated_tbt_p99_s": _display_gap_p99_s(tokens, run["run_id"], mine[moved]),
            "handoff_mismatches": int(mine["dispatch_migration_mismatches"].fillna(0).sum()),
        })  # fmt: skip
    return pd.DataFrame(rows)


def _display_gap_p99_s(tokens: pd.DataFrame, run_id: str, migrated: pd.DataFrame) -> float:
    """P99 of the gaps between shown tokens (``display_s``) of a run's migrated requests."""
    if migrated.empty or "display_s" not in tokens.columns:
        return float("nan")
    keys = set(zip(migrated["node"], migrated["request_id"], strict=True))
    mine = tokens[tokens["run_id"] == run_id]
    mine = mine[[(n, r) in keys for n, r in zip(mine["node"], mine["request_id"], strict=True)]]
    gaps = mine.sort_values("index").groupby(["node", "request_id"])["display_s"].diff().dropna()
    return float(gaps.quantile(0.99)) if len(gaps) else float("nan")
