"""LLMS on the tiny model: Eq. 1's density accumulated during forward passes, and the exact recompute
of interleaved missing chunks (fp32, no compression: equal keys and values, the same greedy output)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from nodes.context_service.density import DensityTracker, reference_density
from nodes.context_service.recompute import recompute_positions
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from nodes.inference.rope import apply_rotary

TINY = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_whole(str(TINY), dtype="float32")


def _ids(n: int, seed: int = 3) -> list[int]:
    return torch.randint(2, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(model, ids: list[int], pieces: list[int], tracker: DensityTracker | None = None):
    cache = model.new_cache(len(ids) + 16)
    if tracker is not None:
        cache.observe_attention = lambda layer, weights, start: tracker.observe_weights(weights, start)
    done = 0
    hidden = None
    with torch.inference_mode():
        for size in pieces:
            hidden = model.run_layers(model.embed(torch.tensor(ids[done : done + size])), [Segment(cache, size)])
            done += size
    return cache, hidden


def test_the_paper_example_of_a_tokens_density() -> None:
    a = torch.tensor([[1.0, 0, 0, 0], [0.7, 0.3, 0, 0], [0.2, 0.5, 0.3, 0], [0.4, 0.1, 0.2, 0.3]])  # Fig. 6a-like
    assert float(reference_density([a[None]])[1]) == pytest.approx((0.3 + 0.5 + 0.1) / 3)


def test_density_accumulated_in_pieces_equals_eq1_over_the_whole_attention(model) -> None:
    ids = _ids(40)
    whole, pieces = DensityTracker(), DensityTracker()
    _prefill(model, ids, [40], whole)
    _prefill(model, ids, [25, 7, 1, 1, 6], pieces)  # prefill in parts and decoding steps
    assert torch.allclose(whole.token_density(40), pieces.token_density(40), atol=1e-6)
    # Eq. 1 from each layer's whole attention matrix (one pass), against the sums kept piece by piece
    cache = model.new_cache(48)
    captured: dict[int, torch.Tensor] = {}
    cache.observe_attention = lambda layer, weights, start: captured.__setitem__(layer, weights.clone())
    with torch.inference_mode():
        model.run_layers(model.embed(torch.tensor(ids)), [Segment(cache, 40)])
    matrices = [captured[layer] for layer in model.layer_ids]
    assert all(torch.allclose(m.sum(-1), torch.ones(m.shape[:-1])) and float(m.triu(1).abs().max()) == 0
               for m in matrices)  # rows sum to 1, nothing above the diagonal: causal softmax  # fmt: skip
    assert torch.allclose(pieces.token_density(40), reference_density(matrices), atol=1e-6)
    chunks = whole.chunk_density(40, 16)
    assert len(chunks) == 3 and chunks[0] == pytest.approx(float(whole.token_density(40)[:16].mean()))


def test_density_in_row_pieces_equals_one_call_and_survives_a_save_and_restore() -> None:
    generator = torch.Generator().manual_seed(4)
    q, k = torch.randn(8, 5, 32, generator=generator), torch.randn(4, 12, 32, generator=generator)  # GQA 2:1
    keys = k.repeat_interleave(2, dim=0)
    weights = torch.zeros(8, 5, 12)
    for row in range(5):  # query row sits at position 7 + row and sees keys 0..7 + row
        scores = torch.einsum("hd,htd->ht", q[:, row], keys[:, : 8 + row]) / math.sqrt(32)
        weights[:, row, : 8 + row] = torch.softmax(scores, dim=-1)
    whole, pieces = DensityTracker(), DensityTracker()
    whole.observe_weights(weights, 7)
    pieces.observe_weights(weights[:, :2, :9], 7)  # rows at 7 and 8 see keys 0..8
    pieces.observe_weights(weights[:, 2:], 9)
    assert torch.allclose(whole.token_density(12), pieces.token_density(12), atol=1e-6)
    restored = DensityTracker()
    restored.restore(whole.column_sum[:12].tolist(), whole.row_count[:12].tolist())
    assert torch.equal(restored.token_density(12), whole.token_density(12))


def _layer_copies(model, cache, length: int):
    keys, values = {}, {}
    for layer in model.layer_ids:
        k, v = cache.view(layer, length)
        keys[layer], values[layer] = k.clone(), v.clone()
    return keys, values


def _greedy_from(model, keys, values, length: int, last_hidden: torch.Tensor, steps: int) -> list[int]:
    cache = model.new_cache(length + steps + 1)
    for layer in model.layer_ids:
        cache.append(layer, keys[layer], values[layer])
    cache.advance(length)
    out = [int(torch.argmax(model.logits(last_hidden)))]
    with torch.inference_mode():
        for _ in range(steps - 1):
            hidden = model.run_layers(model.embed(torch.tensor([out[-1]])), [Segment(cache, 1)])
            out.append(int(torch.argmax(model.logits(hidden[-1]))))
    return out


def test_interleaved_missing_chunks_are_recomputed_exactly(model) -> None:
    ids = _ids(70, seed=5)
    cache, hidden = _prefill(model, ids, [70])
    keys, values = _layer_copies(model, cache, 70)
    original = ({k: t.clone() for k, t in keys.items()}, {k: t.clone() for k, t in values.items()})
    missing = [*range(16, 32), *range(48, 64)]  # chunks 1 and 3 of 16 tokens: interleaved with resident ones
    for layer in model.layer_ids:
        keys[layer][:, missing] = 0
        values[layer][:, missing] = 0
    done: list[int] = []
    recompute_positions(model, ids, keys, values, missing, after_layer=done.append)
    assert done == list(model.layer_ids)
    for layer in model.layer_ids:
        assert torch.allclose(keys[layer], original[0][layer], atol=1e-5)
        assert torch.allclose(values[layer], original[1][layer], atol=1e-5)
    assert _greedy_from(model, keys, values, 70, hidden[-1], 8) == _greedy_from(model, *original, 70, hidden[-1], 8)


def test_a_missing_chunk_at_the_end_and_the_rope_at_global_positions(model) -> None:
    ids = _ids(40, seed=9)
    cache, _ = _prefill(model, ids, [40])
    keys, values = _layer_copies(model, cache, 40)
    first = model.layer_ids[0]
    expected = keys[first][:, 32:40].clone()
    keys[first][:, 32:40] = 0
    recompute_positions(model, ids, keys, values, list(range(32, 40)))
    assert torch.allclose(keys[first][:, 32:40], expected, atol=1e-5)
    # the same tokens at positions 0.. give other keys: the position is what RoPE rotates by
    attn = model.layers[str(first)].self_attn
    x = model.layers[str(first)].input_layernorm(model.embed(torch.tensor(ids[32:40])))
    cos, sin = model.rotary.cos_sin(torch.arange(8), model.dtype, 8)
    at_zero = apply_rotary(attn.k_proj(x).view(8, attn.kv_heads, attn.head_dim).transpose(0, 1), cos, sin)
    assert not torch.allclose(at_zero, expected, atol=1e-3)


def _sleep_lateness(seconds: float, count: int = 8) -> float:
    """How much longer ``count`` sleeps of ``seconds`` take than asked, as a ratio (1: on time)."""
    start = time.perf_counter()
    for _ in range(count):
        time.sleep(seconds)
    return max(1.0, (time.perf_counter() - start) / (count * seconds))


def test_the_install_profile_fits_recompute_and_gives_back_the_modeled_disk(model, tmp_path) -> None:
    from nodes.context_service.chunk_store import ChunkStore, DiskProfile
    from nodes.context_service.install_profile import install_profile
    from nodes.contracts.kv_chunk_bytes import chunk_nbytes

    disk = DiskProfile(read_mbps=40.0, write_mbps=40.0, io_latency_ms=5.0)  # well above the real work of a read
    store = ChunkStore(str(tmp_path / "chunks"), disk)
    block = 2 * chunk_nbytes(model.config.num_key_value_heads, 16, model.config.head_dim, 8)  # one layer's read
    before = max(_sleep_lateness(disk.read_s(block)) for _ in range(3))
    profile = install_profile(model, store, 16)
    layers = len(model.layer_ids)
    one_chunk = profile["read_points"][0][0]
    # the disk's profile, given back: never faster than modeled. Late wake-ups only add, by as much as
    # this machine's load makes them around the profile: the bound above is 1.5 times the lateness of
    # the same sleeps, measured before and after (a quiet machine: 1.5; 3 test workers on 2 cores once
    # gave 1.98 of the model, and 2.12 against a lateness of 1.11 measured only after)
    late = max(before, *(_sleep_lateness(disk.read_s(block)) for _ in range(3)))
    for nbytes, seconds in profile["read_points"]:
        reads = nbytes // one_chunk * layers  # a Load reads a chunk one layer at a time
        modeled = reads * disk.read_s(block)
        assert 0.95 <= seconds / modeled <= 1.5 * late
        # the fitted profile gives the modeled disk back, in the same band: one point slowed by a loaded
        # machine pulls the fit away from the others, not below the model (a fit within 25% of every
        # point failed so beside three test workers)
        assert 0.9 <= profile["read"].seconds(nbytes) / modeled <= 1.65 * late
    recompute = profile["recompute"]  # this machine's compute: its speed is not asserted here (bench/)
    assert [count for count, _ in profile["recompute_points"]] == [1, 2, 4, 8]
    assert recompute.per_unit_s >= 0 and recompute.fixed_s >= 0 and recompute.seconds(1) > 0
    assert store.chunks_of("probe") == []  # the probe's chunks are gone
