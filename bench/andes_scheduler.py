"""How long each scheduler takes to decide one iteration, with 100, 500 and 2,000 requests in flight.

The snapshots are what a loaded server looks like when Andes solves (above the 90% KV watermark):
OPT-66B-like contexts (ShareGPT-like prompts of 100-1,000 tokens plus 0-300 generated), half of them
running, the rest queued or preempted, client buffers anywhere from empty to 30 tokens ahead,
reading-speed TDS_exp (Table 1, mean 4.8 tok/s), and a latency table that is flat and then rises
(latency(B) = 0.15 s + 1 ms x B). The KV capacity holds about half the requests. ``andes-dp`` (Algorithm
2, memory in 16-token blocks) is timed at 100 requests only: it is the reference, not a candidate.

    python bench/andes_scheduler.py
    python bench/andes_scheduler.py --repeats 50

Writes bench/results/andes_scheduler.json: per scheduler and request count, the median, p90 and max
decision time in ms, and whether andes solved (it must: the snapshots are above the watermark).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write
from nodes.serving.schedulers import SCHEDULERS, SchedulerSettings, Snapshot
from workloads.qoe import draw_expected_tds


def loaded_snapshot(requests: int, seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    context = rng.integers(100, 1000, requests) + rng.integers(0, 300, requests)
    running = rng.random(requests) < 0.5
    capacity = int(context.sum() * 0.5)
    order = np.flatnonzero(running)
    while context[running].sum() > capacity * 0.98:  # the running fit, and sit above the watermark
        running[order[-1]] = False
        order = order[:-1]
    delivered = np.where(running | (rng.random(requests) < 0.3), rng.integers(1, 300, requests), 0).astype("float64")
    digested = np.maximum(0.0, delivered - rng.uniform(0, 30, requests))
    arrival = np.sort(rng.uniform(0, 100, requests))
    max_batch = 4096
    return Snapshot(
        now_s=120.0, capacity_tokens=capacity, max_batch=max_batch,
        latency_s=np.concatenate([[np.nan], 0.15 + 0.001 * np.arange(1, max_batch + 1)]), lookahead_s=60.0,
        running=running, need_tokens=context + 1, arrival_s=arrival, queued_s=arrival,
        served_iterations=rng.integers(0, 100, requests), delay_if_served_s=np.where(running, 0.0, 0.3),
        expected_ttft_s=np.full(requests, 1.0), expected_tds=draw_expected_tds("reading", rng, requests),
        delivered=delivered, digested=digested, digested_area=digested * rng.uniform(1, 20, requests),
        ever_run=delivered > 0, preemptions_total=int(requests * 0.2), admitted_total=requests,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="snapshots timed per scheduler and size")
    args = parser.parse_args()
    settings = SchedulerSettings()
    results = []
    for requests in (100, 500, 2000):
        shots = [loaded_snapshot(requests, seed) for seed in range(args.repeats)]
        for name, decide in SCHEDULERS.items():
            if name == "andes-dp" and requests > 100:
                continue
            times_ms, solved = [], 0
            for shot in shots[: 5 if name == "andes-dp" else None]:
                started = time.perf_counter()
                decision = decide(shot, settings)
                times_ms.append((time.perf_counter() - started) * 1e3)
                solved += decision.solved
            results.append({
                "scheduler": name, "requests_in_flight": requests, "decisions": len(times_ms),
                "median_ms": round(float(np.median(times_ms)), 3),
                "p90_ms": round(float(np.percentile(times_ms, 90)), 3),
                "max_ms": round(max(times_ms), 3), "solved": solved,
            })  # fmt: skip
            print(results[-1])
    path = write("andes_scheduler", {"command": " ".join(["python", "bench/andes_scheduler.py", *sys.argv[1:]]),
                                     "results": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
