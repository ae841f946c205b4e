"""LLMS Fig. 9 at small scale: mean context-switching latency against the number of active contexts, per
switching pattern and memory method, in the target device's time; with lists of budgets, Fig. 10 (the
contexts held under 10 and 25 ms, ``max_contexts`` in the JSON); with the ablations as methods and
``--disk-slowdown``, Fig. 13; with a list of chunk sizes, Fig. 14.

The tiny model computes every token; time and bytes are the target's (labelled modeled): a chunk of
the target model (Llama-2-7B by default: 16 tokens x 32 layers of INT8 keys and values, 5 MiB with
its metadata) is R times the tiny model's, so the memory budget and the disk's bandwidth are divided
by R (the disk's per-I/O latency multiplied by the ratio of layers, since each layer is one read), and
recompute is paced to the target's T_re on the device's compute profile (a 16x-token prefill of the
q4f16 target at 1K context). The read:recompute ratio of the target device is thereby kept, which is
what the paper's effects rest on. Calls are teacher-forced (their ground-truth length from Table 3's
tasks); the switching latency is from a call's arrival until its context is resident.

Every point keeps its switches' latencies (``switch_s``, by call: ``switch_calls``), so that the
summaries carry 95% bootstrap intervals (analysis/uncertainty.py): ``factors``, each method's mean
latency over LLMS's on the same calls (paired; per pattern and pooled; Fig. 9, 13); ``max_contexts``,
Fig. 10's contexts under 10 and 25 ms and LLMS's over the best other method's (the switches of each
point resampled, the crossing found again); ``best_chunk``, Fig. 14's chunk size with the lowest mean
latency. ``--seeds`` repeats every point on other traces (the bootstrap's clusters);
``--stop-above-ms`` leaves out a method's larger context counts once its mean is over that (they do
not move Fig. 10's crossing, and cost the most). A point where one context outgrows the budget alone
(small chunks' scales at a small budget) is kept as ``infeasible`` and left out of the summaries.
``fidelity``: per method, the store's I/Os that took longer than modeled.

    python bench/llms_switching.py                                 # orin-nx, 2 GB, 2/4/8 contexts
    python bench/llms_switching.py --contexts 2,4,8,16 --calls-per-context 6 --budget-gb 1
    python bench/llms_switching.py --methods llms,vllm-sq --contexts 4,8,12,16,24,32 --budget-gb 1,2,3
    python bench/llms_switching.py --methods llms --contexts 8 --budget-gb 0.5 --chunk-tokens 8,16,64,256

Writes bench/results/llms_switching.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis import uncertainty
from analysis.context_switching import contexts_under
from analysis.fidelity import VIOLATION_LIMIT
from bench._common import write
from nodes.context_service.chunk_store import ChunkStore, DiskProfile
from nodes.context_service.context_memory import ContextLimit, ContextMemory, baseline_settings
from nodes.context_service.load_plan import LinearCost
from nodes.contracts.kv_chunk_bytes import chunk_bytes_all_layers
from nodes.contracts.target_model import builtin
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer
from testbed.target.compute_profiles import load_profile
from testbed.workers.context_service import context_scale
from workloads.context_traces import context_trace

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
CHUNK = 16
CONSTRAINTS_MS = (10.0, 25.0)  # Fig. 10's latency constraints


def target_chunk_bytes(target, chunk_tokens: int) -> int:
    return chunk_bytes_all_layers(target.layers, target.kv_heads, target.head_dim, chunk_tokens)


def scale_for(profile, target, budget_gb: float, chunk: int, disk_slowdown: float = 1.0) -> dict:
    """The daemon's scale in a campaign with this target, device, budget and chunk size
    (testbed/workers/context_service.py), and the read:recompute ratio of a chunk it keeps; ``disk_slowdown``
    divides the disk's bandwidths and multiplies its per-I/O latency (a slower disk than the profile's:
    the brief's sweep of the read:recompute ratio)."""
    tiny_config = json.loads((TINY / "config.json").read_text())
    disk = profile.spec.disk
    disk = disk.model_copy(
        update={
            "read_mbps": disk.read_mbps / disk_slowdown,
            "io_latency_ms": disk.io_latency_ms * disk_slowdown,
            "write_mbps": disk.write_mbps / disk_slowdown,
        }
    )
    scaled = context_scale(tiny_config, chunk, budget_gb, target=target, rates=profile.rates(), disk=disk)
    disk, t_re, layers = DiskProfile(*scaled.disk), LinearCost(*scaled.recompute), tiny_config["num_hidden_layers"]
    tiny_chunk = round(target_chunk_bytes(target, chunk) / scaled.target_over_model)
    read = LinearCost(1.0 / (disk.read_mbps * 1e6) + disk.io_latency_ms / 1e3 * layers / tiny_chunk, 0.0)
    read_per_chunk_s = disk.read_s(tiny_chunk // layers) * layers
    print(f"{budget_gb:g} GB, {chunk}-token chunks, disk {disk_slowdown:g}x slower: target chunk "
          f"{target_chunk_bytes(target, chunk) / 2**20:.2f} MiB"
          f" = {scaled.target_over_model:.0f} x tiny; budget {scaled.budget_bytes / 2**20:.1f} MiB; T_re "
          f"{t_re.per_unit_s * 1e3:.1f} ms/chunk + {t_re.fixed_s * 1e3:.1f} ms; read {read_per_chunk_s * 1e3:.2f} "
          f"ms/chunk (read:recompute {read_per_chunk_s / t_re.per_unit_s:.2f})", flush=True)  # fmt: skip
    return {
        "budget_gb": budget_gb,
        "chunk_tokens": chunk,
        "disk_slowdown": disk_slowdown,
        "scale": scaled.target_over_model,
        "budget_bytes": scaled.budget_bytes,
        "disk": disk,
        "t_re": t_re,
        "read": read,
        "read_per_chunk_s": read_per_chunk_s,
        "read_to_recompute": read_per_chunk_s / t_re.per_unit_s,
    }


SETTING = ("budget_gb", "chunk_tokens", "disk_slowdown")  # what keys a sweep besides pattern, contexts, method
TRACE = ("pattern", "seed", "contexts")  # the trace a point replays: the same calls for every method


def sweep(args: argparse.Namespace, model, corpus: list[int], scaled: dict) -> list[dict]:
    """Every pattern x seed x active contexts x memory method at one budget and chunk size; with
    ``--stop-above-ms``, a method's larger counts are left out once its mean latency is over it."""
    points = []
    for pattern in args.patterns.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            over: set[str] = set()
            for contexts in sorted(int(n) for n in args.contexts.split(",")):
                trace = context_trace(contexts, contexts * args.calls_per_context, pattern,
                                      tasks=tuple(args.tasks.split(",")), max_context_tokens=args.max_context_tokens,
                                      seed=seed)  # fmt: skip
                for method in args.methods.split(","):
                    if method in over:
                        continue
                    settings = baseline_settings(
                        method, scaled["budget_bytes"], scaled["t_re"], scaled["read"], scaled["chunk_tokens"]
                    )._replace(recompute_pace=scaled["t_re"])
                    try:
                        point = replay(model, corpus, trace, ChunkStore, scaled["disk"], settings)
                    except ContextLimit as refused:  # one context outgrows the budget: no point here
                        point = {"calls": len(trace), "switches": 0, "mean_switch_s": float("nan"),
                                 "infeasible": str(refused), "recompute_overruns": 0, "store_overruns": 0,
                                 "store_ios": 0, "recomputes": 0, "faults": 0, "switch_s": [],
                                 "switch_calls": []}  # fmt: skip
                    point = {"budget_gb": scaled["budget_gb"], "chunk_tokens": scaled["chunk_tokens"],
                             "disk_slowdown": scaled["disk_slowdown"], "read_to_recompute": scaled["read_to_recompute"],
                             "pattern": pattern, "seed": seed, "contexts": contexts, "method": method,
                             **point}  # fmt: skip
                    points.append(point)
                    if args.stop_above_ms is not None and not point["mean_switch_s"] * 1e3 <= args.stop_above_ms:
                        over.add(method)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in point.items()
                                      if not isinstance(v, list)}), flush=True)  # fmt: skip
    return points


