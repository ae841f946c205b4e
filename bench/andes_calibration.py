"""Andes' server before any campaign: the serving engine's own bookkeeping and schedulers
(``nodes.serving``, no model, no ranks) in a loop whose clock is the server's compute profile, for
OPT-66B on 4 x A100-80GB (Andes Table 3) with ShareGPT-like requests and reading-speed users.

Per request rate and scheduler: mean QoE (Eq. 1), per-request generation speed (TDS from the first
token to the last, p50), preemptions per request; per scheduler, the capacity (highest rate with mean
QoE >= 0.9). Also the speed of the memory-bound batch, 1 / latency(B_mem), B_mem = M / the mean
context of a request in flight: the number Andes Fig. 3 puts at >= 6.6 tokens/s, which the profile
is calibrated against, and which decides the capacity gain (6.6 / 4.8 = 1.38x reading).

This predicts where the campaigns' knees lie; the campaigns themselves measure on real ranks.

    python bench/andes_calibration.py
    python bench/andes_calibration.py --profile a100-80gb --requests 400 --rates 1,2,3,4

Writes bench/results/andes_calibration.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.metrics import capacity_per_s, qoe
from bench._common import write
from nodes.contracts.compute_profile import step_seconds
from nodes.contracts.target_model import builtin
from nodes.serving.closed_loop import run_closed_loop
from nodes.serving.engine_state import EngineState, ServedRequest
from nodes.serving.schedulers import SchedulerSettings
from testbed.campaign.serving_budget import kv_capacity_tokens
from testbed.compute_profiles import load_profile, profile_path
from workloads.prompts import LENGTH_MODELS, OUTPUT_LENGTH_MODELS
from workloads.qoe import draw_expected_tds

REPO = Path(__file__).resolve().parent.parent
GPUS = 4


def run(scheduler: str, rate_per_s: float, count: int, seed: int, rates, model, capacity: int,
        host_gbps: float, cap: float = 1.0) -> dict:  # fmt: skip
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, count))
    prompts = np.maximum(1, np.round(LENGTH_MODELS["sharegpt"].sample(rng, count))).astype(int)
    outputs = np.clip(np.round(OUTPUT_LENGTH_MODELS["sharegpt"].sample(rng, count)), 1, 1024).astype(int)
    speeds = draw_expected_tds("reading", rng, count)
    layers = model.layers

    def decode_s(contexts: list[int]) -> float:
        return step_seconds(rates, model, layers, [(1, c) for c in contexts], head_tokens=len(contexts))

    def prefill_s(tokens: int) -> float:
        return step_seconds(rates, model, layers, [(tokens, 0)], head_tokens=1)

    def swap_s(tokens: int) -> float:
        return tokens * model.kv_bytes_per_token / (host_gbps * 1e9)

    swap_tokens = int(240e9 // model.kv_bytes_per_token)  # Andes: 240 GB of host memory for swapped KV
    state = EngineState(scheduler, SchedulerSettings(preemption_cap=cap), capacity, swap_tokens, 256,
                        lambda b: decode_s([512] * b), prefill_s, swap_s)  # fmt: skip
    requests = [ServedRequest((0, i), float(arrivals[i]), [0] * int(prompts[i]), int(outputs[i]), 1.0,
                              float(speeds[i])) for i in range(count)]  # fmt: skip

    def iteration_s(plan) -> float:
        moved = sum(r.context_tokens for r in plan.swapped_out + plan.swapped_in)
        if plan.kind == "prefill":
            step = step_seconds(rates, model, layers, [(r.context_tokens, 0) for r in plan.compute],
                                head_tokens=len(plan.compute))  # fmt: skip
        else:
            step = decode_s([r.context_tokens for r in plan.compute]) if plan.compute else 0.0
        return step + swap_s(moved)

    by_key = run_closed_loop(state, requests, iteration_s)
    stamps = {key[1]: times for key, times in by_key.items()}
    qoes = np.array([qoe(np.array(stamps[i]) - arrivals[i], 1.0, float(speeds[i])) if stamps[i] else 0.0
                     for i in range(count)])  # fmt: skip
    tds = np.array([(len(t) - 1) / (t[-1] - t[0]) for t in stamps.values() if len(t) > 1 and t[-1] > t[0]])
    return {"scheduler": scheduler, "rate_per_s": rate_per_s, "qoe_mean": round(float(qoes.mean()), 4),
            "qoe_p50": round(float(np.median(qoes)), 4), "tds_p50_tok_s": round(float(np.median(tds)), 3),
            "preemptions_per_request": round(state.preemptions_total / count, 3),
            "forced_preemptions": state.forced_total}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="a100-80gb-vllm", help="the server GPU's compute profile")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rates", default="1,1.5,2,2.5,3,3.5,4", help="requests/s over the server")
    parser.add_argument("--schedulers", default="fcfs,rr,andes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cap", type=float, default=1.0, help="Andes' preemption cap P (Optimisation 4)")
    args = parser.parse_args()
    profile = load_profile(profile_path(args.profile, REPO / "examples" / "profiles"))
    one = profile.rates()
    rates = one._replace(mem_bw_gbps=one.mem_bw_gbps * GPUS, peak_tflops=one.peak_tflops * GPUS)
    model = builtin("opt-66b")
    capacity = kv_capacity_tokens(model, profile.spec.memory_gb, GPUS, 0.9)
    in_flight = LENGTH_MODELS["sharegpt"].mean_tokens + OUTPUT_LENGTH_MODELS["sharegpt"].mean_tokens / 2
    b_mem = int(capacity // in_flight)
    memory_bound = step_seconds(rates, model, model.layers, [(1, int(in_flight))] * b_mem, head_tokens=b_mem)
    results = []
    for scheduler in args.schedulers.split(","):
        for rate in [float(r) for r in args.rates.split(",")]:
            results.append(run(scheduler, rate, args.requests, args.seed, rates, model, capacity,
                               profile.spec.host_link_gbps * GPUS, args.cap))  # fmt: skip
            print(results[-1])
    capacities = {}
    for scheduler in args.schedulers.split(","):
        mine = [r for r in results if r["scheduler"] == scheduler]
        capacities[scheduler] = capacity_per_s([r["rate_per_s"] for r in mine], [r["qoe_mean"] for r in mine])
    summary = {"kv_capacity_tokens": capacity, "memory_bound_batch": b_mem,
               "memory_bound_step_s": round(memory_bound, 4), "memory_bound_speed_tok_s": round(1 / memory_bound, 2),
               "capacity_per_s": capacities}  # fmt: skip
    print(summary)
    command = " ".join(["python", "bench/andes_calibration.py", *sys.argv[1:]])
    name = "andes_calibration" if args.cap == 1.0 else f"andes_calibration_cap{args.cap:g}"
    path = write(name, {"command": command, "profile": args.profile, "gpus": GPUS, "preemption_cap": args.cap,
                        **summary, "results": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
