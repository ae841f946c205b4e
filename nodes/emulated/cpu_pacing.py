"""``python -m nodes.emulated.cpu_pacing on --cpus N --period-ms P | off | show``: the CPU quota of an
emulated node while a run paces its steps to a compute profile.

A power mode's quota emulates a board's throughput with CFS's 100 ms period, which makes a short
step's latency bimodal (a throttled burst waits out the period). Under a target emulation the step's
time is the profile's, so the node gets a quota that never holds the real work back, in short periods
(``on``); ``off`` puts the power mode's quota back. Prints ``{"paced": ..., "cpus": ..., "period_ms":
...}``; the state lives beside the node's power mode (``cpu_pacing``), so ``off`` works after a crash.
"""

import argparse
import json
import sys
from typing import List, Optional

from nodes.emulated.node import EmulatedNode


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.emulated.cpu_pacing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("action", choices=("on", "off", "show"))
    parser.add_argument("--cpus", type=float, default=1.0, help="with on: CPUs' worth of time per period")
    parser.add_argument("--period-ms", type=float, default=10.0, help="with on: the CFS period")
    args = parser.parse_args(argv)
    node = EmulatedNode.for_standin("cpu_pacing: ")
    if node is None:
        return 1
    if args.action == "on":
        if args.cpus <= 0 or not 1.0 <= args.period_ms <= 1000.0:
            parser.error("--cpus must be > 0 and --period-ms between 1 and 1000")
        node.set_cpu_pacing(args.cpus, int(args.period_ms * 1000))
    elif args.action == "off":
        node.set_cpu_pacing(None)
    paced = node.cpu_pacing()
    print(json.dumps({"paced": paced is not None, "cpus": paced[0] if paced else None,
                      "period_ms": paced[1] / 1000 if paced else None}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
