"""How sure a number is: 95% intervals of means and of relative changes, by bootstrap over requests and
repetitions, and whether a difference is within noise.

A mean here is a ratio of sums over units (requests): ``sum(numerator) / sum(denominator)``. TTFT's mean
is the plain mean (denominator 1 a request); TBT's mean over every gap between tokens is a request's sum
of gaps over its count of gaps, so resampling requests keeps a request's gaps together (they are not
independent). Units in clusters (repetitions, each with its own seed) are resampled in two stages: the
clusters with replacement, then the units inside each drawn cluster with replacement (the cluster
bootstrap of Davison and Hinkley, Sec. 3.8; each cluster draws its units once per resample, also when it
is drawn twice). A change of a treatment against a baseline measured on the same requests (the same
workload seed per repetition) resamples the pairs together, which is what makes small effects visible.
Any other statistic (a percentile, a capacity, a ratio of percentiles) is recomputed on the same two-stage
resamples (``statistic_interval``, ``statistic_samples``), its interval their percentile interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 20240531  # a fixed seed: the same data gives the same interval, so pages regenerate identically
Values = Sequence[float] | np.ndarray


@dataclass(frozen=True)
class Interval:
    """An estimate with its interval (``low`` to ``high`` at ``confidence``) and the units it rests on."""

    estimate: float
    low: float
    high: float
    units: int
    confidence: float = CONFIDENCE

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (``factor`` > 0), e.g. seconds to milliseconds."""
        return Interval(self.estimate * factor, self.low * factor, self.high * factor, self.units, self.confidence)

    def as_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "units": self.units,
                "confidence": self.confidence}  # fmt: skip

    @staticmethod
    def from_dict(data: dict[str, float]) -> Interval:
        return Interval(float(data["estimate"]), float(data["low"]), float(data["high"]), int(data["units"]),
                        float(data.get("confidence", CONFIDENCE)))  # fmt: skip


BLOCK = 256  # resamples drawn at a time: memory stays bounded by a block's units, whatever the resamples


def _draws(inverse: np.ndarray, clusters: int, resamples: int,
           seed: int) -> Iterator[tuple[int, list[np.ndarray], np.ndarray]]:  # fmt: skip
    """The two-stage draws of ``resamples`` resamples, :data:`BLOCK` at a time from one generator seeded
    with ``seed``: ``(start, units, chosen)``, ``units[c]`` the unit indices that resamples ``start`` to
    ``start + len(chosen)`` draw from cluster ``c`` (``inverse`` numbers each unit's cluster) with
    replacement, a row each, and ``chosen`` the clusters each of them draws with replacement (a single
    cluster is always drawn: nothing to draw)."""
    rng = np.random.default_rng(seed)
    members = [np.flatnonzero(inverse == c) for c in range(clusters)]
    for start in range(0, resamples, BLOCK):
        size = min(BLOCK, resamples - start)
        units = [m[rng.integers(0, len(m), size=(size, len(m)))] for m in members]
        chosen = np.zeros((size, 1), dtype="int64") if clusters == 1 else rng.integers(0, clusters, (size, clusters))
        yield start, units, chosen


def _resampled_sums(arrays: Sequence[np.ndarray], clusters: np.ndarray, resamples: int,
                    seed: int) -> list[np.ndarray]:  # fmt: skip
    """For each of ``arrays`` (one value a unit), its sum over the units of each of ``resamples`` two-stage
    resamples: clusters drawn with replacement, then the units of each cluster (the same draw for every
    array, so that pairs and a ratio's numerator and denominator stay together). The draws are
    :func:`cluster_resamples`', summed a cluster at a time instead of listing each resample's units."""
    labels, inverse = np.unique(clusters, return_inverse=True)
    sums = [np.zeros(resamples) for _ in arrays]
    for start, units, chosen in _draws(inverse, len(labels), resamples, seed):
        rows = np.arange(len(chosen))[:, None]
        for a, values in enumerate(arrays):
            per_cluster = np.stack([values[drawn].sum(axis=1) for drawn in units], axis=1)  # (block, clusters)
            sums[a][start:start + len(chosen)] = per_cluster[rows, chosen].sum(axis=1)
    return sums


