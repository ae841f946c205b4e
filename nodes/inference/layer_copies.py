"""A model whose decoder layers are module copies on several GPUs (CoCoServe Sec. 3): a layer has a
primary copy and may have replicas, each serving a share of the batch; a layer may migrate, with its
sequences' keys and values, from one GPU to another while requests are being served.

Each sequence's KV for a layer lives on the copy that serves it, chosen when the sequence is admitted
(:meth:`LayerCopies.admit`, round robin over the layer's copies) and kept until the sequence ends, so
that a replica added mid-generation serves only sequences admitted after it, and a replica evicted
or a layer migrated mid-generation takes its sequences' KV along. One step runs every layer on the
packed batch: the rows of each copy's sequences go to it (scatter), and come back in place (gather).
The tokens are those of the model without copies, whatever the placement and whenever it changed.

A GPU is a torch device of this process (copies on the same device on a machine without GPUs), or
another rank (:meth:`LayerCopies.add_remote`: ``nodes.workers.engines.layer_ranks``), which holds its copies and
the KV of the sequences they serve, and runs its rows when sent them.
"""

import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .kv_cache import KVCache
from .model import DecoderLayer, ModelPart, Segment


class SequenceKV(object):
    """One sequence's keys and values, per GPU the layers it is served on there."""

    def __init__(self, ident: int, serving: Dict[int, str]) -> None:
        self.ident = ident
        self.serving = dict(serving)  # layer -> the GPU whose copy serves this sequence
        self.caches: Dict[str, KVCache] = {}
        self.length = 0

    def cache_on(self, gpu: str, make: "LayerCopies") -> KVCache:
        if gpu not in self.caches:
            cache = make.new_cache(gpu)
            cache.length = self.length
            self.caches[gpu] = cache
        return self.caches[gpu]