def replay(model, corpus: list[int], trace, store_class, disk, settings) -> dict:
    """One memory method through one trace: each call's switch (until its context is resident), then
    its tokens computed into the context (teacher-forced)."""
    with tempfile.TemporaryDirectory() as tmp:
        memory = ContextMemory(model, store_class(tmp, disk), settings)
        latencies, missing, calls, recomputes = [], [], [], 0
        offset = 0
        for index, call in enumerate(trace):
            ident = f"c{call.context}"
            if ident not in memory.contexts or call.restart:
                if ident in memory.contexts:
                    memory.delete(ident)
                memory.new_context(ident)
            ids = corpus[offset % (len(corpus) - 4096) :][: call.prompt_tokens + call.output_tokens]
            offset += 997
            record = memory.prepare(ident)
            recomputes += record.recomputed_chunks > 0
            cache = memory.working_cache(ident, len(ids))
            with torch.inference_mode():
                model.run_layers(model.embed(torch.tensor(ids)), [Segment(cache, len(ids))])
            memory.commit(ident, cache, ids)
            if record.missing_chunks or memory.contexts[ident].token_ids[: -len(ids)]:
                latencies.append(record.switch_s)  # a switch to a context with a past
                missing.append(record.missing_chunks)
                calls.append(index)
        stats = memory.store.stats
        return {"calls": len(trace), "switches": len(latencies),
                "mean_switch_s": statistics.fmean(latencies) if latencies else 0.0,
                "p50_switch_s": statistics.median(latencies) if latencies else 0.0,
                "mean_missing_chunks": statistics.fmean(missing) if missing else 0.0,
                "bytes_read": stats.bytes_read, "bytes_written": stats.bytes_written, "faults": memory.faults,
                "recompute_overruns": memory.recompute_overruns, "store_overruns": stats.overruns,
                "store_ios": stats.reads + stats.writes, "recomputes": recomputes,
                "switch_s": [round(s, 6) for s in latencies], "switch_calls": calls}  # fmt: skip


