"""Target emulation on the emulated testbed: does dilation change what is measured, and does it buy
fidelity? One campaign (HAT's methods on the default lab's AGX Orin and AGX Xavier, 4 RTX A6000
stages, Vicuna-7B as the target, HAT's mid-distance WiFi trace at its real rates), every run at
dilation 1 and at dilation k, the same requests (one workload seed per repetition).

Reported, per dilation: each run's worst node's share of paced steps that overran their target (the
fidelity violations), and per method the TTFT and mean time between tokens (divided back by the
dilation, as analysis does); then k against 1 request by request: the same tokens, the median
relative differences of TTFT and TBT. And HAT Table 5's ratios on this campaign: each method's change
of mean TTFT and TBT against U-shape, next to the paper's.

    python bench/target_emulation.py                     # ushape, pc, sd, hat; dilation 1 and 3
    python bench/target_emulation.py --dilation 4 --methods ushape,hat --repetitions 2
    python bench/target_emulation.py --device-slots 1      # a device's requests wait for the one before
    python bench/target_emulation.py --methods ushape,pc --base-dilation 3 --dilation 6

Writes bench/results/target_emulation.json (target_emulation_dilations.json with --base-dilation).
Needs root; brings the repository's inventory.yaml up if it is not (and down again after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd

from bench._common import write
from bench.campaign import INVENTORY, REPO, testbed

PAPER_TABLE5_SPECBENCH = {  # HAT Table 5, SpecBench, Vicuna-7B: change against U-shape
    "pc": {"ttft": -0.414}, "sd": {"tbt": -0.268}, "sd_pc": {"tbt": -0.415}, "hat": {"ttft": -0.414, "tbt": -0.495},
}  # fmt: skip


def campaign_file(
    directory: Path, methods: list[str], dilations: list[float], repetitions: int, device_slots: int = 1
) -> Path:
    from nodes.contracts.methods import method_named

    path = directory / "target-emulation.yaml"
    # chunk and draft settings only where a method of the matrix reads them (unused ones are refused)
    used = [method_named(m) for m in methods]
    chunks = "  chunk_tokens: 128\n" if any(m.prefill in ("device_chunks", "server_chunks") for m in used) else ""
    draft = "  draft: {eta: 0.6, max_draft_tokens: 8, top_k: 3}\n" if any(m.drafts for m in used) else ""
    path.write_text(f"""name: target-emulation
inventory: {INVENTORY}
base:
  method: ushape
  model: {REPO / "examples" / "models" / "tiny"}
  partition: {{device_layers: 2, stages: 4}}
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 0.2, requests_per_device: 5, prompts: specbench, max_new_tokens: 48}}
  link: {{trace: {REPO / "examples" / "traces" / "hat-mid.csv"}}}
{chunks}{draft}  power: {{orin: MAXN, xavier: MAXN}}
  target: {{model: vicuna-7b, dilation: 1}}
  telemetry: {{interval_ms: 200}}
  device_slots: {device_slots}
matrix:
  method: {json.dumps(methods)}
  target.dilation: {json.dumps(dilations)}
