"""CoCoServe Fig. 8, 10 and 11 on real ranks of this host: one Llama-2-13B instance on four paced
A100-40GB GPU ranks under Poisson load, static batching (the HF Transformers baseline) against our
continuous batching without scaling and CoCoServe, each GPU's budget its 40 GB (the target's bytes).

The tiny model computes every token; each layer copy's step is paced to the A100 for the five
Llama-2-13B layers a tiny layer stands for, and time is dilated (the emulated GPUs run ``dilation``
times slower than the A100s, so that two cores keep up; the figures are divided back). Requests are
Alpaca-like (prompts about 19 tokens, outputs about 58, at most 256), every request making its drawn
length. Per method and rate: output tokens/s and requests/s, E2E latency, SLO attainment (the
engine's: 5x the request's time alone), OOM rate, peak GPU memory, the controller's actions and the
paced steps' overruns.

Every method meets the same requests in a repetition (its own workload seed); with ``--repetitions``
each measure gets its 95% interval (:mod:`analysis.uncertainty`): per method and load (each rate, the
paper's low load up to 30 requests/s and high load above, all), the means with their intervals, and
each method's change against the others on the same requests (E2E, OOM and SLO violations paired by
request; throughput and memory paired by repetition).

    python bench/cocoserve_load.py                                   # 3 methods x 4 rates
    python bench/cocoserve_load.py --methods static-batching,cocoserve --rates 8,32 --requests 60 --repetitions 3
    python bench/cocoserve_load.py --methods cocoserve --rates 1 --step-rates 4,40,4 --phase-s 20 \\
        --requests 960 --out cocoserve_steps           # the step trace: the controller's actions in order
    python bench/cocoserve_load.py --fleets static-batching:2x1,static-batching:4x1,cocoserve:2x2 \\
        --rates 8,48 --requests 160 --out cocoserve_fleets   # Fig. 10: instances of N GPUs each
    python bench/cocoserve_load.py --campaign examples/campaigns/cocoserve-load.yaml \\
        --set 'matrix.workload.rate_per_s=[4]' --set repetitions=3 --work /var/tmp/coco   # on the emulated lab

With ``--campaign``, the runs are an example campaign's on its emulated lab (brought up and down by
bench/campaign_reproduction.py, whose summary of TTFT and TBT is kept under ``campaign``); the same
measures are computed from the campaign's directory. Writes bench/results/cocoserve_load.json (or the
result ``--out`` names).
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from analysis.comparison import plain  # noqa: E402

TINY = REPO / "examples" / "models" / "tiny"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LOW_MAX_RATE = 30.0  # Sec. 6.1: low load 3-30 requests/s, high 31-50
METHOD_ORDER = {"static-batching": 0, "continuous-batching": 1, "cocoserve": 2}  # a change is later against earlier
PAIR_KEY = ["rate_per_s", "repetition", "stream", "node", "request_id"]  # the same request in two configurations
REQUEST_MEASURES = {"e2e_change": "e2e_s", "oom_change": "out_of_memory", "slo_violation_change": "violated"}
RUN_MEASURES = {"throughput_change": "output_tokens_per_s", "request_throughput_change": "requests_per_s",
                "memory_change": "peak_memory_gb"}  # fmt: skip


def run_instance(method: str, rate: float, gpus: int, clients: list[str], per_client: int, args: argparse.Namespace,
                 run_dir: Path, seed: int) -> dict:  # fmt: skip
    """One instance on ``gpus`` GPU ranks serving ``clients`` (``rate`` requests/s over them all,
    ``per_client`` requests each, drawn with ``seed``): its requests (the target's seconds), monitor
    ticks, module operations and paced steps."""
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
    schedules = build_schedules(spec, clients, seed=seed, model_dir=TINY)
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


def request_units(requests: Any, **settings: Any) -> Any:
    """Per scheduled request: its node and id, E2E (NaN unless it finished), out of memory and SLO
    violated (0 or 1), with ``settings`` (config, rate_per_s, repetition, stream) in front."""
    from analysis import gpu_serving

    outcomes = gpu_serving.request_outcomes(requests)
    units = outcomes[["node", "request_id", "e2e_s"]].assign(
        out_of_memory=outcomes["out_of_memory"].astype(float), violated=(~outcomes["met_slo"]).astype(float)
    )
    for name, value in reversed(settings.items()):
        units.insert(0, name, value)
    return units


def run_one(method: str, rate: float, args: argparse.Namespace, work: Path, repetition: int, seed: int,
            instances: int = 1, gpus: int | None = None) -> tuple[dict, Any]:  # fmt: skip
    """``instances`` alike instances of ``method`` on ``gpus`` GPUs each, behind a dispatcher that deals
    the clients out (each instance its own clients' Poisson streams, ``rate`` requests/s in all). The
    instances share nothing else, so they run one after another on this host (two cores cannot pace
    several at once) on one clock: their requests are pooled (throughput over the fleet's span), their
    GPUs' peak memory summed. Returns the run's row and its requests (:func:`request_units`)."""
    import pandas as pd

    from analysis import gpu_serving

    gpus = gpus or args.gpus
    began = time.monotonic()
    config = f"{method}:{instances}x{gpus}" if args.fleets else method
    name = f"{method}-{rate:g}" + (f"-{instances}x{gpus}" if args.fleets else "") + f"-r{repetition}"
    clients = [f"client{c}" for c in range(args.clients * instances)]
    per_client = args.requests // len(clients)  # the fleet serves --requests in all
    parts = [run_instance(method, rate / instances, gpus, clients[i * args.clients:(i + 1) * args.clients],
                          per_client, args, work / f"{name}-i{i}", seed) for i in range(instances)]  # fmt: skip
    requests = pd.concat([p["requests"] for p in parts], ignore_index=True).assign(run_id="r", completed=True)
    ticks = pd.concat([p["ticks"].assign(run_id=f"i{i}") for i, p in enumerate(parts)], ignore_index=True)
    table = gpu_serving.gpu_serving_table(requests, pd.DataFrame({"run_id": ["r"], "method": [method]}),
                                          ticks.iloc[0:0].assign(run_id="r"), ["method"])  # fmt: skip
    row = {"config": config, **table.iloc[0].to_dict()}
    held = gpu_serving.peak_memory(ticks)  # per instance: the fleet holds their sum
    ticked = len(held) == instances  # an instance that ended before the monitor's first tick held unknown bytes
    row.update(peak_memory_gb=float(held["peak_bytes"].sum()) / 1e9 if ticked else float("nan"),
               gpus_used=float(held["gpus_used"].sum()) if ticked else float("nan"), instances=instances,
               gpus_per_instance=gpus)  # fmt: skip
    ops = pd.concat([p["ops"].assign(instance=i) for i, p in enumerate(parts)], ignore_index=True)
    steps = pd.concat([p["steps"] for p in parts], ignore_index=True)
    columns = ["time_s", "kind", "layer", "destination", "batch_size"] + (["instance"] if instances > 1 else [])
    actions = ops[columns].to_dict("records") if len(ops) else []
    row.update(rate_per_s=rate, repetition=repetition, seed=seed, wall_s=round(time.monotonic() - began, 1),
               actions=actions, **paced(steps))  # fmt: skip
    print(json.dumps({k: v for k, v in row.items() if k != "actions"}, default=float), flush=True)
    units = request_units(requests, config=config, rate_per_s=rate, repetition=repetition,
                          stream=f"{instances} instances")  # fmt: skip
    return row, units


def paced(steps: Any) -> dict[str, Any]:
    """A run's paced steps: how many, how many overran, their share, the worst node's share and whether
    a node is over :data:`analysis.fidelity.VIOLATION_LIMIT` (the run is flagged)."""
    from analysis.fidelity import violation_shares

    if steps.empty:
        return {"paced_steps": 0, "overruns": 0, "overrun_share": None, "worst_node_share": None, "flagged": False}
    nodes = violation_shares(steps.assign(run_id="r"))
    return {
        "paced_steps": int(nodes["steps"].sum()),
        "overruns": int(nodes["overruns"].sum()),
        "overrun_share": float(nodes["overruns"].sum() / nodes["steps"].sum()),
        "worst_node_share": float(nodes["violation_share"].max()),
        "flagged": bool(nodes["flagged"].any()),
    }


def fidelity(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, as bench/campaign_reproduction.py's record: the share of its paced steps that
    overran, the worst node's share and the runs flagged."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config and r["paced_steps"]]
        if mine:
            share = sum(r["overruns"] for r in mine) / sum(r["paced_steps"] for r in mine)
            out.append({"settings": {"config": config}, "overrun_share": round(share, 4),
                        "worst_node_share": round(max(r["worst_node_share"] for r in mine), 4),
                        "flagged_runs": sum(r["flagged"] for r in mine), "runs": len(mine)})  # fmt: skip
    return out


# -- the measures with their intervals ---------------------------------------------------------------


def loads_of(rates: list[float], low_max_rate: float) -> dict[str, list[float]]:
    """Each rate alone ("8/s"), the paper's low and high loads where there are rates, and all of them."""
    loads = {f"{r:g}/s": [r] for r in rates}
    for name, mine in (
        ("low", [r for r in rates if r <= low_max_rate]),
        ("high", [r for r in rates if r > low_max_rate]),
    ):
        if mine:
            loads[name] = mine
    loads["all"] = list(rates)
    return loads


def jsonable(value: Any) -> Any:
    """``value`` with numpy's scalars as Python's and paths as text (what ``bench._common.write`` takes)."""
    return json.loads(json.dumps(value, default=lambda v: str(v) if isinstance(v, Path) else plain(v)))


def group_means(units: Any, runs: Any, loads: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per configuration and load: its requests, runs and repetitions, and the mean E2E (s), OOM rate,
    SLO attainment (requests; clusters: repetitions), output tokens/s, requests/s and peak memory (GB;
    one value a run) with their intervals."""
    from analysis.uncertainty import mean_interval

    rows = []
    for config in runs["config"].drop_duplicates():
        for load, rates in loads.items():
            u = units[(units["config"] == config) & units["rate_per_s"].isin(rates)]
            r = runs[(runs["config"] == config) & runs["rate_per_s"].isin(rates)]
            if r.empty:
                continue
            row: dict[str, Any] = {"config": config, "load": load, "rates_per_s": rates, "requests": len(u),
                                   "runs": len(r), "repetitions": int(r["repetition"].nunique())}  # fmt: skip
            row["e2e_mean_s"] = mean_interval(u["e2e_s"], clusters=u["repetition"]).as_dict()
            row["oom_rate"] = mean_interval(u["out_of_memory"], clusters=u["repetition"]).as_dict()
            row["slo_attainment"] = mean_interval(1.0 - u["violated"], clusters=u["repetition"]).as_dict()
            for column in RUN_MEASURES.values():
                row[column] = mean_interval(r[column].astype(float), clusters=r["repetition"]).as_dict()
            rows.append(row)
    return rows


def _order(config: str, runs: Any) -> tuple[int, float]:
    """Where a configuration stands among baselines: static, continuous, CoCoServe; then GPUs in all."""
    mine = runs[runs["config"] == config].iloc[0]
    gpus = float(mine.get("instances", 1) or 1) * float(mine.get("gpus_per_instance", 0) or 0)
    return METHOD_ORDER.get(str(mine["method"]), 9), gpus


def changes(units: Any, runs: Any, loads: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each configuration against each that stands before it (:func:`_order`), per load: the relative
    change of mean E2E, OOM rate and SLO violations over the same requests (paired; unpaired where the
    two met different requests, as fleets of different sizes do) and of output tokens/s, requests/s and
    peak memory over the same repetitions (paired), each with its interval and whether within noise."""
    from analysis.uncertainty import change_interval, unpaired_change_interval, within_noise

    configs = sorted(runs["config"].drop_duplicates(), key=lambda c: _order(c, runs))
    rows = []
    for b, base in enumerate(configs):
        for config in configs[b + 1 :]:
            for load, rates in loads.items():
                t_u = units[(units["config"] == config) & units["rate_per_s"].isin(rates)]
                b_u = units[(units["config"] == base) & units["rate_per_s"].isin(rates)]
                t_r = runs[(runs["config"] == config) & runs["rate_per_s"].isin(rates)]
                b_r = runs[(runs["config"] == base) & runs["rate_per_s"].isin(rates)]
                if t_r.empty or b_r.empty:
                    continue
                paired = t_u.merge(b_u, on=PAIR_KEY, suffixes=("", "_base"))
                row: dict[str, Any] = {"config": config, "against": base, "load": load, "rates_per_s": rates,
                                       "pairs": len(paired), "paired": bool(len(paired))}  # fmt: skip
                for name, column in REQUEST_MEASURES.items():
                    change = (change_interval(paired[column], paired[f"{column}_base"], clusters=paired["repetition"])
                              if len(paired) else unpaired_change_interval(t_u[column], b_u[column]))  # fmt: skip
                    row[name] = {**change.as_dict(), "within_noise": within_noise(change)}
                both = t_r.merge(b_r, on=["rate_per_s", "repetition"], suffixes=("", "_base"))
                for name, column in RUN_MEASURES.items():
                    change = change_interval(both[column].astype(float), both[f"{column}_base"].astype(float),
                                             clusters=both["repetition"])  # fmt: skip
                    row[name] = {**change.as_dict(), "within_noise": within_noise(change)}
                rows.append(row)
    return rows


def summarise(units: Any, runs: Any, low_max_rate: float) -> dict[str, Any]:
    """The groups' means and the changes between configurations with their intervals, and each
    configuration's SLO knee (the highest rate whose mean attainment is at least 0.9)."""
    from analysis.gpu_serving import KNEE_ATTAINMENT

    rates = sorted(float(r) for r in runs["rate_per_s"].drop_duplicates())
    loads = loads_of(rates, low_max_rate)
    groups = group_means(units, runs, loads)
    knees = {}
    for config in runs["config"].drop_duplicates():
        held = [g["rates_per_s"][0] for g in groups if g["config"] == config and g["load"].endswith("/s")
                and g["slo_attainment"]["estimate"] >= KNEE_ATTAINMENT]  # fmt: skip
        knees[config] = max(held) if held else None
    return {"low_max_rate_per_s": low_max_rate, "groups": groups, "changes": changes(units, runs, loads),
            "slo_knees_per_s": knees}  # fmt: skip


# -- an example campaign on its emulated lab ---------------------------------------------------------


def campaign(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.campaign`` through bench/campaign_reproduction.py (the lab up and down, its TTFT and TBT
    summary) and compute this bench's measures from the campaign's directory."""
    import pandas as pd

    from analysis import gpu_serving, metrics
    from analysis.load import load
    from bench import campaign_reproduction

    work = args.work or Path("/var/tmp/hil-testbed-reproduce") / args.campaign.stem
    summary = campaign_reproduction.run([
        str(args.campaign), *[part for setting in args.set for part in ("--set", setting)], "--baseline", args.baseline,
        "--work", str(work), *(["--resume"] if args.resume else [])])  # fmt: skip
    data = load(work / "out")
    runs = data.runs[data.runs["state"] == "done"]
    requests = data.requests[data.requests["run_id"].isin(runs["run_id"])]
    if requests.empty:
        raise SystemExit(f"the campaign in {work} has no requests of a run that is done")
    keys = [k for k in summary.get("by", []) if k not in ("method", "workload.rate_per_s")]
    clients = requests.groupby("run_id")["node"].nunique()
    settings = runs.set_index("run_id")
    config = settings["method"].astype(str)
    for key in keys:  # other matrix axes make configurations of their own
        config = config + "," + key + "=" + settings[key].astype(str)
    throughput = metrics.throughput(requests.assign(completed=gpu_serving.request_outcomes(requests)["finished"]))
    memory = gpu_serving.peak_memory(data.scaling_ticks).set_index("run_id")
    overrun = data.steps.groupby("run_id")["overrun"].mean() if not data.steps.empty else pd.Series(dtype=float)
    rows, units = [], []
    for run_id, mine in requests.groupby("run_id"):
        run = settings.loc[run_id]
        rate = float(run["workload.rate_per_s"]) * int(clients[run_id])  # the rate is a client's
        tput = throughput.set_index("run_id").reindex([run_id]).iloc[0]
        ops = data.scaling_ops[data.scaling_ops["run_id"] == run_id] if not data.scaling_ops.empty else []
        one = request_units(mine, config=config[run_id], rate_per_s=rate, repetition=int(run["repetition"]),
                            stream="campaign")  # fmt: skip
        rows.append({
            "config": config[run_id], "method": run["method"], "rate_per_s": rate, "repetition": int(run["repetition"]),
            "seed": plain(run["seed"]), "run_id": run_id, "requests": len(one),
            "output_tokens_per_s": float(tput["output_tokens_per_s"]), "requests_per_s": float(tput["requests_per_s"]),
            "e2e_mean_s": float(one["e2e_s"].mean()), "oom_rate": float(one["out_of_memory"].mean()),
            "slo_attainment": float(1 - one["violated"].mean()),
            "peak_memory_gb": float(memory["peak_bytes"].get(run_id, float("nan"))) / 1e9,
            "gpus_used": plain(memory["gpus_used"].get(run_id, float("nan"))),
            "overrun_share": plain(overrun.get(run_id, float("nan"))),
            "actions": [[plain(a.time_s), a.kind, plain(a.layer)] for a in ops.itertuples()] if len(ops) else [],
        })  # fmt: skip
        units.append(one)
    runs_frame = pd.DataFrame(rows)
    return {"campaign": summary, "runs": rows, "fidelity": summary.get("fidelity", []),
            **summarise(pd.concat(units, ignore_index=True), runs_frame, args.low_max_rate)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="static-batching,continuous-batching,cocoserve")
    parser.add_argument("--rates", default="8,16,32,48", help="requests/s in all, the target's")
    parser.add_argument("--requests", type=int, default=120, help="a run's requests, over every client")
    parser.add_argument("--repetitions", type=int, default=1, help="each with its own workload seed")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32, help="static batching's batch; continuous' cap")
    parser.add_argument("--budget-gb", type=float, default=40.0, help="each GPU's memory")
    parser.add_argument("--dilation", type=float, default=8.0)
    parser.add_argument("--max-migrations", type=int, default=4, help="Algorithm 2's phase 1 moves at most this many")
    parser.add_argument("--cooldown-s", type=float, default=10.0, help="the controller's pause after an action")
    parser.add_argument("--seed", type=int, default=25, help="repetition r draws its workload with a seed from this")
    parser.add_argument("--low-max-rate", type=float, default=LOW_MAX_RATE,
                        help="the highest rate (requests/s in all) of the paper's low load")  # fmt: skip
    parser.add_argument("--out", default="cocoserve_load", help="result name under bench/results")
    parser.add_argument(
        "--step-rates",
        help="a step trace instead: these rates (in all) in turn, e.g. 4,40,4 "
        "(arrival: steps; the last step lasts until --requests are in)",
    )
    parser.add_argument("--phase-s", type=float, default=20.0, help="each step's length, the target's seconds")
    parser.add_argument(
        "--fleets",
        help="Fig. 10 instead: METHOD:NxG entries (N instances of G GPUs each), e.g. "
        "static-batching:2x1,static-batching:4x1,cocoserve:2x2",
    )
    parser.add_argument("--keep", help="keep the runs' directories here (else a temporary one)")
    parser.add_argument("--campaign", type=Path, help="an example campaign's runs instead, on its emulated lab (root)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --campaign: change the campaign (bench/campaign_reproduction.py's --set)",
    )
    parser.add_argument("--baseline", default="method=static-batching", help="with --campaign: TTFT/TBT's baseline")
    parser.add_argument("--work", type=Path, help="with --campaign: the campaign directory")
    parser.add_argument("--resume", action="store_true", help="with --campaign: go on with the one in --work")
    args = parser.parse_args()
    import pandas as pd

    from bench._common import write
    from foundation.seeds import derive_seed

    began = time.monotonic()
    command = " ".join(["python", "bench/cocoserve_load.py", *sys.argv[1:]])
    if args.campaign:
        result = campaign(args)
        result["wall_s"] = round(time.monotonic() - began, 1)
        print(f"wrote {write(args.out, jsonable({'command': command, 'settings': vars(args), **result}))}")
        return
    rows, units = [], []
    seeds = [derive_seed(args.seed, "repetition", r) for r in range(args.repetitions)]  # as a campaign's
    with tempfile.TemporaryDirectory(prefix="cocoserve-load-") as temporary:
        work = Path(args.keep or temporary)
        for repetition, seed in enumerate(seeds):
            for rate in [float(r) for r in args.rates.split(",")]:
                entries = args.fleets.split(",") if args.fleets else args.methods.split(",")
                for entry in entries:
                    method, _, shape = entry.partition(":")
                    instances, gpus = (int(v) for v in shape.split("x")) if shape else (1, args.gpus)
                    row, mine = run_one(method, rate, args, work, repetition, seed, instances, gpus)
                    rows.append(row)
                    units.append(mine)
    summary = summarise(pd.concat(units, ignore_index=True), pd.DataFrame(rows), args.low_max_rate)
    path = write(
        args.out,
        jsonable(
            {
                "command": command,
                "settings": vars(args),
                "seeds": seeds,
                "wall_s": round(time.monotonic() - began, 1),
                "runs": rows,
                "fidelity": fidelity(rows),
                **summary,
            }
        ),
    )
    for c in summary["changes"]:
        if c["load"] in ("low", "high", "all"):
            print(f"{c['load']}: {c['config']} against {c['against']}: throughput "
                  f"{c['throughput_change']['estimate']:+.1%}, E2E {c['e2e_change']['estimate']:+.1%}, "
                  f"memory {c['memory_change']['estimate']:+.1%}")  # fmt: skip
    print(f"SLO knees (requests/s): {summary['slo_knees_per_s']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