# -- summaries with intervals ---------------------------------------------------------------------------


def _resampled_means(points: list[dict]) -> list[np.ndarray]:
    """Per point, its mean switching latency (s) in each of RESAMPLES bootstrap resamples of its switches
    (0 for a point without switches, as its mean is), each point's resamples with a seed of its own."""
    out = []
    for index, point in enumerate(points):
        values = np.asarray(point["switch_s"], dtype="float64")
        out.append(uncertainty.statistic_samples(values, np.mean, seed=uncertainty.SEED + index) if len(values)
                   else np.zeros(uncertainty.RESAMPLES))  # fmt: skip
    return out


def _interval(estimate: float, samples: np.ndarray, units: int) -> dict:
    return uncertainty.percentile_interval(estimate, samples, units).as_dict()


def fidelity(points: list[dict]) -> list[dict]:
    """Per method, the chunk store's paced reads and writes that took longer than modeled, in the shape of
    bench/campaign_reproduction.py's record: the share over all its points, the worst point's, and the
    points over analysis.fidelity's limit (a point stands for a run). Recomputes are left out: one that
    ends late may have waited for its layer's reads, as the pipeline means it to (``overruns`` counts them)."""
    rows = []
    for method in dict.fromkeys(p["method"] for p in points):
        mine = [p for p in points if p["method"] == method]
        steps = [p["store_ios"] for p in mine]
        overruns = [p["store_overruns"] for p in mine]
        shares = [o / n for o, n in zip(overruns, steps, strict=True) if n]
        rows.append({"settings": {"method": method},
                     "overrun_share": round(sum(overruns) / sum(steps), 4) if sum(steps) else 0.0,
                     "worst_node_share": round(max(shares, default=0.0), 4),
                     "flagged_runs": sum(share > VIOLATION_LIMIT for share in shares), "runs": len(mine)})  # fmt: skip
    return rows


