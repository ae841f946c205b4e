"""Emulated testbed: wall time of ``emulate up`` (until every sshd accepts connections), of
``inventory check`` over SSH to every node, and of ``emulate down``, for 4 and for 30 nodes.

Writes bench/results/emulate.json. Target: 30 nodes up in under 60 s on a 2-core machine; the
ratio up(30)/up(4) shows how building scales per node. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_inventory, emulated_node, summary, write
from testbed.checks.inventory_check import check_nodes
from testbed.emulation.lifecycle import down, up
from testbed.emulation.resolved import load_lab
from testbed.inventory import load_inventory


def inventory_text(nodes: int, state_dir: Path) -> str:
    models = ("agx-orin", "agx-xavier", "orin-nx")
    return emulated_inventory(state_dir, "tbb", 221, [
        emulated_node(f"n{i:02d}", "jetson", models[i % 3], modes=((0, "MAXN", 0.2, 5, 20),)) for i in range(nodes)])


def measure(nodes: int, repeats: int) -> dict[str, object]:
    up_s, check_s, down_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inventory.yaml"
        path.write_text(inventory_text(nodes, Path(tmp) / "state"))
        inventory = load_inventory(path)
        for _ in range(repeats):
            t = time.perf_counter()
            up(inventory, say=lambda _: None)
            up_s.append(time.perf_counter() - t)
            lab = load_lab(path)
            t = time.perf_counter()
            result = check_nodes(lab, lab.nodes)
            check_s.append(time.perf_counter() - t)
            healthy = sum(1 for o in result.outcomes if o.ok and o.value is not None and o.value.ok)
            if healthy != nodes:
                raise SystemExit(f"only {healthy}/{nodes} nodes passed the check")
            t = time.perf_counter()
            if down(inventory, say=lambda _: None):
                raise SystemExit("down left something behind")
            down_s.append(time.perf_counter() - t)
    return {"up_s": summary(up_s), "check_s": summary(check_s), "down_s": summary(down_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    small, large = measure(4, args.repeats), measure(30, args.repeats)
    payload = {
        "nodes_4": small,
        "nodes_30": large,
        "ratio_up_30_over_4": large["up_s"]["median"] / small["up_s"]["median"],  # type: ignore[index]
        "target": "30 nodes up in under 60 s",
        "target_met": large["up_s"]["max"] < 60,  # type: ignore[index]
    }
    print(write("emulate", payload))
    for key in ("nodes_4", "nodes_30"):
        print(key, {k: round(v["median"], 2) for k, v in payload[key].items()})  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
