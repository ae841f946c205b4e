"""LLMS's planning pieces against brute force: the compression levels (Eq. 2-3), the
swapping-recompute plan (Eq. 4), the LCTRU eviction order, and the chunk codec's bytes and errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from nodes.context_service.chunk_codec import dequantize, quantize, requantize
from nodes.context_service.compression_levels import plan_levels, ratio_of, weighted_density
from nodes.context_service.lctru import LctruQueue
from nodes.context_service.load_plan import LinearCost, plan_load
from nodes.contracts.kv_chunk_bytes import chunk_nbytes


def _best_by_brute_force(densities: list[float], ratio_global: float) -> float:
    best = float("inf")
    for bits in itertools.product((8, 4, 2), repeat=len(densities)):
        if sum(ratio_of(b) for b in bits) <= ratio_global * len(densities) + 1e-9:
            best = min(best, weighted_density(densities, bits))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_levels_weigh_density_as_little_as_any_assignment_within_the_ratio(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    densities = [rng.random() ** 3 for _ in range(n)]
    ratio = rng.choice([0.25, 0.4, 0.5, 0.625, 0.8, 1.0])
    bits = plan_levels(densities, ratio)
    assert sum(ratio_of(b) for b in bits) <= ratio * n + 1e-9
    assert weighted_density(densities, bits) == pytest.approx(_best_by_brute_force(densities, ratio))
    for i, j in itertools.permutations(range(n), 2):  # Eq. 2: denser never fewer bits
        if densities[i] > densities[j]:
            assert bits[i] >= bits[j]


def test_the_levels_at_the_paper_ratio_and_the_bounds() -> None:
    densities = [0.9, 0.1, 0.5, 0.05, 0.3, 0.7, 0.2, 0.6]
    bits = plan_levels(densities, 0.5)
    assert sum(ratio_of(b) for b in bits) / len(bits) == pytest.approx(0.5)  # 50% of INT8 on average
    assert bits[0] == 8 and bits[3] == 2  # the densest keeps 8 bits, the sparsest goes to 2
    assert plan_levels(densities, 1.0) == [8] * 8 and plan_levels(densities, 0.25) == [2] * 8
    assert plan_levels(densities, 0.5, current=[2] * 8) == [2] * 8  # levels only move down
    with pytest.raises(ValueError, match=r"between 0\.25"):
        plan_levels(densities, 0.1)


def test_the_levels_start_from_4_bits_and_move_only_chunks_whose_density_pays_for_it() -> None:
    """Eq. 3's 1/ratio weight is convex: even densities all take the middle level, and a chunk keeps 8
    bits only when its density exceeds twice that of the two chunks that go to 2 bits for it."""
    assert plan_levels([0.3] * 8, 0.5) == [4] * 8
    sink = [0.5, 0.06, 0.05, 0.05, 0.05, 0.05, 0.05, 0.04]  # an attention sink: 8 bits, paid by the sparsest two
    assert plan_levels(sink, 0.5) == [8, 4, 4, 4, 4, 4, 2, 2]
    mild = [0.25, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05]  # 0.25 < 2 x (0.1 + 0.05): not worth two 2-bit chunks
    assert plan_levels(mild, 0.5) == [4] * 8


def _brute_load(sizes: list[int], recompute: LinearCost, read: LinearCost) -> float:
    best = float("inf")
    for chosen in itertools.product((0, 1), repeat=len(sizes)):
        k = sum(chosen)
        rest = sum(s for s, c in zip(sizes, chosen, strict=True) if not c)
        best = min(best, max(recompute.seconds(k), read.seconds(rest)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_load_plan_is_as_fast_as_the_best_split_of_the_missing_chunks(seed: int) -> None:
    rng = random.Random(100 + seed)
    sizes = [rng.choice([2304, 1280, 768]) for _ in range(rng.randint(0, 9))]  # 8-, 4- and 2-bit chunks
    recompute = LinearCost(rng.uniform(1e-4, 5e-3), rng.uniform(0, 5e-3))
    read = LinearCost(1.0 / rng.uniform(5e6, 5e8), rng.uniform(0, 2e-3))
    plan = plan_load(sizes, recompute, read)
    assert plan.delay_s == pytest.approx(_brute_load(sizes, recompute, read))
    assert sorted(plan.recompute + plan.read) == list(range(len(sizes)))
    assert plan.bytes_read == sum(sizes[i] for i in plan.read)
    if plan.recompute and plan.read:  # the heaviest are the ones recomputed
        assert min(sizes[i] for i in plan.recompute) >= max(sizes[i] for i in plan.read)
    everything = plan_load(sizes, recompute, read, allow_recompute=False)
    assert everything.recompute == [] and everything.bytes_read == sum(sizes)


def test_recompute_joins_only_when_the_disk_is_the_slower() -> None:
    sizes = [2304] * 8
    fast_disk = plan_load(sizes, LinearCost(1e-2, 0.0), LinearCost(1e-9, 0.0))
    slow_disk = plan_load(sizes, LinearCost(1e-3, 0.0), LinearCost(1e-6, 0.0))  # 2.3 ms a chunk's read
    assert fast_disk.recompute == [] and 0 < len(slow_disk.recompute) < len(sizes)


def test_lctru_takes_the_heaviest_level_first_then_the_least_recent_and_never_the_working_set() -> None:
    queue = LctruQueue()
    bits = {("a", 0): 8, ("a", 1): 2, ("b", 0): 8, ("b", 1): 4, ("c", 0): 8}
    sizes = {k: 100 * b for k, b in bits.items()}
    queue.touch([("a", 0), ("a", 1)], bits, sizes)  # oldest
    queue.touch([("b", 0), ("b", 1)], bits, sizes)
    queue.touch([("c", 0)], bits, sizes)  # newest
    assert queue.victims(10**6) == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("a", 1)]
    assert queue.victims(1500) == [("a", 0), ("b", 0)]  # enough bytes: stop
    assert queue.victims(10**6, locked={"b"}) == [("a", 0), ("c", 0), ("a", 1)]
    queue.touch([("a", 0)], bits, sizes)  # a's chunk used again: now the most recent 8-bit one
    assert queue.victims(2000) == [("b", 0), ("c", 0), ("a", 0)]
    queue.remove_context("a")
    assert ("a", 1) not in queue and len(queue) == 3


def test_the_codec_counts_its_bytes_and_loses_more_at_fewer_bits() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 32, generator=generator) * torch.linspace(0.1, 3.0, 32)  # channels of unequal range
    errors = {}
    for bits in (8, 4, 2):
        q = quantize(x, bits)
        assert q.nbytes == chunk_nbytes(4, 16, 32, bits)
        back = dequantize(q)
        step = q.scale.float()  # per channel (a head and a dimension)
        worst = (back - x).abs().transpose(0, 1).reshape(16, 4 * 32).max(dim=0).values
        assert bool((worst <= step / 2 * 1.01 + 2e-3).all())  # half a step, plus float16's rounding
        errors[bits] = float((back - x).pow(2).mean())
        assert torch.equal(quantize(back, bits).packed, q.packed)  # codes survive a round trip
    assert errors[8] < errors[4] < errors[2]
    assert chunk_nbytes(4, 16, 32, 4) * 2 - chunk_nbytes(4, 16, 32, 8) == 4 * 32 * 4  # half, but metadata stays
    lower = requantize(quantize(x, 8), 4)
    assert lower.bits == 4 and requantize(lower, 8) is lower  # levels only move down


def test_the_chunk_store_round_trip_is_bit_exact_and_paced_to_the_device_disk(tmp_path) -> None:
    from nodes.context_service.chunk_store import ChunkStore, DiskProfile

    generator = torch.Generator().manual_seed(1)
    layers = {layer: (quantize(torch.randn(4, 16, 32, generator=generator), bits),
                      quantize(torch.randn(4, 16, 32, generator=generator), bits))
              for layer, bits in ((0, 4), (1, 4), (2, 4))}  # fmt: skip
    slept: list[float] = []
    disk = DiskProfile(read_mbps=0.1, write_mbps=0.05, io_latency_ms=500.0)  # slower than any real I/O here
    store = ChunkStore(str(tmp_path / "chunks"), disk, sleep=slept.append)
    written = store.write("ctx", 3, layers)
    assert written == 4 + len(b'{"format": 1, "bits": 4, "shape": [4, 16, 32], "layers": [0, 1, 2]}') + 3 * 2 * (
        chunk_nbytes(4, 16, 32, 4))
    back = store.read_layers("ctx", 3)
    for layer, (k, v) in layers.items():
        for original, read in ((k, back[layer][0]), (v, back[layer][1])):
            assert torch.equal(original.packed, read.packed) and torch.equal(original.scale, read.scale)
            assert torch.equal(original.low, read.low) and read.bits == 4
    one = store.read_layers("ctx", 3, [2])  # one layer: one I/O at its offset
    assert list(one) == [2] and torch.equal(one[2][1].packed, layers[2][1].packed)
    # every I/O takes the disk's time: latency + bytes / bandwidth (the rest slept)
    assert store.stats.writes == 1 and store.stats.reads == 4
    assert store.stats.write_s == pytest.approx(disk.write_s(written), rel=1e-6)
    assert store.stats.read_s == pytest.approx(4 * disk.read_s(2 * chunk_nbytes(4, 16, 32, 4)), rel=1e-6)
    assert len(slept) == 5 and store.modeled and store.chunks_of("ctx") == [3]
    store.delete("ctx", 3)
    assert store.chunks_of("ctx") == []
