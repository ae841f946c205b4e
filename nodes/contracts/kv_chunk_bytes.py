"""The bytes of one chunk of keys or values at a quantisation level (LLMS Sec. 3.1-3.2), without the
tensor: what the context memory's budget counts on the device and what the controller scales a
target's budget by. Standard library only."""

FP16 = 16  # no quantisation: float16 as it is (vLLM's default cache, the VLLM-S baseline)
METADATA_BYTES_PER_CHANNEL = 4  # float16 scale and float16 low, per channel (a head and a dimension)


def packed_bytes(elements: int, bits: int) -> int:
    """``elements`` codes of ``bits`` packed 8 // bits to a byte (float16: two bytes each)."""
    if bits == FP16:
        return 2 * elements
    per_byte = 8 // bits
    return (elements + per_byte - 1) // per_byte


def chunk_nbytes(heads: int, tokens: int, head_dim: int, bits: int) -> int:
    """A (heads, tokens, head_dim) tensor quantised to ``bits``: packed codes and per-channel metadata."""
    metadata = 0 if bits == FP16 else heads * head_dim * METADATA_BYTES_PER_CHANNEL
    return packed_bytes(heads * tokens * head_dim, bits) + metadata


def chunk_bytes_all_layers(layers: int, kv_heads: int, head_dim: int, tokens: int, bits: int = 8) -> int:
    """One chunk across every layer, keys and values: the unit a context is swapped in."""
    return layers * 2 * chunk_nbytes(kv_heads, tokens, head_dim, bits)
