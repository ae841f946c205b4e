"""CoCoServe Fig. 8 and Fig. 11 on real ranks of this host: one Llama-2-13B instance on four paced
A100-40GB GPU ranks under Poisson load, static batching (the HF Transformers baseline) against our
continuous batching without scaling and CoCoServe, each GPU's budget its 40 GB (the target's bytes).

The tiny model computes every token; each layer copy's step is paced to the A100 for the five
Llama-2-13B layers a tiny layer stands for, and time is dilated (the emulated GPUs run ``dilation``
times slower than the A100s, so that two cores keep up; the figures are divided back). Requests are
Alpaca-like (prompts about 19 tokens, outputs about 58, at most 256), every request making its drawn
length. Per method and rate: output tokens/s and requests/s, E2E latency, SLO attainment (the
engine's: 5x the request's time alone), OOM rate, peak GPU memory, the controller's actions and the
paced steps' overruns; then the targets' ratios: throughput against static at each rate, the OOM
rates at the highest rate, and the SLO knees.

    python bench/cocoserve_load.py                                   # 3 methods x 4 rates
    python bench/cocoserve_load.py --methods static-batching,cocoserve --rates 8,32 --requests 60
    python bench/cocoserve_load.py --methods cocoserve --rates 1 --step-rates 4,40,4 --phase-s 20 \
        --requests 1200 --out cocoserve_steps          # the step trace: the controller's actions in order

Writes bench/results/cocoserve_load.json. This is the campaign examples/campaigns/cocoserve-load.yaml
without the emulated lab (no namespaces, no telemetry), to sweep quickly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = REPO / "examples" / "models" / "tiny"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def run_one(method: str, rate: float, args: argparse.Namespace, work: Path) -> dict:
    import pandas as pd

    from analysis import gpu_serving
    from nodes.contracts.target_model import builtin
    from testbed.campaign.plan import dilated_schedule
    from testbed.campaign.results import read_requests, read_scaling, read_steps
    from testbed.campaign.scaling_config import target_bytes
    from testbed.compute_profiles import load_profile
    from workloads.schedule import WorkloadSpec, build_schedules

    target = builtin("llama-2-13b")
    profile = load_profile(REPO / "examples" / "profiles" / "a100-40gb.yaml")
    clients = [f"client{c}" for c in range(args.clients)]
    spec = WorkloadSpec(arrival="poisson", rate_per_s=rate / args.clients,
                        requests_per_device=args.requests // args.clients, prompts="alpaca", output_lengths="alpaca",
                        max_new_tokens=256)  # fmt: skip
    schedules = build_schedules(spec, clients, seed=args.seed, model_dir=TINY)
    if args.step_rates:  # the step trace: Poisson phases of these rates, the clients' rows retimed in turn
        schedules = stepped(schedules, [float(r) for r in args.step_rates.split(",")], args.phase_s, args.seed)
    run_dir = work / f"{method}-{rate:g}"
    run_dir.mkdir(parents=True)
    paths = []
    for client in clients:
        path = run_dir / f"{client}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in dilated_schedule(schedules[client], args.dilation)))
        paths.append(path)
    scaling = dict(target_bytes(target, 8), gpu_memory_bytes=int(args.budget_gb * 1e9),
                   gpu_link_gbps=profile.spec.host_link_gbps)  # fmt: skip
    config = {
        "run_id": f"{method}-{rate:g}", "method": method, "model": str(TINY),
        "partition": {"device_layers": 0, "stages": args.gpus}, "out_dir": str(run_dir / "out"),
        "target": {"model": target.to_json(), "dilation": args.dilation, "pad_payloads": False},
        "serving": {"max_batch": args.max_batch, "ignore_eos": True}, "scaling": scaling,
        "ranks": [{"role": "stage", "node": "server", "profile": profile.rates().to_json()} for _ in range(args.gpus)]
        + [{"role": "device", "node": c, "schedule": str(p)} for c, p in zip(clients, paths, strict=True)],
    }  # fmt: skip
    (run_dir / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    began = time.monotonic()
    done = subprocess.run([str(MPIEXEC), "-n", str(args.gpus + args.clients), sys.executable, "-m", "nodes.workers",
                           str(run_dir / "config.json")], env=env, capture_output=True, text=True, timeout=3600,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{method} at {rate}: the run failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    ranks = run_dir / "out"
    requests = read_requests(ranks).drop(columns=["method"]).assign(run_id="r", completed=True)
    for column in ("arrival_s", "last_token_s", "serving_slo_s"):  # the target's seconds
        requests[column] = requests[column] / args.dilation
    ops, ticks = read_scaling(ranks)
    table = gpu_serving.gpu_serving_table(requests, pd.DataFrame({"run_id": ["r"], "method": [method]}),
                                          ticks.assign(run_id="r"), ["method"])  # fmt: skip
    steps = read_steps(ranks)
    row = table.iloc[0].to_dict()
    actions = ops[["time_s", "kind", "layer", "destination", "batch_size"]].to_dict("records") if len(ops) else []
    row.update(rate_per_s=rate, wall_s=round(time.monotonic() - began, 1), actions=actions, paced_steps=len(steps),
               overrun_share=float(steps["overrun"].mean()) if len(steps) else None)  # fmt: skip
    print(json.dumps({k: v for k, v in row.items() if k != "actions"}, default=float), flush=True)
    return row


def stepped(schedules: dict, rates: list, phase_s: float, seed: int) -> dict:
    """The clients' requests retimed as Poisson arrivals whose rate (in all) steps through ``rates``,
    ``phase_s`` each (the target's seconds), dealt to the clients in turn; requests left over are
    dropped, and a phase runs out of requests if there are too few."""
    import numpy as np

    rng = np.random.default_rng(seed)
    times, start = [], 0.0
    for rate in rates:
        t = start + rng.exponential(1.0 / rate)
        while t < start + phase_s:
            times.append(t)
            t += rng.exponential(1.0 / rate)
        start += phase_s
    clients = sorted(schedules)
    pools = {c: list(schedules[c]) for c in clients}
    out: dict = {c: [] for c in clients}
    for k, t in enumerate(times):
        client = clients[k % len(clients)]
        if pools[client]:
            out[client].append(dict(pools[client].pop(0), arrival_s=t))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="static-batching,continuous-batching,cocoserve")
    parser.add_argument("--rates", default="8,16,32,48", help="requests/s in all, the target's")
    parser.add_argument("--requests", type=int, default=120, help="a run's requests, over every client")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32, help="static batching's batch; continuous' cap")
    parser.add_argument("--budget-gb", type=float, default=40.0, help="each GPU's memory")
    parser.add_argument("--dilation", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--out", default="cocoserve_load")
    parser.add_argument("--step-rates", help="a step trace instead: these rates (in all) in turn, e.g. 4,40,4")
    parser.add_argument("--phase-s", type=float, default=20.0, help="each step's length, the target's seconds")
    parser.add_argument("--keep", help="keep the runs' directories here (else a temporary one)")
    args = parser.parse_args()
    from bench._common import RESULTS, machine

    rows = []
    with tempfile.TemporaryDirectory(prefix="cocoserve-load-") as temporary:
        work = Path(args.keep or temporary)
        for rate in [float(r) for r in args.rates.split(",")]:
            for method in args.methods.split(","):
                rows.append(run_one(method, rate, args, work))
    by = {(r["method"], r["rate_per_s"]): r for r in rows}
    rates = sorted({r["rate_per_s"] for r in rows})
    ratios = {}
    for rate in rates:
        static = by.get(("static-batching", rate))
        for method in ("continuous-batching", "cocoserve"):
            if static and (method, rate) in by and static["output_tokens_per_s"]:
                ratios[f"{method} / static throughput at {rate:g}/s"] = (
                    by[(method, rate)]["output_tokens_per_s"] / static["output_tokens_per_s"])
    knees = {}
    for method in args.methods.split(","):
        held = [r["rate_per_s"] for r in rows if r["method"] == method and r["slo_attainment"] >= 0.9]
        knees[method] = max(held) if held else None
    result = {"machine": machine(), "settings": vars(args), "runs": rows, "throughput_ratios": ratios,
              "slo_knees_per_s": knees,
              "oom_rates_at_highest_rate": {m: by[(m, rates[-1])]["oom_rate"] for m in args.methods.split(",")
                                            if (m, rates[-1]) in by}}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps({k: result[k] for k in ("throughput_ratios", "slo_knees_per_s", "oom_rates_at_highest_rate")},
                     indent=1, default=float))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