repetitions: {repetitions}
seed: 5
order: listed
run_timeout_s: 900
""")
    return path


def figures(out: Path) -> dict[str, Any]:
    from analysis.load import load

    data = load(out)
    runs = data.runs.set_index("run_id")
    requests = data.requests[data.requests["completed"]].copy()
    tokens = data.tokens.sort_values(["run_id", "node", "request_id", "index"])
    gaps = tokens.groupby(["run_id", "node", "request_id"])["ts_s"].diff().dropna()
    gap_means = gaps.groupby([tokens.loc[gaps.index, c] for c in ("run_id", "node", "request_id")]).mean()
    requests = requests.set_index(["run_id", "node", "request_id"])
    requests["tbt_s"] = gap_means
    requests = requests.reset_index()
    requests["method"] = requests["run_id"].map(runs["method"])
    requests["dilation"] = requests["run_id"].map(runs["target.dilation"])
    per_run = []
    for run_id, row in runs.iterrows():
        manifest = json.loads((out / "runs" / str(run_id) / "manifest.json").read_text())
        shares = {n: f["violation_share"] for n, f in (manifest.get("fidelity") or {}).items()}
        per_run.append({"run_id": run_id, "method": row["method"], "dilation": row["target.dilation"],
                        "state": row["state"], "reason": row["reason"], "violation_share": shares,
                        "worst_violation_share": max(shares.values()) if shares else None})  # fmt: skip
    requests["device_wait_s"] = requests["start_s"] - requests["arrival_s"]  # waiting for a free device slot
    by = requests.groupby(["dilation", "method"]).agg(ttft_ms=("ttft_s", "mean"), tbt_ms=("tbt_s", "mean"),
                                                       device_wait_ms=("device_wait_s", "mean"),
                                                       requests=("ttft_s", "size"))  # fmt: skip
    by[["ttft_ms", "tbt_ms", "device_wait_ms"]] *= 1e3
    table5 = {}
    for dilation, part in by.groupby(level=0):
        base = part.loc[(dilation, "ushape")] if (dilation, "ushape") in part.index else None
        table5[str(dilation)] = {
            method: {"ttft_change": round(float(r.ttft_ms / base.ttft_ms - 1), 4),
                     "tbt_change": round(float(r.tbt_ms / base.tbt_ms - 1), 4),
                     "paper": PAPER_TABLE5_SPECBENCH.get(method)}
            for (_, method), r in part.iterrows() if base is not None and method != "ushape"
        }  # fmt: skip
    paired = {}
    dilations = sorted(requests["dilation"].unique())
    keyed = requests.set_index(["method", "node", "request_id", "dilation"])
    for k in dilations[1:]:
        one = keyed.xs(dilations[0], level="dilation")
        other = keyed.xs(k, level="dilation")
        both = one.join(other, lsuffix="_1", rsuffix="_k", how="inner")
        same = sum(list(a) == list(b) for a, b in zip(both.token_ids_1, both.token_ids_k, strict=True))
        paired[str(k)] = {
            "matched": len(both), "same_tokens": same,
            **{f"{m}_median_relative_difference": round(float(((both[f"{m}_k"] - both[f"{m}_1"]) / both[f"{m}_1"])
                                                              .median()), 4) for m in ("ttft_s", "tbt_s")},
        }  # fmt: skip
    acceptance = requests.groupby("method")["speculative_acceptance_length"].mean().dropna() \
        if "speculative_acceptance_length" in requests else pd.Series(dtype=float)  # fmt: skip
    return {
        "per_run": per_run,
        "by_dilation_and_method": [{"dilation": d, "method": m, **{c: round(float(v), 2) for c, v in r.items()}}
                                   for (d, m), r in by.iterrows()],
        "table5_changes_against_ushape": table5,
        "dilation_k_against_base": paired,
        "acceptance_length": {m: round(float(v), 3) for m, v in acceptance.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ushape,pc,sd,hat")
    parser.add_argument("--dilation", type=float, default=3.0, help="the dilation compared with --base-dilation")
    parser.add_argument("--base-dilation", type=float, default=1.0, help="the dilation it is compared with (raise "
                        "it to compare two dilations this machine keeps up with)")  # fmt: skip
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--device-slots", type=int, default=4, help="requests a device serves at once (HAT's "
                        "lab: every arrival at once; 1 makes a device's requests wait for the one before)")  # fmt: skip
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    from testbed.emulation.lifecycle import down, status, up
    from testbed.inventory import load_inventory

    lab = load_inventory(INVENTORY)
    was_up = status(lab).running
    if not was_up and not up(lab, say=lambda _: None).ok:
        raise SystemExit("could not bring the emulated testbed up")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-target-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"campaign in {work}", file=sys.stderr)
    try:
        campaign = campaign_file(work, args.methods.split(","), [args.base_dilation, args.dilation], args.repetitions,
                                 args.device_slots)  # fmt: skip
        started = time.monotonic()
        status_code = testbed("run", str(campaign), "--out", str(work / "out"), log=work / "run.log").wait()
        wall = time.monotonic() - started
        result = {"command": " ".join(["python", "bench/target_emulation.py", *sys.argv[1:]]),
                  "exit_status": status_code, "campaign_wall_s": round(wall, 1), **figures(work / "out")}  # fmt: skip
    finally:
        if not was_up:
            down(load_inventory(INVENTORY), say=lambda _: None)
    result["base_dilation"] = args.base_dilation
    # a comparison of two dilations other than 1 goes to a file of its own, beside the main one
    path = write("target_emulation" if args.base_dilation == 1.0 else "target_emulation_dilations", result)
    print(json.dumps({k: result[k] for k in ("table5_changes_against_ushape", "dilation_k_against_base",
                                             "acceptance_length")}, indent=1))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
