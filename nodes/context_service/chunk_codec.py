"""Channel-wise linear quantisation of one chunk's keys or values (LLMS Sec. 3.2; INT8 as LMDeploy's
baseline, 4 and 2 bits below it), packed into bytes, with its metadata counted.

A tensor of shape (heads, tokens, head_dim) is quantised per channel (a head and a dimension, over the
chunk's tokens): code = round((x - low) / scale), scale = (high - low) / (2^bits - 1), with ``low`` and
``scale`` kept as float16 per channel (4 bytes a channel: the metadata the memory budget counts).
Codes of 4 and 2 bits are packed two and four to a byte. A lower level is made from the dequantised
values of the level above (levels only move down).
"""

from typing import NamedTuple, Tuple

import torch

from nodes.contracts.kv_chunk_bytes import FP16, METADATA_BYTES_PER_CHANNEL

LEVELS = (8, 4, 2)


class QuantizedChunk(NamedTuple):
    packed: torch.Tensor  # uint8, the codes packed 8 // bits to a byte
    scale: torch.Tensor  # float16, one per channel (heads x head_dim)
    low: torch.Tensor  # float16, one per channel
    bits: int
    shape: Tuple[int, int, int]  # heads, tokens, head_dim

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed codes and the per-channel metadata."""
        return int(self.packed.numel()) + int(self.scale.numel()) * METADATA_BYTES_PER_CHANNEL


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    flat = codes.reshape(-1).to(torch.uint8)
    per_byte = 8 // bits
    if per_byte == 1:
        return flat.clone()
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8)])
    groups = flat.reshape(-1, per_byte)
    out = torch.zeros(groups.shape[0], dtype=torch.uint8)
    for i in range(per_byte):
        out |= groups[:, i] << (bits * i)
    return out


def _unpack(packed: torch.Tensor, bits: int, elements: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:elements]
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=1).reshape(-1)[:elements]


def quantize(x: torch.Tensor, bits: int) -> QuantizedChunk:
    """``x`` (heads, tokens, head_dim) at ``bits`` (8, 4 or 2) per element, per-channel range; 16:
    float16 as it is, no metadata."""
    heads, tokens, dim = x.shape
    if bits == FP16:
        empty = torch.zeros(0, dtype=torch.float16)
        raw = x.detach().to(torch.float16).contiguous().reshape(-1).view(torch.uint8).clone()
        return QuantizedChunk(raw, empty, empty, FP16, (heads, tokens, dim))
    if bits not in LEVELS:
        raise ValueError("bits %d: one of %s or %d" % (bits, LEVELS, FP16))
    values = x.detach().float().transpose(0, 1).reshape(tokens, heads * dim)  # rows: tokens, cols: channels
    low = values.min(dim=0).values
    high = values.max(dim=0).values
    levels = (1 << bits) - 1
    scale = ((high - low) / levels).to(torch.float16)
    low16 = low.to(torch.float16)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(low))
    codes = torch.clamp(torch.round((values - low16.float()) / safe), 0, levels)
    return QuantizedChunk(_pack(codes, bits), scale, low16, bits, (heads, tokens, dim))


def dequantize(q: QuantizedChunk, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    heads, tokens, dim = q.shape
    if q.bits == FP16:
        return q.packed.view(torch.float16).reshape(heads, tokens, dim).to(dtype)
    codes = _unpack(q.packed, q.bits, heads * tokens * dim).float().reshape(tokens, heads * dim)
    values = codes * q.scale.float() + q.low.float()
    return values.reshape(tokens, heads, dim).transpose(0, 1).contiguous().to(dtype)


def requantize(q: QuantizedChunk, bits: int) -> QuantizedChunk:
    """The chunk at a lower level (from its dequantised values); the same chunk if not lower."""
    if bits >= q.bits:
        return q
    return quantize(dequantize(q), bits)
