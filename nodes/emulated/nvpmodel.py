"""Stand-in for NVIDIA's ``nvpmodel`` on an emulated Jetson.

Supports ``-q [--verbose]`` (query), ``-m N`` (switch: changes the node's CPU quota) and
``-p --verbose`` (print the power modes), printing what the real tool prints on JetPack 5/6.
"""

import argparse
import sys
from typing import List, Optional

from nodes.emulated.node import EmulatedNode

CONF = "/etc/nvpmodel.conf"


def _query(node: EmulatedNode, verbose: bool) -> int:
    mode = node.power_mode()
    if mode is None:
        print("NVPM ERROR: no power mode is configured", file=sys.stderr)
        return 1
    if verbose:
        print("NVPM VERB: Config file: " + CONF)
        print("NVPM VERB: parsing done for " + CONF)
        print("NVPM VERB: Current mode: NV Power Mode: " + mode.name)
    else:
        print("NV Power Mode: " + mode.name)
    print(mode.id)
    if verbose:
        print("NVPM VERB: hil-testbed stand-in: CPU quota %g CPUs, modeled %g-%g W" % mode[2:5])
    return 0


def _print_modes(node: EmulatedNode) -> int:
    print("NVPM VERB: Config file: " + CONF)
    print("NVPM VERB: parsing done for " + CONF)
    print("succeed to parse file %s." % CONF)
    default = node.power_modes[0] if node.power_modes else None
    if default is not None:
        print("NVPM VERB: PM_CONFIG: DEFAULT=%s(%d)" % (default.name, default.id))
    for mode in node.power_modes:
        print("NVPM VERB: ")
        print("NVPM VERB: POWER_MODEL: ID=%d NAME=%s" % (mode.id, mode.name))
        print("NVPM VERB: CPU_QUOTA CPUS %g" % mode.cpus)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nvpmodel", description="hil-testbed stand-in for NVIDIA nvpmodel")
    parser.add_argument("-q", action="store_true", help="query the current power mode")
    parser.add_argument("-m", type=int, metavar="ID", help="switch to power mode ID")
    parser.add_argument("-p", action="store_true", help="print the power modes of the configuration")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    node = EmulatedNode.for_standin("NVPM ERROR: ")
    if node is None:
        return 1
    if args.m is not None:
        mode = node.mode_by_id(args.m)
        if mode is None:
            print("NVPM ERROR: request for bad power mode %d" % args.m)
            return 1
        node.set_power_mode(mode)
        return 0
    if args.p:
        return _print_modes(node)
    return _query(node, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
