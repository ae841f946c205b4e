"""GPUs that are other ranks, for layer copies (``nodes.inference.layer_copies``): the instance's rank
keeps a :class:`RemoteGpu` per other GPU rank, which runs a :class:`CopyServer` until told to stop.

Messages (``module_transfer.pack``) go to the copy server with ``TAG_MODULE`` and come back with
``TAG_REPLY``:

- ``install``: a layer's weights, and the KV of the sequences it will serve (a replica: none; a
  migrated layer: those its old copy served);
- ``evict``: drop a layer; the reply carries the KV of the sequences it served, back to the primary;
- ``extract``: the same with the layer's weights too (a migration away from this rank);
- ``release``: the KV of sequences that ended (no reply);
- ``sync``: answered once everything sent before is done, with the layers held;
- ``run``: the rows of the sequences a layer's copy there serves, with each sequence's new tokens and
  length; the reply carries the rows out (the KV stays there);
- ``stop``.

Every wait polls and sleeps (``mpi_link``), so an idle GPU rank takes no CPU from the busy ones.
"""

import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from nodes.inference.config import LlamaConfig
from nodes.inference.kv_cache import KVCache
from nodes.inference.model import DecoderLayer, Segment
from nodes.inference.rope import RotaryEmbedding

from .. import mpi_link
from . import module_transfer

TAG_MODULE = module_transfer.TAG_MODULE
TAG_REPLY = 15
KvItems = List[Tuple[int, torch.Tensor, torch.Tensor]]  # (sequence id, keys, values) of one layer


class RemoteGpu(object):
    """The instance's handle on another GPU rank (``LayerCopies.add_remote``)."""

    def __init__(self, comm: Any, rank: int, config: Optional[LlamaConfig] = None) -> None:
        self.comm, self.rank, self.config = comm, rank, config
        self.outbox = mpi_link.Outbox()

    def _config(self) -> LlamaConfig:
        if self.config is None:
            raise ValueError("a layer taken from rank %d needs the model's config (RemoteGpu(config=...))" % self.rank)
        return self.config

    def install(self, layer: int, module: DecoderLayer, kv: Sequence[Tuple[int, torch.Tensor, torch.Tensor]],
                pad_bytes: int = 0) -> int:  # fmt: skip
        """Send ``layer`` (and the KV it serves; ``pad_bytes`` more on the wire, a target's layer); the
        bytes of weights and KV moved."""
        items = [module_transfer.LayerKV(ident, keys, values) for ident, keys, values in kv]
        message = module_transfer.encode(layer, module, items, pad_bytes, header={"op": "install"})
        mpi_link.send(self.comm, message, self.rank, TAG_MODULE)
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        return weights + sum(2 * i.keys.numel() * i.keys.element_size() for i in items)

    def evict(self, layer: int, sequences: Sequence[int]) -> KvItems:
        """Drop the rank's copy of ``layer``; the KV of ``sequences`` it served, as (id, keys, values)."""
        self._request({"op": "evict", "layer": layer, "sequences": list(sequences)}, [])
        header, tensors = self._reply()
        return [(ident, tensors["k%d" % ident], tensors["v%d" % ident]) for ident in header["sequences"]]

    def extract(self, layer: int, sequences: Sequence[int]) -> Tuple[DecoderLayer, KvItems]:
        """Take the rank's copy of ``layer`` away: its module and the KV of ``sequences`` it served."""
        self._request({"op": "extract", "layer": layer, "sequences": list(sequences)}, [])
        header, tensors = self._reply()
        message = module_transfer.layer_of(header, tensors, self._config(), torch.device("cpu"))
        return message.module, [(item.sequence, item.keys, item.values) for item in message.kv]

    def start_run(self, layer: int, rows: torch.Tensor, items: Sequence[Tuple[int, int, int]], scatter_s: float = 0.0,
                  gather_s: float = 0.0) -> None:  # fmt: skip
        """Send ``rows`` of the sequences ``items`` (id, new tokens, length before) to ``layer``'s copy;
        ``scatter_s`` and ``gather_s``: modeled transfer times the rank waits before and after computing."""
        header = {"op": "run", "layer": layer, "items": list(items), "scatter_s": scatter_s, "gather_s": gather_s}
        self.outbox.send(self.comm, module_transfer.pack(header, [("rows", rows)]), self.rank, TAG_MODULE)

    def finish_run(self) -> torch.Tensor:
        _, tensors = self._reply()
        return tensors["rows"]

    def release(self, sequences: Sequence[int]) -> None:
        """Drop the KV the rank holds for ``sequences`` (they ended, or their KV was dropped)."""
        self.outbox.send(self.comm, module_transfer.pack({"op": "release", "sequences": list(sequences)}, []),
                         self.rank, TAG_MODULE)  # fmt: skip

    def sync(self) -> List[int]:
        """Wait until the rank has done everything sent before; the layers it holds."""
        self._request({"op": "sync"}, [])
        return list(self._reply()[0]["layers"])

    def stop(self) -> None:
        self._request({"op": "stop"}, [])
        self.outbox.wait_all()

    def _request(self, header: Dict[str, Any], tensors: List[Tuple[str, torch.Tensor]]) -> None:
        mpi_link.send(self.comm, module_transfer.pack(header, tensors), self.rank, TAG_MODULE)

    def _reply(self) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
        buffer, _, _ = mpi_link.recv_bytes(self.comm, self.rank, TAG_REPLY)
        return module_transfer.unpack(buffer, torch.device("cpu"))


