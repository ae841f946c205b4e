"""CoCoServe's Algorithm 2 (scale-down, "module reduction"): when the SLO is violated on an instance's
GPU, three phases of rising cost, each tried before the next:

1. migrate modules off the source GPU (FilterModules: at most ``max_migrations`` of the layers it is
   primary for, the last first; FindOptimalDestination: the GPU with the most free memory that holds
   the layer, other than the source), until the source no longer violates;
2. evict the replicas held on the source GPU (the brief's reading of g: g_src), the least impact on
   the predicted speedup first;
3. reduce the batch size by Δbs (never below 1) and offload, the KV cache before the parameters.

:func:`next_action` is one step, for a controller that applies one action per tick and re-evaluates
over the next window; :func:`scale_down` runs the whole algorithm against a violation predicate (the
paper's loop, and the fixtures').
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from .placement import GpuMemory, Placement, available_bytes

OFFLOAD_LEVELS = ("none", "kv", "kv+weights")  # what phase 3 has offloaded so far, in order


class Instance(NamedTuple):
    """What scale-down changes: the placement, the batch size, how much is offloaded, and how many
    migrations this episode has made."""

    placement: Placement
    batch_size: int
    offload: str = "none"
    migrations: int = 0


class Action(NamedTuple):
    phase: int  # 1 migrate, 2 evict, 3 reduce
    kind: str  # migrate | evict | reduce
    layer: int = -1
    source: str = ""
    destination: str = ""
    batch_size: int = 0
    offload: str = "none"


def migration_candidates(placement: Placement, source: str) -> List[int]:
    """FilterModules: the layers whose primary is ``source``, the last first (the end of the model
    moves with one boundary, like a pipeline stage)."""
    return [i for i in reversed(range(placement.layers)) if placement.primary(i) == source]


def destination_for(placement: Placement, memory: Dict[str, GpuMemory], layer_bytes: int, layer: int,
                    source: str) -> Optional[str]:  # fmt: skip
    """FindOptimalDestination: the GPU with the most free memory that can take ``layer`` (not the
    source, not already holding it), or None."""
    fits = [(available_bytes(placement, memory, layer_bytes, g), g) for g in memory
            if g != source and g not in placement.hosts[layer]
            and available_bytes(placement, memory, layer_bytes, g) >= layer_bytes]  # fmt: skip
    return min(fits, key=lambda f: (-f[0], f[1]))[1] if fits else None


def evictees(placement: Placement, gpu: str, predict: Callable[[Placement], float]) -> List[int]:
    """SortEvicteesBy: the replicas ``gpu`` holds, the one whose eviction costs the least predicted
    speedup first (ties by layer)."""
    cost = {i: -predict(placement.evict_replica(i, gpu)) for i in placement.replicas_on(gpu)}
    return sorted(cost, key=lambda i: (cost[i], i))


def next_action(instance: Instance, source: str, memory: Dict[str, GpuMemory], layer_bytes: int,
                predict: Callable[[Placement], float], max_migrations: int,
                delta_batch: int) -> Optional[Action]:  # fmt: skip
    """The next action of Algorithm 2 for a violating instance, or None when nothing is left to do
    (every phase exhausted: batch 1 and everything offloaded)."""
    placement = instance.placement
    if instance.migrations < max_migrations:
        for layer in migration_candidates(placement, source):
            destination = destination_for(placement, memory, layer_bytes, layer, source)
            if destination is not None:
                return Action(1, "migrate", layer, source, destination)
    order = evictees(placement, source, predict)
    if order:
        return Action(2, "evict", order[0], source)
    level = OFFLOAD_LEVELS.index(instance.offload)
    batch = max(1, instance.batch_size - delta_batch)
    if batch == instance.batch_size and level == len(OFFLOAD_LEVELS) - 1:
        return None
    return Action(3, "reduce", batch_size=batch, offload=OFFLOAD_LEVELS[min(level + 1, len(OFFLOAD_LEVELS) - 1)])


def apply(instance: Instance, action: Action) -> Instance:
    """The instance after ``action``."""
    if action.kind == "migrate":
        return instance._replace(placement=instance.placement.migrate(action.layer, action.source, action.destination),
                                 migrations=instance.migrations + 1)  # fmt: skip
    if action.kind == "evict":
        return instance._replace(placement=instance.placement.evict_replica(action.layer, action.source))
    return instance._replace(batch_size=action.batch_size, offload=action.offload)


def scale_down(instance: Instance, source: str, memory: Dict[str, GpuMemory], layer_bytes: int,
               predict: Callable[[Placement], float], violating: Callable[[Instance], bool], max_migrations: int,
               delta_batch: int = 5, max_steps: int = 1000) -> Tuple[Instance, List[Action]]:  # fmt: skip
    """Algorithm 2 to the end: actions while ``violating`` says the instance still violates its SLO
    (checked after each, the paper's early exits), until none is left; the instance and the actions."""
    actions: List[Action] = []
    while violating(instance) and len(actions) < max_steps:
        action = next_action(instance, source, memory, layer_bytes, predict, max_migrations, delta_batch)
        if action is None:
            break
        actions.append(action)
        instance = apply(instance, action)
    return instance, actions
