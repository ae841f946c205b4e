"""How much of U-shape's TTFT prompt chunking could hide in a finished HAT campaign, and how much it did.

Pairs every request of the chunked method (pc, and sd_pc / hat, which chunk the same way) with the same
request (node, request id: one schedule per campaign) of U-shape, splits U-shape's TTFT into device,
network, server and the rest (:mod:`analysis.prefill_composition`), and writes the change in TTFT next to
the floor no chunk size can beat: U-shape's TTFT with all its device and server compute hidden.

    .venv/bin/python bench/hat_prefill_composition.py results/hat4-smollm2 \
        --out hat_prefill_composition      # bench/results/hat_prefill_composition.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis import prefill_composition
from analysis.load import load
from bench._common import write

# HAT Sec. 2.3, Fig. 1(b): a 2k-token prompt's U-shape TTFT on the paper's lab, and Table 5's PC row
PAPER = {"prompt_tokens": 2048, "ttft_s": 3.57, "device_s": 0.09, "server_s": 0.28, "network_s": 3.20,
         "network_share": 0.896, "table5_pc_ttft_change": -0.414}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("campaign", type=Path, help="a finished campaign directory with ushape and pc runs")
    parser.add_argument("--whole", default="ushape", help="the method that prefills whole prompts")
    parser.add_argument("--chunked", nargs="+", default=["pc", "sd_pc", "hat"], help="methods that chunk")
    parser.add_argument("--out", default="hat_prefill_composition", help="result name or .json path")
    args = parser.parse_args(argv)

    data = load(args.campaign)
    requests = data.requests.merge(data.runs[["run_id", "method"]], on="run_id")
    whole = requests[requests["method"] == args.whole]
    if whole.empty:
        parser.error(f"{args.campaign}: no {args.whole} run")
    per_method, per_request = {}, []
    for method in args.chunked:
        chunked = requests[requests["method"] == method]
        if chunked.empty:
            continue
        pairs = prefill_composition.chunked_against_whole(chunked, whole)
        per_method[method] = prefill_composition.summary(pairs)
        if method == args.chunked[0]:
            per_request = pairs.round(4).to_dict(orient="records")
    path = write(args.out, {
        "campaign": str(args.campaign),
        "whole": args.whole,
        "paper_fig1b_2k_prompt": PAPER,
        "by_method": per_method,
        f"{args.chunked[0]}_requests": per_request,
        "note": "floor_change: the TTFT change had chunking hidden all U-shape's compute behind the upload",
    })  # fmt: skip
    for method, row in per_method.items():
        shares = ", ".join(f"{part} {row[part + '_share_of_whole_ttft']:.0%}"
                           for part in ("network", "device", "server", "waiting"))  # fmt: skip
        print(f"{method}: TTFT {row['ttft_change']:+.1%} (floor {row['floor_change']:+.1%}, "
              f"{row['attainable_reached']:.0%} of the attainable gain); of U-shape's TTFT: {shares}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