def cluster_resamples(clusters: Sequence[object] | np.ndarray, resamples: int = RESAMPLES,
                      seed: int = SEED) -> Iterator[np.ndarray]:  # fmt: skip
    """Row indices of ``resamples`` two-stage resamples of units whose clusters are ``clusters`` (one
    label a unit), one resample at a time: the clusters with replacement, then the units of each cluster
    with replacement (a cluster drawn twice brings the same units twice), the draws :func:`mean_interval`
    sums. One cluster (all labels alike) is a plain resample of the units."""
    labels, inverse = np.unique(np.asarray(clusters), return_inverse=True)
    if not len(labels):
        for _ in range(resamples):
            yield np.zeros(0, dtype="int64")
        return
    for _, units, chosen in _draws(inverse, len(labels), resamples, seed):
        for r, picked in enumerate(chosen):
            yield np.concatenate([units[c][r] for c in picked])


def statistic_samples(values: np.ndarray, statistic: Callable[[np.ndarray], float | np.ndarray],
                      clusters: Sequence[object] | np.ndarray | None = None, *, resamples: int = RESAMPLES,
                      seed: int = SEED) -> np.ndarray:  # fmt: skip
    """``statistic`` on each of :func:`cluster_resamples`' resamples of ``values`` (its first axis the
    units, ``clusters`` their labels, None one cluster; a 2-D array's row is a unit with its paired
    columns, which stay together): shape (resamples, *the statistic's shape), the same draws for every
    statistic of the same clusters, so that statistics of a unit's columns stay paired."""
    values = np.asarray(values)
    group = np.zeros(len(values), dtype="int64") if clusters is None else np.asarray(clusters)
    if len(group) != len(values):
        raise ValueError("one cluster label a unit")
    draws = cluster_resamples(group, resamples, seed)
    return np.array([statistic(values[rows]) for rows in draws], dtype="float64")


def percentile_interval(estimate: float, samples: np.ndarray, units: int,
                        confidence: float = CONFIDENCE) -> Interval:  # fmt: skip
    """``estimate`` with the percentile interval of its bootstrap ``samples`` (non-finite ones left out),
    resting on ``units``; NaN bounds where no sample is finite or the estimate itself is not."""
    if not math.isfinite(estimate):
        return Interval(float(estimate), math.nan, math.nan, units, confidence)
    low, high = _percentiles(np.asarray(samples, dtype="float64").ravel(), confidence)
    return Interval(float(estimate), low, high, units, confidence)


def statistic_interval(values: np.ndarray, statistic: Callable[[np.ndarray], float],
                       clusters: Sequence[object] | np.ndarray | None = None, *, confidence: float = CONFIDENCE,
                       resamples: int = RESAMPLES, seed: int = SEED) -> Interval:  # fmt: skip
    """``statistic`` (one number) of ``values`` (its first axis the units: a 2-D array keeps a unit's
    paired columns together) with its percentile interval over :func:`statistic_samples`. The statistic
    sees every unit, NaN ones too (it decides what they mean); no unit gives NaN throughout."""
    values = np.asarray(values)
    if not len(values):
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    samples = statistic_samples(values, statistic, clusters, resamples=resamples, seed=seed)
    return percentile_interval(float(statistic(values)), samples, len(values), confidence)


