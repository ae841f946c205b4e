"""Stand-in for NVIDIA's ``tegrastats`` on an emulated Jetson.

Prints one line per ``--interval`` milliseconds in the JetPack 5 format of the board the node stands
for (timestamp, RAM, SWAP, CPU cores, engines, temperatures, power rails as ``NAME cur mW/avg mW``).
Rail power is modeled from the node's CPU utilisation in its current power mode (see
:func:`nodes.emulated.node.modeled_power_w`). The first line is a ``#`` comment saying so, which the
testbed's parser uses to label the data ``modeled``. ``--logfile F`` appends to F, ``--stop`` ends
every instance running on this node. It ends by itself when its node is torn down.
"""

import argparse
import contextlib
import os
import signal
import sys
import time
from typing import Dict, List, Optional, TextIO

from nodes.emulated import boards
from nodes.emulated.node import (
    EmulatedNode,
    UtilisationMeter,
    clocks_pinned,
    modeled_power_w,
    online_cores,
)

STANDIN_MARK = "# hil-testbed stand-in tegrastats: power rails are modeled, not measured"


def _instances_dir(node: EmulatedNode) -> str:
    return os.path.join(os.path.dirname(node.power_mode_file), "tegrastats")


def _ram_used_mb(total_mb: int) -> int:
    info: Dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0])
    used_mb = (info["MemTotal"] - info.get("MemAvailable", info["MemFree"])) // 1024
    return min(total_mb, used_mb)


class Line:
    """Builds successive tegrastats lines; rail averages run from the first sample, as on the board."""

    def __init__(self, node: EmulatedNode) -> None:
        self.node = node
        self.board = boards.board_for(node.model)
        self.meter = UtilisationMeter(node)
        self.samples = 0
        self.rail_sums = [0.0] * len(self.board.rails)

    def next(self) -> str:
        board, node = self.board, self.node
        _, utilisation = self.meter.sample()
        mode = node.power_mode()
        online = online_cores(board.cpu_cores, node, mode)
        pinned = clocks_pinned(node)
        freq_mhz = (
            board.cpu_max_khz // 1000
            if pinned
            else int((board.cpu_min_khz + (board.cpu_max_khz - board.cpu_min_khz) * utilisation) // 1000)
        )
        pct = round(utilisation * 100)
        cores = ["%d%%@%d" % (pct, freq_mhz)] * online + ["off"] * (board.cpu_cores - online)
        temps = " ".join(
            "%s@%sC" % (name, "-256" if t == -256 else ("%.3f" % (t + 15.0 * utilisation)).rstrip("0").rstrip("."))
            for name, t in board.temperatures
        )
        total_w = modeled_power_w(mode, utilisation) if mode else 0.0
        rails = []
        self.samples += 1
        for i, rail in enumerate(board.rails):
            mw = round(total_w * (1.0 if rail.total else rail.share) * 1000)
            self.rail_sums[i] += mw
            rails.append("%s %dmW/%dmW" % (rail.name, mw, round(self.rail_sums[i] / self.samples)))
        used = _ram_used_mb(board.ram_total_mb)
        return " ".join(
            [
                time.strftime("%m-%d-%Y %H:%M:%S"),
                "RAM %d/%dMB (lfb 1770x4MB) SWAP 0/%dMB (cached 0MB)" % (used, board.ram_total_mb, board.swap_total_mb),
                "CPU [%s]" % ",".join(cores),
                board.engines,
                temps,
                " ".join(rails),
            ]
        )


def _node_alive(node: EmulatedNode) -> bool:
    try:
        node.cpu_usage_s()
    except OSError:
        return False  # the node's cgroup is gone: the testbed was torn down
    pid = node.config.get("cpu_root_pid")
    return not pid or os.path.exists("/proc/%d" % int(pid))


def _stop_all(node: EmulatedNode) -> int:
    directory = _instances_dir(node)
    if not os.path.isdir(directory):
        return 0
    for entry in os.listdir(directory):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGTERM)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))
    return 0


def _run(node: EmulatedNode, interval_s: float, out: TextIO) -> int:
    directory = _instances_dir(node)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, str(os.getpid()))
    open(marker, "w").close()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    line = Line(node)
    try:
        out.write(STANDIN_MARK + "\n")
        out.flush()
        deadline = time.monotonic()
        while _node_alive(node):
            deadline += interval_s
            time.sleep(max(0.0, deadline - time.monotonic()))
            out.write(line.next() + "\n")
            out.flush()
    except BrokenPipeError:
        pass
    finally:
        if os.path.exists(marker):
            os.unlink(marker)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tegrastats", description="hil-testbed stand-in for NVIDIA tegrastats")
    parser.add_argument("--interval", type=int, default=1000, metavar="MS", help="sampling interval in ms")
    parser.add_argument("--logfile", metavar="FILE", help="write to FILE instead of standard output")
    parser.add_argument("--stop", action="store_true", help="stop every running tegrastats of this node")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    node = EmulatedNode.for_standin("Error: ")
    if node is None:
        return 1
    if args.stop:
        return _stop_all(node)
    if args.interval <= 0:
        print("Error: interval must be positive", file=sys.stderr)
        return 1
    if args.logfile:
        with open(args.logfile, "a") as f:
            return _run(node, args.interval / 1000.0, f)
    return _run(node, args.interval / 1000.0, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
