"""The LLMS service's context memory (LLMS Sec. 2.3 and 3): every app context's KV cache in chunks of
``chunk_tokens`` tokens across all layers, under one memory budget in bytes, with the primitives

- Claim: a call's new chunks take memory (quantised to INT8 from the call's working cache);
- Reclaim: memory taken back from other contexts' chunks, in LCTRU order (``lctru.py``), their disk
  copy written first unless ahead-of-time swapping already did (then a reclaim writes nothing);
- Load: a calling context's missing chunks brought back, part read from the chunk store and part
  recomputed from the context's text, side by side (``load_plan.py``, ``recompute.py``), the reads one
  layer ahead of the recompute;
- Fault: a chunk found neither in memory nor where the disk should have it (counted; recomputed).

A call is ``prepare`` (lock the context as the working set, Reclaim, Load: the switching latency),
then the model runs on ``working_cache`` (dequantised keys and values, the density observer on it),
then ``commit`` (Claim the new chunks, re-plan the compression levels by density, Eq. 1-3, write the
modified chunks ahead of time, unlock). The settings switch off each technique for the ablations.
"""

import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from nodes.contracts.kv_chunk_bytes import chunk_nbytes
from nodes.contracts.methods.llms import CONTEXT_MEMORY_METHODS, FLOAT16_CONTEXT_MEMORY
from nodes.inference.kv_cache import KVCache
from nodes.inference.model import ModelPart

from .chunk_codec import dequantize, quantize, requantize
from .chunk_store import ChunkStore, LayerKV
from .compression_levels import plan_levels
from .density import DensityTracker
from .lctru import LctruQueue
from .load_plan import LinearCost, plan_load
from .recompute import recompute_positions


class MemorySettings(NamedTuple):
    budget_bytes: int
    recompute_cost: LinearCost  # T_re(chunks), fitted at start
    read_cost: LinearCost  # T_IO(bytes), fitted at start
    chunk_tokens: int = 16
    ratio_global: float = 0.5  # of INT8, on average over a context's complete chunks
    compression: bool = True  # tolerance-aware levels; off: every chunk INT8
    pipeline: bool = True  # recompute beside the reads; off: read every missing chunk
    ahead_of_time: bool = True  # write modified chunks when a call returns; off: at reclaim
    eviction: str = "lctru"  # or "lru": least recent first, whatever the level
    storage_bits: int = 8  # a new chunk's level: INT8 (the LLM's own cache), or 16 (float16: VLLM-S)
    unit: str = "chunk"  # what a reclaim takes: chunks, or a whole context (Swapping, LMK)
    keep_on_reclaim: bool = True  # False: a reclaimed chunk is dropped, not swapped (LMK kills it)
    recompute_pace: Optional[LinearCost] = None  # a target device's T_re: recompute takes that long (modeled)


def baseline_settings(name: str, budget_bytes: int, recompute_cost: LinearCost, read_cost: LinearCost,
                      chunk_tokens: int = 16) -> MemorySettings:  # fmt: skip
    """LLMS and its baselines and ablations (LLMS Sec. 4-5) as settings of one context memory:
    ``llms``; ``lmk`` (Android's low-memory killer: a reclaimed context is gone, recomputed in full);
    ``swapping`` (whole contexts swapped out at reclaim and read back); ``vllm-s`` (16-token blocks in
    float16, LRU, swapped on demand); ``vllm-sq`` (the same at INT8); ``llms-no-lifecycle`` (LRU and no
    ahead-of-time swapping), ``llms-lru`` (half of that: LRU instead of LCTRU, ahead-of-time swapping
    kept), ``llms-no-compression``, ``llms-no-pipeline`` (every missing chunk read).
    The paper quantizes only in VLLM-SQ ("VLLM-S ... without compression"; SmoothQuant INT8 added in
    VLLM-SQ) and LLMS, so the vanilla LMK and Swapping hold float16 caches like VLLM-S (our reading)."""
    base = MemorySettings(budget_bytes, recompute_cost, read_cost, chunk_tokens)
    plain = dict(compression=False, pipeline=False, ahead_of_time=False, eviction="lru")
    table = {
        "llms": {},
        "lmk": dict(plain, unit="context", keep_on_reclaim=False),
        "swapping": dict(plain, unit="context"),
        "vllm-s": dict(plain),
        "vllm-sq": dict(plain),
        "llms-no-lifecycle": dict(ahead_of_time=False, eviction="lru"),
        "llms-lru": dict(eviction="lru"),
        "llms-no-compression": dict(compression=False),
        "llms-no-pipeline": dict(pipeline=False),
    }
    if name not in table:
        raise ValueError("memory method %r: one of %s" % (name, ", ".join(table)))
    return base._replace(**table[name], storage_bits=16 if name in FLOAT16_CONTEXT_MEMORY else 8)