class CopyServer(object):
    """A GPU rank's copies of layers and the KV of the sequences they serve."""

    def __init__(self, comm: Any, model_dir: str, device: str = "cpu", primary: int = 0,
                 pace: Optional[Callable[[int, List[Tuple[int, int]], float], None]] = None) -> None:  # fmt: skip
        """``pace(layer, [(tokens, context)], started)``: wait out a target's time after a copy computed."""
        self.comm, self.primary, self.pace = comm, primary, pace
        self.config = LlamaConfig.load(model_dir)
        self.device = torch.device(device)
        self.rotary = RotaryEmbedding(self.config)
        self.modules: Dict[int, DecoderLayer] = {}
        self.caches: Dict[int, KVCache] = {}
        self.lengths: Dict[int, int] = {}
        self.runs = 0

    def serve(self) -> None:
        """Answer the instance's rank until it says stop. A failure here ends the whole job (the
        instance's rank would otherwise wait for a reply forever)."""
        try:
            self._serve()
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            self.comm.Abort(1)

    def _serve(self) -> None:
        while True:
            buffer, _, _ = mpi_link.recv_bytes(self.comm, self.primary, TAG_MODULE)
            header, tensors = module_transfer.unpack(buffer, self.device)
            op = header["op"]
            if op == "stop":
                return
            if op == "install":
                self._install(module_transfer.layer_of(header, tensors, self.config, self.device))
            elif op == "evict":
                self._evict(header["layer"], header["sequences"])
            elif op == "extract":
                self._extract(header["layer"], header["sequences"])
            elif op == "release":
                for ident in header["sequences"]:
                    self.caches.pop(ident, None)
                    self.lengths.pop(ident, None)
            elif op == "sync":
                reply = module_transfer.pack({"op": "synced", "layers": sorted(self.modules)}, [])
                mpi_link.send(self.comm, reply, self.primary, TAG_REPLY)
            elif op == "run":
                time.sleep(header.get("scatter_s", 0.0))  # the rows' modeled way here
                self._run(header["layer"], tensors["rows"], header["items"], header.get("gather_s", 0.0))
            else:
                raise ValueError("unknown op %r from the instance's rank" % (op,))

    def _cache(self, ident: int, dtype: torch.dtype) -> KVCache:
        if ident not in self.caches:
            c = self.config
            self.caches[ident] = KVCache(range(c.num_hidden_layers), c.num_key_value_heads, c.head_dim, dtype,
                                         self.device)  # fmt: skip
        return self.caches[ident]

    def _install(self, message: module_transfer.LayerMessage) -> None:
        self.modules[message.layer] = message.module
        for item in message.kv:
            cache = self._cache(item.sequence, item.keys.dtype)
            cache.length = 0
            cache.append(message.layer, item.keys, item.values)
            cache.length = self.lengths[item.sequence] = item.keys.shape[1]

    def _evict(self, layer: int, sequences: Sequence[int]) -> None:
        del self.modules[layer]
        tensors: List[Tuple[str, torch.Tensor]] = []
        for ident in sequences:
            keys, values = self._history(ident, layer)
            tensors += [("k%d" % ident, keys), ("v%d" % ident, values)]
        reply = module_transfer.pack({"op": "evicted", "layer": layer, "sequences": list(sequences)}, tensors)
        mpi_link.send(self.comm, reply, self.primary, TAG_REPLY)

    def _extract(self, layer: int, sequences: Sequence[int]) -> None:
        """The copy of ``layer`` and its sequences' KV to the instance's rank, dropped here (a migration
        away from this rank)."""
        kv = [module_transfer.LayerKV(ident, *self._history(ident, layer)) for ident in sequences]
        reply = module_transfer.encode(layer, self.modules.pop(layer), kv, header={"op": "extracted"})
        mpi_link.send(self.comm, reply, self.primary, TAG_REPLY)

    def _history(self, ident: int, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        cache = self.caches[ident]
        cache.length = self.lengths[ident]  # a run leaves it where the step began
        return cache.view(layer, cache.length)

    def _run(self, layer: int, rows: torch.Tensor, items: Sequence[Sequence[int]], gather_s: float) -> None:
        started = time.monotonic()
        segments, rotations = [], []
        dtype = rows.dtype
        for ident, tokens, length in items:
            cache = self._cache(ident, dtype)
            cache.length = length  # every copy on this rank writes its layer at the sequence's length
            segments.append(Segment(cache, tokens))
            positions = torch.arange(length, length + tokens, device=self.device)
            rotations.append(self.rotary.cos_sin(positions, dtype, length + tokens))
            self.lengths[ident] = length + tokens
        with torch.inference_mode():
            out = self.modules[layer](rows, segments, rotations)
        if self.pace is not None:
            self.pace(layer, [(int(tokens), int(length)) for _, tokens, length in items], started)
        time.sleep(gather_s)  # and their modeled way back
        self.runs += 1
        mpi_link.send(self.comm, module_transfer.pack({"op": "ran", "layer": layer}, [("rows", out)]), self.primary,
                      TAG_REPLY)  # fmt: skip
