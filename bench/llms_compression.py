"""LLMS Fig. 12: what tolerance-aware compression of the KV cache costs in quality.

Held-out text, windows of ``context + 64`` tokens: the first ``context`` tokens are the context, whose
keys and values are computed with Eq. 1's densities tracked, then compressed chunk by chunk (16
tokens); the last 64 are scored teacher-forced against that cache (their own keys and values exact).
For the tiny model the text is standard-library files it never trained on and the context 192 tokens
(it was trained on 256); for a pretrained model (``--model examples/models/smollm2-135m``) it is the
Python reference's held-out topics (:func:`workloads.task_prompts.prose_corpus`) and 448 tokens.
Schemes:

- ``fp32`` (no compression) and ``int8`` (every chunk INT8, the baseline LLMS compresses from);
- ``llms-50``: levels by density rank, 50% of INT8 on average (Eq. 2-3);
- ``int4`` and ``int2``: every chunk at 4 or 2 bits (static, per-chunk ranges);
- ``int4-context`` and ``int2-context``: the whole context at 4 or 2 bits with one range per channel
  (static per-context quantisation, the paper's baseline: an outlier token widens every range);
- ``random-50``: the same numbers of 8-, 4- and 2-bit chunks as ``llms-50``, placed at random.

Reported per scheme: perplexity of the scored tokens, and greedy agreement (the share of scored
positions whose argmax equals the fp32 cache's). Every scored prediction reads the compressed cache.
Also per layer, the outlier statistics of the context's keys and values: each channel's (a KV head's
dimension) largest magnitude over the context, the largest channel's against the median channel's.
Targets (issue 24; issue 40 on SmolLM2): static INT2 loses most; llms-50's perplexity increase over
INT8 at most half of static INT4's (per-context for a pretrained model); llms-50 better than random-50.

Every window's negative log-likelihood and agreement per scheme is kept (``per_window``), and
``intervals`` has 95% bootstrap intervals over windows (analysis/uncertainty.py's seed and resamples;
the schemes are scored on the same windows, so they are resampled together): each scheme's
perplexity, its rise over INT8 and its greedy agreement against INT8's; llms-50's rise against the
static INT4's (``llms50_rise_over_static4``); and llms-50's compression over INT8 (8 bits over its
chunks' mean bits, the quantisation's scales left out).

    python bench/llms_compression.py               # the tiny model, 40 windows
    python bench/llms_compression.py --model examples/models/smollm2-135m

Writes bench/results/llms_compression.json (the tiny model) or llms_compression_<model>.json (``--out``
names another).
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

from analysis import uncertainty
from bench._common import write
from nodes.context_service.chunk_codec import dequantize, quantize
from nodes.context_service.compression_levels import level_counts, plan_levels
from nodes.context_service.density import DensityTracker
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer
from workloads.corpus import held_out_corpus, held_out_every
from workloads.task_prompts import prose_corpus

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
CHUNK, SCORED = 16, 64
SCHEMES = ("fp32", "int8", "llms-50", "int4", "int2", "int4-context", "int2-context", "random-50")


def levels_for(scheme: str, densities: list[float], rng: np.random.Generator) -> list[int] | None:
    chunks = len(densities)
    if scheme == "fp32":
        return None
    if scheme in ("int8", "int4", "int2"):
        return [int(scheme[3:])] * chunks
    if scheme.endswith("-context"):
        return [int(scheme[3])]  # one "chunk": the whole context
    planned = plan_levels(densities, 0.5)
    if scheme == "llms-50":
        return planned
    shuffled = list(planned)
    rng.shuffle(shuffled)  # the same counts of each level, placed without regard to density
    return shuffled


def score(model, ids: list[int], keys, values, levels: list[int] | None, context: int) -> tuple[float, list[int]]:
    """Negative log-likelihood of the scored tokens and the argmaxes, over the context's cache compressed
    at ``levels`` (one level a chunk, or one for the whole context): inputs ids[C : C + S] on top of
    the cache, targets ids[C + 1 : C + S + 1]."""
    cache = model.new_cache(context + SCORED + 1)
    size = CHUNK if levels is None or len(levels) > 1 else context
    for layer in model.layer_ids:
        k, v = keys[layer], values[layer]
        if levels is not None:
            k = torch.cat([dequantize(quantize(k[:, i * size : (i + 1) * size], b)) for i, b in enumerate(levels)], 1)
            v = torch.cat([dequantize(quantize(v[:, i * size : (i + 1) * size], b)) for i, b in enumerate(levels)], 1)
        cache.append(layer, k, v)
    cache.advance(context)
    with torch.inference_mode():
        hidden = model.run_layers(model.embed(torch.tensor(ids[context : context + SCORED])), [Segment(cache, SCORED)])
        logits = model.logits(hidden).float()
    targets = torch.tensor(ids[context + 1 : context + SCORED + 1])
    nll = float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    return nll, logits.argmax(-1).tolist()


def outlier_ratio(states: torch.Tensor) -> float:
    """(heads, tokens, head_dim): each channel's largest magnitude over the tokens, the largest
    channel's over the median channel's."""
    peaks = states.abs().amax(dim=1).reshape(-1)
    return float(peaks.max() / peaks.median())


def intervals(per_window: dict[str, np.ndarray], static4: str) -> dict[str, dict]:
    """The summaries of the module's docstring, each an :class:`analysis.uncertainty.Interval` as a dict."""
    windows = len(per_window["tokens"])

    def ppl(data: dict[str, np.ndarray], scheme: str) -> float:
        return math.exp(data[f"nll/{scheme}"].sum() / data["tokens"].sum())

    def agreement(data: dict[str, np.ndarray], scheme: str) -> float:
        return data[f"agree/{scheme}"].sum() / data["tokens"].sum()

    def rise_ratio(data: dict[str, np.ndarray]) -> float:
        base = ppl(data, "int8")
        static = ppl(data, static4) - base
        return (ppl(data, "llms-50") - base) / static if static > 0 else math.nan

    def compression(data: dict[str, np.ndarray]) -> float:
        return 8 * data["chunks"].sum() / data["bits"].sum()

    def interval(statistic) -> dict:  # resampling the windows: every array with the same draw
        def of_windows(rows: np.ndarray) -> float:
            return statistic({k: v[rows] for k, v in per_window.items()})

        return uncertainty.statistic_interval(np.arange(windows), of_windows).as_dict()

    out: dict[str, dict] = {}
    for scheme in SCHEMES:
        out[f"perplexity/{scheme}"] = interval(lambda d, s=scheme: ppl(d, s))
        out[f"rise_over_int8/{scheme}"] = interval(lambda d, s=scheme: ppl(d, s) - ppl(d, "int8"))
        out[f"agreement/{scheme}"] = interval(lambda d, s=scheme: agreement(d, s))
        out[f"agreement_change_vs_int8/{scheme}"] = interval(
            lambda d, s=scheme: agreement(d, s) / agreement(d, "int8") - 1
        )
    out["llms50_rise_over_static4"] = interval(rise_ratio)
    out["llms50_compression_over_int8"] = interval(compression)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(TINY), help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--context", type=int, help="context tokens a window (default 192 tiny, 448 pretrained)")
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="result name under bench/results, or a .json path (default: by the model)")
    args = parser.parse_args()
    torch.manual_seed(0)
    directory = Path(args.model).resolve()
    trained_here = (directory / "training.json").is_file()
    context = args.context or (192 if trained_here else 448)
    if context % CHUNK:
        raise SystemExit(f"--context must be a multiple of {CHUNK}")
    model = load_whole(str(directory), dtype="float32")
    tokenizer = Tokenizer(str(directory))
    if trained_here:
        text, source = held_out_corpus(held_out_every(directory)).text, "held-out standard-library files"
    else:
        prose = prose_corpus("held-out")
        text, source = "\n\n".join(t for _, t in prose.topics), f"held-out reference topics, prose-{prose.sha256[:12]}"
    rng = np.random.default_rng(args.seed)
    began = time.perf_counter()
    totals = {s: 0.0 for s in SCHEMES}
    agree = {s: 0 for s in SCHEMES}
    counts: dict[int, int] = {}
    outliers: dict[int, dict[str, list[float]]] = {layer: {"keys": [], "values": []} for layer in model.layer_ids}
    scored = 0
    done = 0
    windows: dict[str, list[float]] = {"tokens": [], "chunks": [], "bits": []}
    while done < args.windows:
        start = int(rng.integers(len(text)))
        chars = max(4000, 10 * (context + SCORED))  # past the tokens a window needs, wrapping at the end
        window = (text + text[:chars])[start : start + chars]
        ids = tokenizer.encode(window)[1 : 2 + context + SCORED]
        if len(ids) < 1 + context + SCORED:
            continue
        tracker = DensityTracker()
        cache = model.new_cache(context + 1)
        cache.observe_attention = lambda layer, weights, s, tracker=tracker: tracker.observe_weights(weights, s)
        with torch.inference_mode():
            model.run_layers(model.embed(torch.tensor(ids[:context])), [Segment(cache, context)])
        keys = {layer: cache.view(layer, context)[0].clone() for layer in model.layer_ids}
        values = {layer: cache.view(layer, context)[1].clone() for layer in model.layer_ids}
        for layer in model.layer_ids:
            outliers[layer]["keys"].append(outlier_ratio(keys[layer]))
            outliers[layer]["values"].append(outlier_ratio(values[layer]))
        densities = tracker.chunk_density(context, CHUNK)
        reference = None
        for scheme in SCHEMES:
            levels = levels_for(scheme, densities, rng)
            nll, argmax = score(model, ids, keys, values, levels, context)
            totals[scheme] += nll
            if scheme == "fp32":
                reference = argmax
            agreed = sum(a == b for a, b in zip(argmax, reference, strict=True))
            agree[scheme] += agreed
            windows.setdefault(f"nll/{scheme}", []).append(nll)
            windows.setdefault(f"agree/{scheme}", []).append(agreed)
            if scheme == "llms-50":
                for bits, n in level_counts(levels).items():
                    counts[bits] = counts.get(bits, 0) + n
                windows["chunks"].append(len(levels))
                windows["bits"].append(sum(levels))
        windows["tokens"].append(SCORED)
        scored += SCORED
        done += 1
    results = {s: {"perplexity": math.exp(totals[s] / scored), "greedy_agreement": agree[s] / scored} for s in SCHEMES}
    base = results["int8"]["perplexity"]
    for s in SCHEMES:
        results[s]["perplexity_increase_over_int8"] = results[s]["perplexity"] - base
    rise = {scheme: results[scheme]["perplexity_increase_over_int8"] for scheme in SCHEMES}
    static4 = "int4" if trained_here else "int4-context"
    verdict = {
        "int2_loses_most": max(rise, key=rise.get) in ("int2", "int2-context"),
        f"llms50_increase_at_most_half_of_{static4.replace('-', '_')}": rise["llms-50"] <= 0.5 * rise[static4],
        "llms50_beats_random50": results["llms-50"]["perplexity"] < results["random-50"]["perplexity"],
    }
    for s in SCHEMES:
        print(f"{s:13s} perplexity {results[s]['perplexity']:.4f}  agreement {results[s]['greedy_agreement']:.4f}")
    print(verdict)
    per_layer = {str(layer): {kind: round(float(np.median(v)), 2) for kind, v in ratios.items()}
                 for layer, ratios in outliers.items()}  # fmt: skip
    name = args.out or ("llms_compression" if directory == TINY.resolve() else f"llms_compression_{directory.name}")
    path = write(name, {
        "command": " ".join(["python", "bench/llms_compression.py", *sys.argv[1:]]), "model": str(directory),
        "text": source, "seconds": round(time.perf_counter() - began, 1), "windows": done, "scored_tokens": scored,
        "context_tokens": context, "chunk_tokens": CHUNK, "llms50_level_counts": counts,
        "schemes": results, "targets": verdict, "static_int4": static4,
        "intervals": intervals({k: np.asarray(v, dtype="float64") for k, v in windows.items()}, static4),
        "per_window": windows,
        "outliers": {"statistic": "per layer, median over windows of (largest channel's peak magnitude / median "
                                  "channel's) over the context", "per_layer": per_layer},
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