BASELINES = CONTEXT_MEMORY_METHODS  # named once, where the controller reads them (the method's module)


class ContextLimit(ValueError):
    """A context would not fit the memory budget even alone."""


class Chunk(object):
    __slots__ = ("_resident", "bits", "index", "nbytes", "on_disk", "tokens")

    def __init__(self, index: int, tokens: int, bits: int, resident: Optional[Dict[int, LayerKV]]) -> None:
        self.index, self.tokens, self.bits = index, tokens, bits
        self.resident = resident
        self.on_disk = False  # the store holds this chunk as it is now

    @property
    def resident(self) -> Optional[Dict[int, LayerKV]]:
        """Every layer's keys and values in memory, or None (reclaimed)."""
        return self._resident

    @resident.setter
    def resident(self, layers: Optional[Dict[int, LayerKV]]) -> None:
        # the bytes it holds, counted once here: the budget is summed over every chunk at each call
        self._resident = layers
        self.nbytes = 0 if layers is None else sum(k.nbytes + v.nbytes for k, v in layers.values())


class Context(object):
    def __init__(self, ident: str) -> None:
        self.ident = ident
        self.token_ids: List[int] = []
        self.chunks: List[Chunk] = []
        self.density = DensityTracker()
        self.disk_bytes: Dict[int, int] = {}  # chunk index -> its size in the store


class SwitchRecord(NamedTuple):
    """What preparing one call cost: the switching latency and what made it."""

    context: str
    switch_s: float  # from the call's arrival until the context is resident
    missing_chunks: int
    read_chunks: int
    recomputed_chunks: int
    bytes_read: int
    reclaimed_chunks: int
    bytes_written: int  # at switch time (zero with ahead-of-time swapping)
    planned_s: float  # Eq. 4's pipeline delay for this load
    faults: int


