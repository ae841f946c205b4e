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

    python bench/llms_switching.py                                 # orin-nx, 2 GB, 2/4/8 contexts
    python bench/llms_switching.py --contexts 2,4,8,16 --calls-per-context 6 --budget-gb 1
    python bench/llms_switching.py --methods llms,vllm-sq --contexts 4,8,12,16,24,32 --budget-gb 1,2,3

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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.context_switching import contexts_under
from bench._common import write
from nodes.context_service.chunk_store import ChunkStore, DiskProfile
from nodes.context_service.context_memory import ContextMemory, baseline_settings
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
    disk = disk.model_copy(update={"read_mbps": disk.read_mbps / disk_slowdown, "io_latency_ms":
                                   disk.io_latency_ms * disk_slowdown, "write_mbps": disk.write_mbps / disk_slowdown})
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
    return {"budget_gb": budget_gb, "chunk_tokens": chunk, "disk_slowdown": disk_slowdown,
            "scale": scaled.target_over_model,
            "budget_bytes": scaled.budget_bytes, "disk": disk, "t_re": t_re, "read": read,
            "read_per_chunk_s": read_per_chunk_s, "read_to_recompute": read_per_chunk_s / t_re.per_unit_s}


def sweep(args: argparse.Namespace, model, corpus: list[int], scaled: dict) -> list[dict]:
    """Every pattern x active contexts x memory method at one budget and chunk size."""
    points = []
    for pattern in args.patterns.split(","):
        for contexts in [int(n) for n in args.contexts.split(",")]:
            trace = context_trace(contexts, contexts * args.calls_per_context, pattern,
                                  tasks=tuple(args.tasks.split(",")), max_context_tokens=args.max_context_tokens,
                                  seed=args.seed)  # fmt: skip
            for method in args.methods.split(","):
                settings = baseline_settings(method, scaled["budget_bytes"], scaled["t_re"], scaled["read"],
                                             scaled["chunk_tokens"])._replace(recompute_pace=scaled["t_re"])
                point = replay(model, corpus, trace, ChunkStore, scaled["disk"], settings)
                point = {"budget_gb": scaled["budget_gb"], "chunk_tokens": scaled["chunk_tokens"],
                         "disk_slowdown": scaled["disk_slowdown"], "read_to_recompute": scaled["read_to_recompute"],
                         "pattern": pattern, "contexts": contexts, "method": method, **point}  # fmt: skip
                points.append(point)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in point.items()}),
                      flush=True)  # fmt: skip
    return points


def replay(model, corpus: list[int], trace, store_class, disk, settings) -> dict:
    """One memory method through one trace: each call's switch (until its context is resident), then
    its tokens computed into the context (teacher-forced)."""
    with tempfile.TemporaryDirectory() as tmp:
        memory = ContextMemory(model, store_class(tmp, disk), settings)
        latencies, missing = [], []
        offset = 0
        for call in trace:
            ident = f"c{call.context}"
            if ident not in memory.contexts or call.restart:
                if ident in memory.contexts:
                    memory.delete(ident)
                memory.new_context(ident)
            ids = corpus[offset % (len(corpus) - 4096):][: call.prompt_tokens + call.output_tokens]
            offset += 997
            record = memory.prepare(ident)
            cache = memory.working_cache(ident, len(ids))
            with torch.inference_mode():
                model.run_layers(model.embed(torch.tensor(ids)), [Segment(cache, len(ids))])
            memory.commit(ident, cache, ids)
            if record.missing_chunks or memory.contexts[ident].token_ids[: -len(ids)]:
                latencies.append(record.switch_s)  # a switch to a context with a past
                missing.append(record.missing_chunks)
        stats = memory.store.stats
        return {"calls": len(trace), "switches": len(latencies),
                "mean_switch_s": statistics.fmean(latencies) if latencies else 0.0,
                "p50_switch_s": statistics.median(latencies) if latencies else 0.0,
                "mean_missing_chunks": statistics.fmean(missing) if missing else 0.0,
                "bytes_read": stats.bytes_read, "bytes_written": stats.bytes_written, "faults": memory.faults,
                "recompute_overruns": memory.recompute_overruns, "store_overruns": stats.overruns}  # fmt: skip


