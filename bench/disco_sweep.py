"""DiSCo's trace-driven budget sweep (Sec. 5.1-5.2: Table 2, Fig. 6, Fig. 7, Table 3).

For each service trace (GPT-, DeepSeek-, Command-, LLaMA-like: ``nodes/endpoints/services.py``),
device (Pixel 7 Pro + BLOOM-1.1B, + BLOOM-560M, Xiaomi 14 + Qwen1.5-0.5B at their measured rates),
regime (server- or device-constrained, forced as the paper does; Algorithm 1's verdict is logged) and
seed: profile p(l), F, T_d and the output lengths on a calibration draw, then replay an evaluation
draw of Alpaca-like requests under Stoch and DiSCo at every budget b in {0, 0.1, ..., 1}, DiSCo with
and without migration. Server-only and device-only are the two ends. Everything is modeled time
(``nodes/dispatch/replay.py``); the device's TTFT varies 3% run to run.

    python bench/disco_sweep.py                      # 4 traces x 3 devices x 2 regimes x 11 b x 10 seeds
    python bench/disco_sweep.py --seeds 3 --traces gpt command
    python bench/disco_sweep.py --source-stops       # the other reading of Sec. 4.3's migration

Writes bench/results/disco_sweep.json (the four tables, and the numbers DiSCo's reproduction page
reads, each with a 95% interval from resampling the seeds: a seed is one run of the paper's 10, with
its own calibration and evaluation draws, so Stoch and DiSCo are compared on the same requests within
a seed) and prints the tables next to the paper's Table 2 cells.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.cost_model import SERVICE_APIS, DispatchPrices
from analysis.dispatch import budget_curves, cost_curves, migration_table, tail_reduction_table
from analysis.report_document import markdown_table
from analysis.uncertainty import Interval, mean_interval, statistic_interval
from bench._common import write
from nodes.dispatch.controller import MigrationRule, plan_dispatch
from nodes.dispatch.policy import LengthDistribution, ServerTtft, TokenCosts, constrained_endpoint
from nodes.dispatch.replay import ReplayInput, replay
from nodes.endpoints.device_speed import DEVICE_SPEEDS, LinearTtft
from nodes.endpoints.services import SERVICES, ServiceModel
from workloads.prompts import LENGTH_MODELS, OUTPUT_LENGTH_MODELS

CONSUMPTION_TOK_S = 4.8  # r_c: reading speed (the brief's reading of Sec. 2.2)
# DiSCo Table 2: P99 TTFT reduction against Stoch, per trace and regime, devices slowest first
PAPER_TABLE2 = {
    ("gpt", "server"): (23.85, 37.41, 44.04), ("gpt", "device"): (26.39, 21.48, 16.32),
    ("llama", "server"): (11.08, 23.09, 26.29), ("llama", "device"): (35.67, 29.30, 21.29),
    ("deepseek", "server"): (0.00, 3.88, 15.53), ("deepseek", "device"): (30.91, 28.01, 25.08),
    ("command", "server"): (47.93, 50.93, 52.23), ("command", "device"): (34.78, 31.53, 24.42),
}  # fmt: skip
POLICIES = {"server": ("stoch-s", "disco-s"), "device": ("stoch-d", "disco-d")}


def alpaca_prompts(rng: np.random.Generator, count: int) -> np.ndarray:
    return np.maximum(1, np.round(LENGTH_MODELS["alpaca"].sample(rng, count))).astype("int64")


def alpaca_outputs(rng: np.random.Generator, count: int) -> np.ndarray:
    return np.clip(np.round(OUTPUT_LENGTH_MODELS["alpaca"].sample(rng, count)), 1, 128).astype("int64")


Services = Mapping[str, ServiceModel]


def sweep_one(trace: str, device_name: str, regime: str, seed: int, args: argparse.Namespace,
              calibration_services: Services = SERVICES,
              evaluation_services: Services = SERVICES) -> list[dict]:  # fmt: skip
    """One trace, device, regime and seed: every policy at every budget on the same evaluation draw.
    The server's TTFTs of the calibration (F) and of the evaluation come from the two services named
    ``trace`` (the same model by default; two halves of a measured trace in bench/disco_engine.py)."""
    device = DEVICE_SPEEDS[device_name]
    calibration = np.random.default_rng([seed, 1])  # profiles come from here, never from the evaluation
    cal_prompts = alpaca_prompts(calibration, args.requests)
    cal_run = ReplayInput.draw(calibration_services[trace], cal_prompts, alpaca_outputs(calibration, args.requests),
                               calibration)  # fmt: skip
    lengths = LengthDistribution.from_samples(cal_prompts)
    ttft = ServerTtft.from_samples(cal_run.server_ttft_s)
    device_fit = LinearTtft.fit(cal_prompts, device.ttft_s(cal_prompts) * cal_run.device_jitter)
    prices = DispatchPrices.for_run(SERVICE_APIS[trace], device.model, regime, float(cal_prompts.mean()))
    costs = TokenCosts(prices.server_prefill, prices.server_decode, prices.device_prefill, prices.device_decode)
    rule = MigrationRule.from_calibration(costs, CONSUMPTION_TOK_S, device_fit, ttft, cal_run.output_tokens,
                                          source_keeps_streaming=not args.source_stops)  # fmt: skip
    evaluation = np.random.default_rng([seed, 2])
    prompts = alpaca_prompts(evaluation, args.requests)
    run = ReplayInput.draw(evaluation_services[trace], prompts, alpaca_outputs(evaluation, args.requests), evaluation)
    base = {"trace": trace, "device": device_name, "regime": regime, "seed": seed,
            "algorithm1": constrained_endpoint(costs), "device_fit_k_s": device_fit.seconds_per_token,
            "device_fit_c_s": device_fit.intercept_s, "device_pearson": device_fit.pearson,
            "server_pearson": float(np.corrcoef(prompts, run.server_ttft_s)[0, 1])}  # fmt: skip
    rows = []
    budgets = np.round(np.linspace(0.0, 1.0, args.budgets), 3)
    for b in budgets:
        for policy in POLICIES[regime]:
            for migration in (False, True) if policy.startswith("disco") else (False,):
                plan = plan_dispatch(policy, float(b), lengths, ttft, alpha=args.alpha)
                result = replay(plan, run, device, CONSUMPTION_TOK_S, rule if migration else None)
                cost = prices.cost_usd(result.server_input_tokens, result.server_output_tokens,
                                       result.device_prefill_tokens, result.device_decode_tokens)  # fmt: skip
                rows.append({**base, "budget": float(b), "policy": policy, "migration": migration,
                             "realised_budget": result.realised_budget(regime),
                             "cost_usd_per_request": float(cost.mean()), **result.summary()})  # fmt: skip
    for policy in ("server-only", "device-only"):
        result = replay(plan_dispatch(policy, 1.0, lengths, ttft), run, device, CONSUMPTION_TOK_S)
        rows.append({**base, "budget": float("nan"), "policy": policy, "migration": False,
                     "realised_budget": result.realised_budget(regime), **result.summary()})  # fmt: skip
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's own arguments (bench/disco_engine.py runs the same sweep on a measured trace)."""
    parser.add_argument("--traces", nargs="+", default=list(SERVICES), choices=list(SERVICES))
    parser.add_argument("--devices", nargs="+", default=list(DEVICE_SPEEDS), choices=list(DEVICE_SPEEDS))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=1000, help="requests a run (the paper's 1,000)")
    parser.add_argument("--budgets", type=int, default=11, help="points of the budget grid over [0, 1]")
    parser.add_argument("--alpha", type=float, default=0.01, help="DiSCo-D's tail ratio")
    parser.add_argument("--source-stops", action="store_true",
                        help="a migrating source stops when the migration begins (default: it streams on "
                             "until the target is ready, Sec. 4.3 / Fig. 4)")  # fmt: skip