def factors(points: list[dict]) -> list[dict]:
    """LLMS Fig. 9 and 13: per budget, chunk size and disk, per pattern and over all of them ("all",
    pooled over context counts and seeds), each method's mean switching latency (ms) and LLMS's over the
    same calls, and the first over the second (a factor: how many times LLMS's), with paired bootstrap
    intervals clustered by seed (analysis.uncertainty.change_interval); also VLLM-S and VLLM-SQ
    together ("vllm-s+vllm-sq", the paper's "on average 9.7x" against both)."""
    rows = []
    for setting in sorted({tuple(p[k] for k in SETTING) for p in points}):
        mine = [p for p in points if tuple(p[k] for k in SETTING) == setting]
        llms = {tuple(p[k] for k in TRACE): p for p in mine if p["method"] == "llms"}
        methods = list(dict.fromkeys(p["method"] for p in mine if p["method"] != "llms"))
        if {"vllm-s", "vllm-sq"} <= set(methods):
            methods.append("vllm-s+vllm-sq")
        for pattern in [*dict.fromkeys(p["pattern"] for p in mine), "all"]:
            for method in methods:
                treated, base, seeds = [], [], []
                for p in mine:
                    if p["method"] not in method.split("+") or pattern not in ("all", p["pattern"]):
                        continue
                    other = llms.get(tuple(p[k] for k in TRACE))
                    if other is None:
                        continue
                    theirs = dict(zip(other["switch_calls"], other["switch_s"], strict=True))
                    for call, latency in zip(p["switch_calls"], p["switch_s"], strict=True):
                        if call in theirs:
                            treated.append(latency * 1e3)
                            base.append(theirs[call] * 1e3)
                            seeds.append(p["seed"])
                if not treated:
                    continue
                change = uncertainty.change_interval(treated, base, clusters=seeds)
                over = uncertainty.Interval(1 + change.estimate, 1 + change.low, 1 + change.high, change.units)
                rows.append({**dict(zip(SETTING, setting, strict=True)), "pattern": pattern, "method": method,
                             "switches": len(treated),
                             "mean_ms": uncertainty.mean_interval(treated, clusters=seeds).as_dict(),
                             "llms_mean_ms": uncertainty.mean_interval(base, clusters=seeds).as_dict(),
                             "over_llms": over.as_dict()})  # fmt: skip
    return rows


def max_contexts(points: list[dict], constraints_ms, resampled: list[np.ndarray]) -> list[dict]:
    """LLMS Fig. 10: per budget, chunk size, disk, method and latency constraint, the active contexts at
    which the mean switching latency reaches the constraint (analysis.context_switching.contexts_under),
    per pattern (over seeds) and their mean over patterns and seeds, and how many times LLMS's that is
    over the best other method's; intervals by resampling each point's switches (``resampled``) and
    finding the crossings again. ``beyond_sweep``: some pattern never reached the constraint (its count
    is the largest tested)."""
    rows = []
    for limit in constraints_ms:
        for key in sorted({(*(p[k] for k in SETTING), p["method"]) for p in points}):
            per_pattern, draws, crossings, beyond, units = {}, [], [], False, 0
            for pattern in dict.fromkeys(p["pattern"] for p in points):
                counts, pattern_beyond = [], False
                for seed in sorted({p["seed"] for p in points}):
                    mine = [(i, p) for i, p in enumerate(points) if (*(p[k] for k in SETTING), p["method"]) == key
                            and p["pattern"] == pattern and p["seed"] == seed]  # fmt: skip
                    if not mine:
                        continue
                    n = [p["contexts"] for _, p in mine]
                    count, over = contexts_under(n, [p["mean_switch_s"] * 1e3 for _, p in mine], limit)
                    means = np.stack([resampled[i] * 1e3 for i, _ in mine], axis=1)
                    draws.append([contexts_under(n, list(row), limit)[0] for row in means])
                    counts.append(count)
                    crossings.append(count)
                    pattern_beyond |= over
                    units += sum(p["switches"] for _, p in mine)
                if not counts:
                    continue
                per_pattern[pattern] = {"contexts": round(statistics.fmean(counts), 2), "beyond_sweep": pattern_beyond}
                beyond |= pattern_beyond
            if not per_pattern:
                continue
            estimate = statistics.fmean(crossings)  # over patterns and seeds, as the resamples are
            samples = np.mean(np.asarray(draws), axis=0)
            rows.append({"constraint_ms": limit, **dict(zip(SETTING, key[:-1], strict=True)), "method": key[-1],
                         "per_pattern": per_pattern, "mean_contexts": estimate, "beyond_sweep": beyond,
                         "contexts": _interval(estimate, samples, units), "_samples": samples})  # fmt: skip
    for row in rows:
        others = [r for r in rows if r["method"] != "llms" and all(
            r[k] == row[k] for k in ("constraint_ms", *SETTING))]  # fmt: skip
        if row["method"] == "llms" and others:
            best = max(r["mean_contexts"] for r in others)
            samples = row["_samples"] / np.max(np.stack([r["_samples"] for r in others]), axis=0)
            row["over_best_other"] = row["mean_contexts"] / best if best else None
            row["over_best_other_interval"] = _interval(row["mean_contexts"] / best if best else float("nan"),
                                                        samples, row["contexts"]["units"])  # fmt: skip
    for row in rows:
        del row["_samples"]
    return rows


