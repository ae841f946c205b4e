"""CoCoServe Table 2 on this host: what replicating k decoder layers to another GPU rank costs (bytes
and seconds), against restarting the instance.

Two real MPI ranks over loopback TCP (no shaping: the rate is this host's). Rank 0 sends k layers of the
tiny model, each message padded to a target layer's bytes divided by ``--scale`` (Llama-2-13B's
634 MB / 16 by default, so that 8 layers fit in this machine's memory twice); rank 1 installs each
(``layer_ranks.CopyServer``), and a ``sync`` says all are in. Reported per k: bytes moved, the median
seconds until the acknowledgement, the affine fit seconds = a + bytes / rate (R^2), and the median
seconds of an instance restart (a fresh process that imports torch, loads the checkpoint and runs one
step), with the restart over one operation.

    python bench/cocoserve_scaling_cost.py

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
    from nodes.workers.layer_ranks import CopyServer, RemoteGpu

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="1,2,4,8", help="layer counts per operation (Table 2: 1 to 40)")
    parser.add_argument("--scale", type=float, default=16.0, help="a target layer's bytes are divided by this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="cocoserve_scaling_cost", help="result name under bench/results")
    parser.add_argument("--ranks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks:
        ranks(json.loads(args.ranks))
        return 0
    import numpy as np

    from bench._common import write
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
        mpiexec = Path(sys.executable).parent / "mpiexec"
        done = subprocess.run([str(mpiexec), "-n", "2", sys.executable, __file__, "--ranks", json.dumps(settings)],
                              env=dict(os.environ, **LOOPBACK_TCP), timeout=1200)  # fmt: skip
        if done.returncode != 0:
            return done.returncode
        rows = json.loads(Path(settings["out"]).read_text())
    restarts = []
    for _ in range(args.repeats):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", RESTART % str(TINY)], cwd=REPO, check=True)
        restarts.append(time.monotonic() - started)
    sizes = np.array([r["bytes"] for r in rows], dtype=float)
    seconds = np.array([r["seconds"] for r in rows])
    slope, intercept = np.polyfit(sizes, seconds, 1)
    fitted = intercept + slope * sizes
    r2 = 1 - float(((seconds - fitted) ** 2).sum() / ((seconds - seconds.mean()) ** 2).sum())
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
