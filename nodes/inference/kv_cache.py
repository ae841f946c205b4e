"""One sequence's keys and values for the layers a model part holds.

Every layer writes a chunk at the same offset (the committed ``length``); ``advance`` commits the
chunk once all layers have run, and ``truncate`` rolls back (rejected draft tokens). Storage grows
by doubling, so appends are amortised O(1) and views never copy.
"""

from typing import Dict, Iterable, Optional, Tuple

import torch


class KVCache:
    def __init__(
        self,
        layers: Iterable[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        capacity: int = 256,
    ) -> None:
        self.layers = tuple(layers)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device if device is not None else torch.device("cpu")
        self.capacity = max(1, capacity)
        self.length = 0
        self._keys: Dict[int, torch.Tensor] = {}
        self._values: Dict[int, torch.Tensor] = {}

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.num_kv_heads, self.capacity, self.head_dim, dtype=self.dtype, device=self.device)

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        if capacity == self.capacity:
            return
        self.capacity = capacity
        for store in (self._keys, self._values):
            for layer, old in store.items():
                new = self._buffer()
                new[:, : old.shape[1]] = old
                store[layer] = new

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` [kv_heads, n, head_dim] after the committed length of ``layer``.

        Returns views of this layer's keys and values up to and including the new chunk.
        """
        n = keys.shape[1]
        end = self.length + n
        if end > self.capacity:
            self._grow(end)
        if layer not in self._keys:
            self._keys[layer], self._values[layer] = self._buffer(), self._buffer()
        self._keys[layer][:, self.length : end] = keys
        self._values[layer][:, self.length : end] = values
        return self._keys[layer][:, :end], self._values[layer][:, :end]

    def advance(self, n: int) -> None:
        """Commit a chunk of ``n`` tokens that every layer of the part has appended."""
        self.length += n

    def fill_random(self, length: int, generator: Optional[torch.Generator] = None) -> None:
        """Hold ``length`` positions of random keys and values in every layer (a context of that
        length without computing it: for timing steps, ``nodes.workers.profile_engine``)."""
        self._grow(length + 1)
        for layer in self.layers:
            for store in (self._keys, self._values):
                buffer = store.get(layer)
                if buffer is None:
                    buffer = store[layer] = self._buffer()
                # drawn where the generator lives (a CPU generator cannot draw on a GPU), then moved
                where = generator.device if generator is not None else self.device
                buffer[:, :length] = torch.randn(self.num_kv_heads, length, self.head_dim, generator=generator,
                                                 device=where).to(self.device, self.dtype)  # fmt: skip
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget everything from position ``length`` on (rollback); keeps the memory."""
        if length < 0 or length > self.length:
            raise ValueError("cannot truncate a cache of %d tokens to %d" % (self.length, length))
        self.length = length

    def view(self, layer: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values for positions [0, end) (views, no copy)."""
        if end > self.length:
            raise ValueError("the cache holds %d positions, not %d" % (self.length, end))
        if layer not in self._keys:  # nothing written yet (end is 0)
            empty = self._buffer()[:, :0]
            return empty, empty
        return self._keys[layer][:, :end], self._values[layer][:, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self._keys, self._values) for t in store.values())


class BranchCache:
    """A speculative continuation of a ``KVCache``: it reads the base's first ``base_length`` positions
    and keeps what it appends to itself, so several branches (HAT's parallel drafts, Sec. 3.5) grow
    from one prefix without copying it. ``commit`` writes the branch's first positions into the base.
    """

    def __init__(self, base: KVCache, base_length: int, capacity: int = 16) -> None:
        if base_length > base.length:
            raise ValueError("a branch at %d of a cache of %d positions" % (base_length, base.length))
        self.base, self.base_length = base, base_length
        self.layers = base.layers
        self.own = KVCache(base.layers, base.num_kv_heads, base.head_dim, base.dtype, base.device, capacity)

    @property
    def length(self) -> int:
        return self.base_length + self.own.length

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        own_keys, own_values = self.own.append(layer, keys, values)
        base_keys, base_values = self.base.view(layer, self.base_length)
        return torch.cat([base_keys, own_keys], dim=1), torch.cat([base_values, own_values], dim=1)

    def advance(self, n: int) -> None:
        self.own.advance(n)

    def truncate(self, length: int) -> None:
        self.own.truncate(length - self.base_length)

    def commit(self, tokens: int) -> None:
        """Make the branch's first ``tokens`` positions the base's positions base_length.. (the base
        forgets whatever it held from base_length on)."""
        if tokens > self.own.length:
            raise ValueError("the branch holds %d positions, not %d" % (self.own.length, tokens))
        self.base.truncate(self.base_length)
        if not tokens:
            return
        for layer in self.layers:
            keys, values = self.own.view(layer, tokens)
            self.base.append(layer, keys, values)
        self.base.advance(tokens)
