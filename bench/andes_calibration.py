"""Andes' server before any campaign: the serving engine's own bookkeeping and schedulers
(``nodes.serving``, no model, no ranks) in a loop whose clock is the server's compute profile, for
OPT-66B on 4 x A100-80GB (Andes Table 3) with ShareGPT-like requests.

Every scheduler and rate runs on ``--seeds`` (3) traces, each scaled so that its realised mean rate
is the nominal one (a finite bursty trace otherwise drifts 10-20% off it, enough to move a knee).
Per rate and scheduler, over the seeds' requests pooled: mean QoE (Eq. 1) and its p10/p50, TTFT
and per-request generation speed (TDS from the first token to the last) at p50, preemptions per
request (all, and those the memory forced), generated tokens per second, the decision's median
time; per scheduler, the capacity (highest rate with mean QoE >= 0.9). With 95% intervals
(``analysis/uncertainty.py``: bootstrap over requests within seeds, and over seeds): each mean QoE and
mean per-request speed, each scheduler's change against ``--baseline`` (fcfs) at every rate on the
same requests (mean QoE, throughput over the seeds), and each capacity and capacity factor against
the baseline (the sweep recomputed on every resample of the requests, the same resample for every
scheduler and rate, so the factor is paired). Also
the speed of the memory-bound batch, 1 / latency(B_mem), B_mem = M / the mean context of a request
in flight: the number Andes Fig. 3 puts at >= 6.6 tokens/s, which the profile is calibrated against,
and which decides the capacity gain (6.6 / 4.8 = 1.38x reading, 6.6 / 3.3 = 2x speaking).

``--trace speaking`` draws TDS_exp from Andes Table 2; ``--prompts sharegpt-multiround`` gives
Multi-Round-ShareGPT-like inputs; ``--arrival gamma --cv 3`` makes the arrivals
bursty (Sec. 6.3); ``--cap`` sets the preemption cap P, ``--lookahead`` pins delta t (Sec. 6.5).
``--memory-scale`` shrinks the KV capacity (and the host's swap room) so that a short run fills it,
and ``--charge-decisions`` adds each scheduling decision's measured time to its iteration, which is
how ``andes-dp`` pays for Algorithm 2's exact DP end to end (Sec. 6.5: greedy beats the DP).

This predicts where the campaigns' knees lie; the campaigns themselves measure on real ranks.

    python bench/andes_calibration.py
    python bench/andes_calibration.py --trace speaking --rates 3,4,5,6,7,8
    python bench/andes_calibration.py --arrival gamma --cv 3 --rates 2,3,4,5,6
    python bench/andes_calibration.py --memory-scale 0.125 --requests 120 --schedulers andes,andes-dp \
        --charge-decisions --rates 0.5,0.75,1

Writes bench/results/andes_calibration[_<what differs from the defaults>].json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.metrics import capacity_per_s, qoe
from analysis.uncertainty import (
    RESAMPLES,
    Interval,
    change_interval,
    mean_interval,
    percentile_interval,
    statistic_samples,
)
from bench._common import write
from nodes.contracts.compute_profile import step_seconds
from nodes.contracts.target_model import builtin
from nodes.serving.closed_loop import run_closed_loop
from nodes.serving.engine_state import EngineState, ServedRequest
from nodes.serving.schedulers import SchedulerSettings
from testbed.campaign.families.andes import kv_capacity_tokens
from testbed.target.compute_profiles import load_profile, profile_path
from workloads.prompts import LENGTH_MODELS, OUTPUT_LENGTH_MODELS
from workloads.qoe import draw_expected_tds

REPO = Path(__file__).resolve().parent.parent
GPUS = 4
SWAP_BYTES = 240e9  # Andes: 240 GB of host memory for swapped KV


@dataclass(frozen=True)
class Scenario:
    """What one closed-loop run is served under, besides its scheduler and rate."""

    rates: object  # the server's ModeRates (all GPUs)
    model: object  # the TargetModel
    capacity_tokens: int
    host_gbps: float
    trace: str = "reading"
    prompts: str = "sharegpt"  # the prompt length set (sharegpt-multiround: Andes' Multi-Round ShareGPT)
    arrival: str = "poisson"
    cv: float = 3.0
    cap: float = 1.0
    lookahead_s: float | None = None
    memory_scale: float = 1.0
    charge_decisions: bool = False


def run(scheduler: str, rate_per_s: float, count: int, seed: int, sc: Scenario) -> dict:
    rng = np.random.default_rng(seed)
    if sc.arrival == "gamma":  # shape 1/cv^2, mean gap 1/rate (Sec. 6.3's bursty arrivals)
        shape = 1.0 / (sc.cv * sc.cv)
        arrivals = np.cumsum(rng.gamma(shape, 1.0 / (rate_per_s * shape), count))
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, count))
    arrivals *= count / rate_per_s / arrivals[-1]  # the trace's realised rate is the nominal one, both processes
    prompts = np.maximum(1, np.round(LENGTH_MODELS[sc.prompts].sample(rng, count))).astype(int)
    outputs = np.clip(np.round(OUTPUT_LENGTH_MODELS["sharegpt"].sample(rng, count)), 1, 1024).astype(int)
    speeds = draw_expected_tds(sc.trace, rng, count)
    model, layers = sc.model, sc.model.layers

    def decode_s(contexts: list[int]) -> float:
        return step_seconds(sc.rates, model, layers, [(1, c) for c in contexts], head_tokens=len(contexts))

    def prefill_s(tokens: int) -> float:
        return step_seconds(sc.rates, model, layers, [(tokens, 0)], head_tokens=1)

    def swap_s(tokens: int) -> float:
        return tokens * model.kv_bytes_per_token / (sc.host_gbps * 1e9)

    swap_tokens = int(SWAP_BYTES * sc.memory_scale // model.kv_bytes_per_token)
    settings = SchedulerSettings(preemption_cap=sc.cap)
    state = EngineState(scheduler, settings, int(sc.capacity_tokens * sc.memory_scale), swap_tokens, 256,
                        lambda b: decode_s([512] * b), prefill_s, swap_s, lookahead_s=sc.lookahead_s)  # fmt: skip
    requests = [ServedRequest((0, i), float(arrivals[i]), [0] * int(prompts[i]), int(outputs[i]), 1.0,
                              float(speeds[i])) for i in range(count)]  # fmt: skip
    decisions_s: list[float] = []
    decide = state.decide

    def timed_decide(now: float):
        start = time.perf_counter()
        decision = decide(now)
        decisions_s.append(time.perf_counter() - start)
        return decision

    state.decide = timed_decide  # type: ignore[method-assign]

    def iteration_s(plan) -> float:
        moved = sum(r.context_tokens for r in plan.swapped_out + plan.swapped_in)
        if plan.kind == "prefill":
            step = step_seconds(sc.rates, model, layers, [(r.context_tokens, 0) for r in plan.compute],
                                head_tokens=len(plan.compute))  # fmt: skip
        else:
            step = decode_s([r.context_tokens for r in plan.compute]) if plan.compute else 0.0
        return step + swap_s(moved) + (decisions_s[-1] if sc.charge_decisions else 0.0)

    by_key = run_closed_loop(state, requests, iteration_s)
    stamps = {key[1]: np.array(times) for key, times in by_key.items()}
    tokens = sum(len(t) for t in stamps.values())
    span_s = max(t[-1] for t in stamps.values() if len(t)) - float(arrivals[0])
    # per request, in request order (the same requests for every scheduler at one seed: they pair)
    return {"qoe": np.array([qoe(stamps[i] - arrivals[i], 1.0, float(speeds[i])) if len(stamps[i]) else 0.0
                             for i in range(count)]),
            "ttft_s": np.array([stamps[i][0] - arrivals[i] if len(stamps[i]) else np.nan for i in range(count)]),
            "tds": np.array([(len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else np.nan
                             for t in (stamps[i] for i in range(count))]),
            "tokens": tokens, "span_s": span_s, "tokens_per_s": tokens / span_s,
            "preemptions": state.preemptions_total, "forced": state.forced_total, "requests": count,
            "decisions_s": np.array(decisions_s)}  # fmt: skip


def summarise(scheduler: str, rate_per_s: float, runs: list[dict]) -> dict:
    """One scheduler at one rate over its seeds: percentiles over all their requests pooled, the
    throughput the seeds' mean, preemptions per request over all requests."""
    pooled = {name: np.concatenate([r[name] for r in runs]) for name in ("qoe", "ttft_s", "tds", "decisions_s")}
    seeds = np.repeat(np.arange(len(runs)), [r["requests"] for r in runs])
    requests = sum(r["requests"] for r in runs)
    return {"scheduler": scheduler, "rate_per_s": rate_per_s, "seeds": len(runs),
            "qoe_mean": round(float(pooled["qoe"].mean()), 4),
            "qoe_mean_interval": mean_interval(pooled["qoe"], clusters=seeds).as_dict(),
            "qoe_seed_means": [round(float(r["qoe"].mean()), 4) for r in runs],
            "qoe_p10": round(float(np.percentile(pooled["qoe"], 10)), 4),
            "qoe_p50": round(float(np.median(pooled["qoe"])), 4),
            "ttft_p50_s": round(float(np.nanmedian(pooled["ttft_s"])), 3),
            "tds_p50_tok_s": round(float(np.nanmedian(pooled["tds"])), 3),
            "tds_mean_interval": mean_interval(pooled["tds"], clusters=seeds).as_dict(),
            "output_tokens_per_s": round(float(np.mean([r["tokens_per_s"] for r in runs])), 1),
            "preemptions_per_request": round(sum(r["preemptions"] for r in runs) / requests, 3),
            "forced_preemptions_per_request": round(sum(r["forced"] for r in runs) / requests, 3),
            "decision_ms_median": round(float(np.median(pooled["decisions_s"])) * 1e3, 3)}  # fmt: skip


