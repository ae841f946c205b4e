"""LLMS Fig. 15a on the tiny model: decoding speed inside the context service against the bare engine.

The same context (``--context`` tokens of held-out text) and the same greedy decoding of ``--tokens``
tokens, on this machine's CPU, three ways: the bare engine (a plain cache), and the service's working
cache (dequantised INT8 chunks) with and without Eq. 1's density observer, which computes every
layer's attention weights a second time. Repetitions alternate the three; medians are compared.
Target (issue 24): with the service within 10% of without.

    python bench/llms_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write
from nodes.context_service.chunk_store import ChunkStore
from nodes.context_service.context_memory import ContextMemory, MemorySettings
from nodes.context_service.load_plan import LinearCost
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"


def decode(model, cache, first: int, tokens: int) -> float:
    """Seconds to decode ``tokens`` greedily on ``cache`` from ``first``."""
    token = first
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(tokens):
            hidden = model.run_layers(model.embed(torch.tensor([token])), [Segment(cache, 1)])
            token = int(torch.argmax(model.logits(hidden[-1])))
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_whole(str(TINY), dtype="float32")
    ids = Tokenizer(str(TINY)).encode((REPO / "nodes" / "inference" / "model.py").read_text())[: args.context]
    with tempfile.TemporaryDirectory() as tmp:
        settings = MemorySettings(1 << 30, LinearCost(1e-3, 0), LinearCost(1e-9, 0))  # memory to spare
        memory = ContextMemory(model, ChunkStore(tmp), settings)
        memory.new_context("c")
        memory.prepare("c")
        cache = memory.working_cache("c", len(ids))
        with torch.inference_mode():
            model.run_layers(model.embed(torch.tensor(ids)), [Segment(cache, len(ids))])
        memory.commit("c", cache, ids)
        samples: dict[str, list[float]] = {"bare": [], "service": [], "service_no_density": []}
        for _ in range(args.reps):
            bare = model.new_cache(len(ids) + args.tokens + 1)
            with torch.inference_mode():
                model.run_layers(model.embed(torch.tensor(ids)), [Segment(bare, len(ids))])
            samples["bare"].append(decode(model, bare, ids[-1], args.tokens))
            for name in ("service", "service_no_density"):
                memory.prepare("c")
                working = memory.working_cache("c", args.tokens)
                if name == "service_no_density":
                    del working.observe_attention
                samples[name].append(decode(model, working, ids[-1], args.tokens))
                memory.release("c")
    medians = {k: statistics.median(v) for k, v in samples.items()}
    speed = {k: args.tokens / v for k, v in medians.items()}
    slowdown = {k: medians[k] / medians["bare"] - 1 for k in medians}
    for k in medians:
        print(f"{k:20s} {speed[k]:7.1f} tokens/s ({100 * slowdown[k]:+.1f}% time)")
    path = write("llms_decode", {
        "command": " ".join(["python", "bench/llms_decode.py", *sys.argv[1:]]), "context_tokens": len(ids),
        "decoded_tokens": args.tokens, "reps": args.reps, "tokens_per_s": speed, "time_over_bare": slowdown,
        "within_10_pct": slowdown["service"] <= 0.10,
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
