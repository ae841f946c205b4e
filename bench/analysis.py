"""Analysis speed: every metric of analysis.metrics over a synthetic campaign with 1M token rows.

The campaign has 40 runs x 2 devices x 50 requests x 250 tokens (1,000,000 token rows), Andes
expectations on every request, and 10 Hz power telemetry of three nodes. Timed: reading the token
table from parquet, then all metrics together (latencies, TBT gaps, the per-method table, SLA
compliance, QoE of every request, throughput, node power and energy, per-request energy, cost).
For scale, the vectorised QoE is compared with calling the scalar ``qoe()`` per request on a
subset of 1000 requests (a ratio from one run).

Writes bench/results/analysis.json. Target: all metrics in under 3 s (median of 5).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis import metrics
from analysis.cost_model import ModelShape
from bench._common import summary, write

TARGET_S = 3.0
RUNS, DEVICES, REQUESTS, TOKENS = 40, 2, 50, 250
SHAPE = ModelShape(8, 256, 8, 704, 4096, n_kv_heads=4, ffn_matrices=3)


def synthetic_campaign(seed: int = 1) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    n_req = RUNS * DEVICES * REQUESTS
    run = np.repeat(np.arange(RUNS), DEVICES * REQUESTS)
    node = np.tile(np.repeat(np.arange(DEVICES), REQUESTS), RUNS)
    arrival = np.tile(np.arange(REQUESTS) * 6.0, RUNS * DEVICES) + rng.uniform(0, 1, n_req)
    ttft = rng.gamma(4.0, 0.1, n_req)
    gaps = rng.gamma(8.0, 0.005, (n_req, TOKENS))
    gaps[:, 0] = 0.0
    times = arrival[:, None] + ttft[:, None] + np.cumsum(gaps, axis=1)
    run_ids = np.array([f"r{i:03d}" for i in range(RUNS)])
    nodes = np.array(["orin", "xavier"])
    requests = pd.DataFrame({
        "run_id": run_ids[run], "node": nodes[node], "request_id": node * 1_000_000 + np.tile(np.arange(REQUESTS),
                                                                                              RUNS * DEVICES),
        "arrival_s": arrival, "first_token_s": times[:, 0], "last_token_s": times[:, -1],
        "prompt_tokens": rng.integers(64, 512, n_req), "output_tokens": TOKENS, "decode_steps": TOKENS - 1,
        "expected_ttft_s": 1.0, "expected_tds_tok_s": 4.8, "completed": True,
    })  # fmt: skip
    origin = 1.8e9 + run * 1000.0
    for column in ("arrival", "first_token", "last_token"):
        requests[f"{column}_ts_s"] = origin + requests[f"{column}_s"]
    tokens = pd.DataFrame({
        "run_id": np.repeat(requests["run_id"].to_numpy(), TOKENS), "node": np.repeat(requests["node"].to_numpy(),
                                                                                      TOKENS),
        "request_id": np.repeat(requests["request_id"].to_numpy(), TOKENS),
        "index": np.tile(np.arange(TOKENS), n_req), "ts_s": times.ravel(),
    })  # fmt: skip
    span = REQUESTS * 6.0 + 10
    ts = np.arange(0, span, 0.1)
    frames = []
    for i, run_id in enumerate(run_ids):
        for name, metric in (("orin", "board_power_mw"), ("xavier", "board_power_mw"), ("server", "power_mw")):
            frames.append(pd.DataFrame({"run_id": run_id, "node": name, "metric": metric, "kind": "modeled",
                                        "ts_s": 1.8e9 + i * 1000.0 + ts, "value": rng.uniform(5e3, 3e4, len(ts)),
                                        "sensor": "model"}))  # fmt: skip
    telemetry = pd.concat(frames, ignore_index=True)
    runs = pd.DataFrame({"run_id": run_ids, "method": np.where(np.arange(RUNS) % 2, "ushape", "centralized"),
                         "partition.device_layers": 2, "state": "done"})  # fmt: skip
    return runs, requests, tokens, telemetry


def all_metrics(runs: pd.DataFrame, requests: pd.DataFrame, tokens: pd.DataFrame, telemetry: pd.DataFrame) -> dict:
    latencies = metrics.request_latencies(requests)
    gaps = metrics.token_gaps_s(tokens)
    table = metrics.latency_table(requests, tokens, runs, by=("method",), gaps=gaps)
    compliance = metrics.sla_compliance(latencies["prefill_delay_per_128_s"], np.linspace(0, 1, 50))
    qoe = metrics.qoe_table(requests, tokens)
    rate = metrics.throughput(requests)
    power = metrics.node_power(telemetry)
    energy = metrics.request_energy(requests, power)
    nodes = metrics.node_energy(power)
    cost = metrics.request_cost(requests, runs, SHAPE, api="gpt-4o-mini", device_usd_per_pflop=0.3)
    return {"gaps": len(gaps), "table": len(table), "compliance": float(compliance[-1]), "qoe": len(qoe),
            "qoe_mean": float(qoe["qoe"].mean()), "rate": len(rate), "energy": len(energy), "nodes": len(nodes),
            "cost": len(cost)}  # fmt: skip


def main() -> None:
    runs, requests, tokens, telemetry = synthetic_campaign()
    assert len(tokens) == 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.parquet"
        tokens.to_parquet(path, index=False)
        read_s = []
        for _ in range(3):
            t0 = time.perf_counter()
            pd.read_parquet(path)
            read_s.append(time.perf_counter() - t0)
    all_s, counts = [], {}
    for _ in range(5):
        t0 = time.perf_counter()
        counts = all_metrics(runs, requests, tokens, telemetry)
        all_s.append(time.perf_counter() - t0)
    # the vectorised QoE against the scalar definition called per request, on 1000 requests
    subset = requests.head(1000)
    sub_tokens = tokens.merge(subset[metrics.REQUEST_KEY], on=metrics.REQUEST_KEY)
    t0 = time.perf_counter()
    vector = metrics.qoe_table(subset, sub_tokens)
    vector_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    scalar = [metrics.qoe(g["ts_s"].to_numpy() - a, 1.0, 4.8) for (a, (_, g)) in
              zip(subset["arrival_s"], sub_tokens.groupby(metrics.REQUEST_KEY, sort=False), strict=True)]  # fmt: skip
    scalar_s = time.perf_counter() - t0
    agree = float(np.max(np.abs(np.sort(vector["qoe"].to_numpy()) - np.sort(np.asarray(scalar)))))
    result = {
        "token_rows": len(tokens), "requests": len(requests), "telemetry_rows": len(telemetry),
        "read_tokens_parquet_s": summary(read_s), "all_metrics_s": summary(all_s), "target_s": TARGET_S,
        "within_target": summary(all_s)["median"] < TARGET_S, "counts": counts,
        "qoe_vector_vs_scalar_1000_requests": {"vector_s": vector_s, "scalar_s": scalar_s,
                                              "speedup": scalar_s / vector_s, "max_abs_difference": agree},
    }  # fmt: skip
    path = write("analysis", result)
    print(f"all metrics on {len(tokens):,} token rows: median {summary(all_s)['median']:.2f} s "
          f"(target {TARGET_S} s); parquet read {summary(read_s)['median']:.2f} s; "
          f"QoE vectorised {scalar_s / vector_s:.0f}x the per-request loop; {path}")  # fmt: skip


if __name__ == "__main__":
    main()