class LayerCopies(object):
    def __init__(self, part: ModelPart, gpu: str, devices: Optional[Dict[str, torch.device]] = None) -> None:
        """``part``: the whole model on ``gpu`` (embedding, every layer, head), the primary of each layer."""
        if part.embed_tokens is None or part.lm_head is None or len(part.layer_ids) != part.config.num_hidden_layers:
            raise ValueError("layer copies start from the whole model")
        self.part, self.config = part, part.config
        self.devices = dict(devices or {})
        self.devices.setdefault(gpu, part.device)
        self.hosts: Dict[int, List[str]] = {i: [gpu] for i in part.layer_ids}  # primary first
        self.copies: Dict[Tuple[int, str], DecoderLayer] = {(i, gpu): part.layers[str(i)] for i in part.layer_ids}
        self.remote: Dict[str, Any] = {}  # GPUs that are other ranks (nodes.workers.engines.layer_ranks.RemoteGpu)
        # optional: pace(gpu, layer, [(tokens, context)], started) after a local copy computed its rows (a
        # target's time); transfer_s(gpu, tokens) the modeled time to move that many rows' hidden states
        self.pace: Optional[Callable[[str, int, List[Tuple[int, int]], float], None]] = None
        self.transfer_s: Optional[Callable[[str, int], float]] = None
        self.wire_pad_bytes = 0  # sent with each layer installed on another rank (a target's layer on the wire)
        self._turn: Dict[int, int] = {i: 0 for i in part.layer_ids}
        self._admitted = 0

    def add_remote(self, gpu: str, remote: Any) -> None:
        """A GPU that is another rank: ``remote`` installs, evicts and runs its copies there."""
        self.remote[gpu] = remote

    def device(self, gpu: str) -> torch.device:
        return self.devices.get(gpu, self.part.device)

    def new_cache(self, gpu: str) -> KVCache:
        c = self.config
        return KVCache(self.part.layer_ids, c.num_key_value_heads, c.head_dim, self.part.dtype, self.device(gpu))

    def local_module(self, layer: int) -> DecoderLayer:
        """A copy of ``layer`` held in this process (the model starts whole here, and remote GPUs
        receive copies of local ones)."""
        for gpu in self.hosts[layer]:
            if (layer, gpu) in self.copies:
                return self.copies[(layer, gpu)]
        raise ValueError("no copy of layer %d is held here" % layer)

    def layer_bytes(self, layer: int) -> int:
        return _module_bytes(self.local_module(layer))

    # -- admission ------------------------------------------------------------------------------

    def admit(self) -> SequenceKV:
        """A new sequence, each layer served by its copies in turn (the KV stays where it is served)."""
        serving = {}
        for layer, hosts in self.hosts.items():
            serving[layer] = hosts[self._turn[layer] % len(hosts)]
            self._turn[layer] += 1
        self._admitted += 1
        return SequenceKV(self._admitted - 1, serving)

    def release(self, sequence: SequenceKV) -> None:
        """The sequence has ended (or its KV was dropped): its keys and values go, here and on every
        other rank that holds some."""
        sequence.caches.clear()
        for gpu in sorted(set(sequence.serving.values())):
            if gpu in self.remote:
                self.remote[gpu].release([sequence.ident])

    # -- module operations (each returns the bytes it moved) -----------------------------------

    def replicate(self, layer: int, gpu: str) -> int:
        """A copy of ``layer`` on ``gpu`` (its weights sent there); it serves sequences admitted from now."""
        if gpu in self.hosts[layer]:
            raise ValueError("layer %d is already on %s" % (layer, gpu))
        if gpu in self.remote:
            moved = self.remote[gpu].install(layer, self.local_module(layer), [], self.wire_pad_bytes)
        else:
            self.copies[(layer, gpu)] = copy.deepcopy(self.local_module(layer)).to(self.device(gpu))
            moved = _module_bytes(self.copies[(layer, gpu)])
        self.hosts[layer].append(gpu)
        return moved

    def evict(self, layer: int, gpu: str, sequences: Sequence[SequenceKV]) -> int:
        """Drop ``gpu``'s replica of ``layer``; its sequences' KV for the layer moves to the primary."""
        if gpu not in self.hosts[layer][1:]:
            raise ValueError("%s holds no replica of layer %d" % (gpu, layer))
        served = [q for q in sequences if q.serving.get(layer) == gpu]
        if gpu in self.remote:
            kv = self.remote[gpu].evict(layer, [q.ident for q in served])
        else:
            del self.copies[(layer, gpu)]
            kv = _local_kv(layer, gpu, served)
        self.hosts[layer].remove(gpu)
        return self._put_kv(layer, self.hosts[layer][0], served, kv)

    def migrate(self, layer: int, source: str, destination: str, sequences: Sequence[SequenceKV]) -> int:
        """Move ``layer``'s copy on ``source`` to ``destination``: its weights and its sequences' KV (a
        move between two other ranks passes through this one)."""
        hosts = self.hosts[layer]
        if source not in hosts or destination in hosts:
            raise ValueError("layer %d: not on %s, or already on %s" % (layer, source, destination))
        served = [q for q in sequences if q.serving.get(layer) == source]
        if source in self.remote:
            module, kv = self.remote[source].extract(layer, [q.ident for q in served])
        else:
            module, kv = self.copies.pop((layer, source)), _local_kv(layer, source, served)
        hosts[hosts.index(source)] = destination
        if destination in self.remote:
            for sequence in served:
                sequence.serving[layer] = destination
            return self.remote[destination].install(layer, module, kv, self.wire_pad_bytes)
        self.copies[(layer, destination)] = module.to(self.device(destination))
        return _module_bytes(module) + self._put_kv(layer, destination, served, kv)

    def _put_kv(self, layer: int, gpu: str, served: Sequence[SequenceKV],
                kv: Sequence[Tuple[int, torch.Tensor, torch.Tensor]]) -> int:  # fmt: skip
        """``served`` now served by local ``gpu`` for ``layer``, with their KV ``kv`` (id, keys, values)
        written there; the bytes written."""
        by_ident = {q.ident: q for q in served}
        for sequence in served:
            sequence.serving[layer] = gpu
        return sum(self._write_kv(by_ident[ident], layer, gpu, keys, values) for ident, keys, values in kv)

    def _write_kv(self, sequence: SequenceKV, layer: int, gpu: str, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Put a layer's whole history of ``sequence`` on local ``gpu``; the bytes it holds."""
        target = sequence.cache_on(gpu, self)
        target.length = 0  # append writes at the committed length: write the whole history
        target.append(layer, keys.to(self.device(gpu)), values.to(self.device(gpu)))
        target.length = sequence.length
        return keys.numel() * keys.element_size() * 2

    # -- one step -------------------------------------------------------------------------------

    def run_layers(self, hidden: torch.Tensor, steps: Sequence[Tuple[SequenceKV, int]]) -> torch.Tensor:
        """Every layer on a packed batch [sum of tokens, hidden]: each layer's copies run the rows of the
        sequences they serve; every sequence then advances by its tokens."""
        starts, offset = [], 0
        for _, tokens in steps:
            starts.append(offset)
            offset += tokens
        if offset != hidden.shape[0]:
            raise ValueError("the steps cover %d tokens, hidden has %d" % (offset, hidden.shape[0]))
        rotary, dtype = self.part.rotary, self.part.dtype
        for layer in self.part.layer_ids:
            out = torch.empty_like(hidden)
            groups = {gpu: [k for k, (sequence, _) in enumerate(steps) if sequence.serving[layer] == gpu]
                      for gpu in self.hosts[layer]}  # fmt: skip
            away = [gpu for gpu in self.hosts[layer] if gpu in self.remote and groups[gpu]]
            for gpu in away:  # scatter first, so that the other ranks compute while this one does
                rows = torch.cat([hidden[starts[k] : starts[k] + steps[k][1]] for k in groups[gpu]])
                items = [(steps[k][0].ident, steps[k][1], steps[k][0].length) for k in groups[gpu]]
                scatter_s, gather_s = self._run_ends(layer, gpu, rows.shape[0])
                self.remote[gpu].start_run(layer, rows, items, scatter_s, gather_s)
            for gpu, mine in groups.items():
                if not mine or gpu in self.remote:
                    continue
                started = time.monotonic()
                device = self.device(gpu)
                rows = torch.cat([hidden[starts[k] : starts[k] + steps[k][1]] for k in mine]).to(device)
                segments, rotations = [], []
                for k in mine:
                    sequence, tokens = steps[k]
                    segments.append(Segment(sequence.cache_on(gpu, self), tokens))
                    positions = torch.arange(sequence.length, sequence.length + tokens, device=device)
                    rotations.append(rotary.cos_sin(positions, dtype, sequence.length + tokens))
                result = self.copies[(layer, gpu)](rows, segments, rotations).to(hidden.device)
                if self.pace is not None:
                    self.pace(gpu, layer, [(steps[k][1], steps[k][0].length) for k in mine], started)
                _place(out, result, [(starts[k], steps[k][1]) for k in mine])
            for gpu in away:  # gather
                _place(out, self.remote[gpu].finish_run().to(hidden.device, hidden.dtype),
                       [(starts[k], steps[k][1]) for k in groups[gpu]])  # fmt: skip
            hidden = out
        for sequence, tokens in steps:
            sequence.length += tokens
            for cache in sequence.caches.values():
                cache.length = sequence.length
        return hidden


    def _run_ends(self, layer: int, gpu: str, tokens: int) -> Tuple[float, float]:
        """The modeled scatter and gather times of ``gpu``'s rows at ``layer``: paid where a run of
        layers copied on ``gpu`` begins and where it ends (CoCoServe Sec. 3.2), none in between."""
        if self.transfer_s is None:
            return 0.0, 0.0
        begins = layer - 1 not in self.hosts or gpu not in self.hosts[layer - 1]
        ends = layer + 1 not in self.hosts or gpu not in self.hosts[layer + 1]
        each = self.transfer_s(gpu, tokens)
        return (each if begins else 0.0), (each if ends else 0.0)


def _place(out: torch.Tensor, rows: torch.Tensor, spans: Sequence[Tuple[int, int]]) -> None:
    """Rows of a group (in its order) back at their sequences' places in the packed batch."""
    at = 0
    for start, tokens in spans:
        out[start : start + tokens] = rows[at : at + tokens]
        at += tokens


def _module_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _local_kv(layer: int, gpu: str, served: Sequence[SequenceKV]) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    """The KV of ``layer`` that local ``gpu`` holds for ``served``, as (id, keys, values)."""
    return [(q.ident,) + q.caches[gpu].view(layer, q.length) for q in served if q.length and gpu in q.caches]
