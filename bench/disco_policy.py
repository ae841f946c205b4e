"""How long DiSCo's dispatch policy takes to compute from its profiles (DiSCo Fig. 9: 1K, 10K and 100K
samples; on an M1, DiSCo-S 0.128 / 0.969 / 9.082 ms and DiSCo-D 0.486 / 1.741 / 14.856 ms).

A computation is what a device does when its profiles change: build p(l) from N prompt-length samples
(Alpaca-like, lognormal around 40 tokens) and, for DiSCo-D, F from N server-TTFT samples (lognormal,
median 0.4 s, GPT-4o-mini-like), then solve Algorithm 3 (DiSCo-S: the length threshold) or Algorithm
2 (DiSCo-D: the wait map, alpha = 0.01) for a budget of 0.5. Targets on this machine: <= 20 ms (S) and
<= 30 ms (D) at 100K samples.

    python bench/disco_policy.py
    python bench/disco_policy.py --repeats 50

Writes bench/results/disco_policy.json: per policy and sample count, the median, p90 and mean time in
ms, the mean with its 95% interval over the timed computations (``analysis.uncertainty``), and every
time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.uncertainty import mean_interval
from bench._common import write
from nodes.dispatch.policy import LengthDistribution, ServerTtft, length_threshold, wait_map

SAMPLES = (1_000, 10_000, 100_000)


def server_constrained(lengths: np.ndarray, ttft_s: np.ndarray, budget: float) -> None:
    length_threshold(LengthDistribution.from_samples(lengths), budget)


def device_constrained(lengths: np.ndarray, ttft_s: np.ndarray, budget: float) -> None:
    wait_map(LengthDistribution.from_samples(lengths), ServerTtft.from_samples(ttft_s), budget, alpha=0.01)


POLICIES = {"disco-s": server_constrained, "disco-d": device_constrained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed computations per policy and size")
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()
    rng = np.random.default_rng(9)
    rows = []
    for count in SAMPLES:
        lengths = np.maximum(1, rng.lognormal(np.log(40), 0.8, count)).astype("int64")
        ttft_s = rng.lognormal(np.log(0.4), 0.7, count)
        for name, policy in POLICIES.items():
            policy(lengths, ttft_s, args.budget)  # warm up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                policy(lengths, ttft_s, args.budget)
                times.append(time.perf_counter() - start)
            ms = np.array(times) * 1e3
            rows.append({"policy": name, "samples": count, "median_ms": round(float(np.median(ms)), 3),
                         "p90_ms": round(float(np.percentile(ms, 90)), 3),
                         "mean_ms": mean_interval(ms).as_dict(), "times_ms": ms.round(4).tolist()})  # fmt: skip
            print({k: v for k, v in rows[-1].items() if k != "times_ms"}, flush=True)
    command = " ".join(["python", "bench/disco_policy.py", *sys.argv[1:]])
    path = write("disco_policy", {"command": command, "budget": args.budget, "results": rows,
                                  "targets_ms_at_100k": {"disco-s": 20.0, "disco-d": 30.0}})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