def changes_against(runs: dict[tuple[str, float], list[dict]], baseline: str) -> list[dict]:
    """Each scheduler against ``baseline`` at every rate, on the same requests (seed by seed): the mean
    QoE's factor, paired by request and clustered by seed, and the throughput's change over the seeds
    (generated tokens over each run's span: one unit a seed, so no interval from one seed)."""
    rows = []
    for (scheduler, rate), mine in sorted(runs.items()):
        if scheduler == baseline or (baseline, rate) not in runs:
            continue
        base = runs[baseline, rate]
        seeds = np.repeat(np.arange(len(mine)), [r["requests"] for r in mine])
        change = change_interval(np.concatenate([r["qoe"] for r in mine]), np.concatenate([r["qoe"] for r in base]),
                                 clusters=seeds)  # fmt: skip
        throughput = change_interval([r["tokens"] for r in mine], [r["tokens"] for r in base],
                                     [r["span_s"] for r in mine], [r["span_s"] for r in base])  # fmt: skip
        if len(mine) < 2:  # one seed: one unit, no interval
            throughput = Interval(throughput.estimate, float("nan"), float("nan"), 1)
        rows.append({"scheduler": scheduler, "rate_per_s": rate, "against": baseline,
                     "qoe_factor": _shifted(change, 1.0).as_dict(),
                     "throughput_change": throughput.as_dict()})  # fmt: skip
    return rows


