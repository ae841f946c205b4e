"""How much of U-shape's TTFT prompt chunking could hide in a finished HAT campaign, and how much it did.

Pairs every request of a chunking method (pc, and sd_pc / hat, which chunk the same way) with the same
request (repetition, node, request id: one schedule per repetition) of U-shape in the group with the same
other settings (e.g. the same request rate), splits U-shape's TTFT into device, network, server and the
rest (:mod:`analysis.prefill_composition`), and writes the change in TTFT next to the floor no chunk size
can beat: U-shape's TTFT with all its device and server compute hidden. ``bench/hat_campaign.py`` adds
the same to a campaign it runs.

    .venv/bin/python bench/hat_prefill_composition.py results/hat4-smollm2 \\
        --out hat_prefill_composition      # bench/results/hat_prefill_composition.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis import prefill_composition
from analysis.comparison import baseline_group, settings_of
from bench._common import write

# HAT Sec. 2.3, Fig. 1(b): a 2k-token prompt's U-shape TTFT on the paper's lab, and Table 5's PC row
PAPER = {"prompt_tokens": 2048, "ttft_s": 3.57, "device_s": 0.09, "server_s": 0.28, "network_s": 3.20,
         "network_share": 0.896, "table5_pc_ttft_change": -0.414}  # fmt: skip
CHUNKED = ("pc", "sd_pc", "hat")


def by_group(out: Path, by: list[str], whole: str = "ushape",
             chunked: tuple[str, ...] = CHUNKED) -> list[dict[str, Any]]:  # fmt: skip
    """Per group of ``by`` (``method`` among them) whose method chunks: its settings, the ``whole`` group
    it is paired with (the same other settings) and :func:`analysis.prefill_composition.summary`."""
    from analysis.load import load

    data = load(out)
    runs = data.runs[data.runs["state"] == "done"] if "state" in data.runs else data.runs
    columns = ["run_id", *dict.fromkeys(c for c in ("repetition", *by) if c not in data.requests)]
    requests = data.requests.merge(runs[columns], on="run_id")
    if "completed" in requests:
        requests = requests[requests["completed"].astype(bool)]
    rows = []
    for values, part in requests.groupby(by, sort=True) if by else []:
        settings = settings_of(by, values)
        if settings.get("method") not in chunked:
            continue
        base, against = baseline_group(requests, by, settings, {"method": whole})
        if base.empty:
            continue
        pairs = prefill_composition.chunked_against_whole(part, base)
        rows.append({"settings": settings, "against": against, **prefill_composition.summary(pairs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("campaign", type=Path, help="a finished campaign directory with ushape and pc runs")
    parser.add_argument("--by", default="method", help="comma-separated run settings to group by (method first)")
    parser.add_argument("--whole", default="ushape", help="the method that prefills whole prompts")
    parser.add_argument("--chunked", nargs="+", default=list(CHUNKED), help="methods that chunk")
    parser.add_argument("--out", default="hat_prefill_composition", help="result name or .json path")
    args = parser.parse_args(argv)

    rows = by_group(args.campaign, args.by.split(","), args.whole, tuple(args.chunked))
    if not rows:
        parser.error(f"{args.campaign}: no {args.whole} run to pair a chunking method's with")
    path = write(args.out, {"campaign": str(args.campaign), "whole": args.whole, "paper_fig1b_2k_prompt": PAPER,
                            "prefill_composition": rows})  # fmt: skip
    for row in rows:
        shares = ", ".join(f"{part} {row[part + '_share_of_whole_ttft']:.0%}"
                           for part in ("network", "device", "server", "waiting"))  # fmt: skip
        print(f"{row['settings']}: TTFT {row['ttft_change']:+.1%} (floor {row['floor_change']:+.1%}, "
              f"{row['attainable_reached']:.0%} of the attainable gain); of U-shape's TTFT: {shares}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
