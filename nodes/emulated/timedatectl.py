"""Stand-in for systemd's ``timedatectl`` on an emulated node (any kind).

An emulated node keeps the controller's own clock (one kernel), so it is synchronised with the
controller by construction: ``System clock synchronized: yes`` unless the node's ``clock_sync`` file
says ``no`` (a test that plants an unsynchronised clock writes it). ``show`` prints the properties as
``Name=value`` lines (``-p NAME`` picks, ``--value`` drops the names), as systemd 245+ does; no
argument or ``status`` prints the status page. Setting anything is refused: nothing to set here.
"""

import argparse
import os
import sys
import time
from typing import Dict, List, Optional

from nodes.emulated.node import EmulatedNode

CLOCK_SYNC_FILE = "clock_sync"  # in the node's directory: "no" plants an unsynchronised clock


def synchronized(node: EmulatedNode) -> bool:
    path = os.path.join(os.path.dirname(node.power_mode_file), CLOCK_SYNC_FILE)
    try:
        with open(path) as f:
            return f.read().strip() != "no"
    except FileNotFoundError:
        return True


def properties(node: EmulatedNode) -> Dict[str, str]:
    synced = "yes" if synchronized(node) else "no"
    now = time.strftime("%a %Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return {"Timezone": "Etc/UTC", "LocalRTC": "no", "CanNTP": "yes", "NTP": synced,
            "NTPSynchronized": synced, "TimeUSec": now, "RTCTimeUSec": now}  # fmt: skip


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="timedatectl")
    parser.add_argument("command", nargs="?", default="status")
    parser.add_argument("args", nargs="*")
    parser.add_argument("-p", "--property", action="append", default=[])
    parser.add_argument("--value", action="store_true")
    options = parser.parse_args(argv)
    node = EmulatedNode.for_standin("timedatectl (stand-in): ")
    if node is None:
        return 1
    values = properties(node)
    if options.command == "show":
        wanted = [p for group in options.property for p in group.split(",")] or list(values)
        for name in wanted:
            if name in values:
                print(values[name] if options.value else "%s=%s" % (name, values[name]))
        return 0
    if options.command == "status":
        print("               Local time: %s" % values["TimeUSec"])
        print("           Universal time: %s" % values["TimeUSec"])
        print("                Time zone: Etc/UTC (UTC, +0000)")
        print("System clock synchronized: %s" % values["NTPSynchronized"])
        print("              NTP service: %s" % ("active" if values["NTP"] == "yes" else "inactive"))
        print("          RTC in local TZ: no")
        return 0
    sys.stderr.write("timedatectl (stand-in on %s): %s is not emulated; an emulated node keeps the "
                     "controller's clock\n" % (node.name, options.command))
    return 1


if __name__ == "__main__":
    sys.exit(main())
