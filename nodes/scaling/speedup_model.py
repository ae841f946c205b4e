"""CoCoServe's speedup model (Sec. 4.1) of a placement of replicated layers.

Times are per step of the whole batch: ``compute_s[g]`` is one layer over the full batch on GPU g (the
paper's d^2 x bs x l / C), ``transfer_s[g]`` moving the full batch's hidden states between a layer's
primary and g (d x bs x l / B). A layer on p GPUs splits its batch so that every copy finishes together
(shares in proportion to speed; even on identical GPUs).

- Eq. 1, :func:`computation_s`: W(P) = sum over layers of the slowest copy's share of the work.
- Eq. 2, :func:`communication_s` (as we read it): each maximal run of consecutive layers replicated
  on a GPU pays one scatter of its share before the run and one gather after it; the paper's delta,
  the count of non-consecutive transitions, is the number of runs. (The printed sum over every layer
  would charge a transfer per layer, against Sec. 3.2, which the constant delta was meant to undo.)
- Eq. 3, :func:`speedup`: S(P) = W(P_0) / (W(P) + T(P)).
- Eq. 4, :func:`homogeneous_speedup`: S = 1 / (gamma + (1 - gamma) / n x sum 1/p_i).

On identical GPUs, Eq. 2 as read makes a run of k layers on p GPUs cost 2 t (1 - 1/p), and Eq. 4's
communication term gamma w k (1 - 1/p): so gamma = 2 t / (k w) (:func:`gamma_from_times`), and
:func:`fit_gamma` fits it from measured speedups instead.
"""

from typing import Callable, Dict, Mapping, Sequence, Tuple

from .placement import Placement


def shares(placement: Placement, layer: int, compute_s: Mapping[str, float]) -> Dict[str, float]:
    """Each copy's share of ``layer``'s batch: in proportion to its GPU's speed, summing to 1."""
    speeds = {g: 1.0 / compute_s[g] for g in placement.hosts[layer]}
    total = sum(speeds.values())
    return {g: s / total for g, s in speeds.items()}


def computation_s(placement: Placement, compute_s: Mapping[str, float]) -> float:
    """Eq. 1: W(P), the sum over layers of the slowest copy's time on its share."""
    total = 0.0
    for layer, hosts in enumerate(placement.hosts):
        share = shares(placement, layer, compute_s)
        total += max(compute_s[g] * share[g] for g in hosts)
    return total


def communication_s(placement: Placement, compute_s: Mapping[str, float], transfer_s: Mapping[str, float]) -> float:
    """Eq. 2 as we read it: per GPU and per run of consecutive layers replicated on it, the scatter of
    its share of the run's first layer and the gather of its share of the last."""
    total = 0.0
    for gpu in placement.replica_gpus():
        for first, last in placement.runs_on(gpu):
            scatter = shares(placement, first, compute_s)[gpu]
            gather = shares(placement, last, compute_s)[gpu]
            total += transfer_s[gpu] * (scatter + gather)
    return total


def transitions(placement: Placement) -> int:
    """delta: the runs of replicated layers (each a scatter and a gather), over every GPU."""
    return sum(len(placement.runs_on(g)) for g in placement.replica_gpus())


def speedup(placement: Placement, compute_s: Mapping[str, float], transfer_s: Mapping[str, float]) -> float:
    """Eq. 3: S(P) = W(P_0) / (W(P) + T(P)), P_0 the same layers on their primaries alone."""
    alone = sum(compute_s[hosts[0]] for hosts in placement.hosts)
    return alone / (computation_s(placement, compute_s) + communication_s(placement, compute_s, transfer_s))


def times_by_share(placement: Placement, layer_s: Callable[[str, float], float],
                   transfer_s: Mapping[str, float]) -> Tuple[float, float]:  # fmt: skip
    """Eq. 3's two times, W(P_0) and W(P) + T(P), with each copy's time taken for its share rather than
    proportional to it: ``layer_s(g, share)`` is GPU g's time for one layer on that share of the batch
    (measured, or the profile's roofline, under which a memory-bound decode step reads every weight
    whatever the share, so that splitting its batch saves little); shares are even (identical GPUs),
    and Eq. 2's transfers are as in :func:`communication_s`."""
    alone = sum(layer_s(hosts[0], 1.0) for hosts in placement.hosts)
    work = sum(max(layer_s(g, 1.0 / len(hosts)) for g in hosts) for hosts in placement.hosts)
    even = {g: 1.0 for hosts in placement.hosts for g in hosts}
    return alone, work + communication_s(placement, even, transfer_s)


def speedup_by_share(placement: Placement, layer_s: Callable[[str, float], float],
                     transfer_s: Mapping[str, float]) -> float:  # fmt: skip
    """Eq. 3 from :func:`times_by_share`; with ``layer_s(g, s) = s x compute_s[g]`` it is :func:`speedup`."""
    alone, placed = times_by_share(placement, layer_s, transfer_s)
    return alone / placed


def homogeneous_speedup(degrees: Sequence[int], gamma: float) -> float:
    """Eq. 4: S(P) = 1 / (gamma + (1 - gamma) / n x ||1 / P||_1)."""
    if not degrees or min(degrees) < 1:
        raise ValueError("every layer runs on at least one GPU")
    return 1.0 / (gamma + (1.0 - gamma) / len(degrees) * sum(1.0 / p for p in degrees))


def gamma_from_times(compute_s: float, transfer_s: float, run_layers: int) -> float:
    """gamma = delta C / (d B) on identical GPUs, from one layer's compute time over the full batch,
    the full batch's transfer time and the layers a replicated run spans: 2 t / (k w)."""
    if compute_s <= 0 or run_layers < 1:
        raise ValueError("a layer takes time and a run holds at least one layer")
    return 2.0 * transfer_s / (run_layers * compute_s)


def fit_gamma(measured: Sequence[Tuple[Sequence[int], float]]) -> float:
    """gamma by least squares from measured (P, speedup) pairs: Eq. 4 is linear in gamma as
    1/S - a = gamma (1 - a), with a = ||1 / P||_1 / n. Pairs without a replica (a = 1) say nothing."""
    numerator = denominator = 0.0
    for degrees, observed in measured:
        a = sum(1.0 / p for p in degrees) / len(degrees)
        numerator += (1.0 - a) * (1.0 / observed - a)
        denominator += (1.0 - a) ** 2
    if denominator == 0:
        raise ValueError("gamma needs at least one measured placement with a replica")
    return numerator / denominator


def identical(gpus: Sequence[str], value: float) -> Dict[str, float]:
    """The same time for every GPU (a homogeneous server)."""
    return {g: value for g in gpus}

