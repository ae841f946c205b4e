"""CoCoServe Table 2 on this host: what replicating k decoder layers to another GPU rank costs (bytes
and seconds), against restarting the instance.

Two real MPI ranks over loopback TCP (no shaping: the rate is this host's). Rank 0 sends k layers of the
tiny model, each message padded to a target layer's bytes divided by ``--scale`` (Llama-2-13B's
634 MB / 16 by default, so that 8 layers fit in this machine's memory twice); rank 1 installs each
(``layer_ranks.CopyServer``), and a ``sync`` says all are in. Reported per k: bytes moved, the median
seconds until the acknowledgement, the affine fit seconds = a + bytes / rate (R^2), and the median
seconds of an instance restart (a fresh process that imports torch, loads the checkpoint and runs one
step), with the restart over one operation.

With ``--rates-mbit``, the two ranks run instead on two nodes of a throwaway emulated testbed (each
rank in its node's network namespace, MPI over the data veths) and the link between them is shaped
with the testbed's own HTB plans at each rate in turn: per rate the affine fit, and over every rate
one fit of seconds = a + b x bytes / rate (the link's rate, as Table 2's time should follow). Needs
root.

    python bench/cocoserve_scaling_cost.py
    python bench/cocoserve_scaling_cost.py --rates-mbit 500,1000,2000 --repeats 3 --out cocoserve_scaling_cost_shaped

Writes bench/results/cocoserve_scaling_cost.json.
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
LOOPBACK_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo", "MPIR_CVAR_NOLOCAL": "1"}
RESTART = ("import torch; from nodes.inference.checkpoint import load_whole; m = load_whole(%r); "
           "m.run_layers(m.embed(torch.tensor([0, 5, 6])), [__import__('nodes.inference.model', fromlist=['Segment'])"
           ".Segment(m.new_cache(), 3)])")  # fmt: skip


def ranks(settings: dict) -> None:
    from mpi4py import MPI

    from nodes.inference.checkpoint import load_whole
    from nodes.workers.engines.layer_ranks import CopyServer, RemoteGpu

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        CopyServer(comm, str(TINY)).serve()
        return
    model = load_whole(str(TINY))
    remote = RemoteGpu(comm, 1)
    rows = []
    for layers in settings["layers"]:
        for _ in range(settings["repeats"]):
            started = time.monotonic()
            moved = sum(remote.install(i, model.layers[str(i)], [], settings["pad_bytes"]) for i in range(layers))
            remote.sync()  # every layer installed there
            rows.append({"layers": layers, "bytes": moved + layers * settings["pad_bytes"],
                         "seconds": time.monotonic() - started})  # fmt: skip
    remote.stop()
    Path(settings["out"]).write_text(json.dumps(rows))


def lab_inventory(state_dir: Path) -> str:
    """Two GPU nodes of one server, the link between them to be shaped."""
    return (
        "defaults: {ssh: {user: root}, sudo: false}\n"
        f"emulation: {{management_subnet: 10.235.0.0/24, data_subnet: 10.236.0.0/24, name_prefix: tbg, "
        f"state_dir: {state_dir}}}\n"
        "nodes:\n"
        + "".join(f"  - {{name: gpu{i}, kind: server, model: a100-40gb, roles: [server], emulated: "
                  "{power_modes: [{id: 0, name: default, cpus: 1.0, idle_w: 50, busy_w: 250}]}}\n" for i in range(2))
    )  # fmt: skip


def copy_rows(settings: dict, netns: tuple[str, str] | None) -> list[dict]:
    """The two ranks' rows: on loopback, or each rank in its node's namespace (MPI over data0)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    rank = [sys.executable, __file__, "--ranks", json.dumps(settings)]
    if netns is None:
        argv, env = [str(mpiexec), "-n", "2", *rank], dict(os.environ, **LOOPBACK_TCP)
    else:  # one block per namespace: hydra's proxy forks both, PMI over the inherited descriptor
        argv = [str(mpiexec), "-n", "1", "ip", "netns", "exec", netns[0], *rank, ":",
                "-n", "1", "ip", "netns", "exec", netns[1], *rank]  # fmt: skip
        env = dict(os.environ, **dict(LOOPBACK_TCP, FI_TCP_IFACE="data0"))
    done = subprocess.run(argv, env=dict(env, PYTHONPATH=str(REPO)), timeout=1200, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the copy ranks failed (exit status {done.returncode})")
    return json.loads(Path(settings["out"]).read_text())


def shaped(settings: dict, rates_mbit: list[float]) -> dict:
    """Every layer count at every rate, the link between the two GPU nodes shaped (HTB, both ways)."""
    from bench._common import affine_fit, emulated_lab
    from netem.profile import DirectedLink, LinkProfile
    from testbed.emulation.plan import plan_emulation
    from testbed.links.apply import apply_plans, clear_nodes
    from testbed.links.plans import compile_plan

    rows = []
    with emulated_lab(lab_inventory) as lab:
        plan = plan_emulation(lab)
        netns = (plan.node("gpu0").netns, plan.node("gpu1").netns)
        try:
            for mbit in rates_mbit:
                profile = LinkProfile.model_validate({"rate": f"{mbit:g}mbit"})
                links = (DirectedLink("gpu0", "gpu1", f"{mbit:g}mbit", profile),
                         DirectedLink("gpu1", "gpu0", f"{mbit:g}mbit", profile))  # fmt: skip
                if not apply_plans(lab, compile_plan(lab, links)).ok:
                    raise SystemExit(f"shaping the GPUs' link to {mbit:g} mbit failed")
                rows += [dict(r, rate_mbit=mbit) for r in copy_rows(settings, netns)]
                print(f"{mbit:g} mbit: {len(rows)} rows", flush=True)
        finally:
            clear_nodes(lab)
    per_rate = {}
    for mbit in rates_mbit:
        mine = [r for r in rows if r["rate_mbit"] == mbit]
        fit = affine_fit([r["bytes"] for r in mine], [r["seconds"] for r in mine])
        per_rate[f"{mbit:g}"] = {"fixed_s": fit["intercept"], "rate_mbit_fitted": 8e-6 / fit["slope"], "r2": fit["r2"],
                                 "median_s": {str(k): statistics.median(r["seconds"] for r in mine if r["layers"] == k)
                                              for k in settings["layers"]}}  # fmt: skip
    joint = affine_fit([r["bytes"] * 8 / (r["rate_mbit"] * 1e6) for r in rows], [r["seconds"] for r in rows])
    fitted = {"fixed_s": joint["intercept"], "slope": joint["slope"], "r2": joint["r2"]}
    return {"rows": rows, "per_rate": per_rate, "bytes_over_rate_fit": fitted}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="1,2,4,8", help="layer counts per operation (Table 2: 1 to 40)")
    parser.add_argument("--scale", type=float, default=16.0, help="a target layer's bytes are divided by this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="cocoserve_scaling_cost", help="result name under bench/results")
    parser.add_argument("--rates-mbit", help="shape the link between two emulated GPU nodes to each rate in turn")
    parser.add_argument("--ranks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks:
        ranks(json.loads(args.ranks))
        return 0
    from bench._common import affine_fit, write
    from nodes.contracts.target_model import builtin
    from nodes.inference.checkpoint import load_part

    target = builtin("llama-2-13b")
    target_layer = 4 * target.hidden * target.hidden * 2 + 3 * target.hidden * target.ffn * 2  # float16 weights
    tiny_layer = sum(t.numel() * t.element_size() for t in load_part(str(TINY), [0]).layers["0"].state_dict().values())
    pad = max(0, int(target_layer / args.scale) - tiny_layer)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"layers": [int(n) for n in args.layers.split(",")], "repeats": args.repeats, "pad_bytes": pad,
                    "out": str(Path(tmp) / "rows.json")}  # fmt: skip
        if args.rates_mbit:
            result = shaped(settings, [float(v) for v in args.rates_mbit.split(",")])
            path = write(args.out, {
                "command": " ".join(["python", "bench/cocoserve_scaling_cost.py", *sys.argv[1:]]),
                "seconds": round(time.perf_counter() - began, 1), "target_layer_bytes": target_layer,
                "scale": args.scale, "message_pad_bytes": pad, **result,
                "link": "two emulated GPU nodes' data veths, HTB at each rate both ways (testbed link plans)",
            })  # fmt: skip
            print(json.dumps({k: result[k] for k in ("per_rate", "bytes_over_rate_fit")}, indent=1))
            print(f"wrote {path}")
            return 0
        rows = copy_rows(settings, None)
    restarts = []
    for _ in range(args.repeats):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", RESTART % str(TINY)], cwd=REPO, check=True)
        restarts.append(time.monotonic() - started)
    fit = affine_fit([r["bytes"] for r in rows], [r["seconds"] for r in rows])
    intercept, slope, r2 = fit["intercept"], fit["slope"], fit["r2"]
    per_k = {}
    for layers in settings["layers"]:
        mine = [r for r in rows if r["layers"] == layers]
        per_k[str(layers)] = {"bytes": mine[0]["bytes"], "median_s": statistics.median(r["seconds"] for r in mine)}
    one = per_k[str(min(settings["layers"]))]["median_s"]
    restart = statistics.median(restarts)
    path = write(args.out, {
        "command": " ".join(["python", "bench/cocoserve_scaling_cost.py", *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - began, 1), "target_layer_bytes": target_layer, "scale": args.scale,
        "message_pad_bytes": pad, "per_layers": per_k, "fit": {"fixed_s": intercept, "rate_gbps": 1 / slope / 1e9,
                                                                  "r2": r2},
        "restart_s": restart, "restart_over_one_operation": restart / one, "rows": rows,
        "link": "loopback TCP, unshaped (this host's rate)",
    })  # fmt: skip
    print(json.dumps({"per_layers": per_k, "r2": r2, "rate_gbps": 1 / slope / 1e9, "restart_s": restart,
                      "restart_over_one_operation": restart / one}, indent=1))  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
