"""CoCoServe's speedup model against measured speedups: layer replication strategies on four GPU
ranks (real MPI ranks on this host), the tiny model computing every token, each copy's computation
paced to an A100-40GB running its share of Llama-2-13B (a tiny layer stands for 5 of its 40 layers)
and the rows' scatter and gather at each run's ends paced to an inter-GPU link rate (both modeled).

For each link rate and strategy (P_0 first), the median time of chunked-prefill steps (16 sequences x
32 new tokens: compute-bound on an A100, where splitting the batch pays) gives the measured speedup
T(P_0) / T(P); Eq. 3 predicts it from the per-layer compute time measured under P_0 and the modeled
transfer time; Eq. 4's gamma is fitted from the measured speedups. Reported: Spearman's rank
correlation of predicted and measured over every strategy and rate, Algorithm 1's pick against the
best enumerated strategy, and whether Algorithm 1 replicates anything once the fitted gamma >= 1.

    python bench/cocoserve_speedup.py                      # 3 link rates x 10 strategies
    python bench/cocoserve_speedup.py --rates-gbps 8 --steps 4

Writes bench/results/cocoserve_speedup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = REPO / "examples" / "models" / "tiny"
GPUS = ("g0", "r1", "r2", "r3")
# strategies over the tiny model's 8 layers: GPU -> layers it replicates
STRATEGIES = {
    "P0": {},
    "2-5 on r1": {"r1": range(2, 6)},
    "all on r1": {"r1": range(8)},
    "all on r1,r2": {"r1": range(8), "r2": range(8)},
    "all on r1,r2,r3": {"r1": range(8), "r2": range(8), "r3": range(8)},
    "0-3 on r1": {"r1": range(4)},
    "even on r1": {"r1": (0, 2, 4, 6)},
    "0-3 on r1, 4-7 on r2": {"r1": range(4), "r2": range(4, 8)},
    "0-5 on r1,r2": {"r1": range(6), "r2": range(6)},
    "1 on r1": {"r1": (1,)},
}
LOOPBACK_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo", "MPIR_CVAR_NOLOCAL": "1"}


def ranks(settings: dict) -> None:
    """Every rank's part (under mpiexec): rank 0 the instance, the others copy servers."""
    from mpi4py import MPI

    from nodes.contracts.target_model import builtin
    from nodes.workers import mpi_link
    from nodes.workers.engines.layer_ranks import CopyServer
    from nodes.workers.pacing import Pacer
    from testbed.target.compute_profiles import load_profile

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    dilation = settings["dilation"]
    mpi_link.set_time_dilation(dilation)
    target = builtin("llama-2-13b")
    per_copy = target.layers // 8  # target layers a tiny layer stands for
    pacer = Pacer(load_profile(REPO / "examples" / "profiles" / "a100-40gb.yaml").rates(), target, dilation)

    def pace(shape, started):
        pacer.pace("layers", started, pacer.target_s(per_copy, shape), per_copy, shape)

    if rank > 0:
        CopyServer(comm, str(TINY), pace=lambda layer, shape, started: pace(shape, started)).serve()
        return
    try:
        instance(comm, settings, pacer, pace, target)
    except Exception:  # the copy servers would wait for it forever
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)


def instance(comm, settings: dict, pacer, pace, target) -> None:
    """Rank 0: each link rate and strategy, timed."""
    import torch

    from nodes.inference.checkpoint import load_whole
    from nodes.inference.layer_copies import LayerCopies
    from nodes.workers.engines.layer_ranks import RemoteGpu

    dilation = settings["dilation"]
    torch.set_num_threads(1)
    model = load_whole(str(TINY), dtype="float32")
    corpus = list(range(2, 4000))
    row_bytes = target.hidden * 2  # float16 hidden states of the target
    results = []
    remotes = {g: RemoteGpu(comm, i) for i, g in enumerate(GPUS) if i}
    for rate in settings["rates_gbps"]:
        for name, strategy in STRATEGIES.items():
            copies = LayerCopies(model, "g0")
            for gpu, remote in remotes.items():
                copies.add_remote(gpu, remote)
            for gpu, layers in strategy.items():
                for layer in layers:
                    copies.replicate(layer, gpu)
            copies.pace = lambda gpu, layer, shape, started: pace(shape, started)
            copies.transfer_s = lambda gpu, tokens, rate=rate: tokens * row_bytes / (rate * 1e9) * dilation
            sequences = [copies.admit() for _ in range(settings["batch"])]
            tokens, seconds = settings["tokens"], []
            with torch.inference_mode():
                for step in range(settings["steps"] + 1):
                    ids = [corpus[(k * 97 + step * tokens + t) % len(corpus)] for k in range(len(sequences))
                           for t in range(tokens)]  # fmt: skip
                    pacer.unchain()
                    started = time.monotonic()
                    copies.run_layers(model.embed(torch.tensor(ids)), [(s, tokens) for s in sequences])
                    if step:  # the first warms up
                        seconds.append((time.monotonic() - started) / dilation)
            degrees = [len(copies.hosts[i]) for i in range(8)]
            for gpu, layers in strategy.items():  # free the ranks for the next strategy
                for layer in layers:
                    copies.evict(layer, gpu, sequences)
            results.append({"rate_gbps": rate, "strategy": name, "step_s": statistics.median(seconds),
                            "steps_s": seconds, "degrees": degrees, "instance_overruns": pacer.overruns})  # fmt: skip
            print(json.dumps({k: v for k, v in results[-1].items() if k != "steps_s"}), flush=True)
    for remote in remotes.values():
        remote.stop()
    Path(settings["out"]).write_text(json.dumps(results))