def sweep(args: argparse.Namespace, calibration_services: Services = SERVICES,
          evaluation_services: Services = SERVICES) -> pd.DataFrame:  # fmt: skip
    """Every trace, device, regime and seed of ``args`` (one row per run)."""
    began, rows = time.perf_counter(), []
    for trace in args.traces:
        for device in args.devices:
            for regime in POLICIES:
                for seed in range(args.seeds):
                    rows += sweep_one(trace, device, regime, seed, args, calibration_services, evaluation_services)
            print(f"{trace} {device}: {len(rows)} runs, {time.perf_counter() - began:.0f} s", flush=True)
    return pd.DataFrame(rows)


# -- the numbers the reproduction page reads, with intervals over the seeds ----------------------------


def over_seeds(matrix: np.ndarray, reduce: Callable[[np.ndarray], float]) -> Interval:
    """``reduce`` of the seeds' mean (``matrix``: one row a seed; ``reduce`` maps the means, one a
    column, to one value, e.g. the best budget's) with its percentile interval from resampling the seeds
    (:func:`analysis.uncertainty.statistic_interval`)."""
    with np.errstate(invalid="ignore"):
        return statistic_interval(np.asarray(matrix, dtype="float64"), lambda m: float(reduce(np.nanmean(m, axis=0))))


