"""``phone-governor-sync`` on an emulated phone: after a root command changed its cpufreq files, put the
phone in the power mode they now describe (its CPU quota and modeled power), as the governor and the
frequency cap would change what a real phone computes. A mode the inventory does not list leaves the
quota as it was (said on stderr)."""

import sys

from nodes.emulated.node import STANDIN_ROOT_VARIABLE, EmulatedNode
from nodes.emulated.phones import mode_of_policies, phone_named


def main() -> int:
    node = EmulatedNode.for_standin("phone-governor-sync: ")
    if node is None:
        return 1
    import os

    root = os.environ.get(STANDIN_ROOT_VARIABLE, "")
    name = mode_of_policies(root, phone_named(node.model))
    for mode in node.power_modes:
        if mode.name == name:
            if node.power_mode() != mode:
                node.set_power_mode(mode)
            return 0
    sys.stderr.write("phone-governor-sync: %s is none of the phone's power modes (%s); quota unchanged\n"
                     % (name, ", ".join(m.name for m in node.power_modes)))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