def placement_of(strategy: dict):
    from nodes.scaling.placement import Placement

    placement = Placement.single(8, "g0")
    for gpu, layers in strategy.items():
        for layer in layers:
            placement = placement.add_replica(layer, gpu)
    return placement


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates-gbps", default="16,1,0.1", help="inter-GPU link rates, GB/s (PCIe 4.0 x16 ~ 25)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per strategy (after one to warm up)")
    parser.add_argument("--batch", type=int, default=16, help="sequences a step")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a sequence a step (chunked prefill)")
    parser.add_argument("--dilation", type=float, default=4.0, help="every modeled time stretched by this")
    parser.add_argument("--out", default="cocoserve_speedup", help="result name under bench/results")
    parser.add_argument("--ranks", help=argparse.SUPPRESS)  # the ranks' settings (internal)
    args = parser.parse_args()
    if args.ranks:
        ranks(json.loads(args.ranks))
        return 0
    import pandas as pd

    from bench._common import write
    from nodes.scaling.placement import GpuMemory
    from nodes.scaling.scale_up import scale_up
    from nodes.scaling.speedup_model import fit_gamma, homogeneous_speedup, identical, speedup

    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"rates_gbps": [float(r) for r in args.rates_gbps.split(",")], "steps": args.steps,
                    "batch": args.batch, "tokens": args.tokens, "dilation": args.dilation,
                    "out": str(Path(tmp) / "ranks.json")}  # fmt: skip
        mpiexec = Path(sys.executable).parent / "mpiexec"
        done = subprocess.run([str(mpiexec), "-n", str(len(GPUS)), sys.executable, __file__, "--ranks",
                               json.dumps(settings)], env=dict(os.environ, **LOOPBACK_TCP), timeout=3000)  # fmt: skip
        if done.returncode != 0:
            return done.returncode
        rows = json.loads(Path(settings["out"]).read_text())
    from nodes.contracts.target_model import builtin

    target = builtin("llama-2-13b")
    batch_tokens = args.batch * args.tokens
    table = pd.DataFrame(rows)
    points, per_rate = [], {}
    for rate, group in table.groupby("rate_gbps", sort=False):
        base = group.loc[group["strategy"] == "P0", "step_s"].iloc[0]
        compute = identical(GPUS, base / 8)  # one tiny layer's share of a P_0 step (embedding unpaced)
        transfer = identical(GPUS, batch_tokens * target.hidden * 2 / (rate * 1e9))
        measured = []
        for row in group.itertuples():
            placement = placement_of(STRATEGIES[row.strategy])
            points.append({"rate_gbps": rate, "strategy": row.strategy, "measured_speedup": base / row.step_s,
                           "predicted_speedup": speedup(placement, compute, transfer), "step_s": row.step_s,
                           "degrees": row.degrees})  # fmt: skip
            measured.append((placement.degrees(), base / row.step_s))
        gamma = fit_gamma(measured)
        memory = {"g0": GpuMemory(8), **{g: GpuMemory(8) for g in GPUS[1:]}}  # room for every layer
        def predict(p, c=compute, t=transfer):
            return speedup(p, c, t)

        picked = scale_up(placement_of({}), memory, {g: 0.9 for g in GPUS[1:]}, 0.2, 1, predict)
        best = max(p["measured_speedup"] for p in points if p["rate_gbps"] == rate)
        picked_measured = next((p["measured_speedup"] for p in points if p["rate_gbps"] == rate
                                and p["degrees"] == picked.placement.degrees()), None)  # fmt: skip
        eq4_pick = scale_up(placement_of({}), memory, {g: 0.9 for g in GPUS[1:]}, 0.2, 1,
                            lambda p, g=gamma: homogeneous_speedup(p.degrees(), g))  # fmt: skip
        per_rate[str(rate)] = {"fitted_gamma": gamma, "algorithm1_degrees": picked.placement.degrees(),
                               "algorithm1_predicted": picked.speedup, "algorithm1_measured": picked_measured,
                               "best_measured": best, "eq4_replicas_added": len(eq4_pick.added)}  # fmt: skip
    frame = pd.DataFrame(points)
    spearman = frame["predicted_speedup"].rank().corr(frame["measured_speedup"].rank())  # Spearman's rho
    path = write(args.out, {
        "command": " ".join(["python", "bench/cocoserve_speedup.py", *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - began, 1), "modeled": "compute (A100-40GB, Llama-2-13B) and transfer",
        "batch_tokens": batch_tokens, "dilation": args.dilation, "spearman": spearman, "per_rate": per_rate,
        "points": points, "instance_overruns": int(table["instance_overruns"].max()),
    })  # fmt: skip
    print(frame.to_string(index=False))
    print(f"Spearman {spearman:.3f}; per rate: {json.dumps(per_rate, indent=1)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
