"""The LCTRU queue (LLMS Sec. 3.4): which in-memory chunks a Reclaim takes, Least
Compression-Tolerable and Recently Used first.

Sub-queues per compression level, each ordered by the chunk's last access (updated at every callLLM);
a reclaim pops the heaviest level first (8 bits, then 4, then 2: for the same memory, fewer chunks
to recompute later, Eq. 4), least recently used first within a level. The calling context's chunks
are its working set: locked, never popped.
"""

from typing import Dict, Hashable, Iterable, List, Optional, Set, Tuple

from .compression_levels import BITS

ChunkKey = Tuple[Hashable, int]  # (context id, chunk index)


class LctruQueue(object):
    def __init__(self) -> None:
        self._entries: Dict[ChunkKey, Tuple[int, int, int]] = {}  # key -> (bits, access stamp, bytes)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._entries

    def touch(self, keys: Iterable[ChunkKey], bits: Dict[ChunkKey, int], sizes: Dict[ChunkKey, int]) -> None:
        """Mark chunks in memory and accessed now (one stamp for the whole call, in chunk order)."""
        self._clock += 1
        for key in keys:
            self._entries[key] = (bits[key], self._clock, sizes[key])

    def remove(self, key: ChunkKey) -> None:
        self._entries.pop(key, None)

    def remove_context(self, context: Hashable) -> None:
        for key in [k for k in self._entries if k[0] == context]:
            del self._entries[key]

    def victims(self, bytes_needed: int, locked: Optional[Set[Hashable]] = None) -> List[ChunkKey]:
        """The chunks a reclaim of ``bytes_needed`` takes, in eviction order (fewer when all unlocked
        chunks together are not enough: the caller decides what that means)."""
        locked = locked or set()
        rank = {b: i for i, b in enumerate(BITS)}
        candidates = sorted(((rank.get(bits, len(BITS)), stamp, key) for key, (bits, stamp, _) in self._entries.items()
                             if key[0] not in locked), key=lambda c: (c[0], c[1], repr(c[2])))  # fmt: skip
        out: List[ChunkKey] = []
        freed = 0
        for _, _, key in candidates:
            if freed >= bytes_needed:
                break
            out.append(key)
            freed += self._entries[key][2]
        return out