def _percentiles(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    samples = samples[np.isfinite(samples)]
    if not len(samples):
        return math.nan, math.nan
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def _as_arrays(
    numerator: Values, denominator: Values | None, clusters: Sequence[object] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num = np.asarray(numerator, dtype="float64")
    den = np.ones_like(num) if denominator is None else np.asarray(denominator, dtype="float64")
    group = np.zeros(len(num), dtype="int64") if clusters is None else np.asarray(clusters)
    keep = np.isfinite(num) & np.isfinite(den)
    return num[keep], den[keep], group[keep]


def mean_interval(numerator: Values, denominator: Values | None = None,
                  clusters: Sequence[object] | np.ndarray | None = None, *, confidence: float = CONFIDENCE,
                  resamples: int = RESAMPLES, seed: int = SEED) -> Interval:  # fmt: skip
    """The mean ``sum(numerator) / sum(denominator)`` over units (denominator 1 each when None), with its
    bootstrap percentile interval; ``clusters`` names each unit's repetition. NaN units are left out;
    no unit gives NaN throughout."""
    num, den, group = _as_arrays(numerator, denominator, clusters)
    if not len(num) or den.sum() == 0:
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    sum_num, sum_den = _resampled_sums([num, den], group, resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = sum_num / sum_den
    low, high = _percentiles(samples, confidence)
    return Interval(float(num.sum() / den.sum()), low, high, len(num), confidence)


def change_interval(treatment: Values, baseline: Values,
                    treatment_denominator: Values | None = None,
                    baseline_denominator: Values | None = None,
                    clusters: Sequence[object] | np.ndarray | None = None, *, confidence: float = CONFIDENCE,
                    resamples: int = RESAMPLES, seed: int = SEED) -> Interval:  # fmt: skip
    """The relative change of the treatment's mean against the baseline's, ``mean_t / mean_b - 1``, with
    its bootstrap interval, the two measured on the same units (position i of each is the same request:
    the pairs are resampled together). A pair with a NaN on either side is left out."""
    num_t, den_t = np.asarray(treatment, float), _ones_or(treatment_denominator, len(treatment))
    num_b, den_b = np.asarray(baseline, float), _ones_or(baseline_denominator, len(baseline))
    if not (len(num_t) == len(num_b) == len(den_t) == len(den_b)):
        raise ValueError("a paired change needs the same units on both sides")
    group = np.zeros(len(num_t), dtype="int64") if clusters is None else np.asarray(clusters)
    keep = np.isfinite(num_t) & np.isfinite(den_t) & np.isfinite(num_b) & np.isfinite(den_b)
    num_t, den_t, num_b, den_b, group = num_t[keep], den_t[keep], num_b[keep], den_b[keep], group[keep]
    if not len(num_t) or den_t.sum() == 0 or num_b.sum() == 0:
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    sums = _resampled_sums([num_t, den_t, num_b, den_b], group, resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = (sums[0] / sums[1]) / (sums[2] / sums[3]) - 1
    low, high = _percentiles(samples, confidence)
    estimate = (num_t.sum() / den_t.sum()) / (num_b.sum() / den_b.sum()) - 1
    return Interval(float(estimate), low, high, len(num_t), confidence)


def unpaired_change_interval(treatment: Values, baseline: Values, *,
                             confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                             seed: int = SEED) -> Interval:  # fmt: skip
    """``mean(treatment) / mean(baseline) - 1`` for samples of different units, each resampled on its own."""
    t, b = np.asarray(treatment, float), np.asarray(baseline, float)
    t, b = t[np.isfinite(t)], b[np.isfinite(b)]
    if not len(t) or not len(b) or b.mean() == 0:
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    rng = np.random.default_rng(seed)
    mean_t = t[rng.integers(0, len(t), size=(resamples, len(t)))].mean(axis=1)
    mean_b = b[rng.integers(0, len(b), size=(resamples, len(b)))].mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        low, high = _percentiles(mean_t / mean_b - 1, confidence)
    return Interval(float(t.mean() / b.mean() - 1), low, high, min(len(t), len(b)), confidence)


def _ones_or(values: Values | None, length: int) -> np.ndarray:
    return np.ones(length) if values is None else np.asarray(values, dtype="float64")


def within_noise(change: Interval, no_effect: float = 0.0) -> bool:
    """Whether the interval of a difference includes no difference at all (or has none: NaN)."""
    return not (change.low > no_effect or change.high < no_effect)
