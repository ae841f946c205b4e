"""Where an instance's decoder layers live on a server's GPUs (CoCoServe Sec. 3): each layer has a
primary GPU and zero or more replicas, each replica taking a share of the layer's batch.

A :class:`Placement` is immutable: replicating, evicting and migrating return a new one, so that the
scaling algorithms can try a change and keep it only if the model says it helps. P = [p_1..p_n], the
paper's replication degrees, is :meth:`Placement.degrees`.
"""

from typing import Dict, List, NamedTuple, Sequence, Tuple


class Placement(NamedTuple):
    hosts: Tuple[Tuple[str, ...], ...]  # per layer: its primary GPU first, then its replicas

    @classmethod
    def single(cls, layers: int, gpu: str) -> "Placement":
        """Every layer on one GPU, no replicas (P_0)."""
        return cls(tuple((gpu,) for _ in range(layers)))

    @classmethod
    def split(cls, gpus_of_layers: Sequence[str]) -> "Placement":
        """Layer i on ``gpus_of_layers[i]``, no replicas (a pipeline or a migrated model)."""
        return cls(tuple((g,) for g in gpus_of_layers))

    @property
    def layers(self) -> int:
        return len(self.hosts)

    def degrees(self) -> List[int]:
        """P: how many GPUs run each layer."""
        return [len(h) for h in self.hosts]

    def primary(self, layer: int) -> str:
        return self.hosts[layer][0]

    def replicas_on(self, gpu: str) -> List[int]:
        """The layers ``gpu`` holds a replica of (not those it is primary for), in index order."""
        return [i for i, h in enumerate(self.hosts) if gpu in h[1:]]

    def layers_on(self, gpu: str) -> List[int]:
        """Every layer ``gpu`` holds, as primary or replica."""
        return [i for i, h in enumerate(self.hosts) if gpu in h]

    def runs_on(self, gpu: str) -> List[Tuple[int, int]]:
        """The maximal runs of consecutive layers replicated on ``gpu``, as (first, last): a batch share
        is scattered to ``gpu`` before each run and gathered after it."""
        return _runs(self.replicas_on(gpu))

    def replica_gpus(self) -> List[str]:
        """The GPUs holding at least one replica, in first-seen order."""
        seen: Dict[str, None] = {}
        for h in self.hosts:
            for g in h[1:]:
                seen.setdefault(g, None)
        return list(seen)

    def add_replica(self, layer: int, gpu: str) -> "Placement":
        if gpu in self.hosts[layer]:
            raise ValueError("layer %d is already on %s" % (layer, gpu))
        return self._with(layer, self.hosts[layer] + (gpu,))

    def evict_replica(self, layer: int, gpu: str) -> "Placement":
        if gpu not in self.hosts[layer][1:]:
            raise ValueError("%s holds no replica of layer %d" % (gpu, layer))
        return self._with(layer, tuple(g for g in self.hosts[layer] if g != gpu))

    def migrate(self, layer: int, source: str, destination: str) -> "Placement":
        """Move ``layer``'s copy on ``source`` to ``destination`` (a primary stays the primary)."""
        hosts = self.hosts[layer]
        if source not in hosts:
            raise ValueError("layer %d is not on %s" % (layer, source))
        if destination in hosts:
            raise ValueError("layer %d is already on %s" % (layer, destination))
        return self._with(layer, tuple(destination if g == source else g for g in hosts))

    def _with(self, layer: int, hosts: Tuple[str, ...]) -> "Placement":
        return Placement(self.hosts[:layer] + (hosts,) + self.hosts[layer + 1 :])


def _runs(indices: Sequence[int]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for i in sorted(indices):
        if out and i == out[-1][1] + 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


class GpuMemory(NamedTuple):
    """One GPU's memory as the scaling algorithms see it: its capacity, and what it holds besides
    layer copies (KV cache, activations, other instances), in bytes."""

    capacity_bytes: int
    other_bytes: int = 0


def available_bytes(placement: Placement, memory: Dict[str, GpuMemory], layer_bytes: int, gpu: str) -> int:
    """What ``gpu`` has left for another copy: its capacity less its other bytes (the engine's KV and
    fixed share, :func:`nodes.scaling.memory_budget.used_bytes`) and every layer copy on it."""
    held = memory[gpu].other_bytes + layer_bytes * len(placement.layers_on(gpu))
    return memory[gpu].capacity_bytes - held
