"""``python3 -m nodes.power``: the node-side power command the controller runs (see
:mod:`nodes.power`)."""

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

from nodes.contracts.tool_errors import BAD_INPUT, NODE_FAILED, OK, error_answer
from nodes.power import driver_kinds, make_driver
from nodes.power.common import PowerError, PowerJournal, PowerState, PowerUsageError


def _state_json(state: Optional[PowerState]) -> Optional[Dict[str, Any]]:
    return None if state is None else dict(state._asdict())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nodes.power", description="power modes and clocks of this node")
    parser.add_argument("--kind", required=True, choices=driver_kinds())
    parser.add_argument("--journal", required=True, help="journal file (the state before the first change)")
    parser.add_argument("--sudo", action="store_true", help="run privileged tools with sudo -n")
    parser.add_argument("--serial", help="phone serial (android)")
    parser.add_argument("--adb", default="adb")
    sub = parser.add_subparsers(dest="action")
    sub.required = True
    sub.add_parser("show", help="current mode, clocks and the available modes")
    set_parser = sub.add_parser("set", help="set a mode (id or name) and read it back")
    set_parser.add_argument("mode")
    set_parser.add_argument("--lock-clocks", action="store_true", help="also lock clocks at the mode's maximum")
    set_parser.add_argument("--if-differs", action="store_true",
                            help="leave a node that is in the mode already alone (no journal)")  # fmt: skip
    sub.add_parser("restore", help="put back what the journal recorded, then drop the journal")
    args = parser.parse_args(argv)
    journal = PowerJournal(args.journal)
    try:
        driver = make_driver(args.kind, args.sudo, journal, args.serial, args.adb)
        result: Dict[str, Any] = {"kind": driver.kind}
        if args.action == "show":
            result.update(state=_state_json(driver.state()), modes=[m._asdict() for m in driver.modes()])
        elif args.action == "set":
            driver.check_mode(args.mode)  # a mode that cannot be set leaves no journal behind
            current = driver.state() if args.if_differs and not args.lock_clocks else None
            if current is not None and current.mode_id == driver.resolve(args.mode).id:
                result.update(state=_state_json(current), changed=False)
            else:
                journal.record_before_change(driver)
                state = driver.set_mode(args.mode)
                if args.lock_clocks:
                    state = driver.lock_clocks()
                result.update(state=_state_json(state), changed=True)
        else:
            result.update(restored=_state_json(journal.restore(driver)))
        result["journal"] = journal.read() is not None
    except PowerUsageError as exc:
        print(error_answer(exc))
        return BAD_INPUT
    except PowerError as exc:
        print(error_answer(exc))
        return NODE_FAILED
    print(json.dumps(result, sort_keys=True))
    return OK


if __name__ == "__main__":
    sys.exit(main())
