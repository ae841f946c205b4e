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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def _resampled_sums(arrays: Sequence[np.ndarray], clusters: np.ndarray, resamples: int,
                    rng: np.random.Generator) -> list[np.ndarray]:  # fmt: skip
    """For each of ``arrays`` (one value a unit), its sum over the units of each of ``resamples`` two-stage
    resamples: clusters drawn with replacement, then the units of each cluster (the same draw for every
    array, so that pairs and a ratio's numerator and denominator stay together)."""
    labels, inverse = np.unique(clusters, return_inverse=True)
    per_cluster = np.zeros((len(arrays), len(labels), resamples))
    for c in range(len(labels)):
        members = np.flatnonzero(inverse == c)
        for start in range(0, resamples, 256):  # bounded memory: 256 resamples of a cluster at a time
            stop = min(start + 256, resamples)
            drawn = members[rng.integers(0, len(members), size=(stop - start, len(members)))]
            for a, values in enumerate(arrays):
                per_cluster[a, c, start:stop] = values[drawn].sum(axis=1)
    if len(labels) == 1:
        return [per_cluster[a, 0] for a in range(len(arrays))]
    chosen = rng.integers(0, len(labels), size=(resamples, len(labels)))
    columns = np.arange(resamples)[:, None]
    return [per_cluster[a][chosen, columns].sum(axis=1) for a in range(len(arrays))]


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
    sum_num, sum_den = _resampled_sums([num, den], group, resamples, np.random.default_rng(seed))
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
    sums = _resampled_sums([num_t, den_t, num_b, den_b], group, resamples, np.random.default_rng(seed))
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