def _seed_mean(values: pd.Series) -> dict:
    """The mean over seeds (one value each) with its interval (analysis.uncertainty.mean_interval)."""
    return mean_interval(values.to_numpy(dtype="float64")).as_dict()


def _paired(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per trace, regime, device, seed and budget: ``metric`` of the regime's Stoch and DiSCo (no
    migration), measured on the same requests."""
    plain = frame[frame["budget"].notna() & ~frame["migration"].astype(bool)]
    wide = plain.pivot_table(index=["trace", "regime", "device", "seed", "budget"], columns="policy", values=metric)
    wide = wide.reindex(columns=["stoch-s", "disco-s", "stoch-d", "disco-d"]).reset_index()
    server = wide["regime"] == "server"
    wide["disco"] = np.where(server, wide["disco-s"], wide["disco-d"])
    wide["stoch"] = np.where(server, wide["stoch-s"], wide["stoch-d"])
    return wide


def headline_numbers(frame: pd.DataFrame) -> dict:
    """Table 2 (P99 TTFT reduction against Stoch averaged over the budget grid, per seed and then over
    seeds), Fig. 6 (DiSCo's mean and P99 TTFT change against Stoch per budget, averaged over the devices:
    its best budget and its average), Fig. 7 (migration's cost cut, the largest over traces, devices and
    budgets) and Table 3 (migrated requests: tokens held for the migration, tokens shown late, TBT P99
    after the buffer) and the realised budget (mean over devices), each with its 95% interval over seeds."""
    swept = frame[frame["budget"].notna()]
    p99, mean = _paired(swept, "p99_ttft_s"), _paired(swept, "mean_ttft_s")
    table2 = []
    p99["reduction_pct"] = 100.0 * (1.0 - p99["disco"] / p99["stoch"])
    for (trace, regime, device), part in p99.groupby(["trace", "regime", "device"], sort=False):
        paper = PAPER_TABLE2.get((trace, regime))
        table2.append({"trace": trace, "regime": regime, "device": device,
                       "reduction_pct": _seed_mean(part.groupby("seed")["reduction_pct"].mean()),
                       "paper_pct": paper[DEVICE_SPEEDS_ORDER.index(device)] if paper else None})  # fmt: skip
    fig6 = []
    for metric, wide in (("p99_ttft", p99), ("mean_ttft", mean)):
        wide = wide.assign(change_pct=100.0 * (wide["disco"] / wide["stoch"] - 1.0))
        for (trace, regime), part in wide.groupby(["trace", "regime"], sort=False):
            by_budget = part.pivot_table(index="seed", columns="budget", values="change_pct")  # mean over devices
            matrix, budgets = by_budget.to_numpy(), [float(b) for b in by_budget.columns]
            fig6.append({"trace": trace, "regime": regime, "metric": metric, "budgets": budgets,
                         "change_pct_by_budget": np.nanmean(matrix, axis=0).round(3).tolist(),
                         "best_change_pct": over_seeds(matrix, np.nanmin).as_dict(),
                         "best_budget": budgets[int(np.nanargmin(np.nanmean(matrix, axis=0)))],
                         "average_change_pct": over_seeds(matrix, np.nanmean).as_dict(),
                         })  # fmt: skip
    disco = swept[swept["policy"].isin(["disco-s", "disco-d"])]
    cost = disco.pivot_table(index=["trace", "regime", "device", "seed", "budget"], columns="migration",
                             values="cost_usd_per_request").reset_index()  # fmt: skip
    fig7 = []
    if True in cost.columns and False in cost.columns:
        cost["cut_pct"] = 100.0 * (1.0 - cost[True] / cost[False])
        for regime, part in cost.groupby("regime", sort=False):
            cells = part.pivot_table(index="seed", columns=["trace", "device", "budget"], values="cut_pct")
            matrix = cells.to_numpy()
            best = cells.columns[int(np.nanargmax(np.nanmean(matrix, axis=0)))]
            fig7.append({"regime": regime, "max_cut_pct": over_seeds(matrix, np.nanmax).as_dict(),
                         "at": {"trace": best[0], "device": best[1], "budget": float(best[2])},
                         "max_cut_pct_by_trace": {
                             trace: over_seeds(cells[trace].to_numpy(), np.nanmax).as_dict()
                             for trace in dict.fromkeys(cells.columns.get_level_values(0))}})  # fmt: skip
    table3 = []
    moved = swept[swept["migration"].astype(bool) & (swept["migrated_share"] > 0)]
    for (trace, regime), part in moved.groupby(["trace", "regime"], sort=False):
        seeds = part.groupby("seed").agg(held=("held_tokens_mean", "mean"), held_p99=("held_tokens_p99", "mean"),
                                         slipped=("slipped_tokens_mean", "mean"), share=("migrated_share", "mean"),
                                         tbt=("migrated_tbt_p99_s", "median"))  # fmt: skip
        table3.append({"trace": trace, "regime": regime, "held_tokens_mean": _seed_mean(seeds["held"]),
                       "held_tokens_p99": _seed_mean(seeds["held_p99"]),
                       "slipped_tokens_mean": _seed_mean(seeds["slipped"]),
                       "migrated_share": _seed_mean(seeds["share"]),
                       "tbt_p99_s": _seed_mean(seeds["tbt"])})  # fmt: skip
    tbt = {regime: _seed_mean(part.groupby("seed")["migrated_tbt_p99_s"].median())
           for regime, part in moved.groupby("regime", sort=False)}  # fmt: skip
    realised = [{"trace": trace, "regime": regime, "policy": policy, "budget": float(budget),
                 "realised_budget": _seed_mean(part.groupby("seed")["realised_budget"].mean())}
                for (trace, regime, policy, budget), part in swept[~swept["migration"].astype(bool)].groupby(
                    ["trace", "regime", "policy", "budget"], sort=False)]  # fmt: skip
    return {"table2": table2, "fig6": fig6, "fig7": fig7, "table3": table3, "table3_tbt_p99_s": tbt,
            "realised_budget": realised}  # fmt: skip


def print_numbers(numbers: dict) -> None:
    """The headline numbers as tables (estimate [low, high])."""

    def text(interval: dict) -> str:
        return f"{interval['estimate']:.3g} [{interval['low']:.3g}, {interval['high']:.3g}]"

    table2 = pd.DataFrame([{"trace": r["trace"], "regime": r["regime"], "device": r["device"],
                            "ours %": text(r["reduction_pct"]), "paper %": r["paper_pct"]}
                           for r in numbers["table2"]])  # fmt: skip
    print("\nTable 2 (P99 TTFT reduction against Stoch, %, averaged over b; mean of seeds)\n" + markdown_table(table2))
    fig6 = pd.DataFrame([{"trace": r["trace"], "regime": r["regime"], "metric": r["metric"],
                          "best %": text(r["best_change_pct"]), "at b": r["best_budget"],
                          "average %": text(r["average_change_pct"])} for r in numbers["fig6"]])  # fmt: skip
    print("\nFig. 6 (DiSCo against Stoch, change %, mean over devices)\n" + markdown_table(fig6))
    fig7 = pd.DataFrame(
        [{"regime": r["regime"], "max cut %": text(r["max_cut_pct"]), **r["at"]} for r in numbers["fig7"]]
    )
    print("\nFig. 7 (migration's largest cost cut)\n" + markdown_table(fig7))
    table3 = pd.DataFrame([{"trace": r["trace"], "regime": r["regime"], "held": text(r["held_tokens_mean"]),
                            "slipped": text(r["slipped_tokens_mean"]), "TBT P99 s": text(r["tbt_p99_s"])}
                           for r in numbers["table3"]])  # fmt: skip
    print("\nTable 3 (migrated requests)\n" + markdown_table(table3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--name", default="disco_sweep", help="result file name under bench/results/")
    args = parser.parse_args()
    began = time.perf_counter()
    frame = sweep(args)
    swept = frame[frame["budget"].notna()]
    table2 = tail_reduction_table(swept)  # seed medians, then the ratio (the README's cells)
    paper = pd.DataFrame(
        [[PAPER_TABLE2[key][DEVICE_SPEEDS_ORDER.index(d)] for d in table2.columns] for key in table2.index],
        index=table2.index, columns=table2.columns)  # fmt: skip
    ends = frame[frame["budget"].isna()].groupby(["trace", "device", "regime", "policy"])[
        ["mean_ttft_s", "p99_ttft_s"]].median().reset_index()  # fmt: skip
    numbers = headline_numbers(frame)
    print_numbers(numbers)
    cost = cost_curves(swept)
    print("\npremises (Pearson of prompt length and TTFT) and Algorithm 1's verdicts")
    print(markdown_table(pd.DataFrame(_premises(frame)).round(4), digits=4))
    command = " ".join(["python", "bench/disco_sweep.py", *sys.argv[1:]])
    path = write(args.name, {
        "command": command, "seconds": round(time.perf_counter() - began, 1), "alpha": args.alpha,
        "source_keeps_streaming": not args.source_stops, "requests": args.requests, "seeds": args.seeds,
        "consumption_tok_s": CONSUMPTION_TOK_S, "services": {k: SERVICES[k].describe() for k in args.traces},
        "modeled": True, **numbers,
        "table2_reduction_pct": _records(table2), "table2_paper_pct": _records(paper),
        "table3_runs": migration_table(swept).to_dict("records"),
        "fig6_curves": budget_curves(swept).to_dict("records"), "fig7_curves": cost.to_dict("records"),
        "ends": ends.to_dict("records"), "premises": _premises(frame),
    })  # fmt: skip
    print(f"wrote {path}")


DEVICE_SPEEDS_ORDER = list(DEVICE_SPEEDS)


def _premises(frame: pd.DataFrame) -> list[dict]:
    """Per trace and device: the Pearson coefficients and the fitted T_d over the seeds."""
    numbers = ["server_pearson", "device_pearson", "device_fit_k_s", "device_fit_c_s"]
    pooled = frame.drop_duplicates(["trace", "device", "regime", "seed"])
    table = pooled.groupby(["trace", "device"])[numbers].agg(["min", "max"])
    table.columns = [f"{name}_{stat}" for name, stat in table.columns]
    verdicts = pooled.groupby(["trace", "device", "regime"])["algorithm1"].agg(lambda v: ",".join(sorted(set(v))))
    out = table.reset_index().to_dict("records")
    for row in out:
        row["algorithm1"] = {regime: verdicts.get((row["trace"], row["device"], regime)) for regime in POLICIES}
    return out


def _records(table: pd.DataFrame) -> list[dict]:
    return table.reset_index().to_dict("records")


if __name__ == "__main__":
    main()
