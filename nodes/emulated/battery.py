"""The battery of an emulated phone: ``python -m nodes.emulated.battery NODE_JSON STANDIN_ROOT``, started by
``testbed emulate up`` beside the phone's sshd. Every ``PERIOD_S`` it samples the phone's CPU use, takes the
modeled power of its power mode (P = P_idle + (P_busy - P_idle) u), and writes what the battery driver
would: the current it draws at the battery's voltage (negative: discharging, in microamperes), the
charge left and the capacity it makes, and a temperature that follows the power. The phone's readers
(``nodes/android/battery.py`` through adb) see the phone's getprop say it is a stand-in, and label the
data modeled. It ends when the phone's node file is gone (the testbed was taken down).
"""

import json
import os
import sys
import time

from nodes.emulated.node import EmulatedNode, UtilisationMeter, modeled_power_w
from nodes.emulated.phones import phone_named, write_battery

PERIOD_S = 0.1
START_CAPACITY_PCT = 80.0
AMBIENT_DC, DC_PER_W = 300, 15  # tenths of a degree: 30.0 C, and 1.5 C more a watt


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m nodes.emulated.battery NODE_JSON STANDIN_ROOT\n")
        return 2
    config_path, root = args
    with open(config_path) as handle:
        node = EmulatedNode(json.load(handle))
    phone = phone_named(node.model)
    meter = UtilisationMeter(node)
    charge_mah = phone.battery_mah * START_CAPACITY_PCT / 100.0
    last = time.monotonic()
    while os.path.exists(config_path):
        time.sleep(PERIOD_S)
        now = time.monotonic()
        mode = node.power_mode()
        _, utilisation = meter.sample()
        watts = modeled_power_w(mode, utilisation) if mode is not None else 0.0
        amps = watts / phone.nominal_v
        charge_mah = max(0.0, charge_mah - amps * 1000.0 * (now - last) / 3600.0)
        last = now
        try:
            write_battery(root, phone, current_ua=-int(amps * 1e6), capacity_pct=100.0 * charge_mah / phone.battery_mah,
                          temp_dc=int(AMBIENT_DC + DC_PER_W * watts))  # fmt: skip
        except OSError:
            break  # its files went away with the testbed
    return 0


if __name__ == "__main__":
    sys.exit(main())
