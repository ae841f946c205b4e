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
        --requests 960 --out cocoserve_steps           # the step trace: the controller's actions in order
    python bench/cocoserve_load.py --fleets static-batching:2x1,static-batching:4x1,cocoserve:2x2 \
        --rates 8,48 --requests 160 --out cocoserve_fleets   # Fig. 10: instances of N GPUs each

Writes bench/results/cocoserve_load.json. This is the campaign examples/campaigns/cocoserve-load.yaml
without the emulated lab (no namespaces, no telemetry), to sweep quickly.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def run_instance(method: str, rate: float, gpus: int, clients: list[str], per_client: int, args: argparse.Namespace,
                 run_dir: Path) -> dict:  # fmt: skip
    """One instance on ``gpus`` GPU ranks serving ``clients`` (``rate`` requests/s over them all,
    ``per_client`` requests each): its requests (the target's seconds), monitor ticks, module
    operations and paced steps."""
    from nodes.contracts.target_model import builtin
    from testbed.campaign.families.cocoserve import target_bytes
    from testbed.campaign.results import read_requests, read_scaling, read_steps
    from testbed.campaign.run_spec import dilated_schedule
    from testbed.target.compute_profiles import load_profile
    from workloads.schedule import WorkloadSpec, build_schedules

    target = builtin("llama-2-13b")
    profile = load_profile(REPO / "examples" / "profiles" / "a100-40gb.yaml")
    spec = WorkloadSpec(arrival="poisson", rate_per_s=rate / len(clients),
                        requests_per_device=per_client, prompts="alpaca", output_lengths="alpaca",
                        max_new_tokens=256)  # fmt: skip
    if args.step_rates:  # the step trace: each client's share of these rates (in all) in turn
        steps = [[float(r) / len(clients), args.phase_s] for r in args.step_rates.split(",")]
        spec = dataclasses.replace(spec, arrival="steps", rate_per_s=None, rate_steps=steps)
    schedules = build_schedules(spec, clients, seed=args.seed, model_dir=TINY)
    run_dir.mkdir(parents=True)
    paths = []
    for client in clients:
        path = run_dir / f"{client}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in dilated_schedule(schedules[client], args.dilation)))
        paths.append(path)
    scaling = dict(target_bytes(target, 8), gpu_memory_bytes=int(args.budget_gb * 1e9),
                   gpu_link_gbps=profile.spec.host_link_gbps, max_migrations=args.max_migrations,
                   cooldown_s=args.cooldown_s)  # fmt: skip
    config = {
        "run_id": run_dir.name, "method": method, "model": str(TINY),
        "partition": {"device_layers": 0, "stages": gpus}, "out_dir": str(run_dir / "out"),
        "target": {"model": target.to_json(), "dilation": args.dilation, "pad_payloads": False},
        "serving": {"max_batch": args.max_batch, "ignore_eos": True}, "scaling": scaling,
        "ranks": [{"role": "stage", "node": "server", "profile": profile.rates().to_json()} for _ in range(gpus)]
        + [{"role": "device", "node": c, "schedule": str(p)} for c, p in zip(clients, paths, strict=True)],
    }  # fmt: skip
    (run_dir / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([str(MPIEXEC), "-n", str(gpus + len(clients)), sys.executable, "-m", "nodes.workers",
                           str(run_dir / "config.json")], env=env, capture_output=True, text=True, timeout=3600,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name}: the run failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    ranks = run_dir / "out"
    requests = read_requests(ranks).drop(columns=["method"])
    for column in ("arrival_s", "last_token_s", "serving_slo_s"):  # the target's seconds
        requests[column] = requests[column] / args.dilation
    ops, ticks = read_scaling(ranks)
    return {"requests": requests, "ticks": ticks, "ops": ops, "steps": read_steps(ranks)}


def run_one(method: str, rate: float, args: argparse.Namespace, work: Path, instances: int = 1,
            gpus: int | None = None) -> dict:  # fmt: skip
    """``instances`` alike instances of ``method`` on ``gpus`` GPUs each, behind a dispatcher that deals
    the clients out (each instance its own clients' Poisson streams, ``rate`` requests/s in all). The
    instances share nothing else, so they run one after another on this host (two cores cannot pace
    several at once) on one clock: their requests are pooled (throughput over the fleet's span), their
    GPUs' peak memory summed."""
    import pandas as pd

    from analysis import gpu_serving

    gpus = gpus or args.gpus
    began = time.monotonic()
    name = f"{method}-{rate:g}" + (f"-{instances}x{gpus}" if instances > 1 else "")
    clients = [f"client{c}" for c in range(args.clients * instances)]
    per_client = args.requests // len(clients)  # the fleet serves --requests in all
    parts = [run_instance(method, rate / instances, gpus, clients[i * args.clients:(i + 1) * args.clients],
                          per_client, args, work / f"{name}-i{i}") for i in range(instances)]  # fmt: skip
    requests = pd.concat([p["requests"] for p in parts], ignore_index=True).assign(run_id="r", completed=True)
    ticks = pd.concat([p["ticks"].assign(run_id=f"i{i}") for i, p in enumerate(parts)], ignore_index=True)
    table = gpu_serving.gpu_serving_table(requests, pd.DataFrame({"run_id": ["r"], "method": [method]}),
                                          ticks.iloc[0:0].assign(run_id="r"), ["method"])  # fmt: skip
    row = table.iloc[0].to_dict()
    held = gpu_serving.peak_memory(ticks)  # per instance: the fleet holds their sum
    row.update(peak_memory_gb=float(held["peak_bytes"].sum()) / 1e9, gpus_used=float(held["gpus_used"].sum()),
               instances=instances, gpus_per_instance=gpus)  # fmt: skip
    ops = pd.concat([p["ops"].assign(instance=i) for i, p in enumerate(parts)], ignore_index=True)
    steps = pd.concat([p["steps"] for p in parts], ignore_index=True)
    columns = ["time_s", "kind", "layer", "destination", "batch_size"] + (["instance"] if instances > 1 else [])
    actions = ops[columns].to_dict("records") if len(ops) else []
    row.update(rate_per_s=rate, wall_s=round(time.monotonic() - began, 1), actions=actions, paced_steps=len(steps),
               overrun_share=float(steps["overrun"].mean()) if len(steps) else None)  # fmt: skip
    print(json.dumps({k: v for k, v in row.items() if k != "actions"}, default=float), flush=True)
    return row


def write_fleets(rows: list, args: argparse.Namespace) -> None:
    """Fig. 10's comparisons per rate: each fleet's throughput and memory against the others'."""
    from bench._common import RESULTS, machine

    for row in rows:
        row["fleet"] = f"{row['method']}:{row['instances']}x{row['gpus_per_instance']}"
    by = {(r["fleet"], r["rate_per_s"]): r for r in rows}
    comparisons = []
    for rate in sorted({r["rate_per_s"] for r in rows}):
        fleets = [r for r in rows if r["rate_per_s"] == rate]
        for a in fleets:
            for b in fleets:
                if a is not b and a["method"] == "cocoserve" and b["method"] != "cocoserve":
                    comparisons.append({
                        "rate_per_s": rate, "fleet": a["fleet"], "against": b["fleet"],
                        "throughput_ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"],
                        "e2e_mean_ratio": a["e2e_mean_s"] / b["e2e_mean_s"],
                        "memory_ratio": a["peak_memory_gb"] / b["peak_memory_gb"]})  # fmt: skip
    result = {"machine": machine(), "settings": vars(args), "runs": rows, "comparisons": comparisons}
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    for c in comparisons:
        print(f"{c['rate_per_s']:g}/s {c['fleet']} against {c['against']}: throughput x{c['throughput_ratio']:.3f}, "
              f"E2E x{c['e2e_mean_ratio']:.3f}, memory x{c['memory_ratio']:.3f}")  # fmt: skip
    print(f"wrote {path} ({len(by)} fleet runs)")


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
    parser.add_argument("--max-migrations", type=int, default=4, help="Algorithm 2's phase 1 moves at most this many")
    parser.add_argument("--cooldown-s", type=float, default=10.0, help="the controller's pause after an action")
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--out", default="cocoserve_load")
    parser.add_argument("--step-rates", help="a step trace instead: these rates (in all) in turn, e.g. 4,40,4 "
                        "(arrival: steps; the last step lasts until --requests are in)")
    parser.add_argument("--phase-s", type=float, default=20.0, help="each step's length, the target's seconds")
    parser.add_argument("--fleets", help="Fig. 10 instead: METHOD:NxG entries (N instances of G GPUs each), e.g. "
                        "static-batching:2x1,static-batching:4x1,cocoserve:2x2")
    parser.add_argument("--keep", help="keep the runs' directories here (else a temporary one)")
    args = parser.parse_args()
    from bench._common import RESULTS, machine

    rows = []
    with tempfile.TemporaryDirectory(prefix="cocoserve-load-") as temporary:
        work = Path(args.keep or temporary)
        for rate in [float(r) for r in args.rates.split(",")]:
            if args.fleets:
                for entry in args.fleets.split(","):
                    method, shape = entry.split(":")
                    instances, gpus = (int(v) for v in shape.split("x"))
                    rows.append(run_one(method, rate, args, work, instances, gpus))
                continue
            for method in args.methods.split(","):
                rows.append(run_one(method, rate, args, work))
    if args.fleets:
        write_fleets(rows, args)
        return
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
