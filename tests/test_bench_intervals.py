"""The intervals the papers' benches compute from their samples with analysis.uncertainty's bootstrap:
a paired change resamples both sides with one draw (Andes Table 4's percentiles), a capacity is found
again on every resample of the same requests (Andes Sec. 6.1), and a sweep's best budget is read on
resamples of its seeds (DiSCo Fig. 6). Synthetic samples whose answer is known."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bench.andes_calibration import capacity_intervals
from bench.andes_campaign import table4
from bench.disco_sweep import over_seeds

SCHEDULER = "serving.scheduler"


def _requests(scheduler: str, ttft_s: np.ndarray, qoe: np.ndarray, tds: np.ndarray) -> pd.DataFrame:
    count = len(ttft_s)
    return pd.DataFrame({SCHEDULER: scheduler, "repetition": np.arange(count) % 3, "node": "dev0",
                         "request_id": np.arange(count), "qoe": qoe, "ttft_s": ttft_s, "tds_tok_s": tds,
                         "preemptions": 0.0})  # fmt: skip


def test_table4_resamples_a_scheduler_and_its_baseline_on_the_same_requests_with_one_draw():
    rng = np.random.default_rng(3)
    ttft, qoe, tds = rng.lognormal(0, 1, 90), rng.uniform(0.5, 1, 90), rng.uniform(5, 20, 90)
    frame = pd.concat([_requests("fcfs", ttft, qoe, tds), _requests("andes", ttft / 2, qoe, tds + 1.0)])
    rates = pd.DataFrame({SCHEDULER: ["fcfs", "andes"], "output_tokens_per_s": [10.0, 12.0]})
    table = table4(frame, rates, [SCHEDULER], {SCHEDULER: "fcfs"})
    (change,) = table["changes"]
    assert change["settings"] == {SCHEDULER: "andes"} and change["pairs"] == 90
    for pct in ("p10", "p50", "p90"):
        # halving every request's TTFT halves each percentile on every resample: a pairing kept exactly
        halved = change["change"]["ttft_s"][pct]
        assert np.allclose([halved["estimate"], halved["low"], halved["high"]], -0.5)
        same = change["difference"]["qoe"][pct]
        assert same["estimate"] == same["low"] == same["high"] == 0.0
        shifted = change["difference"]["tds_tok_s"][pct]  # +1 token/s each request: +1 at any percentile
        assert np.allclose([shifted["low"], shifted["high"]], 1.0)
    fcfs = next(g for g in table["groups"] if g["settings"] == {SCHEDULER: "fcfs"})
    p50 = fcfs["percentiles"]["ttft_s"]["p50"]
    assert p50["low"] < p50["estimate"] < p50["high"]  # one side alone does vary across resamples
    assert fcfs["repetitions"] == 3 and fcfs["output_tokens_per_s"] == 10.0


def test_a_capacity_is_found_again_on_each_resample_of_the_same_requests():
    rng = np.random.default_rng(5)
    rates, seeds, count = [1.0, 2.0, 3.0], 2, 200
    borderline = (rng.uniform(size=(seeds, count)) > 0.1).astype(float)  # mean QoE near the 0.9 threshold
    qoe = {("fcfs", 1.0): np.ones((seeds, count)), ("fcfs", 2.0): borderline, ("fcfs", 3.0): np.zeros((seeds, count)),
           ("andes", 1.0): np.ones((seeds, count)), ("andes", 2.0): np.ones((seeds, count)),
           ("andes", 3.0): np.ones((seeds, count))}  # fmt: skip
    runs = {key: [{"qoe": row} for row in values] for key, values in qoe.items()}
    out = capacity_intervals(runs, ["fcfs", "andes"], rates, "fcfs", resamples=400)
    fcfs, andes = out["capacity_per_s"]["fcfs"], out["capacity_per_s"]["andes"]
    assert andes["low"] == andes["estimate"] == andes["high"] == 3.0  # never below the threshold
    assert fcfs["low"] == 1.0 and fcfs["high"] == 2.0  # 2/s passes on some resamples, fails on others
    factor = out["capacity_factor"]["andes"]
    assert factor["estimate"] == 3.0 / fcfs["estimate"] and factor["low"] == 1.5 and factor["high"] == 3.0


def test_a_sweep_s_best_budget_is_read_again_on_resamples_of_its_seeds():
    seeds = np.array([[0.0, -10.0, -4.0], [0.0, -30.0, -2.0], [0.0, -20.0, -6.0], [0.0, -20.0, np.nan]])
    best = over_seeds(seeds, np.nanmin)
    assert best.estimate == -20.0 and best.units == 4  # the budget with the lowest mean change
    assert -30.0 <= best.low < best.estimate < best.high <= -10.0
    average = over_seeds(seeds, np.nanmean)
    assert np.isclose(average.estimate, np.mean([0.0, -20.0, -4.0]))