def _shifted(interval: Interval, by: float) -> Interval:
    """A relative change as a factor (``by`` = 1): the same interval moved by ``by``."""
    return Interval(interval.estimate + by, interval.low + by, interval.high + by, interval.units,
                    interval.confidence)  # fmt: skip


def capacity_intervals(runs: dict[tuple[str, float], list[dict]], schedulers: list[str], rates: list[float],
                       baseline: str | None, resamples: int = RESAMPLES) -> dict:  # fmt: skip
    """Andes Sec. 6.1's capacity (the highest rate whose mean QoE is at least 0.9, every lower rate too)
    of each scheduler and its factor against ``baseline``, with bootstrap intervals: every resample
    draws seeds with replacement and requests with replacement within each drawn seed, the same draw
    for every scheduler and rate (their requests are the same), and recomputes every mean QoE and the
    capacities from them. A resample where a capacity is undefined (even the lowest rate fails) is
    left out of that interval."""
    qoe_of = {key: np.stack([r["qoe"] for r in mine]) for key, mine in runs.items()}  # (seeds, requests)
    seeds, count = next(iter(qoe_of.values())).shape
    order = np.argsort(rates)
    sorted_rates = np.asarray(rates, dtype="float64")[order]
    # one row a request (seed by seed), one column a scheduler and rate (rates ascending)
    qoe = np.stack([qoe_of[s, rates[k]].reshape(-1) for s in schedulers for k in order], axis=1)

    def capacities_of(resample: np.ndarray) -> np.ndarray:  # one a scheduler
        return capacity_per_s(sorted_rates, resample.mean(axis=0).reshape(len(schedulers), len(rates)))

    capacities = statistic_samples(qoe, capacities_of, np.repeat(np.arange(seeds), count), resamples=resamples)
    drawn = {s: capacities[:, i] for i, s in enumerate(schedulers)}
    out: dict[str, dict] = {"capacity_per_s": {}, "capacity_factor": {}}
    estimate = {s: capacity_per_s(rates, [float(qoe_of[s, r].mean()) for r in rates]) for s in schedulers}
    for scheduler in schedulers:
        out["capacity_per_s"][scheduler] = percentile_interval(estimate[scheduler], drawn[scheduler],
                                                               seeds * count).as_dict()  # fmt: skip
        if baseline in schedulers and scheduler != baseline:
            with np.errstate(invalid="ignore", divide="ignore"):
                factor = drawn[scheduler] / drawn[baseline]
            out["capacity_factor"][scheduler] = percentile_interval(estimate[scheduler] / estimate[baseline],
                                                                    factor, seeds * count).as_dict()  # fmt: skip
    return out


