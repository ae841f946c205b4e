"""A HAT campaign as a reproduction's experiment: Table 5's or Fig. 6's methods with intervals, and where
U-shape's time to first token goes.

Runs bench/campaign_reproduction.py's ``run`` with the same arguments (the campaign on its emulated lab,
then per group of runs the mean TTFT and TBT and the paired changes against ``--baseline``, with
intervals), then adds ``prefill_composition``: per group of a method that chunks its prompt (PC, SD+PC,
HAT) against U-shape on the same requests, U-shape's TTFT split into upload, device and server compute
and the wait for a device slot, and the floor no chunk size beats (all the compute hidden behind the
upload; bench/hat_prefill_composition.py). A PC gain far below the paper's reads against that floor.

    python bench/hat_campaign.py examples/campaigns/hat-lab-4-table5-specbench-smollm2.yaml \\
        --baseline method=ushape

Writes bench/results/hat_campaign.json unless a reproduction names the file. Needs root.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import campaign_reproduction
from bench._common import write
from bench.hat_prefill_composition import PAPER, by_group

# bench/campaign_reproduction.py's options, under this script's name and description
PARSER = campaign_reproduction.argument_parser(f"bench/{Path(__file__).name}", __doc__)


def main() -> None:
    result = campaign_reproduction.run(sys.argv[1:], PARSER)
    result["prefill_composition"] = by_group(Path(result["work"]) / "out", list(result["by"]))
    result["paper_fig1b_2k_prompt"] = PAPER
    result["command"] = " ".join(["python", "bench/hat_campaign.py", *sys.argv[1:]])
    print(f"wrote {write('hat_campaign', result)}")


if __name__ == "__main__":
    main()
