"""Install-time profiling (LLMS Sec. 3.3 i): T_re(x), the recompute time of x chunks, and T_IO(m), the
read time of m bytes, measured at a few points and fitted as lines (intercepts included), so that the
Load plan (Eq. 4) knows this device.

Recompute is timed on a context of random token ids with x of its chunks missing; reads through the
service's own chunk store (paced to the device's disk on an emulated node, so the fit gives back the
profile's disk there). Each point is the median of a few repetitions.
"""

import shutil
import statistics
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

import torch

from nodes.inference.model import ModelPart, Segment

from .chunk_codec import quantize
from .chunk_store import ChunkStore
from .load_plan import LinearCost
from .recompute import recompute_positions


def fit_line(points: Sequence[Tuple[float, float]]) -> LinearCost:
    """Least squares seconds = a x + b (a and b at least 0)."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    slope = max(0.0, slope)
    return LinearCost(slope, max(0.0, mean_y - slope * mean_x))


def profile_recompute(model: ModelPart, chunk_tokens: int, counts: Sequence[int] = (1, 2, 4, 8),
                      reps: int = 3) -> Tuple[LinearCost, List[Tuple[int, float]]]:  # fmt: skip
    chunks = max(counts) + 1
    length = chunks * chunk_tokens
    ids = torch.randint(2, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(length + 1)
    with torch.inference_mode():
        model.run_layers(model.embed(torch.tensor(ids)), [Segment(cache, length)])
    base = {layer: cache.view(layer, length) for layer in model.layer_ids}
    points = []
    for count in counts:
        samples = []
        for _ in range(reps):
            keys = {layer: k.clone().float() for layer, (k, _) in base.items()}
            values = {layer: v.clone().float() for layer, (_, v) in base.items()}
            positions = [p for c in range(1, 1 + count) for p in range(c * chunk_tokens, (c + 1) * chunk_tokens)]
            started = time.monotonic()
            recompute_positions(model, ids, keys, values, positions)
            samples.append(time.monotonic() - started)
        points.append((count, statistics.median(samples)))
    return fit_line(points), points


def profile_reads(store: ChunkStore, model: ModelPart, chunk_tokens: int, counts: Sequence[int] = (1, 2, 4, 8),
                  reps: int = 3) -> Tuple[LinearCost, List[Tuple[int, float]]]:  # fmt: skip
    """T_IO over the bytes of ``counts`` INT8 chunks, read a layer at a time as a Load does."""
    config = model.config
    generator = torch.Generator().manual_seed(1)
    shape = (config.num_key_value_heads, chunk_tokens, config.head_dim)
    layers = {layer: (quantize(torch.randn(*shape, generator=generator), 8),
                      quantize(torch.randn(*shape, generator=generator), 8)) for layer in model.layer_ids}  # fmt: skip
    probe = ChunkStore(tempfile.mkdtemp(prefix="llms-profile-", dir=store.directory), store.disk, store.sleep)
    try:
        size = probe.write("probe", 0, layers)
        for index in range(1, max(counts)):
            probe.write("probe", index, layers)
        points = []
        for count in counts:
            samples = []
            for _ in range(reps):
                started = time.monotonic()
                for layer in model.layer_ids:
                    for index in range(count):
                        probe.read_layers("probe", index, [layer])
                samples.append(time.monotonic() - started)
            # the disk's time is what it models; a loaded machine only adds to it, so the fastest
            # repetition measures it (the median of three carried a busy stretch into the fit)
            points.append((count * size, min(samples)))
        return fit_line(points), points
    finally:
        shutil.rmtree(probe.directory, ignore_errors=True)


def install_profile(model: ModelPart, store: ChunkStore, chunk_tokens: int) -> Dict[str, object]:
    recompute, re_points = profile_recompute(model, chunk_tokens)
    read, io_points = profile_reads(store, model, chunk_tokens)
    return {"recompute": recompute, "read": read, "recompute_points": re_points, "read_points": io_points,
            "read_modeled": store.modeled}  # fmt: skip