def best_chunk(points: list[dict], resampled: list[np.ndarray]) -> list[dict]:
    """LLMS Fig. 14: per budget, disk, method and active contexts swept over chunk sizes, the mean
    switching latency at each chunk size (over patterns and seeds, every switch weighted alike) and the
    chunk size where it is lowest, with the bootstrap's spread of that choice (resampling each point's
    switches)."""
    rows = []
    group = ("budget_gb", "disk_slowdown", "method", "contexts")
    for key in sorted({tuple(p[k] for k in group) for p in points}):
        mine = [(i, p) for i, p in enumerate(points) if tuple(p[k] for k in group) == key]
        sizes = sorted({p["chunk_tokens"] for _, p in mine})
        if len(sizes) < 2:
            continue
        means, samples, units = [], [], 0
        for size in sizes:
            at = [(i, p) for i, p in mine if p["chunk_tokens"] == size]
            weights = np.asarray([p["switches"] for _, p in at], dtype="float64")
            total = weights.sum() or 1.0
            means.append(sum(p["mean_switch_s"] * p["switches"] for _, p in at) / total * 1e3)
            samples.append(sum(resampled[i] * p["switches"] for i, p in at) / total * 1e3)
            units += int(weights.sum())
        best = np.asarray(sizes, dtype="float64")[np.argmin(np.stack(samples), axis=0)]
        tail = 100 * (1 - uncertainty.CONFIDENCE) / 2
        low, high = np.percentile(best, [tail, 100 - tail], method="nearest")
        estimate = sizes[int(np.argmin(means))]
        rows.append({**dict(zip(group, key, strict=True)), "chunk_sizes": sizes,
                     "mean_ms": {str(s): _interval(m, x, units) for s, m, x in zip(sizes, means, samples, strict=True)},
                     "best_chunk_tokens": uncertainty.Interval(float(estimate), float(low), float(high),
                                                               units).as_dict()})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="orin-nx", help="compute profile (examples/profiles)")
    parser.add_argument("--target", default="llama-2-7b")
    parser.add_argument("--budget-gb", default="2", help="context memory of the target device, GB (a list: Fig. 10)")
    parser.add_argument("--contexts", default="2,4,8")
    parser.add_argument("--patterns", default="random,markov,gaussian")
    parser.add_argument(
        "--methods",
        default="llms,vllm-sq,vllm-s,swapping,lmk",
        help="also llms-no-lifecycle, llms-no-compression, llms-no-pipeline (Fig. 13)",
    )
    parser.add_argument("--chunk-tokens", default=str(CHUNK), help="tokens a chunk (a list: Fig. 14, 1 to 512)")
    parser.add_argument(
        "--disk-slowdown",
        default="1",
        help="a list of factors the device's disk is made slower by "
        "(bandwidth divided, per-I/O latency multiplied): sweeps the read:recompute ratio (Fig. 13)",
    )
    parser.add_argument("--calls-per-context", type=int, default=5)
    parser.add_argument("--tasks", default="sst2,samsum,agnews,wmt17", help="Table 3 tasks the contexts take")
    parser.add_argument("--max-context-tokens", type=int, default=1024)
    parser.add_argument("--seeds", "--seed", default="0", help="trace seeds (a list: repetitions on other traces)")
    parser.add_argument(
        "--stop-above-ms",
        type=float,
        help="leave out a method's larger context counts (per "
        "pattern and seed) once its mean switching latency is over this (Fig. 10)",
    )
    parser.add_argument("--out", default="llms_switching", help="result name under bench/results, or a .json path")
    args = parser.parse_args()

    model = load_whole(str(TINY), dtype="float32")
    torch.set_num_threads(1)
    profile = load_profile(REPO / "examples" / "profiles" / f"{args.device}.yaml")
    target = builtin(args.target)._replace(dtype="q4f16")  # GPTQ 4-bit weights, as the paper runs
    corpus = Tokenizer(str(TINY)).encode((REPO / "nodes" / "inference" / "model.py").read_text() * 4)
    began = time.perf_counter()
    points, scales = [], []
    for budget_gb in [float(b) for b in args.budget_gb.split(",")]:
        for chunk in [int(c) for c in args.chunk_tokens.split(",")]:
            for slowdown in [float(x) for x in args.disk_slowdown.split(",")]:
                scaled = scale_for(profile, target, budget_gb, chunk, slowdown)
                scales.append(scaled)
                points += sweep(args, model, corpus, scaled)
    for point in points:
        base = next((p for p in points if p["method"] == "llms" and all(
            p[k] == point[k] for k in (*TRACE, *SETTING))), None)  # fmt: skip
        point["slower_than_llms"] = point["mean_switch_s"] / base["mean_switch_s"] if base and base[
            "mean_switch_s"] else None  # fmt: skip
    feasible = [p for p in points if "infeasible" not in p]  # the summaries leave out what did not fit
    resampled = _resampled_means(feasible)
    first = scales[0]
    path = write(args.out, {
        "command": " ".join(["python", "bench/llms_switching.py", *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - began, 1), "device": args.device, "target": args.target,
        "budget_gb": args.budget_gb, "chunk_tokens": args.chunk_tokens, "max_context_tokens": args.max_context_tokens,
        "seeds": args.seeds, "calls_per_context": args.calls_per_context, "stop_above_ms": args.stop_above_ms,
        "scale_target_over_tiny": first["scale"], "modeled_times": True,
        "t_re_s_per_chunk": first["t_re"].per_unit_s, "t_re_fixed_s": first["t_re"].fixed_s,
        "read_s_per_chunk": first["read_per_chunk_s"], "read_to_recompute_ratio": first["read_to_recompute"],
        "scales": [{k: v for k, v in s.items() if k in ("budget_gb", "chunk_tokens", "disk_slowdown", "scale",
                                                         "budget_bytes", "read_per_chunk_s", "read_to_recompute")}
                   for s in scales],
        "disk_tiny": first["disk"]._asdict(),
        "overruns": {"recompute": sum(p["recompute_overruns"] for p in points),
                     "recomputes": sum(p["recomputes"] for p in points),
                     "store": sum(p["store_overruns"] for p in points),
                     "store_ios": sum(p["store_ios"] for p in points), "faults": sum(p["faults"] for p in points)},
        "fidelity": fidelity(points),
        "infeasible": len(points) - len(feasible),
        "factors": factors(feasible), "max_contexts": max_contexts(feasible, CONSTRAINTS_MS, resampled),
        "best_chunk": best_chunk(feasible, resampled), "points": points,
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
