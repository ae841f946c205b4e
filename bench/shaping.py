"""Link shaping fidelity: target against measured iperf3 TCP goodput for 1, 5, 10, 40 and 100 mbit,
device -> server and server -> device, on a two-node emulated testbed (real HTB on the data veths).

Writes bench/results/shaping.json: per rate and direction the median of the repeats, the ratio
measured/target, and the ratio expected from header overhead alone (TCP payload per Ethernet frame,
1448/1514 with timestamps). Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_inventory, emulated_lab, emulated_node, write
from netem.profile import DirectedLink, LinkProfile
from testbed.links.apply import apply_plans, clear_nodes
from testbed.links.plans import compile_plan
from testbed.links.verify import verify_links

RATES_MBIT = (1, 5, 10, 40, 100)
HEADER_RATIO = 1448 / 1514  # TCP payload with timestamps / Ethernet frame that HTB counts


def inventory_text(state_dir: Path) -> str:
    return emulated_inventory(state_dir, "tbs", 223, [
        emulated_node("server", "server", "s", "server", ((0, "default", 1.0, 90, 300),)),
        emulated_node("device", "jetson", "agx-orin", "device", ((0, "MAXN", 1.0, 7, 40),))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of iperf3 per measurement")
    parser.add_argument("--rates", type=float, nargs="+", default=RATES_MBIT, help="target rates in mbit")
    parser.add_argument("--output", default="shaping", help="name of the JSON file in bench/results")
    args = parser.parse_args()
    results = []
    with emulated_lab(inventory_text) as lab:
        for mbit in args.rates:
            profile = LinkProfile.model_validate({"rate": f"{mbit:g}mbit"})
            links = (
                DirectedLink("device", "server", f"{mbit:g}mbit", profile),
                DirectedLink("server", "device", f"{mbit:g}mbit", profile),
            )
            if not apply_plans(lab, compile_plan(lab, links)).ok:
                raise SystemExit(f"applying {mbit} mbit failed")
            samples: dict[str, list[float]] = {"up": [], "down": []}
            for _ in range(args.repeats):
                for row in verify_links(lab, links, duration_s=args.duration):
                    if row.measured_rate_bit_s is None:
                        raise SystemExit(f"measurement failed: {row.note}")
                    samples["up" if row.source == "device" else "down"].append(row.measured_rate_bit_s)
            for direction, values in samples.items():
                median = statistics.median(values)
                results.append(
                    {
                        "target_rate_mbit": mbit,
                        "direction": direction,
                        "measured_goodput_mbit_median": round(median / 1e6, 3),
                        "measured_goodput_mbit_all": [round(v / 1e6, 3) for v in values],
                        "ratio_measured_over_target": round(median / (mbit * 1e6), 4),
                        "within_10pct": abs(median / (mbit * 1e6) - 1) <= 0.10,
                    }
                )
                print(f"{mbit:>5g} mbit {direction:<4} {median / 1e6:8.3f} mbit  ratio {median / (mbit * 1e6):.3f}")
        clear_nodes(lab)
    payload = {
        "method": f"iperf3 TCP, {args.duration:g} s per run (first second omitted), {args.repeats} repeats, "
        "one direction at a time",
        "header_overhead_ratio": round(HEADER_RATIO, 4),
        "results": results,
        "all_within_10pct": all(r["within_10pct"] for r in results),
    }
    print(write(args.output, payload))


if __name__ == "__main__":
    main()