class ContextMemory(object):
    def __init__(self, model: ModelPart, store: ChunkStore, settings: MemorySettings) -> None:
        self.model, self.store, self.settings = model, store, settings
        self.contexts: Dict[str, Context] = {}
        self.queue = LctruQueue()
        self.locked: set = set()
        self.faults = 0
        self.aot_bytes_written = 0
        self.recompute_overruns = 0  # paced recomputes this machine could not finish in the target's time
        self._lock = threading.RLock()

    # -- accounting --------------------------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        return sum(c.nbytes for ctx in self.contexts.values() for c in ctx.chunks)

    def _resident_bytes_of(self, chunk: Chunk) -> int:
        """A missing chunk's size once resident (its size on disk less the file's header)."""
        config = self.model.config
        per_layer = 2 * chunk_nbytes(config.num_key_value_heads, chunk.tokens, config.head_dim, chunk.bits)
        return per_layer * len(self.model.layer_ids)

    # -- contexts ------------------------------------------------------------------------------------

    def new_context(self, ident: str) -> Context:
        with self._lock:
            if ident in self.contexts:
                raise ValueError("context %s exists" % ident)
            context = self.contexts[ident] = Context(ident)
            return context

    def delete(self, ident: str) -> None:
        with self._lock:
            context = self.contexts.pop(ident)
            self.queue.remove_context(ident)
            for chunk in context.chunks:
                self.store.delete(ident, chunk.index)

    # -- a call --------------------------------------------------------------------------------------

    def prepare(self, ident: str) -> SwitchRecord:
        """Lock ``ident`` as the working set and make all its chunks resident (Reclaim, then Load)."""
        started = time.monotonic()
        with self._lock:
            context = self.contexts[ident]
            self.locked.add(ident)
            missing = [c for c in context.chunks if c.resident is None]
            needed = sum(self._resident_bytes_of(c) for c in missing)
            try:
                reclaimed, written = self._reclaim(needed)
            except ContextLimit:
                self.locked.discard(ident)  # refused: the context is not the working set after all
                raise
            stored = [c for c in missing if c.on_disk]
            lost = [c for c in missing if not c.on_disk]  # dropped (LMK): only the text brings them back
            if lost and self.settings.keep_on_reclaim:
                self.faults += len(lost)  # a swapped chunk with no copy on disk: a fault, recomputed
            plan = plan_load([context.disk_bytes.get(c.index, 0) for c in stored], self.settings.recompute_cost,
                             self.settings.read_cost, allow_recompute=self.settings.pipeline)  # fmt: skip
            read = [stored[i] for i in plan.read]
            recompute = [stored[i] for i in plan.recompute] + lost
            read_faults = self._load(context, read, recompute)
            planned_s = max(self.settings.recompute_cost.seconds(len(recompute)), plan.read_s)
        faults = read_faults + (len(lost) if self.settings.keep_on_reclaim else 0)
        return SwitchRecord(ident, time.monotonic() - started, len(missing), len(read) - read_faults,
                            len(recompute) + read_faults, plan.bytes_read, reclaimed, written, planned_s,
                            faults)  # fmt: skip

    def _reclaim(self, needed: int) -> tuple:
        free = self.settings.budget_bytes - self.resident_bytes
        if needed <= free:
            return 0, 0
        victims = self.queue.victims(needed - free, locked=self.locked)
        if self.settings.unit == "context":  # the whole context of every chunk chosen goes
            whole = [ident for ident in dict.fromkeys(ident for ident, _ in victims)]
            victims = [(ident, c.index) for ident in whole for c in self.contexts[ident].chunks
                       if c.resident is not None]  # fmt: skip
        written = 0
        for ident, index in victims:
            context = self.contexts[ident]
            chunk = context.chunks[index]
            if self.settings.keep_on_reclaim and not chunk.on_disk:  # no ahead-of-time copy: written now
                written += self._write(context, chunk)
            chunk.resident = None
            self.queue.remove((ident, index))
        if self.resident_bytes + needed > self.settings.budget_bytes:
            raise ContextLimit("the context needs %d bytes more than the budget of %d leaves"
                               % (self.resident_bytes + needed - self.settings.budget_bytes,
                                  self.settings.budget_bytes))  # fmt: skip
        return len(victims), written

    def _write(self, context: Context, chunk: Chunk) -> int:
        assert chunk.resident is not None
        size = self.store.write(context.ident, chunk.index, chunk.resident)
        context.disk_bytes[chunk.index] = size
        chunk.on_disk = True
        return size

    def _load(self, context: Context, read: Sequence[Chunk], recompute: Sequence[Chunk]) -> int:
        """Read ``read`` one layer ahead of the recompute of ``recompute``; returns the faults."""
        if not read and not recompute:
            return 0
        layers = list(self.model.layer_ids)
        faulted: List[Chunk] = []
        arrived = {layer: threading.Event() for layer in layers}
        loaded: Dict[int, Dict[int, LayerKV]] = {c.index: {} for c in read}
        failure: List[BaseException] = []

        def reader() -> None:
            try:
                for layer in layers:
                    for chunk in read:
                        if chunk in faulted:
                            continue
                        try:
                            loaded[chunk.index].update(self.store.read_layers(context.ident, chunk.index, [layer]))
                        except FileNotFoundError:  # the disk lost it: a fault, recomputed instead
                            faulted.append(chunk)
                    arrived[layer].set()
            except BaseException as error:  # surfaced in the caller
                failure.append(error)
                for event in arrived.values():
                    event.set()

        thread = threading.Thread(target=reader, name="llms-io", daemon=True)
        thread.start()
        if recompute:
            self._recompute(context, list(recompute), lambda layer: arrived[layer].wait(), loaded)
        thread.join()
        if failure:
            raise failure[0]
        for chunk in read:
            if chunk not in faulted:
                chunk.resident = loaded[chunk.index]
        if faulted:
            self.faults += len(faulted)
            self._recompute(context, faulted)
        return len(faulted)

    def _recompute(self, context: Context, chunks: List[Chunk], before_layer=None,
                   arriving: Optional[Dict[int, Dict[int, LayerKV]]] = None) -> None:  # fmt: skip
        """Recompute ``chunks`` from the context's text, the other chunks' keys and values as they are
        (dequantised): those being read (``arriving``) come layer by layer, ``before_layer`` waits."""
        length = len(context.token_ids)
        config = self.model.config
        shape = (config.num_key_value_heads, length, config.head_dim)
        keys = {layer: torch.zeros(shape) for layer in self.model.layer_ids}
        values = {layer: torch.zeros_like(keys[layer]) for layer in self.model.layer_ids}
        size = self.settings.chunk_tokens
        positions = [p for c in chunks for p in range(c.index * size, c.index * size + c.tokens)]

        def fill(layer: int) -> None:
            if before_layer is not None:
                before_layer(layer)
            for chunk in context.chunks:
                source = chunk.resident if chunk.resident is not None else (arriving or {}).get(chunk.index)
                if source is not None and layer in source:
                    start = chunk.index * size
                    keys[layer][:, start : start + chunk.tokens] = dequantize(source[layer][0])
                    values[layer][:, start : start + chunk.tokens] = dequantize(source[layer][1])

        pace = self.settings.recompute_pace
        started, layers = time.monotonic(), list(self.model.layer_ids)

        def paced(layer: int) -> None:
            """Layer l of the recompute ends at its share of the target's T_re (a late one is counted)."""
            due = started + pace.seconds(len(chunks)) * (layers.index(layer) + 1) / len(layers)
            left = due - time.monotonic()
            if left > 0:
                time.sleep(left)
            elif layer == layers[-1]:
                self.recompute_overruns += 1

        recompute_positions(self.model, context.token_ids, keys, values, positions, before_layer=fill,
                            after_layer=paced if pace is not None else None)  # fmt: skip
        for chunk in chunks:
            start = chunk.index * size
            chunk.resident = {layer: (quantize(keys[layer][:, start : start + chunk.tokens], chunk.bits),
                                      quantize(values[layer][:, start : start + chunk.tokens], chunk.bits))
                              for layer in self.model.layer_ids}  # fmt: skip

    def working_cache(self, ident: str, room: int) -> KVCache:
        """The prepared context as the model's cache (dequantised), with ``room`` positions to grow and
        the density observer attached."""
        context = self.contexts[ident]
        length = len(context.token_ids)
        cache = self.model.new_cache(length + room + 1)
        for layer in self.model.layer_ids:
            parts = [c.resident[layer] for c in context.chunks if c.resident is not None]
            if len(parts) != len(context.chunks):
                raise RuntimeError("context %s is not resident: prepare it first" % ident)
            if parts:
                cache.append(layer, torch.cat([dequantize(k, cache.dtype) for k, _ in parts], dim=1),
                             torch.cat([dequantize(v, cache.dtype) for _, v in parts], dim=1))  # fmt: skip
        cache.advance(length)
        density = context.density
        cache.observe_attention = lambda layer, weights, start: density.observe_weights(weights, start)  # type: ignore
        return cache

    def commit(self, ident: str, cache: KVCache, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` (the prompt and output the call added) from ``cache``: Claim their chunks
        (the partial last chunk redone), re-plan the levels, write modified chunks ahead of time, unlock."""
        with self._lock:
            context = self.contexts[ident]
            size = self.settings.chunk_tokens
            old_length = len(context.token_ids)
            context.token_ids.extend(int(t) for t in token_ids)
            length = len(context.token_ids)
            if cache.length < length:
                raise ValueError("the cache holds %d positions, the context %d" % (cache.length, length))
            first_changed = old_length // size
            del context.chunks[first_changed:]
            for index in range(first_changed, (length + size - 1) // size):
                start, end = index * size, min(length, (index + 1) * size)
                resident = {}
                for layer in self.model.layer_ids:
                    k, v = cache.view(layer, end)
                    bits = self.settings.storage_bits
                    resident[layer] = (quantize(k[:, start:end], bits), quantize(v[:, start:end], bits))
                context.chunks.append(Chunk(index, end - start, self.settings.storage_bits, resident))
            self._plan_levels(context)
            self.queue.remove_context(ident)
            keys = [(ident, c.index) for c in context.chunks]
            lctru = self.settings.eviction == "lctru"  # lru: one level for every chunk
            self.queue.touch(keys, {k: c.bits if lctru else 8 for k, c in zip(keys, context.chunks)},
                             {k: c.nbytes for k, c in zip(keys, context.chunks)})  # fmt: skip
            if self.settings.ahead_of_time:
                for chunk in context.chunks:
                    if not chunk.on_disk:
                        self.aot_bytes_written += self._write(context, chunk)
            self.locked.discard(ident)
            # a call may have grown the context past what is free: the others make room now
            self._reclaim(0)

    def _plan_levels(self, context: Context) -> None:
        """Eq. 2-3 over the complete chunks (the partial last one stays INT8); a chunk moved down is
        requantised and its disk copy is stale."""
        if not self.settings.compression:
            return
        complete = [c for c in context.chunks if c.tokens == self.settings.chunk_tokens]
        if not complete:
            return
        densities = context.density.chunk_density(len(context.token_ids), self.settings.chunk_tokens)
        bits = plan_levels([densities[c.index] for c in complete], self.settings.ratio_global,
                           current=[c.bits for c in complete])  # fmt: skip
        for chunk, level in zip(complete, bits):
            if level < chunk.bits and chunk.resident is not None:
                chunk.resident = {layer: (requantize(k, level), requantize(v, level))
                                  for layer, (k, v) in chunk.resident.items()}  # fmt: skip
                chunk.bits = level
                chunk.on_disk = False

    def release(self, ident: str) -> None:
        """Unlock a context whose call failed (nothing committed)."""
        with self._lock:
            self.locked.discard(ident)

