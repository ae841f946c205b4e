"""DiSCo's server TTFT measured on our own loaded serving engine, then the trace-driven sweep of
bench/disco_sweep.py run on it: Table 2, Fig. 6, Fig. 7 and Table 3 with the server's tail measured
rather than our lognormal reading of DiSCo Sec. 3 (nodes/endpoints/services.py).

The server is the serving engine behind DiSCo's engine endpoint (nodes/workers/engines/engine_endpoint.py:
continuous batching, the fcfs scheduler, the KV budget): the tiny model computes every token on this
CPU while each iteration takes the target's time, Llama-2-70B on 4 x A100-80GB (tensor parallel,
examples/profiles/a100-80gb.yaml), with at most ``--max-batch`` requests an iteration (one replica of
a busy service). Alpaca-like prompts arrive as a Poisson stream of ``--rate`` requests a second and
generate their Alpaca-like lengths (capped at 128, DiSCo App. E); the first ``--warmup`` share fill
the engine and are left out. A request's TTFT runs from its submission to the engine's API to its
first token, in the target's seconds: queueing for a place in the batch and the prefill iteration.

The tail's shape is measured; the scale is not: for each of DiSCo's traces the measured TTFTs are
scaled so that their median is the trace's typical TTFT (the reading of DiSCo Table 5 in
nodes/endpoints/services.py), i.e. an engine whose iterations are that much slower at the same load.
Odd-numbered requests give F (the calibration), even-numbered ones the evaluation's server times;
the inter-token times stay the trace's.

    python bench/disco_engine.py                             # 600 requests, then the whole sweep
    python bench/disco_engine.py --requests 150 --seeds 2 --traces gpt

Writes bench/results/disco_engine.json: the engine's measurement (TTFT quantiles, Pearson of prompt
length and TTFT (DiSCo Table 1's server premise), the two halves of the run, paced steps that overran,
as ``fidelity`` in a campaign's form) and the sweep's numbers with intervals over seeds, as
bench/disco_sweep.py writes them.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.fidelity import VIOLATION_LIMIT
from bench._common import write
from bench.disco_sweep import add_arguments, headline_numbers, print_numbers, sweep
from nodes.endpoints.services import SERVICES, ServiceModel
from workloads.prompts import LENGTH_MODELS, OUTPUT_LENGTH_MODELS

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
TARGET, PROFILE, GPUS = "llama-2-70b", "a100-80gb", 4  # LLaMA-3-70B's size class, as Hyperbolic serves it


def start_engine(directory: Path, max_batch: int, dilation: float):
    """The serving engine of DiSCo's engine endpoint, paced to the target, its loop on a thread."""
    from nodes.contracts.run_config import parse
    from nodes.contracts.target_model import builtin
    from nodes.workers.engines.engine_endpoint import EngineEndpoint
    from testbed.campaign.families.andes import kv_capacity_tokens
    from testbed.target.compute_profiles import load_profile, profile_path

    target, profile = builtin(TARGET), load_profile(profile_path(PROFILE, REPO))
    capacity = kv_capacity_tokens(target, profile.spec.memory_gb, GPUS, 0.9)  # vLLM's way, as campaigns size it
    config = parse({
        "method": "disco", "model": str(TINY), "out_dir": str(directory), "partition": {"stages": 1},
        "ranks": [{"role": "stage", "node": "server", "profile": profile.rates().to_json()},
                  {"role": "device", "node": "d", "schedule": "/unused"}],
        "serving": {"scheduler": "fcfs", "capacity_tokens": capacity, "max_batch": max_batch,
                    "tensor_parallel": GPUS, "ignore_eos": True},
        "target": {"model": target.to_json(), "dilation": dilation},
        "dispatch": {"server_endpoint": "engine"},
    })  # fmt: skip
    engine = EngineEndpoint(config, None, 0)
    engine.start(time.monotonic())
    loop = threading.Thread(target=engine.serve, name="engine", daemon=True)
    loop.start()
    return engine, loop, capacity


def measure(args: argparse.Namespace) -> dict:
    """Drive the engine with a Poisson stream; every request's prompt length, TTFT and token gaps."""
    from nodes.workers.engines.engine_endpoint import DONE

    rng = np.random.default_rng([args.engine_seed, 0])
    n = args.engine_requests
    prompts = np.maximum(1, np.round(LENGTH_MODELS["alpaca"].sample(rng, n))).astype("int64")
    outputs = np.clip(np.round(OUTPUT_LENGTH_MODELS["alpaca"].sample(rng, n)), 1, 128).astype("int64")
    arrivals_s = np.cumsum(rng.exponential(1.0 / args.rate, n))  # the target's seconds
    ids = [rng.integers(2, 4000, size=int(length)).tolist() for length in prompts]  # content is not the point
    ttft_s, gaps_s = np.full(n, np.nan), [np.zeros(0)] * n
    with tempfile.TemporaryDirectory(prefix="disco-engine-") as tmp:
        engine, loop, capacity = start_engine(Path(tmp), args.max_batch, args.dilation)

        def one(i: int, submitted: float) -> None:
            _, tokens = engine.submit(ids[i], int(outputs[i]))
            times = []
            while tokens.get(timeout=600) is not DONE:
                times.append(time.monotonic())
            ttft_s[i] = (times[0] - submitted) / args.dilation
            gaps_s[i] = np.diff(times) / args.dilation

        for length in (16, 64, 16, 64):  # warm-up (torch's first passes), outside the measurement
            _, tokens = engine.submit(rng.integers(2, 4000, size=length).tolist(), 4)
            while tokens.get(timeout=600) is not DONE:
                pass
        pacer = engine.pacer
        steps_before, overruns_before = (pacer.steps, pacer.overruns) if pacer else (0, 0)
        began, threads = time.monotonic(), []
        for i in range(n):
            time.sleep(max(0.0, began + arrivals_s[i] * args.dilation - time.monotonic()))
            thread = threading.Thread(target=one, args=(i, time.monotonic()), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout=900)
        wall_s = time.monotonic() - began
        engine.stop()
        loop.join(timeout=60)
        iterations = list(csv.DictReader(line for line in next(Path(tmp).rglob("engine_iterations.csv")).open()
                                         if not line.startswith("#")))  # fmt: skip
    batches = np.array([float(r["batch"]) for r in iterations if r["kind"] == "decode"])
    waiting = np.array([float(r["waiting"]) for r in iterations])
    return {"prompt_tokens": prompts, "ttft_s": ttft_s, "gaps_s": gaps_s, "wall_s": wall_s,
            "kv_capacity_tokens": capacity, "paced_steps": (pacer.steps if pacer else 0) - steps_before,
            "overrun_steps": (pacer.overruns if pacer else 0) - overruns_before,
            "decode_batch_mean": float(batches.mean()) if len(batches) else float("nan"),
            "iterations_with_a_queue_share": float((waiting > 0).mean()) if len(waiting) else float("nan")}  # fmt: skip


