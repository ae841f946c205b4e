"""Chunks on disk: one file per chunk, every layer's quantised keys and values in layer order, so that a
Load can read layer l + 1 while layer l recomputes (LLMS Sec. 3.3).

On a real device the store is the device's disk. On an emulated one (nodes share this host's disk and
page cache) every read and write takes what the device profile says, per-I/O latency plus bytes over
bandwidth: the store does the real I/O, drops the file's pages from the cache, and sleeps the rest of
the modeled time (labelled ``modeled``; an I/O that took longer than modeled is counted as an overrun).

File: a 4-byte little-endian header length, a JSON header (format, bits, shape, layer ids), then per
layer the keys' packed codes, scale and low, then the values' likewise.
"""

import contextlib
import json
import os
import struct
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from nodes.contracts.kv_chunk_bytes import FP16, chunk_nbytes, packed_bytes

from .chunk_codec import QuantizedChunk

FORMAT = 1
LayerKV = Tuple[QuantizedChunk, QuantizedChunk]  # keys, values of one layer


class DiskProfile(NamedTuple):
    """A device's disk as the compute profile gives it (``disk:`` read_mbps, write_mbps, io_latency_ms)."""

    read_mbps: float
    write_mbps: float
    io_latency_ms: float

    def read_s(self, nbytes: int) -> float:
        return self.io_latency_ms / 1e3 + nbytes / (self.read_mbps * 1e6)

    def write_s(self, nbytes: int) -> float:
        return self.io_latency_ms / 1e3 + nbytes / (self.write_mbps * 1e6)


class StoreStats(object):
    def __init__(self) -> None:
        self.reads = self.writes = self.bytes_read = self.bytes_written = self.overruns = 0
        self.read_s = self.write_s = 0.0
        self._lock = threading.Lock()

    def add(self, kind: str, nbytes: int, seconds: float, overrun: bool) -> None:
        with self._lock:
            if kind == "read":
                self.reads, self.bytes_read = self.reads + 1, self.bytes_read + nbytes
                self.read_s += seconds
            else:
                self.writes, self.bytes_written = self.writes + 1, self.bytes_written + nbytes
                self.write_s += seconds
            self.overruns += int(overrun)

    def as_dict(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in ("reads", "writes", "bytes_read", "bytes_written", "read_s", "write_s",
                                              "overruns")}  # fmt: skip


def _tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor owning a copy of ``data`` (an empty one for no bytes: frombuffer refuses those)."""
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.zeros(0, dtype=dtype)


def _layer_block_bytes(bits: int, shape: Sequence[int]) -> int:
    heads, tokens, dim = shape
    return 2 * chunk_nbytes(heads, tokens, dim, bits)


class ChunkStore(object):
    def __init__(self, directory: str, disk: Optional[DiskProfile] = None, sleep=time.sleep) -> None:
        self.directory = directory
        self.disk = disk
        self.sleep = sleep
        self.stats = StoreStats()
        os.makedirs(directory, exist_ok=True)

    @property
    def modeled(self) -> bool:
        return self.disk is not None

    def path(self, context: str, chunk: int) -> str:
        return os.path.join(self.directory, "%s-%06d.chunk" % (context, chunk))

    def _paced(self, kind: str, nbytes: int, started: float, fd: int) -> None:
        if self.disk is None:
            self.stats.add(kind, nbytes, time.monotonic() - started, False)
            return
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read comes from the "disk" again
        target = self.disk.read_s(nbytes) if kind == "read" else self.disk.write_s(nbytes)
        left = started + target - time.monotonic()
        if left > 0:
            self.sleep(left)
        self.stats.add(kind, nbytes, max(target, time.monotonic() - started), left < 0)

    def write(self, context: str, chunk: int, layers: Dict[int, LayerKV]) -> int:
        """Write a chunk (every layer) durably; returns its bytes on disk."""
        ids = sorted(layers)
        first = layers[ids[0]][0]
        header = json.dumps({"format": FORMAT, "bits": first.bits, "shape": list(first.shape), "layers": ids}).encode()
        parts: List[bytes] = [struct.pack("<I", len(header)), header]
        for layer in ids:
            for q in layers[layer]:
                if q.bits != first.bits or tuple(q.shape) != tuple(first.shape):
                    raise ValueError("chunk %s/%d: every layer at one level and shape" % (context, chunk))
                parts += [q.packed.numpy().tobytes(), q.scale.numpy().tobytes(), q.low.numpy().tobytes()]
        data = b"".join(parts)
        path = self.path(context, chunk)
        started = time.monotonic()
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
            self._paced("write", len(data), started, fd)
        finally:
            os.close(fd)
        os.replace(path + ".tmp", path)
        return len(data)

    def read_layers(self, context: str, chunk: int, layers: Optional[Sequence[int]] = None) -> Dict[int, LayerKV]:
        """Read the chunk's ``layers`` (all by default), each one I/O at its offset in the file."""
        path = self.path(context, chunk)
        started = time.monotonic()  # each I/O's modeled time covers all its work (the header's too)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = struct.unpack("<I", os.pread(fd, 4, 0))[0]
            header = json.loads(os.pread(fd, size, 4).decode())
            bits, shape, ids = int(header["bits"]), tuple(header["shape"]), list(header["layers"])
            block = _layer_block_bytes(bits, shape)
            out: Dict[int, LayerKV] = {}
            for layer in ids if layers is None else layers:
                raw = os.pread(fd, block, 4 + size + ids.index(layer) * block)
                out[layer] = self._decode(raw, bits, shape)
                self._paced("read", len(raw), started, fd)
                started = time.monotonic()
            return out
        finally:
            os.close(fd)

    @staticmethod
    def _decode(raw: bytes, bits: int, shape: Tuple[int, int, int]) -> LayerKV:
        heads, tokens, dim = shape
        packed = packed_bytes(heads * tokens * dim, bits)
        channels = 0 if bits == FP16 else heads * dim
        pair = []
        offset = 0
        for _ in range(2):
            codes = _tensor(raw[offset : offset + packed], torch.uint8)
            offset += packed
            scale = _tensor(raw[offset : offset + 2 * channels], torch.float16)
            offset += 2 * channels
            low = _tensor(raw[offset : offset + 2 * channels], torch.float16)
            offset += 2 * channels
            pair.append(QuantizedChunk(codes, scale, low, bits, shape))
        return pair[0], pair[1]

    def delete(self, context: str, chunk: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(context, chunk))

    def chunks_of(self, context: str) -> List[int]:
        prefix = context + "-"
        return sorted(int(name[len(prefix) : -6]) for name in os.listdir(self.directory)
                      if name.startswith(prefix) and name.endswith(".chunk"))  # fmt: skip
