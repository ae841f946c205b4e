"""Stand-in for NVIDIA's ``jetson_clocks`` on an emulated Jetson.

No option pins the clocks at their maximum; ``--show`` prints the clock state as the real script
does on JetPack 5; ``--store [file]`` and ``--restore [file]`` save and restore it (default
``~/l4t_dfs.conf``, ``sysfs_path:value`` lines). Pinning changes the frequencies reported, not the
modeled power, which follows the power mode and CPU utilisation.
"""

import argparse
import os
import sys
from typing import List, Optional

from nodes.emulated import boards
from nodes.emulated.node import (
    EmulatedNode,
    clocks_pinned,
    online_cores,
    set_clocks_pinned,
)

EMC_LOCK = "/sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked"


def _show(node: EmulatedNode) -> None:
    board = boards.board_for(node.model)
    mode = node.power_mode()
    online = online_cores(board.cpu_cores, node, mode)
    pinned = clocks_pinned(node)
    print("SOC family:%s  Machine:%s" % (board.soc, board.machine))
    print("Online CPUs: " + ("0" if online == 1 else "0-%d" % (online - 1)))
    # The real script lists cores in glob order: cpu0, cpu1, cpu10, cpu11, cpu2, ...
    for core in sorted(range(online), key=str):
        low = board.cpu_max_khz if pinned else board.cpu_min_khz
        idle = "WFI=0 c7=0" if pinned else "WFI=1 c7=1"
        print(
            "cpu%d: Online=1 Governor=schedutil MinFreq=%d MaxFreq=%d CurrentFreq=%d IdleStates: %s "
            % (core, low, board.cpu_max_khz, board.cpu_max_khz if pinned else low, idle)
        )
    gpu_low = board.gpu_max_hz if pinned else board.gpu_min_hz
    print("GPU MinFreq=%d MaxFreq=%d CurrentFreq=%d" % (gpu_low, board.gpu_max_hz, gpu_low))
    print(
        "EMC MinFreq=204000000 MaxFreq=%d CurrentFreq=%d FreqOverride=%d"
        % (board.emc_max_hz, board.emc_max_hz, 1 if pinned else 0)
    )
    print("FAN Dynamic Speed control=active hwmon2_pwm1=%d" % (255 if pinned else 55))
    print("NV Power Mode: " + (mode.name if mode else "unknown"))


def _store(node: EmulatedNode, path: str) -> int:
    if os.path.exists(path):
        sys.stdout.write("File %s already exists. Can I overwrite it? Y/N: " % path)
        sys.stdout.flush()
        if sys.stdin.readline().strip() not in ("y", "Y"):
            print("Error: file %s already exists!" % path)
            return 1
    with open(path, "w") as f:
        f.write("%s:%d\n" % (EMC_LOCK, 1 if clocks_pinned(node) else 0))
    return 0


def _restore(node: EmulatedNode, path: str) -> int:
    if not os.path.exists(path):
        print("Error: %s file not found !" % path)
        return 1
    with open(path) as f:
        for line in f:
            key, _, value = line.strip().rpartition(":")
            if key == EMC_LOCK:
                set_clocks_pinned(node, value == "1")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="jetson_clocks", description="hil-testbed stand-in for jetson_clocks")
    parser.add_argument("--show", action="store_true", help="show the current clock settings")
    parser.add_argument("--store", nargs="?", const="", metavar="FILE", help="store the clock settings")
    parser.add_argument("--restore", nargs="?", const="", metavar="FILE", help="restore stored settings")
    parser.add_argument("--fan", action="store_true", help="set the fan to maximum speed")
    args = parser.parse_args(argv)
    node = EmulatedNode.for_standin("Error: ")
    if node is None:
        return 1
    if node.mode == "netns" and os.geteuid() != 0:
        print("Error: Run this script(%s) as a root user" % sys.argv[0])
        return 1
    default_file = os.path.join(os.path.expanduser("~"), "l4t_dfs.conf")
    if args.show:
        _show(node)
        return 0
    if args.store is not None:
        return _store(node, args.store or default_file)
    if args.restore is not None:
        return _restore(node, args.restore or default_file)
    set_clocks_pinned(node, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
