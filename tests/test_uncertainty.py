"""Intervals by bootstrap (analysis/uncertainty.py) and paper-against-ours verdicts (analysis/reproduction.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.reproduction import DIRECTION, MISSED, NOT_RUN, WITHIN, Comparison, count_line, counts
from analysis.uncertainty import (
    Interval,
    change_interval,
    mean_interval,
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


def test_the_count_line_says_what_is_stale_and_not_run():
    rows = [
        Comparison("T", "a", "%", -40.0, _ours(-38.0, -40.0, -36.0), stale=True),
        Comparison("T", "b", "%", -40.0, None),
        Comparison("T", "c", "%", -40.0, Interval(-5.0, math.nan, math.nan, 1)),
    ]
    assert counts(rows) == {WITHIN: 1, DIRECTION: 1, MISSED: 0, NOT_RUN: 1, "stale": 1, "without interval": 1}
    line = count_line(rows)
    assert "1 within ±25%" in line and "1 not run yet" in line and "1 stale" in line
