"""The U-shaped partition (HAT, Sec. 3.1): the device keeps the model's input and output ends.

Device: embedding, layers 0..m-1, final norm and LM head. Server: layers m..L-1, split into P
pipeline stages of consecutive layers as even as possible (earlier stages take the remainder), one
MPI rank per stage. m = 0 gives the ``centralized`` layout's server share (all layers).
"""

import re
from typing import Iterable, List, NamedTuple, Tuple


class PartitionError(ValueError):
    pass


class UShapePartition(NamedTuple):
    num_layers: int
    device_layers: int  # m
    stages: int  # P

    @classmethod
    def make(cls, num_layers: int, device_layers: int, stages: int) -> "UShapePartition":
        if device_layers < 0 or stages < 1:
            raise PartitionError("m must be >= 0 and P >= 1 (got m=%d, P=%d)" % (device_layers, stages))
        middle = num_layers - device_layers
        if middle < stages:
            raise PartitionError(
                "a model of %d layers with m=%d leaves %d middle layers for P=%d stages; lower m or P"
                % (num_layers, device_layers, middle, stages)
            )
        return cls(num_layers, device_layers, stages)

    def device_layer_ids(self) -> Tuple[int, ...]:
        return tuple(range(self.device_layers))

    def stage_layer_ids(self) -> List[Tuple[int, ...]]:
        """Layer ids of each server stage, in pipeline order."""
        middle = list(range(self.device_layers, self.num_layers))
        base, extra = divmod(len(middle), self.stages)
        out, start = [], 0
        for stage in range(self.stages):
            size = base + (1 if stage < extra else 0)
            out.append(tuple(middle[start : start + size]))
            start += size
        return out

    def describe(self) -> str:
        stages = ", ".join("%d-%d" % (s[0], s[-1]) for s in self.stage_layer_ids())
        layers = "layers 0-%d, " % (self.device_layers - 1) if self.device_layers else ""
        return "device: embedding, %snorm, head; server stages: %s" % (layers, stages)


def checkpoint_tensor_names(
    names: Iterable[str], layers: Iterable[int], embedding: bool, head: bool, tied: bool
) -> List[str]:
    """The Hugging Face tensors among ``names`` that a part with these layers, embedding and head loads.

    Torch-free, so that the controller can cut a checkpoint into parts by name. A tied head reads
    the embedding matrix; buffers (``rotary_emb.inv_freq`` of old checkpoints) are never loaded.
    """
    wanted_layers = set(layers)
    chosen = []
    for name in names:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            keep = int(match.group(1)) in wanted_layers and "rotary_emb" not in name
        elif name.startswith("model.embed_tokens."):
            keep = embedding or (head and tied)
        else:
            keep = head and (name.startswith("model.norm.") or name.startswith("lm_head."))
        if keep:
            chosen.append(name)
    return sorted(chosen)
