"""Do DiSCo's live runs on the emulated testbed agree with the trace-driven replay? For every run of a
finished `disco` campaign, replay its very requests: the same prompt lengths and output limits, the
routes its plan gave them (recorded per request), and the server times its trace endpoint drew from
each request's seed; then compare mean and P99 TTFT, the realised budget and who answered first.
What differs is what the live run adds: HTTP, the shaped data plane, scheduling on the nodes.

    python bench/disco_campaign_check.py results/disco-budget
    python bench/disco_campaign_check.py results/disco-budget --name disco_budget_check

Writes bench/results/<name>.json. Target (issue 23): within 15%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.cost_model import dispatch_regime
from bench._common import write
from nodes.dispatch.replay import draw_seeded, replay
from nodes.endpoints.device_speed import device_speed_named
from nodes.endpoints.services import service_named

CONSUMPTION_TOK_S = 4.8


class RecordedRoutes:
    """A plan that gives each request the route the live run's plan gave it."""

    def __init__(self, server_s: np.ndarray, device_s: np.ndarray) -> None:
        self.server_s, self.device_s = server_s, device_s

    def starts(self, prompt_tokens: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.server_s, self.device_s


def check_run(run: Path) -> dict | None:
    manifest = json.loads((run / "manifest.json").read_text())
    settings = manifest.get("settings", {})
    if manifest.get("status") != "done" or settings.get("method") != "disco":
        return None
    dispatch = settings.get("dispatch") or {}
    if dispatch.get("external") or dispatch.get("server_endpoint", "trace") != "trace":
        return None  # only a trace endpoint's draws can be replayed
    requests = pd.read_parquet(run / "requests.parquet")
    requests = requests[requests["ttft_s"].notna()]
    prompts = requests["prompt_tokens"].to_numpy()
    seeds = requests["dispatch_seed"].astype("int64").to_numpy()
    routes = RecordedRoutes(requests["dispatch_route_server_s"].astype(float).fillna(np.inf).to_numpy(),
                            requests["dispatch_route_device_s"].astype(float).fillna(np.inf).to_numpy())  # fmt: skip
    service = service_named(dispatch.get("service", "gpt"))
    device = device_speed_named(dispatch.get("device_speed", "pixel7pro-bloom-1.1b"))
    inputs = draw_seeded(service, prompts, requests["max_new_tokens"].to_numpy(), seeds, np.zeros(len(prompts)))
    replayed = replay(routes, inputs, device, CONSUMPTION_TOK_S)  # type: ignore[arg-type]
    regime = dispatch_regime(dispatch.get("policy", "disco-s"), dispatch.get("regime"))
    constrained = "server_input_tokens" if regime == "server" else "device_prefill_tokens"
    live_budget = float(requests[f"dispatch_race_{constrained}"].sum() / prompts.sum())
    row = {
        "run_id": run.name, "policy": dispatch.get("policy"), "budget": dispatch.get("budget"),
        "service": service.name, "device": device.name, "requests": len(requests),
        "live_mean_ttft_s": float(requests["ttft_s"].mean()), "replay_mean_ttft_s": float(replayed.ttft_s.mean()),
        "live_p99_ttft_s": float(requests["ttft_s"].quantile(0.99)),
        "replay_p99_ttft_s": float(np.percentile(replayed.ttft_s, 99)),
        "live_realised_budget": live_budget, "replay_realised_budget": replayed.realised_budget(regime),
        "live_device_first": float((requests["dispatch_winner"] == "device").mean()),
        "replay_device_first": float(replayed.winner_device.mean()),
    }  # fmt: skip
    row["mean_ttft_gap_pct"] = 100 * (row["live_mean_ttft_s"] / row["replay_mean_ttft_s"] - 1)
    row["p99_ttft_gap_pct"] = 100 * (row["live_p99_ttft_s"] / row["replay_p99_ttft_s"] - 1)
    budget = row["replay_realised_budget"]
    row["budget_gap_pct"] = 100 * (live_budget / budget - 1) if budget > 0 else (0.0 if live_budget == 0 else np.inf)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("campaign", type=Path, help="a finished campaign's output directory")
    parser.add_argument("--name", default="disco_campaign_check", help="result file name under bench/results/")
    args = parser.parse_args()
    rows = [r for run in sorted((args.campaign / "runs").iterdir()) if (r := check_run(run)) is not None]
    if not rows:
        raise SystemExit(f"{args.campaign}: no finished disco run with a trace endpoint")
    frame = pd.DataFrame(rows)
    print(frame.drop(columns=["run_id"]).round(3).to_string(index=False))
    within = bool((frame[["mean_ttft_gap_pct", "budget_gap_pct"]].abs() <= 15).all().all())
    print(f"mean TTFT and realised budget within 15% of the replay in every run: {within}")
    path = write(args.name, {"command": " ".join(["python", "bench/disco_campaign_check.py", *sys.argv[1:]]),
                             "runs": rows, "all_within_15_pct": within, "modeled_times": True})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
