"""A stand-in ``adb`` on the USB host of emulated phones (hil-testbed): it speaks for the phones
``testbed emulate up`` attached to this node (``$TESTBED_ADB_DEVICES``: serial -> the phone's node, its
address, port and user, its model), in platform-tools' formats:

- ``adb devices [-l]``: the attached phones, ``device`` state, with product, model and device fields;
- ``adb -s SERIAL shell CMD...``: CMD run on the phone (its shell: ``nodes/emulated/phone_shell.sh``),
  carried there over ssh with the testbed's keys; its output and exit status are CMD's.

Anything else is refused with a message, as adb refuses what it does not know.
"""

import json
import os
import shlex
import sys
from typing import Dict, List

DEVICES_VARIABLE = "TESTBED_ADB_DEVICES"


def _devices() -> Dict[str, Dict[str, object]]:
    path = os.environ.get(DEVICES_VARIABLE)
    if not path or not os.path.exists(path):
        return {}
    with open(path) as handle:
        table = json.load(handle)
    node = ""
    config = os.environ.get("TESTBED_EMULATED_NODE")
    if config and os.path.exists(config):
        with open(config) as handle:
            node = str(json.load(handle).get("node", ""))
    return {serial: entry for serial, entry in table.items() if entry.get("usb_host") == node}


def main(argv: List[str]) -> int:
    devices = _devices()
    if argv[:1] == ["devices"]:
        print("List of devices attached")
        for number, (serial, entry) in enumerate(sorted(devices.items()), start=1):
            model = str(entry["product_model"]).replace(" ", "_")
            print("%-22s device usb:1-1.%d product:%s model:%s device:%s transport_id:%d"
                  % (serial, number, entry["codename"], model, entry["codename"], number))  # fmt: skip
        print()
        return 0
    if len(argv) >= 2 and argv[0] == "-s":
        serial, rest = argv[1], argv[2:]
        entry = devices.get(serial)
        if entry is None:
            sys.stderr.write("adb: device '%s' not found\n" % serial)
            return 1
        if rest[:1] != ["shell"] or len(rest) < 2:
            sys.stderr.write("adb: this stand-in knows only 'shell CMD' (no interactive shell)\n")
            return 1
        command = " ".join(rest[1:])  # as adb does: the words joined, the phone's shell parses them
        argv_ssh = [str(entry["ssh"]), "-p", str(entry["port"]), "%s@%s" % (entry["user"], entry["host"]),
                    "phone-shell " + shlex.quote(command)]  # fmt: skip
        try:
            os.execv(argv_ssh[0], argv_ssh)
        except OSError as exc:
            sys.stderr.write("adb: cannot reach %s (%s)\n" % (serial, exc))
            return 1
    sys.stderr.write("adb: this stand-in knows 'devices' and '-s SERIAL shell CMD'\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
