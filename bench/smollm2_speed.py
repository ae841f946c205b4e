"""Our engine's speed on SmolLM2-135M against transformers on this CPU, in one run (issue 40, item 7):
same dtype, same torch threads, same inputs; decode tokens/s at batch 1 and batch 8 (after a prompt of
--context tokens, --steps greedy steps, the LM head on the new row only) and a 512-token prefill.
Each measurement is repeated --reps times, interleaving the two engines so that a slow moment of the
machine hits both; medians with their spread, and ratios ours/transformers.

The memory-bandwidth bound: a decode step reads every weight once (the tied embedding as the LM head),
so tokens/s at batch 1 cannot exceed this machine's measured bandwidth (a large numpy copy: bytes read
plus written) over the weights' bytes; the fraction of it each engine reaches is recorded.

Needs the packaged model (make models). Writes bench/results/smollm2_speed.json. Run it on a quiet
machine: it measures time.

    .venv/bin/python bench/smollm2_speed.py [--threads 2] [--dtype float32] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import summary, write
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from testbed.models.packaged import PACKAGED, cache_dir


def bandwidth_gb_s(size_mb: int = 512, reps: int = 5) -> float:
    """This machine's memory bandwidth as a large copy sees it: (read + written bytes) / time, best of reps."""
    source = np.ones(size_mb * (1 << 20) // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best / 1e9


def ours_decode(model, batch: int, context: int, steps: int) -> float:
    """Seconds for ``steps`` decode steps of ``batch`` sequences after a ``context``-token prompt each."""
    caches = [model.new_cache(context + steps + 1) for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for cache in caches:
            prompt = torch.randint(0, model.config.vocab_size, (context,), generator=generator)
            model.run_layers(model.embed(prompt), [Segment(cache, context)])
        tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=generator)
        started = time.perf_counter()
        for _ in range(steps):
            hidden = model.run_layers(model.embed(tokens), [Segment(c, 1) for c in caches])
            tokens = torch.argmax(model.logits(hidden), dim=-1)
        return time.perf_counter() - started


def theirs_decode(model, batch: int, context: int, steps: int) -> float:
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        cache = DynamicCache()
        prompt = torch.randint(0, vocab, (batch, context), generator=generator)
        model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens = torch.randint(0, vocab, (batch, 1), generator=generator)
        started = time.perf_counter()
        for _ in range(steps):
            logits = model(tokens, past_key_values=cache, use_cache=True).logits
            tokens = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
        return time.perf_counter() - started


def ours_prefill(model, tokens: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        started = time.perf_counter()
        hidden = model.run_layers(model.embed(ids), [Segment(model.new_cache(tokens), tokens)])
        model.logits(hidden[-1:])
        return time.perf_counter() - started


def theirs_prefill(model, tokens: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        started = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the decode steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="smollm2_speed")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    packaged = PACKAGED["smollm2-135m"]
    gguf = cache_dir() / Path(packaged.member).name
    dtype = getattr(torch, args.dtype)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
    ours = load_whole(str(packaged.directory), dtype=args.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())  # the tied head counted once
    cases = {f"decode_batch{b}": (lambda m, f, b=b: f(m, b, args.context, args.steps), b * args.steps) for b in (1, 8)}
    cases[f"prefill_{args.prefill}"] = (lambda m, f: f(m, args.prefill), args.prefill)
    engines = {"ours": (ours, {"decode": ours_decode, "prefill": ours_prefill}),
               "transformers": (reference, {"decode": theirs_decode, "prefill": theirs_prefill})}  # fmt: skip
    seconds: dict[str, dict[str, list[float]]] = {case: {e: [] for e in engines} for case in cases}
    for case, (measure, _) in cases.items():
        kind = "decode" if case.startswith("decode") else "prefill"
        for model, functions in engines.values():  # warm-up
            measure(model, functions[kind])
        for _ in range(args.reps):
            for engine, (model, functions) in engines.items():
                seconds[case][engine].append(measure(model, functions[kind]))
        print(case, {e: round(statistics.median(s), 4) for e, s in seconds[case].items()}, flush=True)
    bandwidth = bandwidth_gb_s()
    bound_tokens_s = bandwidth * 1e9 / weight_bytes
    results = {}
    for case, (_, tokens) in cases.items():
        per_engine = {e: {"tokens_per_s": summary([tokens / s for s in samples]), "seconds": summary(samples)}
                      for e, samples in seconds[case].items()}  # fmt: skip
        ratios = [t / o for o, t in zip(seconds[case]["ours"], seconds[case]["transformers"], strict=True)]
        results[case] = {**per_engine, "speedup_ours_over_transformers": summary(ratios)}
    batch1 = results["decode_batch1"]
    result = {
        "model": packaged.name, "dtype": args.dtype, "threads": args.threads, "context_tokens": args.context,
        "decode_steps": args.steps, "reps": args.reps, "torch": torch.__version__, "cases": results,
        "memory_bandwidth_gb_s": round(bandwidth, 2), "weight_bytes": weight_bytes,
        "decode_batch1_bound_tokens_per_s": round(bound_tokens_s, 2),
        "fraction_of_bound": {e: round(batch1[e]["tokens_per_s"]["median"] / bound_tokens_s, 3) for e in engines},
        "targets": {"decode_batch1_speedup": 1.3, "decode_batch8_speedup": 2.0},
    }  # fmt: skip
    for case, r in results.items():
        s = r["speedup_ours_over_transformers"]
        print(f"{case}: ours {r['ours']['tokens_per_s']['median']:.1f} tok/s, transformers "
              f"{r['transformers']['tokens_per_s']['median']:.1f} tok/s, speedup {s['median']:.2f} "
              f"({s['min']:.2f}-{s['max']:.2f})")  # fmt: skip
    print(f"bandwidth {bandwidth:.1f} GB/s, weights {weight_bytes / 1e6:.0f} MB: bound {bound_tokens_s:.1f} tok/s; "
          f"fraction reached {result['fraction_of_bound']}")  # fmt: skip
    print(write(args.out, result))


if __name__ == "__main__":
    main()