def summary(lengths: np.ndarray, ttft_s: np.ndarray) -> dict:
    p50, p90, p99 = np.percentile(ttft_s, [50, 90, 99])
    return {"requests": len(ttft_s), "ttft_p50_s": float(p50), "ttft_p90_s": float(p90), "ttft_p99_s": float(p99),
            "ttft_mean_s": float(ttft_s.mean()), "p99_over_p50": float(p99 / p50),
            "pearson_length_ttft": float(np.corrcoef(lengths, ttft_s)[0, 1])}  # fmt: skip


def shaped_services(samples_s: np.ndarray, scale_to_s: float) -> dict[str, ServiceModel]:
    """Every trace with the engine's TTFTs scaled to the trace's typical TTFT, its own inter-token times."""
    factor = {name: service.ttft_body.median_s / scale_to_s for name, service in SERVICES.items()}
    return {name: ServiceModel.from_samples(name, samples_s * factor[name], service.inter_token)
            for name, service in SERVICES.items()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--engine-requests", type=int, default=600, help="requests sent to the engine")
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals a second (the target's seconds)")
    parser.add_argument("--max-batch", type=int, default=8, help="requests an iteration carries at most")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the first requests left out")
    parser.add_argument("--dilation", type=float, default=1.0, help="wall seconds a target second takes")
    parser.add_argument("--engine-seed", type=int, default=0)
    parser.add_argument("--name", default="disco_engine", help="result file name under bench/results/")
    args = parser.parse_args()
    began = time.perf_counter()
    measured = measure(args)
    keep = np.arange(len(measured["ttft_s"])) >= int(args.warmup * len(measured["ttft_s"]))
    keep &= np.isfinite(measured["ttft_s"])
    lengths, ttft_s = measured["prompt_tokens"][keep], measured["ttft_s"][keep]
    half = len(ttft_s) // 2
    gaps = np.concatenate([g for g, k in zip(measured["gaps_s"], keep, strict=True) if k and len(g)])
    engine = {
        "target": TARGET, "profile": PROFILE, "gpus": GPUS, "scheduler": "fcfs", "max_batch": args.max_batch,
        "rate_per_s": args.rate, "dilation": args.dilation, "sent": len(measured["ttft_s"]),
        "warmup_left_out": int((~keep).sum()), "wall_s": round(measured["wall_s"], 1),
        **{k: measured[k] for k in ("kv_capacity_tokens", "paced_steps", "overrun_steps", "decode_batch_mean",
                                    "iterations_with_a_queue_share")},
        **summary(lengths, ttft_s), "first_half": summary(lengths[:half], ttft_s[:half]),
        "second_half": summary(lengths[half:], ttft_s[half:]),
        "tbt_p50_s": float(np.median(gaps)), "tbt_p99_s": float(np.percentile(gaps, 99)),
        "ttft_s": ttft_s.round(5).tolist(), "prompt_tokens": lengths.tolist(),
    }  # fmt: skip
    print({k: v for k, v in engine.items() if k not in ("ttft_s", "prompt_tokens")}, flush=True)
    share = measured["overrun_steps"] / max(1, measured["paced_steps"])
    fidelity = [{"settings": {"engine": f"{TARGET} on {GPUS} x {PROFILE}"}, "overrun_share": round(share, 4),
                 "worst_node_share": round(share, 4), "flagged_runs": int(share > VIOLATION_LIMIT),
                 "runs": 1}]  # fmt: skip
    median_s = float(np.median(ttft_s))
    frame = sweep(args, shaped_services(ttft_s[1::2], median_s), shaped_services(ttft_s[0::2], median_s))
    numbers = headline_numbers(frame)
    print_numbers(numbers)
    command = " ".join(["python", "bench/disco_engine.py", *sys.argv[1:]])
    path = write(args.name, {
        "command": command, "seconds": round(time.perf_counter() - began, 1), "alpha": args.alpha,
        "source_keeps_streaming": not args.source_stops, "requests": args.requests, "seeds": args.seeds,
        "engine": engine, "fidelity": fidelity,
        "scaled_to_median_s": {k: s.ttft_body.median_s for k, s in SERVICES.items()},
        "modeled": "the engine's step times (the target's, paced) and each trace's typical TTFT", **numbers,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
