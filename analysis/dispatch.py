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