def result_name(args: argparse.Namespace) -> str:
    """The results file: andes_calibration, suffixed by each option that differs from its default."""
    parts = ["andes_calibration"]
    if args.requests != 600:
        parts.append(f"n{args.requests}")
    if args.seeds != 3:
        parts.append(f"seeds{args.seeds}")
    if args.trace != "reading":
        parts.append(args.trace)
    if args.prompts != "sharegpt":
        parts.append(args.prompts.replace("sharegpt-", ""))
    if args.arrival != "poisson":
        parts.append(f"{args.arrival}{args.cv:g}")
    if args.cap != 1.0:
        parts.append(f"cap{args.cap:g}")
    if args.lookahead is not None:
        parts.append(f"lookahead{args.lookahead:g}")
    if args.memory_scale != 1.0:
        parts.append(f"memory{args.memory_scale:g}")
    if args.charge_decisions:
        parts.append("charged")
    return "_".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="a100-80gb-vllm", help="the server GPU's compute profile")
    parser.add_argument("--requests", type=int, default=600, help="requests a run")
    parser.add_argument("--rates", default="1,1.5,2,2.5,3,3.5,4", help="requests/s over the server")
    parser.add_argument("--schedulers", default="fcfs,rr,andes")
    parser.add_argument("--baseline", default="fcfs", help="the scheduler the others' changes are against")
    parser.add_argument("--seed", type=int, default=1, help="the first seed")
    parser.add_argument("--seeds", type=int, default=3, help="runs per scheduler and rate, seeds seed, seed+1, ...")
    parser.add_argument("--trace", default="reading", choices=["reading", "speaking"], help="TDS_exp table")
    parser.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    parser.add_argument("--prompts", default="sharegpt", choices=["sharegpt", "sharegpt-multiround"],
                        help="prompt lengths: ShareGPT's or Multi-Round ShareGPT's (about 3x longer)")  # fmt: skip
    parser.add_argument("--cv", type=float, default=3.0, help="gamma arrivals: the gaps' coefficient of variation")
    parser.add_argument("--cap", type=float, default=1.0, help="Andes' preemption cap P (Optimisation 4)")
    parser.add_argument("--lookahead", type=float, default=None,
                        help="Andes' delta t in seconds (default: the mean completion time so far)")  # fmt: skip
    parser.add_argument("--memory-scale", type=float, default=1.0,
                        help="multiply the KV capacity and the swap room by this (a short run fills them)")  # fmt: skip
    parser.add_argument(
        "--charge-decisions",
        action="store_true",
        help="add each decision's measured time to its iteration (the solver's end-to-end cost)",
    )
    args = parser.parse_args()
    profile = load_profile(profile_path(args.profile, REPO / "examples" / "profiles"))
    one = profile.rates()
    rates = one._replace(mem_bw_gbps=one.mem_bw_gbps * GPUS, peak_tflops=one.peak_tflops * GPUS)
    model = builtin("opt-66b")
    capacity = kv_capacity_tokens(model, profile.spec.memory_gb, GPUS, 0.9)
    scenario = Scenario(rates, model, capacity, profile.spec.host_link_gbps * GPUS, args.trace, args.prompts,
                        args.arrival, args.cv, args.cap, args.lookahead, args.memory_scale,
                        args.charge_decisions)  # fmt: skip
    in_flight = LENGTH_MODELS[args.prompts].mean_tokens + OUTPUT_LENGTH_MODELS["sharegpt"].mean_tokens / 2
    b_mem = int(capacity * args.memory_scale // in_flight)
    memory_bound = step_seconds(rates, model, model.layers, [(1, int(in_flight))] * b_mem, head_tokens=b_mem)
    results, runs = [], {}
    schedulers, rates = args.schedulers.split(","), [float(r) for r in args.rates.split(",")]
    for scheduler in schedulers:
        for rate in rates:
            runs[scheduler, rate] = [run(scheduler, rate, args.requests, args.seed + k, scenario)
                                     for k in range(args.seeds)]  # fmt: skip
            results.append(summarise(scheduler, rate, runs[scheduler, rate]))
            print(results[-1], flush=True)
    capacities = {}
    for scheduler in schedulers:
        mine = [r for r in results if r["scheduler"] == scheduler]
        capacities[scheduler] = capacity_per_s([r["rate_per_s"] for r in mine], [r["qoe_mean"] for r in mine])
    baseline = args.baseline if args.baseline in schedulers else None
    summary = {"kv_capacity_tokens": int(capacity * args.memory_scale), "memory_bound_batch": b_mem,
               "memory_bound_step_s": round(memory_bound, 4), "memory_bound_speed_tok_s": round(1 / memory_bound, 2),
               "capacity_per_s": capacities, "baseline": baseline,
               "intervals": capacity_intervals(runs, schedulers, rates, baseline),
               "changes": changes_against(runs, baseline) if baseline else []}  # fmt: skip
    print({k: v for k, v in summary.items() if k != "changes"})
    command = " ".join(["python", "bench/andes_calibration.py", *sys.argv[1:]])
    settings = {"trace": args.trace, "prompts": args.prompts, "arrival": args.arrival,
                "cv": args.cv if args.arrival == "gamma" else None,
                "preemption_cap": args.cap, "lookahead_s": args.lookahead, "memory_scale": args.memory_scale,
                "charge_decisions": args.charge_decisions}  # fmt: skip
    path = write(result_name(args), {"command": command, "profile": args.profile, "gpus": GPUS, **settings,
                                     **summary, "results": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
