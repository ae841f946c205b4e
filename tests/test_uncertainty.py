"""Intervals by bootstrap (analysis/uncertainty.py) and paper-against-ours verdicts (analysis/reproduction.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.reproduction import DIRECTION, MISSED, NOT_RUN, WITHIN, Comparison, comparison_table, count_line, counts
from analysis.uncertainty import (
    RESAMPLES,
    Interval,
    change_interval,
    cluster_resamples,
    mean_interval,
    percentile_interval,
    statistic_interval,
    statistic_samples,
    unpaired_change_interval,
    within_noise,
)


def test_the_interval_of_a_mean_covers_the_true_mean_about_95_times_in_100():
    rng = np.random.default_rng(3)
    covered = sum(mean_interval(rng.lognormal(0.0, 0.6, 200), seed=i).contains(math.exp(0.18)) for i in range(100))
    assert 88 <= covered <= 99  # a percentile bootstrap of a skewed mean: slightly below 95 at n = 200


def test_a_ratio_of_sums_resamples_a_request_s_gaps_together():
    # TBT: two requests, one with 9 gaps of 10 ms, one with 1 gap of 100 ms: the pooled mean is 19 ms,
    # not the mean of the requests' means (55 ms)
    interval = mean_interval([0.09, 0.1], [9, 1])
    assert interval.estimate == pytest.approx(0.019)
    assert interval.low <= interval.estimate <= interval.high


def test_repetitions_that_disagree_widen_the_interval_beyond_the_requests_alone():
    rng = np.random.default_rng(5)
    offsets = np.repeat([0.0, 3.0, -3.0, 1.5, -1.5], 300)
    values = rng.normal(10.0, 1.0, len(offsets)) + offsets
    alone = mean_interval(values)
    clustered = mean_interval(values, clusters=np.repeat(np.arange(5), 300))
    assert (clustered.high - clustered.low) > 3 * (alone.high - alone.low)
    assert clustered.estimate == pytest.approx(alone.estimate)


def test_pairs_find_a_small_change_that_unpaired_samples_call_noise():
    rng = np.random.default_rng(7)
    baseline = rng.lognormal(0.0, 0.5, 400)
    treatment = baseline * 0.97 * rng.lognormal(0.0, 0.02, 400)  # 3% faster, request by request
    paired = change_interval(treatment, baseline)
    unpaired = unpaired_change_interval(treatment, baseline)
    assert paired.estimate == pytest.approx(unpaired.estimate)
    assert not within_noise(paired) and paired.high < 0
    assert within_noise(unpaired)


def test_the_same_data_gives_the_same_interval():
    values = np.arange(50.0)
    assert mean_interval(values) == mean_interval(values)


def test_missing_values_are_left_out_and_no_data_gives_nan():
    assert mean_interval([1.0, np.nan, 3.0]).units == 2
    empty = mean_interval([])
    assert math.isnan(empty.estimate) and empty.units == 0
    assert within_noise(empty)


def test_a_resample_draws_whole_clusters_and_a_cluster_drawn_twice_brings_the_same_units():
    clusters = np.repeat(["a", "b", "c"], 4)
    for rows in cluster_resamples(clusters, resamples=200, seed=1):
        assert len(rows) == 12
        parts = rows.reshape(3, 4)  # one drawn cluster a part: its units, drawn from it alone
        labels = [set(clusters[part]) for part in parts]
        assert all(len(label) == 1 for label in labels)
        for i in range(3):
            for j in range(i):
                if labels[i] == labels[j]:
                    assert (parts[i] == parts[j]).all()


def test_one_cluster_is_a_plain_resample_of_the_units():
    draws = list(cluster_resamples(np.zeros(30), resamples=100))
    assert len(draws) == 100 and all(len(rows) == 30 and rows.min() >= 0 and rows.max() < 30 for rows in draws)
    assert any(len(set(rows)) < 30 for rows in draws)  # with replacement
    assert all(rows.tolist() == again.tolist() for rows, again in zip(draws, cluster_resamples(np.zeros(30), 100),
                                                                      strict=True))  # fmt: skip


def test_the_mean_as_a_statistic_gives_the_interval_of_mean_interval():
    rng = np.random.default_rng(11)
    clusters = np.repeat([0, 1, 2, 3], [50, 80, 20, 60])  # unequal clusters: resamples of unequal length
    values = rng.lognormal(0.0, 0.5, len(clusters)) + clusters
    for group in (None, clusters):
        general, mean = statistic_interval(values, np.mean, group), mean_interval(values, clusters=group)
        assert (general.estimate, general.low, general.high, general.units) == pytest.approx(
            (mean.estimate, mean.low, mean.high, mean.units), rel=1e-12)


def test_a_statistic_interval_is_fixed_by_its_seed_and_holds_its_estimate():
    values = np.random.default_rng(13).exponential(1.0, 300)
    interval = statistic_interval(values, np.median)
    assert interval == statistic_interval(values, np.median)
    assert interval != statistic_interval(values, np.median, seed=1)
    assert interval.estimate == np.median(values) and interval.low < interval.estimate < interval.high
    assert interval.units == 300 and interval.confidence == 0.95
    assert interval.low > 0.5 and interval.high < 0.9  # the true median, ln 2 = 0.69, and within sampling noise


def test_a_row_keeps_its_paired_columns_together():
    rng = np.random.default_rng(17)
    before = rng.lognormal(0.0, 1.0, 200)
    pairs = np.column_stack([before, before + 1.0])  # each unit one more than itself
    paired = statistic_interval(pairs, lambda v: float(np.median(v[:, 1] - v[:, 0])))
    assert (paired.estimate, paired.low, paired.high) == pytest.approx((1.0, 1.0, 1.0))
    alone = statistic_interval(pairs, lambda v: float(np.median(v[:, 1])))
    assert alone.high - alone.low > 0.1  # each column alone varies: apart, their difference would too


def test_repetitions_that_disagree_widen_a_statistic_s_interval():
    rng = np.random.default_rng(19)
    clusters = np.repeat(np.arange(5), 200)
    values = rng.normal(0.0, 1.0, len(clusters)) + np.array([0.0, 3.0, -3.0, 1.5, -1.5])[clusters]
    alone = statistic_interval(values, np.median)
    clustered = statistic_interval(values, np.median, clusters)
    assert clustered.high - clustered.low > 3 * (alone.high - alone.low)
    assert clustered.estimate == alone.estimate


def test_a_vector_statistic_stacks_one_row_a_resample_from_the_same_draws():
    rng = np.random.default_rng(23)
    values, clusters = rng.normal(size=(120, 2)), np.repeat([0, 1, 2], 40)
    samples = statistic_samples(values, lambda v: np.percentile(v, [10, 50, 90], axis=0), clusters)
    assert samples.shape == (RESAMPLES, 3, 2)
    medians = statistic_samples(values, lambda v: float(np.median(v[:, 1])), clusters)
    assert medians.shape == (RESAMPLES,)
    assert samples[:, 1, 1] == pytest.approx(medians)


def test_non_finite_samples_are_left_out_and_none_left_gives_no_interval():
    samples = np.concatenate([np.linspace(0.0, 1.0, 101), [np.nan, np.inf, -np.inf]])
    interval = percentile_interval(0.5, samples, 7)
    assert (interval.low, interval.high, interval.units) == pytest.approx((0.025, 0.975, 7))
    assert math.isnan(percentile_interval(0.5, np.full(10, np.nan), 7).low)
    nothing = percentile_interval(math.nan, samples, 7)  # no interval around no estimate
    assert math.isnan(nothing.low) and math.isnan(nothing.high) and nothing.units == 7
    empty = statistic_interval(np.zeros(0), np.mean)
    assert math.isnan(empty.estimate) and empty.units == 0
    # a statistic undefined on some resamples (the first cluster's share of the second's mean, when the
    # resample lacks one) keeps the resamples where it is defined
    clusters = np.repeat([0, 1], 10)

    def ratio(rows: np.ndarray) -> float:
        first, second = rows[rows < 10], rows[rows >= 10]
        return float(first.mean() / second.mean()) if len(first) and len(second) else math.nan

    with_gaps = statistic_interval(np.arange(20), ratio, clusters)
    assert np.isfinite([with_gaps.low, with_gaps.high]).all() and with_gaps.contains(with_gaps.estimate)


def _ours(estimate: float, low: float, high: float) -> Interval:
    return Interval(estimate, low, high, 100)


@pytest.mark.parametrize(
    ("paper", "ours", "no_effect", "verdict"),
    [
        (-41.4, _ours(-35.0, -38.0, -32.0), 0.0, WITHIN),  # 0.85 of the paper's effect
        (-41.4, _ours(-10.0, -12.0, -8.0), 0.0, DIRECTION),  # a quarter of it, but surely there
        (-41.4, _ours(-40.0, -45.0, 2.0), 0.0, MISSED),  # within noise
        (-41.4, _ours(5.0, 3.0, 7.0), 0.0, MISSED),  # the wrong way
        (4.7, _ours(4.0, 3.5, 4.5), 1.0, WITHIN),  # a factor: (4 - 1) / (4.7 - 1) = 0.81
        (655.6, _ours(900.0, 880.0, 920.0), None, MISSED),  # a plain value 37% off
        (655.6, _ours(700.0, 680.0, 720.0), None, WITHIN),
        (655.6, None, None, NOT_RUN),
    ],
)
def test_verdicts(paper, ours, no_effect, verdict):
    assert Comparison("Table", "q", "%", paper, ours, no_effect).verdict == verdict


@pytest.mark.parametrize(
    ("ours", "verdict"),
    [
        (_ours(0.02, -0.2, 0.08), WITHIN),  # a premise's bound (Pearson < 0.1): the whole interval under it
        (_ours(0.05, -0.1, 0.3), DIRECTION),  # the estimate under it, the interval over
        (_ours(0.4, 0.2, 0.6), MISSED),
        (Interval(0.02, math.nan, math.nan, 3), DIRECTION),  # no interval: not shown to hold
    ],
)
def test_a_bound_holds_when_the_whole_interval_is_under_it(ours, verdict):
    comparison = Comparison("Table 1", "server Pearson", "", 0.1, ours, None, at_most=True)
    assert comparison.verdict == verdict
    assert "| ≤ 0.1 |" in comparison_table([comparison])


def test_the_count_line_says_what_is_stale_and_not_run():
    rows = [
        Comparison("T", "a", "%", -40.0, _ours(-38.0, -40.0, -36.0), stale=True),
        Comparison("T", "b", "%", -40.0, None),
        Comparison("T", "c", "%", -40.0, Interval(-5.0, math.nan, math.nan, 1)),
    ]
    assert counts(rows) == {WITHIN: 1, DIRECTION: 1, MISSED: 0, NOT_RUN: 1, "stale": 1, "without interval": 1}
    line = count_line(rows)
    assert "1 within ±25%" in line and "1 not run yet" in line and "1 stale" in line


def test_resamples_come_one_at_a_time_so_memory_stays_bounded():
    # all of them at once would be 20,000 units x 10^7 resamples x 8 bytes (1.6 TB); a block is 41 MB
    draws = cluster_resamples(np.repeat([0, 1], 10_000), resamples=10_000_000)
    first, second = next(draws), next(draws)
    assert len(first) == len(second) == 20_000 and first.tolist() != second.tolist()
