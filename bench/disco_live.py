"""DiSCo live against trace-driven: the dispatcher racing real endpoints over HTTP (tokens computed by
the tiny model, times paced to the target) agrees with the trace-driven replay of the same policy.

Two endpoint processes on loopback: a trace endpoint (a service's TTFT and inter-token times) and a
device endpoint (a phone's measured rates). The profiles come from calibration runs against them
(server-only requests for F; device-only requests of several lengths for T_d = k l + c, whose Pearson
is the device premise); then Alpaca-like prompts are dispatched at b in {0.2, 0.5, 0.8} for both
regimes. Every request names a seed (the API's ``seed``), from which the trace endpoint draws its
times; the replay of the same plan on the same prompts with the same seeds is the paired reference
(10 independent draws of the trace give the unpaired spread). Target: mean TTFT and realised budget
within 15% of the paired replay.

    python bench/disco_live.py                       # gpt, pixel7pro-bloom-1.1b, 100 requests a point
    python bench/disco_live.py --requests 40 --service command --device xiaomi14-qwen-0.5b

Writes bench/results/disco_live.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write
from nodes.dispatch.controller import plan_dispatch
from nodes.dispatch.live import EndpointAddress, dispatch_request
from nodes.dispatch.policy import LengthDistribution, ServerTtft
from nodes.dispatch.replay import ReplayInput, draw_seeded, replay
from nodes.endpoints.device_speed import DEVICE_SPEEDS, LinearTtft
from nodes.endpoints.services import SERVICES
from nodes.inference.tokenizer import Tokenizer
from workloads.prompts import LENGTH_MODELS

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
R_C = 4.8
POLICIES = {"server": "disco-s", "device": "disco-d"}


@contextlib.contextmanager
def endpoint(directory: Path, name: str, *args: str):
    port_file = directory / f"{name}.port"
    process = subprocess.Popen([sys.executable, "-m", "nodes.endpoints", "--model", str(TINY), "--port-file",
                                str(port_file), "--log", str(directory / f"{name}.jsonl"), *args],
                               cwd=REPO, stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit(f"the {name} endpoint did not start")
            time.sleep(0.1)
        yield EndpointAddress(f"http://127.0.0.1:{int(port_file.read_text())}/v1", "tiny")
    finally:
        process.terminate()
        process.wait(timeout=30)


def prompt_of(tokens: list[int], length: int, offset: int) -> list[int]:
    start = offset % max(1, len(tokens) - length)
    return tokens[start : start + length]


def serve_all(jobs, workers: int, seeds=None) -> list[dict]:
    """Dispatch every job (dispatch_request's positional arguments), ``workers`` at a time."""
    seeds = list(seeds) if seeds is not None else [None] * len(jobs)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pair: dispatch_request(*pair[0], seed=pair[1]), zip(jobs, seeds, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--service", default="gpt", choices=list(SERVICES))
    parser.add_argument("--device", default="pixel7pro-bloom-1.1b", choices=list(DEVICE_SPEEDS))
    parser.add_argument("--requests", type=int, default=100, help="requests per budget and regime")
    parser.add_argument("--calibration", type=int, default=200, help="calibration requests per endpoint")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens a request generates (TTFT is the point)")
    parser.add_argument("--workers", type=int, default=4, help="requests in flight at once (each is independent)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-url", help="a running trace endpoint (its base URL, .../v1) instead of one "
                        "started here on loopback: bench/disco_phones.py runs this on a phone against the server's")
    parser.add_argument("--out", help="the JSON to write (default bench/results/disco_live.json)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    tokenizer = Tokenizer(str(TINY))
    corpus = tokenizer.encode((REPO / "nodes" / "inference" / "model.py").read_text())
    service, device = SERVICES[args.service], DEVICE_SPEEDS[args.device]

    def lengths(count: int) -> np.ndarray:
        return np.maximum(2, np.round(LENGTH_MODELS["alpaca"].sample(rng, count))).astype("int64")

    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        server_args = ("--pace", "trace", "--service", args.service, "--seed", str(args.seed))
        device_args = ("--pace", "device", "--device-speed", args.device)
        remote = contextlib.nullcontext(EndpointAddress(args.server_url, "tiny")) if args.server_url else None
        with remote or endpoint(directory, "server", *server_args) as server, \
                endpoint(directory, "device", *device_args) as dev:
            addresses = {"server": server, "device": dev}
            cal_lengths = lengths(args.calibration)
            never, now = float("inf"), 0.0
            unknown = LinearTtft(1.0 / device.prefill_tok_s, 0.0, 1.0, 0)
            server_cal = serve_all([(i, prompt_of(corpus, int(n), i * 37), 1, now, never, addresses, R_C, unknown)
                                    for i, n in enumerate(cal_lengths)], args.workers)  # fmt: skip
            device_cal = serve_all([(i, prompt_of(corpus, int(n), i * 53), 1, never, now, addresses, R_C, unknown)
                                    for i, n in enumerate(cal_lengths)], args.workers)  # fmt: skip
            ttft = ServerTtft.from_samples([r["ttft_s"] for r in server_cal])
            fit = LinearTtft.fit(cal_lengths, [r["ttft_s"] for r in device_cal])
            p_l = LengthDistribution.from_samples(cal_lengths)
            server_pearson = float(np.corrcoef(cal_lengths, [r["ttft_s"] for r in server_cal])[0, 1])
            print(f"calibration: T_d = {fit.seconds_per_token * 1e3:.2f} ms/token x l + {fit.intercept_s * 1e3:.1f} ms "
                  f"(Pearson {fit.pearson:.3f}); server Pearson {server_pearson:.3f}, median F "
                  f"{np.median(ttft.sorted_s):.3f} s", flush=True)  # fmt: skip
            points = []
            for regime, policy in POLICIES.items():
                for budget in (0.2, 0.5, 0.8):
                    plan = plan_dispatch(policy, budget, p_l, ttft)
                    prompts = lengths(args.requests)
                    draws = rng.random(args.requests)
                    server_start, device_start = plan.starts(prompts, draws)
                    seeds = [args.seed * 1_000_000 + len(points) * 10_000 + i for i in range(len(prompts))]
                    records = serve_all([(i, prompt_of(corpus, int(n), i * 71), args.max_tokens, float(server_start[i]),
                                          float(device_start[i]), addresses, R_C, fit)
                                         for i, n in enumerate(prompts)], args.workers, seeds)  # fmt: skip
                    live_ttft = np.array([r["ttft_s"] for r in records if r["ttft_s"] is not None])
                    spent = sum(r["race_server_input_tokens" if regime == "server" else "race_device_prefill_tokens"]
                                for r in records)  # fmt: skip
                    live_budget = spent / float(prompts.sum())
                    replayed = []
                    for draw in range(10):  # the replay of the same prompts and coins, 10 draws of the trace
                        run = ReplayInput.draw(service, prompts, np.full(len(prompts), args.max_tokens),
                                               np.random.default_rng([args.seed, draw]))  # fmt: skip
                        run = ReplayInput(run.prompt_tokens, run.output_tokens, run.server_ttft_s, run.server_gaps_s,
                                          run.migration_ttft_s, draws, run.device_jitter)  # fmt: skip
                        result = replay(plan, run, device, R_C)
                        replayed.append((result.ttft_s.mean(), np.percentile(result.ttft_s, 99),
                                         result.realised_budget(regime)))  # fmt: skip
                    spread = np.array(replayed)
                    # paired: the replay of the very server draws the live endpoint made (the seeds)
                    paired = replay(plan, draw_seeded(service, prompts, np.full(len(prompts), args.max_tokens),
                                                      seeds, draws), device, R_C)  # fmt: skip
                    mean_r, p99_r, budget_r = paired.ttft_s.mean(), np.percentile(paired.ttft_s, 99), \
                        paired.realised_budget(regime)
                    point = {
                        "regime": regime, "policy": policy, "budget": budget, "requests": len(records),
                        "failures": sum(1 for r in records if r["failure"]),
                        "live_mean_ttft_s": float(live_ttft.mean()), "replay_mean_ttft_s": float(mean_r),
                        "live_p99_ttft_s": float(np.percentile(live_ttft, 99)), "replay_p99_ttft_s": float(p99_r),
                        "live_realised_budget": live_budget, "replay_realised_budget": float(budget_r),
                        "device_first_share": float(np.mean([r["winner"] == "device" for r in records])),
                        "replay_device_first_share": float(paired.winner_device.mean()),
                        "unpaired_mean_ttft_s_range": [float(spread[:, 0].min()), float(spread[:, 0].max())],
                        "unpaired_p99_ttft_s_range": [float(spread[:, 1].min()), float(spread[:, 1].max())],
                    }  # fmt: skip
                    point["p99_ttft_gap_pct"] = 100 * (point["live_p99_ttft_s"] / point["replay_p99_ttft_s"] - 1)
                    point["mean_ttft_gap_pct"] = 100 * (point["live_mean_ttft_s"] / point["replay_mean_ttft_s"] - 1)
                    # equal budgets agree, also at 0 (a budget that no request's race used)
                    point["budget_gap_pct"] = 0.0 if abs(live_budget - float(budget_r)) < 1e-12 else \
                        100 * (live_budget / max(1e-9, float(budget_r)) - 1)
                    points.append(point)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in point.items()}),
                          flush=True)  # fmt: skip
    within = all(abs(p["mean_ttft_gap_pct"]) <= 15 and abs(p["budget_gap_pct"]) <= 15 for p in points)
    command = " ".join(["python", "bench/disco_live.py", *sys.argv[1:]])
    path = write(args.out or "disco_live", {
        "command": command, "server_url": args.server_url, "seconds": round(time.perf_counter() - began, 1),
        "service": args.service,
        "device": args.device, "max_tokens": args.max_tokens, "modeled_times": True,
        "calibration": {"device_k_s_per_token": fit.seconds_per_token, "device_c_s": fit.intercept_s,
                        "device_pearson": fit.pearson, "server_pearson": server_pearson,
                        "server_median_s": float(np.median(ttft.sorted_s))},
        "points": points, "all_within_15_pct": within,
    })  # fmt: skip
    print(f"all points within 15%: {within}; wrote {path}")


if __name__ == "__main__":
    main()
