"""Fan-out: gather facts (one facts command + 8 clock exchanges, over a new SSH connection per
node) from 1 and from 30 real sshd instances in parallel, and from the same 30 in a serial loop.

Writes bench/results/fanout.json. Targets (ratios, same run): parallel N=30 within 3x of N=1, and
at least 8x faster than the serial loop. Never fails on absolute times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine_cpu_s, summary, write
from testbed.checks.inventory_check import check_node
from testbed.emulation.sshd_server import SshdServer, SshKeys, loopback_inventory_yaml
from testbed.inventory import load_inventory
from testbed.transport.fanout import fan_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        keys = SshKeys.create(Path(tmp) / "keys")
        # Each node gets a home of its own, as a real node has: the controller user's rc files (here a
        # pyenv init costing ~130 ms of CPU per command) would otherwise be charged to every node.
        servers = [
            SshdServer(keys, name=f"bench{i}", environment={"HOME": f"{tmp}/home{i}"}).start()
            for i in range(args.nodes)
        ]
        try:
            path = Path(tmp) / "inventory.yaml"
            ports = [(f"n{i:02d}", server.port) for i, server in enumerate(servers)]
            path.write_text(loopback_inventory_yaml(keys, ports, python=sys.executable))
            inventory = load_inventory(path)
            names = [n.name for n in inventory.nodes]

            def gather(name: str) -> object:
                return check_node(inventory, inventory.node(name))

            cpu_s_per_node: list[float] = []

            def timed(selection: list[str], parallel: int) -> float:
                cpu_before, start = machine_cpu_s(), time.monotonic()
                result = fan_out(selection, gather, max_parallel=parallel)
                elapsed = time.monotonic() - start
                cpu_s_per_node.append((machine_cpu_s() - cpu_before) / len(selection))
                if not result.ok:
                    raise SystemExit(f"bench failed: {[o.error for o in result.failed]}")
                return elapsed

            timed(names[:1], 1)  # warm caches (sshd binary, keys) before measuring
            one, parallel, serial = [], [], []
            for _ in range(args.repeats):  # interleaved, so drift hits all three alike
                one.append(timed(names[:1], 1))
                parallel.append(timed(names, 32))
                serial.append(timed(names, 1))
        finally:
            for s in servers:
                s.stop()

    one_s, par_s, ser_s = summary(one), summary(parallel), summary(serial)
    cpu_node = statistics.median(cpu_s_per_node)
    cores = os.cpu_count() or 1
    payload = {
        "benchmark": "fanout",
        "nodes": args.nodes,
        "repeats": args.repeats,
        "wall_s": {"n1": one_s, f"n{args.nodes}_parallel": par_s, f"n{args.nodes}_serial": ser_s},
        "ratios_of_medians": {
            f"parallel_n{args.nodes}_over_n1": par_s["median"] / one_s["median"],
            f"serial_over_parallel_n{args.nodes}": ser_s["median"] / par_s["median"],
        },
        "targets": {f"parallel_n{args.nodes}_over_n1": "<= 3", f"serial_over_parallel_n{args.nodes}": ">= 8"},
        # Controller and every sshd share this machine's cores, so node-side work does not run in
        # parallel as it would on a lab's separate boards: the parallel run cannot beat this floor.
        "machine_cpu_s_per_node_check": cpu_node,
        f"cpu_bound_floor_n{args.nodes}_s": cpu_node * args.nodes / cores,
    }
    out = write("fanout", payload)
    print(
        f"N=1 {one_s['median']:.3f} s | N={args.nodes} parallel {par_s['median']:.3f} s | "
        f"N={args.nodes} serial {ser_s['median']:.3f} s (medians of {args.repeats})"
    )
    for key, value in payload["ratios_of_medians"].items():
        print(f"{key}: {value:.2f} (target {payload['targets'][key]})")
    print(
        f"machine CPU per node check {cpu_node * 1e3:.1f} ms -> N={args.nodes} cannot finish below "
        f"{cpu_node * args.nodes / cores:.3f} s on {cores} cores shared by controller and nodes"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
