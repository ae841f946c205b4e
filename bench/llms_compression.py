"""LLMS Fig. 12 on the tiny model: what tolerance-aware compression of the KV cache costs in quality.

Held-out text (standard-library files the tiny model never trained on), windows of 256 tokens (its
training length): the first 192 tokens are the context, whose keys and values are computed with
Eq. 1's densities tracked, then compressed chunk by chunk (16 tokens); the last 64 are scored
teacher-forced against that cache (their own keys and values exact). Schemes:

- ``fp32`` (no compression) and ``int8`` (every chunk INT8, the baseline LLMS compresses from);
- ``llms-50``: levels by density rank, 50% of INT8 on average (Eq. 2-3);
- ``int4`` and ``int2``: every chunk at 4 or 2 bits (static);
- ``random-50``: the same numbers of 8-, 4- and 2-bit chunks as ``llms-50``, placed at random.

Reported per scheme: perplexity of the scored tokens, and greedy agreement (the share of scored
positions whose argmax equals the fp32 cache's). Every scored prediction reads the compressed cache.
Target (issue 24): llms-50's perplexity increase over INT8 at most half of int4's; llms-50 better
than random-50.

    python bench/llms_compression.py               # 40 windows
    python bench/llms_compression.py --windows 200

Writes bench/results/llms_compression.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write
from nodes.context_service.chunk_codec import dequantize, quantize
from nodes.context_service.compression_levels import level_counts, plan_levels
from nodes.context_service.density import DensityTracker
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer
from workloads.corpus import held_out_corpus, held_out_every

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
CHUNK, CONTEXT, SCORED = 16, 192, 64
SCHEMES = ("fp32", "int8", "llms-50", "int4", "int2", "random-50")


def levels_for(scheme: str, densities: list[float], rng: np.random.Generator) -> list[int] | None:
    chunks = len(densities)
    if scheme == "fp32":
        return None
    if scheme in ("int8", "int4", "int2"):
        return [int(scheme[3:])] * chunks
    planned = plan_levels(densities, 0.5)
    if scheme == "llms-50":
        return planned
    shuffled = list(planned)
    rng.shuffle(shuffled)  # the same counts of each level, placed without regard to density
    return shuffled


def score(model, ids: list[int], keys, values, levels: list[int] | None) -> tuple[float, list[int]]:
    """Negative log-likelihood of the scored tokens and the argmaxes, over the context's cache compressed
    at ``levels``: inputs ids[C : C + S] on top of the cache, targets ids[C + 1 : C + S + 1]."""
    cache = model.new_cache(CONTEXT + SCORED + 1)
    for layer in model.layer_ids:
        k, v = keys[layer], values[layer]
        if levels is not None:
            k = torch.cat([dequantize(quantize(k[:, i * CHUNK : (i + 1) * CHUNK], b)) for i, b in enumerate(levels)], 1)
            v = torch.cat([dequantize(quantize(v[:, i * CHUNK : (i + 1) * CHUNK], b)) for i, b in enumerate(levels)], 1)
        cache.append(layer, k, v)
    cache.advance(CONTEXT)
    with torch.inference_mode():
        hidden = model.run_layers(model.embed(torch.tensor(ids[CONTEXT : CONTEXT + SCORED])), [Segment(cache, SCORED)])
        logits = model.logits(hidden).float()
    targets = torch.tensor(ids[CONTEXT + 1 : CONTEXT + SCORED + 1])
    nll = float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    return nll, logits.argmax(-1).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_whole(str(TINY), dtype="float32")
    tokenizer = Tokenizer(str(TINY))
    corpus = held_out_corpus(held_out_every(TINY))
    rng = np.random.default_rng(args.seed)
    began = time.perf_counter()
    totals = {s: 0.0 for s in SCHEMES}
    agree = {s: 0 for s in SCHEMES}
    counts: dict[int, int] = {}
    scored = 0
    done = 0
    while done < args.windows:
        start = int(rng.integers(len(corpus.text)))
        ids = tokenizer.encode(corpus.window(start, 4000))[1 : 2 + CONTEXT + SCORED]
        if len(ids) < 1 + CONTEXT + SCORED:
            continue
        tracker = DensityTracker()
        cache = model.new_cache(CONTEXT + 1)
        cache.observe_attention = lambda layer, weights, s, tracker=tracker: tracker.observe_weights(weights, s)
        with torch.inference_mode():
            model.run_layers(model.embed(torch.tensor(ids[:CONTEXT])), [Segment(cache, CONTEXT)])
        keys = {layer: cache.view(layer, CONTEXT)[0].clone() for layer in model.layer_ids}
        values = {layer: cache.view(layer, CONTEXT)[1].clone() for layer in model.layer_ids}
        densities = tracker.chunk_density(CONTEXT, CHUNK)
        reference = None
        for scheme in SCHEMES:
            levels = levels_for(scheme, densities, rng)
            nll, argmax = score(model, ids, keys, values, levels)
            totals[scheme] += nll
            if scheme == "fp32":
                reference = argmax
            agree[scheme] += sum(a == b for a, b in zip(argmax, reference, strict=True))
            if scheme == "llms-50":
                for bits, n in level_counts(levels).items():
                    counts[bits] = counts.get(bits, 0) + n
        scored += SCORED
        done += 1
    results = {s: {"perplexity": math.exp(totals[s] / scored), "greedy_agreement": agree[s] / scored} for s in SCHEMES}
    base = results["int8"]["perplexity"]
    for s in SCHEMES:
        results[s]["perplexity_increase_over_int8"] = results[s]["perplexity"] - base
    verdict = {
        "llms50_increase_at_most_half_of_int4": results["llms-50"]["perplexity_increase_over_int8"]
        <= 0.5 * results["int4"]["perplexity_increase_over_int8"],
        "llms50_beats_random50": results["llms-50"]["perplexity"] < results["random-50"]["perplexity"],
    }
    for s in SCHEMES:
        print(f"{s:10s} perplexity {results[s]['perplexity']:.4f}  agreement {results[s]['greedy_agreement']:.4f}")
    print(verdict)
    path = write("llms_compression", {
        "command": " ".join(["python", "bench/llms_compression.py", *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - began, 1), "windows": done, "scored_tokens": scored,
        "context_tokens": CONTEXT, "chunk_tokens": CHUNK, "llms50_level_counts": counts,
        "schemes": results, "targets": verdict,
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