def max_contexts(points: list[dict], constraints_ms) -> list[dict]:
    """LLMS Fig. 10: per budget, chunk size, disk, method and latency constraint, the active contexts at
    which the mean switching latency reaches the constraint (analysis.context_switching.contexts_under),
    per pattern and their mean, and how many times LLMS's mean that is over the best other method's."""
    setting = ("budget_gb", "chunk_tokens", "disk_slowdown")
    rows = []
    for limit in constraints_ms:
        for key in sorted({(*(p[k] for k in setting), p["method"]) for p in points}):
            per_pattern = {}
            for pattern in dict.fromkeys(p["pattern"] for p in points):
                mine = [p for p in points if (*(p[k] for k in setting), p["method"]) == key and p["pattern"] == pattern]
                n, beyond = contexts_under([p["contexts"] for p in mine], [p["mean_switch_s"] * 1e3 for p in mine],
                                           limit)  # fmt: skip
                per_pattern[pattern] = {"contexts": round(n, 2), "beyond_sweep": beyond}
            rows.append({"constraint_ms": limit, **dict(zip(setting, key[:-1], strict=True)), "method": key[-1],
                         "per_pattern": per_pattern,
                         "mean_contexts": statistics.fmean(v["contexts"] for v in per_pattern.values())})  # fmt: skip
    for row in rows:
        others = [r["mean_contexts"] for r in rows if r["method"] != "llms" and all(
            r[k] == row[k] for k in ("constraint_ms", *setting))]  # fmt: skip
        if row["method"] == "llms" and others:
            row["over_best_other"] = row["mean_contexts"] / max(others) if max(others) else None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="orin-nx", help="compute profile (examples/profiles)")
    parser.add_argument("--target", default="llama-2-7b")
    parser.add_argument("--budget-gb", default="2", help="context memory of the target device, GB (a list: Fig. 10)")
    parser.add_argument("--contexts", default="2,4,8")
    parser.add_argument("--patterns", default="random,markov,gaussian")
    parser.add_argument("--methods", default="llms,vllm-sq,vllm-s,swapping,lmk",
                        help="also llms-no-lifecycle, llms-no-compression, llms-no-pipeline (Fig. 13)")
    parser.add_argument("--chunk-tokens", default=str(CHUNK), help="tokens a chunk (a list: Fig. 14, 1 to 512)")
    parser.add_argument("--disk-slowdown", default="1", help="a list of factors the device's disk is made slower by "
                        "(bandwidth divided, per-I/O latency multiplied): sweeps the read:recompute ratio (Fig. 13)")
    parser.add_argument("--calls-per-context", type=int, default=5)
    parser.add_argument("--tasks", default="sst2,samsum,agnews,wmt17", help="Table 3 tasks the contexts take")
    parser.add_argument("--max-context-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
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
            p[k] == point[k] for k in ("pattern", "contexts", "budget_gb", "chunk_tokens", "disk_slowdown"))),
            None)  # fmt: skip
        point["slower_than_llms"] = point["mean_switch_s"] / base["mean_switch_s"] if base and base[
            "mean_switch_s"] else None  # fmt: skip
    first = scales[0]
    path = write(args.out, {
        "command": " ".join(["python", "bench/llms_switching.py", *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - began, 1), "device": args.device, "target": args.target,
        "budget_gb": args.budget_gb, "chunk_tokens": args.chunk_tokens, "max_context_tokens": args.max_context_tokens,
        "scale_target_over_tiny": first["scale"], "modeled_times": True,
        "t_re_s_per_chunk": first["t_re"].per_unit_s, "t_re_fixed_s": first["t_re"].fixed_s,
        "read_s_per_chunk": first["read_per_chunk_s"], "read_to_recompute_ratio": first["read_to_recompute"],
        "scales": [{k: v for k, v in s.items() if k in ("budget_gb", "chunk_tokens", "disk_slowdown", "scale",
                                                         "budget_bytes", "read_per_chunk_s", "read_to_recompute")}
                   for s in scales],
        "disk_tiny": first["disk"]._asdict(), "points": points,
        "max_contexts": max_contexts(points, CONSTRAINTS_MS),
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
