"""CoCoServe's Algorithm 1 (scale-up): add layer replicas on GPUs with spare resources while the
predicted speedup rises.

For each eligible GPU (resource vacancy above T_up, the emptiest first), max_replicas is its free
memory over one layer's bytes (floored); the candidates are the layers it does not hold yet, by
continuity (:func:`by_continuity`); each is added when the speedup of the placement with it beats
the best so far (Eq. 3 with measured times, or Eq. 4 with gamma). Our reading where the paper is
terse, after the brief: P* starts as P; one replica of a layer per GPU; the layers with the fewest
copies are candidates first; and a candidate that does not pay alone is kept on trial while its run
goes on, so that a run whose ends pay one scatter and one gather is judged whole (with Eq. 4 this
changes nothing: every replica pays alone when gamma < 1 and none does when gamma >= 1). The speedup
never decreases and no GPU goes over its capacity.
"""

from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .placement import GpuMemory, Placement, _runs, available_bytes

Speedup = Callable[[Placement], float]


class ScaleUp(NamedTuple):
    placement: Placement
    speedup: float
    added: Tuple[Tuple[int, str], ...]  # (layer, GPU) replicas in the order they were committed


def eligible(vacancy: Mapping[str, float], threshold: float) -> List[str]:
    """GetEligibleNodes: the GPUs whose vacancy rate exceeds ``threshold``, the emptiest first."""
    return [g for g, v in sorted(vacancy.items(), key=lambda kv: (-kv[1], kv[0])) if v > threshold]


def by_continuity(placement: Placement, gpu: str, max_replicas: int) -> List[int]:
    """SortCandidatesByContinuity: the layers ``gpu`` could replicate, in runs of consecutive indices,
    the longest run first (ties by index), the first ``max_replicas`` of them. Layers with fewer copies
    come before layers with more (our reading: one more copy gains most where there are fewest, Eq. 4's
    1/p - 1/(p+1)), so a second GPU with room replicates what the first did not."""
    free = [i for i, hosts in enumerate(placement.hosts) if gpu not in hosts]
    out: List[int] = []
    for degree in sorted({len(placement.hosts[i]) for i in free}):
        runs = sorted(_runs([i for i in free if len(placement.hosts[i]) == degree]), key=lambda r: (r[0] - r[1], r[0]))
        out += [i for first, last in runs for i in range(first, last + 1)]
    return out[: max(0, max_replicas)]


def scale_up(placement: Placement, memory: Dict[str, GpuMemory], vacancy: Mapping[str, float], threshold: float,
             layer_bytes: int, predict: Speedup, gpus: Optional[Sequence[str]] = None) -> ScaleUp:  # fmt: skip
    """Algorithm 1 over the GPUs of ``vacancy`` (only ``gpus`` where given): the placement P*, its
    predicted speedup and the replicas added."""
    if layer_bytes <= 0:
        raise ValueError("a layer takes memory")
    best, best_speedup = placement, predict(placement)
    added: List[Tuple[int, str]] = []
    for gpu in eligible({g: v for g, v in vacancy.items() if gpus is None or g in gpus}, threshold):
        max_replicas = available_bytes(best, memory, layer_bytes, gpu) // layer_bytes
        trial, pending, previous = best, [], -2
        for layer in by_continuity(best, gpu, max_replicas):
            if layer != previous + 1:  # a new run: what the last one left on trial is dropped
                trial, pending = best, []
            trial = trial.add_replica(layer, gpu)
            pending.append((layer, gpu))
            predicted = predict(trial)
            if predicted > best_speedup:
                best, best_speedup = trial, predicted
                added += pending
                pending = []
            previous = layer
    return ScaleUp(best, best_speedup, tuple(added))
